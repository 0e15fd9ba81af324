"""Hugging Face decoder checkpoints in and out: Llama, Mistral, Qwen2, Qwen3, SmolLM3, OLMo 2, Phi-3 (and
Phi-4-mini), Gemma 2, Gemma 3 (text), and the Mixture-of-Experts Mixtral, Qwen2-MoE and Qwen3-MoE (`DENSE`).

    model = zoo.from_pretrained("path/to/folder", dtype=torch.bfloat16)    # config.json + *.safetensors
    zoo.save_pretrained(model, "out/", tokenizer="path/to/tokenizer.model")

Zoo fuses and stacks HF's separate q/k/v, gate/up and experts (`key_map`); both use rotate-half
RoPE; Gemma's norms (1 + w) hold 1 + w in Zoo. A config.json key that changes the computation is read or refused by name. Loading builds
the model on the meta device and reads each tensor into its rows, after every check: no two copies.
"""
from __future__ import annotations

import json
import math
import shutil
from functools import partial
from pathlib import Path
from typing import Optional, Union

import torch

from ..config import ConfigError, LLMConfig, RopeScaling, from_dict, to_dict
from .files import FILE_DTYPES, atomic_write, read_safetensors_header, save_safetensors

MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "GptOssForCausalLM",
                     "DeepseekV3ForCausalLM")
GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
ROPES = {"rope_linear", "rope_llama3", "rope_yarn"}
# Hugging Face class -> (model_type, the Zoo features (`features`) it needs, those it may have): what
# loads from it and what it can hold on export; docs/pretrained.md's table is made from it.
DENSE = {
    "LlamaForCausalLM": ("llama", set(), {"attn_bias"} | ROPES),
    "MistralForCausalLM": ("mistral", set(), {"window"} | ROPES),
    "Qwen2ForCausalLM": ("qwen2", {"qkv_bias"}, {"window", "pattern"} | ROPES),
    "Qwen3ForCausalLM": ("qwen3", {"qk_norm"}, {"window", "pattern", "attn_bias"} | ROPES),
    "SmolLM3ForCausalLM": ("smollm3", {"nope"}, {"window", "pattern", "attn_bias"} | ROPES),
    "Olmo2ForCausalLM": ("olmo2", {"qk_norm_proj", "post_norm"}, {"attn_bias"} | ROPES),
    "Phi3ForCausalLM": ("phi3", set(), {"partial_rotary", "window", "rope_longrope"}),
    "Gemma2ForCausalLM": ("gemma2", {"sandwich_norm", "gelu_tanh", "embed_scale"},
                          {"query_scalar", "attn_softcap", "final_softcap", "window", "pattern"} | ROPES),
    "Gemma3ForCausalLM": ("gemma3_text", {"sandwich_norm", "gelu_tanh", "embed_scale", "qk_norm"},
                          {"query_scalar", "final_softcap", "window", "pattern", "rope_local"} | ROPES),
}
MOE = {"MixtralForCausalLM": ("mixtral", {"moe"}, {"window"} | ROPES),  # which one: _moe_architecture_for
       "Qwen2MoeForCausalLM": ("qwen2_moe", {"moe"}, {"qkv_bias", "window", "pattern"} | ROPES),
       "Qwen3MoeForCausalLM": ("qwen3_moe", {"moe", "qk_norm"}, {"window"} | ROPES),
       "DeepseekV3ForCausalLM": ("deepseek_v3", {"moe", "mla", "sigmoid"}, {"moe_groups"} | ROPES),
       "GptOssForCausalLM": ("gpt_oss", {"moe", "moe_bias", "clamped_swiglu", "sinks", "attn_bias"},
                             {"window", "pattern"} | ROPES)}
ARCHITECTURES = tuple(DENSE) + MOE_ARCHITECTURES
MODEL_TYPES = {t: a for a, (t, _, _) in {**DENSE, **MOE}.items()}
_PERIOD = {"Gemma2ForCausalLM": 2, "Gemma3ForCausalLM": 6, "GptOssForCausalLM": 2}  # every Nth layer global

