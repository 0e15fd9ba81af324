"""Float8 training (`train.float8`): torchao's Float8Linear in place of the model's linears.

The forward and backward matmuls run in float8 with dynamic scales, weights and optimizer in high
precision, as torchtitan trains Llama 3. Kept in high precision: `train.float8_keep` (the LM head, the
most sensitive layer), linears whose dimensions are not multiples of 16 (the float8 matmul needs them)
and with `train.float8_skip_small` those too small to gain. Without a GPU of compute capability 8.9+
torchao emulates the matmul (same casts and scales), so the same path runs and is tested on a CPU.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from zoo.quantization import kept


def float8_targets(model: nn.Module, t) -> list[str]:
    """The qualified names of the linears `train.float8` converts."""
    from torchao.float8 import _auto_filter_for_recipe
    small = _auto_filter_for_recipe(t.float8_recipe, filter_fqns=[])  # True: large enough to gain

    def converted(name, m) -> bool:
        out_f, in_f = m.weight.shape
        return (not kept(name, t.float8_keep) and out_f % 16 == 0 and in_f % 16 == 0
                and (not t.float8_skip_small or small(m, name)))
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and converted(n, m)]


def prepare(model: nn.Module, t, device: torch.device, fsdp: bool, say) -> nn.Module:
    """train.float8: swap the target linears for Float8Linear (in place, before any wrapping)."""
    if not t.float8:
        return model
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    names, total = set(float8_targets(model, t)), sum(isinstance(m, nn.Linear) for m in model.modules())
    if not names:
        raise ValueError(f"train.float8: none of the {total} linears can be converted (train.float8_keep="
                         f"{t.float8_keep}, dimensions not multiples of 16, or train.float8_skip_small)")
    real = device.type == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability(device) >= (8, 9)
    cfg = dataclasses.replace(Float8LinearConfig.from_recipe_name(t.float8_recipe), emulate=not real,
                              enable_fsdp_float8_all_gather=fsdp and real and t.float8_recipe == "tensorwise")
    convert_to_float8_training(model, config=cfg, module_filter_fn=lambda m, name: name in names)
    say(f"float8: {t.float8_recipe} scaling on {len(names)} of {total} linears"
        + (", float8 all-gather under FSDP2" if cfg.enable_fsdp_float8_all_gather else "")
        + ("" if real else f" (emulated: {device} has no float8 matmul, compute capability 8.9+ needed)"))
    return model
