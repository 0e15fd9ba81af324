"""diffusers Flux2Transformer2DModel folders in and out.

A folder with config.json (`_class_name: Flux2Transformer2DModel`) and the safetensors, or a pipeline folder's
`transformer/`, loads as Zoo's Flux2; `save(model, folder)` writes one diffusers loads. Zoo's names are diffusers'
but for the block lists (`double_blocks`, `single_blocks`), the single blocks' `attn.` level and the double blocks'
`attn.to_out.0` (`attn.to_out`). Sharded checkpoints and patch sizes other than one are refused in one line.
`module_names` gives diffusers' names of the modules, which LoRA targets and files use (diffusers_lora.py).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from ..config import Flux2Config
from .files import atomic_write, diffusers_folder, load_shards, mismatches, save_safetensors

CLASS, WEIGHTS = "Flux2Transformer2DModel", "diffusion_pytorch_model.safetensors"
# (diffusers' config key, Zoo's Flux2Config field, diffusers' default)
KEYS = [("num_layers", "double_depth", 8), ("num_single_layers", "single_depth", 48),
        ("num_attention_heads", "heads", 48), ("attention_head_dim", "head_dim", 128), ("mlp_ratio", "mlp_ratio", 3.0),
        ("in_channels", "in_channels", 128), ("out_channels", "out_channels", None),
        ("joint_attention_dim", "text_dim", 15360), ("axes_dims_rope", "rope_axes", (32, 32, 32, 32)),
        ("rope_theta", "rope_theta", 2000), ("guidance_embeds", "guidance", True),
        ("timestep_guidance_channels", "timestep_dim", 256), ("eps", "eps", 1e-6)]
# (diffusers' name pattern, Zoo's), both directions
NAMES = [(r"^transformer_blocks\.(\d+)\.attn\.to_out\.0\.", r"double_blocks.\1.attn.to_out."),
         (r"^transformer_blocks\.", "double_blocks."), (r"^single_transformer_blocks\.(\d+)\.attn\.", r"single_blocks.\1.")]
ZOO_NAMES = [(r"^double_blocks\.(\d+)\.attn\.to_out\.", r"transformer_blocks.\1.attn.to_out.0."),
             (r"^double_blocks\.", "transformer_blocks."), (r"^single_blocks\.(\d+)\.", r"single_transformer_blocks.\1.attn.")]


def detect(path) -> bool:
    return diffusers_folder(path, CLASS, WEIGHTS) is not None


def _renamed(key: str, rules) -> str:
    for pattern, repl in rules:
        key, n = re.subn(pattern, repl, key)
        if n:
            break
    return key


def _rename(sd: dict, rules) -> dict:
    return {_renamed(k, rules): v for k, v in sd.items()}


def load(path, dtype=torch.float32, **_):
    """Zoo's Flux2 from a diffusers Flux2Transformer2DModel folder (weights cast to `dtype`)."""
    from ..diffusion.flux2 import Flux2
    f = diffusers_folder(path, CLASS, WEIGHTS)
    if f is None:
        raise ValueError(f"{path}: not a diffusers {CLASS} folder (config.json + {WEIGHTS})")
    cfg = json.loads((f / "config.json").read_text())
    if cfg.get("patch_size", 1) != 1:
        raise ValueError(f"{f / 'config.json'}: patch_size={cfg['patch_size']}: only 1 is supported (FLUX.2's)")
    values = {field: cfg.get(key, default) for key, field, default in KEYS}
    model = Flux2(Flux2Config(**{**values, "rope_axes": tuple(values["rope_axes"])}))
    ours = _rename(load_shards(f, WEIGHTS), NAMES)
    if what := mismatches(ours, model.state_dict(), limit=3):
        raise ValueError(f"{f / WEIGHTS}: weights do not match config.json ({what})")
    model.load_state_dict(ours)
    model.pretrained_format = {"format": "diffusers"}
    return model.to(dtype).eval()


def exports(model) -> bool:
    from ..diffusion.flux2 import Flux2
    return isinstance(getattr(model, "_orig_mod", model), Flux2)


def save(model, path, dtype=None, **_) -> Path:
    """Write Zoo's Flux2 as a diffusers Flux2Transformer2DModel folder; returns the folder."""
    model = getattr(model, "_orig_mod", model)
    c = model.config
    sd = {k: v.detach().to("cpu", dtype or v.dtype).contiguous() for k, v in model.state_dict().items()}
    config = {"_class_name": CLASS, "_diffusers_version": "0.42.0", "patch_size": 1,
              **{key: getattr(c, field) for key, field, _ in KEYS}}
    config["axes_dims_rope"] = list(c.rope_axes)
    p = Path(path)
    save_safetensors(_rename(sd, ZOO_NAMES), p / WEIGHTS)
    atomic_write(p / "config.json", json.dumps(config, indent=2) + "\n")
    return p



def latent_space(path):
    """(mean, std, pixels per token) of a pipeline folder's AutoencoderKLFlux2 (vae/): its batch norm's statistics
    (4C,) over the 2x2-patched channels, which normalise the transformer's tokens; None when there is no vae/."""
    f = Path(path) / "vae"
    if not (f / "config.json").is_file():
        return None
    cfg = json.loads((f / "config.json").read_text())
    sd = load_shards(f, WEIGHTS)
    if "bn.running_mean" not in sd:
        raise ValueError(f"{f / WEIGHTS}: no bn.running_mean (not an AutoencoderKLFlux2)")
    std = (sd["bn.running_var"].float() + cfg.get("batch_norm_eps", 1e-4)).sqrt()
    return sd["bn.running_mean"].float(), std, 2 ** len(cfg.get("block_out_channels", (0,) * 4))


def module_names(model) -> dict[str, str]:
    """Zoo's module name -> diffusers' for the modules of the FLUX.2 transformer in `model` (the transformer, or a
    model holding it); {} when it holds none."""
    from ..diffusion.flux2 import Flux2
    p = next((f"{n}." if n else "" for n, m in model.named_modules() if isinstance(m, Flux2)), None)
    return {} if p is None else {n: _renamed(n[len(p):] + ".", ZOO_NAMES)[:-1] for n, _ in model.named_modules()
                                 if n and n.startswith(p)}
