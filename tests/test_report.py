"""The techniques report (train/benches/report.py): the verdict rule on hand-made numbers (and a test
that fails when the interval rule changes), a tiny run of the report's cheaper measurements (each
row must come from a measurement and carry the verdict the rule gives its numbers), and the same
checks on the committed report of this machine (docs/report/report.json), which covers every
measurement."""
import json
import math
import re
from pathlib import Path

import pytest

from train.benches import harness, report

ROOT = Path(__file__).resolve().parents[1]

# the measurements cheap enough for the suite (the others train or start processes for minutes);
# together they give paired speed-ups, optimizer-state memory and a loop-run quality row; the committed
# report (the last test) holds every measurement, the memory peaks and the equality row among them
TINY = ["fused", "optimizers", "channels-last", "taesd", "averaging", "cuda-flags"]
# the rows re-designed to measure their claim's own quantity (slow: loop runs and measured peaks)
REDESIGNED = ["precision", "min-snr", "stochastic-depth", "moe"]
SEEDS = ROOT.parent / "shared" / "seeds"   # the source notes, where this checkout has them


def judged(samples, evidence, threshold, kind="gain", unmeasured=""):
    est, iv, why = report.estimate(samples, evidence)
    return report.verdict(est, iv, threshold, kind, why, unmeasured)


@pytest.mark.parametrize("samples, evidence, threshold, expected", [
    ([0.12, 0.15, 0.11], "seeds", 0.10, "holds"),          # interval above zero, mean 0.127 >= 0.10
    ([0.04, 0.06, 0.05], "seeds", 0.10, "partly"),         # above zero, short of the claim
    ([-0.04, -0.06, -0.05], "seeds", 0.01, "does not hold"),
    ([0.05, -0.04, 0.01], "seeds", 0.01, "inconclusive"),  # straddles zero, though the mean is 0.0067
    ([0.20, -0.01, 0.21], "seeds", 0.01, "inconclusive"),  # mean 0.13 meets the claim, the interval does not exclude 0
    ([0.3], "seeds", 0.01, "no verdict: one seed"),
    ([0.3, 0.31], "seeds", 0.01, "no verdict: 2 seeds (at least 3 needed)"),
    ([0.3], "repeats", 0.01, "no verdict: one measurement"),
    ([0.5], "exact", 1.0, "partly"),                       # "stateless" at 50% of Adam's state saved
    ([1.0], "exact", 1.0, "holds"),                        # zero state
    ([0.0], "exact", 0.1, "does not hold"),                # exactly no effect
    ([0.5], "exact", 0.5, "holds"),
    ([0.1, 0.2, 0.3, 0.4, 0.5, 0.6], "rounds", 0.1, "holds"),         # 6 rounds: the full range, 96.9%
    ([-0.1, 0.2, 0.3, 0.4, 0.5, 0.6], "rounds", 0.1, "inconclusive"),
    ([0.1, 0.2, 0.3, 0.4, 0.5], "rounds", 0.1, "no verdict: 5 rounds: too few for a 95% interval"),
])
def test_verdict_rule_on_constructed_numbers(samples, evidence, threshold, expected):
    assert judged(samples, evidence, threshold) == expected


def test_unmeasured_part_of_a_claim_caps_at_partly_and_equalities():
    assert judged([11.0], "exact", 11.0, unmeasured="the cost") == "partly"
    assert judged([4e-7], "exact", 1e-5, "equal") == "holds"
    assert judged([2e-4], "exact", 1e-5, "equal") == "does not hold"
    assert judged([1e-6, 3e-5, 2e-6], "seeds", 1e-5, "equal") == "inconclusive"
    assert report.verdict(None, None, 0.1) == "skipped"