# transformers' defaults for keys a config.json may leave out (they differ per architecture)
_DEFAULTS = {
    "LlamaForCausalLM": {"max_position_embeddings": 2048, "num_key_value_heads": None},
    "MistralForCausalLM": {"max_position_embeddings": 4096 * 32, "num_key_value_heads": 8, "sliding_window": 4096},
    "Qwen2ForCausalLM": {"max_position_embeddings": 32768, "num_key_value_heads": 32, "sliding_window": 4096,
                         "max_window_layers": 28},
    "Qwen3ForCausalLM": {"max_position_embeddings": 32768, "num_key_value_heads": 32, "sliding_window": 4096,
                         "max_window_layers": 28, "head_dim": 128},
    "SmolLM3ForCausalLM": {"max_position_embeddings": 32768, "num_key_value_heads": 4, "rope_theta": 2e6,
                           "no_rope_layer_interval": 4},
    "Olmo2ForCausalLM": {"max_position_embeddings": 2048, "num_key_value_heads": None},
    "Phi3ForCausalLM": {"max_position_embeddings": 4096, "num_key_value_heads": None},
    "Gemma2ForCausalLM": {"max_position_embeddings": 8192, "num_key_value_heads": 4, "sliding_window": 4096,
                          "head_dim": 256, "query_pre_attn_scalar": 256, "attn_logit_softcapping": 50.0,
                          "final_logit_softcapping": 30.0},
    "Gemma3ForCausalLM": {"max_position_embeddings": 131072, "num_key_value_heads": 4, "sliding_window": 4096,
                          "head_dim": 256, "query_pre_attn_scalar": 256, "rope_theta": 1e6, "rope_local_base_freq": 1e4},
    "MixtralForCausalLM": {"max_position_embeddings": 4096 * 32, "num_key_value_heads": 8, "sliding_window": None,
                           "rope_theta": 1e6, "num_local_experts": 8, "num_experts_per_tok": 2},
    "Qwen2MoeForCausalLM": {"max_position_embeddings": 32768, "num_key_value_heads": 16, "sliding_window": 4096,
                            "max_window_layers": 28, "num_experts": 60, "num_experts_per_tok": 4,
                            "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
                            "norm_topk_prob": False, "decoder_sparse_step": 1},
    "Qwen3MoeForCausalLM": {"max_position_embeddings": 32768, "num_key_value_heads": 4, "sliding_window": 4096,
                            "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                            "norm_topk_prob": False, "decoder_sparse_step": 1},
}
_DEFAULTS["GptOssForCausalLM"] = {"max_position_embeddings": 131072, "num_key_value_heads": 8, "sliding_window": 128,
                                  "head_dim": 64, "rope_theta": 150000.0, "num_local_experts": 128,
                                  "num_experts_per_tok": 4, "swiglu_limit": 7.0}
_DEFAULTS["DeepseekV3ForCausalLM"] = {"max_position_embeddings": 4096, "num_key_value_heads": None, "n_routed_experts": 256,
                                      "num_experts_per_tok": 8, "n_shared_experts": 1, "n_group": 8, "topk_group": 4,
                                      "routed_scaling_factor": 2.5, "first_k_dense_replace": 3, "norm_topk_prob": True,
                                      "moe_intermediate_size": 2048, "q_lora_rank": 1536, "kv_lora_rank": 512,
                                      "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128}
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


# -------------------------------------------------------------- config.json <-> LLMConfig

def read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def architecture_of(hf: dict, source: str) -> str:
    archs = hf.get("architectures") or []
    if isinstance(archs, str):
        archs = [archs]
    arch = archs[0] if archs else MODEL_TYPES.get(hf.get("model_type"), hf.get("model_type"))
    if arch not in ARCHITECTURES:
        raise ConfigError(f"{source}: unsupported architecture '{arch}' (supported: {', '.join(ARCHITECTURES)})")
    return arch


def _rope_params(params: dict, hf: dict, key: str, source: str) -> tuple[float, Optional[RopeScaling]]:
    """(theta, scaling) of one RoPE parameter set (a 5.x rope_parameters entry or a 4.x rope_scaling)."""
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in ("su",):
        kind = "longrope"
    if kind not in ("default", "linear", "llama3", "yarn", "longrope"):
        raise ConfigError(f"{source}: unsupported rope type '{kind}' in {key} "
                          f"(supported: default, linear, llama3, yarn, longrope)")
    need = {"llama3": ("factor", "low_freq_factor", "high_freq_factor"), "yarn": ("factor",),
            "longrope": ("short_factor", "long_factor")}.get(kind, ())
    missing = [k for k in need if k not in params]
    if missing:
        raise ConfigError(f"{source}: {key} of type '{kind}' lacks {', '.join(missing)}")
    try:
        theta = float(params["rope_theta"])
        if kind == "default":
            return theta, None
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
        if kind == "longrope":
            scaling.update(short_factor=list(params["short_factor"]), long_factor=list(params["long_factor"]))
        if params.get("attention_factor") is not None:
            scaling["attention_factor"] = float(params["attention_factor"])
        return theta, from_dict(RopeScaling, scaling, source, key + ".")
    except (TypeError, ValueError, KeyError, ZeroDivisionError):
        raise ConfigError(f"{source}: {key} and rope_theta must be numbers, got {params}") from None


def _rope(hf: dict, arch: str, source: str) -> dict:
    """rope_theta, rope_scaling, rope_theta_local and rotary_fraction from a 5.x `rope_parameters` (one set,
    or one per layer type: Gemma 3) or a 4.x `rope_theta` + `rope_scaling` (+ Gemma 3's rope_local_base_freq)."""
    defaults = _DEFAULTS[arch]
    params, key = hf.get("rope_parameters") or {}, "rope_parameters"
    local = None
    if "full_attention" in params or "sliding_attention" in params:  # 5.x, per layer type
        local = dict(params.get("sliding_attention") or {})
        params, key = dict(params.get("full_attention") or {}), key + ".full_attention"
        if local.get("rope_type", "default") != "default":
            raise ConfigError(f"{source}: rope_parameters.sliding_attention of type '{local['rope_type']}' is not "
                              f"supported (default only)")
    if hf.get("rope_scaling"):  # 4.x (transformers 5 also lets it override rope_parameters)
        params, key = {**params, **hf["rope_scaling"]}, "rope_scaling"
    if not all(isinstance(v, (int, float, str, list, type(None))) for v in params.values()):
        raise ConfigError(f"{source}: {key} per layer type is not supported here")
    params = {**params, "rope_theta": params.get("rope_theta", hf.get("rope_theta", defaults.get("rope_theta", 1e4)))}
    theta, scaling = _rope_params(params, hf, key, source)
    fraction = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    out = dict(rope_theta=theta, rope_scaling=to_dict(scaling) if scaling else None, rotary_fraction=float(fraction or 1))
    if arch == "Gemma3ForCausalLM":
        out["rope_theta_local"] = float((local or {}).get("rope_theta", hf.get("rope_local_base_freq",
                                                                                  defaults["rope_local_base_freq"])))
    return out


def _pattern(types: list) -> list:
    """HF layer_types -> Zoo's attn_pattern: 'local' / 'global', cut to its shortest repeating period."""
    kinds = ["local" if t == "sliding_attention" else "global" for t in types]
    period = next(p for p in range(1, len(kinds) + 1) if all(k == kinds[i % p] for i, k in enumerate(kinds)))
    return kinds[:period]


def _window(hf: dict, arch: str, n_layers: int) -> tuple[Optional[int], list]:
    """(sliding_window, attn_pattern). Mistral, Mixtral, Phi-3: `sliding_window` on every layer (null = none);
    Qwen2/3 (-MoE), SmolLM3: only with use_sliding_window, on the layers `layer_types` marks (defaults: Qwen2,
    Qwen3 those >= max_window_layers; Qwen2-MoE the even ones below it; Qwen3-MoE all; SmolLM3 the NoPE ones);
    Gemma, GPT-OSS: `layer_types`, or every sliding_window_pattern-th layer global."""
    defaults = _DEFAULTS[arch]
    window = hf.get("sliding_window", defaults.get("sliding_window"))
    if arch in ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM") or window is None:
        return window, []
    if arch in _PERIOD:
        period = hf.get("sliding_window_pattern", _PERIOD[arch])
        default_types = ["sliding_attention" if (i + 1) % period else "full_attention" for i in range(n_layers)]
    elif arch in ("LlamaForCausalLM", "Olmo2ForCausalLM") or not hf.get("use_sliding_window", False):
        return None, []
    elif arch == "Qwen3MoeForCausalLM":
        return window, []
    elif arch == "SmolLM3ForCausalLM":
        default_types = ["full_attention" if r else "sliding_attention" for r in _no_rope(hf, n_layers)]
    else:
        max_window = hf.get("max_window_layers", defaults["max_window_layers"])
        default_types = ["sliding_attention" if (i >= max_window if arch != "Qwen2MoeForCausalLM"
                                                 else (i + 1) % 2 and i < max_window) else "full_attention"
                         for i in range(n_layers)]
    pattern = _pattern(hf.get("layer_types") or default_types)
    if pattern == ["global"]:
        return None, []
    return window, [] if pattern == ["local"] else pattern


def _no_rope(hf: dict, n_layers: int) -> list:
    """SmolLM3's no_rope_layers: 1 where a layer uses RoPE (default: all but every no_rope_layer_interval-th)."""
    every = hf.get("no_rope_layer_interval", 4)
    return hf.get("no_rope_layers") or [int((i + 1) % every != 0) for i in range(n_layers)]


def _moe_from_hf(hf: dict, arch: str, n_layers: int, source: str) -> dict:
    """The `moe:` section of a Mixtral / Qwen2-MoE / Qwen3-MoE config.json."""
    defaults = _DEFAULTS[arch]

    def get(key, *aliases):
        for k in (key, *aliases):
            if k in hf:
                return hf[k]
        return defaults[key]

    n_experts = get("n_routed_experts") if arch == "DeepseekV3ForCausalLM" else \
        get("num_local_experts", "num_experts") if arch in ("MixtralForCausalLM", "GptOssForCausalLM") \
        else get("num_experts", "num_local_experts")
    if not isinstance(n_experts, int) or n_experts <= 0:
        raise ConfigError(f"{source}: num_experts={n_experts!r} is not supported (a MoE model needs experts)")
    # transformers adds the load-balancing loss in training only with output_router_logits
    moe = dict(n_experts=n_experts, top_k=get("num_experts_per_tok"),
               balance="aux_loss" if hf.get("output_router_logits") else "none")
    if arch == "MixtralForCausalLM":
        moe.update(norm_topk_prob=True, expert_hidden=hf["intermediate_size"])
        return moe
    if arch == "DeepseekV3ForCausalLM":  # sigmoid scores, group-limited, a routing bias, shared experts
        F = get("moe_intermediate_size")
        moe.update(n_experts=get("n_routed_experts"), scoring="sigmoid", norm_topk_prob=bool(get("norm_topk_prob")),
                   expert_hidden=F, n_shared=get("n_shared_experts"), shared_hidden=F, n_groups=get("n_group"),
                   topk_groups=get("topk_group"), routed_scale=float(get("routed_scaling_factor")), balance="bias",
                   dense_layers=list(range(min(get("first_k_dense_replace"), n_layers))))
        return moe
    if arch == "GptOssForCausalLM":  # softmax over the top-k logits: the renormalised top-k of a softmax
        if hf.get("swiglu_alpha", 1.702) != 1.702:
            raise ConfigError(f"{source}: swiglu_alpha={hf['swiglu_alpha']} is not supported (1.702)")
        moe.update(norm_topk_prob=True, expert_hidden=hf["intermediate_size"], bias=True,
                   swiglu_limit=float(get("swiglu_limit")))
        return moe
    step = get("decoder_sparse_step")
    if not isinstance(step, int) or step <= 0:
        raise ConfigError(f"{source}: decoder_sparse_step={step!r} must be a positive integer")
    only = hf.get("mlp_only_layers") or []
    moe.update(norm_topk_prob=bool(get("norm_topk_prob")), expert_hidden=get("moe_intermediate_size"),
               sparse_every=step, dense_layers=sorted({i for i in only if isinstance(i, int) and 0 <= i < n_layers}))
    if arch == "Qwen2MoeForCausalLM":
        shared = get("shared_expert_intermediate_size")
        if shared:
            moe.update(n_shared=1, shared_hidden=shared, shared_gate=True)
    return moe


def config_from_hf(hf: dict, source: str = "config.json") -> tuple[LLMConfig, str]:
    """A Hugging Face config.json (as a dict) -> (LLMConfig, architecture)."""
    arch = architecture_of(hf, source)
    missing = [k for k in _REQUIRED if k not in hf]
    if missing:
        raise ConfigError(f"{source}: missing key(s) {', '.join(missing)}")
    defaults = _DEFAULTS[arch]
    gemma = arch in GEMMA
    act = hf.get("hidden_activation") or hf.get("hidden_act", "gelu_pytorch_tanh" if gemma else "silu")
    acts = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
    if act not in acts:
        raise ConfigError(f"{source}: hidden_act '{act}' is not supported (silu, gelu_pytorch_tanh)")
    if hf.get("mlp_bias"):
        raise ConfigError(f"{source}: mlp_bias=true is not supported")
    bias = bool(hf.get("attention_bias", arch == "GptOssForCausalLM"))  # q, k, v and o
    if bias and arch in GEMMA + ("Phi3ForCausalLM", "MistralForCausalLM") + MOE_ARCHITECTURES[:3] \
            + ("DeepseekV3ForCausalLM",):
        raise ConfigError(f"{source}: attention_bias=true is not supported for {arch}")
    if arch in MOE_ARCHITECTURES and hf.get("attention_dropout"):
        raise ConfigError(f"{source}: attention_dropout={hf['attention_dropout']} is not supported (Zoo's attention has no dropout)")
    d, n_heads, n_layers = hf["hidden_size"], hf["num_attention_heads"], hf["num_hidden_layers"]
    head_dim = hf.get("head_dim", defaults.get("head_dim")) or d // n_heads
    kv = hf.get("num_key_value_heads", defaults["num_key_value_heads"]) or n_heads
    window, pattern = _window(hf, arch, n_layers)
    data = dict(
        vocab_size=hf["vocab_size"], d_model=d, n_layers=n_layers, n_heads=n_heads,
        n_kv_heads=kv, head_dim=head_dim if head_dim * n_heads != d else None,
        ffn_hidden=hf["intermediate_size"], max_seq_len=hf.get("max_position_embeddings", defaults["max_position_embeddings"]),
        norm_eps=hf.get("rms_norm_eps", 1e-6), tie_embeddings=bool(hf.get("tie_word_embeddings", gemma)),
        qkv_bias=bias or arch == "Qwen2ForCausalLM" or (arch == "Qwen2MoeForCausalLM" and bool(hf.get("qkv_bias", True))),
        attn_out_bias=bias, sliding_window=window, attn_pattern=pattern,
        qk_norm="proj" if arch == "Olmo2ForCausalLM" else arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
                                                                    "Gemma3ForCausalLM"),
        norm_placement="sandwich" if gemma else "post" if arch == "Olmo2ForCausalLM" else "pre",
        mlp_act=acts[act], embed_scale=gemma, attn_sinks=arch == "GptOssForCausalLM", **_rope(hf, arch, source),
    )
    if gemma:
        data.update(query_pre_attn_scalar=hf.get("query_pre_attn_scalar", defaults["query_pre_attn_scalar"]),
                    attn_softcap=hf.get("attn_logit_softcapping", defaults.get("attn_logit_softcapping"))
                    if arch == "Gemma2ForCausalLM" else None,  # transformers' Gemma 3 leaves it unused
                    final_softcap=hf.get("final_logit_softcapping", defaults.get("final_logit_softcapping")))
        if data["query_pre_attn_scalar"] == head_dim:
            data["query_pre_attn_scalar"] = None
    if arch == "SmolLM3ForCausalLM":
        data["nope_layers"] = [i for i, r in enumerate(_no_rope(hf, n_layers)) if not r]
    if arch in MOE_ARCHITECTURES:
        data["moe"] = _moe_from_hf(hf, arch, n_layers, source)
    if arch == "DeepseekV3ForCausalLM":
        get = {**defaults, **hf}.get
        data.update(mla=dict(kv_rank=get("kv_lora_rank"), q_rank=get("q_lora_rank"), rope_dim=get("qk_rope_head_dim"),
                             nope_dim=get("qk_nope_head_dim"), v_dim=get("v_head_dim")),
                    head_dim=get("qk_rope_head_dim") + get("qk_nope_head_dim"), n_kv_heads=n_heads)
    return from_dict(LLMConfig, data, source), arch


def features(cfg: LLMConfig) -> set:
    """The architecture ideas `cfg` uses, by the names of `DENSE` (and 'moe')."""
    bias = {(True, True): "attn_bias", (True, False): "qkv_bias", (False, True): "out_bias"}.get(
        (cfg.qkv_bias, cfg.attn_out_bias))
    window = None if cfg.sliding_window is None else "pattern" if "global" in cfg.attn_pattern else "window"
    scaling = cfg.rope_scaling and "rope_" + cfg.rope_scaling.type
    named = {bias, window, scaling, {"head": "qk_norm", True: "qk_norm", "proj": "qk_norm_proj"}.get(cfg.qk_norm),
             {"post": "post_norm", "sandwich": "sandwich_norm"}.get(cfg.norm_placement),
             "gelu_tanh" if cfg.mlp_act == "gelu_tanh" else None, "moe" if cfg.moe is not None else None}
    flags = {"embed_scale": cfg.embed_scale, "query_scalar": cfg.query_pre_attn_scalar,
             "attn_softcap": cfg.attn_softcap, "final_softcap": cfg.final_softcap, "rope_local": cfg.rope_theta_local,
             "nope": cfg.nope_layers, "partial_rotary": cfg.rotary_fraction < 1, "sinks": cfg.attn_sinks,
             "mod": cfg.mod_capacity > 0, "moe_bias": cfg.moe and cfg.moe.bias,
             "clamped_swiglu": cfg.moe and cfg.moe.swiglu_limit, "mla": cfg.mla,
             "sigmoid": cfg.moe and cfg.moe.scoring == "sigmoid",
             "moe_groups": cfg.moe and (cfg.moe.n_groups > 1 or cfg.moe.routed_scale != 1)}
    return (named | {k for k, v in flags.items() if v}) - {None}


def _moe_architecture_for(cfg: LLMConfig, remembered: Optional[str]) -> str:
    """Mixtral: every layer sparse, renormalised top-k, no shared experts, no qkv bias or q/k norm.
    Qwen2-MoE: shared experts behind a sigmoid gate, an optional qkv bias. Qwen3-MoE: q/k norm, no
    shared experts. All: softmax scores."""
    m = cfg.moe
    if m.scoring != "softmax":
        raise ValueError(f"model.moe.scoring={m.scoring!r} has no Hugging Face MoE architecture (softmax only)")
    all_sparse = all(cfg.is_sparse(i) for i in range(cfg.n_layers))
    why = {"MixtralForCausalLM": [why for bad, why in (
               (not all_sparse, "dense layers"), (not m.norm_topk_prob, "norm_topk_prob=false"),
               (m.n_shared, "shared experts"), (cfg.qkv_bias, "qkv_bias"), (cfg.qk_norm, "qk_norm")) if bad],
           "Qwen2MoeForCausalLM": [why for bad, why in (
               (not m.n_shared or not m.shared_gate, "no gated shared experts"), (cfg.qk_norm, "qk_norm")) if bad],
           "Qwen3MoeForCausalLM": [why for bad, why in (
               (not cfg.qk_norm, "no qk_norm"), (m.n_shared, "shared experts"), (cfg.qkv_bias, "qkv_bias")) if bad]}
    if remembered in why and not why[remembered]:
        return remembered
    for arch in ("Qwen3MoeForCausalLM", "MixtralForCausalLM", "Qwen2MoeForCausalLM"):
        if not why[arch]:
            return arch
    raise ValueError("this MoE config fits no Hugging Face architecture: "
                     + "; ".join(f"{a}: {', '.join(w)}" for a, w in why.items()))


def architecture_for(cfg: LLMConfig, remembered: Optional[str] = None) -> str:
    """The Hugging Face class that can hold `cfg`: the one it was loaded from when that still fits, else
    the first of `DENSE` whose features it has (for MoE configs, see `_moe_architecture_for`)."""
    have = features(cfg)
    if "mod" in have:
        raise ValueError(f"model.mod_capacity={cfg.mod_capacity}: Mixture-of-Depths routers have no place in a "
                         f"Hugging Face checkpoint")
    if cfg.moe is not None:
        extra = have - set().union(*(need | may for _, need, may in MOE.values()))
        if extra:
            raise ValueError(f"a MoE model with {', '.join(sorted(extra))} fits no Hugging Face MoE architecture here")
        for arch in ("DeepseekV3ForCausalLM", "GptOssForCausalLM"):  # their ideas no other MoE class holds
            need, may = MOE[arch][1:]
            if need <= have <= need | may:
                return arch
        return _moe_architecture_for(cfg, remembered)

    def fits(arch):
        need, may = DENSE[arch][1:]
        return need <= have <= need | may
    if remembered in DENSE and fits(remembered):
        return remembered
    for arch in DENSE:
        if fits(arch):
            return arch
    raise ValueError(f"no Hugging Face architecture here holds a model with {', '.join(sorted(have))} "
                     f"(docs/pretrained.md lists what each holds)")


def _int(x: float):
    """x as an int when it is whole (config.json's integer fields)."""
    return int(x) if float(x).is_integer() else x


def _rope_to_hf(cfg: LLMConfig, theta: float, scaling: Optional[RopeScaling]) -> dict:
    """One 5.x RoPE parameter set."""
    rope = {"rope_type": "default", "rope_theta": theta}
    if scaling is not None:
        keep = {"llama3": ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
                "yarn": ("beta_fast", "beta_slow", "truncate", "original_max_position_embeddings", "attention_factor",
                         "mscale_all_dim"),
                "longrope": ("short_factor", "long_factor", "original_max_position_embeddings", "attention_factor")}
        rope.update(rope_type=scaling.type, factor=scaling.factor,
                    **{k: getattr(scaling, k) for k in keep.get(scaling.type, ()) if getattr(scaling, k) is not None})
    if cfg.rotary_fraction < 1:
        rope["partial_rotary_factor"] = cfg.rotary_fraction
    return rope


def config_to_hf(cfg: LLMConfig, arch: str, dtype: torch.dtype, base: Optional[dict] = None) -> dict:
    """LLMConfig -> config.json dict. RoPE is written in both dialects (5.x `rope_parameters`,
    4.x `rope_theta` + `rope_scaling`), so either transformers version reads it. Token ids
    (bos/eos/pad) are kept from `base`, the config.json the model was loaded from."""
    rope = _rope_to_hf(cfg, cfg.rope_theta, cfg.rope_scaling)
    model_type = {v: k for k, v in MODEL_TYPES.items()}[arch]
    n = cfg.n_layers
    hf = {
        "architectures": [arch], "model_type": model_type,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "intermediate_size": cfg.resolved_ffn_hidden,
        "num_hidden_layers": n, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.resolved_n_kv_heads, "head_dim": cfg.resolved_head_dim,
        "hidden_act": "gelu_pytorch_tanh" if cfg.mlp_act == "gelu_tanh" else "silu",
        "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "rope_parameters": rope, "rope_theta": cfg.rope_theta, "partial_rotary_factor": cfg.rotary_fraction,
        "rope_scaling": {k: v for k, v in rope.items() if k != "rope_theta"} if cfg.rope_scaling else None,
        "dtype": str(dtype).removeprefix("torch."), "use_cache": True,
    }
    window = cfg.sliding_window is not None
    types = ["sliding_attention" if cfg.is_local(i) else "full_attention" for i in range(n)]
    if arch in ("LlamaForCausalLM", "Qwen3ForCausalLM", "SmolLM3ForCausalLM", "Olmo2ForCausalLM"):
        hf.update(attention_bias=cfg.attn_out_bias, mlp_bias=False)
    if arch in ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM"):
        hf["sliding_window"] = cfg.sliding_window
    if arch == "Phi3ForCausalLM" and cfg.rope_scaling is not None:  # Phi-3 reads it at the top level
        hf["original_max_position_embeddings"] = cfg.rope_scaling.original_max_position_embeddings
    elif arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3ForCausalLM", "SmolLM3ForCausalLM"):
        hf.update(use_sliding_window=window, sliding_window=cfg.sliding_window, max_window_layers=n, layer_types=types)
    elif arch == "Qwen3MoeForCausalLM":  # one window on every layer
        hf.update(use_sliding_window=window, sliding_window=cfg.sliding_window, attention_bias=False)
    elif arch == "DeepseekV3ForCausalLM":
        m, a = cfg.moe, cfg.mla
        first = len(m.dense_layers)
        if list(m.dense_layers) != list(range(first)) or m.sparse_every != 1 or m.n_shared * (m.shared_hidden or 0) == 0 \
                or (m.shared_hidden or 0) != cfg.resolved_expert_hidden:
            raise ValueError("a DeepseekV3ForCausalLM has its dense layers first, then every layer sparse with "
                             "shared experts of the experts' width")
        hf.update(kv_lora_rank=a.kv_rank, q_lora_rank=a.q_rank, qk_rope_head_dim=a.rope_dim, qk_nope_head_dim=a.nope_dim,
                  v_head_dim=a.v_dim, head_dim=a.rope_dim, rope_interleave=True, attention_bias=False,
                  n_routed_experts=m.n_experts, n_shared_experts=m.n_shared, moe_intermediate_size=m.expert_hidden,
                  n_group=m.n_groups, topk_group=m.topk_groups, routed_scaling_factor=m.routed_scale,
                  first_k_dense_replace=first, norm_topk_prob=m.norm_topk_prob)
    elif arch == "GptOssForCausalLM":
        hf.update(sliding_window=cfg.sliding_window or cfg.max_seq_len, layer_types=types,
                  attention_bias=True, swiglu_limit=cfg.moe.swiglu_limit)
    elif arch in GEMMA:
        hf.update(hidden_activation=hf.pop("hidden_act"), sliding_window=cfg.sliding_window or cfg.max_seq_len,
                  layer_types=types, query_pre_attn_scalar=_int(cfg.query_pre_attn_scalar or cfg.resolved_head_dim),
                  attn_logit_softcapping=cfg.attn_softcap, final_logit_softcapping=cfg.final_softcap)
    if arch == "SmolLM3ForCausalLM":
        hf["no_rope_layers"] = [int(i not in cfg.nope_layers) for i in range(n)]
    if arch == "Gemma3ForCausalLM":
        local = cfg.rope_theta_local or cfg.rope_theta
        hf.update(rope_parameters={"full_attention": rope, "sliding_attention": _rope_to_hf(cfg, local, None)},
                  rope_local_base_freq=local)
    if cfg.moe is not None:
        m = cfg.moe
        hf.update(num_experts_per_tok=m.top_k, output_router_logits=m.balance == "aux_loss", attention_dropout=0.0)
        if arch in ("MixtralForCausalLM", "GptOssForCausalLM"):
            hf.update(num_local_experts=m.n_experts, intermediate_size=cfg.resolved_expert_hidden)
        elif arch != "DeepseekV3ForCausalLM":
            hf.update(num_experts=m.n_experts, moe_intermediate_size=cfg.resolved_expert_hidden,
                      norm_topk_prob=m.norm_topk_prob, decoder_sparse_step=m.sparse_every,
                      mlp_only_layers=list(m.dense_layers))
        if arch == "Qwen2MoeForCausalLM":
            hf.update(shared_expert_intermediate_size=m.n_shared * (m.shared_hidden or cfg.resolved_expert_hidden),
                      qkv_bias=cfg.qkv_bias)
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if base is not None and k in base:
            hf[k] = base[k]
    return hf


# --------------------------------------------------------------------------- weight names

def key_map(cfg: LLMConfig, arch: Optional[str] = None) -> dict[str, list[tuple[str, tuple]]]:
    """Zoo parameter name -> [(Hugging Face name, shape), ...]; several entries are fused by
    concatenating along dim 0 in that order (the stacked experts: seen as 2-D, (E * rows, cols)).
    lm_head is absent when the embeddings are tied. `arch` names the norms (OLMo 2's and Gemma's),
    Phi-3's fused projections and the MoE weights (Mixtral's or Qwen's)."""
    d, V, F = cfg.d_model, cfg.vocab_size, cfg.resolved_ffn_hidden
    D = cfg.resolved_head_dim
    q, kv = cfg.n_heads * D, cfg.resolved_n_kv_heads * D
    norms = {"pre": {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"},
             "post": {"attn_post_norm": "post_attention_layernorm", "mlp_post_norm": "post_feedforward_layernorm"},
             "sandwich": {"attn_norm": "input_layernorm", "attn_post_norm": "post_attention_layernorm",
                          "mlp_norm": "pre_feedforward_layernorm", "mlp_post_norm": "post_feedforward_layernorm"}}
    phi3 = arch == "Phi3ForCausalLM"
    m = {"embed.weight": [("model.embed_tokens.weight", (V, d))]}
    for i in range(cfg.n_layers):
        z, h = f"layers.{i}.", f"model.layers.{i}."
        for zoo_norm, hf_norm in norms[cfg.norm_placement].items():
            m[z + zoo_norm + ".weight"] = [(h + hf_norm + ".weight", (d,))]
        a = h + "self_attn."
        if cfg.mla:
            m.update(_mla_keys(cfg, z, a))
        for kind in (() if cfg.mla else ("weight", "bias") if cfg.qkv_bias else ("weight",)):
            shapes = [(r, d)[:2 if kind == "weight" else 1] for r in (q, kv, kv)]
            m[z + "attn.qkv." + kind] = [(a + f"qkv_proj.{kind}", (q + 2 * kv, d)[:len(shapes[0])])] if phi3 else \
                [(a + f"{n}_proj.{kind}", shape) for n, shape in zip("qkv", shapes)]
        if cfg.qk_norm:
            per_proj = cfg.qk_norm == "proj"
            m[z + "attn.q_norm.weight"] = [(a + "q_norm.weight", (q if per_proj else D,))]
            m[z + "attn.k_norm.weight"] = [(a + "k_norm.weight", (kv if per_proj else D,))]
        m[z + "attn.proj.weight"] = [(a + "o_proj.weight", (d, cfg.n_heads * cfg.mla.v_dim if cfg.mla else q))]
        if cfg.attn_out_bias:
            m[z + "attn.proj.bias"] = [(a + "o_proj.bias", (d,))]
        if cfg.attn_sinks:
            m[z + "attn.sinks"] = [(a + "sinks", (cfg.n_heads,))]
        if cfg.is_sparse(i):
            m.update(_moe_keys(cfg, z, h, arch))
            continue
        m[z + "mlp.gate_up.weight"] = [(h + "mlp.gate_up_proj.weight", (2 * F, d))] if phi3 else \
            [(h + "mlp.gate_proj.weight", (F, d)), (h + "mlp.up_proj.weight", (F, d))]
        m[z + "mlp.down.weight"] = [(h + "mlp.down_proj.weight", (d, F))]
    m["norm.weight"] = [("model.norm.weight", (d,))]
    if not cfg.tie_embeddings:
        m["lm_head.weight"] = [("lm_head.weight", (V, d))]
    return m


@torch.no_grad()
def gpt_oss_experts(state: dict, to_file: bool) -> dict:
    """GPT-OSS's expert tensors <-> Zoo's: gate_up_proj (E, d, 2F) with gate and up columns interleaved and
    down_proj (E, F, d) vs Zoo's gate_up (E, 2F, d) gate rows first and down (E, d, F); the gate_up bias
    interleaved too. Zoo names; a new dict (each tensor contiguous, in the target layout's shape)."""
    out = dict(state)
    for name, t in state.items():
        if name.endswith(("mlp.gate_up", "mlp.gate_up_bias")):  # Zoo's shape: (E, 2F, d) or (E, 2F)
            if to_file:  # rows gate, up -> interleaved, then (E, d, 2F)
                t = torch.stack(t.unflatten(1, (2, t.shape[1] // 2)).unbind(1), dim=2).flatten(1, 2)
                out[name] = t if t.dim() == 2 else t.transpose(1, 2).contiguous()
            else:  # the memory holds the file's (E, d, 2F)
                t = t if t.dim() == 2 else t.view(t.shape[0], t.shape[2], t.shape[1]).transpose(1, 2)
                out[name] = torch.cat([t[:, 0::2], t[:, 1::2]], dim=1).contiguous()
        elif name.endswith("mlp.down"):
            E, d, F = t.shape
            out[name] = t.transpose(1, 2).contiguous() if to_file else t.view(E, F, d).transpose(1, 2).contiguous()
    return out


@torch.no_grad()
def _shift_norms(state: dict, offset: float):
    """Add `offset` to every RMSNorm gain of a state dict, in place."""
    for name, t in state.items():
        if offset and name.endswith("norm.weight"):
            t += offset


def norm_offset(arch: Optional[str]) -> float:
    """What Zoo's RMSNorm gains hold beyond the checkpoint's: 1 for Gemma's (1 + w) norms, else 0."""
    return 1.0 if arch in GEMMA else 0.0


def _mla_keys(cfg: LLMConfig, z: str, a: str) -> dict:
    """Zoo -> Hugging Face names of one multi-head latent attention (DeepSeek-V3; z, a: the prefixes)."""
    mla, d, H = cfg.mla, cfg.d_model, cfg.n_heads
    qk = H * (mla.nope_dim + mla.rope_dim)
    m = {z + "attn.kv_a.weight": [(a + "kv_a_proj_with_mqa.weight", (mla.kv_rank + mla.rope_dim, d))],
         z + "attn.kv_norm.weight": [(a + "kv_a_layernorm.weight", (mla.kv_rank,))],
         z + "attn.kv_b.weight": [(a + "kv_b_proj.weight", (H * (mla.nope_dim + mla.v_dim), mla.kv_rank))]}
    if mla.q_rank is None:
        return {**m, z + "attn.q_b.weight": [(a + "q_proj.weight", (qk, d))]}
    return {**m, z + "attn.q_a.weight": [(a + "q_a_proj.weight", (mla.q_rank, d))],
            z + "attn.q_norm.weight": [(a + "q_a_layernorm.weight", (mla.q_rank,))],
            z + "attn.q_b.weight": [(a + "q_b_proj.weight", (qk, mla.q_rank))]}


@torch.no_grad()
def interleaved_rope(state: dict, cfg: LLMConfig, to_file: bool) -> dict:
    """DeepSeek's RoPE channels in interleaved pairs (x0, x1), (x2, x3), ... <-> Zoo's halves: the rows of
    the RoPE parts of q_b (per head) and kv_a permuted (the scores are the same). A new dict."""
    out, R = dict(state), cfg.mla.rope_dim
    for name, w in state.items():
        if name.endswith(("attn.q_b.weight", "attn.kv_a.weight")):
            heads = w.view(cfg.n_heads if "q_b" in name else 1, -1, w.shape[-1])
            rope = heads[:, -R:]
            rope = torch.stack([rope[:, :R // 2], rope[:, R // 2:]], dim=2).flatten(1, 2) if to_file \
                else torch.cat([rope[:, 0::2], rope[:, 1::2]], dim=1)
            out[name] = torch.cat([heads[:, :-R], rope], dim=1).view(w.shape)
    return out


def _moe_keys(cfg: LLMConfig, z: str, h: str, arch: Optional[str]) -> dict:
    """Zoo -> Hugging Face names of one sparse layer (z, h: the layer's prefixes): router, experts
    (stacked in Zoo; the shapes here are each expert's, concatenated along dim 0) and shared experts."""
    d, E, F = cfg.d_model, cfg.moe.n_experts, cfg.resolved_expert_hidden
    if arch == "GptOssForCausalLM":  # experts as stacked tensors in their own layout: `gpt_oss_experts`
        h = h + "mlp."
        return {z + "mlp.router.weight": [(h + "router.weight", (E, d))], z + "mlp.router.bias": [(h + "router.bias", (E,))],
                z + "mlp.gate_up": [(h + "experts.gate_up_proj", (E, d, 2 * F))],
                z + "mlp.gate_up_bias": [(h + "experts.gate_up_proj_bias", (E, 2 * F))],
                z + "mlp.down": [(h + "experts.down_proj", (E, F, d))],
                z + "mlp.down_bias": [(h + "experts.down_proj_bias", (E, d))]}
    if arch == "MixtralForCausalLM":
        h, gate, up, down = h + "block_sparse_moe.", "w1", "w3", "w2"
    else:
        h, gate, up, down = h + "mlp.", "gate_proj", "up_proj", "down_proj"
    m = {z + "mlp.router.weight": [(h + "gate.weight", (E, d))],
         z + "mlp.gate_up": [p for e in range(E) for p in ((h + f"experts.{e}.{gate}.weight", (F, d)),
                                                            (h + f"experts.{e}.{up}.weight", (F, d)))],
         z + "mlp.down": [(h + f"experts.{e}.{down}.weight", (d, F)) for e in range(E)]}
    if arch == "DeepseekV3ForCausalLM":
        m[z + "mlp.score_bias"] = [(h + "gate.e_score_correction_bias", (E,))]
    if cfg.moe.n_shared:
        Fs = cfg.moe.n_shared * (cfg.moe.shared_hidden or F)
        s = h + ("shared_experts." if arch == "DeepseekV3ForCausalLM" else "shared_expert.")
        m[z + "mlp.shared.gate_up.weight"] = [(s + "gate_proj.weight", (Fs, d)), (s + "up_proj.weight", (Fs, d))]
        m[z + "mlp.shared.down.weight"] = [(s + "down_proj.weight", (d, Fs))]
        if cfg.moe.shared_gate:
            m[z + "mlp.shared_gate.weight"] = [(h + "shared_expert_gate.weight", (1, d))]
    return m


def _ignorable(name: str, cfg: LLMConfig) -> bool:
    # old checkpoints saved the RoPE buffer; tied ones may still carry a copy of lm_head
    return name.endswith("rotary_emb.inv_freq") or (cfg.tie_embeddings and name == "lm_head.weight")


def mismatches(found: dict, expected: dict, ignorable=lambda name: False) -> str:
    """What differs between the tensors a file holds and those expected ({name: shape} both):
    "missing: ...; unexpected: ...; wrong shape: ..." (each list cut short), or "" when they match."""
    missing = [n for n in expected if n not in found]
    unexpected = [n for n in found if n not in expected and not ignorable(n)]
    wrong = [f"{n} {list(found[n])} (expected {list(s)})" for n, s in expected.items()
             if n in found and tuple(found[n]) != tuple(s)]
    return "; ".join(f"{label}: {_listing(names)}" for label, names in
                     (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong)) if names)


def _listing(names, limit: int = 8) -> str:
    names = list(names)
    more = f" (+{len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


# ---------------------------------------------------------------------- safetensors files

def weight_files(folder: Path) -> list[Path]:
    """model.safetensors, or the shards listed in model.safetensors.index.json."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index}: no 'weight_map' listing the shards")
        files = [folder / f for f in dict.fromkeys(weight_map.values())]
        for f in files:
            if not f.is_file():
                raise FileNotFoundError(f"{f}: shard listed in {index.name} is missing")
        return files
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
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
    if name not in _DTYPES:
        raise ValueError(f"{source}: unsupported dtype '{name}' (supported: {', '.join(_DTYPES)})")
    return _DTYPES[name]


def assemble(cfg: LLMConfig, kmap: dict, dtype: torch.dtype, device: torch.device, fills) -> "LLM":
    """An LLM whose weights come from `fills`: (external name of `kmap`, fill(dest)) pairs, each writing its
    rows of a Zoo tensor. Built on the meta device, each tensor allocated once in `dtype` on `device`
    (no concatenation copies); the LM head tied and the RoPE tables rebuilt. Every name must be filled."""
    from ..llm import LLM

    with torch.device("meta"):
        model = LLM(cfg)
    rows_of: dict[str, tuple[str, int, int]] = {}  # external name -> (Zoo name, first row, rows)
    for zoo_name, parts in kmap.items():
        start = 0
        for name, shape in parts:
            rows_of[name] = (zoo_name, start, shape[0])
            start += shape[0]
    state: dict[str, torch.Tensor] = {}
    for name, fill in fills:
        zoo_name, start, rows = rows_of[name]
        if zoo_name not in state:
            parts = kmap[zoo_name]
            shape = (sum(s[0] for _, s in parts),) + parts[0][1][1:]
            state[zoo_name] = torch.empty(shape, dtype=dtype, device=device)
        fill(state[zoo_name][start:start + rows])
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

def _folder(path) -> Path:
    p = Path(path)
    return p.parent if p.is_file() and p.name == "config.json" else p


def detect(path) -> bool:
    """A folder (or its config.json) whose config.json describes a Hugging Face causal LM."""
    cfg_file = _folder(path) / "config.json"
    if not cfg_file.is_file():
        return False
    try:
        hf = json.loads(cfg_file.read_text())
    except (ValueError, UnicodeDecodeError, OSError):
        return False
    if not isinstance(hf, dict):
        return False
    archs = hf.get("architectures") or []
    return any(isinstance(a, str) and a.endswith("ForCausalLM") for a in archs) or hf.get("model_type") in MODEL_TYPES


def load(path, dtype: Union[torch.dtype, str, None] = None, device: Union[torch.device, str, None] = None):
    """Load a Hugging Face folder into a Zoo LLM; dtype None / "auto": the checkpoint's (else fp32)."""
    folder = _folder(path)
    cfg_file = folder / "config.json"
    hf = read_json(cfg_file)
    cfg, arch = config_from_hf(hf, str(cfg_file))
    dtype = _resolve_dtype(dtype, hf, str(cfg_file))
    device = torch.device(device or "cpu")

    # 1. check every file header and every name/shape before reading any data
    files = weight_files(folder)
    headers = {f: read_safetensors_header(f)[::2] for f in files}  # (table, data offset)
    found = {name: tuple(t["shape"]) for table, _ in headers.values() for name, t in table.items()}
    kmap = key_map(cfg, arch)
    expected = {hf_name: shape for parts in kmap.values() for hf_name, shape in parts}
    problems = mismatches(found, expected, lambda n: _ignorable(n, cfg))
    if problems:
        raise ValueError(f"{folder}: weights do not match config.json ({arch}, {cfg.n_layers} layers): {problems}")

    # 2. read every file tensor straight into the rows of its Zoo tensor
    def fills():
        for path, (table, offset) in headers.items():
            with open(path, "rb", buffering=0) as f:
                for name in sorted((n for n in table if n in expected), key=lambda n: table[n]["data_offsets"][0]):
                    yield name, partial(read_tensor, f, path, offset, table[name])

    model = assemble(cfg, kmap, dtype, device, fills())
    _shift_norms(model.state_dict(), norm_offset(arch))
    if arch == "GptOssForCausalLM":
        model.load_state_dict(gpt_oss_experts(model.state_dict(), to_file=False))
    if arch == "DeepseekV3ForCausalLM" and hf.get("rope_interleave", True):
        model.load_state_dict(interleaved_rope(model.state_dict(), cfg, to_file=False))
    model.hf_architecture = arch
    model.hf_config = hf
    return model.eval()


def exports(model) -> bool:
    return getattr(getattr(model, "_orig_mod", model), "family", None) == "llm"


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
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    state = model.state_dict()
    dtype = dtype or state["embed.weight"].dtype
    arch = architecture_for(cfg, getattr(model, "hf_architecture", None))
    if norm_offset(arch):
        state = {k: v.clone() if k.endswith("norm.weight") else v for k, v in state.items()}
        _shift_norms(state, -norm_offset(arch))
    if arch == "GptOssForCausalLM":
        state = gpt_oss_experts(state, to_file=True)
    if arch == "DeepseekV3ForCausalLM":
        state = interleaved_rope(state, cfg, to_file=True)
    if arch != "DeepseekV3ForCausalLM" and any(b.score_bias is not None and bool(b.score_bias.any())
                                                for b in model.moe_blocks()):
        raise ValueError(f"model.moe.balance=bias: the trained routing bias has no place in a {arch} checkpoint")
    limit = _shard_limit(max_shard_size)

    # split fused tensors back into Hugging Face names, grouped into shards in order
    shards: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for zoo_name, parts in key_map(cfg, arch).items():
        flat = state[zoo_name].reshape(-1, *parts[0][1][1:])  # stacked experts: (E * rows, cols)
        pieces = flat.split([shape[0] for _, shape in parts], dim=0)
        for (hf_name, _), t in zip(parts, pieces):
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
        body = json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
        atomic_write(index, body)
    # remove weights of an earlier save into the same folder, which loaders would otherwise pick up
    keep = set(names) | ({index.name} if n > 1 else set())
    for old in [index, *out.glob("model*.safetensors")]:
        if old.name not in keep and old.is_file():
            old.unlink()

    hf = config_to_hf(cfg, arch, dtype, getattr(model, "hf_config", None))
    atomic_write(out / "config.json", json.dumps(hf, indent=2) + "\n")
    if hasattr(tokenizer, "save"):  # a GGUF file's (gguf_llm.load_tokenizer): written as tokenizer.json + config
        tokenizer.save(out)
    elif tokenizer is not None:
        _copy_tokenizer(Path(tokenizer), out)
    return out


TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja")


def _copy_tokenizer(src: Path, out: Path):
    """Copy a tokenizer.model file, or the tokenizer files of a Hugging Face folder, into `out`."""
    if src.is_dir():
        files = [src / n for n in TOKENIZER_FILES if (src / n).is_file()]
        if not files:
            raise FileNotFoundError(f"{src}: no tokenizer file ({', '.join(TOKENIZER_FILES)})")
    elif src.is_file():
        files = [src]
    else:
        raise FileNotFoundError(f"{src}: tokenizer file not found")
    for f in files:
        dst = out / ("tokenizer.model" if f.suffix == ".model" else f.name)
        if f.resolve() != dst.resolve():
            atomic_write(dst, lambda tmp: shutil.copyfile(f, tmp))
