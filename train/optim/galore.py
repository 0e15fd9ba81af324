"""GaLore: AdamW with low-rank gradient states (Zhao et al., "GaLore: Memory-Efficient LLM Training
by Gradient Low-Rank Projection", 2024).

Every `update_every` steps the gradient's top-`rank` singular vectors become the projection; Adam's
moments are kept for the projected gradient only. Zoo's own because `galore-torch` keeps an object
in the optimizer state, which `weights_only=True` refuses; here the state is plain tensors.
"""
from __future__ import annotations

import torch


class GaLoreAdamW(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 rank: int = 128, update_every: int = 200, scale: float = 0.25):
        if rank < 1 or update_every < 1:
            raise ValueError(f"GaLore: rank and update_every must be >= 1, got {rank}, {update_every}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, galore=False,
                                      rank=rank, update_every=update_every, scale=scale))

    @staticmethod
    def _projection(grad: torch.Tensor, rank: int) -> torch.Tensor:
        U, _, Vh = torch.linalg.svd(grad.float(), full_matrices=False)
        # m x r: R = P^T G, or r x n: R = G P^T
        return U[:, :rank].contiguous() if grad.shape[0] < grad.shape[1] else Vh[:rank].contiguous()

    def planned_state_bytes(self) -> int:
        """The state's bytes after a step, from the shapes alone (the planner cannot run the step on fake
        tensors): per low-rank matrix P and two r x larger-side moments, else two moments; fp32."""
        total = 0
        for group in self.param_groups:
            for p in group["params"]:
                if group["galore"] and p.dim() == 2:
                    r = min(group["rank"], *p.shape)
                    total += 4 * r * (min(p.shape) + 2 * max(p.shape))
                else:
                    total += 8 * p.numel()
                total += 4
        return total

    @torch.no_grad()
    def step(self, closure=None):
        with torch.enable_grad():
            loss = closure() if closure is not None else None
        for group in self.param_groups:
            b1, b2 = group["betas"]
            lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g, st = p.grad.float(), self.state[p]
                low_rank = group["galore"] and p.dim() == 2
                if not st:
                    st["step"] = torch.zeros((), dtype=torch.float32)
                if low_rank:
                    left = p.shape[0] < p.shape[1]
                    if int(st["step"]) % group["update_every"] == 0:
                        st["proj"] = self._projection(g, group["rank"])
                    P = st["proj"]
                    g = P.T @ g if left else g @ P.T
                if "exp_avg" not in st:
                    st["exp_avg"] = torch.zeros_like(g)
                    st["exp_avg_sq"] = torch.zeros_like(g)
                st["step"] += 1
                t = float(st["step"])
                m, v = st["exp_avg"], st["exp_avg_sq"]
                m.lerp_(g, 1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                n = (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt_().add_(eps))
                if low_rank:
                    n = (P @ n if left else n @ P) * group["scale"]
                if wd:
                    p.mul_(1 - lr * wd)
                p.add_(n.to(p.dtype), alpha=-lr)
        return loss
