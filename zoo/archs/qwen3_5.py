"""Qwen3.5 (text): Gated DeltaNet layers (`linear_attention`) between full-attention layers whose output is gated by
a sigmoid of a second half of q_proj (per head: q, then its gate); per-head q/k RMSNorm; norms storing 1 + w (the
DeltaNet's gated norm a plain gain); RoPE on a quarter of each head by default (multimodal RoPE, which for text is
plain RoPE). Qwen3-Next: the same layers with a Qwen2-MoE-style sparse MLP (a shared expert behind a sigmoid
gate), its DeltaNet projections fused per key head (in_proj_qkvz: q, k, v, z; in_proj_ba: b, a). Qwen3.5-MoE (text):
Qwen3.5's layers with Qwen3-Next's sparse MLP in every layer, its top-k weights always renormalised."""
from .qwen import QWEN_MOE, qwen_moe, qwen_moe_to_hf
from .record import ROPES, Record, no_attention


class Qwen3_5(Record):
    hf_class, model_type = "Qwen3_5ForCausalLM", "qwen3_5_text"
    needs, may = frozenset({"linear_attention", "attn_gate", "qk_norm"}), ROPES | {"partial_rotary"}
    defaults = {"max_position_embeddings": 32768, "num_key_value_heads": 4, "head_dim": 256, "rope_theta": 1e4,
                "partial_rotary_factor": 0.25, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
                "linear_value_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32}
    norm_offset = 1.0
    mixers = {"linear_attention": "linear_attn"}
    gguf, gguf_writes = "qwen35", True
    gguf_renames = {"linear_attn.dt_bias": "linear_attn.dt_proj.bias"}

    def refuses(self, cfg):
        return no_attention(cfg)

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

    def gguf_config(self, get, tensors):  # every full_attention_interval-th layer full attention (llama.cpp's rule)
        every, heads = get("full_attention_interval", 4), get("ssm.time_step_rank")
        return {"layer_types": ["linear_attention" if (i + 1) % every else "full_attention"
                                for i in range(get("block_count"))],
                "linear_conv_kernel_dim": get("ssm.conv_kernel"), "linear_key_head_dim": get("ssm.state_size"),
                "linear_num_key_heads": get("ssm.group_count"), "linear_num_value_heads": heads,
                "linear_value_head_dim": get("ssm.inner_size") // heads}

    def gguf_metadata(self, cfg):
        r, every = cfg.resolved_recurrent, full_attention_interval(cfg)
        return {"ssm_conv_kernel": r.conv_kernel, "ssm_state_size": r.head_dim, "ssm_group_count": r.n_heads,
                "ssm_time_step_rank": r.n_v_heads or r.n_heads, "ssm_inner_size": r.head_dim * (r.n_v_heads or r.n_heads),
                "full_attention_interval": every, "rope_dimension_sections": sections(cfg.rotary_dim // 2)}

    def gguf_layout(self, cfg):
        """llama.cpp's value heads tiled (each key head's i-th value head together) rather than grouped by key head:
        the v rows of in_proj_qkv and the convolution, in_proj_z, in_proj_b / a, A_log, dt_bias, out_proj's columns."""
        r = cfg.resolved_recurrent
        K, Dk, Hv, Dv = r.n_heads, r.head_dim, r.n_v_heads or r.n_heads, r.v_head_dim or r.head_dim
        if K == Hv:
            return {}
        qk = list(range(2 * K * Dk))
        v, one, a = [2 * K * Dk + i for i in tiled(K, Hv // K, Dv)], tiled(K, Hv // K, 1), "linear_attn."
        rows = {"in_proj_qkv": qk + v, "conv1d": qk + v, "in_proj_z": tiled(K, Hv // K, Dv), "in_proj_b": one,
                "in_proj_a": one, "A_log": one, "dt_bias": one}
        return {a + "out_proj": (None, None, tiled(K, Hv // K, Dv)),
                **{a + name: (None, order, None) for name, order in rows.items()}}

    def gguf_refuses(self, cfg):
        r = cfg.resolved_recurrent
        return ("value heads of another width than the key heads" if (r.v_head_dim or r.head_dim) != r.head_dim else
                "layer pattern but one full attention layer every n" if not full_attention_interval(cfg) else "")


class Qwen3Next(Qwen3_5):
    hf_class, model_type = "Qwen3NextForCausalLM", "qwen3_next"
    gguf = "qwen3next"
    needs = Qwen3_5.needs | {"moe", "moe_shared", "moe_shared_gate"}
    may = QWEN_MOE | {"partial_rotary"}
    defaults = {**Qwen3_5.defaults, "head_dim": 256, "num_key_value_heads": 2, "num_experts": 512,
                "num_experts_per_tok": 10, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
                "norm_topk_prob": True, "decoder_sparse_step": 1}

    def config(self, hf, get, n_layers):
        return {**super().config(hf, get, n_layers), "moe": qwen_moe(hf, get, n_layers)}

    def to_hf(self, cfg):
        return {**super().to_hf(cfg), **qwen_moe_to_hf(cfg)}

    def split_rows(self, cfg):
        r = cfg.resolved_recurrent
        K, Dk, Dv = r.n_heads, r.head_dim, r.v_head_dim or r.head_dim
        vr = (r.n_v_heads or K) // K  # value heads per key head
        qkvz, ba, a = (Dk, Dk, vr * Dv, vr * Dv), (vr, vr), "linear_attn."
        return {a + "in_proj_qkv.weight": (a + "in_proj_qkvz.weight", grouped(K, qkvz, 0, 1, 2)),
                a + "in_proj_z.weight": (a + "in_proj_qkvz.weight", grouped(K, qkvz, 3)),
                a + "in_proj_b.weight": (a + "in_proj_ba.weight", grouped(K, ba, 0)),
                a + "in_proj_a.weight": (a + "in_proj_ba.weight", grouped(K, ba, 1))}

    def gguf_split_rows(self, cfg, found=()):
        """llama.cpp's converter splits in_proj_qkvz into attn_qkv and attn_gate; its files before kept it whole
        (ssm_in), as transformers does."""
        legacy = any(name.endswith(".ssm_in.weight") for name in found)
        return {k: v for k, v in self.split_rows(cfg).items() if legacy or "in_proj_ba" in v[0]}

    def gguf_layout(self, cfg):  # value heads grouped by key head, as in the file
        return {}

    def gguf_config(self, get, tensors):
        return {**super().gguf_config(get, tensors), **gguf_moe(get), "norm_topk_prob": True, "decoder_sparse_step": 1}

    def gguf_refuses(self, cfg):
        m = cfg.moe
        return super().gguf_refuses(cfg) or ("dense layers" if m.dense_layers or m.sparse_every > 1 else
                                             "unnormalised top-k weights" if not m.norm_topk_prob else "")


class Qwen3_5Moe(Qwen3_5):
    hf_class, model_type = "Qwen3_5MoeForCausalLM", "qwen3_5_moe_text"
    gguf = "qwen35moe"
    needs = Qwen3Next.needs
    defaults = {**Qwen3_5.defaults, "num_key_value_heads": 2, "num_experts": 256, "num_experts_per_tok": 8,
                "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "norm_topk_prob": True,
                "decoder_sparse_step": 1, "intermediate_size": None}  # no dense MLP: no intermediate_size

    def config(self, hf, get, n_layers):
        return {**super().config(hf, get, n_layers), "moe": qwen_moe(hf, get, n_layers)}

    def to_hf(self, cfg):
        moe = {k: v for k, v in qwen_moe_to_hf(cfg).items()
               if k not in ("norm_topk_prob", "decoder_sparse_step", "mlp_only_layers")}  # keys it does not have
        return {**super().to_hf(cfg), **moe}

    def gguf_config(self, get, tensors):
        return {**super().gguf_config(get, tensors), **gguf_moe(get), "intermediate_size": None}

    def gguf_metadata(self, cfg):  # no dense MLP: no feed_forward_length
        return {**super().gguf_metadata(cfg), "feed_forward_length": None}


def gguf_moe(get) -> dict:
    """The config.json keys of a Qwen MoE's experts from llama.cpp's expert_* metadata."""
    return {"num_experts": get("expert_count"), "moe_intermediate_size": get("expert_feed_forward_length"),
            "shared_expert_intermediate_size": get("expert_shared_feed_forward_length")}


def grouped(groups: int, sizes: tuple, *parts: int) -> list:
    """The rows of `parts` (each over all groups, in turn) in a tensor of `groups` groups of rows of `sizes` each."""
    return [g * sum(sizes) + sum(sizes[:p]) + i for p in parts for g in range(groups) for i in range(sizes[p])]


def tiled(groups: int, per_group: int, size: int) -> list:
    """Where each row of `groups` groups of `per_group` heads of `size` rows lies once the heads are tiled (the first
    head of every group, then the second, ...): grouped = tiled[order]."""
    return [j * groups * size + g * size + i for g in range(groups) for j in range(per_group) for i in range(size)]


def sections(pairs: int) -> list:
    """Multimodal RoPE's sections (time, height, width, none) over `pairs` rotated pairs, the way Qwen3.5 splits them;
    text has one position on every axis, so any split turns it alike."""
    return [pairs - 2 * (pairs // 3), pairs // 3, pairs // 3, 0]


def full_attention_interval(cfg) -> int:
    """n when every n-th layer (and only it) is full attention, else 0."""
    every = next((i + 1 for i in range(cfg.n_layers) if cfg.layer_type(i) == "full_attention"), cfg.n_layers + 1)
    full = [(i + 1) % every == 0 for i in range(cfg.n_layers)]
    return every if full == [cfg.layer_type(i) == "full_attention" for i in range(cfg.n_layers)] else 0
