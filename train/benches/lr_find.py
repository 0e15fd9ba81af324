"""The LR range test against a sweep: does `train.features.lr_find`'s suggestion land within a factor of 3
of the best LR of a small sweep?

    python train/bench.py lr-find                               # the embedded default, AdamW
    python train/bench.py lr-find --train-steps 200 --lrs 5e-4,1e-3,2e-3,4e-3,8e-3,1.6e-2

Runs the range test (train.features.lr_find=true, its default range and steps) on the embedded default
(configs/llm/tiny.yaml, `--set key=value` overrides for both), then trains `--train-steps` steps
at each LR of `--lrs` (warmup 10%, the config's cosine schedule) and prints the final val loss of
each, the best LR, the suggestion and their ratio.
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from train.benches import harness  # noqa: E402


def main(argv=None):
    ap = harness.parser("lr-find", __doc__, precision="fp32", rounds=False)
    ap.add_argument("--train-steps", type=harness.positive_int, default=200)
    ap.add_argument("--lrs", type=lambda s: [float(x) for x in s.split(",")],
                    default=[5e-4, 1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2])
    ap.add_argument("--set", nargs="*", default=[], help="key=value overrides of the config, for every run")
    args = ap.parse_args(argv)
    harness.setup(args)
    from train.config import load_run_config
    from train.loop import train
    from train.run import DEFAULT_CONFIG

    common = [f"train.precision={args.precision[0]}", "train.progress=false", "train.samples=false",
              "train.export=false", *args.set]
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_run_config(str(DEFAULT_CONFIG), [f"train.out_dir={tmp}", "train.features.lr_find=true", *common])
        found = train(cfg, log=lambda m: None)
    suggested = found["suggested_lr"]
    print(f"lr-find: suggested {suggested:.3g} ({len(found['lr'])} range-test steps)", flush=True)
    rows, results = [], {}
    for lr in args.lrs:
        with tempfile.TemporaryDirectory() as tmp:
            over = [f"train.out_dir={tmp}", f"train.max_steps={args.train_steps}", "train.eval_every=0",
                    "train.plot=false", "train.checkpoint_every=0", "train.average_last=0", f"optim.warmup_steps={max(1, args.train_steps // 10)}",
                    f"optim.lr={lr}", *common]
            final = train(load_run_config(str(DEFAULT_CONFIG), over), log=lambda m: None)
        results[lr] = final["val_loss"]
        print(f"  lr {lr:.3g}: val loss {results[lr]:.4f}", flush=True)
    best = min(results, key=results.get)
    ratio = max(best / suggested, suggested / best)
    print()
    harness.print_table(["LR", f"val loss after {args.train_steps} steps"],
                        [[f"{lr:.3g}" + (" (best)" if lr == best else ""), f"{v:.4f}"] for lr, v in results.items()])
    print(f"\nsuggested {suggested:.3g}, best of the sweep {best:.3g}: a factor of {ratio:.2f} "
          f"({'within' if ratio <= 3 else 'NOT within'} 3)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
