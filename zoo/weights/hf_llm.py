"""Hugging Face decoder checkpoints in and out: config.json and safetensors, for every class zoo/archs has a
record of (`RECORDS`: Llama to Qwen3, Gemma 3, OLMo 3, GLM-4, Cohere 2, the MoE classes, DeepSeek-V3, Mistral 4).

    model = zoo.from_pretrained("path/to/folder", dtype=torch.bfloat16)    # config.json + *.safetensors
    zoo.save_pretrained(model, "out/", tokenizer="path/to/tokenizer.model")

The machinery every record goes through: the common config.json keys (both transformers dialects of RoPE), the tensor
names (Zoo fuses q/k/v and gate/up and stacks the experts: `key_map`), the rows a record stores in another order
(`row_orders`), the class a model exports as (`record_for`). A config.json key that changes the computation is read or
refused by name. Loading builds the model on the meta device and reads each tensor into its rows: no two copies.
"""
from __future__ import annotations

import json
import math
import shutil
from functools import partial
from pathlib import Path
from typing import Optional, Union

import torch

from ..archs import BY_MODEL_TYPE, BY_WRAPPER, FEATURES, RECORDS, Record, features
from ..config import RECURRENT_TYPES, ConfigError, LLMConfig, RopeScaling, from_dict, to_dict
from .files import (FILE_DTYPES, atomic_write, config_folder, mismatches, read_json, read_safetensors_header,
                    save_safetensors, shards)

ARCHITECTURES = tuple(RECORDS)
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}
_ACTS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


# -------------------------------------------------------------- config.json <-> LLMConfig

def record_of(hf: dict, source: str) -> Record:
    """The record of a config.json's class (its `architectures`, else its `model_type`)."""
    archs = hf.get("architectures") or []
    archs = [archs] if isinstance(archs, str) else archs
    rec = RECORDS.get(archs[0]) if archs else BY_MODEL_TYPE.get(hf.get("model_type"))
    if rec is None:
        name = archs[0] if archs else hf.get("model_type")
        raise ConfigError(f"{source}: unsupported architecture '{name}' (supported: {', '.join(ARCHITECTURES)})")
    return rec


def _rope_params(params: dict, hf: dict, key: str, source: str) -> tuple[float, Optional[RopeScaling]]:
    """(theta, scaling) of one RoPE parameter set (a 5.x rope_parameters entry or a 4.x rope_scaling)."""
    kind = params.get("rope_type", params.get("type", "default"))
    kind = "longrope" if kind == "su" else kind
    if kind not in ("default", "linear", "llama3", "yarn", "longrope", "proportional"):
        raise ConfigError(f"{source}: unsupported rope type '{kind}' in {key} "
                          f"(supported: default, linear, llama3, yarn, longrope, proportional)")
    need = {"llama3": ("factor", "low_freq_factor", "high_freq_factor"), "yarn": ("factor",),
            "longrope": ("short_factor", "long_factor")}.get(kind, ())
    if missing := [k for k in need if k not in params]:
        raise ConfigError(f"{source}: {key} of type '{kind}' lacks {', '.join(missing)}")
    try:
        theta = float(params["rope_theta"])
        if kind == "default" and not params.get("llama_4_scaling_beta"):
            return theta, None
        kind = "linear" if kind == "default" else kind  # a temperature on unscaled RoPE: linear by a factor of 1
        old = params.get("original_max_position_embeddings", hf.get("original_max_position_embeddings",
                                                                        hf.get("max_position_embeddings")))
        factor = params.get("factor") or (hf["max_position_embeddings"] / old if kind == "longrope" else 1.0)
        scaling = dict(type=kind, factor=float(factor), original_max_position_embeddings=int(old))
        if kind == "llama3":
            scaling.update(low_freq_factor=float(params["low_freq_factor"]),
                           high_freq_factor=float(params["high_freq_factor"]))
        if kind == "yarn":
            scaling.update({k: params[k] for k in ("beta_fast", "beta_slow", "truncate") if params.get(k) is not None})
            m, m_all = params.get("mscale"), params.get("mscale_all_dim")
            if params.get("attention_factor") is None and m and m_all and factor > 1:  # DeepSeek's form
                params = {**params, "attention_factor": (0.1 * m * math.log(factor) + 1) / (0.1 * m_all * math.log(factor) + 1)}
            if m_all:
                scaling["mscale_all_dim"] = float(m_all)
        if kind == "proportional":
            scaling["rotated"] = float(params.get("partial_rotary_factor", 1.0))
        if kind == "longrope":
            scaling.update(short_factor=list(params["short_factor"]), long_factor=list(params["long_factor"]))
        if params.get("attention_factor") is not None:
            scaling["attention_factor"] = float(params["attention_factor"])
        if params.get("llama_4_scaling_beta"):  # Llama 4's attention temperature (Mistral 4)
            scaling["query_beta"] = float(params["llama_4_scaling_beta"])
        return theta, from_dict(RopeScaling, scaling, source, key + ".")
    except (TypeError, ValueError, KeyError, ZeroDivisionError):
        raise ConfigError(f"{source}: {key} and rope_theta must be numbers, got {params}") from None


