"""The classification recipe against crops and flips (the digits preset's shifts): equal steps, several seeds.

    python train/bench.py convnet-recipe                        # resnet-digits, 200 steps, seeds 0 1 2
    python train/bench.py convnet-recipe --config convnext-digits.yaml --seeds 0,1,2,3,4
    python train/bench.py convnet-recipe --docs   # also docs/convnet_recipe.json and docs/convnet.md's table

Two runs of train/run.py per seed, the same config, data, steps and batch: `baseline` as shipped
(random shifts, label smoothing, EMA) and `recipe` with timm's augmentations on top
(`--recipe`, default TrivialAugment, random erasing 0.25, Mixup 0.8 / CutMix 1.0). The table gives
each side's final validation accuracy, loss and confidence (`confidence`) per seed, and the mean
of the per-seed differences (recipe - baseline) with its 95% t-interval (harness.mean_interval);
an interval that straddles 0 is inconclusive. The numbers go to `--out`/recipe.json beside the
runs (a run already there is read, not redone); `--docs` also writes them to
docs/convnet_recipe.json and renders docs/convnet.md's table from them (`render`).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from train.benches import harness  # noqa: E402
from train.metrics import read_rows  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DOCS_JSON, PAGE = ROOT / "docs" / "convnet_recipe.json", ROOT / "docs" / "convnet.md"
METRICS = ("val_acc1", "val_loss", "val_confidence")
RECIPE = "data.auto_augment=trivialaugment,data.random_erasing=0.25,data.mixup_alpha=0.8,data.cutmix_alpha=1.0"


def final_eval(out: Path) -> dict:
    return [r for r in read_rows(out) if "val_acc1" in r][-1]


def confidence(out: Path) -> float:
    """The mean over the validation images of the highest softmax probability of the run's final
    weights (how sure the model is; a model as sure as it is right scores about its accuracy)."""
    import torch
    from safetensors.torch import load_file

    from train.config import load_run_config
    from train.tasks.classify import ClassifyTask
    task = ClassifyTask(load_run_config(str(out / "config.yaml")), torch.device("cpu"), log=lambda m: None)
    task.setup()
    model = task.build_model()
    model.load_state_dict(load_file(str(out / "model.safetensors")))
    logits, _ = task.predict(model)
    return logits.softmax(-1).max(-1).values.mean().item()


def table(data: dict) -> str:
    runs, rows = data["runs"], []
    for key in METRICS:
        m, (lo, hi), verdict = (data["summary"][key][k] for k in ("mean_diff", "ci95", "verdict"))
        rows.append([key, " ".join(f"{a[key]:.4f}" for a in runs["baseline"]),
                     " ".join(f"{b[key]:.4f}" for b in runs["recipe"]), f"{m:+.4f} [{lo:+.4f}, {hi:+.4f}]", verdict])
    return harness.table_text(["metric", "baseline (per seed)", "recipe (per seed)",
                               "recipe - baseline, mean [95% interval]", "verdict"], rows)


def render(data: dict, page: Path = PAGE, write: bool = True) -> list[str]:
    return ["convnet-recipe"] if harness.update_docs_table(page, "convnet-recipe", table(data), write) else []


def main(argv=None):
    ap = harness.parser("convnet-recipe", __doc__, precision="fp32", rounds=False)
    ap.add_argument("--config", default="resnet-digits.yaml", help="a file of configs/convnet/")
    ap.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1, 2])
    ap.add_argument("--steps", type=harness.positive_int, default=200)
    ap.add_argument("--recipe", default=RECIPE, help="comma list of the overrides the recipe adds")
    ap.add_argument("--out", default="runs/bench/convnet-recipe")
    ap.add_argument("--docs", action="store_true", help="also write docs/convnet_recipe.json and docs/convnet.md's table")
    args = ap.parse_args(argv)
    if len(args.seeds) < 3:  # quality comparisons: at least three seeds (DESIGN.md)
        ap.error("--seeds: at least three seeds")
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
            res[name].append({"seed": seed, "val_acc1": r["val_acc1"], "val_loss": r["val_loss"],
                              "val_confidence": confidence(out)})
            print(f"  {name} seed {seed}: " + ", ".join(f"{k} {res[name][-1][k]:.4f}" for k in METRICS), flush=True)
    summary = {}
    for key in METRICS:
        m, half = harness.mean_interval(b[key] - a[key] for a, b in zip(res["baseline"], res["recipe"]))
        verdict = harness.verdict(m, half, lower_is="lower")
        summary[key] = {"mean_diff": m, "ci95": [m - half, m + half],
                        "verdict": verdict if verdict == "inconclusive" else f"recipe {verdict}"}
    data = {"config": args.config, "steps": args.steps, "precision": args.precision[0], "recipe": sides["recipe"],
            "runs": res, "summary": summary}
    print()
    print(table(data), end="")
    harness.write_results(data, Path(args.out) / "recipe.json", DOCS_JSON if args.docs else None, render)
    return 0


if __name__ == "__main__":
    sys.exit(main())
