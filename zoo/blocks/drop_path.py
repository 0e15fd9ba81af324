"""Stochastic depth (DropPath): drop a residual branch for whole samples during training.

Paper: Huang, Sun, Liu, Sedra & Weinberger, "Deep Networks with Stochastic Depth" (2016).
In training, each sample's branch output is kept with probability keep = 1 - drop_prob and
scaled by 1 / keep, so its expectation equals the undropped output; at eval it is the identity.
Use it on the residual branch only:  x = shortcut + drop_path(branch(x)).

Shapes: x (B, ...) -> (B, ...), e.g. (B, C, H, W) or (B, T, D); one Bernoulli draw per sample.
Works with any memory format (the mask is (B, 1, ..., 1) and broadcasts).
Depends on torch only.
"""
import torch
from torch import nn


def drop_path(x: torch.Tensor, drop_prob: float = 0.0, training: bool = False,
              generator: torch.Generator = None) -> torch.Tensor:
    """Zero whole samples of x with probability drop_prob and rescale the rest by 1 / (1 - drop_prob)."""
    if drop_prob == 0.0 or not training:
        return x
    keep = 1.0 - drop_prob
    shape = (x.shape[0],) + (1,) * (x.ndim - 1)
    mask = torch.empty(shape, dtype=x.dtype, device=x.device).bernoulli_(keep, generator=generator)
    return x * mask.div_(keep)


class DropPath(nn.Module):
    """Module form of drop_path(); identity in eval mode or when drop_prob == 0."""

    def __init__(self, drop_prob: float = 0.0):
        super().__init__()
        if not 0.0 <= drop_prob < 1.0:
            raise ValueError(f"drop_prob must be in [0, 1), got {drop_prob}")
        self.drop_prob = float(drop_prob)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return drop_path(x, self.drop_prob, self.training)

    def extra_repr(self) -> str:
        return f"drop_prob={self.drop_prob:.3f}"


def linear_drop_rates(n_blocks: int, max_rate: float) -> list:
    """The linear rule: rate 0 at the first block rising to max_rate at the last."""
    if n_blocks <= 1:
        return [0.0] * n_blocks  # a single block keeps rate 0 (it is the first block)
    return [max_rate * i / (n_blocks - 1) for i in range(n_blocks)]
