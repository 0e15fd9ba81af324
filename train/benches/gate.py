"""The speed gate: the paired ratios that matter, at short settings, against the ratios committed.

    python train/bench.py gate             # every check (a few minutes); exit 1 when one falls
    python train/bench.py gate --update    # ... and commit the ratios measured to docs/results/gate.json
    python train/bench.py gate --rehearse  # tiny shapes, one round: the plumbing only, nothing judged

Each check runs a benchmark's sides at short settings (the benchmark itself, its JSON read back) and takes
the median over rounds of the paired ratio, the reference's time over Zoo's (above 1: Zoo is faster). A check
fails when its ratio falls below the committed one by more than its own noise: the distance from its median
to the lower quartile of its per-round ratios. Run it before resolving a change to zoo/blocks/, zoo/llm.py or
train/step.py.
"""
from __future__ import annotations

import json
import statistics
import sys
import tempfile
from functools import reduce
from pathlib import Path

from train.benches import harness

SHORT = ["--rounds", "6", "--seq", "256", "--batch", "2", "--n-layers", "4", "--vocab", "8192"]
TINY = ["--rounds", "1", "--seq", "32", "--batch", "1", "--n-layers", "1", "--d-model", "64", "--n-heads", "2",
        "--n-kv-heads", "1", "--vocab", "256"]
# check -> (bench argv, short options, tiny options, the path to Zoo's round times, to the reference's)
CHECKS = {
    "dense-train-compiled": (["llm-train", "--precision", "bf16", "--modes", "compile"], SHORT, TINY,
                                 ("training bf16", "wall", "zoo-compile"), ("training bf16", "wall", "transformers-compile")),
    "dense-train-eager": (["llm-train", "--precision", "bf16", "--modes", "eager"], SHORT, TINY,
                              ("training bf16", "wall", "zoo-eager"), ("training bf16", "wall", "transformers-eager")),
    "moe-train-compiled": (["llm-moe", "--modes", "compile", "--new-tokens", "0"], SHORT, TINY + ["--experts", "4"],
                               ("training bf16", "wall", "zoo-compile"), ("training bf16", "wall", "tf-grouped_mm-compile")),
    "moe-train-eager": (["llm-moe", "--modes", "eager", "--new-tokens", "0"], SHORT, TINY + ["--experts", "4"],
                            ("training bf16", "wall", "zoo-eager"), ("training bf16", "wall", "tf-grouped_mm-eager")),
    "decode-eager-fp32": (["llm-generate", "--precision", "fp32", "--modes", "eager", "--load-rounds", "0"],
                             ["--rounds", "6", "--new-tokens", "32"], TINY[:2] + TINY[6:] + ["--new-tokens", "4"],
                             ("decoding fp32", "wall", "zoo-eager"), ("decoding fp32", "wall", "transformers-eager")),
    "rollout-eager": (["rollout", "--modes", "eager"], ["--rounds", "6", "--prompts", "2", "--group", "4"],
                           ["--rounds", "1", "--prompts", "1", "--group", "2", "--new-tokens", "2"],
                           ("bf16", "zoo-eager", "wall"), ("bf16", "transformers-eager", "wall")),
    "data-prepare": (["data", "--only", "speed", "--forms", "jsonl"], ["--rounds", "6", "--mb", "2"],
                     ["--rounds", "1", "--mb", "1"], ("speed", "jsonl", "sentencepiece", "zoo prepare", "wall_s"),
                     ("speed", "jsonl", "sentencepiece", "tokenizer alone", "wall_s")),
}
GATE = harness.RESULTS / "gate.json"


def measure(check: str, rehearse: bool, threads) -> dict:
    """Run one check's benchmark: {'ratio': the paired median, 'noise': median - lower quartile}."""
    from train import bench
    argv, short, tiny, ours, ref = CHECKS[check]
    with tempfile.TemporaryDirectory() as d:
        out, extra = Path(d) / "result.json", ["--threads", str(threads)] if threads else []
        if bench.main([*argv, *(tiny if rehearse else short), *extra, "--json", str(out)]):
            raise RuntimeError(f"gate: the benchmark of {check!r} failed")
        data = json.loads(out.read_text())["data"]
    r = [b / a for a, b in zip(*(reduce(lambda d, key: d[key], path, data) for path in (ours, ref)))]
    median = statistics.median(r)
    low = statistics.quantiles(r, n=4)[0] if len(r) > 1 else median
    return {"ratio": median, "noise": max(0.0, median - low)}


def falls(now: dict, committed) -> bool:
    """Whether a check's ratio now falls below its committed ratio by more than its own noise."""
    return committed is not None and now["ratio"] < committed["ratio"] - now["noise"]


def main(argv=None):
    p = harness.parser("gate", __doc__, precision=None, rounds=False, result=None)
    p.add_argument("--checks", type=harness.name_list(CHECKS, "check"), default=",".join(CHECKS))
    p.add_argument("--update", action="store_true", help=f"write the ratios measured to {GATE.relative_to(harness.ROOT)}")
    p.add_argument("--rehearse", action="store_true", help="tiny shapes, one round; nothing judged or written")
    p.add_argument("--gate", type=Path, default=GATE, help="the committed ratios")
    args = p.setup(argv)
    committed = json.loads(args.gate.read_text())["data"]["checks"] if args.gate.is_file() else {}
    now, rows, failed = {}, [], []
    for check in args.checks:
        now[check] = m = measure(check, args.rehearse, args.threads)
        c, low = committed.get(check), falls(m, committed.get(check))
        failed += [check] if low and not args.rehearse else []
        rows.append([check, f"{m['ratio']:.2f}x ± {m['noise']:.2f}", f"{c['ratio']:.2f}x" if c else "-",
                     "rehearsal" if args.rehearse else "FAILS" if low else "ok"])
    tables = {"gate": harness.table(["check", "now (paired median ± noise)", "committed", "verdict"], rows)}
    harness.show(tables)
    if args.update and not args.rehearse:
        harness.save(args, tables, {"checks": {**committed, **now}}, args.gate, show_tables=False)
    if failed:
        print(f"gate: {len(failed)} check(s) fell below their committed ratio: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0
