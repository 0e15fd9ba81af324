"""LoRA of a FLUX.2 transformer in diffusers' file: what Flux2KleinPipeline's `save_lora_weights` writes and its
`load_lora_weights` reads.

    save_lora(model, "out/lora")          # out/lora/pytorch_lora_weights.safetensors
    load_lora(model, "out/lora")          # or the file; a file diffusers wrote
    fill_adapter(model, path)             # adapter.init_from: the adapter held, from such a file or a PEFT folder

`model`: a Zoo Flux2, or a model holding one (a latent diffusion's denoiser). Keys `transformer.<diffusers module>.
lora_A.weight` / `lora_B.weight`; the LoRA config (r, lora_alpha, use_rslora, use_dora) sits in the header's
`lora_adapter_metadata`, and a file without it has alpha = r, as diffusers reads it.
"""
from __future__ import annotations

import json
from pathlib import Path

from ..adapters import apply_adapters, differences, peft_target
from .diffusers_flux2 import module_names
from .files import load_tensors, read_safetensors_header, save_safetensors
from .peft_lora import PREFIX, adapter_state, files, load_adapter_weights, lora_config, lora_fields, read_config

LORA_WEIGHTS, LORA_PREFIX, LORA_META = "pytorch_lora_weights.safetensors", "transformer.", "lora_adapter_metadata"


def lora_file(path) -> Path:
    p = Path(path)
    return p / LORA_WEIGHTS if p.is_dir() else p


def save_lora(model, path, dtype=None) -> Path:
    """Write the active LoRA / DoRA adapter of the FLUX.2 transformer in `model` as diffusers' LoRA file:
    <path>/pytorch_lora_weights.safetensors (or `path`, a .safetensors name). Returns the file."""
    model = getattr(model, "_orig_mod", model)
    cfg = getattr(model, "adapter_configs", {}).get(getattr(model, "active_adapter", None))
    if cfg is None or not cfg.mergeable:
        raise ValueError("save_lora: the model has no LoRA / DoRA adapter")
    state = {k[len(PREFIX):]: v for k, v in adapter_state(model).items()}
    modules = {k.rsplit(".lora_", 1)[0] for k in state}
    if outside := sorted(modules - set(module_names(model).values())):
        raise ValueError(f"save_lora: {outside[0]} is not in a FLUX.2 transformer (the file holds the transformer's)")
    meta = {LORA_PREFIX + k: v for k, v in lora_fields(cfg, modules).items()}
    f = Path(path) if Path(path).suffix == ".safetensors" else Path(path) / LORA_WEIGHTS
    return save_safetensors({LORA_PREFIX + k: v.detach().to("cpu", dtype or v.dtype).contiguous()
                             for k, v in state.items()}, f, {LORA_META: json.dumps(meta, sort_keys=True)})


def lora_file_config(f: Path, tensors: dict):
    """The AdapterConfig of diffusers' LoRA file `f` holding `tensors`: its header's LoRA config, else r from the
    tensors and alpha = r; the targets are the modules it holds."""
    if bad := [k for k in tensors if not (k.startswith(LORA_PREFIX) and ".lora_" in k)]:
        raise ValueError(f"{f}: {bad[0]}: not diffusers' LoRA file of a FLUX.2 transformer "
                         f"({LORA_PREFIX}<module>.lora_A.weight / .lora_B.weight)")
    ranks = sorted({t.shape[0] for k, t in tensors.items() if k.endswith(".lora_A.weight")})
    if len(ranks) != 1:
        raise ValueError(f"{f}: LoRA ranks {ranks}: one rank for all modules is supported")
    raw = read_safetensors_header(f)[1].get(LORA_META)
    try:
        meta = {k[len(LORA_PREFIX):]: v for k, v in json.loads(raw).items() if k.startswith(LORA_PREFIX)} if raw else {}
    except (ValueError, AttributeError):
        raise ValueError(f"{f}: {LORA_META} in the header is not a JSON object") from None
    targets = sorted({peft_target(k[len(LORA_PREFIX):].rsplit(".lora_", 1)[0]) for k in tensors})
    return lora_config({"peft_type": "LORA", "r": ranks[0], "lora_alpha": ranks[0], **meta, "target_modules": targets},
                       f)


def load_lora(model, path, name: str = "default"):
    """Read diffusers' LoRA file (`path`: the file, or a folder holding pytorch_lora_weights.safetensors) into the
    FLUX.2 transformer in `model` as the adapter `name`, added as the file describes it or, when `model` holds it
    already, filled where the file agrees with it; a module the file leaves out adds nothing. Returns the model."""
    f = lora_file(path)
    tensors = load_tensors(f)
    cfg, have = lora_file_config(f, tensors), getattr(model, "adapter_configs", {}).get(name)
    if have is None:
        apply_adapters(model, cfg, str(f), name=name)
    elif differ := differences(cfg, have):
        raise ValueError(f"{f}: the file's LoRA differs from adapter {name!r}: {differ}")
    load_adapter_weights(model, f, name, {PREFIX + k[len(LORA_PREFIX):]: v for k, v in tensors.items()})
    return model


def fill_adapter(model, path, name: str = "default"):
    """Fill the adapter `name` of `model` from `path`: diffusers' LoRA file (a .safetensors, or a folder holding
    pytorch_lora_weights.safetensors) or an adapter folder, whose config must be the adapter's."""
    if lora_file(path).suffix == ".safetensors" and lora_file(path).is_file():
        return load_lora(model, path, name)
    config, weights = files(Path(path))
    if differ := differences(read_config(Path(path)), model.adapter_configs[name]):
        raise ValueError(f"{config}: the folder's adapter differs from adapter {name!r}: {differ}")
    load_adapter_weights(model, weights, name)
    return model