def test_interval_arithmetic_against_direct_computation():
    """t interval: mean +- t(0.975, n-1) s / sqrt(n), with t checked by a Monte-Carlo tail (independent of scipy,
    which computes it); rounds: order statistics."""
    import random
    import statistics
    xs = [0.12, 0.15, 0.11]
    est, (lo, hi), why = report.estimate(xs, "seeds")
    t = (hi - est) * math.sqrt(3) / statistics.stdev(xs)
    rng = random.Random(0)
    draws = [rng.gauss(0, 1) / math.sqrt((rng.gauss(0, 1) ** 2 + rng.gauss(0, 1) ** 2) / 2) for _ in range(40000)]
    assert sum(abs(d) > t for d in draws) / len(draws) == pytest.approx(0.05, abs=0.006)
    assert est == pytest.approx(statistics.fmean(xs)) and not why
    assert hi - est == pytest.approx(est - lo)
    assert harness.median_rank(6) == 1 and harness.median_rank(5) is None
    k = harness.median_rank(20)
    cover = lambda k: 1 - 2 * sum(math.comb(20, i) for i in range(k)) / 2 ** 20
    assert cover(k) >= 0.95 > cover(k + 1)
    assert report.estimate(list(range(20)), "rounds")[1] == (k - 1, 20 - k)


def test_the_interval_rule_is_95_percent_student_t_and_order_statistics():
    """Fails when the rule changes: the level, the t quantile (Student's t with n - 1 degrees of freedom, not a
    normal one), the minimum of seeds, or the order statistic of the rounds' interval."""
    assert report.CONFIDENCE == 0.95 and report.MIN_SEEDS == 3
    xs = [1.0, 2.0, 4.0]  # mean 7/3, s = sqrt(7/3); t(0.975, 2) = 4.302652729911275
    est, (lo, hi), _ = report.estimate(xs, "seeds")
    assert est == pytest.approx(7 / 3) and hi - est == pytest.approx(4.302652729911275 * math.sqrt(7 / 3) / math.sqrt(3))
    assert report.estimate(xs[:2], "seeds")[1] is None  # two seeds: no interval
    assert report.estimate([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8], "rounds")[1] == (0.1, 0.8)  # 8 rounds: k = 1
    assert report.estimate(list(range(1, 12)), "repeats")[1] is not None
    # the verdict turns exactly where the interval's lower end crosses zero
    assert report.verdict(0.5, (1e-9, 1.0), 0.1) == "holds" and report.verdict(0.5, (-1e-9, 1.0), 0.1) == "inconclusive"
    assert report.verdict(0.05, (0.01, 0.09), 0.1) == "partly" and report.verdict(-0.5, (-1.0, -1e-9), 0.1) == "does not hold"


def test_verdict_rule_rejects_meaningless_claims():
    for bad in ((0.1, (0.0, 0.2), 0.0, "gain"), (0.1, (0.0, 0.2), -1.0, "gain"), (0.1, (0.0, 0.2), 0.0, "equal"),
                (0.1, (0.0, 0.2), 1.0, "other")):
        with pytest.raises(ValueError):
            report.verdict(*bad)
    with pytest.raises(ValueError):
        report.estimate([0.1, 0.2], "exact")
    with pytest.raises(ValueError):
        report.estimate([0.1], "guess")


def test_others_share_counts_other_processes_not_the_report():
    """The 'shared' line: CPU time of the whole machine minus the report's own, over wall x cores."""
    assert harness.others_share((0.0, 100.0, 10.0), (10.0, 130.0, 20.0), 2) == pytest.approx(1.0)
    assert harness.others_share((0.0, 100.0, 10.0), (10.0, 110.0, 20.0), 2) == 0.0  # only the report ran
    assert harness.others_share((0.0, None, 0.0), (1.0, 5.0, 1.0), 2) is None
    if harness.busy_cpu_s() is None:
        pytest.skip("no /proc/stat here")
    import subprocess, sys
    busy0, own0 = harness.busy_cpu_s(), harness.own_cpu_s()
    burn = "import time\nt=time.process_time()\nwhile time.process_time()-t<1.0: pass"
    subprocess.run([sys.executable, "-c", burn], check=True)   # a child: counted in the report's own CPU time
    d_busy, d_own = harness.busy_cpu_s() - busy0, harness.own_cpu_s() - own0
    assert d_own >= 1.0
    assert d_busy >= 0.9 * d_own   # the machine's busy time (parsed from /proc/stat) holds the child's second


