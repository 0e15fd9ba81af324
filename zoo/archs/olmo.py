"""OLMo 2 and OLMo 3: RMSNorm after each branch (post-norm, no norm before), q and k RMS-normalised over the
whole projection; OLMo 3 adds a sliding window on three layers of four, each kind with its own RoPE base."""
from .record import ROPES, Record, attention_bias

POST = {"attn_post_norm": "post_attention_layernorm", "mlp_post_norm": "post_feedforward_layernorm"}


class Olmo2(Record):
    hf_class, model_type = "Olmo2ForCausalLM", "olmo2"
    needs, may = frozenset({"qk_norm_proj", "post_norm"}), ROPES | {"attn_bias"}
    defaults = {"max_position_embeddings": 2048}
    norms = POST
    gguf, gguf_writes = "olmo2", True

    def config(self, hf, get, n_layers):
        return {"qk_norm": "proj", "norm_placement": "post", **attention_bias(get)}

    def to_hf(self, cfg):
        return {"attention_bias": cfg.attn_out_bias, "mlp_bias": False}

    def gguf_refuses(self, cfg):
        return "sliding window" if cfg.sliding_window else super().gguf_refuses(cfg)


class Olmo3(Olmo2):
    hf_class, model_type = "Olmo3ForCausalLM", "olmo3"
    may = Olmo2.may | {"window", "pattern", "rope_local"}
    defaults = {"max_position_embeddings": 2048, "rope_theta": 500000.0, "sliding_window": 4096}
    window, period = "types", 4
    gguf, gguf_writes = None, False
