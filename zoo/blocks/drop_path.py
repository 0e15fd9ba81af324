"""Stochastic depth (DropPath): drop a residual branch for whole samples during training.

Paper: Huang et al., "Deep Networks with Stochastic Depth" (2016). A sample's branch is kept with probability
1 - drop_prob and scaled by its inverse; identity at eval.

    y = shortcut + drop_path(branch(x), p, training)          # masked: dropped rows zeroed
    y = residual_drop_path(shortcut, branch, x, p, training)  # the branch runs on the kept rows only

Both draw the same mask; the second saves the dropped rows' compute (masked under torch.compile). `per="batch"`: one
draw for the whole batch (the paper's variant).
Shapes: x (B, ...) -> (B, ...), e.g. (B, C, H, W) or (B, T, D); any memory format.
"""
from typing import Callable

import torch
from torch import nn


def keep_mask(batch: int, keep: float, device, generator: torch.Generator = None) -> torch.Tensor:
    """(batch,) float mask: 1 with probability keep, else 0 (the per-sample draw both forms share)."""
    return torch.empty(batch, device=device).bernoulli_(keep, generator=generator)


def drop_path(x: torch.Tensor, drop_prob: float = 0.0, training: bool = False,
              generator: torch.Generator = None) -> torch.Tensor:
    """Zero whole samples of x with probability drop_prob and rescale the rest by 1 / (1 - drop_prob)."""
    if drop_prob == 0.0 or not training:
        return x
    keep = 1.0 - drop_prob
    mask = keep_mask(x.shape[0], keep, x.device, generator).to(x.dtype)
    return x * mask.view((-1,) + (1,) * (x.ndim - 1)).div_(keep)


def residual_drop_path(shortcut: torch.Tensor, branch: Callable, x: torch.Tensor, drop_prob: float = 0.0,
                       training: bool = False, generator: torch.Generator = None, per: str = "sample"):
    """shortcut + drop_path(branch(x)), the branch run on the kept rows only (per="sample") or skipped
    whole with probability drop_prob (per="batch"); the plain sum in eval, at rate 0 or compiling."""
    if drop_prob == 0.0 or not training:
        return shortcut + branch(x)
    if per not in ("sample", "batch"):
        raise ValueError(f"per must be 'sample' or 'batch', got {per!r}")
    keep = 1.0 - drop_prob
    if per == "batch":
        kept = keep_mask(1, keep, x.device, generator).item() > 0
        return shortcut + branch(x) / keep if kept else shortcut.clone()  # a new tensor, as in every case
    if torch.compiler.is_compiling():
        return shortcut + drop_path(branch(x), drop_prob, training, generator)
    mask = keep_mask(x.shape[0], keep, x.device, generator)
    rows = mask.nonzero().squeeze(1)
    if rows.numel() < 2 or rows.numel() == x.shape[0]:  # the masked form when all rows are kept, or fewer
        # than two (no row: still a graph through the branch; one row: a BatchNorm of 1x1 maps needs two)
        view = mask.to(x.dtype).view((-1,) + (1,) * (x.ndim - 1)) / keep
        return shortcut + branch(x) * view
    fmt = torch.channels_last if x.ndim == 4 and x.is_contiguous(memory_format=torch.channels_last) \
        and not x.is_contiguous() else torch.contiguous_format
    out = branch(x.index_select(0, rows).contiguous(memory_format=fmt))
    return shortcut.clone().index_add_(0, rows, out, alpha=1.0 / keep)  # clone keeps the memory format


class DropPath(nn.Module):
    """Module form. mode "mask": `self.drop_path(branch_out)` zeroes the dropped rows; "skip" and "batch":
    `self.drop_path.residual(shortcut, branch, x)` is residual_drop_path with per="sample" or per="batch" (residual()
    works in every mode). Identity in eval mode or when drop_prob == 0. `generator`: where the draws come from (None:
    the global RNG); data-parallel ranks whose "batch" blocks have generators seeded alike drop the same blocks."""
    MODES = ("mask", "skip", "batch")

    def __init__(self, drop_prob: float = 0.0, mode: str = "mask"):
        super().__init__()
        if not 0.0 <= drop_prob < 1.0:
            raise ValueError(f"drop_prob must be in [0, 1), got {drop_prob}")
        if mode not in self.MODES:
            raise ValueError(f"mode must be one of {', '.join(self.MODES)}, got {mode!r}")
        self.drop_prob, self.mode = float(drop_prob), mode
        self.generator: torch.Generator = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return drop_path(x, self.drop_prob, self.training, self.generator)

    def residual(self, shortcut: torch.Tensor, branch: Callable, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "mask":
            return shortcut + self(branch(x))
        return residual_drop_path(shortcut, branch, x, self.drop_prob, self.training, self.generator,
                                  per="batch" if self.mode == "batch" else "sample")

    def extra_repr(self) -> str:
        return f"drop_prob={self.drop_prob:.3f}, mode={self.mode}"


def linear_drop_rates(n_blocks: int, max_rate: float) -> list:
    """The linear rule: rate 0 at the first block rising to max_rate at the last."""
    if n_blocks <= 1:
        return [0.0] * n_blocks  # a single block keeps rate 0 (it is the first block)
    return [max_rate * i / (n_blocks - 1) for i in range(n_blocks)]
