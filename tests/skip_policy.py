"""The test suite's skip policy, a pytest plugin (loaded by conftest.py): a test may skip only for
a reason on the allow-list below, checked when the run ends. Any other skip (above all a parity
test whose reference library fails to import although the `test` extra installs it) fails the
run with the list of offending tests, so a broken import can never turn parity checks into a
green run of skips."""
import re

import pytest

ALLOWED_SKIPS = {  # pattern of the skip reason -> why such a skip is acceptable
    r"shared.*not beside": "../shared (real data and weights) is optional beside a checkout",
    r"CUDA": "GPU tests run on machines with a GPU",
    r"flash-attn": "flash-attn is an optional CUDA-only extra built from source",
    r"needs Linux|/proc": "resident-memory and allocator checks read Linux's /proc and glibc",
    r"needs torch >=": "features of newer torch releases than the oldest supported",
}

_skipped = []


def pytest_runtest_logreport(report):
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reason = reason.removeprefix("Skipped: ")
        _skipped.append((report.nodeid, reason))


def disallowed(skips):
    """The (test, reason) pairs whose reason matches no pattern of ALLOWED_SKIPS."""
    return [(t, r) for t, r in skips if not any(re.search(p, r) for p in ALLOWED_SKIPS)]


def pytest_sessionfinish(session, exitstatus):
    bad = disallowed(_skipped)
    if bad:
        rep = session.config.pluginmanager.get_plugin("terminalreporter")
        lines = [f"{len(bad)} test(s) skipped for a reason not on the allow-list (tests/skip_policy.py):"]
        lines += [f"  {t}: {r}" for t, r in bad]
        if rep is not None:
            rep.write_line("")
            rep.write_line("\n".join(lines), red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
