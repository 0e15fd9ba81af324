"""Gemma 2 and Gemma 3 (text): norms before and after each branch (sandwich) storing 1 + w, GeGLU, embeddings
times sqrt(d_model), scores scaled by query_pre_attn_scalar, local (sliding) and global layers (Gemma 2: one
of two global; Gemma 3: one of six); Gemma 2 soft-caps scores and logits, Gemma 3 normalises q and k per
head and gives its local layers a RoPE base of their own, unscaled. Gemma 4: see its record."""
from .record import ROPES, Record, stacked

SANDWICH = {"attn_norm": "input_layernorm", "attn_post_norm": "post_attention_layernorm",
            "mlp_norm": "pre_feedforward_layernorm", "mlp_post_norm": "post_feedforward_layernorm"}


def _int(x: float):
    return int(x) if float(x).is_integer() else x


class Gemma2(Record):
    hf_class, model_type = "Gemma2ForCausalLM", "gemma2"
    needs = frozenset({"sandwich_norm", "gelu_tanh", "embed_scale"})
    may = ROPES | {"query_scalar", "attn_softcap", "final_softcap", "window", "pattern"}
    defaults = {"max_position_embeddings": 8192, "num_key_value_heads": 4, "sliding_window": 4096, "head_dim": 256,
                "query_pre_attn_scalar": 256, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}
    window, period = "types", 2
    act, tie, norms, norm_offset = "gelu_pytorch_tanh", True, SANDWICH, 1.0

    def config(self, hf, get, n_layers):
        head_dim = get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
        scalar = get("query_pre_attn_scalar")
        return {"norm_placement": "sandwich", "embed_scale": True, "attn_softcap": get("attn_logit_softcapping"),
                "final_softcap": get("final_logit_softcapping"), "query_pre_attn_scalar": None if scalar == head_dim
                else scalar}

    def to_hf(self, cfg):
        return {"hidden_activation": "gelu_pytorch_tanh", "sliding_window": cfg.sliding_window or cfg.max_seq_len,
                "query_pre_attn_scalar": _int(cfg.query_pre_attn_scalar or cfg.resolved_head_dim),
                "attn_logit_softcapping": cfg.attn_softcap, "final_logit_softcapping": cfg.final_softcap}


