"""Stochastic depth that skips the work: ResNet training steps with the dropped samples' branches
computed and zeroed (`drop_path_mode: mask`) against never computed (`skip`: kept rows gathered,
run, scattered back; `batch`: a whole block dropped for the batch, Huang et al. 2016).

    python train/bench.py drop-path                       # resnet50, 32 x 3 x 64 x 64, rates 0.1 0.3 0.5
    python train/bench.py drop-path --rates 0.1 0.2 0.3 0.4 0.5 --rounds 10 --docs
    python train/bench.py drop-path --rates 0.2 --size 128 --rounds 8

Each rate is the last block's (linear from 0 at the first block, as in the paper); every side has
the same weights, batch and drop rate, channels-last, fp32 (or `--precision`), SGD step included;
like the loop (`train.cpu_keep_memory`) the process keeps freed memory (`--no-keep-memory`: glibc's
default, each step's activations page-faulted in afresh).
Timing: train/benches/harness.py's alternating rounds; the table gives each mode's images/s
(best round) and the paired median of skip's (and batch's) speed over mask's with its range over the
rounds. Writes the numbers (every round's seconds too) to `--json` (runs/bench-drop-path/drop_path.json
by default); with `--docs` also to docs/convnet/drop_path.json and the table in docs/convnet.md is
rendered from it (tests/test_convnet.py checks that the two agree). The machine's load average
before and after is recorded: the paired ratios, not the images/s, are what survives a shared machine.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

from train.benches import harness  # noqa: E402
from train.benches.resnet import Side  # noqa: E402

MODES = ("mask", "skip", "batch")
PAGE = ROOT / "docs" / "convnet.md"
DOCS_JSON = ROOT / "docs" / "convnet" / "drop_path.json"


def bound(rate: float) -> float:
    """About the most skipping can give at a last-block rate: the linear rule's mean rate over the
    blocks is rate / 2, so that share of the branches' work is saved in expectation, a bound on the
    step's share when the step is all branches and the blocks do equal work (as ResNet's roughly do:
    each stage halves the map and doubles the width)."""
    return 1.0 / (1.0 - rate / 2)


def table(data: dict) -> str:
    """The docs table: images/s of each mode's best round, skip's and batch's paired speed over
    mask's, and the bound on any speed-up at that rate."""
    return harness.table_text(
        ["precision", "last block's rate", "mask img/s", "skip img/s", "batch img/s",
         "skip / mask (paired median, range)", "batch / mask", "bound 1 / (1 - rate / 2)"],
        [[r["precision"], r["rate"], *(f"{r[f'{m}_img_s']:.1f}" for m in MODES),
          *(str(harness.Paired(**r[f"{m}_over_mask"])) for m in ("skip", "batch")), f"{bound(r['rate']):.2f}x"]
         for r in data["results"]])


def crossover(data: dict, mode: str, precision: str = "fp32"):
    """The lowest rate from which on (every higher rate measured too) `mode`'s paired median speed
    over mask's is above 1; None when there is no such rate."""
    rows = sorted((r for r in data["results"] if r["precision"] == precision), key=lambda r: r["rate"])
    above = [r[f"{mode}_over_mask"]["median"] > 1.0 for r in rows]
    first = next((i for i in range(len(rows)) if all(above[i:])), None)
    return None if first is None else rows[first]["rate"]


def summary(data: dict) -> str:
    """Lines under the table, from the JSON: per mode, where its paired median beats mask's, at
    which rates every round was faster, and at which the median is beyond `bound` (noise); the load."""
    lines = []
    for p in dict.fromkeys(r["precision"] for r in data["results"]):
        rows = [r for r in data["results"] if r["precision"] == p]
        for mode in ("skip", "batch"):
            rate = crossover(data, mode, p)
            every = [r["rate"] for r in rows if r[f"{mode}_over_mask"]["low"] > 1.0]
            beyond = [r["rate"] for r in rows if r[f"{mode}_over_mask"]["median"] > bound(r["rate"])]
            lines.append(f"{mode} / mask ({p}): paired median above 1.00x "
                         f"{'at no rate measured' if rate is None else f'from a last-block rate of {rate} on'}; "
                         f"every round faster at {', '.join(map(str, every)) or 'no rate'}; "
                         f"median beyond the bound (noise) at {', '.join(map(str, beyond)) or 'no rate'}.")
    if "load_before" in data:
        lines.append(f"Load average (1 min) on the 2-core machine: {data['load_before']:.1f} before, "
                     f"{data['load_after']:.1f} after.")
    return "\n".join(lines) + "\n"


def render(data: dict, page: Path = PAGE, write: bool = True) -> list[str]:
    return ["drop-path"] if harness.update_docs_table(page, "drop-path", table(data) + "\n" + summary(data),
                                                      write) else []


def main(argv=None):
    import zoo
    from zoo.config import ConvNetConfig
    ap = harness.parser("drop-path", __doc__, precision="fp32", keep_memory=True)
    ap.add_argument("--arch", default="resnet50")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--size", type=int, default=64, help="image height and width")
    ap.add_argument("--rates", type=float, nargs="+", default=[0.1, 0.3, 0.5])
    ap.add_argument("--steps", type=harness.positive_int, default=2, help="timed steps per round")
    ap.add_argument("--json", default="runs/bench-drop-path/drop_path.json", help="where the numbers are written")
    ap.add_argument("--docs", action="store_true", help=f"also write {DOCS_JSON.relative_to(ROOT)} and its table")
    args = ap.parse_args(argv)
    kept = harness.setup(args)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch, 3, args.size, args.size, generator=g).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (args.batch,), generator=g)
    print(f"drop-path: {args.arch}, batch {args.batch} x 3 x {args.size} x {args.size}, channels-last, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.rounds} rounds of {args.steps} steps")
    out = {"command": "python train/bench.py drop-path " + " ".join(sys.argv[2:] if argv is None else argv),
           "arch": args.arch, "batch": args.batch, "size": args.size, "rounds": args.rounds, "steps": args.steps,
           "threads": torch.get_num_threads(), "torch": torch.__version__, "freed_memory_kept": kept,
           "load_before": os.getloadavg()[0], "results": []}
    for p in args.precision:
        for rate in args.rates:
            sides = {}
            for mode in MODES:
                torch.manual_seed(0)
                cfg = ConvNetConfig(arch=args.arch, num_classes=10, drop_path_rate=rate, drop_path_mode=mode)
                sides[mode] = Side(mode, zoo.build(cfg).train().to(memory_format=torch.channels_last))
                sides[mode].step(x, y, p)
            r = harness.run_rounds({m: (lambda s=s: s.step(x, y, p)) for m, s in sides.items()}, args.rounds,
                                   calls=args.steps)
            out["results"].append({
                "precision": p, "rate": rate, **{f"{m}_img_s": args.batch / r.best(m) for m in MODES},
                **{f"{m}_over_mask": r.paired(m, "mask")._asdict() for m in ("skip", "batch")},
                "seconds": {m: r.times(m) for m in MODES}})
            print(table({"results": out["results"][-1:]}).splitlines()[-1], flush=True)
    out["load_after"] = os.getloadavg()[0]
    print(f"\nload average (1 min) before {out['load_before']:.2f}, after {out['load_after']:.2f}\n")
    print(table(out) + "\n" + summary(out), end="", flush=True)
    harness.write_results(out, Path(args.json), DOCS_JSON if args.docs else None, render)
    return 0


if __name__ == "__main__":
    sys.exit(main())