def _rope(hf: dict, get, rec: Record, source: str) -> dict:
    """rope_theta, rope_scaling, rope_theta_local and rotary_fraction from a 5.x `rope_parameters` (one set,
    or one per layer type) or a 4.x `rope_theta` + `rope_scaling` (+ `rope_local_base_freq`). The local layers'
    base is kept where it differs from the global layers' RoPE (their base, or a scaling they do not share)."""
    params, key = hf.get("rope_parameters") or rec.defaults.get("rope_parameters") or {}, "rope_parameters"
    local = hf.get("rope_local_base_freq", rec.defaults.get("rope_local_base_freq"))
    if "full_attention" in params or "sliding_attention" in params:  # 5.x, per layer type
        sliding = dict(params.get("sliding_attention") or {})
        params, key = dict(params.get("full_attention") or {}), key + ".full_attention"
        if sliding.get("rope_type", "default") != "default":
            raise ConfigError(f"{source}: rope_parameters.sliding_attention of type '{sliding['rope_type']}' is not "
                              f"supported (default only)")
        local = sliding.get("rope_theta", local)
    if hf.get("rope_scaling"):  # 4.x (transformers 5 also lets it override rope_parameters)
        params, key = {**params, **hf["rope_scaling"]}, "rope_scaling"
    if not all(isinstance(v, (int, float, str, list, type(None))) for v in params.values()):
        raise ConfigError(f"{source}: {key} per layer type is not supported here")
    params = {**params, "rope_theta": params.get("rope_theta", get("rope_theta", 1e4))}
    theta, scaling = _rope_params(params, hf, key, source)
    fraction = 1.0 if scaling and scaling.type == "proportional" else \
        params.get("partial_rotary_factor", get("partial_rotary_factor", 1.0))
    out = dict(rope_theta=theta, rope_scaling=to_dict(scaling) if scaling else None, rotary_fraction=float(fraction or 1))
    if local is not None and "rope_local" in rec.may | rec.needs and (float(local) != theta or scaling):
        out["rope_theta_local"] = float(local)
    return out


def _period(kinds: list) -> list:
    """A list cut to its shortest repeating period."""
    period = next(p for p in range(1, len(kinds) + 1) if all(k == kinds[i % p] for i, k in enumerate(kinds)))
    return kinds[:period]


def _window(hf: dict, get, rec: Record, n_layers: int) -> tuple[Optional[int], list]:
    """(sliding_window, attn_pattern) as the record's `window` rule reads config.json."""
    window = get("sliding_window")
    if rec.window is None or window is None or (rec.window == "qwen" and not get("use_sliding_window")):
        return None, []
    if rec.window == "every":
        return window, []
    types = hf.get("layer_types")
    local = [t == "sliding_attention" for t in types] if types else rec.default_local(hf, get, n_layers)
    pattern = _period(["local" if t else "global" for t in local])  # Zoo's attn_pattern
    if pattern == ["global"]:
        return None, []
    return window, [] if pattern == ["local"] else pattern


def config_from_hf(hf: dict, source: str = "config.json") -> tuple[LLMConfig, str]:
    """A Hugging Face config.json (as a dict) -> (LLMConfig, architecture): the common keys here, the class's
    own in its record."""
    rec = record_of(hf, source)
    if missing := [k for k in _REQUIRED if k not in hf and k not in rec.defaults]:
        raise ConfigError(f"{source}: missing key(s) {', '.join(missing)}")
    get = lambda k, d=None: hf[k] if k in hf else rec.defaults.get(k, d)  # noqa: E731
    act = hf.get("hidden_activation") or hf.get("hidden_act") or rec.act
    if act not in _ACTS:
        raise ConfigError(f"{source}: hidden_act '{act}' is not supported (silu, gelu_pytorch_tanh)")
    if get("mlp_bias"):
        raise ConfigError(f"{source}: mlp_bias=true is not supported")
    if "moe" in rec.needs and get("attention_dropout"):
        raise ConfigError(f"{source}: attention_dropout={hf['attention_dropout']} is not supported (Zoo's attention has no dropout)")
    d, n_heads, n_layers = hf["hidden_size"], hf["num_attention_heads"], hf["num_hidden_layers"]
    head_dim = get("head_dim") or d // n_heads
    window, pattern = _window(hf, get, rec, n_layers)
    data = dict(
        vocab_size=hf["vocab_size"], d_model=d, n_layers=n_layers, n_heads=n_heads,
        n_kv_heads=get("num_key_value_heads") or n_heads, head_dim=head_dim if head_dim * n_heads != d else None,
        ffn_hidden=get("intermediate_size"), max_seq_len=get("max_position_embeddings", 2048),
        norm_eps=get("rms_norm_eps", 1e-6), tie_embeddings=bool(get("tie_word_embeddings", rec.tie)),
        sliding_window=window, attn_pattern=pattern, mlp_act=_ACTS[act],
        **_rope(hf, get, rec, source))
    if rec.mixers and hf.get("layer_types"):  # a hybrid class: its layers' kinds, Zoo's names for them
        data["layer_types"] = _period([rec.types.get(t, t) for t in hf["layer_types"]])
    try:
        own = rec.config(hf, get, n_layers)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{source}: {e}") from None
    if get("attention_bias") and "qkv_bias" not in own:
        raise ConfigError(f"{source}: attention_bias=true is not supported for {rec.hf_class}")
    if "moe" in own:  # transformers adds the load-balancing loss in training only with output_router_logits
        own["moe"] = {"top_k": get("num_experts_per_tok"), "balance": "aux_loss" if hf.get("output_router_logits")
                      else "none", **own["moe"]}
    return from_dict(LLMConfig, {**data, **own}, source), rec.hf_class


