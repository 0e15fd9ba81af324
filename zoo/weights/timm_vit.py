"""timm weights in and out for the vision transformers (ViT, DeiT, DINOv2-style with registers, EVA-02).

Zoo's ViT uses timm's parameter names; this module reads the file, infers the structure from the shapes (width and
patch from patch_embed, depth from the blocks, prefix tokens from cls_token / dist_token / reg_token, the image size
from the position table, heads from the preset or a head width of HEAD_DIM), checks every name and shape, and loads.
Where the names differ (a SwiGLU's fc1 / fc1_g, fc1_x / fc2 are Zoo's gate_up / down; EVA-02 base and large keep
q_proj, k_proj, v_proj apart) from_timm and to_timm rename; export writes timm's layout back (timm_convnet.write).
An EVA-02 file (q_bias, no k bias) takes the eva02 preset of its width: the RoPE grid is in no tensor.

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
from .timm_convnet import load_into, read_state_dict, saved_config, weight_file, write

SIGNATURE = ("patch_embed.proj.weight", "pos_embed", "blocks.0.attn.qkv.weight")
DETECT = ("blocks.0.attn.qkv.weight", "blocks.0.attn.q_proj.weight")  # either, beside patch_embed (no table: RoPE)
HEAD_DIM = 64  # the head width assumed when neither the preset nor num_heads= gives the heads
UNFUSED = ("eva02_base", "eva02_large")  # timm's presets that keep q, k, v apart (qkv_fused=False)


def detect(path) -> bool:
    """A ViT state dict in timm's layout (or a Zoo ViT's, its config in the file, where no table is: RoPE)."""
    f = weight_file(path)
    if f is None:
        return False
    try:
        keys = read_safetensors_header(f)[0] if f.suffix.lower() == ".safetensors" else read_state_dict(f)
    except Exception:
        return False
    return "patch_embed.proj.weight" in keys and any(k in keys for k in DETECT)


def _blocks(sd: dict) -> list:
    """The "blocks.{i}." prefixes of a state dict, in order."""
    return [f"blocks.{i}." for i in sorted({int(k.split(".")[1]) for k in sd if k.startswith("blocks.")})]


def from_timm(sd: dict) -> dict:
    """timm's names -> Zoo's: q_proj, k_proj, v_proj (EVA-02 base, large) -> one qkv with q_bias, v_bias; a SwiGLU's
    fc1 (packed, gate rows first) or fc1_g + fc1_x -> gate_up, its fc2 -> down. Anything else as it is."""
    sd = dict(sd)
    for b in _blocks(sd):
        a, m = b + "attn.", b + "mlp."
        if a + "q_proj.weight" in sd:
            sd[a + "qkv.weight"] = torch.cat([sd.pop(f"{a}{n}_proj.weight") for n in "qkv"])
            sd.update({f"{a}{n}_bias": sd.pop(f"{a}{n}_proj.bias") for n in "qv" if f"{a}{n}_proj.bias" in sd})
        fc1, fc2 = sd.get(m + "fc1.weight"), sd.get(m + "fc2.weight")
        if m + "fc1_g.weight" in sd:
            for t in ("weight", "bias"):
                if m + "fc1_g." + t in sd:
                    sd[m + "gate_up." + t] = torch.cat([sd.pop(m + "fc1_g." + t), sd.pop(m + "fc1_x." + t)])
        elif fc1 is None or fc2 is None or fc1.shape[0] != 2 * fc2.shape[1]:
            continue  # a plain MLP (or Zoo's names already)
        sd.update({k.replace(".fc1.", ".gate_up.").replace(".fc2.", ".down."): sd.pop(k) for k in list(sd)
                   if k.startswith((m + "fc1.", m + "fc2."))})
    return sd


def to_timm(model) -> dict:
    """A Zoo ViT's tensors under timm's names (from_timm undone): a SwiGLU's gate_up -> fc1 (or fc1_g, fc1_x with
    mlp_norm: timm's unpacked SwiGLU), down -> fc2; EVA-02 base and large presets' qkv -> q_proj, k_proj, v_proj."""
    sd, unfused = dict(model.state_dict()), model.config.arch.startswith(UNFUSED)
    for b in _blocks(sd):
        a, m = b + "attn.", b + "mlp."
        if unfused and a + "q_bias" in sd:
            sd.update({f"{a}{n}_proj.weight": w for n, w in zip("qkv", sd.pop(a + "qkv.weight").chunk(3))})
            sd.update({f"{a}{n}_proj.bias": sd.pop(f"{a}{n}_bias") for n in "qv"})
        for t in [t for t in ("weight", "bias") if m + "gate_up." + t in sd]:
            if m + "norm.weight" in sd:
                sd[m + "fc1_g." + t], sd[m + "fc1_x." + t] = sd.pop(m + "gate_up." + t).chunk(2)
            else:
                sd[m + "fc1." + t] = sd.pop(m + "gate_up." + t)
            sd[m + "fc2." + t] = sd.pop(m + "down." + t)
    return sd


def _side(n: int) -> int | None:
    side = math.isqrt(max(n, 0))
    return side if side > 0 and side * side == n else None


def shape_keys(sd: dict, preset: dict, source: str) -> dict:
    """The ViTConfig shape keys a timm state dict's names and shapes fix (num_heads: the preset's where its
    width matches, else embed_dim / HEAD_DIM)."""
    if missing := [k for k in SIGNATURE if k not in sd]:
        raise ValueError(f"{source}: not a ViT state dict in timm's layout (no {', '.join(missing)})")
    down = sd.get("blocks.0.mlp.fc2.weight", sd.get("blocks.0.mlp.down.weight"))
    if down is None:
        raise ValueError(f"{source}: not a ViT state dict in timm's layout (no blocks.0.mlp.fc2.weight)")
    dim, _, patch, _ = sd["patch_embed.proj.weight"].shape
    hidden, ratio, plain = down.shape[1], preset.get("mlp_ratio", 4.0), preset.get("mlp", "gelu")
    cfg = dict(embed_dim=dim, patch_size=patch, class_token="cls_token" in sd, distilled="dist_token" in sd,
               reg_tokens=sd["reg_token"].shape[1] if "reg_token" in sd else 0,
               depth=len({k.split(".")[1] for k in sd if k.startswith("blocks.")}),
               mlp_ratio=ratio if int(dim * ratio) == hidden else hidden / dim,
               global_pool="map" if "attn_pool.latent" in sd else "avg" if "fc_norm.weight" in sd or "cls_token"
               not in sd else "token",
               fc_norm="fc_norm.weight" in sd, pre_norm="norm_pre.weight" in sd,
               mlp="swiglu" if "blocks.0.mlp.gate_up.weight" in sd else "gelu" if plain == "swiglu" else plain,
               mlp_norm="blocks.0.mlp.norm.weight" in sd, k_bias="blocks.0.attn.q_bias" not in sd)
    cfg["init_values"] = (preset.get("init_values") or 1e-5) if "blocks.0.ls1.gamma" in sd else 0.0
    n_prefix, n_pos = cfg["class_token"] + cfg["distilled"] + cfg["reg_tokens"], sd["pos_embed"].shape[1]
    own, patches_only = _side(n_pos - n_prefix), _side(n_pos) if n_prefix else None
    if own is None and patches_only is None:
        raise ValueError(f"{source}: pos_embed has {n_pos} rows: neither a square grid nor one plus the "
                         f"{n_prefix} prefix tokens")
    # both readings fit a few small grids (3 x 3 = 2 x 2 + 5 prefix rows): timm's ViTs with registers, as the preset
    # says, keep no table rows for the prefix tokens
    embeds_none = preset.get("no_embed_class", False) or cfg["reg_tokens"] > 0
    cfg["no_embed_class"] = own is None or (patches_only is not None and embeds_none)
    cfg["img_size"] = (patches_only if cfg["no_embed_class"] else own) * patch
    if preset.get("embed_dim") == dim:
        cfg["num_heads"] = preset["num_heads"]
    elif dim % HEAD_DIM == 0:
        cfg["num_heads"] = dim // HEAD_DIM
    return cfg


def _family(arch: str) -> str:
    """eva02, clip (a norm before the blocks) or vit: the presets a file of that kind takes its defaults from."""
    return "eva02" if arch.startswith("eva02") else "clip" if VIT_ARCHS[arch].get("pre_norm") else "vit"


def config_from_state_dict(sd: dict, arch: str | None = None, source: str = "<state dict>", base: dict | None = None,
                           **overrides) -> ViTConfig:
    """The ViTConfig of a timm-layout state dict, its names already Zoo's (from_timm): `arch` (default: the first
    preset of the file's width) with the keys the shapes fix where they differ from it; `base`: a saved Zoo config
    (a Zoo export's)."""
    if arch is not None and arch not in VIT_ARCHS:
        raise ValueError(f"{source}: unknown ViT arch {arch!r} (known: {', '.join(VIT_ARCHS)})")
    if base is not None and (arch is None or base.get("arch") == arch):
        return from_dict(ViTConfig, {**base, **overrides}, source, "")
    dim = sd["patch_embed.proj.weight"].shape[0] if "patch_embed.proj.weight" in sd else None
    # EVA-02's q and v biases: its RoPE, in no tensor, from an eva02 preset; CLIP's pre-norm: its eps from a clip one
    kind = "eva02" if "blocks.0.attn.q_bias" in sd else "clip" if "norm_pre.weight" in sd else "vit"
    fallback = {"vit": "vit_small_patch16_224", "clip": "vit_base_patch16_clip_224",
                "eva02": "eva02_base_patch14_224" if "blocks.0.mlp.norm.weight" in sd else "eva02_small_patch14_224"}
    arch = arch or next((a for a, p in VIT_ARCHS.items() if p["embed_dim"] == dim and _family(a) == kind),
                        fallback[kind])
    cfg = shape_keys(sd, VIT_ARCHS[arch], source)
    if "num_heads" not in cfg and "num_heads" not in overrides:
        raise ValueError(f"{source}: embed_dim={dim} is not a multiple of {HEAD_DIM}: pass num_heads=")
    resolved = ViTConfig(arch=arch).resolved
    shape = cfg
    cfg = {k: v for k, v in shape.items() if resolved[k] != v and k != "fc_norm"}  # only what differs from the preset
    if ViTConfig(arch=arch, **cfg).resolved["fc_norm"] != shape["fc_norm"]:  # its default follows global_pool
        cfg["fc_norm"] = shape["fc_norm"]
    cfg.update(arch=arch, in_chans=sd["patch_embed.proj.weight"].shape[1],
               qkv_bias="blocks.0.attn.qkv.bias" in sd or "blocks.0.attn.q_bias" in sd)
    cfg["num_classes"] = sd["head.weight"].shape[0] if "head.weight" in sd else 0
    return from_dict(ViTConfig, {**cfg, **overrides}, source, "")  # img_size: load() resamples the table to it


def load(path, arch: str | None = None, num_classes: int | None = None, **overrides):
    """A Zoo ViT (eval mode) with the weights of `path`; `img_size=` another image side: the position table
    resampled to its grid (bicubic, as timm's resample_abs_pos_embed)."""
    from ..vit import ViT
    sd = from_timm(read_state_dict(path))
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


def exports(model) -> bool:
    from ..vit import ViT
    return isinstance(model, ViT)


def save(model, path, **kwargs) -> Path:
    """timm_convnet.save for a ViT: its tensors under timm's names (to_timm)."""
    if kwargs:
        raise TypeError(f"save_pretrained for a timm model takes no options, got {', '.join(kwargs)}")
    return write(model, to_timm(model), path)
