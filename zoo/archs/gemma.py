"""Gemma 2 and Gemma 3 (text): norms before and after each branch (sandwich) storing 1 + w, GeGLU, embeddings
times sqrt(d_model), scores scaled by query_pre_attn_scalar, local (sliding) and global layers (Gemma 2: one
of two global; Gemma 3: one of six); Gemma 2 soft-caps scores and logits, Gemma 3 normalises q and k per
head and gives its local layers a RoPE base of their own, unscaled."""
from .record import ROPES, Record

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