def record_for(cfg: LLMConfig, remembered: Optional[str] = None) -> Record:
    """The record of the Hugging Face class that holds `cfg`: the one it was loaded from when that still fits,
    else the first of `RECORDS` whose needs it has and whose needs and mays hold all it has."""
    have = features(cfg)
    no_place = {"mod_capacity": "Mixture-of-Depths routers", "mlp": "a ReLU^2 MLP", "value_embeds": "value embeddings",
                "unet_skips": "U-net skip weights",
                "mup_base_width": "muP's multipliers"}  # what no Hugging Face class holds
    for key, what in no_place.items():
        if getattr(cfg, key) != LLMConfig.__dataclass_fields__[key].default:
            raise ValueError(f"model.{key}={getattr(cfg, key)}: no Hugging Face class holds {what}")

    def misfit(rec):  # what `cfg` lacks and what it has too many, for rec
        return rec.needs - have, have - rec.needs - rec.may

    fits = [r for r in RECORDS.values() if misfit(r) == (set(), set())]
    for rec in sorted(fits, key=lambda r: r.hf_class != remembered):
        if not rec.refuses(cfg):
            return rec
    if fits:
        raise ValueError("; ".join(f"a {r.hf_class} has {r.refuses(cfg)}" for r in fits))
    name = lambda fs: ", ".join(f"{f} (model.{FEATURES[f]})" for f in sorted(fs))  # noqa: E731
    close = min(RECORDS.values(), key=lambda r: sum(map(len, misfit(r))))
    lack, extra = misfit(close)
    raise ValueError(f"no Hugging Face architecture here holds a model with {name(have)} (the closest, "
                     f"{close.hf_class}, " + " and ".join(w for w in (lack and f"needs {name(lack)}",
                                                              extra and f"has no {name(extra)}") if w)
                     + "; docs/pretrained.md lists what each holds)")


def architecture_for(cfg: LLMConfig, remembered: Optional[str] = None) -> str:
    """The Hugging Face class that can hold `cfg` (see `record_for`)."""
    return record_for(cfg, remembered).hf_class


def _rope_to_hf(cfg: LLMConfig, theta: float, scaling: Optional[RopeScaling]) -> dict:
    """One 5.x RoPE parameter set."""
    rope = {"rope_type": "default", "rope_theta": theta}
    if scaling is not None:
        keep = {"llama3": ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
                "yarn": ("beta_fast", "beta_slow", "truncate", "original_max_position_embeddings", "attention_factor",
                         "mscale_all_dim"),
                "longrope": ("short_factor", "long_factor", "original_max_position_embeddings", "attention_factor"),
                "proportional": ("rotated",)}
        rope.update(rope_type=scaling.type, factor=scaling.factor,
                    **{k: getattr(scaling, k) for k in keep.get(scaling.type, ()) if getattr(scaling, k) is not None})
        rope = {"partial_rotary_factor" if k == "rotated" else k: v for k, v in rope.items()}
        if scaling.query_beta:
            rope.update(llama_4_scaling_beta=scaling.query_beta,
                        original_max_position_embeddings=scaling.original_max_position_embeddings)
    return rope


def config_to_hf(cfg: LLMConfig, arch: str, dtype: torch.dtype, base: Optional[dict] = None) -> dict:
    """LLMConfig -> config.json dict: the common keys here, the class's own from its record. RoPE is written in
    both dialects (5.x `rope_parameters`, 4.x `rope_theta` + `rope_scaling`), so either transformers version
    reads it. Token ids (bos/eos/pad) are kept from `base`, the config.json the model was loaded from; without one
    they are null (a class's defaults, e.g. Phi-3's pad 32000, may lie outside a small vocabulary)."""
    rec, n = RECORDS[arch], cfg.n_layers
    rope = _rope_to_hf(cfg, cfg.rope_theta, cfg.rope_scaling)
    hf = {
        "architectures": [arch], "model_type": rec.model_type,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "intermediate_size": cfg.resolved_ffn_hidden,
        "num_hidden_layers": n, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.resolved_n_kv_heads, "head_dim": cfg.resolved_head_dim,
        "hidden_act": "gelu_pytorch_tanh" if cfg.mlp_act == "gelu_tanh" else "silu",
        "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "rope_parameters": rope, "rope_theta": cfg.rope_theta,
        "rope_scaling": {k: v for k, v in rope.items() if k != "rope_theta"} if cfg.rope_scaling else None,
        "dtype": str(dtype).removeprefix("torch."), "use_cache": True,
    }
    types = ["sliding_attention" if cfg.is_local(i) else "full_attention" for i in range(n)]
    if rec.window == "every":
        hf["sliding_window"] = cfg.sliding_window
    elif rec.window == "qwen":
        hf.update(use_sliding_window=cfg.sliding_window is not None, sliding_window=cfg.sliding_window)
        if "pattern" in rec.may:
            hf.update(max_window_layers=n, layer_types=types)
    elif rec.window == "types":
        hf.update(sliding_window=cfg.sliding_window or cfg.max_seq_len, layer_types=types)
    if "rope_local" in rec.may:
        local = cfg.rope_theta_local or cfg.rope_theta
        hf.update(rope_parameters={"full_attention": rope, "sliding_attention": _rope_to_hf(cfg, local, None)})
    if rec.mixers:
        names = {v: k for k, v in rec.types.items()}
        hf["layer_types"] = [names.get(cfg.layer_type(i), cfg.layer_type(i)) for i in range(n)]
    if cfg.moe is not None:
        hf.update(num_experts_per_tok=cfg.moe.top_k, output_router_logits=cfg.moe.balance == "aux_loss",
                  attention_dropout=0.0)
    hf.update(rec.to_hf(cfg))
    if not rec.old_rope:
        del hf["rope_theta"], hf["rope_scaling"]
    hf["partial_rotary_factor"] = fraction = cfg.rotary_dim / hf["head_dim"]  # of the head_dim the class counts
    for params in (rope, hf["rope_parameters"].get("sliding_attention")):
        if params is not None and fraction < 1:
            params["partial_rotary_factor"] = fraction
    ids = ("bos_token_id", "eos_token_id", "pad_token_id")  # without a base unknown: None, not the class's default
    hf.update({k: base[k] for k in ids if k in base} if base is not None else dict.fromkeys(ids))
    return hf


# --------------------------------------------------------------------------- weight names

