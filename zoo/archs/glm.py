"""GLM-4: norms before and after each branch under names of its own, a bias on q/k/v, gate and up kept as one
fused projection, and RoPE on the first half of each head (partial_rotary_factor 0.5) with its pairs
interleaved in the file."""
from .record import ROPES, Record, interleaved

SANDWICH = {"attn_norm": "input_layernorm", "attn_post_norm": "post_self_attn_layernorm",
            "mlp_norm": "post_attention_layernorm", "mlp_post_norm": "post_mlp_layernorm"}


class Glm4(Record):
    hf_class, model_type = "Glm4ForCausalLM", "glm4"
    needs, may = frozenset({"sandwich_norm"}), ROPES | {"qkv_bias", "partial_rotary"}
    defaults = {"max_position_embeddings": 131072, "num_key_value_heads": 2, "head_dim": 128, "rms_norm_eps": 1.5625e-07,
                "attention_bias": True, "partial_rotary_factor": 0.5}
    norms, fused = SANDWICH, ("gate_up_proj",)

    def config(self, hf, get, n_layers):
        return {"norm_placement": "sandwich", "qkv_bias": bool(get("attention_bias")), "attn_out_bias": False}

    def to_hf(self, cfg):
        return {"attention_bias": cfg.qkv_bias}

    def rope_rows(self, cfg, hf=None):
        D, r = cfg.resolved_head_dim, cfg.rotary_dim
        return {"self_attn.q_proj": interleaved(cfg.n_heads, D, 0, r),
                "self_attn.k_proj": interleaved(cfg.resolved_n_kv_heads, D, 0, r)}
