"""Qwen3.5 (text): Gated DeltaNet layers (`linear_attention`) between full-attention layers whose output is gated by
a sigmoid of a second half of q_proj (per head: q, then its gate); per-head q/k RMSNorm; norms storing 1 + w (the
DeltaNet's gated norm a plain gain); RoPE on a quarter of each head by default (multimodal RoPE, which for text is
plain RoPE)."""
from .record import ROPES, Record


class Qwen3_5(Record):
    hf_class, model_type = "Qwen3_5ForCausalLM", "qwen3_5_text"
    needs, may = frozenset({"linear_attention", "attn_gate", "qk_norm"}), ROPES | {"partial_rotary"}
    defaults = {"max_position_embeddings": 32768, "num_key_value_heads": 4, "head_dim": 256, "rope_theta": 1e4,
                "partial_rotary_factor": 0.25, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
                "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32}
    norm_offset = 1.0
    mixers = {"linear_attention": "linear_attn"}

    def config(self, hf, get, n_layers):
        return {"qk_norm": True, "attn_gate": True, "recurrent": {
            "n_heads": get("linear_num_key_heads"), "head_dim": get("linear_key_head_dim"),
            "n_v_heads": get("linear_num_value_heads"), "v_head_dim": get("linear_value_head_dim"),
            "conv_kernel": get("linear_conv_kernel_dim")}}

    def to_hf(self, cfg):
        r = cfg.resolved_recurrent
        return {"attention_bias": False, "linear_num_key_heads": r.n_heads, "linear_key_head_dim": r.head_dim,
                "linear_num_value_heads": r.n_v_heads or r.n_heads, "linear_value_head_dim": r.v_head_dim or r.head_dim,
                "linear_conv_kernel_dim": r.conv_kernel}
