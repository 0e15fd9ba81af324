"""Knowledge distillation: the run's teacher (train.teacher, train.kd_alpha, train.kd_temperature).

`load_teacher` reads the teacher with zoo.from_pretrained (fp32, eval mode, no gradients) and asks
the task whether it fits the student (`Task.check_teacher`; a mismatch is a one-line ConfigError).
The task uses it in its loss (zoo/blocks/chunked_ce.py). It is never part of the trained model:
wrappers and checkpoints hold the student alone; every rank runs its own copy.
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
    why = task.check_teacher(teacher, model)
    if why:
        raise ConfigError(f"{cfg.source}: train.teacher={path}: {why}")
    teacher = teacher.float().to(device).eval().requires_grad_(False)
    if cfg.train.channels_last:
        teacher = teacher.to(memory_format=torch.channels_last)
    n = sum(p.numel() for p in teacher.parameters())
    say(f"teacher: {path} ({type(teacher).__name__}, {n / 1e6:.2f}M parameters), kd_alpha {cfg.train.kd_alpha}, "
        f"kd_temperature {cfg.train.kd_temperature}")
    return teacher
