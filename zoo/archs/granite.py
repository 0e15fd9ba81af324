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
    gguf, gguf_writes, gguf_fused = "granitehybrid", True, ()
    gguf_interleaved = True  # its converter permutes q/k rows as Llama's
    gguf_renames = {"mamba.dt_bias": "mamba.dt_proj.bias", "shared_mlp.output_linear": "mlp.down_proj"}

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

    def gguf_config(self, get, tensors):  # llama.cpp's: no kv heads on a Mamba-2 layer, its attention without RoPE
        kv, heads, n = get("attention.head_count_kv"), get("ssm.time_step_rank"), get("block_count")
        kv = kv if isinstance(kv, list) else [kv] * n
        ff = get("feed_forward_length")
        return {"layer_types": ["attention" if k else "mamba" for k in kv], "num_key_value_heads": max(kv),
                "position_embedding_type": "nope", "mamba_n_heads": heads, "mamba_d_head": get("ssm.inner_size") // heads,
                "mamba_d_state": get("ssm.state_size"), "mamba_n_groups": get("ssm.group_count"),
                "mamba_d_conv": get("ssm.conv_kernel"), "mamba_proj_bias": False,
                "mamba_conv_bias": any(name.endswith("ssm_conv1d.bias") for name in tensors),
                "attention_multiplier": get("attention.scale"), "embedding_multiplier": get("embedding_scale", 1.0),
                "residual_multiplier": get("residual_scale", 1.0), "logits_scaling": get("logit_scale", 1.0),
                "num_local_experts": get("expert_count", 0), "intermediate_size": ff,
                "shared_intermediate_size": get("expert_shared_feed_forward_length", ff)}

    def gguf_metadata(self, cfg):
        r, m = cfg.resolved_recurrent, cfg.moe
        return {"head_count_kv": [0 if cfg.layer_type(i) == "mamba" else cfg.resolved_n_kv_heads for i in range(cfg.n_layers)],
                "ssm_conv_kernel": r.conv_kernel, "ssm_state_size": r.state_size, "ssm_group_count": r.n_groups,
                "ssm_inner_size": r.n_heads * r.head_dim, "ssm_time_step_rank": r.n_heads,
                "attention_scale": (cfg.query_pre_attn_scalar or cfg.resolved_head_dim) ** -0.5,
                "embedding_scale": cfg.embed_multiplier, "residual_scale": cfg.residual_multiplier,
                "logit_scale": 1 / cfg.logit_scale, "rope_scaling_finetuned": False,
                "feed_forward_length": cfg.resolved_expert_hidden if m else cfg.resolved_ffn_hidden,
                "expert_shared_feed_forward_length": m.n_shared * (m.shared_hidden or cfg.resolved_expert_hidden) if m
                else cfg.resolved_ffn_hidden}

    def gguf_layout(self, cfg):
        """llama.cpp's Mamba-2 shapes: A and D as columns (H, 1), the gated norm's gain per group (G, width / G)."""
        r = cfg.resolved_recurrent
        inner = r.n_heads * r.head_dim
        return {"mamba.A_log": ((r.n_heads, 1), None, None), "mamba.D": ((r.n_heads, 1), None, None),
                "mamba.norm": ((r.n_groups, inner // r.n_groups), None, None)}

    def gguf_refuses(self, cfg):
        attention = {i for i in range(cfg.n_layers) if cfg.layer_type(i) not in RECURRENT_TYPES}
        return ("RoPE (its attention layers have none)" if attention - set(cfg.nope_layers) else
                "Mamba-2 projection biases" if cfg.resolved_recurrent.bias else super().gguf_refuses(cfg))
