"""Activation checkpointing policies for a stack of blocks: which blocks recompute their forward in the backward pass
instead of keeping their activations, and what a recomputed block keeps.

Chen et al., "Training Deep Nets with Sublinear Memory Cost" (2016); the selective policy after Korthikanti et al.,
"Reducing Activation Recomputation in Large Transformer Models" (2022): keep the outputs of MATMUL_OPS, recompute the
rest. Policies "none", "full", "selective". Applied from outside, as timm and torchtitan do (the state dict is
unchanged): `checkpoint_units(model.checkpoint_units(), "selective", every=2)`; `run_block` for one call.
Shapes: whatever the block takes and returns.
"""
from __future__ import annotations

import functools
import types
from typing import Iterable, Union

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

POLICIES = ("none", "full", "selective")

_aten = torch.ops.aten
MATMUL_OPS = {_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default,
              _aten.convolution.default, _aten._scaled_dot_product_flash_attention_for_cpu.default,
              _aten._scaled_dot_product_efficient_attention.default,
              _aten._scaled_dot_product_flash_attention.default,
              _aten._scaled_dot_product_cudnn_attention.default}
if hasattr(_aten, "_grouped_mm"):
    MATMUL_OPS.add(_aten._grouped_mm.default)


def resolve_policy(policy: Union[bool, str]) -> str:
    """True -> 'full', False -> 'none'; a name from POLICIES as it is."""
    if policy is True:
        return "full"
    if policy is False or policy is None:
        return "none"
    if policy not in POLICIES:
        raise ValueError(f"unknown activation checkpointing policy {policy!r} (known: {', '.join(POLICIES)}, "
                         f"true, false)")
    return policy


def _keep_matmuls(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in MATMUL_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _frozen_stats(block: nn.Module, fn):
    """fn whose later calls (the recomputation) leave BatchNorm's running statistics as they are."""
    norms = [m for m in block.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]
    if not norms:
        return fn
    calls = [0]

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 1:
            return fn(*args, **kwargs)
        with _disable_current_modes():  # bookkeeping, not part of the block (selective checkpointing's mode)
            saved = [(m, m.momentum, m.num_batches_tracked.clone()) for m in norms]
        for m in norms:
            m.momentum = 0.0
        try:
            return fn(*args, **kwargs)
        finally:
            with _disable_current_modes():
                for m, momentum, count in saved:
                    m.momentum = momentum
                    m.num_batches_tracked.copy_(count)
    return wrapped


def _run(block: nn.Module, fn, policy: str, *args, **kwargs):
    """fn(*args, **kwargs), the forward of `block`, checkpointed under `policy` ('full' or 'selective')."""
    selective = {} if policy == "full" else {
        "context_fn": functools.partial(create_selective_checkpoint_contexts, _keep_matmuls)}
    return checkpoint(_frozen_stats(block, fn), *args, use_reentrant=False, **selective, **kwargs)


def run_block(block: nn.Module, i: int, policy: Union[bool, str], every: int, *args, **kwargs):
    """block(*args, **kwargs) as block `i` (from 0) of its stack, checkpointed as the policy says."""
    policy = resolve_policy(policy)
    if policy == "none" or i % every or not (block.training and torch.is_grad_enabled()):
        return block(*args, **kwargs)
    return _run(block, block, policy, *args, **kwargs)


def _checkpointed_forward(self: nn.Module, *args, **kwargs):
    """The forward `checkpoint_units` gives a unit: its class's forward, checkpointed while training."""
    plain = functools.partial(type(self).forward, self)
    if not (self.training and torch.is_grad_enabled()):
        return plain(*args, **kwargs)
    return _run(self, plain, self.checkpoint_policy, *args, **kwargs)


def checkpoint_units(units: Iterable[nn.Module], policy: Union[bool, str] = "full", every: int = 1) -> int:
    """Checkpoint unit i (from 0) of `units` under `policy` when i % every == 0; the other units,
    and all of them with policy 'none' (or False), get their plain forward back. Returns how many
    units are checkpointed. Call it again to change the policy."""
    policy = resolve_policy(policy)
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"checkpoint every must be an int >= 1, got {every!r}")
    n = 0
    for i, unit in enumerate(units):
        unit.__dict__.pop("forward", None)
        unit.__dict__.pop("checkpoint_policy", None)
        if policy != "none" and i % every == 0:
            unit.checkpoint_policy = policy
            unit.forward = types.MethodType(_checkpointed_forward, unit)
            n += 1
    return n
