"""Quantized LLMs (zoo/quantization.py) on disk: a Zoo folder whose weights are torchao's.

    out/config.yaml        family: llm, the model: section, and quantization: {scheme, group_size, ...}
    out/model.pt           the quantized state dict (torchao's tensor subclasses)
    out/tokenizer.*        the tokenizer file, when given

model.pt loads with weights_only=True; a device without the scheme's kernel is a one-line error.
"""
from __future__ import annotations

from pathlib import Path
from typing import Union

import torch

from ..config import load_yaml, model_config_from, to_dict
from .files import atomic_write, load_tensors
from .zoo_folder import CONFIG, _folder, cast_weights, folder_config, write_config

WEIGHTS = "model.pt"
# tensor subclass -> the device types its kernels run on (others run wherever torch runs)
LAYOUT_DEVICES = {"Int4OpaqueTensor": ("cpu",), "Int4TilePackedTo4dTensor": ("cuda",)}


def detect(path) -> bool:
    """A folder with config.yaml holding a `quantization:` section, and model.pt."""
    data = folder_config(path, WEIGHTS)
    return data is not None and isinstance(data.get("quantization"), dict)


def exports(model) -> bool:
    from ..quantization import is_quantized
    return is_quantized(model)


def save(model, path, tokenizer=None, **_) -> Path:
    """Write a quantized LLM as a folder (config.yaml, model.pt, the tokenizer if given); returns it."""
    model = getattr(model, "_orig_mod", model)
    if getattr(model, "family", None) != "llm":
        raise ValueError(f"a quantized Zoo folder holds LLMs, not a {type(model).__name__}")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / WEIGHTS, lambda tmp: torch.save(model.state_dict(), tmp))
    q = dict(model.quantization, dtype=str(model.embed.weight.dtype).removeprefix("torch."))
    return write_config(out, {"family": "llm", "model": to_dict(model.config), "quantization": q}, tokenizer)


def check_device(q: dict, device: str, source: str):
    """A one-line error when the file's packed layout has no kernel on `device` (a device type)."""
    for layout in q.get("layout", []):
        where = LAYOUT_DEVICES.get(layout)
        if where is not None and device not in where:
            raise ValueError(f"{source}: {q['scheme']} weights packed for {q.get('device', where[0])} ({layout}) do not "
                             f"run on {device}; quantize the 16-bit model on this device instead "
                             f"(zoo.quantize(model, '{q['scheme']}'))")


def load(path, dtype: Union[torch.dtype, str, None] = None, device: Union[torch.device, str, None] = None):
    """Build the LLM of config.yaml and load the quantized model.pt into it (eval mode). The 16-bit dtype is the file's
    (a `dtype` that differs is an error: quantized weights are not recast); device defaults to the CPU."""
    from ..config import LLMConfig, without_moved
    from ..llm import LLM
    f = _folder(path, WEIGHTS)
    data = load_yaml(f / CONFIG)
    q = data["quantization"]
    device = torch.device(device or "cpu")
    try:
        import torchao.prototype.quantization.int4  # noqa: F401  (registers the CPU int4 layout for loading)
        import torchao.quantization  # noqa: F401
    except ImportError:
        raise ValueError(f"{f / CONFIG}: a {q.get('scheme')} model needs torchao (pip install 'torchao>=0.18')") from None
    check_device(q, device.type, str(f / WEIGHTS))
    saved = getattr(torch, str(q.get("dtype", "bfloat16")))
    if dtype not in (None, "auto") and (getattr(torch, dtype) if isinstance(dtype, str) else dtype) != saved:
        raise ValueError(f"{f / CONFIG}: the quantized model runs in {saved} (its 16-bit parts); dtype={dtype} "
                         f"would need the unquantized weights")
    cfg = model_config_from(without_moved(LLMConfig, data["model"]), "llm", str(f / CONFIG))
    with torch.device(device):
        model = cast_weights(LLM(cfg), saved)
    model.requires_grad_(False)
    state = {k: v.to(device) for k, v in load_tensors(f / WEIGHTS).items()}
    want = set(model.state_dict())
    if set(state) != want:
        extra, missing = sorted(set(state) - want), sorted(want - set(state))
        raise ValueError(f"{f / WEIGHTS}: weights do not match {f / CONFIG} "
                         f"(missing: {missing[:3]}; unexpected: {extra[:3]})")
    model.load_state_dict(state, assign=True)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    model.quantization = {k: v for k, v in q.items() if k != "dtype"}
    return model.eval()