def check_rows(rows: list[dict], measurements: list[str], cuda: bool, fp16: bool = True):
    """Every measurement gave rows; every row not skipped for a named hardware reason (no CUDA; no fp16
    kernels) holds finite measured numbers, and the interval, verdict and ratio the rule gives them: no
    verdict from one seed or one measurement, nor without an interval."""
    assert {r["measurement"] for r in rows} == set(measurements)
    for r in rows:
        name = r["technique"]
        if r["verdict"] == "skipped":
            assert ((r["measurement"] == "cuda-flags" and not cuda and "no CUDA" in r["reason"])
                    or (r["measurement"] == "precision" and not fp16 and "no fp16" in r["reason"])), (name, r["reason"])
            continue
        assert r["effect"] is not None and math.isfinite(r["effect"]), name
        assert r["numbers"], f"{name}: no measured numbers"
        leaves = [v for v in r["numbers"].values() if isinstance(v, (int, float))]
        leaves += [v for d in r["numbers"].values() if isinstance(d, dict) for v in d.values()
                   if isinstance(v, (int, float))]
        assert leaves and all(math.isfinite(v) for v in leaves), name
        assert r["threshold"] > 0 and r["evidence"] in report.EVIDENCE, name
        if r["samples"]:   # the estimate and interval are the rule's, from the stored samples
            est, iv, why = report.estimate(r["samples"], r["evidence"])
            assert r["effect"] == pytest.approx(est) and r["n"] == len(r["samples"]), name
            assert r["interval"] == (None if iv is None else pytest.approx(list(iv))) and r["missing"] == why, name
        elif r["interval"] is not None:   # a re-judged speed row: the range of its stored paired rounds
            n = r["numbers"]
            assert r["evidence"] == "rounds" and harness.median_rank(n["rounds"]) is not None, name
            assert r["interval"] == pytest.approx([v - 1 for v in n["round_range"]]), name
            assert n["round_range"][0] - 0.01 <= r["effect"] + 1 <= n["round_range"][1] + 0.01, name
        if r["interval"] is None:
            assert r["verdict"].startswith("no verdict: ") and r["missing"], name
        if r["evidence"] in ("seeds", "repeats") and r["n"] < report.MIN_SEEDS:
            assert r["verdict"].startswith("no verdict: "), f"{name}: a verdict from {r['n']} {r['evidence']}"
        assert r["verdict"] == report.verdict(r["effect"], r["interval"], r["threshold"], r["kind"], r["missing"],
                                              r["unmeasured"]), name
        assert r["ratio"] == pytest.approx(r["effect"] / r["threshold"]), name
        n = r["numbers"]
        if r["metric"] == "speed-up - 1" and "speedup" in n:   # the effect is the measured number, not typed in
            assert r["effect"] == pytest.approx(n["speedup"] - 1), name
        if r["metric"] == "memory saved" and "tech_peak" in n:   # a re-judged row: one measurement each
            assert r["effect"] == pytest.approx(1 - n["tech_peak"] / n["base_peak"]), name
        if r["metric"] == "memory saved" and "tech_peaks" in n:   # repeats, paired in turn
            assert r["samples"] == pytest.approx([1 - t / b for b, t in zip(n["base_peaks"], n["tech_peaks"])]), name
        if r["metric"] == "memory saved" and "tech_bytes" in n:
            assert r["effect"] == pytest.approx(1 - n["tech_bytes"] / n["base_bytes"]), name


