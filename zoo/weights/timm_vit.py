"""timm weights in and out for the vision transformers (ViT, DeiT, DINOv2-style with registers).

Zoo's ViT uses timm's parameter names; this module reads the file, infers the structure from the shapes (width and
patch from patch_embed, depth from the blocks, prefix tokens from cls_token / dist_token / reg_token, the image size
from the position table, heads from the preset or a head width of HEAD_DIM), checks every name and shape, and loads.
Export is the ConvNets' (timm_convnet.save): the same layout written back.

    model = zoo.from_pretrained("vit_small_patch16_224.safetensors", arch="vit_small_patch16_224")
    model = zoo.from_pretrained("vit.pth", img_size=384)     # the position table resampled to a 24x24 grid
    zoo.save_pretrained(model, "out/model.safetensors")
"""
from __future__ import annotations

import math
from pathlib import Path

import torch

from ..blocks.vit import resample_pos_embed
from ..config import VIT_ARCHS, ViTConfig, from_dict
from .files import read_safetensors_header
from .timm_convnet import load_into, read_state_dict, saved_config, weight_file

SIGNATURE = ("patch_embed.proj.weight", "pos_embed", "blocks.0.attn.qkv.weight", "blocks.0.mlp.fc1.weight")
DETECT = ("patch_embed.proj.weight", "blocks.0.attn.qkv.weight")  # a Zoo file with its config: RoPE, no table
HEAD_DIM = 64  # the head width assumed when neither the preset nor num_heads= gives the heads


def detect(path) -> bool:
    """A ViT state dict in timm's layout (or a Zoo ViT's, its config in the file, where no table is: RoPE)."""
    f = weight_file(path)
    if f is None:
        return False
    try:
        keys = read_safetensors_header(f)[0] if f.suffix.lower() == ".safetensors" else read_state_dict(f)
    except Exception:
        return False
    return set(DETECT) <= set(keys)


def _side(n: int) -> int | None:
    side = math.isqrt(max(n, 0))
    return side if side > 0 and side * side == n else None


def shape_keys(sd: dict, preset: dict, source: str) -> dict:
    """The ViTConfig shape keys a timm state dict's names and shapes fix (num_heads: the preset's where its
    width matches, else embed_dim / HEAD_DIM)."""
    missing = [k for k in SIGNATURE if k not in sd]
    if missing:
        raise ValueError(f"{source}: not a ViT state dict in timm's layout (no {', '.join(missing)})")
    dim, _, patch, _ = sd["patch_embed.proj.weight"].shape
    cfg = dict(embed_dim=dim, patch_size=patch, class_token="cls_token" in sd, distilled="dist_token" in sd,
               reg_tokens=sd["reg_token"].shape[1] if "reg_token" in sd else 0,
               depth=len({k.split(".")[1] for k in sd if k.startswith("blocks.")}),
               mlp_ratio=sd["blocks.0.mlp.fc1.weight"].shape[0] / dim,
               global_pool="avg" if "fc_norm.weight" in sd else "token")
    cfg["init_values"] = (preset.get("init_values") or 1e-5) if "blocks.0.ls1.gamma" in sd else 0.0
    n_prefix, n_pos = cfg["class_token"] + cfg["distilled"] + cfg["reg_tokens"], sd["pos_embed"].shape[1]
    own, patches_only = _side(n_pos - n_prefix), _side(n_pos) if n_prefix else None
    if own is None and patches_only is None:
        raise ValueError(f"{source}: pos_embed has {n_pos} rows: neither a square grid nor one plus the "
                         f"{n_prefix} prefix tokens")
    cfg["no_embed_class"] = own is None or (patches_only is not None and preset.get("no_embed_class", False))
    cfg["img_size"] = (patches_only if cfg["no_embed_class"] else own) * patch
    if preset.get("embed_dim") == dim:
        cfg["num_heads"] = preset["num_heads"]
    elif dim % HEAD_DIM == 0:
        cfg["num_heads"] = dim // HEAD_DIM
    return cfg


def config_from_state_dict(sd: dict, arch: str | None = None, source: str = "<state dict>", base: dict | None = None,
                           **overrides) -> ViTConfig:
    """The ViTConfig of a timm-layout state dict: `arch` (default: the first preset of the file's width) with the
    keys the shapes fix where they differ from it; `base`: a saved Zoo config (a Zoo export's)."""
    if arch is not None and arch not in VIT_ARCHS:
        raise ValueError(f"{source}: unknown ViT arch {arch!r} (known: {', '.join(VIT_ARCHS)})")
    if base is not None and (arch is None or base.get("arch") == arch):
        return from_dict(ViTConfig, {**base, **overrides}, source, "")
    dim = sd["patch_embed.proj.weight"].shape[0] if "patch_embed.proj.weight" in sd else None
    arch = arch or next((a for a, p in VIT_ARCHS.items() if p["embed_dim"] == dim), "vit_small_patch16_224")
    cfg = shape_keys(sd, VIT_ARCHS[arch], source)
    if "num_heads" not in cfg and "num_heads" not in overrides:
        raise ValueError(f"{source}: embed_dim={dim} is not a multiple of {HEAD_DIM}: pass num_heads=")
    resolved = ViTConfig(arch=arch).resolved
    cfg = {k: v for k, v in cfg.items() if resolved[k] != v}  # only what differs from the preset
    cfg.update(arch=arch, in_chans=sd["patch_embed.proj.weight"].shape[1], qkv_bias="blocks.0.attn.qkv.bias" in sd)
    cfg["num_classes"] = sd["head.weight"].shape[0] if "head.weight" in sd else 0
    return from_dict(ViTConfig, {**cfg, **overrides}, source, "")  # img_size: load() resamples the table to it


def load(path, arch: str | None = None, num_classes: int | None = None, **overrides):
    """A Zoo ViT (eval mode) with the weights of `path`; `img_size=` another image side: the position table
    resampled to its grid (bicubic, as timm's resample_abs_pos_embed)."""
    from ..vit import ViT
    sd = read_state_dict(path)
    if num_classes is not None:
        overrides["num_classes"] = num_classes
    named, base = saved_config(path, VIT_ARCHS)
    cfg = config_from_state_dict(sd, arch or named, str(path), base, **overrides)
    with torch.device("meta"):
        model = ViT(cfg)
    model.to_empty(device="cpu")
    n_prefix = 0 if model.spec["no_embed_class"] else model.num_prefix_tokens
    file_grid = _side(sd["pos_embed"].shape[1] - n_prefix) if "pos_embed" in sd else None
    if file_grid is not None and file_grid != model.grid:
        sd["pos_embed"] = resample_pos_embed(sd["pos_embed"], (model.grid,) * 2, (file_grid,) * 2, n_prefix)
    load_into(model, sd, str(path))
    model.pretrained_format = {"format": "timm", "layout": "folder" if Path(path).is_dir() else "file",
                               "file": weight_file(path).name}
    return model.eval()