def key_map(cfg: LLMConfig, arch: Optional[str] = None, splits: Optional[dict] = None,
            fused: Optional[tuple] = None) -> dict[str, list[tuple[str, tuple]]]:
    """Zoo parameter name -> [(Hugging Face name, shape), ...]; several entries are fused by concatenating along dim 0
    in that order (the stacked experts: seen as 2-D, (E * rows, cols)). An entry (name, shape, rows) takes only
    those rows of the file tensor (`Record.split_rows`: one file tensor split across Zoo tensors). lm_head is absent
    when the embeddings are tied. The record of `arch` names the norms, the fused projections and the experts.
    splits, fused: another format's `split_rows` and `fused` (GGUF's)."""
    rec = RECORDS[arch] if arch else Record()
    fused = rec.fused if fused is None else fused
    d, V = cfg.d_model, cfg.vocab_size
    m = {"embed.weight": [("model.embed_tokens.weight", (V, d))], **_per_layer_keys(cfg)}
    for i in range(cfg.n_layers):
        z, h = f"layers.{i}.", f"model.layers.{i}."
        for zoo_norm, hf_norm in rec.norms.items():
            m[z + zoo_norm + ".weight"] = [(h + hf_norm + ".weight", (d,))]
        if cfg.layer_type(i) in RECURRENT_TYPES:
            m.update(_mixer_keys(cfg, cfg.layer_type(i), z, h + rec.mixers.get(cfg.layer_type(i), "mixer") + "."))
        else:
            m.update(_attention_keys(cfg, rec, z, h + "self_attn.", i, fused))
        if cfg.layer_scalar:
            m[z + "layer_scalar"] = [(h + "layer_scalar", (1,))]
        if cfg.per_layer_dim:
            P = cfg.per_layer_dim
            m.update({z + "per_layer.gate.weight": [(h + "per_layer_input_gate.weight", (P, d))],
                      z + "per_layer.out.weight": [(h + "per_layer_projection.weight", (d, P))],
                      z + "per_layer.norm.weight": [(h + "post_per_layer_input_norm.weight", (d,))]})
        if cfg.is_sparse(i):
            m.update(_moe_keys(cfg, z, rec.experts(cfg, h), "gate_up_proj" in fused))
            if cfg.moe.branch_norms:  # the MoE's own norms in place of the block's
                del m[z + "mlp_norm.weight"]
            continue
        F = cfg.ffn_width(i)
        m[z + "mlp.gate_up.weight"] = [(h + "mlp.gate_up_proj.weight", (2 * F, d))] if "gate_up_proj" in fused \
            else [(h + "mlp.gate_proj.weight", (F, d)), (h + "mlp.up_proj.weight", (F, d))]
        m[z + "mlp.down.weight"] = [(h + "mlp.down_proj.weight", (d, F))]
    m["norm.weight"] = [("model.norm.weight", (d,))]
    if not cfg.tie_embeddings:
        m["lm_head.weight"] = [("lm_head.weight", (V, d))]
    return _split(rec.split_rows(cfg) if splits is None else splits,
                  {k: [(rec.renamed(n), shape) for n, shape in parts] for k, parts in m.items()})


def _split(splits: dict, m: dict) -> dict:
    """key_map's entries of a layer tensor the record splits (`split_rows`) turned into rows of the tensor the file
    holds instead (its rows: all its parts', its columns: the entry's)."""
    total = {}
    for file, rows in splits.values():
        total[file] = total.get(file, 0) + len(rows)
    for k, parts in m.items():
        (name, shape), own = parts[0], parts[0][0].split(".", 3)[-1]  # 'model.layers.i.' + own
        if len(parts) == 1 and own in splits:
            file, rows = splits[own]
            m[k] = [(name.removesuffix(own) + file, (total[file],) + shape[1:], rows)]
    return m


def height(part: tuple) -> int:
    """The rows a key_map entry gives its Zoo tensor."""
    return len(part[2]) if len(part) > 2 else part[1][0]


def _mixer_keys(cfg: LLMConfig, kind: str, z: str, x: str) -> dict:
    """Zoo -> file names of a recurrent layer's mixer (the blocks hold the files' names; x: its prefix there)."""
    from ..llm import recurrent_block
    with torch.device("meta"):
        block = recurrent_block(cfg, kind)
    return {z + "mixer." + n: [(x + n, tuple(p.shape))] for n, p in block.named_parameters()}


def _per_layer_keys(cfg: LLMConfig) -> dict:
    """Zoo -> file names of the per-layer input embeddings' table, projection and norm (none when off)."""
    LP, P = cfg.n_layers * cfg.per_layer_dim, cfg.per_layer_dim
    return {"per_layer.embed.weight": [("model.embed_tokens_per_layer.weight", (cfg.per_layer_vocab or cfg.vocab_size, LP))],
            "per_layer.proj.weight": [("model.per_layer_model_projection.weight", (LP, cfg.d_model))],
            "per_layer.norm.weight": [("model.per_layer_projection_norm.weight", (P,))]} if P else {}


