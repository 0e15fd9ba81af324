"""Granite 4.0-H (IBM; GraniteMoeHybrid): Mamba-2 layers (`mamba`) between grouped-query attention layers, which have
RoPE only when position_embedding_type is rope; every layer's MLP a shared SwiGLU (shared_mlp, gate and up fused),
beside routed experts stored stacked as (E, 2F, d) and (E, d, F) when num_local_experts > 0; muP's scalars: the
embeddings times embedding_multiplier, each branch times residual_multiplier, attention_multiplier the scores' scale,
the logits divided by logits_scaling. Its layer_types say mamba / attention (or linear_attention / full_attention)."""
import math

from ..config import RECURRENT_TYPES
from .record import ROPES, Record, attention_bias, stacked

INFINITE = (math.inf, {"__float__": "Infinity"})  # time_step_limit's open end, as transformers 4.x and 5.x write it


class GraniteMoeHybrid(Record):
    hf_class, model_type = "GraniteMoeHybridForCausalLM", "granitemoehybrid"
    may = ROPES | {"mamba", "nope", "attn_bias", "moe", "moe_shared", "embed_multiplier", "residual_multiplier",
                   "query_scalar", "logit_scale"}
    defaults = {"mamba_n_heads": 128, "mamba_n_groups": 1, "mamba_d_state": 256, "mamba_d_head": "auto",
                "mamba_d_conv": 4, "mamba_expand": 2, "mamba_chunk_size": 256, "mamba_conv_bias": True,
                "num_local_experts": 8, "num_experts_per_tok": 2, "shared_intermediate_size": 1024,
                "embedding_multiplier": 1.0, "residual_multiplier": 1.0, "attention_multiplier": 1.0,
                "logits_scaling": 1.0}
    fused = ("gate_up_proj",)
    renames = {"mlp.gate_up_proj": "shared_mlp.input_linear", "mlp.down_proj": "shared_mlp.output_linear"}
    mixers = {"mamba": "mamba"}
    types = {"linear_attention": "mamba", "attention": "full_attention"}

    def config(self, hf, get, n_layers):
        if get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={get('hidden_act')!r} is not supported (silu: Zoo's Mamba-2 layers)")
        low, high = get("time_step_limit") or (0.0, math.inf)
        heads, experts, shared = get("mamba_n_heads"), get("num_local_experts"), get("shared_intermediate_size")
        head = get("mamba_d_head")
        out = {"embed_multiplier": float(get("embedding_multiplier")), "logit_scale": 1 / get("logits_scaling"),
               "residual_multiplier": float(get("residual_multiplier")), **attention_bias(get),
               "query_pre_attn_scalar": get("attention_multiplier") ** -2.0,
               "nope_layers": [] if get("position_embedding_type") == "rope" else list(range(n_layers)),
               "recurrent": dict(n_heads=heads, head_dim=get("mamba_expand") * hf["hidden_size"] // heads
                                 if head == "auto" else head, state_size=get("mamba_d_state"),
                                 n_groups=get("mamba_n_groups"), conv_kernel=get("mamba_d_conv"),
                                 conv_bias=bool(get("mamba_conv_bias")), bias=bool(get("mamba_proj_bias")),
                                 chunk=get("mamba_chunk_size"),
                                 dt_min=float(low), dt_max=None if high in INFINITE else float(high))}
        if not hf.get("layer_types"):  # transformers' default: every layer Mamba-2
            out["layer_types"] = ["mamba"]
        if experts:
            out["moe"] = dict(n_experts=experts, expert_hidden=hf["intermediate_size"], n_shared=1,
                              shared_hidden=shared, norm_topk_prob=True)
        return out if experts else {**out, "ffn_hidden": shared}

    def to_hf(self, cfg):
        r, m = cfg.resolved_recurrent, cfg.moe
        return {"attention_bias": cfg.attn_out_bias, "embedding_multiplier": cfg.embed_multiplier,
                "residual_multiplier": cfg.residual_multiplier, "logits_scaling": 1 / cfg.logit_scale,
                "attention_multiplier": (cfg.query_pre_attn_scalar or cfg.resolved_head_dim) ** -0.5,
                "position_embedding_type": "nope" if cfg.nope_layers else "rope",
                "layer_types": ["mamba" if cfg.layer_type(i) == "mamba" else "attention" for i in range(cfg.n_layers)],
                "mamba_n_heads": r.n_heads, "mamba_d_head": r.head_dim, "mamba_expand": r.n_heads * r.head_dim //
                cfg.d_model, "mamba_d_state": r.state_size, "mamba_n_groups": r.n_groups, "mamba_d_conv": r.conv_kernel,
                "mamba_conv_bias": r.conv_bias, "mamba_proj_bias": r.bias, "mamba_chunk_size": r.chunk,
                "time_step_limit": [r.dt_min, r.dt_max or math.inf],
                "num_local_experts": m.n_experts if m else 0,
                "intermediate_size": cfg.resolved_expert_hidden if m else cfg.resolved_ffn_hidden,
                "shared_intermediate_size": m.n_shared * (m.shared_hidden or cfg.resolved_expert_hidden) if m
                else cfg.resolved_ffn_hidden}

    def refuses(self, cfg):
        r = cfg.resolved_recurrent
        attention = {i for i in range(cfg.n_layers) if cfg.layer_type(i) not in RECURRENT_TYPES}
        if cfg.nope_layers and attention - set(cfg.nope_layers):
            return "RoPE on every attention layer or on none"
        if "mamba" in cfg.layer_types and r.n_heads * r.head_dim % cfg.d_model:
            return "Mamba-2 layers as wide as a whole multiple of d_model (recurrent.n_heads x head_dim)"
        return "a shared MLP beside its experts (moe.n_shared)" if cfg.moe and not cfg.moe.n_shared else ""

    def experts(self, cfg, h):
        x = h + "block_sparse_moe."
        return {"router": x + "router.layer", "shared": h + "mlp.",
                "stacked": stacked(cfg, x + "input_linear.weight", x + "output_linear.weight")}
