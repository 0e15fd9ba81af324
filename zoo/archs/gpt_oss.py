"""GPT-OSS: biases on q/k/v/o, a learned sink logit per head in every softmax, local and global layers (one of
two global), and experts with biases and a clamped SwiGLU (swiglu_limit), stored stacked as (E, d, 2F) with
the gate and up columns interleaved and (E, F, d): a layout of their own."""
import torch

from .record import ROPES, Record, attention_bias


class GptOss(Record):
    hf_class, model_type = "GptOssForCausalLM", "gpt_oss"
    needs = frozenset({"moe", "moe_bias", "clamped_swiglu", "sinks", "attn_bias"})
    may = ROPES | {"window", "pattern"}
    defaults = {"max_position_embeddings": 131072, "num_key_value_heads": 8, "sliding_window": 128, "head_dim": 64,
                "rope_theta": 150000.0, "num_local_experts": 128, "num_experts_per_tok": 4, "swiglu_limit": 7.0,
                "attention_bias": True}
    window, period = "types", 2

    def config(self, hf, get, n_layers):
        if get("swiglu_alpha", 1.702) != 1.702:
            raise ValueError(f"swiglu_alpha={get('swiglu_alpha')} is not supported (1.702)")
        return {"attn_sinks": True, **attention_bias(get),
                "moe": dict(n_experts=get("num_local_experts"), norm_topk_prob=True, expert_hidden=hf["intermediate_size"],
                            bias=True, swiglu_limit=float(get("swiglu_limit")))}

    def to_hf(self, cfg):
        return {"sliding_window": cfg.sliding_window or cfg.max_seq_len, "attention_bias": True,
                "swiglu_limit": cfg.moe.swiglu_limit, "num_local_experts": cfg.moe.n_experts,
                "intermediate_size": cfg.resolved_expert_hidden}

    def experts(self, cfg, h):
        E, d, F = cfg.moe.n_experts, cfg.d_model, cfg.resolved_expert_hidden
        return {"router": h + "mlp.router", "stacked": ((h + "mlp.experts.gate_up_proj", (E, d, 2 * F)),
                                                         (h + "mlp.experts.down_proj", (E, F, d)))}

    @torch.no_grad()
    def layout(self, state, cfg, to_file):
        """gate_up_proj (E, d, 2F), gate and up columns interleaved, and down_proj (E, F, d) <-> Zoo's gate_up
        (E, 2F, d), gate rows first, and down (E, d, F); the gate_up bias interleaved too."""
        out = dict(state)
        for name, t in state.items():
            if name.endswith(("mlp.gate_up", "mlp.gate_up_bias")):  # Zoo's shape: (E, 2F, d) or (E, 2F)
                if to_file:  # rows gate, up -> interleaved, then (E, d, 2F)
                    t = torch.stack(t.unflatten(1, (2, t.shape[1] // 2)).unbind(1), dim=2).flatten(1, 2)
                    out[name] = t if t.dim() == 2 else t.transpose(1, 2).contiguous()
                else:  # the memory holds the file's (E, d, 2F)
                    t = t if t.dim() == 2 else t.view(t.shape[0], t.shape[2], t.shape[1]).transpose(1, 2)
                    out[name] = torch.cat([t[:, 0::2], t[:, 1::2]], dim=1).contiguous()
            elif name.endswith("mlp.down"):
                E, d, F = t.shape
                out[name] = t.transpose(1, 2).contiguous() if to_file else t.view(E, F, d).transpose(1, 2).contiguous()
        return out
