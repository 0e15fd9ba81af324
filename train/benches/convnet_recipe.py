"""The classification recipe against crops and flips (the digits preset's shifts): equal steps, several seeds.

    python train/bench.py convnet-recipe                        # resnet-digits, 200 steps, seeds 0 1 2
    python train/bench.py convnet-recipe --config convnext-digits.yaml --seeds 0,1,2,3,4

Two runs of train/run.py per seed, the same config, data, steps and batch: `baseline` as shipped
(random shifts, label smoothing, EMA) and `recipe` with timm's augmentations on top
(`--recipe`, default TrivialAugment, random erasing 0.25, Mixup 0.8 / CutMix 1.0). The table gives
each side's final validation accuracy and loss per seed, and the mean of the per-seed differences
(recipe - baseline) with its 95% t-interval; an interval that straddles 0 is inconclusive. The
numbers go to `--out`/recipe.json beside the runs.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from train.benches import harness  # noqa: E402
from train.metrics import read_rows  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
RECIPE = "data.auto_augment=trivialaugment,data.random_erasing=0.25,data.mixup_alpha=0.8,data.cutmix_alpha=1.0"


def final_eval(out: Path) -> dict:
    return [r for r in read_rows(out) if "val_acc1" in r][-1]


def interval(diffs: list) -> tuple[float, float, float]:
    """(mean, low, high): the mean of the paired differences and its 95% Student-t interval."""
    from scipy.stats import t
    m = statistics.mean(diffs)
    half = t.ppf(0.975, len(diffs) - 1) * statistics.stdev(diffs) / len(diffs) ** 0.5
    return m, m - half, m + half


def main(argv=None):
    ap = harness.parser("convnet-recipe", __doc__, precision="fp32", rounds=False)
    ap.add_argument("--config", default="resnet-digits.yaml", help="a file of configs/convnet/")
    ap.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1, 2])
    ap.add_argument("--steps", type=harness.positive_int, default=200)
    ap.add_argument("--recipe", default=RECIPE, help="comma list of the overrides the recipe adds")
    ap.add_argument("--out", default="runs/bench/convnet-recipe")
    args = ap.parse_args(argv)
    if len(args.seeds) < 2:
        ap.error("--seeds: at least two seeds for an interval")
    if len(args.precision) != 1:
        ap.error("--precision: one precision (train.precision of every run)")
    sides = {"baseline": [], "recipe": args.recipe.split(",")}
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads or 1))
    res = {name: [] for name in sides}
    for seed in args.seeds:
        for name, extra in sides.items():
            out = Path(args.out) / f"{name}-{seed}"
            if not (out / "model.safetensors").is_file():
                cmd = [sys.executable, str(ROOT / "train" / "run.py"), str(ROOT / "configs" / "convnet" / args.config),
                       f"train.out_dir={out}", f"train.max_steps={args.steps}", f"train.seed={seed}",
                       f"train.precision={args.precision[0]}", "train.progress=false", "train.samples=false", *extra]
                print(" ".join(cmd[1:]), flush=True)
                subprocess.run(cmd, check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
            r = final_eval(out)
            res[name].append({"seed": seed, "val_acc1": r["val_acc1"], "val_loss": r["val_loss"]})
            print(f"  {name} seed {seed}: val_acc1 {r['val_acc1']:.4f}, val_loss {r['val_loss']:.4f}", flush=True)
    rows, summary = [], {}
    for key in ("val_acc1", "val_loss"):
        diffs = [b[key] - a[key] for a, b in zip(res["baseline"], res["recipe"])]
        m, lo, hi = interval(diffs)
        verdict = "inconclusive" if lo <= 0 <= hi else ("recipe higher" if lo > 0 else "recipe lower")
        summary[key] = {"mean_diff": m, "ci95": [lo, hi], "verdict": verdict}
        rows.append([key, " ".join(f"{a[key]:.4f}" for a in res["baseline"]),
                     " ".join(f"{b[key]:.4f}" for b in res["recipe"]), f"{m:+.4f} [{lo:+.4f}, {hi:+.4f}]", verdict])
    print()
    harness.print_table(["metric", "baseline (per seed)", "recipe (per seed)",
                         "recipe - baseline, mean [95% interval]", "verdict"], rows)
    path = Path(args.out) / "recipe.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"config": args.config, "steps": args.steps, "recipe": sides["recipe"], "runs": res,
                                "summary": summary}, indent=1))
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
