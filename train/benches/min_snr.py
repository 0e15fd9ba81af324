"""Min-SNR-gamma against uniform loss weighting at an equal budget, on the embedded digits default.

    python train/bench.py min-snr [--steps 800] [--gammas 5,none] [--precision bf16] [--config configs/diffusion/digits.yaml]

Each setting trains the same config through the loop (same seed, data, autoencoder and number of
steps; only model.min_snr_gamma differs), then:
  - the loss curves: the unweighted validation MSE of the prediction (comparable across
    weightings, unlike each run's own weighted loss) at every evaluation;
  - sample quality: samples_per_class guided samples per digit from the EMA model, labelled by a
    digits classifier (logistic regression on the real training digits, fitted here) -> accuracy
    against the class asked for and the classifier's mean confidence. The classifier's accuracy on
    real held-out digits and on their autoencoder reconstructions is printed as the ceiling.
Writes loss_curves.png and a samples PNG per setting into --out.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from ..plots import line_plot
from . import harness
from train.metrics import read_rows


def digits_classifier(size: int):
    """Logistic regression on the training digits, seen as the generated images will be: size x size
    RGB in [0, 1] average-pooled back to 8x8 grey. Returns predict_proba(images) -> (N, 10) numpy."""
    from sklearn.linear_model import LogisticRegression

    from ..data.images import digits_dataset

    def features(images):
        grey = images.float().mean(1, keepdim=True)
        return F.adaptive_avg_pool2d(grey, 8).flatten(1).cpu().numpy()

    x, y = digits_dataset("train", size, 3)
    clf = LogisticRegression(max_iter=3000, C=1.0).fit(features(x), y.numpy())
    return lambda images: clf.predict_proba(features(images))


def score(proba, labels) -> dict:
    pred = proba.argmax(1)
    conf = proba.max(1)
    labels = labels.cpu().numpy()
    return {"accuracy": float((pred == labels).mean()), "confidence": float(conf.mean()),
            "confident": float(((pred == labels) & (conf > 0.5)).mean())}


def train_settings(config: str, gammas: str, out: Path, steps=None, precision=None, overrides=(),
                   per_class: int = 20, say=print) -> dict:
    """Trains `config` once per gamma of `gammas` ('5,none': none = uniform weighting) through the
    loop, everything else equal. Returns {setting: {"curve": [(step, val_mse, ema_val_mse)],
    "train": [(step, loss)], "rows": the metrics rows, accuracy, confidence, confident}} and writes
    a samples PNG per setting into `out`."""
    from safetensors.torch import load_model

    import zoo

    from ..config import load_run_config
    from ..loop import train
    from ..tasks.diffusion import sample_grid, save_grid

    out = Path(out)
    results = {}
    classify = None
    for gamma in gammas.split(","):
        name = "uniform" if gamma.strip().lower() == "none" else f"gamma={float(gamma):g}"
        over = [f"model.min_snr_gamma={'null' if name == 'uniform' else float(gamma)}",
                f"train.out_dir={out / name.replace('=', '')}", "train.progress=false", "train.resume=false"]
        if steps:
            over.append(f"train.max_steps={steps}")
        if precision:
            over.append(f"train.precision={precision}")
        cfg = load_run_config(config, over + list(overrides))
        say(f"== {name}: {cfg.train.max_steps} steps")
        train(cfg, log=lambda m: None)
        run = Path(cfg.train.out_dir)
        rows = read_rows(run)
        curve = [(r["step"], r["val_mse"], r.get("ema_val_mse")) for r in rows if "val_mse" in r]
        train_curve = [(r["step"], r["loss"]) for r in rows if "loss" in r]
        model = zoo.build(cfg.model)
        ema = run / "model_ema.safetensors"
        load_model(model, str(ema if ema.is_file() else run / "model.safetensors"))
        model.eval()
        if classify is None:
            classify = digits_classifier(cfg.model.image_size)
            from ..data.images import digits_dataset
            xv, yv = digits_dataset("val", cfg.model.image_size, 3)
            with torch.no_grad():
                recon = model.autoencoder(xv).clamp(0, 1)
            say(f"classifier ceiling: real val digits {score(classify(xv), yv)['accuracy']:.3f}, "
                f"their autoencoder reconstructions {score(classify(recon), yv)['accuracy']:.3f}")
        images = sample_grid(model, per_class, torch.device("cpu"), seed=0)
        labels = torch.arange(cfg.model.num_classes).repeat_interleave(per_class)
        save_grid(images, out / f"samples_{name.replace('=', '')}.png", nrow=per_class)
        results[name] = {"curve": curve, "train": train_curve, "rows": rows, **score(classify(images), labels)}
    return results


def main(argv=None):
    ap = harness.parser("min-snr", __doc__, precision=None, rounds=False)
    ap.add_argument("--precision", type=harness.precision_name, default=None,
                    help=f"one of {', '.join(harness.PRECISIONS)} for every run (default: the config's train.precision)")
    ap.add_argument("--config", default="configs/diffusion/digits.yaml")
    ap.add_argument("--steps", type=int, default=None, help="training steps per setting (default: the config's)")
    ap.add_argument("--gammas", default="5,none", help="comma-separated; 'none' = uniform weighting")
    ap.add_argument("--per-class", type=int, default=20, help="samples per class for the quality metric")
    ap.add_argument("--out", default="runs/bench-min-snr")
    ap.add_argument("overrides", nargs="*", help="extra key=value config overrides for every run")
    args = ap.parse_args(argv)
    harness.setup(args)
    out = Path(args.out)
    results = train_settings(args.config, args.gammas, out, args.steps, args.precision, args.overrides,
                             args.per_class, say=lambda m: print(m, flush=True))

    print("\nvalidation MSE of the prediction (unweighted; EMA in brackets)")
    names = list(results)
    steps = [s for s, *_ in results[names[0]]["curve"]]
    rows = []
    for i, s in enumerate(steps):
        cells = []
        for n in names:
            _, v, e = results[n]["curve"][i]
            cells.append(f"{v:.4f} ({e:.4f})" if e is not None else f"{v:.4f}")
        rows.append([s] + cells)
    harness.print_table(["step"] + names, rows)
    print(f"\nsample quality ({args.per_class} per class, EMA model, digits classifier)")
    harness.print_table(["setting", "accuracy", "mean confidence", "correct & confidence > 0.5"],
                        [[n, f"{r['accuracy']:.3f}", f"{r['confidence']:.3f}", f"{r['confident']:.3f}"]
                         for n, r in results.items()])
    _plot(results, out / "loss_curves.png")
    print(f"\n{out / 'loss_curves.png'}, {out}/samples_*.png")
    return 0


def _plot(results, path):
    line_plot({name: [(s, v) for s, v, _ in r["curve"]] for name, r in results.items()}, path, "step", "validation MSE (unweighted)",
              title="validation MSE of each weighting", markers=set(results))