def _attention_keys(cfg: LLMConfig, rec: Record, z: str, a: str, i: int = 0, fused: tuple = ()) -> dict:
    """Zoo -> file names of attention layer i (z, a: the prefixes); a gate (attn_gate) doubles q_proj's rows; a
    KV-sharing layer has no k and v, a global layer whose values are its keys (global_kv_same) no v."""
    d, (n_kv, D) = cfg.d_model, cfg.attn_shape(i)
    q, kv = cfg.n_heads * D, n_kv * D
    own = {"q": True, "k": not cfg.kv_shared(i), "v": not cfg.kv_shared(i) and not (
        cfg.global_kv_same and not cfg.is_local(i))}
    m = _mla_keys(cfg, z, a, i) if cfg.mla else {}
    for kind in (() if cfg.mla else ("weight", "bias") if cfg.qkv_bias else ("weight",)):
        shapes = [(r, d)[:2 if kind == "weight" else 1] for r in (q * (1 + cfg.attn_gate), kv, kv)]
        m[z + "attn.qkv." + kind] = [(a + f"qkv_proj.{kind}", (q + 2 * kv, d)[:len(shapes[0])])] \
            if "qkv_proj" in fused else [(a + f"{n}_proj.{kind}", shape) for n, shape in zip("qkv", shapes) if own[n]]
    if cfg.qk_norm:
        per_proj = cfg.qk_norm == "proj"
        m[z + "attn.q_norm.weight"] = [(a + "q_norm.weight", (q if per_proj else D,))]
        if own["k"]:
            m[z + "attn.k_norm.weight"] = [(a + "k_norm.weight", (kv if per_proj else D,))]
    m[z + "attn.proj.weight"] = [(a + "o_proj.weight", (d, cfg.n_heads * cfg.mla.v_dim if cfg.mla else q))]
    if cfg.attn_out_bias:
        m[z + "attn.proj.bias"] = [(a + "o_proj.bias", (d,))]
    if cfg.attn_sinks:
        m[z + "attn.sinks"] = [(a + "sinks", (cfg.n_heads,))]
    return m


def _moe_keys(cfg: LLMConfig, z: str, x: dict, fused: bool = False) -> dict:
    """Zoo -> file names of one sparse layer (z: its Zoo prefix; x: the record's `experts` names): the router,
    the experts (stacked in Zoo; per-expert files: each expert's shapes, concatenated along dim 0) and the
    shared experts (fused: their gate and up in one gate_up_proj)."""
    d, E, F = cfg.d_model, cfg.moe.n_experts, cfg.resolved_expert_hidden
    m = {z + "mlp.router.weight": [(x["router"] + ".weight", (E, d))]}
    if "per_expert" in x:
        prefix, gate, up, down = x["per_expert"]
        m[z + "mlp.gate_up"] = [(prefix.format(e=e) + n + ".weight", (F, d)) for e in range(E) for n in (gate, up)]
        m[z + "mlp.down"] = [(prefix.format(e=e) + down + ".weight", (d, F)) for e in range(E)]
    else:
        (gate_up, gu_shape), (down, down_shape) = x["stacked"]
        m[z + "mlp.gate_up"], m[z + "mlp.down"] = [(gate_up, gu_shape)], [(down, down_shape)]
        if cfg.moe.bias:
            m[z + "mlp.gate_up_bias"], m[z + "mlp.down_bias"] = [(gate_up + "_bias", (E, 2 * F))], [(down + "_bias", (E, d))]
    if cfg.moe.bias:
        m[z + "mlp.router.bias"] = [(x["router"] + ".bias", (E,))]
    if "score_bias" in x:
        m[z + "mlp.score_bias"] = [(x["score_bias"], (E,))]
    if cfg.moe.router_norm:
        m[z + "mlp.router_scale"], m[z + "mlp.expert_scale"] = [(x["router_scale"], (d,))], [(x["expert_scale"], (E,))]
    if cfg.moe.branch_norms:
        names = ("shared_norm", "shared_post_norm", "routed_norm", "routed_post_norm")
        m.update({z + f"mlp.{n}.weight": [(f + ".weight", (d,))] for n, f in zip(names, x["norms"])})
    if cfg.moe.n_shared:
        Fs, s = cfg.moe.n_shared * (cfg.moe.shared_hidden or F), x["shared"]
        m[z + "mlp.shared.gate_up.weight"] = [(s + "gate_up_proj.weight", (2 * Fs, d))] if fused else \
            [(s + "gate_proj.weight", (Fs, d)), (s + "up_proj.weight", (Fs, d))]
        m[z + "mlp.shared.down.weight"] = [(s + "down_proj.weight", (d, Fs))]
        if cfg.moe.shared_gate:
            m[z + "mlp.shared_gate.weight"] = [(x["shared_gate"] + ".weight", (1, d))]
    return m


def row_orders(cfg: LLMConfig, rec: Record, hf: Optional[dict] = None) -> dict[str, list]:
    """File tensor name -> the order of its rows in Zoo (zoo_rows = file_rows[order]), for the tensors whose
    RoPE channels the record stores in interleaved pairs."""
    suffixes = rec.rope_rows(cfg, hf)
    if not suffixes:
        return {}
    return {name: suffixes[name.split(".", 3)[-1].rsplit(".", 1)[0]] for parts in key_map(cfg, rec.hf_class).values()
            for name, *_ in parts if name.split(".", 3)[-1].rsplit(".", 1)[0] in suffixes}


def inverse(order: list) -> list:
    """The order that undoes `order`."""
    return sorted(range(len(order)), key=order.__getitem__)


@torch.no_grad()
def _shift_norms(state: dict, offset: float):
    """Add `offset` to every norm gain of a state dict, in place."""
    for name, t in state.items():  # not a recurrent mixer's gated norm (a gain of its own)
        if offset and name.endswith("norm.weight") and ".mixer." not in name:
            t += offset


