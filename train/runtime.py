"""Runtime choices applied to a built model: how it runs, not what it computes.

A model config (zoo/config.py) describes the architecture only. The run config's train: section
holds the choices that change how a built model runs, and `apply_runtime` applies them from
outside the model, as torchtitan applies activation checkpointing:

    train.attn_backend                    every CausalSelfAttention's backend (zoo/blocks/attention.py)
    train.activation_checkpointing        none | full | selective (or false / true) on the model's
    train.activation_checkpointing_every  checkpoint_units(), every n-th from the first (zoo/blocks/checkpoint.py)
    train.chunked_loss, train.loss_chunk_size   the LLM's loss, chunk by chunk without the full logits

It runs where the model is built for training: the run builder's `build_model` (train/builder.py:
the loop, the LR finder, the benchmarks) and train/plan.py's `build_model` (the planner's model).
"""
from __future__ import annotations

from typing import Callable

from torch import nn

from zoo.blocks.attention import CausalSelfAttention, flash_available, set_backend
from zoo.blocks.checkpoint import checkpoint_units, resolve_policy
from zoo.config import ConfigError


def apply_runtime(model: nn.Module, train_cfg, log: Callable[[str], None] = lambda s: None,
                  source: str = "<config>") -> nn.Module:
    """Apply train_cfg's attention backend, activation checkpointing and chunked-loss settings to
    `model` (in place; returned for chaining). A choice the model cannot take is a one-line
    ConfigError naming the key."""
    t = train_cfg
    if any(isinstance(m, CausalSelfAttention) for m in model.modules()):
        if t.attn_backend == "flash" and flash_available() is None:
            raise ConfigError(f"{source}: train.attn_backend=flash needs flash-attn, which is not installed or "
                              f"does not import (pip install -e '.[flash]', CUDA only); use auto or sdpa")
        set_backend(model, t.attn_backend)
    policy = resolve_policy(t.activation_checkpointing)
    units = model.checkpoint_units() if hasattr(model, "checkpoint_units") else []
    if policy != "none":
        if not units:
            raise ConfigError(f"{source}: train.activation_checkpointing={t.activation_checkpointing}: "
                              f"{type(model).__name__} exposes no checkpoint_units()")
        n = checkpoint_units(units, policy, t.activation_checkpointing_every)
        log(f"activation checkpointing: {policy} on {n} of {len(units)} units "
            f"(every {t.activation_checkpointing_every})")
    elif units:
        checkpoint_units(units, "none")
    if hasattr(model, "chunked_loss"):
        model.chunked_loss, model.loss_chunk_size = t.chunked_loss, t.loss_chunk_size
    return model
