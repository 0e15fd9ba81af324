"""Magnitude pruning and its recovery fine-tune: what pruning costs, what the fine-tune wins back, and speed.

    python train/bench.py prune                       # unstructured 0.5 and 2:4 on the embedded default, 3 seeds
    python train/bench.py prune --docs                # also docs/deploy/prune.json and the tables in docs/deploy.md
    python train/bench.py prune --patterns 2:4 --seeds 0 --steps 50
    python train/bench.py prune --trained path/to/model.gguf --fine-tune-overrides "data.path=..."   # a real model
    python train/bench.py prune --render              # only the docs tables, from docs/deploy/prune.json

The base: as `bench.py qat`'s (the trained embedded default, or --trained: a run folder, a Hugging
Face folder or a GGUF file). For each pattern of --patterns (`unstructured` at --sparsity, `N:M`):
  one-shot:  the base pruned (train.prune on the built model) and evaluated before any step, on
             the fine-tunes' validation windows (in this process);
  recovered: a fine-tune of the base with train.prune=<pattern> (the masks held after every step);
  dense:     the same fine-tune without pruning (same data, steps, schedule and seed),
one pair of fine-tunes per seed (train/run.py, qat.py's fine_tune_row). The table gives the base's
validation loss, the one-shot loss, and per pattern the mean over seeds (with its 95% Student-t
interval) of the recovered and the dense fine-tunes and of their difference.

Speed on this machine: every linear a pattern prunes, as the dense matmul of the pruned weights
(what train/run.py, generation and `train/eval.py` run: zeros cost as much as any other weight)
against torch's sparse CSR matmul of the same weights (`Tensor.to_sparse_csr`, the CPU's sparse
kernel), at 1 token (decoding) and 128 tokens (a prompt), in alternating rounds: the paired median
of dense time / CSR time (above 1: CSR is faster). The 2:4 pattern's own kernels are CUDA's
(zoo.pruning.to_semi_structured, compute capability 8.0+) and are not timed here.
Runs that finished in --out are read back, not run again.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

from train.benches import harness  # noqa: E402
from train.benches.qat import base_model, fine_tune_arguments, fine_tune_overrides, fine_tune_row  # noqa: E402
from train.benches.quantized import PAGE  # noqa: E402

DOCS_JSON = ROOT / "docs" / "deploy" / "prune.json"
TOKENS = (1, 128)


def pattern_overrides(args, pattern: str) -> list[str]:
    return [f"train.prune={pattern}", f"train.prune_sparsity={args.sparsity}"]


def one_shot(args, base: Path, pattern) -> dict:
    """The validation loss of the base, pruned with `pattern` (None: as it is), before any step."""
    import torch

    from train.builder import build_run
    from train.config import load_run_config
    over = fine_tune_overrides(args, base, Path(args.out) / "one-shot", 0)
    cfg = load_run_config(str(ROOT / "configs" / "llm" / "tiny.yaml"),
                          [*over, *(pattern_overrides(args, pattern) if pattern else [])])
    run = build_run(cfg)
    with torch.no_grad(), run.autocast():
        return run.task.evaluate(run.model)


def speed(args, base: Path, pattern: str) -> dict:
    """{tokens: how many times faster torch's CSR matmul runs than the dense one} over the linears
    `pattern` prunes (fp32; the paired median of alternating rounds)."""
    import torch
    from torch.nn.functional import linear

    import zoo
    from zoo.pruning import prune
    model = zoo.from_pretrained(base).float().eval()
    weights = [w.detach() for w, _ in prune(model, pattern, args.sparsity).values()]
    csr = [w.to_sparse_csr() for w in weights]
    out = {}
    with torch.no_grad():
        for n in TOKENS:
            xs = [torch.randn(n, w.shape[1]) for w in weights]
            sides = {"dense": lambda: [linear(x, w) for x, w in zip(xs, weights)],
                     "csr": lambda: [torch.sparse.mm(c, x.T) for x, c in zip(xs, csr)]}
            for side in sides.values():  # first calls (kernel selection, caches) untimed
                side()
            rounds = harness.run_rounds(sides, args.rounds, calls=10)
            out[str(n)] = rounds.paired("csr", "dense").median
    return out


def table(d: dict) -> str:
    rows = [["base (no pruning, no fine-tune)", "0", f"{d['base_val_loss']:.4f}", "", "", ""]]
    for p in d["patterns"]:
        rec, den, diff = p["recovered"], p["dense"], p["difference"]
        rows.append([p["pattern"], f"{p['sparsity']:.2f}",
                     f"{p['one_shot']:.4f} ({p['one_shot'] - d['base_val_loss']:+.4f})",
                     f"{rec[0]:.4f} (±{rec[1]:.4f})", f"{den[0]:.4f} (±{den[1]:.4f})",
                     f"{diff[0]:+.4f} (±{diff[1]:.4f})"])
    return harness.table_text(["pattern", "sparsity of the pruned linears", "one-shot val loss (vs base)",
                               f"pruned + {d['steps']}-step fine-tune", "dense fine-tune, same steps",
                               "pruned - dense (mean of seeds)"], rows)


def speed_table(d: dict) -> str:
    rows = [[p["pattern"], *(f"{p['speed'][str(n)]:.2f}x" for n in TOKENS)] for p in d["patterns"]]
    return harness.table_text(["pattern", *(f"CSR's speed / dense's, {n} token{'s' if n > 1 else ''}" for n in TOKENS)],
                              rows)


def render(data: dict, page: Path = PAGE, write: bool = True) -> list[str]:
    return [name for name, text in (("prune", table(data)), ("prune-speed", speed_table(data)))
            if harness.update_docs_table(page, name, text, write)]


def main(argv=None):
    p = harness.parser("prune", __doc__, precision=None)
    p.add_argument("--patterns", default="unstructured,2:4", help="comma list of train.prune values")
    p.add_argument("--sparsity", type=float, default=0.5, help="train.prune_sparsity (the unstructured pattern's)")
    args = fine_tune_arguments(p, "runs/bench-prune").parse_args(argv)
    if args.render:
        return harness.render_docs(DOCS_JSON, render)
    base = base_model(args)
    seeds = [int(s) for s in args.seeds.split(",")]
    out = Path(args.out)
    dense = [fine_tune_row(args, base, out / f"dense-seed{s}", s, []) for s in seeds]
    from zoo.pruning import parse_pattern
    patterns = []
    for pattern in args.patterns.split(","):
        nm = parse_pattern(pattern)
        tag = pattern.replace(":", "of") if nm else f"unstructured{args.sparsity:g}"
        pruned = [fine_tune_row(args, base, out / f"{tag}-seed{s}", s, pattern_overrides(args, pattern)) for s in seeds]
        patterns.append({"pattern": pattern, "sparsity": pruned[0]["sparsity"],
                         "one_shot": one_shot(args, base, pattern)["val_loss"],
                         "seeds": [{"seed": s, "recovered": r["val_loss"], "dense": d["val_loss"]}
                                   for s, r, d in zip(seeds, pruned, dense)],
                         "recovered": list(harness.mean_interval(r["val_loss"] for r in pruned)),
                         "dense": list(harness.mean_interval(d["val_loss"] for d in dense)),
                         "difference": list(harness.mean_interval(r["val_loss"] - d["val_loss"]
                                                                  for r, d in zip(pruned, dense))),
                         "speed": speed(args, base, pattern)})
    data = {"base": str(base), "steps": args.steps, "lr": args.lr, "eval_batches": args.eval_batches,
            "precision": args.precision, "fine_tune_overrides": args.fine_tune_overrides, "threads": args.threads,
            "base_val_loss": one_shot(args, base, None)["val_loss"], "patterns": patterns,
            "load_average": os.getloadavg()[0]}
    print(table(data))
    print(speed_table(data))
    harness.write_results(data, out / "prune.json", DOCS_JSON if args.docs else None, render)
    return 0


if __name__ == "__main__":
    sys.exit(main())
