"""Quantized inference and quantization-aware training of a model's linear layers, through torchao.

    model = zoo.quantize(model, "int4wo", group_size=32)    # in place; returns the model
    zoo.save_pretrained(model, "out/")                      # a quantized Zoo folder (zoo/weights/quantized.py)

LLM schemes (`SCHEMES`) swap torchao's tensor subclasses into every nn.Linear outside `keep`; ConvNets take `int8`
(`quantize_convnet`, PT2E on a CPU). QAT (`prepare_qat`, `convert_qat`) uses torchao's FakeQuantizedLinear; int4wo
uses Zoo's `Int4FakeQuantizer`, which rounds exactly as the conversion will (torchao's generic one does not).
docs/deploy.md has the schemes and kernels.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

SCHEMES = ("int8wo", "int4wo", "8da4w")   # an LLM's linears (torchao tensor subclasses)
CONVNET_SCHEMES = ("int8",)              # a ConvNet: PT2E static int8 on a CPU
KEEP = ("embed", "lm_head")          # stay in 16-bit unless `keep` says otherwise
INT4_CPU_GROUPS = (32, 64, 128)     # the group sizes the CPU int4 kernel packs


def _check_scheme(scheme: str, allowed: tuple = SCHEMES + CONVNET_SCHEMES):
    if scheme not in allowed:
        raise ValueError(f"unknown quantization scheme {scheme!r} (choose from {', '.join(allowed)})")


def has_conv(model: nn.Module) -> bool:
    return any(isinstance(m, nn.Conv2d) for m in model.modules())


def kept(name: str, keep: Iterable[str]) -> bool:
    """Whether the module of qualified name `name` stays in 16-bit under `keep`."""
    last = name.rsplit(".", 1)[-1]
    return any(name == k or name.startswith(k + ".") or last == k for k in keep)


def targets(model: nn.Module, keep: Iterable[str] = KEEP) -> list[str]:
    """The qualified names of the nn.Linear modules a scheme quantizes (in module order)."""
    keep = tuple(keep)
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and not kept(n, keep)]


def _linears(model: nn.Module, keep: tuple, scheme: str, group_size: int, doing: str) -> tuple[list[str], str]:
    """(the linears outside `keep`, their device type), once `scheme` can quantize them in groups of `group_size`."""
    names = targets(model, keep)
    if not names:
        raise ValueError(f"no nn.Linear to {doing} in the {type(model).__name__} outside keep={list(keep)}")
    mods = dict(model.named_modules())
    device = mods[names[0]].weight.device.type
    if scheme == "int8wo":
        return names, device
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if scheme == "int4wo" and device == "cpu" and group_size not in INT4_CPU_GROUPS:
        raise ValueError(f"int4wo on a CPU packs groups of {', '.join(map(str, INT4_CPU_GROUPS))}, "
                         f"not group_size={group_size}")
    if bad := [f"{n} ({mods[n].in_features} inputs)" for n in names if mods[n].in_features % group_size]:
        raise ValueError(f"group_size={group_size} does not divide the input size of {bad[0]}"
                         + (f" and {len(bad) - 1} more" if len(bad) > 1 else ""))
    return names, device


def ptq_config(scheme: str, group_size: int, device: str):
    """The torchao config that quantizes a linear for `scheme` on a device of type `device`."""
    from torchao.quantization import Int8DynamicActivationIntxWeightConfig, Int8WeightOnlyConfig
    from torchao.quantization.granularity import PerGroup
    _check_scheme(scheme, SCHEMES)
    if scheme == "int8wo":
        return Int8WeightOnlyConfig()
    if scheme == "8da4w":
        return Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(group_size))
    if device == "cpu":
        from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig
        return PrototypeInt4WeightOnlyConfig(group_size=group_size, set_inductor_config=False)
    if device == "cuda":
        from torchao.quantization import Int4WeightOnlyConfig
        return Int4WeightOnlyConfig(group_size=group_size, int4_packing_format="tile_packed_to_4d",
                                    set_inductor_config=False)
    raise ValueError(f"int4wo has no kernel on device type {device!r} (cpu and cuda have one)")


def quantize(model: nn.Module, scheme: str, group_size: int = 32, keep: Iterable[str] = KEEP) -> nn.Module:
    """Quantize the model's linears (all but `keep`) in place for `scheme` (int8wo, int4wo, 8da4w)
    and return it. The weights become torchao tensor subclasses and stop requiring gradients; the
    model records what was done in `model.quantization` (what zoo.save_pretrained writes)."""
    from torchao.quantization import quantize_
    _check_scheme(scheme)
    if scheme in CONVNET_SCHEMES or has_conv(model):
        raise ValueError(f"scheme {scheme!r} on a {type(model).__name__}: {', '.join(SCHEMES)} quantize an LLM's "
                         f"linears; a ConvNet takes 'int8' (zoo.quantize(model, 'int8', calibration=batches))")
    if getattr(model, "quantization", None):
        raise ValueError(f"the model is already quantized ({model.quantization['scheme']})")
    keep = tuple(keep)
    names, device = _linears(model, keep, scheme, group_size, "quantize")
    wanted = set(names)
    quantize_(model, ptq_config(scheme, group_size, device), filter_fn=lambda m, fqn: fqn in wanted)
    mods = dict(model.named_modules())
    model.quantization = {"scheme": scheme, "group_size": group_size, "keep": list(keep),
                          "layout": sorted({type(mods[n].weight).__name__ for n in names}), "device": device}
    return model


def is_quantized(model: nn.Module) -> bool:
    return bool(getattr(getattr(model, "_orig_mod", model), "quantization", None))


# ------------------------------------------------------------------ quantization-aware training
def int4_round_trip(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """`w` (out, in) rounded to int4wo's grid and back, in w's dtype, through torchao's tinygemm
    functions (asymmetric, one scale and float zero point per group of `group_size` inputs)."""
    from torchao.quantization.quant_primitives import (MappingType, _choose_qparams_affine_tinygemm,
                                                       _dequantize_affine_tinygemm, _quantize_affine_tinygemm)
    block = (1, group_size)
    scale, zero = _choose_qparams_affine_tinygemm(w, MappingType.ASYMMETRIC, block, torch.int32, 0, 15, 1e-6,
                                                  None, w.dtype)
    levels = _quantize_affine_tinygemm(w, block, scale, zero, torch.int32, 0, 15)
    return _dequantize_affine_tinygemm(levels, block, scale, zero, torch.int32, 0, 15, output_dtype=w.dtype)


class _StraightThrough(torch.autograd.Function):
    """Forward: the rounded weight; backward: the gradient of the weight unchanged."""

    @staticmethod
    def forward(ctx, w, rounded):
        return rounded

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class Int4FakeQuantizer(nn.Module):
    """int4wo's fake quantizer (a FakeQuantizedLinear's `weight_fake_quantizer`): the weight rounded in
    `dtype`, the converted model's, as `int4_round_trip`; the gradient passes straight through.
    `config`: the torchao config it stands in for (torchao's convert step reads it)."""

    def __init__(self, group_size: int, dtype: torch.dtype = torch.bfloat16, config=None):
        super().__init__()
        self.group_size, self.dtype, self.config = group_size, dtype, config

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            rounded = int4_round_trip(w.to(self.dtype), self.group_size).to(w.dtype)
        return _StraightThrough.apply(w, rounded)

    def extra_repr(self) -> str:
        return f"group_size={self.group_size}, dtype={self.dtype}"


def fake_quant_configs(scheme: str, group_size: int):
    """(activation, weight) torchao fake-quantize configs with the numerics of `scheme`'s kernels.
    int4wo's (asymmetric, the zero point a float) is torchao's nearest; prepare_qat replaces its
    quantizer with `Int4FakeQuantizer`, which rounds as the conversion does."""
    from torchao.quantization.qat import IntxFakeQuantizeConfig
    from torchao.quantization.quant_primitives import ZeroPointDomain
    _check_scheme(scheme, SCHEMES)
    if scheme == "int8wo":
        return None, IntxFakeQuantizeConfig(torch.int8, "per_channel", is_symmetric=True)
    if scheme == "int4wo":
        return None, IntxFakeQuantizeConfig(torch.int4, group_size=group_size, is_symmetric=False,
                                            zero_point_domain=ZeroPointDomain.FLOAT,
                                            zero_point_precision=torch.float32)
    return (IntxFakeQuantizeConfig(torch.int8, "per_token", is_symmetric=False),
            IntxFakeQuantizeConfig(torch.int4, group_size=group_size, is_symmetric=True))


def prepare_qat(model: nn.Module, scheme: str, group_size: int = 32, keep: Iterable[str] = KEEP,
                dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """Swap the linears `quantize` would quantize for torchao's FakeQuantizedLinear (same weight
    parameter, same state-dict names), in place; returns the model. `dtype`: the dtype the model
    will be converted in (int4wo's fake quantizer rounds in it)."""
    from torchao.quantization import quantize_
    from torchao.quantization.qat import QATConfig
    keep = tuple(keep)
    names, _ = _linears(model, keep, scheme, group_size, "train quantization-aware")
    act, weight = fake_quant_configs(scheme, group_size)
    wanted = set(names)
    quantize_(model, QATConfig(activation_config=act, weight_config=weight, step="prepare"),
              filter_fn=lambda m, fqn: fqn in wanted)
    if scheme == "int4wo":
        mods = dict(model.named_modules())
        for n in names:
            mods[n].weight_fake_quantizer = Int4FakeQuantizer(group_size, dtype, mods[n].weight_fake_quantizer.config)
    model.qat = {"scheme": scheme, "group_size": group_size, "keep": list(keep)}
    return model


def remove_fake_quantization(model: nn.Module) -> dict:
    """Swap prepare_qat's fake-quantized linears back to nn.Linear in place; returns prepare_qat's record."""
    from torchao.quantization import quantize_
    from torchao.quantization.qat import FakeQuantizedLinear, QATConfig
    qat = getattr(model, "qat", None)
    if not qat:
        raise ValueError("the model was not prepared for quantization-aware training (zoo.quantization.prepare_qat)")
    quantize_(model, QATConfig(step="convert"), filter_fn=lambda m, fqn: isinstance(m, FakeQuantizedLinear))
    del model.qat
    return qat


def convert_qat(model: nn.Module) -> nn.Module:
    """Swap prepare_qat's fake-quantized linears back to nn.Linear and quantize the model with the
    same scheme, in place (in the model's dtype: cast it first to deploy in another); returns it."""
    qat = remove_fake_quantization(model)
    return quantize(model, qat["scheme"], qat["group_size"], qat["keep"])


# ------------------------------------------------------------------ ConvNets: PT2E static int8
def quantize_convnet(model: nn.Module, calibration, scheme: str = "int8") -> nn.Module:
    """int8 static post-training quantization of a ConvNet on a CPU (PT2E, X86InductorQuantizer):
    exported with a dynamic batch, calibrated on `calibration` (image batches (B, C, H, W), B >= 2).
    Returns a new module (compile it with `compile_frozen` for the int8 kernels); `model` is unchanged."""
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
    from torchao.quantization.pt2e.quantizer import x86_inductor_quantizer as xiq
    if scheme not in CONVNET_SCHEMES:
        raise ValueError(f"unknown ConvNet quantization scheme {scheme!r} (choose from {', '.join(CONVNET_SCHEMES)})")
    if not has_conv(model):
        raise ValueError(f"scheme {scheme!r} quantizes a ConvNet; the {type(model).__name__} has no nn.Conv2d "
                         f"(an LLM takes {', '.join(SCHEMES)})")
    device = next(model.parameters()).device.type
    if device != "cpu":
        raise ValueError(f"scheme {scheme!r} (PT2E with the x86 inductor quantizer) runs on a CPU, the model is on {device}")
    batches = iter(calibration)
    first = next(batches, None)
    if first is None or first.dim() != 4 or first.shape[0] < 2:
        raise ValueError("calibration: at least one image batch (B, C, H, W) with B >= 2, got "
                         + ("nothing" if first is None else f"shape {tuple(first.shape)}"))
    was = model.training
    model.eval()
    try:
        batch = torch.export.Dim("batch", min=2)
        graph = torch.export.export(model, (first,), dynamic_shapes=({0: batch},)).module()
    finally:
        model.train(was)
    quantizer = xiq.X86InductorQuantizer().set_global(xiq.get_default_x86_inductor_quantization_config())
    prepared = prepare_pt2e(graph, quantizer)
    n = 0
    with torch.no_grad():
        for x in (first, *batches):
            prepared(x)
            n += 1
    out = convert_pt2e(prepared)
    out.quantization = {"scheme": scheme, "method": "pt2e-x86-inductor", "calibration_batches": n,
                        "source": type(model).__name__}
    return out


def compile_frozen(module: nn.Module):
    """torch.compile with inductor's `freezing` on (oneDNN's int8 kernels for a PT2E graph); call under no_grad."""
    import torch._inductor.config as inductor_config
    compiled = torch.compile(module)

    def run(x):
        with inductor_config.patch(freezing=True):
            return compiled(x)
    return run
