"""Flakiness check of the whole suite (not collected by pytest: run it by hand).

    python tests/soak_suite.py --runs 3 [--neighbour-run 3] [--keep] [-- PYTEST ARGS]

Runs the README's test command (`python -m pytest -q -n 2 --dist loadfile`, or the pytest arguments given
after `--`, e.g. `-- -m slow`) `--runs` times, each in a fresh clone of this checkout's HEAD (uncommitted
changes are not in it) made beside the checkout, so that it sees the same ../shared, and lists every test
that failed in any run. During run `--neighbour-run` (default:
the last; 0: none) a busy neighbour shares the machine: a process multiplying 2-thread fp32 matrices in a
loop. The clone's own zoo/ and train/ are imported (PYTHONPATH), so the installed package is left alone.
Exit code: 0 when every test passed in every run, 1 otherwise.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README_TESTS = ["-q", "-n", "2", "--dist", "loadfile"]
NEIGHBOUR = ("import torch\ntorch.set_num_threads(2)\na = torch.randn(1024, 1024)\n"
             "while True:\n    a = (a @ a).clamp_(-1, 1)\n")


def run_suite(clone: Path, pytest_args: list, report: Path) -> tuple[int, float]:
    env = {**os.environ, "PYTHONPATH": str(clone), "PYTHONUNBUFFERED": "1", "MPLBACKEND": "Agg"}
    t0 = time.monotonic()
    code = subprocess.run([sys.executable, "-m", "pytest", *pytest_args, "-p", "no:cacheprovider",
                           f"--junitxml={report}"], cwd=clone, env=env).returncode
    return code, time.monotonic() - t0


def failures(report: Path) -> list[str]:
    """The ids of the tests a junit report names as failed or in error."""
    if not report.is_file():
        return ["(no report: pytest did not finish)"]
    out = []
    for case in ET.parse(report).iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            out.append(f"{case.get('classname')}::{case.get('name')}")
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    pytest_args = argv[argv.index("--") + 1:] if "--" in argv else README_TESTS
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3, help="fresh clones, one suite run each")
    ap.add_argument("--neighbour-run", type=int, default=None, help="the run (from 1) beside a busy neighbour "
                                                                    "(default: the last; 0: none)")
    ap.add_argument("--keep", action="store_true", help="keep the clones (beside the checkout) and their reports")
    a = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    busy = a.runs if a.neighbour_run is None else a.neighbour_run
    work = Path(tempfile.mkdtemp(prefix="zoo-soak-suite-"))
    failed: dict[str, list[int]] = {}
    for i in range(1, a.runs + 1):
        clone = ROOT.parent / f".{ROOT.name}-soak-{os.getpid()}-{i}"
        subprocess.run(["git", "clone", "-q", "--no-hardlinks", str(ROOT), str(clone)], check=True)
        neighbour = subprocess.Popen([sys.executable, "-c", NEIGHBOUR]) if i == busy else None
        try:
            code, secs = run_suite(clone, pytest_args, work / f"report-{i}.xml")
        finally:
            if neighbour is not None:
                neighbour.kill()
                neighbour.wait()
        names = failures(work / f"report-{i}.xml") if code else []
        print(f"run {i}/{a.runs}{' (beside a busy neighbour)' if neighbour else ''}: exit {code}, "
              f"{secs / 60:.1f} min, {len(names)} failed", flush=True)
        for n in names:
            failed.setdefault(n, []).append(i)
        if not a.keep:
            subprocess.run(["rm", "-rf", str(clone)], check=True)
    for name, runs in sorted(failed.items()):
        print(f"FAILED in run(s) {', '.join(map(str, runs))}: {name}")
    print("every test passed in every run" if not failed else f"{len(failed)} test(s) failed at least once")
    print(f"junit reports: {work}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
