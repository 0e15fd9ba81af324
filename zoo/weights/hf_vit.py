"""Hugging Face vision transformers in and out: DINOv3ViTModel (`dinov3_vit`) and Siglip2VisionModel
(`siglip2_vision_model`, or the vision tower of a whole `siglip2` folder) as Zoo's ViT; the SigLIP encoders of
SmolVLM and Idefics3 for hf_vlm.py (`TILE_ENCODERS`).

One record per class: its config's defaults, the translation to ViTConfig and back, and the key map (Zoo's names
against the class's; tensors fused on one side stacked along their rows on the other). SigLIP 2's linear patch
embedding is Zoo's patch convolution with its (p, p, C) inputs reordered, its position table Zoo's `pos_embed`.
Biases a DINOv3 config leaves out (the key bias) load as zeros and are written back only where they became non-zero
(the config flag then set). save() writes the class the model came from (a Zoo-built ViT, called directly: DINOv3),
its config.json the source's with the architecture keys replaced, tensors it does not use (DINOv3's mask token) as
read. DINOv3's training-time RoPE augmentation (pos_embed_shift, _jitter, _rescale) is read into the config and
written back from it. zoo.save_pretrained writes a Zoo-built ViT in timm's layout, its config beside it.

    model = zoo.from_pretrained("dinov3-vits16/")          # a folder transformers' save_pretrained wrote
    tokens = model.forward_features(images)                # last_hidden_state; model(images): pooler_output
    zoo.save_pretrained(model, "out/")                     # the class's from_pretrained("out/") loads it
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..config import ROPE_AUGMENT_KEYS, VIT_ARCHS, ViTConfig, from_dict, to_dict
from .files import atomic_write, config_folder, load_tensors, read_json, save_safetensors
from .hf_llm import weight_files
from .timm_convnet import load_into

DEFAULTS = {  # transformers' defaults of the keys read, for config.json files that leave them out
    "dinov3_vit": dict(patch_size=16, hidden_size=384, intermediate_size=1536, num_hidden_layers=12,
                       num_attention_heads=6, hidden_act="gelu", layer_norm_eps=1e-5, rope_theta=100.0, image_size=224,
                       num_channels=3, query_bias=True, key_bias=False, value_bias=True, proj_bias=True, mlp_bias=True,
                       layerscale_value=1.0, use_gated_mlp=False, num_register_tokens=0, pos_embed_shift=None,
                       pos_embed_jitter=None, pos_embed_rescale=2.0),
    "siglip2_vision_model": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                                 num_channels=3, patch_size=16, hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6,
                                 vision_use_head=True, num_patches=256),
    **dict.fromkeys(("smolvlm_vision", "idefics3_vision"), dict(  # a VLM's encoder of image tiles (hf_vlm.py)
        hidden_size=1152, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=16, num_channels=3,
        image_size=224, patch_size=32, hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6))}
CLASSES = {"dinov3_vit": "DINOv3ViTModel", "siglip2_vision_model": "Siglip2VisionModel"}
TILE_ENCODERS = {"smolvlm_vision": "SmolVLM's encoder", "idefics3_vision": "Idefics3's encoder"}  # SigLIP's names
ACTS = {"gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh", "quick_gelu": "quick_gelu", "silu": "swiglu"}  # hidden_act ->
# ViTConfig.mlp
# the config flag of each optional DINOv3 bias, by the HF name's ending
BIAS_FLAGS = {"q_proj.bias": "query_bias", "k_proj.bias": "key_bias", "v_proj.bias": "value_bias",
              "o_proj.bias": "proj_bias", "up_proj.bias": "mlp_bias", "down_proj.bias": "mlp_bias",
              "gate_proj.bias": "mlp_bias"}


def hf_config(path) -> tuple[dict, str]:
    """(the vision model's config with the defaults filled in, its tensors' name prefix in the files)."""
    hf = read_json(config_folder(path) / "config.json")
    prefix = ""
    if hf.get("model_type") == "siglip2":  # a whole SigLIP 2: its vision tower
        hf, prefix = {**(hf.get("vision_config") or {}), "model_type": "siglip2_vision_model"}, "vision_model."
    return {**DEFAULTS.get(hf.get("model_type"), {}), **hf}, prefix


def detect(path) -> bool:
    try:
        return hf_config(path)[0].get("model_type") in CLASSES
    except (ValueError, OSError):
        return False


def _square(v, key: str, source: str) -> int:
    a, b = (v, v) if isinstance(v, int) else v
    if a != b:
        raise ValueError(f"{source}: {key}={v}: only square {key.split('_')[0]}s are supported")
    return a


def zoo_config(hf: dict, source: str, **overrides) -> ViTConfig:
    """The ViTConfig of an HF config (hf_config's): its structure, num_classes 0 (the HF classes have no head)."""
    kind, gated, act = hf["model_type"], hf.get("use_gated_mlp", False), hf["hidden_act"]
    if ACTS.get(act) is None or (ACTS[act] == "swiglu") != gated:
        raise ValueError(f"{source}: hidden_act={act!r} with use_gated_mlp={gated} is not supported (plain: gelu, "
                         f"gelu_pytorch_tanh; gated: silu)")
    dim, patch = hf["hidden_size"], _square(hf["patch_size"], "patch_size", source)
    ratio = hf["intermediate_size"] / dim
    c = dict(embed_dim=dim, depth=hf["num_hidden_layers"], num_heads=hf["num_attention_heads"], patch_size=patch,
             mlp_ratio=ratio if int(dim * ratio) == hf["intermediate_size"] else (hf["intermediate_size"] + .5) / dim,
             mlp=ACTS[act], norm_eps=hf["layer_norm_eps"], in_chans=hf["num_channels"], num_classes=0)
    if kind == "dinov3_vit":
        if not hf["layerscale_value"]:
            raise ValueError(f"{source}: layerscale_value=0 is not supported (Zoo's LayerScale starts non-zero)")
        c.update(img_size=_square(hf["image_size"], "image_size", source), reg_tokens=hf["num_register_tokens"],
                 no_embed_class=True, init_values=hf["layerscale_value"], rope_theta=hf["rope_theta"],
                 qkv_bias=hf["query_bias"] or hf["key_bias"] or hf["value_bias"],
                 **{k: hf[k] for k in ROPE_AUGMENT_KEYS})  # RoPE's training-time augmentation, null: off
    elif kind in TILE_ENCODERS:
        c.update(img_size=_square(hf["image_size"], "image_size", source), class_token=False, no_embed_class=True)
    else:
        grid = round(hf["num_patches"] ** 0.5)
        if grid * grid != hf["num_patches"] or not hf["vision_use_head"]:
            raise ValueError(f"{source}: num_patches={hf['num_patches']} (must be a square) and vision_use_head="
                             f"{hf['vision_use_head']} (must be true) are not supported")
        c.update(img_size=grid * patch, class_token=False, no_embed_class=True, global_pool="map",
                 pos_interp="bilinear")
    arch = next((a for a, p in VIT_ARCHS.items() if p["embed_dim"] == dim), "vit_small_patch16_224")
    return from_dict(ViTConfig, {"arch": arch, **c, **overrides}, source, "")


def key_map(kind: str, model) -> list:
    """[(Zoo names, HF names)]: the Zoo tensors, stacked along dim 0, are the HF ones stacked (only the Zoo
    model's tensors; an HF name missing from a file is a bias that loads as zeros)."""
    own = model.state_dict()
    wb = lambda z, h: [([f"{z}.{k}"], [f"{h}.{k}"]) for k in ("weight", "bias")]  # noqa: E731
    fused = lambda z, hs, k: ([f"{z}.{k}"], [f"{h}.{k}" for h in hs])  # noqa: E731
    if kind == "dinov3_vit":
        pairs = [(["cls_token"], ["embeddings.cls_token"]), (["reg_token"], ["embeddings.register_tokens"]),
                 *wb("patch_embed.proj", "embeddings.patch_embeddings"), *wb("norm", "norm")]
        mlp = {"gate_up": ["gate_proj", "up_proj"], "down": ["down_proj"]} if model.spec["mlp"] == "swiglu" \
            else {"fc1": ["up_proj"], "fc2": ["down_proj"]}
        per = {"norm1": ["norm1"], "norm2": ["norm2"], "attn.qkv": [f"attention.{n}_proj" for n in "qkv"],
               "attn.proj": ["attention.o_proj"], **{f"mlp.{z}": [f"mlp.{h}" for h in hs] for z, hs in mlp.items()}}
        for i in range(len(model.blocks)):
            pairs += [fused(f"blocks.{i}.{z}", [f"layer.{i}.{h}" for h in hs], k) for z, hs in per.items()
                      for k in ("weight", "bias")]
            pairs += [([f"blocks.{i}.ls{j}.gamma"], [f"layer.{i}.layer_scale{j}.lambda1"]) for j in (1, 2)]
    else:
        pairs = [(["pos_embed"], ["embeddings.position_embedding.weight"]), (["attn_pool.latent"], ["head.probe"]),
                 *wb("patch_embed.proj", "embeddings.patch_embedding"), *wb("norm", "post_layernorm"),
                 *wb("attn_pool.proj", "head.attention.out_proj"), *wb("attn_pool.norm", "head.layernorm"),
                 *wb("attn_pool.mlp.fc1", "head.mlp.fc1"), *wb("attn_pool.mlp.fc2", "head.mlp.fc2"),
                 (["attn_pool.q.weight", "attn_pool.kv.weight"], ["head.attention.in_proj_weight"]),
                 (["attn_pool.q.bias", "attn_pool.kv.bias"], ["head.attention.in_proj_bias"])]
        per = {"norm1": "layer_norm1", "norm2": "layer_norm2", "attn.proj": "self_attn.out_proj",
               "mlp.fc1": "mlp.fc1", "mlp.fc2": "mlp.fc2"}
        for i in range(len(model.blocks)):
            h = f"encoder.layers.{i}."
            pairs += [p for z, n in per.items() for p in wb(f"blocks.{i}.{z}", h + n)]
            pairs += [fused(f"blocks.{i}.attn.qkv", [f"{h}self_attn.{n}_proj" for n in "qkv"], k)
                      for k in ("weight", "bias")]
    return [(z, h) for z, h in pairs if all(n in own for n in z)]


def _to_zoo_shape(name: str, t: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """An HF tensor in the Zoo tensor's shape: SigLIP 2's (D, p*p*C) patch linear as a (D, C, p, p) conv; its
    (n, D) position table as (1, n, D)."""
    if name == "patch_embed.proj.weight" and t.dim() == 2:
        D, C, p, _ = shape
        return t.view(D, p, p, C).permute(0, 3, 1, 2)
    return t.reshape(shape) if name == "pos_embed" and t.numel() == shape.numel() else t


def load(path, dtype=None, **overrides):
    """A Zoo ViT (eval mode) with the weights of an HF DINOv3ViTModel / Siglip2VisionModel / Siglip2Model folder;
    keyword arguments are ViTConfig keys (num_classes=10: a fresh head)."""
    folder = config_folder(path)
    hf, prefix = hf_config(folder)
    model = build(hf, prefixed(folder, prefix), str(folder / "config.json"), **overrides)
    return model.to(dtype or torch.float32).eval()


def prefixed(folder: Path, prefix: str) -> dict:
    """The tensors of a folder's safetensors files whose names start with `prefix`, the prefix cut."""
    sd = {}
    for f in weight_files(folder):
        sd.update({k[len(prefix):]: v for k, v in load_tensors(f).items() if k.startswith(prefix)})
    return sd


def build(hf: dict, sd: dict, source: str, **overrides):
    """A Zoo ViT of an HF vision config (defaults filled in) holding the tensors `sd` (HF names); an unexpected or
    missing tensor: one error naming it."""
    from ..vit import ViT
    cfg = zoo_config(hf, source, **overrides)
    with torch.device("meta"):
        model = ViT(cfg)
    model.to_empty(device="cpu")
    own, ours, used = model.state_dict(), {}, set()
    for zs, hs in key_map(hf["model_type"], model):
        if not any(h in sd for h in hs):  # missing: load_into names it, unless the config turns it off
            ours.update((z, torch.zeros(own[z].shape)) for z in zs if biases_off(hf, hs))
            continue
        rows = [sd[h] if h in sd else sd[h[:-4] + "weight"].new_zeros(len(sd[h[:-4] + "weight"])) for h in hs]
        whole = torch.cat([_to_zoo_shape(zs[0], r, own[zs[0]].shape) if len(zs) == 1 else r for r in rows])
        ours.update(zip(zs, whole.split([own[z].shape[0] for z in zs])))
        used.update(hs)
    extra = {k: v for k, v in sd.items() if k not in used}
    load_into(model, {**ours, **{k: v for k, v in extra.items() if v.numel() and k != "embeddings.mask_token"}},
              source)  # unexpected tensors (other than an empty register table, the mask token): one error
    model.pretrained_format = {"format": "hf", "config": hf, "extra": extra}
    return model


def biases_off(hf: dict, names: list) -> bool:
    """Every one of `names` an optional DINOv3 bias its config turns off (proj_bias, mlp_bias, ...): zeros in Zoo."""
    return all(any(h.endswith(n) and not hf.get(f, True) for n, f in BIAS_FLAGS.items()) for h in names)


def exports(model) -> bool:
    """A ViT loaded from an HF folder (one built in Zoo is written in timm's layout, its config beside it)."""
    from ..vit import ViT
    return isinstance(model, ViT) and (getattr(model, "pretrained_format", None) or {}).get("format") == "hf"


def hf_keys(model, kind: str, path) -> dict:
    """The HF config keys the model's structure fixes; a structure the class cannot hold: a one-line error."""
    r, c = model.spec, model.config
    want = dict(class_token=kind == "dinov3_vit", distilled=False, num_classes=0,
                global_pool="map" if kind == "siglip2_vision_model" else "token", rope_ref_grid=0, k_bias=True,
                mlp_norm=False, pre_norm=False)  # EVA-02's, CLIP's: timm's layout only
    if kind != "dinov3_vit":  # SigLIP's encoder: a plain MLP, biased q, k, v, no registers, LayerScale or RoPE
        want.update(reg_tokens=0, init_values=0.0, rope_theta=0.0, qkv_bias=True, swiglu=False)
    if kind in CLASSES:
        want["pos_interp"] = "bicubic" if kind == "dinov3_vit" else "bilinear"
    got = {**r, "num_classes": c.num_classes, "qkv_bias": c.qkv_bias, "swiglu": r["mlp"] == "swiglu"}
    if bad := [f"{k}={got[k]} (needs {v})" for k, v in want.items() if got[k] != v]:
        hint = "; keep this ViT in timm's layout or a Zoo run folder" if kind in CLASSES else ""
        raise ValueError(f"{path}: {CLASSES.get(kind) or TILE_ENCODERS[kind]} cannot hold {', '.join(bad)}{hint}")
    if kind == "dinov3_vit" and not (r["rope_theta"] and r["init_values"]):
        raise ValueError(f"{path}: DINOv3ViTModel needs rope_theta > 0 and init_values > 0 (LayerScale)")
    keys = dict(hidden_size=r["embed_dim"], intermediate_size=int(r["embed_dim"] * r["mlp_ratio"]),
                num_hidden_layers=r["depth"], num_attention_heads=r["num_heads"], patch_size=r["patch_size"],
                hidden_act={v: k for k, v in ACTS.items()}[r["mlp"]], layer_norm_eps=r["norm_eps"],
                num_channels=c.in_chans)
    if kind == "dinov3_vit":
        return {**keys, "image_size": r["img_size"], "num_register_tokens": r["reg_tokens"], "rope_theta":
                r["rope_theta"], "layerscale_value": r["init_values"], "use_gated_mlp": r["mlp"] == "swiglu",
                **rope_augment_keys(c)}
    if kind in TILE_ENCODERS:
        return {**keys, "image_size": r["img_size"]}
    return {**keys, "num_patches": model.grid ** 2, "vision_use_head": True}


def rope_augment_keys(c: ViTConfig) -> dict:
    """The config's pos_embed_* as transformers reads them: a factor of 0 (off) as null, which the class skips
    (its log-uniform draw needs a factor >= 1)."""
    return {"pos_embed_shift": c.pos_embed_shift, "pos_embed_jitter": c.pos_embed_jitter or None,
            "pos_embed_rescale": c.pos_embed_rescale or None}


def hf_state(model, kind: str, dtype=None) -> dict:
    """The model's tensors under the HF class's names (CPU, in `dtype` or their own)."""
    sd = {k: v.detach().to("cpu", dtype or v.dtype) for k, v in model.state_dict().items()}
    out = {}
    for zs, hs in key_map(kind, model):
        whole = torch.cat([sd[z].reshape(-1, *sd[z].shape[2:]) if z == "pos_embed" else sd[z] for z in zs])
        if zs == ["patch_embed.proj.weight"] and kind == "siglip2_vision_model":
            whole = whole.permute(0, 2, 3, 1).flatten(1)  # a (D, p*p*C) linear
        out.update((h, t.contiguous()) for h, t in zip(hs, whole.chunk(len(hs))))
    return out


def save(model, path, dtype=None, **kwargs) -> Path:
    """Write the model as an HF folder (config.json, model.safetensors) of the class it came from; returns it."""
    if kwargs:
        raise TypeError(f"save_pretrained for an HF ViT takes dtype= only, got {', '.join(kwargs)}")
    source = getattr(model, "pretrained_format", None) or {}
    hf = dict(source.get("config") or {**DEFAULTS["dinov3_vit"], "model_type": "dinov3_vit"})
    kind = hf["model_type"]
    hf.update(hf_keys(model, kind, path), architectures=[CLASSES[kind]])
    out = {k: v.to(dtype or v.dtype) for k, v in (source.get("extra") or {}).items()}
    if kind == "dinov3_vit":  # what Zoo's ViT does not use, when the source had none: HF's initial values
        zero = torch.zeros(1, 1, hf["hidden_size"], dtype=dtype or torch.float32)
        out.setdefault("embeddings.mask_token", zero)
        out.setdefault("embeddings.register_tokens", zero[:, :0])
    out.update(hf_state(model, kind, dtype))
    if kind == "dinov3_vit":  # the optional biases: written where the source has them or they became non-zero
        for name, flag in BIAS_FLAGS.items():
            hf[flag] = hf.get(flag, True) or any(v.any() for k, v in out.items() if k.endswith(name))
        out = {k: v for k, v in out.items() if all(hf[f] or not k.endswith(n) for n, f in BIAS_FLAGS.items())}
    p = Path(path)
    save_safetensors(out, p / "model.safetensors", {"format": "pt", "zoo": json.dumps(to_dict(model.config))})
    atomic_write(p / "config.json", json.dumps(hf, indent=2) + "\n")
    return p