def _mla_keys(cfg: LLMConfig, z: str, a: str, i: int) -> dict:
    """Zoo -> Hugging Face names of layer i's multi-head latent attention (DeepSeek-V3; z, a: the prefixes)."""
    mla, d, H = cfg.mla, cfg.d_model, cfg.n_heads
    qk = H * (mla.nope_dim + mla.rope_dim)
    m = {z + "attn.kv_a.weight": [(a + "kv_a_proj_with_mqa.weight", (mla.kv_rank + mla.rope_dim, d))],
         z + "attn.kv_norm.weight": [(a + "kv_a_layernorm.weight", (mla.kv_rank,))],
         z + "attn.kv_b.weight": [(a + "kv_b_proj.weight", (H * (mla.nope_dim + mla.v_dim), mla.kv_rank))]}
    if cfg.indexer_at(i):  # DeepSeek-V3.2's lightning indexer
        i, D = a + "indexer.", mla.index_dim
        m.update({z + "attn.indexer.q.weight": [(i + "wq_b.weight", (mla.index_heads * D, mla.q_rank))],
                  z + "attn.indexer.k.weight": [(i + "wk.weight", (D, d))],
                  z + "attn.indexer.k_norm.weight": [(i + "k_norm.weight", (D,))],
                  z + "attn.indexer.k_norm.bias": [(i + "k_norm.bias", (D,))],
                  z + "attn.indexer.weights.weight": [(i + "weights_proj.weight", (mla.index_heads, d))]})
    if mla.q_rank is None:
        return {**m, z + "attn.q_b.weight": [(a + "q_proj.weight", (qk, d))]}
    return {**m, z + "attn.q_a.weight": [(a + "q_a_proj.weight", (mla.q_rank, d))],
            z + "attn.q_norm.weight": [(a + "q_a_layernorm.weight", (mla.q_rank,))],
            z + "attn.q_b.weight": [(a + "q_b_proj.weight", (qk, mla.q_rank))]}


# ---------------------------------------------------------------------- safetensors files

def weight_files(folder: Path) -> list[Path]:
    """model.safetensors, or the shards listed in model.safetensors.index.json."""
    if files := shards(folder, "model.safetensors"):
        return files
    if any(folder.glob("pytorch_model*.bin")):
        raise FileNotFoundError(f"{folder}: only pytorch_model*.bin weights; Zoo reads safetensors only "
                                f"(unpickling is unsafe): convert them to model.safetensors")
    raise FileNotFoundError(f"{folder}: no model.safetensors or model.safetensors.index.json")


def read_tensor(f, path: Path, offset: int, entry: dict, dest: torch.Tensor):
    """Read one tensor of an open safetensors file into `dest` (same shape), straight into it when it is a
    contiguous CPU tensor of the file's dtype. Plain reads, not a memory map, so the file's pages are
    not counted in (and doubling) the process's resident memory."""
    file_dtype = FILE_DTYPES[entry["dtype"]]
    direct = dest.device.type == "cpu" and dest.dtype == file_dtype and dest.is_contiguous()
    buf = dest if direct else torch.empty(dest.shape, dtype=file_dtype, device="cpu")
    view = memoryview(buf.view(-1).view(torch.uint8).numpy())  # safetensors data is little-endian
    begin, end = entry["data_offsets"]
    f.seek(offset + begin)
    done = 0
    while done < end - begin:
        n = f.readinto(view[done:])
        if not n:
            raise ValueError(f"{path}: corrupt or truncated safetensors file (it ends inside a tensor)")
        done += n
    if not direct:
        dest.copy_(buf)


