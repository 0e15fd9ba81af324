"""diffusers DiTTransformer2DModel folders in and out.

A folder with config.json (`_class_name: DiTTransformer2DModel`) and the safetensors, or a
pipeline folder's `transformer/`, loads as Zoo's DiT; `save(dit, folder)` writes one diffusers
loads. diffusers keeps an embedder per block; when all are equal Zoo keeps one. Unsupported config
keys are refused in one line (docs/diffusion.md, "diffusers DiT weights in and out").
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..config import DiTConfig
from .files import atomic_write, diffusers_folder, load_shards, mismatches, save_safetensors

CLASS, WEIGHTS = "DiTTransformer2DModel", "diffusion_pytorch_model.safetensors"
_ACTIVATIONS = {"gelu-approximate": "tanh", "gelu": "none"}


def detect(path) -> bool:
    return diffusers_folder(path, CLASS, WEIGHTS) is not None


def _refuse(cfg: dict, where: Path):
    rules = [("norm_type", lambda v: v == "ada_norm_zero", "only ada_norm_zero exists for DiT"),
             ("norm_elementwise_affine", lambda v: not v, "affine MLP LayerNorms are not supported"),
             ("dropout", lambda v: not v, "dropout is not supported"),
             ("upcast_attention", lambda v: not v, "upcast attention is not supported"),
             ("activation_fn", lambda v: v in _ACTIVATIONS, f"supported: {', '.join(_ACTIVATIONS)}")]
    for key, ok, why in rules:
        if key in cfg and not ok(cfg[key]):
            raise ValueError(f"{where}: {key}={cfg[key]!r}: {why}")
    C = cfg.get("in_channels", 4)
    out = cfg.get("out_channels") or C
    if out not in (C, 2 * C):
        raise ValueError(f"{where}: out_channels={out} must be in_channels={C} or twice it (learned sigma)")


def _same_embedders(sd: dict, depth: int) -> bool:
    pre = "transformer_blocks.{}.norm1.emb."
    names = [k[len(pre.format(0)):] for k in sd if k.startswith(pre.format(0))]
    return all(torch.equal(sd[pre.format(0) + n], sd[pre.format(i) + n]) for i in range(1, depth) for n in names)


def load(path, dtype=torch.float32, **_):
    """Zoo's DiT from a diffusers DiTTransformer2DModel folder (weights cast to `dtype`)."""
    from ..diffusion.dit import DiT
    f = diffusers_folder(path, CLASS, WEIGHTS)
    if f is None:
        raise ValueError(f"{path}: not a diffusers {CLASS} folder")
    where = f / "config.json"
    cfg = json.loads(where.read_text())
    _refuse(cfg, where)
    heads, depth = cfg.get("num_attention_heads", 16), cfg.get("num_layers", 28)
    C = cfg.get("in_channels", 4)
    sd = load_shards(f, WEIGHTS)
    shared = _same_embedders(sd, depth)
    zcfg = DiTConfig(depth=depth, width=heads * cfg.get("attention_head_dim", 72), heads=heads,
                     patch_size=cfg.get("patch_size", 2), learn_sigma=(cfg.get("out_channels") or C) == 2 * C,
                     qkv_bias=cfg.get("attention_bias", True), norm_eps=cfg.get("norm_eps", 1e-5), freq_shift=1.0,
                     block_conditioning=not shared)
    model = DiT(zcfg, C, cfg.get("num_embeds_ada_norm", 1000), cfg.get("sample_size", 32))
    if _ACTIVATIONS[cfg.get("activation_fn", "gelu-approximate")] == "none":
        for b in model.blocks:
            b.mlp.approximate = "none"
    ours = to_zoo(sd, depth, shared)
    if what := mismatches(ours, model.state_dict(), limit=3):
        raise ValueError(f"{f / WEIGHTS}: weights do not match config.json ({what})")
    model.load_state_dict(ours)
    model.pretrained_format = {"format": "diffusers", "sample_size": cfg.get("sample_size", 32)}
    return model.to(dtype).eval()


