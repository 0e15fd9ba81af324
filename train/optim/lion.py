"""Lion: EvoLved Sign Momentum (Chen et al., "Symbolic Discovery of Optimization Algorithms", 2023).

    c = beta1 * m + (1 - beta1) * g          the update direction, interpolated
    p = p * (1 - lr * wd) - lr * sign(c)     decoupled weight decay, then a step of size lr per entry
    m = beta2 * m + (1 - beta2) * g          the momentum, with the slower beta2

Half of AdamW's state. Zoo's own because torch has none.
"""
from __future__ import annotations

import torch


class Lion(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 1e-4, betas=(0.9, 0.99), weight_decay: float = 0.0):
        if lr <= 0 or not all(0.0 <= b < 1.0 for b in betas) or weight_decay < 0:
            raise ValueError(f"Lion: lr > 0, betas in [0, 1), weight_decay >= 0; got {lr}, {betas}, {weight_decay}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        with torch.enable_grad():
            loss = closure() if closure is not None else None
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads, moms = [p.grad for p in params], []
            for p in params:
                st = self.state[p]
                if "exp_avg" not in st:
                    st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                moms.append(st["exp_avg"])
            b1, b2 = group["betas"]
            lr, wd = group["lr"], group["weight_decay"]
            update = torch._foreach_lerp(moms, grads, 1 - b1)
            torch._foreach_sign_(update)
            if wd:
                torch._foreach_mul_(params, 1 - lr * wd)
            torch._foreach_add_(params, update, alpha=-lr)
            torch._foreach_lerp_(moms, grads, 1 - b2)
        return loss