def _resolve_dtype(dtype, hf: dict, source: str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    name = dtype if dtype not in (None, "auto") else hf.get("dtype", hf.get("torch_dtype")) or "float32"
    if name not in _DTYPES:  # the caller's argument, else the file's
        where = f"{source}: unsupported dtype '{name}'" if name != dtype else f"dtype={name!r} is not supported"
        raise ValueError(f"{where} (supported: {', '.join(_DTYPES)})")
    return _DTYPES[name]


def assemble(cfg: LLMConfig, kmap: dict, dtype: torch.dtype, device: torch.device, fills) -> "LLM":
    """An LLM whose weights come from `fills`: (external name of `kmap`, fill(dest)) pairs, each writing its
    rows of a Zoo tensor. Built on the meta device, each tensor allocated once in `dtype` on `device`
    (no concatenation copies); the LM head tied and the RoPE tables rebuilt. Every name must be filled."""
    from ..llm import LLM

    with torch.device("meta"):
        model = LLM(cfg)
    rows_of: dict[str, list] = {}  # external name -> [(Zoo name, first row, key_map entry), ...]
    for zoo_name, parts in kmap.items():
        start = 0
        for part in parts:
            rows_of.setdefault(part[0], []).append((zoo_name, start, part))
            start += height(part)
    state: dict[str, torch.Tensor] = {}
    for name, fill in fills:
        for zoo_name, _, _ in rows_of[name]:
            if zoo_name not in state:
                parts = kmap[zoo_name]
                shape = (sum(map(height, parts)),) + parts[0][1][1:]
                state[zoo_name] = torch.empty(shape, dtype=dtype, device=device)
        zoo_name, start, part = rows_of[name][0]
        if len(part) == 2:
            fill(state[zoo_name][start:start + height(part)])
            continue
        whole = torch.empty(part[1], dtype=dtype, device=device)  # a file tensor split across Zoo tensors
        fill(whole)
        for zoo_name, start, part in rows_of[name]:
            state[zoo_name][start:start + height(part)] = whole[part[2]]
    if cfg.tie_embeddings:
        state["lm_head.weight"] = state["embed.weight"]
    for name, buf in model.state_dict().items():  # running statistics no file holds (router_load) start at zero
        if name not in state and name not in (n for n, _ in model.named_parameters()):
            state[name] = torch.zeros(buf.shape, dtype=torch.float32, device=device)
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    state = {k: t.view(shapes[k]) for k, t in state.items()}  # stacked experts: (E * rows, cols) -> (E, rows, cols)
    model.load_state_dict(state, strict=True, assign=True)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    # the RoPE tables are non-persistent buffers: rebuild them (fp32) on the real device. They grow
    # on demand, so start at most 8192 positions long rather than max_position_embeddings (128k+).
    with torch.device(device):
        model.build_rope(min(cfg.max_seq_len, 8192))
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    assert not left, f"tensors left on the meta device after loading: {left}"
    return model


# ----------------------------------- the format interface: detect / load / exports / save

def detect(path) -> bool:
    """A folder (or its config.json) whose config.json describes a Hugging Face causal LM."""
    try:
        hf = read_json(config_folder(path) / "config.json")
    except (ValueError, OSError):  # none, or not a JSON object
        return False
    archs = hf.get("architectures") or []
    return any(isinstance(a, str) and a.endswith("ForCausalLM") for a in archs) or \
        hf.get("model_type") in BY_MODEL_TYPE or hf.get("model_type") in BY_WRAPPER


def unwrap(hf: dict) -> tuple[dict, str]:
    """A multimodal class's config.json (a record's `wrapper`) -> (its text model's config.json, the prefix its tensors
    carry in place of 'model.'); any other -> (hf, '')."""
    rec = BY_WRAPPER.get(hf.get("model_type"))
    if rec is None or not isinstance(hf.get("text_config"), dict):
        return hf, ""
    dtype = {"dtype": hf.get("dtype", hf.get("torch_dtype"))}
    tie = {"tie_word_embeddings": hf["tie_word_embeddings"]} if "tie_word_embeddings" in hf else {}  # the outer model's
    return {**dtype, **hf["text_config"], **tie, "architectures": [rec.hf_class], "model_type": rec.model_type}, rec.wrapper[1]


def load(path, dtype: Union[torch.dtype, str, None] = None, device: Union[torch.device, str, None] = None):
    """Load a Hugging Face folder into a Zoo LLM; dtype None / "auto": the checkpoint's (else fp32)."""
    folder = config_folder(path)
    cfg_file = folder / "config.json"
    hf, outer = unwrap(read_json(cfg_file))
    # a multimodal folder: the text model's tensors, the other towers' left unread
    inner = dict(rename=lambda n: outer + n.removeprefix("model.") if n.startswith("model.") else n,
                 others=lambda n: not n.startswith((outer, "lm_head."))) if outer else {}
    return load_llm(hf, folder, str(cfg_file), _resolve_dtype(dtype, hf, str(cfg_file)), device, **inner)


def load_llm(hf: dict, folder: Path, source: str, dtype: torch.dtype, device=None, rename=None, others=None):
    """A Zoo LLM of config.json `hf` from the safetensors files of `folder`. rename: the file's name of each of the
    class's tensor names (a model inside a larger one); others(name): true for the file's tensors of other parts."""
    cfg, arch = config_from_hf(hf, source)
    rec = RECORDS[arch]
    device = torch.device(device or "cpu")
    rename = rename or (lambda n: n)

    # 1. check every file header and every name/shape before reading any data
    headers = {f: read_safetensors_header(f)[::2] for f in weight_files(folder)}  # (table, data offset)
    found = {name: tuple(t["shape"]) for table, _ in headers.values() for name, t in table.items()}
    kmap = {z: [(rename(n), *rest) for n, *rest in parts] for z, parts in key_map(cfg, arch).items()}
    expected = {hf_name: shape for parts in kmap.values() for hf_name, shape, *_ in parts}
    # old checkpoints saved the RoPE buffer; tied ones may still carry a copy of lm_head; a module of zero width
    # (DeepSeek-V3's shared experts at n_shared_experts=0) is saved as empty tensors
    problems = mismatches(found, expected, lambda n: n.endswith("rotary_emb.inv_freq") or (others and others(n))
                          or (cfg.tie_embeddings and n == rename("lm_head.weight")) or 0 in found[n])
    if problems:
        raise ValueError(f"{folder}: weights do not match config.json ({arch}, {cfg.n_layers} layers): {problems}")

    # 2. read every file tensor straight into the rows of its Zoo tensor
    orders = {rename(k): v for k, v in row_orders(cfg, rec, hf).items()}

    def fills():
        for path, (table, offset) in headers.items():
            with open(path, "rb", buffering=0) as f:
                for name in sorted((n for n in table if n in expected), key=lambda n: table[n]["data_offsets"][0]):
                    yield name, reordered(partial(read_tensor, f, path, offset, table[name]), orders.get(name))

    model = assemble(cfg, kmap, dtype, device, fills())
    _shift_norms(model.state_dict(), rec.norm_offset)
    model.load_state_dict(rec.layout(model.state_dict(), cfg, to_file=False))
    model.hf_architecture = arch
    model.hf_config, model.hf_folder = hf, str(folder)  # (a GGUF export reads its tokenizer.json)
    return model.eval()


def reordered(fill, order: Optional[list]):
    """fill(dest), writing rows in the file's order, as a fill writing them in Zoo's (`row_orders`)."""
    if order is None:
        return fill

    def fill_reordered(dest):
        tmp = torch.empty_like(dest)
        fill(tmp)
        dest.copy_(tmp[order])
    return fill_reordered


def exports(model) -> bool:
    return getattr(getattr(model, "_orig_mod", model), "family", None) == "llm"


def holds(model) -> str:
    """Why no Hugging Face class holds `model` ('' when one does): no class has its features, or it has
    trained tensors the class's file has no place for (a routing bias)."""
    try:
        rec = record_for(model.config, getattr(model, "hf_architecture", None))
    except ValueError as e:
        return str(e)
    held = set(key_map(model.config, rec.hf_class))
    bias = [n for n, t in model.state_dict().items() if n.endswith("score_bias") and n not in held and bool(t.any())]
    return f"model.moe.balance=bias: the trained routing bias has no place in a {rec.hf_class} checkpoint" if bias else ""


def _shard_limit(max_shard_size) -> int:
    if isinstance(max_shard_size, int):
        return max_shard_size
    s = str(max_shard_size).strip().upper()
    for unit, mult in (("GIB", 2**30), ("MIB", 2**20), ("KIB", 2**10), ("GB", 10**9), ("MB", 10**6),
                       ("KB", 10**3), ("B", 1)):
        if s.endswith(unit):
            try:
                return int(float(s[: -len(unit)]) * mult)
            except ValueError:
                break
    raise ValueError(f"max_shard_size {max_shard_size!r} must be bytes (int) or like '5GB', '500MB'")


def save(model, path, tokenizer=None, max_shard_size: Union[int, str] = "5GB",
         dtype: Optional[torch.dtype] = None) -> Path:
    """Write `model` as a Hugging Face folder: config.json and model.safetensors, or shards of at
    most max_shard_size bytes plus model.safetensors.index.json; copy tokenizer.model (a file, or
    a folder holding one) or write a GGUFTokenizer if given. Returns the folder."""
    model = getattr(model, "_orig_mod", model)  # torch.compile'd
    cfg: LLMConfig = model.config
    if why := holds(model):
        raise ValueError(why)
    rec = record_for(cfg, getattr(model, "hf_architecture", None))
    # what could fail is checked before anything is written: a failed save leaves an earlier one whole
    limit = _shard_limit(max_shard_size)
    tok_files = [] if tokenizer is None or hasattr(tokenizer, "save") else _tokenizer_files(Path(tokenizer))
    state = model.state_dict()
    dtype = state["embed.weight"].dtype if dtype is None else _resolve_dtype(dtype, {}, str(path))
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    if rec.norm_offset:
        state = {k: v.clone() if k.endswith("norm.weight") else v for k, v in state.items()}
        _shift_norms(state, -rec.norm_offset)

    # split fused tensors back into Hugging Face names, grouped into shards in order
    shards: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for hf_name, t in file_tensors(cfg, rec, rec.layout(state, cfg, to_file=True)):
        nbytes = t.numel() * dtype.itemsize
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append((hf_name, t))
        size += nbytes

    n = len(shards)
    names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    weight_map, total = {}, 0
    for name, shard in zip(names, shards):
        tensors = {k: t.detach().to("cpu", dtype).contiguous().clone() for k, t in shard}
        save_safetensors(tensors, out / name)
        for k, t in tensors.items():
            weight_map[k] = name
            total += t.numel() * t.element_size()
        del tensors
    index = out / "model.safetensors.index.json"
    if n > 1:
        atomic_write(index, json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    # remove weights of an earlier save into the same folder, which loaders would otherwise pick up
    keep = set(names) | ({index.name} if n > 1 else set())
    for old in [index, *out.glob("model*.safetensors")]:
        if old.name not in keep and old.is_file():
            old.unlink()

    hf = config_to_hf(cfg, rec.hf_class, dtype, token_ids(model))
    atomic_write(out / "config.json", json.dumps(hf, indent=2) + "\n")
    if hasattr(tokenizer, "save"):  # a GGUF file's (gguf_llm.load_tokenizer): written as tokenizer.json + config
        tokenizer.save(out)
    _copy_tokenizer(tok_files, out)
    return out


# The special tokens' ids in a GGUF file (its tokenizer.ggml.<key>), by name; config.json holds <name>_token_id
GGUF_TOKEN_IDS = {"bos": "bos_token_id", "eos": "eos_token_id", "pad": "padding_token_id", "unk": "unknown_token_id"}


def token_ids(model) -> Optional[dict]:
    """What gives config.json's bos/eos/pad ids: the config.json the model was loaded from, else its GGUF file's
    tokenizer ids; None when neither (a model Zoo trained)."""
    if (hf := getattr(model, "hf_config", None)) is not None:
        return hf
    fields = getattr(model, "gguf_tokenizer", None)
    return {f"{name}_token_id": fields[f"tokenizer.ggml.{key}"][0] for name, key in GGUF_TOKEN_IDS.items()
            if name != "unk" and f"tokenizer.ggml.{key}" in fields} if fields else None


def file_tensors(cfg: LLMConfig, rec: Record, state: dict, kmap: Optional[dict] = None, orders: Optional[dict] = None):
    """(Hugging Face name, tensor) of each file tensor, in key_map's order, from a state dict in the record's layout
    (fused tensors split, RoPE rows reordered, a file tensor split across Zoo tensors yielded once, filled when the
    iteration ends). kmap, orders: another format's names and row orders (zoo = file[order]) instead."""
    kmap = kmap or key_map(cfg, rec.hf_class)
    orders = {k: inverse(o) for k, o in (row_orders(cfg, rec) if orders is None else orders).items()}
    whole = {}  # file tensors split across Zoo tensors, filled as their parts come
    for zoo_name, parts in kmap.items():
        flat = state[zoo_name].reshape(-1, *parts[0][1][1:])  # stacked experts: (E * rows, cols)
        for (hf_name, shape, *rows), t in zip(parts, flat.split(list(map(height, parts)), dim=0)):
            t = t[orders[hf_name]] if hf_name in orders else t
            if rows:
                seen = hf_name in whole
                whole.setdefault(hf_name, t.new_empty(shape))[rows[0]] = t
                if seen:
                    continue
                t = whole[hf_name]
            yield hf_name, t


TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja")


def _tokenizer_files(src: Path) -> list[Path]:
    """A tokenizer.model file, or the tokenizer files of a Hugging Face folder; none there: a one-line error."""
    if src.is_dir():
        files = [src / n for n in TOKENIZER_FILES if (src / n).is_file()]
        if not files:
            raise FileNotFoundError(f"{src}: no tokenizer file ({', '.join(TOKENIZER_FILES)})")
        return files
    if not src.is_file():
        raise FileNotFoundError(f"{src}: tokenizer file not found")
    return [src]


def _copy_tokenizer(files: list[Path], out: Path):
    """Copy the tokenizer files (_tokenizer_files') into `out`."""
    for f in files:
        dst = out / ("tokenizer.model" if f.suffix == ".model" else f.name)
        if f.resolve() != dst.resolve():
            atomic_write(dst, lambda tmp: shutil.copyfile(f, tmp))