def to_zoo(sd: dict, depth: int, shared: bool) -> dict:
    """diffusers' state dict -> Zoo's names (q, k and v stacked into qkv)."""
    out = {}
    for k, v in sd.items():
        if not k.startswith("transformer_blocks."):
            out[k.replace("pos_embed.proj", "patch.proj").replace("proj_out_1", "final.ada")
                 .replace("proj_out_2", "final.linear")] = v
            continue
        _, i, rest = k.split(".", 2)
        if rest.startswith("norm1.emb."):
            if shared and i != "0":
                continue
            rest = (rest.removeprefix("norm1.emb.").replace("timestep_embedder", "t_embed")
                    .replace("class_embedder.embedding_table", "y_embed.table"))
            out[f"cond.{i}.{rest}"] = v
        elif rest.startswith("attn1.to_q."):
            kind = rest.rsplit(".", 1)[1]
            parts = [sd[f"transformer_blocks.{i}.attn1.to_{n}.{kind}"] for n in "qkv"]
            out[f"blocks.{i}.attn.qkv.{kind}"] = torch.cat(parts)
        elif rest.startswith(("attn1.to_k.", "attn1.to_v.")):
            continue
        else:
            rest = (rest.replace("norm1.linear", "ada").replace("attn1.to_out.0", "attn.proj")
                    .replace("ff.net.0.proj", "mlp.fc1").replace("ff.net.2", "mlp.fc2"))
            out[f"blocks.{i}.{rest}"] = v
    return out


def exports(model) -> bool:
    from ..diffusion.dit import DiT
    return isinstance(getattr(model, "_orig_mod", model), DiT)


def save(model, path, dtype=None, **_) -> Path:
    """Write Zoo's DiT as a diffusers DiTTransformer2DModel folder; returns the folder."""
    model = getattr(model, "_orig_mod", model)
    c = model.config
    bad = [(k, v, ok) for k, v, ok in (("qk_norm", c.qk_norm, False), ("rope", c.rope, False),
                                       ("mlp_ratio", c.mlp_ratio, 4.0), ("freq_shift", c.freq_shift, 1.0))
           if v != ok]
    if bad:
        k, v, ok = bad[0]
        raise ValueError(f"{path}: diffusers' {CLASS} cannot express {k}={v} (it has {k}={ok}); keep this DiT "
                         f"in a Zoo run folder")
    approx = {b.mlp.approximate for b in model.blocks}
    if len(approx) != 1:
        raise ValueError(f"{path}: blocks mix GELU approximations {sorted(approx)}; diffusers has one activation_fn")
    sd = {k: v.detach().to("cpu", dtype or v.dtype).contiguous() for k, v in model.state_dict().items()}
    out = {}
    D, depth = c.resolved_width, c.resolved_depth
    for k, v in sd.items():
        head, _, rest = k.partition(".")
        if head == "cond":
            i, rest = rest.split(".", 1)
            rest = rest.replace("t_embed", "timestep_embedder").replace("y_embed.table", "class_embedder.embedding_table")
            targets = range(depth) if len(model.cond) == 1 else [int(i)]
            for j in targets:
                out[f"transformer_blocks.{j}.norm1.emb.{rest}"] = v.clone()  # one copy per block, as diffusers stores it
        elif head == "blocks":
            i, rest = rest.split(".", 1)
            pre = f"transformer_blocks.{i}."
            if rest.startswith("attn.qkv."):
                for n, part in zip("qkv", v.split(D)):
                    out[f"{pre}attn1.to_{n}.{rest.rsplit('.', 1)[1]}"] = part.contiguous()
                continue
            rest = (rest.replace("ada", "norm1.linear", 1) if rest.startswith("ada") else rest)
            rest = (rest.replace("attn.proj", "attn1.to_out.0").replace("mlp.fc1", "ff.net.0.proj")
                    .replace("mlp.fc2", "ff.net.2"))
            out[pre + rest] = v
        else:
            out[k.replace("patch.proj", "pos_embed.proj").replace("final.ada", "proj_out_1")
                 .replace("final.linear", "proj_out_2")] = v
    config = {"_class_name": CLASS, "_diffusers_version": "0.30.0",
              "num_attention_heads": c.resolved_heads, "attention_head_dim": D // c.resolved_heads,
              "in_channels": model.in_channels, "out_channels": model.out_channels, "num_layers": depth,
              "dropout": 0.0, "norm_num_groups": 32, "attention_bias": c.qkv_bias,
              "sample_size": model.sample_size, "patch_size": c.patch_size,
              "activation_fn": "gelu-approximate" if approx == {"tanh"} else "gelu",
              "num_embeds_ada_norm": model.num_classes, "upcast_attention": False, "norm_type": "ada_norm_zero",
              "norm_elementwise_affine": False, "norm_eps": c.norm_eps}
    p = Path(path)
    save_safetensors(out, p / WEIGHTS)
    atomic_write(p / "config.json", json.dumps(config, indent=2) + "\n")
    return p
