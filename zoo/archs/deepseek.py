"""DeepSeek-V3 and Mistral 4: multi-head latent attention (queries through a low-rank bottleneck, keys and
values from one cached latent) with RoPE pairs interleaved in the file, and Mixture-of-Experts layers after
`first_k_dense_replace` dense ones, with shared experts and group-limited routing (the experts of the
`topk_group` groups whose two best scores sum highest). DeepSeek-V3 scores by sigmoid with a routing bias;
DeepSeek-V3.2 adds a lightning indexer to each attention layer (each query keeps its `index_topk` best keys);
GLM-5 (GlmMoeDsa) is DeepSeek-V3.2 with its indexer's RoPE pairs interleaved too and layers that reuse the
previous indexer layer's selection (`indexer_types` "shared"); Mistral 4 scores by softmax, keeps its experts as
stacked tensors and scales queries past `original_max_position_embeddings` (Llama 4's attention temperature)."""
from .record import ROPES, Record, interleaved, stacked


class DeepseekV3(Record):
    hf_class, model_type = "DeepseekV3ForCausalLM", "deepseek_v3"
    needs = frozenset({"moe", "mla", "sigmoid"})
    may = ROPES | {"moe_shared", "moe_groups", "moe_dense_layers", "moe_topk_raw"}  # no shared experts: empty tensors
    defaults = {"max_position_embeddings": 4096, "n_routed_experts": 256, "num_experts_per_tok": 8,
                "n_shared_experts": 1, "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5,
                "first_k_dense_replace": 3, "norm_topk_prob": True, "moe_intermediate_size": 2048, "q_lora_rank": 1536,
                "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
                "rope_interleave": True}
    scoring = "sigmoid"

    def config(self, hf, get, n_layers):
        F = get("moe_intermediate_size")
        moe = dict(n_experts=get("n_routed_experts"), scoring=self.scoring, norm_topk_prob=bool(get("norm_topk_prob")),
                   expert_hidden=F, n_shared=get("n_shared_experts"), shared_hidden=F, n_groups=get("n_group") or 1,
                   topk_groups=get("topk_group") or 1, routed_scale=float(get("routed_scaling_factor")),
                   dense_layers=list(range(min(get("first_k_dense_replace") or 0, n_layers))))
        if self.scoring == "sigmoid":
            moe["balance"] = "bias"
        mla = dict(kv_rank=get("kv_lora_rank"), q_rank=get("q_lora_rank"), rope_dim=get("qk_rope_head_dim"),
                   nope_dim=get("qk_nope_head_dim"), v_dim=get("v_head_dim"))
        return {"moe": moe, "mla": mla, "head_dim": mla["rope_dim"] + mla["nope_dim"], "n_kv_heads": hf["num_attention_heads"],
                "rotary_fraction": 1.0}

    def refuses(self, cfg):
        m, first = cfg.moe, len(cfg.moe.dense_layers)
        wide = m.n_shared and (m.shared_hidden or 0) != cfg.resolved_expert_hidden
        if list(m.dense_layers) != list(range(first)) or m.sparse_every != 1 or wide:
            return "its dense layers first, then every layer sparse, with shared experts of the experts' width"
        return ""

    def to_hf(self, cfg):
        m, a = cfg.moe, cfg.mla
        return dict(kv_lora_rank=a.kv_rank, q_lora_rank=a.q_rank, qk_rope_head_dim=a.rope_dim, qk_nope_head_dim=a.nope_dim,
                    v_head_dim=a.v_dim, head_dim=a.rope_dim, rope_interleave=True, attention_bias=False,
                    n_routed_experts=m.n_experts, n_shared_experts=m.n_shared, moe_intermediate_size=m.expert_hidden,
                    n_group=m.n_groups, topk_group=m.topk_groups, routed_scaling_factor=m.routed_scale,
                    first_k_dense_replace=len(m.dense_layers), norm_topk_prob=m.norm_topk_prob)

    def rope_rows(self, cfg, hf=None):
        if hf is not None and not hf.get("rope_interleave", True):
            return {}
        a, H = cfg.mla, cfg.n_heads
        q = interleaved(H, a.nope_dim + a.rope_dim, a.nope_dim, a.rope_dim)
        return {"self_attn.q_b_proj": q, "self_attn.q_proj": q,
                "self_attn.kv_a_proj_with_mqa": interleaved(1, a.kv_rank + a.rope_dim, a.kv_rank, a.rope_dim)}

    def experts(self, cfg, h):
        return {**super().experts(cfg, h), "shared": h + "mlp.shared_experts.", "score_bias": h + "mlp.gate.e_score_correction_bias"}


