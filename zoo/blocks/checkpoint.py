"""Activation checkpointing policies for a stack of blocks: which blocks recompute their forward
in the backward pass instead of keeping their activations, and what a recomputed block keeps.

Chen, Xu, Zhang & Guestrin, "Training Deep Nets with Sublinear Memory Cost" (2016); the selective
policy after Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models"
(2022): keep the outputs of the expensive ops, recompute the cheap ones.

    policy "none" (or False)   every block keeps its activations
    policy "full" (or True)    a checkpointed block keeps only its inputs; the backward runs its forward again
    policy "selective"         a checkpointed block keeps the outputs of its matmuls, convolutions and
                               attention (MATMUL_OPS) and recomputes the rest (norms, activations,
                               element-wise ops): most of the memory saved for little recompute
    every = n                  only blocks 0, n, 2n, ... are checkpointed (1: every block)

`run_block(block, i, policy, every, *args, **kwargs)` calls `block(*args, **kwargs)` as block i of
its stack under the policy (through torch.utils.checkpoint, non-reentrant, RNG state preserved so
dropout and stochastic depth draw the same masks again). Running statistics (BatchNorm) are not
updated twice: while a block is recomputed their momentum is 0 and their batch count is restored.
Checkpointing applies only when gradients are being recorded (`torch.is_grad_enabled()`) and
the block is training. Shapes: whatever the block takes and returns. torch only.
"""
from __future__ import annotations

import functools
from typing import Union

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
    """fn whose second and later calls (the recomputation) leave BatchNorm's running statistics as
    they are."""
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


def run_block(block: nn.Module, i: int, policy: Union[bool, str], every: int, *args, **kwargs):
    """block(*args, **kwargs) as block `i` (from 0) of its stack, checkpointed as the policy says."""
    policy = resolve_policy(policy)
    if policy == "none" or i % every or not (block.training and torch.is_grad_enabled()):
        return block(*args, **kwargs)
    fn = _frozen_stats(block, block)
    if policy == "full":
        return checkpoint(fn, *args, use_reentrant=False, **kwargs)
    return checkpoint(fn, *args, use_reentrant=False,
                      context_fn=functools.partial(create_selective_checkpoint_contexts, _keep_matmuls), **kwargs)
