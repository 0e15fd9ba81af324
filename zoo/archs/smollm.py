"""SmolLM3: Llama's decoder with RoPE left out of every `no_rope_layer_interval`-th layer (NoPE); with
use_sliding_window, the window on the NoPE layers."""
from .record import ROPES, Record, attention_bias


def no_rope(hf, get, n_layers) -> list:
    """no_rope_layers: 1 where a layer uses RoPE (default: all but every no_rope_layer_interval-th)."""
    every = get("no_rope_layer_interval")
    return hf.get("no_rope_layers") or [int((i + 1) % every != 0) for i in range(n_layers)]


class SmolLM3(Record):
    hf_class, model_type = "SmolLM3ForCausalLM", "smollm3"
    needs, may = frozenset({"nope"}), ROPES | {"window", "pattern", "attn_bias"}
    defaults = {"max_position_embeddings": 32768, "num_key_value_heads": 4, "rope_theta": 2e6,
                "no_rope_layer_interval": 4}
    window = "qwen"

    def config(self, hf, get, n_layers):
        return {"nope_layers": [i for i, r in enumerate(no_rope(hf, get, n_layers)) if not r], **attention_bias(get)}

    def default_local(self, hf, get, n_layers):
        return [not r for r in no_rope(hf, get, n_layers)]

    def to_hf(self, cfg):
        return {"no_rope_layers": [int(i not in cfg.nope_layers) for i in range(cfg.n_layers)],
                "attention_bias": cfg.attn_out_bias, "mlp_bias": False}
