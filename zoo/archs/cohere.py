"""Cohere 2 (Command R7B, Command A): attention and MLP side by side from one LayerNorm without a bias
(parallel_block), local (sliding) and global layers (one of four global), RoPE on the local layers only,
with its pairs interleaved in the file, and the logits scaled by logit_scale."""
from .record import ROPES, Record, attention_bias, interleaved


class Cohere2(Record):
    hf_class, model_type = "Cohere2ForCausalLM", "cohere2"
    needs = frozenset({"layer_norm", "parallel"})
    may = ROPES | {"attn_bias", "window", "pattern", "nope", "logit_scale"}
    defaults = {"max_position_embeddings": 8192, "logit_scale": 0.0625, "sliding_window": 4096,
                "layer_norm_eps": 1e-5}
    window, period, tie = "types", 4, True
    norms = {"attn_norm": "input_layernorm"}

    def config(self, hf, get, n_layers):
        local = [t == "sliding_attention" for t in hf["layer_types"]] if hf.get("layer_types") else \
            self.default_local(hf, get, n_layers)
        if get("sliding_window") is None:  # no window: no layer is local, none has RoPE
            local = [False] * n_layers
        return {"norm_type": "layer", "parallel_block": True, "norm_eps": get("layer_norm_eps"),
                "logit_scale": float(get("logit_scale")), **attention_bias(get),
                "nope_layers": [i for i, is_local in enumerate(local) if not is_local]}

    def refuses(self, cfg):
        if sorted(cfg.nope_layers) != [i for i in range(cfg.n_layers) if not cfg.is_local(i)]:
            return "RoPE on the local layers and on no others"
        return ""

    def to_hf(self, cfg):
        return {"layer_norm_eps": cfg.norm_eps, "logit_scale": cfg.logit_scale, "attention_bias": cfg.attn_out_bias,
                "sliding_window": cfg.sliding_window or cfg.max_seq_len}

    def rope_rows(self, cfg, hf=None):
        D = cfg.resolved_head_dim
        return {"self_attn.q_proj": interleaved(cfg.n_heads, D, 0, D),
                "self_attn.k_proj": interleaved(cfg.resolved_n_kv_heads, D, 0, D)}
