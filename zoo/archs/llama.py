"""Llama, Mistral and Mixtral: the pre-norm decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU) every
other record departs from; Mistral's window on every layer; Mixtral's experts (every layer sparse, the top-k
renormalised), named w1 / w3 / w2 under block_sparse_moe."""
from .record import ROPES, Record, attention_bias


class Llama(Record):
    hf_class, model_type = "LlamaForCausalLM", "llama"
    may = ROPES | {"attn_bias"}
    defaults = {"max_position_embeddings": 2048}
    gguf, gguf_writes = "llama", True
    gguf_interleaved = True  # llama.cpp stores Llama's q/k rows with RoPE pairs interleaved

    def config(self, hf, get, n_layers):
        return attention_bias(get)

    def to_hf(self, cfg):
        return {"attention_bias": cfg.attn_out_bias, "mlp_bias": False}

    def gguf_config(self, get, tensors):  # a file without key_length: the head size is the rotated one
        return {} if get("attention.key_length") else {"head_dim": get("rope.dimension_count")}


class Mistral(Record):
    hf_class, model_type = "MistralForCausalLM", "mistral"
    may = ROPES | {"window"}
    defaults = {"max_position_embeddings": 4096 * 32, "num_key_value_heads": 8, "sliding_window": 4096}
    window = "every"


class Mixtral(Record):
    hf_class, model_type = "MixtralForCausalLM", "mixtral"
    needs, may = frozenset({"moe"}), ROPES | {"window"}
    defaults = {"max_position_embeddings": 4096 * 32, "num_key_value_heads": 8, "sliding_window": None,
                "rope_theta": 1e6, "num_local_experts": 8, "num_experts_per_tok": 2}
    window = "every"

    def config(self, hf, get, n_layers):
        return {"moe": dict(n_experts=get("num_local_experts"), norm_topk_prob=True, expert_hidden=hf["intermediate_size"])}

    def to_hf(self, cfg):
        return {"num_local_experts": cfg.moe.n_experts, "intermediate_size": cfg.resolved_expert_hidden}

    def experts(self, cfg, h):
        return {"router": h + "block_sparse_moe.gate", "per_expert": (h + "block_sparse_moe.experts.{e}.", "w1", "w3", "w2")}
