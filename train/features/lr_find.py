"""The LR range test (Smith, "Cyclical Learning Rates for Training Neural Networks", 2017):
`python train/run.py CONFIG train.lr_find=true`.

On a fresh copy of the run (its checkpoints untouched) the LR grows exponentially from
`train.lr_find_min` to `train.lr_find_max`, a step per LR, until the smoothed loss passes 4x its best.
Suggested LR: the lowest smoothed loss's over 10 (past the minimum the run already diverges); written
to `<out_dir>/lr_find.png` and `.json`. Under torchrun the ranks agree on each step's loss (the global
batch's), so each finds the LR one process finds; lr_find.json lists every rank's suggestion.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from zoo.weights.files import atomic_write

from ..optim import set_lr
from ..plots import line_plot
from ..step import optimizer_step, to_device

SMOOTH, STOP_FACTOR = 0.9, 4.0


def suggest(lrs: list[float], losses: list[float]) -> tuple[float, list[float]]:
    """(suggested LR, smoothed losses) from the raw losses of the range test."""
    smooth, avg = [], 0.0
    for i, l in enumerate(losses):
        avg = SMOOTH * avg + (1 - SMOOTH) * l
        smooth.append(avg / (1 - SMOOTH ** (i + 1)))
    return lrs[min(range(len(smooth)), key=smooth.__getitem__)] / 10, smooth


def lr_find(run, say) -> dict:
    """The range test on a built run (train/builder.py's build_run, as training builds it)."""
    t, par = run.cfg.train, run.par
    out = Path(t.out_dir)
    sync = dict(no_sync=lambda last: par.no_sync(run.fwd, last), agree=lambda s: par.agree(s, False)[0]) \
        if par.active else {}
    task, params, n = run.task, run.params(), t.lr_find_steps
    lrs, losses, best = [], [], math.inf
    say(f"lr_find: {n} steps, LR {t.lr_find_min:g} to {t.lr_find_max:g} ({run.cfg.optim.name}, "
        f"{t.batch_size} x {t.grad_accum}{f' x {par.world} ranks' if par.active else ''} per step)")
    for step in range(n):
        lr = t.lr_find_min * (t.lr_find_max / t.lr_find_min) ** (step / (n - 1))
        set_lr(run.optimizer, lr)
        batches = (to_device(task.train_batch(step, m), run.device, t.channels_last) for m in range(t.grad_accum))
        r = optimizer_step(lambda b: task.loss(run.fwd, b), batches, t.grad_accum, run.optimizer, run.scaler, params,
                           t.clip_grad, run.train_context, **sync)
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
    result = {"suggested_lr": lr, "lr": lrs, "loss": losses, "smoothed_loss": smooth, "ranks": par.gather(lr)}
    if not par.main:
        return result
    atomic_write(out / "lr_find.json", json.dumps(result))
    if t.plot:
        lo, hi = min(smooth), smooth[0]
        line_plot({"loss": list(zip(lrs, losses)), "smoothed loss": list(zip(lrs, smooth))}, out / "lr_find.png",
                  "learning rate", "loss", logx=True, vline=(lr, f"suggested {lr:.2g}"),
                  ylim=(lo - 0.1 * (hi - lo), hi + 0.5 * (hi - lo)), styles={"loss": {"alpha": 0.35}})
        say(f"lr_find: plot {out / 'lr_find.png'}")
    say(f"lr_find: suggested optim.lr={lr:.3g} (lowest smoothed loss {min(smooth):.3f} at LR "
        f"{lr * 10:.3g}, divided by 10; {len(lrs)} steps" + (f"; each rank's: {result['ranks']})" if par.active else ")"))
    return result
