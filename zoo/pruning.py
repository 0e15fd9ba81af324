"""Magnitude pruning of a model's linear layers: unstructured and N:M, with masks that training keeps.

    masks = zoo.prune(model, "unstructured", sparsity=0.5)  # each linear's smallest half set to zero
    masks = zoo.prune(model, "2:4")                          # 2 kept in every 4 consecutive inputs of a row
    optimizer.register_step_post_hook(lambda *a: apply_masks(masks))   # pruned weights stay zero

Han et al., "Learning both Weights and Connections for Efficient Neural Networks" (2015); N:M after Mishra et al.,
"Accelerating Sparse Deep Neural Networks" (2021). Linears outside `keep` are pruned; `to_semi_structured` swaps 2:4
weights for torch's sparse kernels on CUDA (docs/deploy.md).
"""
from __future__ import annotations

import re
from typing import Iterable

import torch
from torch import nn

from .quantization import KEEP, targets

PATTERNS = "unstructured or N:M with 0 < N < M (such as 2:4)"


def parse_pattern(pattern: str):
    """'unstructured' -> None; 'N:M' -> (N, M); anything else raises ValueError."""
    if pattern == "unstructured":
        return None
    m = re.fullmatch(r"(\d+):(\d+)", str(pattern))
    if not m or not 0 < int(m.group(1)) < int(m.group(2)):
        raise ValueError(f"pruning pattern must be {PATTERNS}, got {pattern!r}")
    return int(m.group(1)), int(m.group(2))


def magnitude_mask(w: torch.Tensor, pattern: str = "unstructured", sparsity: float = 0.5) -> torch.Tensor:
    """The bool mask (w's shape; True: kept) that prunes the weights of smallest magnitude: the
    `sparsity` share of all of them (unstructured), or all but N in every M along the last dim (N:M).
    Ties go to the earlier weight (a stable sort), so a mask is the same on every run."""
    nm = parse_pattern(pattern)
    a = w.detach().abs().float()
    if nm is None:
        if not 0 < sparsity < 1:
            raise ValueError(f"sparsity must be in (0, 1), got {sparsity}")
        drop = a.flatten().argsort(stable=True)[:round(sparsity * a.numel())]
        mask = torch.ones(a.numel(), dtype=torch.bool, device=w.device)
        mask[drop] = False
        return mask.view_as(w)
    n, m = nm
    groups = a.reshape(-1, m)
    order = groups.argsort(dim=1, descending=True, stable=True)[:, :n]
    mask = torch.zeros_like(groups, dtype=torch.bool).scatter_(1, order, True)
    return mask.view_as(w)


def prune(model: nn.Module, pattern: str = "unstructured", sparsity: float = 0.5,
          keep: Iterable[str] = KEEP) -> dict:
    """Magnitude-prune the linears outside `keep` in place; returns their masks {name: (weight, mask)}."""
    nm = parse_pattern(pattern)
    names = targets(model, keep)
    if not names:
        raise ValueError(f"nothing to prune: the model has no nn.Linear outside keep={list(keep)}")
    modules = dict(model.named_modules())
    if nm is not None:
        if bad := [f"{n} {tuple(modules[n].weight.shape)}" for n in names if modules[n].weight.shape[-1] % nm[1]]:
            raise ValueError(f"pruning pattern {pattern}: the input dim must be a multiple of {nm[1]}: "
                             f"{', '.join(bad)} (add them to keep)")
    masks = {n: (modules[n].weight, magnitude_mask(modules[n].weight, pattern, sparsity)) for n in names}
    apply_masks(masks)
    return masks


@torch.no_grad()
def apply_masks(masks: dict):
    """Set the pruned weights to zero (after an optimizer step)."""
    for w, mask in masks.values():
        w.mul_(mask)


def sparsity_of(masks: dict) -> float:
    """The share of the masked weights that are zero now (what pruning left, checked on the weights;
    sharded weights, DTensors, are counted over all their shards)."""
    counts = [(w == 0).sum() for w, _ in masks.values()]
    zeros = sum(int(c.full_tensor() if hasattr(c, "full_tensor") else c) for c in counts)
    return zeros / sum(w.numel() for w, _ in masks.values())


def to_semi_structured(model: nn.Module, keep: Iterable[str] = KEEP) -> nn.Module:
    """Inference on a CUDA GPU of compute capability 8.0+: every 2:4-sparse fp16/bf16 linear weight
    outside `keep` becomes torch's SparseSemiStructuredTensor (in place; returns the model)."""
    from torch.sparse import to_sparse_semi_structured
    modules = dict(model.named_modules())
    for n in targets(model, keep):
        w = modules[n].weight
        if w.device.type != "cuda" or torch.cuda.get_device_capability(w.device) < (8, 0):
            raise ValueError(f"to_semi_structured: {n} is on {w.device}; 2:4 sparse kernels need a CUDA GPU of "
                             f"compute capability 8.0 or later")
        if w.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"to_semi_structured: {n} is {w.dtype}; cast the model to fp16 or bf16 first")
        if w.shape[-1] % 4 or bool(((w != 0).reshape(-1, 4).sum(1) > 2).any()):
            raise ValueError(f"to_semi_structured: {n} is not 2:4 sparse (prune it with pattern 2:4 first)")
        modules[n].weight = nn.Parameter(to_sparse_semi_structured(w.detach()), requires_grad=False)
    return model
