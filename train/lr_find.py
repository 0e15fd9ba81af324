"""The LR range test (Smith, "Cyclical Learning Rates for Training Neural Networks", 2017):
`python train/run.py CONFIG train.lr_find=true`.

On a fresh copy of the run (same model, data, optimizer and batch; nothing is read from or
written to the run's checkpoints), the LR grows exponentially from `train.lr_find_min` to
`train.lr_find_max` over `train.lr_find_steps` optimizer steps, one step per LR. The loss is
smoothed (EMA, 0.9, bias-corrected); the test stops early once the smoothed loss exceeds 4x its
best. Suggested LR: the LR of the lowest smoothed loss divided by 10 (past the minimum the run is
already diverging; a tenth of it is the largest LR that still trains stably). Writes
`<out_dir>/lr_find.png` (loss against LR, log scale) and `<out_dir>/lr_find.json`.
"""
from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path

import torch

from zoo.weights.files import atomic_write

SMOOTH = 0.9
STOP_FACTOR = 4.0


def suggest(lrs: list[float], losses: list[float]) -> tuple[float, list[float]]:
    """(suggested LR, smoothed losses) from the raw losses of the range test."""
    smooth, avg = [], 0.0
    for i, l in enumerate(losses):
        avg = SMOOTH * avg + (1 - SMOOTH) * l
        smooth.append(avg / (1 - SMOOTH ** (i + 1)))
    best = min(range(len(smooth)), key=smooth.__getitem__)
    return lrs[best] / 10, smooth


def lr_find(cfg, say) -> dict:
    from .loop import DTYPES, optimizer_step, resolve_device, resolve_precision, to_device
    from .optim import build_optimizer, set_lr
    from .runtime import apply_runtime
    from .tasks import task_class
    t = cfg.train
    out = Path(t.out_dir)
    device = resolve_device(t.device)
    torch.manual_seed(t.seed)
    precision = resolve_precision(cfg, device, say)
    amp_dtype = None if precision == "fp32" else DTYPES[precision]
    task = task_class(cfg.family)(cfg, device, say)
    task.autocast_dtype = amp_dtype
    task.setup()
    torch.manual_seed(t.seed)
    model = apply_runtime(task.build_model(), t, say, cfg.source).to(device).train()  # from_pretrained: eval mode
    optimizer = build_optimizer(model, cfg.optim, device, say)
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    autocast = (lambda: torch.autocast(device.type, dtype=amp_dtype)) if amp_dtype else contextlib.nullcontext
    params = [p for p in model.parameters() if p.requires_grad]
    n = t.lr_find_steps
    ratio = t.lr_find_max / t.lr_find_min
    lrs, losses, best = [], [], math.inf
    say(f"lr_find: {n} steps, LR {t.lr_find_min:g} to {t.lr_find_max:g} ({cfg.optim.name}, "
        f"{t.batch_size} x {t.grad_accum} per step)")
    for step in range(n):
        lr = t.lr_find_min * ratio ** (step / (n - 1))
        set_lr(optimizer, lr)
        batches = (to_device(task.train_batch(step, m), device, t.channels_last) for m in range(t.grad_accum))
        r = optimizer_step(lambda b: task.loss(model, b), batches, t.grad_accum, optimizer, scaler, params,
                           t.clip_grad, autocast)
        if not math.isfinite(r.loss):
            break
        lrs.append(lr)
        losses.append(r.loss)
        _, smooth = suggest(lrs, losses)
        best = min(best, smooth[-1])
        if step > 5 and smooth[-1] > STOP_FACTOR * best:
            break
    if len(losses) < 3:
        raise ValueError(f"lr_find: the loss was not finite from LR {t.lr_find_min:g}; lower train.lr_find_min")
    lr, smooth = suggest(lrs, losses)
    result = {"suggested_lr": lr, "lr": lrs, "loss": losses, "smoothed_loss": smooth}
    atomic_write(out / "lr_find.json", json.dumps(result))
    if t.plot:
        _plot(lrs, losses, smooth, lr, out / "lr_find.png")
        say(f"lr_find: plot {out / 'lr_find.png'}")
    say(f"lr_find: suggested optim.lr={lr:.3g} (lowest smoothed loss {min(smooth):.3f} at LR "
        f"{lr * 10:.3g}, divided by 10; {len(lrs)} steps)")
    return result


def _plot(lrs, losses, smooth, lr, path: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(lrs, losses, alpha=0.35, label="loss")
    ax.plot(lrs, smooth, label="smoothed loss")
    ax.axvline(lr, color="k", ls="--", label=f"suggested {lr:.2g}")
    ax.set_xscale("log")
    ax.set_xlabel("learning rate")
    ax.set_ylabel("loss")
    lo, hi = min(smooth), smooth[0]
    ax.set_ylim(lo - 0.1 * (hi - lo), hi + 0.5 * (hi - lo))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
