"""Optimizers and learning-rate schedules.

Weight decay goes to matrices only: norms, biases and embeddings are not decayed.
AdamW is fused (one kernel for the whole update) where the device supports it.
Schedules are multipliers of the peak LR: warmup + cosine, constant, linear, and
warmup-stable-decay (WSD: Hu et al., "MiniCPM", 2024).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from .config import OptimConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay, seen = [], [], set()
    emb_params = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for p in model.parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        if p.dim() < 2 or id(p) in emb_params:  # biases, norm/BN scales, embeddings
            no_decay.append(p)
        else:
            decay.append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def fused_supported(device: torch.device) -> bool:
    """torch's fused AdamW runs on CUDA, CPU (torch >= 2.4) and MPS."""
    return device.type in ("cuda", "cpu", "mps", "xpu")


def build_optimizer(model: nn.Module, cfg: OptimConfig, device: torch.device, log=print):
    groups = param_groups(model, cfg.weight_decay)
    if cfg.name == "adamw":
        fused = fused_supported(device) if cfg.fused is None else cfg.fused
        try:
            return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=fused)
        except (RuntimeError, TypeError) as e:
            log(f"fused AdamW unavailable on {device.type} ({e}); using the foreach implementation")
            return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)
    if cfg.name == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov and cfg.momentum > 0)
    raise ValueError(f"unknown optimizer {cfg.name!r}")


def lr_multiplier(step: int, max_steps: int, cfg: OptimConfig) -> float:
    """LR / peak LR at optimizer step `step` (0-based)."""
    warm = min(cfg.resolved_warmup_steps(max_steps), max(max_steps - 1, 0))
    if step < warm:
        return (step + 1) / (warm + 1)
    lo = cfg.min_lr_ratio
    if cfg.schedule == "constant":
        return 1.0
    progress = (step - warm) / max(1, max_steps - 1 - warm)
    progress = min(max(progress, 0.0), 1.0)
    if cfg.schedule == "cosine":
        return lo + (1 - lo) * 0.5 * (1 + math.cos(math.pi * progress))
    if cfg.schedule == "linear":
        return 1.0 - (1 - lo) * progress
    if cfg.schedule == "wsd":
        decay_start = max_steps - max(1, int(round(cfg.decay_fraction * max_steps)))
        if step < max(decay_start, warm):
            return 1.0
        frac = (step - max(decay_start, warm)) / max(1, max_steps - 1 - max(decay_start, warm))
        return 1.0 - (1 - lo) * min(frac, 1.0)
    raise ValueError(f"unknown schedule {cfg.schedule!r}")


def set_lr(optimizer: torch.optim.Optimizer, lr: float):
    for g in optimizer.param_groups:
        g["lr"] = lr