class DeepseekV32(DeepseekV3):
    hf_class, model_type = "DeepseekV32ForCausalLM", "deepseek_v32"
    needs = DeepseekV3.needs | {"sparse_attention"}
    defaults = {**DeepseekV3.defaults, "max_position_embeddings": 163840, "index_topk": 2048, "index_head_dim": 128,
                "index_n_heads": 64}

    def config(self, hf, get, n_layers):
        out = super().config(hf, get, n_layers)
        dense = len(out["moe"]["dense_layers"])
        if hf.get("mlp_layer_types", ["dense"] * dense + ["sparse"] * (n_layers - dense)) != \
                ["dense"] * dense + ["sparse"] * (n_layers - dense):
            raise ValueError(f"mlp_layer_types must be first_k_dense_replace={dense} dense layers, then sparse ones")
        out["mla"].update(index_heads=get("index_n_heads"), index_dim=get("index_head_dim"), index_topk=get("index_topk"))
        return out

    def to_hf(self, cfg):
        a = cfg.mla
        return {**{k: v for k, v in super().to_hf(cfg).items() if k != "rope_interleave"},  # always interleaved
                "index_n_heads": a.index_heads, "index_head_dim": a.index_dim, "index_topk": a.index_topk}


class GlmMoeDsa(DeepseekV32):
    hf_class, model_type = "GlmMoeDsaForCausalLM", "glm_moe_dsa"
    may = DeepseekV32.may | {"shared_index"}
    defaults = {**DeepseekV32.defaults, "max_position_embeddings": 202752, "q_lora_rank": 2048, "qk_nope_head_dim": 192,
                "v_head_dim": 256, "n_group": 1, "topk_group": 1, "rms_norm_eps": 1e-5, "index_n_heads": 32}

    def config(self, hf, get, n_layers):
        out = super().config(hf, get, n_layers)
        kinds = indexer_types(hf, n_layers)
        if kinds[:1] == ["shared"] or set(kinds) - {"full", "shared"} or len(kinds) != n_layers:
            raise ValueError(f"indexer_types must be 'full' or 'shared' per layer, the first 'full': got {kinds}")
        out["mla"]["index_shared"] = [i for i, k in enumerate(kinds) if k == "shared"]
        return out

    def to_hf(self, cfg):
        return {**super().to_hf(cfg), "indexer_types": ["full" if cfg.indexer_at(i) else "shared"
                                                         for i in range(cfg.n_layers)]}

    def rope_rows(self, cfg, hf=None):
        a, k = cfg.mla, interleaved(1, cfg.mla.index_dim, 0, cfg.mla.rope_dim)
        return {**super().rope_rows(cfg, hf), "self_attn.indexer.wq_b": interleaved(a.index_heads, a.index_dim, 0, a.rope_dim),
                "self_attn.indexer.wk": k, "self_attn.indexer.k_norm": k}


def indexer_types(hf: dict, n_layers: int) -> list:
    """GLM-5's per-layer indexer kinds: config.json's `indexer_types`, else as transformers derives them from
    `index_topk_pattern` ("FSS...") or `index_topk_freq` / `index_skip_topk_offset`."""
    if hf.get("indexer_types") is not None:
        return list(hf["indexer_types"])
    if (pattern := hf.get("index_topk_pattern")) is not None:
        return [{"F": "full", "S": "shared"}.get(c, c) for c in pattern]
    freq, offset = max(hf.get("index_topk_freq", 1), 1), hf.get("index_skip_topk_offset", 2)
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n_layers)]


class Mistral4(DeepseekV3):
    hf_class, model_type = "Mistral4ForCausalLM", "mistral4"
    needs = frozenset({"moe", "mla", "moe_shared"})
    may = DeepseekV3.may - needs | {"query_temperature"}
    defaults = {**DeepseekV3.defaults, "max_position_embeddings": 1048576, "n_routed_experts": 128,
                "num_experts_per_tok": 4, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0,
                "first_k_dense_replace": 0, "moe_intermediate_size": 2048, "q_lora_rank": 1024, "kv_lora_rank": 256,
                "qk_rope_head_dim": 64, "qk_nope_head_dim": 64, "v_head_dim": 128}
    scoring = "softmax"

    def experts(self, cfg, h):
        return {"router": h + "mlp.gate", "shared": h + "mlp.shared_experts.",
                "stacked": stacked(cfg, h + "mlp.experts.gate_up_proj", h + "mlp.experts.down_proj")}

    def to_hf(self, cfg):
        return {k: v for k, v in super().to_hf(cfg).items() if k != "head_dim"}
