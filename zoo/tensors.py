"""Counting tensors' memory: one walker for every place that adds up bytes (parameters, optimizer state, the memory
planner's live tensors).

    tensors_of(obj)    the plain tensors inside obj: nested dicts, lists and tuples walked, a tensor
                       subclass (NF4, 8-bit optimizer states) replaced by the tensors it is made of
    tensor_bytes(obj)  the bytes of their storages, each storage counted once (tied weights, views)
"""
from __future__ import annotations

import torch
from torch import nn


def _is_subclass(t: torch.Tensor) -> bool:
    """A tensor subclass made of inner tensors (torchao's NF4, 8-bit states), not a fake tensor."""
    return (type(t) not in (torch.Tensor, nn.Parameter) and hasattr(t, "__tensor_flatten__")
            and type(t).__name__ != "FakeTensor")


def tensors_of(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        if _is_subclass(obj):
            return [u for name in obj.__tensor_flatten__()[0] for u in tensors_of(getattr(obj, name))]
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in tensors_of(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in tensors_of(v)]
    return []


def tensor_bytes(obj) -> int:
    seen, total = set(), 0
    for t in tensors_of(obj):  # meta tensors count the bytes they stand for
        s = t.untyped_storage()
        if s._cdata not in seen:
            seen.add(s._cdata)
            total += s.nbytes()
    return total
