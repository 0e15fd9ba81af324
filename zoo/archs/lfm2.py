"""LFM2 (Liquid AI): gated short convolutions (`conv` layers) between attention layers with per-head q/k RMSNorm;
its own names for the norms, the attention output, the MLP (w1, w3, w2) and the final norm (embedding_norm), and a
config.json whose intermediate_size is scaled and rounded unless block_auto_adjust_ff_dim is false."""
from .record import ROPES, Record, no_attention


class Lfm2(Record):
    hf_class, model_type = "Lfm2ForCausalLM", "lfm2"
    needs, may = frozenset({"conv", "qk_norm"}), ROPES
    defaults = {"max_position_embeddings": 128000, "num_key_value_heads": 8, "rope_theta": 1e6, "norm_eps": 1e-5,
                "conv_L_cache": 3, "block_multiple_of": 256, "block_ffn_dim_multiplier": 1.0,
                "block_auto_adjust_ff_dim": True}
    tie = True
    norms = {"attn_norm": "operator_norm", "mlp_norm": "ffn_norm"}
    renames = {"self_attn.o_proj": "self_attn.out_proj", "self_attn.q_norm": "self_attn.q_layernorm",
               "self_attn.k_norm": "self_attn.k_layernorm", "mlp.gate_proj": "feed_forward.w1",
               "mlp.up_proj": "feed_forward.w3", "mlp.down_proj": "feed_forward.w2", "model.norm.": "model.embedding_norm."}
    mixers = {"conv": "conv"}
    gguf, gguf_writes = "lfm2", True

    def refuses(self, cfg):
        return no_attention(cfg)

    def config(self, hf, get, n_layers):
        ffn = hf["intermediate_size"]
        if get("block_auto_adjust_ff_dim"):  # as transformers' Lfm2MLP
            ffn, mult, multiple = int(2 * ffn / 3), get("block_ffn_dim_multiplier"), get("block_multiple_of")
            if mult is not None:
                ffn = multiple * ((int(mult * ffn) + multiple - 1) // multiple)
        return {"qk_norm": True, "ffn_hidden": ffn, "norm_eps": get("norm_eps"),
                "recurrent": {"conv_kernel": get("conv_L_cache"), "conv_bias": bool(get("conv_bias"))}}

    def to_hf(self, cfg):
        return {"norm_eps": cfg.norm_eps, "block_auto_adjust_ff_dim": False, "conv_L_cache": cfg.resolved_recurrent.conv_kernel,
                "conv_bias": cfg.resolved_recurrent.conv_bias}

    def gguf_config(self, get, tensors):  # llama.cpp's: no kv heads on a convolution layer; the MLP's width as is
        kv = get("attention.head_count_kv")
        kv = kv if isinstance(kv, list) else [kv] * get("block_count")
        return {"layer_types": ["full_attention" if n else "conv" for n in kv], "num_key_value_heads": max(kv),
                "conv_L_cache": get("shortconv.l_cache"), "block_auto_adjust_ff_dim": False,
                "norm_eps": get("attention.layer_norm_rms_epsilon")}

    def gguf_metadata(self, cfg):
        return {"shortconv_l_cache": cfg.resolved_recurrent.conv_kernel, "head_count_kv": [
            0 if cfg.layer_type(i) == "conv" else cfg.resolved_n_kv_heads for i in range(cfg.n_layers)]}

    def gguf_refuses(self, cfg):
        return "convolution biases" if cfg.resolved_recurrent.conv_bias else ""
