"""The run's quantization: quantization-aware training and the quantized model at the end.

`train.qat` swaps the linears for torchao's fake-quantized ones before any wrapping. With
`train.quantize` the last step evaluates a bf16 copy (`quant_ref_*`) and the quantized model
(`quant_*`); train/finish.py writes it to out_dir/quantized/. Rank 0 evaluates, on the weights
gathered from FSDP2's shards where the model is sharded.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from zoo.quantization import prepare_qat, quantize, remove_fake_quantization
from zoo.weights.zoo_folder import cast_weights

from ..config import QAT_SCHEMES

DEPLOY_DTYPE = torch.bfloat16


def prepare(model: nn.Module, t, say) -> nn.Module:
    """train.qat: fake-quantize the model's linears (in place)."""
    if t.qat:
        prepare_qat(model, QAT_SCHEMES[t.qat], t.quant_group_size, t.quant_keep, DEPLOY_DTYPE)
        say(f"qat: {t.qat} fake quantization on the linears outside {', '.join(t.quant_keep)} "
            f"(converts to {QAT_SCHEMES[t.qat]} at the end)")
    return model


def deployed_copy(model: nn.Module) -> nn.Module:
    """The final model as deployed, before quantization: a bf16 copy without QAT's fake quantization."""
    q = cast_weights(copy.deepcopy(model), DEPLOY_DTYPE).eval().requires_grad_(False)
    if getattr(q, "qat", None):  # (a model gathered from FSDP2's shards is built without it)
        remove_fake_quantization(q)
    return q


def quantized_evaluation(run) -> dict:
    """The deployed model's evaluation before and after quantization (quant_ref_*, quant_*); sets
    run.quantized. {} on ranks other than 0 and when the run quantizes nothing."""
    from ..finish import consolidated
    t = run.cfg.train
    if not (t.qat or t.quantize):
        return {}
    whole, _ = consolidated(run)  # FSDP2: every rank takes part in the gathering
    if not run.par.main:
        return {}
    model = deployed_copy(whole)
    with run.autocast():
        ref = run.task.evaluate(model)
    run.quantized = quantize(model, QAT_SCHEMES[t.qat] if t.qat else t.quantize, t.quant_group_size, t.quant_keep)
    with run.autocast():
        ev = run.task.evaluate(run.quantized)
    return {**{f"quant_ref_{k}": v for k, v in ref.items()}, **{f"quant_{k}": v for k, v in ev.items()}}