class Gemma3(Gemma2):
    hf_class, model_type = "Gemma3ForCausalLM", "gemma3_text"
    needs = Gemma2.needs | {"qk_norm"}
    may = ROPES | {"query_scalar", "final_softcap", "window", "pattern", "rope_local"}
    defaults = {**Gemma2.defaults, "max_position_embeddings": 131072, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
                "attn_logit_softcapping": None, "final_logit_softcapping": None}
    period = 6
    gguf, gguf_writes = "gemma3", True

    def config(self, hf, get, n_layers):
        return {**super().config(hf, get, n_layers), "qk_norm": True, "attn_softcap": None}  # transformers ignores it

    def gguf_config(self, get, tensors):  # llama.cpp's rules: local layers at base 10000, scores by the head size
        d, heads = get("embedding_length"), get("attention.head_count")
        return {"sliding_window_pattern": get("attention.sliding_window_pattern", 6), "rope_local_base_freq": 10000.0,
                "query_pre_attn_scalar": d // heads if get("block_count") == 62 else get("attention.key_length")}

    def gguf_refuses(self, cfg):
        six = [(i + 1) % 6 != 0 for i in range(cfg.n_layers)]
        return ("a local/global pattern but five local layers to one global" if [cfg.is_local(i) for i in
                range(cfg.n_layers)] != six else "local RoPE base but 10000" if cfg.rope_theta_local not in (None, 1e4)
                else "query_pre_attn_scalar but the head size" if cfg.query_pre_attn_scalar else
                "final soft-cap" if cfg.final_softcap else "")


class Gemma4(Gemma3):
    """Gemma 4 (text): Gemma 3's layers with norms storing w, values RMS-normalised, unscaled scores, each layer's
    output times a stored scalar; global layers with wider heads (per_layer_config, or the older global_head_dim),
    optionally fewer kv heads whose values are their keys (attention_k_eq_v), RoPE over a quarter of their angles
    (proportional); per-layer input embeddings; the last num_kv_shared_layers reading an earlier layer's keys and
    values, optionally with MLPs twice as wide; with enable_moe_block (26B-A4B), experts beside every layer's MLP:
    the MLP a shared expert, each branch between norms of its own, the router reading the layer's input through a
    weightless RMSNorm times a learned gain, the chosen weights times learned per-expert scales."""
    hf_class, model_type = "Gemma4ForCausalLM", "gemma4_text"
    needs = Gemma3.needs | {"v_norm", "query_scalar", "layer_scalar"}
    may = ROPES | {"rope_proportional", "final_softcap", "window", "pattern", "rope_local", "kv_shared", "kv_same",
                   "global_heads", "per_layer", "kv_shared_wide", "moe", "moe_shared", "router_norm", "branch_norms"}
    defaults = {"max_position_embeddings": 131072, "num_key_value_heads": 4, "head_dim": 256, "sliding_window": 512,
                "final_logit_softcapping": None, "global_head_dim": 512, "hidden_size_per_layer_input": 256,
                "vocab_size_per_layer_input": 262144, "rope_parameters": {
                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6}}}
    norm_offset, old_rope, wrapper = 0.0, False, ("gemma4", "model.language_model.")
    gguf = "gemma4"
    gguf_renames = {"layer_scalar": "layer_scalar.weight"}

    def default_local(self, hf, get, n_layers):  # transformers makes the last layer global
        return super().default_local(hf, get, n_layers)[:-1] + [False]

    def config(self, hf, get, n_layers):
        if get("use_bidirectional_attention") == "all":
            raise ValueError("use_bidirectional_attention=all is not supported (a causal decoder only)")
        types = hf.get("layer_types") or []
        if types and types[-1] != "full_attention":
            raise ValueError(f"layer_types ends in {types[-1]!r}: transformers makes the last layer full_attention")
        shared, wide = get("num_kv_shared_layers") or 0, get("use_double_wide_mlp")
        return {"norm_placement": "sandwich", "embed_scale": True, "qk_norm": True, "v_norm": True,
                "query_pre_attn_scalar": 1.0, "layer_scalar": True, "final_softcap": get("final_logit_softcapping"),
                "global_kv_same": bool(get("attention_k_eq_v")), "kv_shared_layers": shared,
                "kv_shared_ffn_hidden": 2 * get("intermediate_size") if wide and shared else None,
                "per_layer_dim": get("hidden_size_per_layer_input") or 0,
                "per_layer_vocab": None if get("vocab_size_per_layer_input") == hf["vocab_size"] or not
                get("hidden_size_per_layer_input") else get("vocab_size_per_layer_input"),
                **self.global_heads(hf, get, types), **self.moe(get, wide and shared)}

    @staticmethod
    def moe(get, wide: bool) -> dict:
        """`moe` from enable_moe_block: the MLP beside the experts is their one shared expert ({} without)."""
        if not get("enable_moe_block"):
            return {}
        if missing := [k for k in ("num_experts", "top_k_experts", "moe_intermediate_size") if not get(k)]:
            raise ValueError(f"enable_moe_block=True needs {', '.join(missing)}")
        if wide:
            raise ValueError("use_double_wide_mlp with enable_moe_block is not supported (the MLP beside the experts "
                             "of one width)")
        return {"moe": dict(n_experts=get("num_experts"), top_k=get("top_k_experts"), expert_hidden=get(
            "moe_intermediate_size"), n_shared=1, shared_hidden=get("intermediate_size"), router_norm=True,
            branch_norms=True)}

    def global_heads(self, hf, get, types) -> dict:
        """global_head_dim and global_n_kv_heads from per_layer_config (one override for every full-attention layer)
        or from global_head_dim and num_global_key_value_heads (the latter with attention_k_eq_v only)."""
        head_dim, n_kv = get("head_dim"), get("num_key_value_heads")
        if "per_layer_config" in hf:
            over = {int(k): v for k, v in (hf["per_layer_config"] or {}).items()}
            full = [i for i, t in enumerate(types) if t == "full_attention"]
            one = over.get(full[0], {}) if full else {}
            if set(over) - set(full) or any(over.get(i, {}) != one for i in full) or \
                    set(one) - {"head_dim", "num_key_value_heads"}:
                raise ValueError("per_layer_config must give every full_attention layer the same head_dim / "
                                 "num_key_value_heads, and nothing else")
            gd, gkv = one.get("head_dim", head_dim), one.get("num_key_value_heads", n_kv)
        else:
            gd, gkv = get("global_head_dim"), get("num_global_key_value_heads") if get("attention_k_eq_v") else None
        return {"global_head_dim": None if gd == head_dim else gd, "global_n_kv_heads": None if gkv in (None, n_kv)
                else gkv}

    def to_hf(self, cfg):
        n_kv, head_dim = cfg.attn_shape(cfg.n_layers - 1)  # the last layer is global
        return {"hidden_activation": "gelu_pytorch_tanh", "sliding_window": cfg.sliding_window or cfg.max_seq_len,
                "final_logit_softcapping": cfg.final_softcap, "hidden_size_per_layer_input": cfg.per_layer_dim,
                "vocab_size_per_layer_input": cfg.per_layer_vocab or cfg.vocab_size, **self.moe_to_hf(cfg),
                "attention_k_eq_v": cfg.global_kv_same, "num_kv_shared_layers": cfg.kv_shared_layers,
                "use_double_wide_mlp": cfg.kv_shared_ffn_hidden is not None,
                "per_layer_config": {str(i): {"head_dim": head_dim, "num_key_value_heads": n_kv}
                                     for i in range(cfg.n_layers) if not cfg.is_local(i)}}

    @staticmethod
    def moe_to_hf(cfg) -> dict:
        """`moe`'s config.json keys."""
        m = cfg.moe
        return {"enable_moe_block": m is not None, **({} if m is None else dict(
            num_experts=m.n_experts, top_k_experts=m.top_k, moe_intermediate_size=cfg.resolved_expert_hidden))}

    def experts(self, cfg, h):
        norms = ("pre_feedforward_layernorm", "post_feedforward_layernorm_1", "pre_feedforward_layernorm_2",
                 "post_feedforward_layernorm_2")
        return {"router": h + "router.proj", "router_scale": h + "router.scale", "expert_scale": h +
                "router.per_expert_scale", "shared": h + "mlp.", "norms": [h + n for n in norms],
                "stacked": stacked(cfg, h + "experts.gate_up_proj", h + "experts.down_proj")}

    def refuses(self, cfg):
        m = cfg.moe
        its_moe = m is None or m.router_norm and m.branch_norms and m.n_shared == 1 and (
            m.shared_hidden or cfg.resolved_expert_hidden) == cfg.resolved_ffn_hidden and cfg.kv_shared_ffn_hidden is None
        return ("no query_pre_attn_scalar but 1" if cfg.query_pre_attn_scalar != 1 else
                "experts only beside an MLP of ffn_hidden (moe.n_shared 1, moe.shared_hidden ffn_hidden, "
                "moe.router_norm, moe.branch_norms) and no wider KV-sharing MLPs" if not its_moe else
                "no local last layer" if cfg.is_local(cfg.n_layers - 1) else
                "per-head q/k norms only" if cfg.qk_norm == "proj" else
                "no KV-sharing layers' MLP width but twice ffn_hidden" if cfg.kv_shared_ffn_hidden not in
                (None, 2 * cfg.resolved_ffn_hidden) else "")

    def gguf_config(self, get, tensors):
        """llama.cpp's: local layers by sliding_window_pattern, their head size key_length_swa; kv heads and MLP
        widths per layer; global layers' values their keys where they have no attn_v; the angles of the global
        layers that turn where rope_freqs is 1 (proportional RoPE)."""
        if get("expert_count"):
            raise ValueError(f"gemma4.expert_count={get('expert_count')}: Gemma 4's experts are not read from GGUF files")
        n = get("block_count")
        local = get("attention.sliding_window_pattern")
        kv, ff = (v if isinstance(v, list) else [v] * n for v in (get("attention.head_count_kv"), get("feed_forward_length")))
        full, shared = [i for i in range(n) if not local[i]], get("attention.shared_kv_layers", 0)
        factors = tensors["rope_freqs.weight"].data
        table = tensors.get("per_layer_token_embd.weight")
        return {"layer_types": ["sliding_attention" if s else "full_attention" for s in local],
                "head_dim": get("attention.key_length_swa"), "num_key_value_heads": kv[local.index(True)],
                "per_layer_config": {str(i): {"head_dim": get("attention.key_length"), "num_key_value_heads": kv[i]}
                                     for i in full},
                "attention_k_eq_v": f"blk.{full[0]}.attn_v.weight" not in tensors, "num_kv_shared_layers": shared,
                "intermediate_size": ff[0], "use_double_wide_mlp": bool(shared) and ff[-1] == 2 * ff[0],
                "hidden_size_per_layer_input": get("embedding_length_per_layer_input", 0),
                "vocab_size_per_layer_input": int(table.shape[-1]) if table is not None else None,
                "final_logit_softcapping": get("final_logit_softcapping"), "rope_parameters": {
                    "sliding_attention": {"rope_type": "default", "rope_theta": get("rope.freq_base_swa", 1e4)},
                    "full_attention": {"rope_type": "proportional", "rope_theta": get("rope.freq_base"),
                                       "partial_rotary_factor": float((factors == 1).mean())}}}

    def gguf_metadata(self, cfg):
        n, last = cfg.n_layers, cfg.attn_shape(cfg.n_layers - 1)  # the last layer is global
        per_layer = lambda f: [f(i) for i in range(n)] if len({f(i) for i in range(n)}) > 1 else f(0)  # noqa: E731
        return {"sliding_window_pattern": [cfg.is_local(i) for i in range(n)], "shared_kv_layers": cfg.kv_shared_layers,
                "embedding_length_per_layer_input": cfg.per_layer_dim, "key_length": last[1], "value_length": last[1],
                "key_length_swa": cfg.resolved_head_dim, "value_length_swa": cfg.resolved_head_dim,
                "rope_dimension_count": last[1], "rope_dimension_count_swa": cfg.resolved_head_dim,
                "rope_freq_base_swa": cfg.rope_theta_local or cfg.rope_theta,
                "head_count_kv": per_layer(lambda i: cfg.attn_shape(i)[0]), "feed_forward_length": per_layer(cfg.ffn_width),
                "final_logit_softcapping": cfg.final_softcap}

    def gguf_refuses(self, cfg):
        s = cfg.rope_scaling
        return ("experts that Zoo writes (enable_moe_block)" if cfg.moe else
                "RoPE on the global layers but proportional (rope_freqs)" if s is None or s.type != "proportional" else
                "factor scaling proportional RoPE" if s.factor != 1 else "")
