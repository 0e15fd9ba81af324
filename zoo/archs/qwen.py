"""Qwen2 (a bias on q/k/v), Qwen3 (per-head q/k RMSNorm) and their Mixture-of-Experts classes (Qwen2-MoE: a
shared expert behind a sigmoid gate; Qwen3-MoE). A window applies only with use_sliding_window: Qwen2 and
Qwen3 on the layers from max_window_layers, Qwen2-MoE on the even ones below it, Qwen3-MoE on every layer."""
from .record import ROPES, Record, attention_bias

QWEN_MOE = ROPES | {"moe_dense_layers", "moe_topk_raw"}


def qwen_moe(hf, get, n_layers) -> dict:
    """The `moe:` keys of a Qwen MoE config.json (`decoder_sparse_step`, `mlp_only_layers`, a shared expert behind a
    sigmoid gate where `shared_expert_intermediate_size` is given)."""
    step, n = get("decoder_sparse_step"), hf.get("num_experts", hf.get("num_local_experts", get("num_experts")))
    if not isinstance(n, int) or n <= 0:
        raise ValueError(f"num_experts={n!r} is not supported (a MoE model needs experts)")
    if not isinstance(step, int) or step <= 0:
        raise ValueError(f"decoder_sparse_step={step!r} must be a positive integer")
    only, shared = hf.get("mlp_only_layers") or [], get("shared_expert_intermediate_size")
    return dict(n_experts=n, norm_topk_prob=bool(get("norm_topk_prob")),
                expert_hidden=get("moe_intermediate_size"), sparse_every=step,
                dense_layers=sorted({i for i in only if isinstance(i, int) and 0 <= i < n_layers}),
                **(dict(n_shared=1, shared_hidden=shared, shared_gate=True) if shared else {}))


def qwen_moe_to_hf(cfg) -> dict:
    m = cfg.moe
    shared = {"shared_expert_intermediate_size": m.n_shared * (m.shared_hidden or cfg.resolved_expert_hidden)}
    return {"num_experts": m.n_experts, "moe_intermediate_size": cfg.resolved_expert_hidden,
            "norm_topk_prob": m.norm_topk_prob, "decoder_sparse_step": m.sparse_every,
            "mlp_only_layers": list(m.dense_layers), **(shared if m.n_shared else {})}


class Qwen2(Record):
    hf_class, model_type = "Qwen2ForCausalLM", "qwen2"
    needs, may = frozenset({"qkv_bias"}), ROPES | {"window", "pattern"}
    defaults = {"max_position_embeddings": 32768, "num_key_value_heads": 32, "sliding_window": 4096,
                "max_window_layers": 28}
    window = "qwen"
    gguf, gguf_writes = "qwen2", True

    def config(self, hf, get, n_layers):
        return {"qkv_bias": True, "attn_out_bias": False}

    def default_local(self, hf, get, n_layers):
        return [i >= get("max_window_layers") for i in range(n_layers)]


class Qwen3(Qwen2):
    hf_class, model_type = "Qwen3ForCausalLM", "qwen3"
    needs, may = frozenset({"qk_norm"}), ROPES | {"window", "pattern", "attn_bias"}
    defaults = {**Qwen2.defaults, "head_dim": 128}
    gguf = "qwen3"

    def config(self, hf, get, n_layers):
        return {"qk_norm": True, **attention_bias(get)}

    def to_hf(self, cfg):
        return {"attention_bias": cfg.attn_out_bias, "mlp_bias": False}

    def gguf_refuses(self, cfg):
        return "sliding window" if cfg.sliding_window else super().gguf_refuses(cfg)


class Qwen2Moe(Qwen2):
    hf_class, model_type = "Qwen2MoeForCausalLM", "qwen2_moe"
    needs, may = frozenset({"moe", "moe_shared", "moe_shared_gate"}), QWEN_MOE | {"qkv_bias", "window", "pattern"}
    defaults = {"max_position_embeddings": 32768, "num_key_value_heads": 16, "sliding_window": 4096,
                "max_window_layers": 28, "num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
                "shared_expert_intermediate_size": 5632, "norm_topk_prob": False, "decoder_sparse_step": 1}
    gguf, gguf_writes = None, False

    def config(self, hf, get, n_layers):
        return {"moe": qwen_moe(hf, get, n_layers), "qkv_bias": bool(hf.get("qkv_bias", True)), "attn_out_bias": False}

    def to_hf(self, cfg):
        return {**qwen_moe_to_hf(cfg), "qkv_bias": cfg.qkv_bias}

    def default_local(self, hf, get, n_layers):
        return [bool((i + 1) % 2) and i < get("max_window_layers") for i in range(n_layers)]


class Qwen3Moe(Record):
    hf_class, model_type = "Qwen3MoeForCausalLM", "qwen3_moe"
    needs, may = frozenset({"moe", "qk_norm"}), QWEN_MOE | {"window", "attn_bias"}
    defaults = {"max_position_embeddings": 32768, "num_key_value_heads": 4, "sliding_window": 4096,
                "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": False,
                "decoder_sparse_step": 1}
    window = "qwen"  # on every layer

    def config(self, hf, get, n_layers):
        return {"moe": qwen_moe(hf, get, n_layers), "qk_norm": True, **attention_bias(get)}

    def to_hf(self, cfg):
        return {**qwen_moe_to_hf(cfg), "attention_bias": cfg.attn_out_bias}
