"""Knowledge distillation: the run's teacher (train.teacher, train.kd_kind, train.kd_alpha, train.kd_temperature).

`load_teacher` reads it (fp32, eval mode, no gradients), checked by `Task.check_teacher`; the task's loss
uses it (zoo/blocks/chunked_ce.py). Wrappers and checkpoints hold the student alone; each rank has a copy.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from zoo.config import ConfigError


def load_teacher(cfg, task, model: nn.Module, device: torch.device, say) -> Optional[nn.Module]:
    """The teacher of train.teacher (None without one), checked against the student `model`."""
    path = cfg.train.teacher
    if path is None:
        return None
    import zoo
    try:
        teacher = zoo.from_pretrained(path)
    except (ValueError, FileNotFoundError, OSError, TypeError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ConfigError(f"{cfg.source}: train.teacher: {first}") from None
    if why := task.check_teacher(teacher, model):
        raise ConfigError(f"{cfg.source}: train.teacher={path}: {why}")
    teacher = teacher.float().to(device).eval().requires_grad_(False)
    if cfg.train.channels_last:
        teacher = teacher.to(memory_format=torch.channels_last)
    n = sum(p.numel() for p in teacher.parameters())
    t = cfg.train
    say(f"teacher: {path} ({type(teacher).__name__}, {n / 1e6:.2f}M parameters), kd_kind {t.kd_kind}, "
        f"kd_alpha {t.kd_alpha}" + (f", kd_temperature {t.kd_temperature}" if t.kd_kind == "soft" else ""))
    return teacher
