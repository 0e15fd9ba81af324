"""Phi-3 and Phi-4-mini: q/k/v and gate/up kept as fused projections, a window on every layer, partial rotary
(Phi-4-mini) and LongRoPE (two sets of per-channel factors, `original_max_position_embeddings` at the top
level); in GGUF files the LongRoPE factors are tensors."""
from .record import Record


class Phi3(Record):
    hf_class, model_type = "Phi3ForCausalLM", "phi3"
    may = frozenset({"partial_rotary", "window", "rope_longrope"})
    defaults = {"max_position_embeddings": 4096}
    window = "every"
    fused = ("qkv_proj", "gate_up_proj")
    gguf, gguf_writes = "phi3", True

    def to_hf(self, cfg):
        s = cfg.rope_scaling
        return {"original_max_position_embeddings": s.original_max_position_embeddings} if s else {}

    def gguf_config(self, get, tensors):
        if "rope_factors_long.weight" not in tensors:
            return {}
        factors = {k: [float(v) for v in tensors[f"rope_factors_{k}.weight"].data] for k in ("short", "long")}
        return {"original_max_position_embeddings": get("rope.scaling.original_context_length"),
                "rope_scaling": {"rope_type": "longrope", "short_factor": factors["short"],
                                 "long_factor": factors["long"], "attention_factor": get("rope.scaling.attn_factor")}}
