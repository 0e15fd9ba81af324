"""The run's model, built one way for the run builder (train/builder.py) and the memory planner
(train/planner.py), so that what the planner counts is what the loop trains. `apply_runtime` sets how a
built model runs from outside the model; the config is never changed.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from zoo.adapters import apply_adapters
from zoo.blocks.attention import CausalSelfAttention, flash_available, set_backend
from zoo.blocks.checkpoint import checkpoint_units, resolve_policy
from zoo.blocks.mla import MultiHeadLatentAttention
from zoo.blocks.moe import MoE
from zoo.config import ConfigError

from .features.float8 import prepare as prepare_float8
from .features.quantize import prepare as prepare_qat


def apply_runtime(model: nn.Module, train_cfg, log: Callable[[str], None] = lambda s: None,
                  source: str = "<config>") -> nn.Module:
    """train_cfg's attention backend, activation checkpointing, chunked loss, MoE and indexer settings, set on `model`
    in place (returned); a choice the model cannot take is a one-line ConfigError naming the key."""
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
    for m in filter(lambda m: isinstance(m, MoE), model.modules()):
        m.capacity_factor, m.jitter, m.dispatch = t.moe_capacity_factor, t.moe_router_jitter, t.moe_dispatch
    train_indexers(model, t, source)
    return model


def train_indexers(model: nn.Module, t, source: str):
    """train.index_loss_coef: the lightning indexers report their KL (zoo/blocks/mla.py); train.index_warmup: the
    attention dense and every weight but the indexers' frozen (DeepSeek-V3.2's dense warm-up)."""
    attns = [m for m in model.modules() if isinstance(m, MultiHeadLatentAttention) and m.indexer is not None]
    if t.index_loss_coef and not attns:
        raise ConfigError(f"{source}: train.index_loss_coef={t.index_loss_coef} needs lightning indexers "
                          f"(model.mla.index_heads > 0)")
    for m in attns:
        m.index_loss, m.dense = t.index_loss_coef > 0, t.index_warmup
    if t.index_warmup:
        model.requires_grad_(False)
        for m in attns:
            m.indexer.requires_grad_(True)


def fresh_model(cfg) -> nn.Module:
    """cfg.model with fresh weights; an autoencoder with weights built as its weightless variant (same shapes)."""
    import zoo
    model_cfg, ae = cfg.model, getattr(cfg.model, "autoencoder", None)
    if ae is not None and ae.weights:
        from torch._subclasses.fake_tensor import unset_fake_temporarily
        from zoo.diffusion.latent import build_autoencoder
        with unset_fake_temporarily(), torch.device("cpu"):
            variant = build_autoencoder(model_cfg, cfg.source).variant
        model_cfg = dataclasses.replace(model_cfg, autoencoder=dataclasses.replace(ae, weights=None, **variant))
    return zoo.build(model_cfg)


def adapter_from(model: nn.Module, cfg):
    """The new adapter's weights from adapter.init_from (a PEFT adapter folder or diffusers' LoRA file)."""
    from zoo.weights.diffusers_lora import fill_adapter
    try:
        fill_adapter(model, cfg.adapter.init_from)
    except (ValueError, OSError) as e:
        raise ConfigError(f"{cfg.source}: adapter.init_from: {e}") from None


def build_model(cfg, task=None, device: Optional[torch.device] = None, say=lambda m: None,
                fsdp: bool = False) -> nn.Module:
    """The run's model in training mode on `device` (default: where built): task.build_model() or `fresh_model`,
    seeded by train.seed; runtime choices, channels-last, adapters, bf16-pure, float8, QAT applied (fsdp: FSDP2
    to come)."""
    torch.manual_seed(cfg.train.seed)
    model = apply_runtime(task.build_model() if task is not None else fresh_model(cfg), cfg.train, say, cfg.source)
    model = (model if device is None else model.to(device)).train()  # from_pretrained returns eval mode
    if cfg.train.channels_last:  # as model.to(memory_format=...) lays them out, on fake tensors too
        with torch.no_grad():
            for t in [*model.parameters(), *model.buffers()]:
                if t.dim() == 4:
                    t.data = t.to(memory_format=torch.channels_last)
    if cfg.adapter.enabled:
        apply_adapters(model, cfg.adapter, cfg.source, say)
    if cfg.adapter.init_from and not is_fake(next(model.parameters())):  # the planner's fake tensors hold no values
        adapter_from(model, cfg)
        say(f"adapter: from {cfg.adapter.init_from}")
    if cfg.train.precision == "bf16-pure":  # the weights themselves in bf16 (buffers stay fp32), fake tensors too
        with torch.no_grad():
            for p in model.parameters():
                p.data = p.to(torch.bfloat16)
    prepare_float8(model, cfg.train, device or next(model.parameters()).device, fsdp, say)
    return prepare_qat(model, cfg.train, say)