def check_page(out: Path, rows: list[dict]):
    page = (out / "report.md").read_text()
    for key in ("CPU:", "torch ", "transformers ", "## The verdict rule", report.RULE):
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
    by = {r["technique"]: r for r in data["rows"]}
    avg = by["checkpoint averaging"]   # three seeds: a t interval from the per-seed effects
    assert avg["n"] == report.MIN_SEEDS and avg["interval"] is not None and len(avg["numbers"]["val_loss"]) == 3
    assert avg["numbers"]["average_last"] == 4 and "weighted" in avg["source"]   # the note's weighted average
    assert by["fused AdamW"]["verdict"] == "no verdict: 2 rounds: too few for a 95% interval"
    assert by["lion (state memory)"]["verdict"] == "partly"   # stateless claimed, one momentum buffer measured


def test_redesigned_rows_measure_their_claims_quantity(tmp_path, one_thread):
    """fp16 speed skipped where the hardware has no fp16 kernels; memory with the activations' share stated;
    Min-SNR judged by its samples' Frechet distance; stochastic depth on the deep net at the note's rates;
    MoE at equal training FLOPs."""
    import torch
    from train.benches.checkpointing import fp16_missing
    from train.step import resolve_device
    no_fp16 = fp16_missing(resolve_device("auto"))
    report.run_report(tmp_path, report.SCALES["test"], only=REDESIGNED, say=lambda m: None)
    rows = json.loads((tmp_path / "report.json").read_text())["rows"]
    check_rows(rows, REDESIGNED, torch.cuda.is_available(), fp16=not no_fp16)
    by = {r["technique"]: r for r in rows}
    assert (by["fp16 autocast + GradScaler (speed)"]["verdict"] == "skipped") == bool(no_fp16)
    for p in ("bf16 autocast", "fp16 autocast + GradScaler"):
        mem = by[f"{p} (memory)"]
        assert 0 < mem["numbers"]["activation_share"] < 1 and "of fp32's peak" in mem["memory"], p
    snr = by["Min-SNR-gamma weighting"]
    ps = snr["numbers"]["per_seed"]
    assert snr["samples"] == pytest.approx([(p["uniform fd"] - p["gamma=5 fd"]) / p["uniform fd"] for p in ps])
    sd, layers = by["stochastic depth (quality)"], report.SCALES["test"].sd_layers
    assert f"{2 * sum(layers) + 2}-layer ResNet" in sd["quality"] and sd["unmeasured"]
    for p in by["MoE (equal compute)"]["numbers"]["per_seed"]:   # steps x FLOPs per token: equal within a step's
        steps, fpt = p["steps"], p["flops_per_token"]
        assert abs(steps["moe"] * fpt["moe"] - steps["dense"] * fpt["dense"]) <= fpt["moe"], p


def test_every_claim_quotes_its_notes_words():
    """Each claim cites the words of the note it tests (NNN: "words"; "more words"), found verbatim in that note
    (whitespace aside; " ... " joins fragments), or says it is Zoo's own."""
    if not SEEDS.is_dir():
        pytest.skip(f"{SEEDS}: the source notes are not in this checkout")
    text = {p.name[:3]: " ".join(p.read_text().split()) for p in SEEDS.glob("[0-9][0-9][0-9]_*.txt")}
    for key, (_, cite, *_) in report.CLAIMS.items():
        parts = re.findall(r'(\d{3}):|"([^"]*)"', cite)
        assert any(q for _, q in parts) and (parts[0][0] or cite.startswith(report.OWN)), (key, cite)
        seed = None
        for number, quote in parts:
            seed = number or seed
            for fragment in filter(None, quote.split(" ... ")):
                assert " ".join(fragment.split()) in text[seed], (key, seed, fragment)


def test_committed_report_covers_every_measurement():
    """docs/report: the report of this machine, as the README links it."""
    out = ROOT / "docs" / "report"
    data = json.loads((out / "report.json").read_text())
    gpu = data["hardware"]["gpu"] is not None   # a CPU report may skip fp16 speed, for the reason it names
    check_rows(data["rows"], list(report.MEASUREMENTS), gpu, fp16=gpu)
    check_page(out, data["rows"])
    accum = next(r for r in data["rows"] if r["kind"] == "equal")  # gradient accumulation: the measured difference
    assert accum["effect"] == accum["numbers"]["max_rel_grad_diff"]
