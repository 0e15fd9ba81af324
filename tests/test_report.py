"""The techniques report (train/benches/report.py): the verdict rule on hand-made numbers, a tiny
run of the report's cheaper measurements (each row must come from a measurement and carry the
verdict the rule gives its numbers), and the same checks on the committed report of this machine
(docs/report/report.json), which covers every measurement."""
import json
import math
import re
from pathlib import Path

import pytest

from train.benches import report

ROOT = Path(__file__).resolve().parents[1]

# the measurements cheap enough for the suite (the others train or start processes for minutes);
# together they give paired speed-ups, optimizer-state memory and a loop-run quality row; the committed
# report (the last test) holds every measurement, the memory peaks and the equality row among them
TINY = ["fused", "optimizers", "channels-last", "taesd", "averaging", "cuda-flags"]


@pytest.mark.parametrize("effect, claimed, kind, expected", [
    (1.0, 1.0, "gain", "holds"),
    (0.5, 1.0, "gain", "holds"),            # exactly half the claim
    (0.49, 1.0, "gain", "partly"),
    (0.001, 0.1, "gain", "partly"),
    (0.0, 0.1, "gain", "does not hold here"),
    (-0.3, 0.75, "gain", "does not hold here"),
    (3.0, 0.1, "gain", "holds"),
    (None, 0.1, "gain", "skipped"),
    (float("nan"), 0.1, "gain", "skipped"),
    (float("inf"), 0.1, "gain", "skipped"),
    (1e-6, 1e-5, "equal", "holds"),
    (-1e-5, 1e-5, "equal", "holds"),
    (5e-5, 1e-5, "equal", "partly"),
    (2e-4, 1e-5, "equal", "does not hold here"),
])
def test_verdict_rule(effect, claimed, kind, expected):
    assert report.verdict(effect, claimed, kind) == expected


def test_verdict_rule_rejects_meaningless_claims():
    for bad in ((0.1, 0.0, "gain"), (0.1, -1.0, "gain"), (0.1, 0.0, "equal"), (0.1, 1.0, "other")):
        with pytest.raises(ValueError):
            report.verdict(*bad)


def test_others_share_counts_other_processes_not_the_report():
    """The 'shared' line: CPU time of the whole machine minus the report's own, over wall x cores."""
    assert report.others_share((0.0, 100.0, 10.0), (10.0, 130.0, 20.0), 2) == pytest.approx(1.0)
    assert report.others_share((0.0, 100.0, 10.0), (10.0, 110.0, 20.0), 2) == 0.0  # only the report ran
    assert report.others_share((0.0, None, 0.0), (1.0, 5.0, 1.0), 2) is None
    if report.busy_cpu_s() is None:
        pytest.skip("no /proc/stat here")
    import subprocess, sys
    busy0, own0 = report.busy_cpu_s(), report.own_cpu_s()
    burn = "import time\nt=time.process_time()\nwhile time.process_time()-t<1.0: pass"
    subprocess.run([sys.executable, "-c", burn], check=True)   # a child: counted in the report's own CPU time
    d_busy, d_own = report.busy_cpu_s() - busy0, report.own_cpu_s() - own0
    assert d_own >= 1.0
    assert d_busy >= 0.9 * d_own   # the machine's busy time (parsed from /proc/stat) holds the child's second


def check_rows(rows: list[dict], measurements: list[str], cuda: bool):
    """Every measurement gave rows; every row not skipped for a named hardware reason holds finite
    measured numbers and the verdict and ratio the rule gives them."""
    assert {r["measurement"] for r in rows} == set(measurements)
    for r in rows:
        name = r["technique"]
        if r["verdict"] == "skipped":
            assert r["measurement"] == "cuda-flags" and not cuda and "no CUDA" in r["reason"], (name, r["reason"])
            continue
        assert r["effect"] is not None and math.isfinite(r["effect"]), name
        assert r["numbers"], f"{name}: no measured numbers"
        leaves = [v for v in r["numbers"].values() if isinstance(v, (int, float))]
        leaves += [v for d in r["numbers"].values() if isinstance(d, dict) for v in d.values()
                   if isinstance(v, (int, float))]
        assert leaves and all(math.isfinite(v) for v in leaves), name
        assert r["verdict"] == report.verdict(r["effect"], r["claimed"], r["kind"]), name
        assert r["ratio"] == pytest.approx(r["effect"] / r["claimed"]), name
        n = r["numbers"]
        if r["metric"] == "speed-up - 1" and "speedup" in n:   # the effect is the measured number, not typed in
            assert r["effect"] == pytest.approx(n["speedup"] - 1), name
        if r["metric"] == "memory saved" and "tech_peak" in n:
            assert r["effect"] == pytest.approx(1 - n["tech_peak"] / n["base_peak"]), name
        if r["metric"] == "memory saved" and "tech_bytes" in n:
            assert r["effect"] == pytest.approx(1 - n["tech_bytes"] / n["base_bytes"]), name


def check_page(out: Path, rows: list[dict]):
    page = (out / "report.md").read_text()
    for key in ("CPU:", "torch ", "transformers ", "## The verdict rule", "holds"):
        assert key in page
    for r in rows:
        assert f"| {r['technique']} |" in page
        assert re.search(re.escape(f"**{r['verdict']}") + r"[*:]", page), r["technique"]
    pngs = re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", page)
    assert "speed.png" in pngs and "memory.png" in pngs
    for png in pngs:
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png


def test_tiny_report_rows_come_from_measurements(tmp_path, one_thread):
    import torch
    rows, page = report.run_report(tmp_path, report.SCALES["test"], only=TINY, say=lambda m: None)
    data = json.loads((tmp_path / "report.json").read_text())
    assert len(data["rows"]) == len(rows) >= len(TINY)
    check_rows(data["rows"], TINY, torch.cuda.is_available())
    check_page(tmp_path, data["rows"])
    assert "averaging_loss.png" in (tmp_path / "report.md").read_text()


def test_committed_report_covers_every_measurement():
    """docs/report: the report of this machine, as the README links it."""
    out = ROOT / "docs" / "report"
    data = json.loads((out / "report.json").read_text())
    check_rows(data["rows"], list(report.MEASUREMENTS), data["hardware"]["gpu"] is not None)
    check_page(out, data["rows"])
    accum = next(r for r in data["rows"] if r["kind"] == "equal")  # gradient accumulation: the measured difference
    assert accum["effect"] == accum["numbers"]["max_rel_grad_diff"]
