"""LR schedules: multipliers of the peak LR at each optimizer step (0-based).

    cosine        linear warmup, then cosine down to min_lr_ratio
    constant      linear warmup, then 1
    linear        linear warmup, then linear down to min_lr_ratio
    wsd           warmup-stable-decay (Hu et al., "MiniCPM", 2024): 1 until the last decay_fraction, then linear
    onecycle      (Smith & Topin, "Super-Convergence", 2017; torch's OneCycleLR, two phases, cosine) from
                  1/onecycle_div up to 1 over the warmup (cosine), then cosine down to min_lr_ratio
    inverse_sqrt  (Vaswani et al., "Attention Is All You Need", 2017) linear warmup, then
                  sqrt((warmup + 1) / (step + 1)): 1 where the warmup ends, no floor
    exponential   linear warmup, then exponential_gamma^(steps since the warmup) (torch's ExponentialLR), no floor
    step          linear warmup, then times step_gamma every step_every steps (torch's StepLR), no floor
"""
from __future__ import annotations

import math

def _cos(a: float, b: float, frac: float) -> float:
    """From a (frac 0) to b (frac 1) along half a cosine."""
    return b + (a - b) * 0.5 * (1 + math.cos(math.pi * frac))


def lr_multiplier(step: int, max_steps: int, cfg) -> float:
    """LR / peak LR at optimizer step `step` (0-based)."""
    warm = min(cfg.resolved_warmup_steps(max_steps), max(max_steps - 1, 0))
    lo = cfg.min_lr_ratio
    if cfg.schedule == "onecycle":
        if step <= warm:
            return _cos(1.0 / cfg.onecycle_div, 1.0, step / warm if warm else 1.0)
        return _cos(1.0, lo, min(1.0, (step - warm) / max(1, max_steps - 1 - warm)))
    if step < warm:
        return (step + 1) / (warm + 1)
    if cfg.schedule == "constant":
        return 1.0
    if cfg.schedule == "inverse_sqrt":
        return math.sqrt((warm + 1) / (step + 1))
    if cfg.schedule == "exponential":
        return cfg.exponential_gamma ** (step - warm)
    if cfg.schedule == "step":
        return cfg.step_gamma ** ((step - warm) // cfg.step_every)
    progress = (step - warm) / max(1, max_steps - 1 - warm)
    progress = min(max(progress, 0.0), 1.0)
    if cfg.schedule == "cosine":
        return _cos(1.0, lo, progress)
    if cfg.schedule == "linear":
        return 1.0 - (1 - lo) * progress
    if cfg.schedule == "wsd":
        decay_start = max_steps - max(1, int(round(cfg.decay_fraction * max_steps)))
        if step < max(decay_start, warm):
            return 1.0
        frac = (step - max(decay_start, warm)) / max(1, max_steps - 1 - max(decay_start, warm))
        return 1.0 - (1 - lo) * min(frac, 1.0)
    raise ValueError(f"unknown schedule {cfg.schedule!r}")


def resume_note(start: int, was_max_steps, max_steps: int, cfg) -> str:
    """The log line of a run resumed at `start` whose train.max_steps changed since the checkpoint: the schedule
    is recomputed over the new max_steps, so the LR may jump, from what to what; at or past max_steps, that no step
    is left; "" when nothing changed."""
    if start >= max_steps and start > 0:
        return (f"resume: the checkpoint's step {start} is not below train.max_steps={max_steps}: nothing left to "
                f"train (raise train.max_steps to train on)")
    if not was_max_steps or was_max_steps == max_steps or start <= 0:
        return ""
    last = cfg.lr * lr_multiplier(start - 1, was_max_steps, cfg)
    nxt = cfg.lr * lr_multiplier(start, max_steps, cfg)
    return (f"resume: train.max_steps {was_max_steps} -> {max_steps}: the LR schedule is recomputed over "
            f"{max_steps} steps and continues from step {start}; the LR goes from {last:.4g} (step {start}, "
            f"the last of the checkpoint, on the schedule over {was_max_steps}) to {nxt:.4g} (step {start + 1})")


def micro_batches(step: int, grad_accum: int, warmup_steps: int) -> int:
    """Batch-size warmup: micro-batches grow linearly from 1 at step 0 to `grad_accum` at `warmup_steps`."""
    return grad_accum if warmup_steps <= 0 or step >= warmup_steps else 1 + (grad_accum - 1) * step // warmup_steps
