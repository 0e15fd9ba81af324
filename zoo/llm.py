"""Decoder-only transformer (Llama-style) built from zoo/blocks, with generate() on a KV cache.

    tokens -> embed -> n_layers x [x + attn(norm(x)); x + mlp(norm(x))] -> norm -> lm_head

Pre-norm RMSNorm, RoPE, grouped-query attention, SwiGLU; tied or untied embeddings; a chunked loss.
`config.moe`: Mixture-of-Experts MLPs (blocks/moe.py); `config.mod_capacity` > 0: Mixture-of-Depths
(blocks/mod.py), their statistics from `return_aux=True`. `config.layer_types`: recurrent layers (Gated DeltaNet,
Mamba-2, short convolutions) in place of attention, their state in the decoding cache. `doc_ids=` and `position_ids=` (B, T)
for packed documents. `mlp`, `value_embeds`, `unet_skips`, `zero_init_out`: the speedrun's ReLU^2 MLP, value
embeddings, U-net skips across blocks and zero-initialised output projections. `mup_base_width`: muP's logit
multiplier, attention scale and init (train/optim scales the hidden matrices' LR). How it trains and runs (attention,
checkpointing, MoE routing, losses' weights) is set outside.
"""
from __future__ import annotations

import contextlib
import functools
import math
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn
from .blocks.attention import CausalSelfAttention, KVCache
from .blocks.attention_docs import Documents, document_positions  # noqa: F401  (document_positions: part of the API)
from .blocks.attention_masked import KeyMask, MaskedKVCache
from .blocks.gated_deltanet import GatedDeltaNet
from .blocks.mamba2 import Mamba2
from .blocks.chunked_ce import chunked_cross_entropy, chunked_distillation_loss, compute_dtype, distillation_loss
from .blocks.lora import adapters_per_row
from .blocks.matvec_cpu import MatvecCPU, on_the_left, weight_on_the_left
from .blocks.mla import LatentKVCache, MultiHeadLatentAttention
from .blocks.mlp import ReLU2MLP, SwiGLU
from .blocks.mod import MixtureOfDepths
from .blocks.moe import MoE
from .blocks.norm import LayerNorm, RMSNorm
from .blocks.per_layer import PerLayerInput, PerLayerInputs
from .blocks.recurrent import StateCache
from .blocks.rope import RotaryEmbedding
from .blocks.short_conv import ShortConv
from .config import RECURRENT_TYPES, LLMConfig, check, to_dict


class Distill(NamedTuple):
    """A teacher's side of knowledge distillation for LLM.forward: its final hidden states (B, T, Dt)
    and LM head weight (V, Dt), the weight alpha of the KL term and the temperature."""
    hidden: torch.Tensor
    weight: torch.Tensor
    alpha: float
    temperature: float


def moe_block(cfg: LLMConfig) -> MoE:
    m = cfg.moe
    return MoE(cfg.d_model, cfg.resolved_expert_hidden, m.n_experts, m.top_k, m.scoring, m.norm_topk_prob,
               m.n_shared, m.shared_hidden, m.shared_gate, bias_balancing=m.balance == "bias", bias=m.bias,
               swiglu_limit=m.swiglu_limit, n_groups=m.n_groups, topk_groups=m.topk_groups, routed_scale=m.routed_scale,
               act=cfg.mlp_act, router_norm=m.router_norm, branch_norms=m.branch_norms, eps=cfg.norm_eps)


def mla_block(cfg: LLMConfig, layer: int = 0) -> MultiHeadLatentAttention:
    """Multi-head latent attention of `layer`; scores scaled as DeepSeek's YaRN does (mscale_all_dim)."""
    m, s = cfg.mla, cfg.rope_scaling
    scale = (m.nope_dim + m.rope_dim) ** -0.5
    if s is not None and s.type == "yarn" and s.mscale_all_dim and s.factor > 1:
        scale *= (0.1 * s.mscale_all_dim * math.log(s.factor) + 1) ** 2
    return MultiHeadLatentAttention(cfg.d_model, cfg.n_heads, m.kv_rank, m.rope_dim, m.nope_dim, m.v_dim, m.q_rank,
                                    cfg.norm_eps, scale, m.absorb,
                                    (m.index_heads, m.index_dim, m.index_topk) if cfg.indexer_at(layer) else None,
                                    max(i for i in range(layer) if cfg.indexer_at(i)) if layer in m.index_shared
                                    else None, layer)


def recurrent_block(cfg: LLMConfig, kind: str) -> nn.Module:
    """The recurrent mixer of a `kind` layer (config.RECURRENT_TYPES), sized by cfg.recurrent."""
    r, d = cfg.resolved_recurrent, cfg.d_model
    if kind == "conv":
        return ShortConv(d, r.conv_kernel, r.conv_bias)
    if kind == "mamba":
        return Mamba2(d, r.n_heads, r.head_dim, r.state_size, r.n_groups, r.conv_kernel, r.chunk, r.bias, r.conv_bias,
                      cfg.norm_eps, (r.dt_min, r.dt_max or math.inf))
    return GatedDeltaNet(d, r.n_heads, r.head_dim, r.n_v_heads, r.v_head_dim, r.conv_kernel, cfg.norm_eps, r.chunk)


class Block(nn.Module):
    n_extra = 1  # forward returns (x, one more item): what a skipping MixtureOfDepths returns in its place

    def __init__(self, cfg: LLMConfig, layer: int = 0):
        super().__init__()
        scalar = cfg.query_pre_attn_scalar

        def norm(where):  # a norm where norm_placement puts one, else nothing
            wanted = cfg.norm_placement == "sandwich" or cfg.norm_placement == where
            return norm_class(cfg)(cfg.d_model, cfg.norm_eps) if wanted else nn.Identity()
        self.parallel = cfg.parallel_block  # attention and MLP both read attn_norm's output
        self.attn_norm = norm("pre")
        self.recurrent = cfg.layer_type(layer) in RECURRENT_TYPES  # a recurrent `mixer` in place of `attn`
        if self.recurrent:
            self.mixer = recurrent_block(cfg, cfg.layer_type(layer))
        else:
            local, (n_kv, head_dim) = cfg.is_local(layer), cfg.attn_shape(layer)
            self.attn = mla_block(cfg, layer) if cfg.mla else CausalSelfAttention(
                cfg.d_model, cfg.n_heads, n_kv, head_dim, cfg.qkv_bias,
                sliding_window=cfg.sliding_window if local else None, qk_norm=cfg.qk_norm,
                norm_eps=cfg.norm_eps, rope=layer not in cfg.nope_layers,
                scale=1 / cfg.resolved_head_dim if cfg.mup_base_width else scalar ** -0.5 if scalar else None,
                softcap=cfg.attn_softcap, sinks=cfg.attn_sinks, out_bias=cfg.attn_out_bias, gate=cfg.attn_gate,
                kv=not cfg.kv_shared(layer), kv_same=cfg.global_kv_same and not local, v_norm=cfg.v_norm)
        self.attn_post_norm = norm("post")
        own_norms = cfg.is_sparse(layer) and cfg.moe.branch_norms  # the MoE norms its branches' inputs itself
        self.mlp_norm = nn.Identity() if self.parallel or own_norms else norm("pre")
        width = cfg.ffn_width(layer)
        self.mlp = moe_block(cfg) if cfg.is_sparse(layer) else ReLU2MLP(cfg.d_model, width) \
            if cfg.mlp == "relu2" else SwiGLU(cfg.d_model, width, act=cfg.mlp_act)
        self.mlp_post_norm = norm("post")
        self.per_layer = PerLayerInput(cfg.d_model, cfg.per_layer_dim, cfg.mlp_act, cfg.norm_eps) \
            if cfg.per_layer_dim else None  # its per-layer input joins after the MLP (blocks/per_layer.py)
        if cfg.layer_scalar:  # the block's output times it
            self.register_buffer("layer_scalar", torch.ones(1))
        self.attn_adapter = self.mlp_adapter = None  # bottleneck adapters on the two outputs (blocks/bottleneck.py)
        self.res = cfg.residual_multiplier  # the branches' outputs times it (1: left as they are)

    def forward(self, x, cos, sin, cache: Optional[KVCache] = None, start_pos: int = 0, key_mask=None, doc_ids=None,
                q_scale=None, ve=None, per_layer=None, shared=None):
        """-> (x, routing stats of a MoE block and the indexer's 'index_kl', or None). key_mask (B, T): the tokens attention
        may use as keys (a Mixture-of-Depths block in causal mode, blocks/attention_masked.py);
        doc_ids (B, T): attention within each document (blocks/attention_docs.py); q_scale: the
        queries' scale per position (latent attention, rope_scaling.query_beta); ve: added to the values; per_layer (B, T, P):
        this layer's per-layer input; shared: the keys and values KV-sharing layers read. A recurrent layer restarts its state
        where doc_ids change, or at a padded row's first real token (key_mask), and keeps it in `cache` (StateCache)."""
        h = self.attn_norm(x)
        if self.recurrent:
            a, state = self.mixer(h, None if cache is None else cache.read(), doc_ids if key_mask is None else key_mask.long())
            if cache is not None:
                cache.write(state)
        else:
            mask = KeyMask(key_mask, doc_ids) if key_mask is not None else Documents(doc_ids) if doc_ids is not None \
                else None
            extra = {k: v for k, v in (("q_scale", q_scale), ("ve", ve), ("shared", shared)) if v is not None}
            a = self.attn(h, cos, sin, cache, start_pos, mask, **extra)
        a, kl = a if isinstance(a, tuple) else (a, None)  # latent attention's output and its indexer's KL (index_loss)
        x = x + self.scaled(self.attn_post_norm(a if self.attn_adapter is None else self.attn_adapter(a)))
        y = self.mlp(h if self.parallel else self.mlp_norm(x))  # parallel: both branches read one norm's output
        y, stats = y if isinstance(self.mlp, MoE) else (y, None)
        x = x + self.scaled(self.mlp_post_norm(y if self.mlp_adapter is None else self.mlp_adapter(y)))
        x = x if self.per_layer is None else self.per_layer(x, per_layer)
        stats = stats if kl is None else {**(stats or {}), "index_kl": kl}
        return (x * self.layer_scalar if hasattr(self, "layer_scalar") else x), stats

    def scaled(self, branch: torch.Tensor) -> torch.Tensor:
        return branch if self.res == 1.0 else branch * self.res


def norm_class(cfg: LLMConfig) -> type:
    return LayerNorm if cfg.norm_type == "layer" else RMSNorm


class LLM(nn.Module):
    family = "llm"

    def __init__(self, cfg: LLMConfig):
        super().__init__()
        check(cfg)
        self.config = cfg
        # how the loss runs, not what it computes (train.chunked_loss, train.loss_chunk_size)
        self.chunked_loss = True            # never materialise the full B*T*V fp32 logits
        self.loss_chunk_size = 2048         # tokens per chunk of the chunked loss
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(
            MixtureOfDepths(Block(cfg, i), cfg.d_model, cfg.mod_capacity, cfg.mod_router) if cfg.is_mod(i)
            else Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = norm_class(cfg)(cfg.d_model, cfg.norm_eps)
        if cfg.per_layer_dim:  # every layer's own input (blocks/per_layer.py)
            self.per_layer = PerLayerInputs(cfg.per_layer_vocab or cfg.vocab_size, cfg.d_model, cfg.n_layers,
                                            cfg.per_layer_dim, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        if cfg.value_embeds:  # tables and the scalars mixing them into each layer's values (value_embed_layers)
            width = cfg.resolved_n_kv_heads * cfg.resolved_head_dim
            self.value_embeds = nn.ModuleList(nn.Embedding(cfg.vocab_size, width) for _ in range(cfg.value_embeds))
            self.value_lambdas = nn.Parameter(torch.empty(2 * cfg.value_embeds))
        if cfg.unet_skips:  # the weight of each first-half block's output in its mirrored block's input
            self.skip_weights = nn.Parameter(torch.empty(cfg.n_layers // 2))
        self.build_rope(cfg.max_seq_len)
        if cfg.moe is not None and cfg.moe.balance == "bias":  # choices since the last bias update
            n_sparse = sum(map(cfg.is_sparse, range(cfg.n_layers)))
            self.register_buffer("router_load", torch.zeros(n_sparse, cfg.moe.n_experts))
        # MoD decision logits since the last threshold update, kept only when keep_mod_decisions (train/ sets it)
        self.mod_decisions: list = []
        self.keep_mod_decisions = False
        self.prompt = None  # prompt tuning: learned input embeddings in front of each sequence (blocks/prefix.py)
        if self.embed.weight.device.type != "meta":  # a meta build (for loading) needs no init
            self.reset_parameters()

    def build_rope(self, length: int):
        """The RoPE tables (fp32, non-persistent), `length` positions to start with: `rope`, and `rope_local`
        for the local layers when they have a base (rope_theta_local) or a head width (global_head_dim) of their own."""
        cfg = self.config
        scaling = to_dict(cfg.rope_scaling) if cfg.rope_scaling else None
        wide = cfg.global_head_dim and cfg.mla is None  # the global layers' heads: rotated as wide, proportionally
        self.rope = RotaryEmbedding(int(cfg.global_head_dim * cfg.rotary_fraction) if wide else cfg.rotary_dim, length,
                                    cfg.rope_theta, scaling)
        own = cfg.rope_theta_local is not None
        self.rope_local = RotaryEmbedding(cfg.rotary_dim, length, cfg.rope_theta_local if own else cfg.rope_theta,
                                          None if own else scaling) if own or wide else None

    def reset_parameters(self, init_std: float = 0.02):
        """Normal(0, init_std) weights (the residual projections' / sqrt(2 n_layers)), unit norms, zero biases; under
        muP the hidden matrices' (all but the embeddings and the head) std x sqrt(base / d_model)."""
        hidden = init_std * math.sqrt(self.config.mup_ratio or 1.0)
        for name, p in self.named_parameters():
            if name.endswith(("norm.weight", "mlp.router_scale", "mlp.expert_scale")):
                nn.init.ones_(p)
            elif name.endswith(".bias"):
                nn.init.zeros_(p)
            elif name in ("skip_weights", "value_lambdas"):
                nn.init.constant_(p, 1.0 if name == "skip_weights" else 0.5)
            elif name.endswith(("A_log", "dt_bias", "mixer.D")):  # the recurrences' decays keep their blocks' init
                continue
            elif name.endswith(("attn.proj.weight", "mixer.out_proj.weight", "mlp.down.weight", "mlp.down",
                                "mlp.shared.down.weight")):
                nn.init.normal_(p, 0.0, 0.0 if self.config.zero_init_out else hidden / math.sqrt(2 * self.config.n_layers))
            else:
                nn.init.normal_(p, 0.0, hidden if p.dim() > 1 and not name.startswith(("embed.", "lm_head.", "value_embeds."))
                                else init_std)

    # ------------------------------------------------------------------ forward / loss
    def forward(self, input_ids: torch.Tensor, targets: Optional[torch.Tensor] = None,
                caches: Optional[list] = None, start_pos: int = 0, return_aux: bool = False,
                mod_causal: Optional[bool] = None, distill: Optional[Distill] = None,
                doc_ids: Optional[torch.Tensor] = None, position_ids: Optional[torch.Tensor] = None,
                key_mask: Optional[torch.Tensor] = None, inputs_embeds: Optional[torch.Tensor] = None):
        """input_ids (B, T) -> logits (B, T, V); with targets: (logits, loss), logits None under the chunked
        loss; `distill`: the distillation loss; return_aux=True appends `routing_aux`. mod_causal:
        MoD routes by the causal decision. doc_ids, position_ids (B, T): packed documents (not with caches).
        key_mask (B, T) bool: the tokens attention may use as keys (False: left padding; needs masked caches).
        inputs_embeds (B, T, D): the first layer's input in place of embed_tokens(input_ids) (a VLM's)."""
        B, T = input_ids.shape
        h, stats, mod_stats = self._trunk(input_ids, caches, start_pos, mod_causal, doc_ids, position_ids, key_mask,
                                          inputs_embeds)
        cap = self.config.final_softcap
        if targets is None:
            out = (self.logits(h),)
        elif cap is not None and (self.chunked_loss or distill is not None):
            raise ValueError(f"final_softcap={cap}: train with train.chunked_loss=false and without distillation "
                             f"(the chunked losses read the uncapped logits)")
        elif self.chunked_loss and distill is not None:
            out = (None, chunked_distillation_loss(h.reshape(B * T, -1), self.lm_head.weight, targets.reshape(B * T),
                                                   distill.hidden.reshape(B * T, -1), distill.weight, distill.alpha,
                                                   distill.temperature, self.loss_chunk_size))
        elif self.chunked_loss:
            out = (None, chunked_cross_entropy(h.reshape(B * T, -1), self.lm_head.weight, targets.reshape(B * T),
                                               self.loss_chunk_size))
        else:
            logits = self.logits(h)
            if distill is not None:
                loss = distillation_loss(logits.view(B * T, -1), distill.hidden.reshape(B * T, -1) @ distill.weight.t(),
                                         targets.reshape(B * T), distill.alpha, distill.temperature)
            else:
                loss = F.cross_entropy(logits.float().view(B * T, -1), targets.reshape(B * T), ignore_index=-100)
            out = (logits, loss)
        if return_aux:
            out = out + (self.routing_aux(stats, mod_stats),)
        return out[0] if len(out) == 1 else out

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final hidden states (B, T, D) -> logits (B, T, V), soft-capped at final_softcap c: c * tanh(z / c)."""
        head = self.lm_head  # without gradients, a plain head takes a CPU's faster matrix-vector route (decoding)
        plain = type(head) is nn.Linear and not torch.is_grad_enabled() and on_the_left(h, head.weight)
        z = weight_on_the_left(h, head.weight, head.bias) if plain else head(h)
        cap = self.config.final_softcap
        return z if cap is None else cap * torch.tanh(z / cap)

    def features(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids (B, T) -> the final norm's output (B, T, D), what the LM head reads (distillation)."""
        return self._trunk(input_ids, None, 0, None)[0]

    def hidden_states(self, input_ids: torch.Tensor, layers, key_mask: Optional[torch.Tensor] = None) -> list:
        """transformers' output_hidden_states[i] for each i in `layers` (B, T, D): 0 the embeddings, i the i-th
        layer's output, n_layers the final norm's. key_mask (B, T) bool: False on padding (a text encoder's)."""
        n, T, got = len(self.layers), input_ids.shape[1], {}
        if bad := [i for i in layers if not 0 <= i <= n]:
            raise ValueError(f"hidden state layers {bad} out of range: this model has layers 0..{n}")
        hooks = [self.layers[i - 1].register_forward_hook(lambda m, a, out, i=i: got.__setitem__(i, out[0][:, -T:]))
                 for i in set(layers) if 0 < i < n]
        try:
            got[n] = self._trunk(input_ids, None, 0, None, key_mask=key_mask)[0]
        finally:
            for h in hooks:
                h.remove()
        return [self.embed_tokens(input_ids) if i == 0 else got[i] for i in layers]

    def _trunk(self, input_ids, caches, start_pos: int, mod_causal: Optional[bool], doc_ids=None, position_ids=None,
               key_mask=None, inputs_embeds=None):
        """embed -> the layers -> the final norm: (h (B, T, D), MoE stats, MoD stats)."""
        B, T = input_ids.shape
        if doc_ids is not None and caches is not None:
            raise ValueError("doc_ids (document masking) is for forwards without caches; decoding runs one sequence")
        if key_mask is not None and self.config.mod_capacity > 0:
            raise ValueError("key_mask (padded rows) is not supported with Mixture-of-Depths layers")
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        n, ves = 0, self.value_embeddings(input_ids)
        per_layer = self.per_layer(input_ids, x) if self.config.per_layer_dim else None  # (B, T, L, P)
        if self.prompt is not None:
            x, start_pos, position_ids, key_mask, n = self.prompted(x, start_pos, position_ids, key_mask, doc_ids)
            T = x.shape[1]
            ves = {i: F.pad(v, (0, 0, n, 0)) for i, v in ves.items()}  # none for the virtual tokens
            per_layer = None if per_layer is None else F.pad(per_layer, (0, 0, 0, 0, n, 0))
        tables = self.rope_tables(x, T, start_pos, position_ids)
        stats, mod_stats = [], []
        q_scale = self.query_scale(position_ids, start_pos, T, x.device)
        causal = caches is not None if mod_causal is None else mod_causal
        if caches is not None and not causal and self.config.mod_capacity > 0:
            raise ValueError("decoding with caches needs mod_causal=True (the top-k of a sequence sees its future)")
        kw = {k: v for k, v in dict(start_pos=start_pos, doc_ids=doc_ids, key_mask=key_mask, q_scale=q_scale,
                                    shared={} if self.config.kv_shared_layers or self.config.mla else None).items()
              if v is not None}
        skips, L = [], len(self.layers)
        for i, layer in enumerate(self.layers):
            mod = {"causal": causal} if isinstance(layer, MixtureOfDepths) else {}
            mod.update({"ve": ves[i]} if i in ves else {})
            mod.update({"per_layer": per_layer[:, :, i]} if per_layer is not None else {})
            cache = None if caches is None else caches[i]
            if self.config.unet_skips and i >= L - L // 2:  # the mirrored first-half block's output joins
                x = x + self.skip_weights[L - 1 - i] * skips.pop()
            x, s, *m = layer(x, *tables[self.config.is_local(i)], cache=cache, **kw, **mod)
            if self.config.unet_skips and i < L // 2:
                skips.append(x)
            if s is not None:
                stats.append(s)
            mod_stats += m
        if self.training:
            self._record_routing(stats, mod_stats)
        return self.final_norm(x[:, n:]), stats, mod_stats

    # the trunk's ends, for a caller that runs the layers itself (a pipeline's stages)
    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids (B, T) -> the first layer's input (B, T, D)."""
        x, cfg = self.embed(input_ids), self.config
        x = x * torch.tensor(cfg.d_model ** 0.5, dtype=x.dtype) if cfg.embed_scale else x
        return x if cfg.embed_multiplier == 1.0 else x * cfg.embed_multiplier

    def value_embeddings(self, input_ids: torch.Tensor) -> dict:
        """{layer: what value embeddings add to its values (B, T, n_kv_heads * head_dim)}; empty when off."""
        layers = self.config.value_embed_layers()
        tables = [*self.value_embeds, *self.value_embeds] if layers else []
        return {i: lam * t(input_ids) for i, lam, t in zip(layers, self.value_lambdas if layers else [], tables)}

    def rope_tables(self, x: torch.Tensor, T: int, start_pos: int = 0, position_ids=None) -> list:
        """[(cos, sin) of the global layers, of the local ones] for T positions, in the dtype the layers compute in."""
        dtype = compute_dtype(x)
        return [rope(start_pos, T, dtype) if position_ids is None else rope.at(position_ids, dtype)
                for rope in (self.rope, self.rope_local or self.rope)]  # (T, D), or (B, T, D) per row

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        """The last layer's output -> what the LM head reads: the final norm, the logits' scale (and muP's) folded in."""
        h, scale = self.norm(x), self.config.logit_scale * (self.config.mup_ratio or 1.0)
        return h if scale == 1.0 else h * scale

    def prompted(self, x, start_pos, position_ids, key_mask, doc_ids):
        """Prompt tuning: the n virtual tokens at positions [0, n) in front of a sequence's first chunk (start_pos 0),
        every token's position moved up by n -> (x, start_pos, position_ids, key_mask, n prepended or 0)."""
        n, B = self.prompt.length, x.shape[0]
        if doc_ids is not None:
            raise ValueError("prompt tuning does not run on packed documents (doc_ids): the virtual tokens open one sequence")
        position_ids = None if position_ids is None else position_ids + n
        if torch.is_tensor(start_pos) or start_pos > 0:  # a later chunk: the virtual tokens are in the cache
            return x, start_pos + n, position_ids, key_mask, 0
        if position_ids is not None:
            position_ids = torch.cat([torch.arange(n, device=x.device).expand(B, n), position_ids], 1)
        if key_mask is not None:
            key_mask = torch.cat([key_mask.new_ones(B, n), key_mask], 1)
        return self.prompt(x), start_pos, position_ids, key_mask, n

    def query_scale(self, position_ids, start_pos, T: int, device) -> Optional[torch.Tensor]:
        """rope_scaling.query_beta's scale of the queries at each position, (T,) or (B, T); None when off."""
        s = self.config.rope_scaling
        if s is None or not s.query_beta:
            return None
        pos = position_ids if position_ids is not None else start_pos + torch.arange(T, device=device)
        return 1 + s.query_beta * torch.log1p(torch.floor(pos / s.original_max_position_embeddings))

    def routing_aux(self, stats: list, mod_stats: list) -> dict:
        """return_aux's statistics, unweighted (train/ weighs the losses): MoE 'lb_loss', 'z_loss', 'dropped' (L,),
        'load' (L, E); MoD 'mod_decision_loss' (the mean), 'mod_routed', 'mod_decided', 'mod_accuracy', 'mod_decide';
        the lightning indexers' 'index_kl' (the mean over layers, with their index_loss set)."""
        moe = [s for s in stats if "load" in s]
        aux = {k: torch.stack([s[k] for s in moe]) for k in ("lb_loss", "z_loss", "load", "dropped") if moe}
        if kl := [s["index_kl"] for s in stats if "index_kl" in s]:
            aux["index_kl"] = torch.stack(kl).mean()
        mod = [k for k in ("routed", "decided", "accuracy", "decide") if mod_stats and all(k in s for s in mod_stats)]
        aux.update({f"mod_{k}": torch.stack([s[k] for s in mod_stats]) for k in mod})
        if mod_stats:
            aux["mod_decision_loss"] = torch.stack([s["aux_loss"] for s in mod_stats]).mean()
        return aux

    # ------------------------------------------------------------------ Mixture-of-Depths
    @torch.no_grad()
    def _record_routing(self, stats: list, mod_stats: list):
        """A training forward keeps what the routing-state updates need, as BatchNorm keeps its statistics:
        the experts' load (`router_load`) and, when keep_mod_decisions, the MoD decision logits; the
        trainer applies them once per optimizer step (update_router_biases, update_mod_thresholds)."""
        if stats and hasattr(self, "router_load"):
            self.router_load += torch.stack([s["load"] for s in stats if "load" in s])
        if self.keep_mod_decisions and mod_stats and all("decide" in s for s in mod_stats):
            self.mod_decisions.append(torch.stack([s["decide"] for s in mod_stats]).detach())

    def take_mod_decisions(self) -> Optional[torch.Tensor]:
        """The decision logits (L, N, T) recorded since the last call (None: none), then forgotten."""
        d, self.mod_decisions = self.mod_decisions, []
        return torch.cat(d, dim=1) if d else None

    @torch.no_grad()
    def mod_boundaries(self, decide: torch.Tensor) -> torch.Tensor:
        """The top-k boundary (L,) of each MoD block in its decision logits (L, N, T) of a whole
        batch ('mod_decide', or those of every process of a data-parallel run, gathered)."""
        T = decide.shape[-1]
        return torch.stack([layer.boundary(d, layer.tokens_routed(T)) for layer, d in zip(self.mod_layers(), decide)])

    @torch.no_grad()
    def update_mod_thresholds(self, boundary: torch.Tensor, rate: float):
        """Move each MoD block's threshold toward `boundary` (L,) by the fraction `rate`, after every step."""
        for layer, b in zip(self.mod_layers(), boundary):
            layer.update_threshold(b, rate)

    def repeated_units(self) -> list:
        """The layers: what a data-parallel wrapper shards, and activation checkpointing applies to, one by one."""
        return list(self.layers)

    checkpoint_units = repeated_units

    def mod_layers(self) -> list:
        """The Mixture-of-Depths layers, in order."""
        return [layer for layer in self.layers if isinstance(layer, MixtureOfDepths)]

    def blocks(self) -> list:
        """The transformer blocks, unwrapped from their Mixture-of-Depths routing."""
        return [layer.block if isinstance(layer, MixtureOfDepths) else layer for layer in self.layers]

    # ------------------------------------------------------------------ MoE balancing by bias
    def moe_blocks(self) -> list:
        return [b.mlp for b in self.blocks() if isinstance(b.mlp, MoE)]

    @torch.no_grad()
    def update_router_biases(self, rate: float):
        """balance 'bias' (DeepSeek-V3): move each sparse layer's routing bias by `rate` toward uniform load from
        the choices recorded since the last update (a buffer, so a resume is exact), then reset them."""
        for block, load in zip(self.moe_blocks(), self.router_load):
            block.update_bias(load, rate)
        self.router_load.zero_()

    # ------------------------------------------------------------------ generation
    def new_caches(self, batch: int, max_len: int, device=None, dtype=None, masked: bool = False) -> list:
        """One cache per layer: keys and values (masked=True: also which keys are real, for padded rows), the
        compressed latents of latent attention, or a recurrent layer's state (StateCache)."""
        p, cfg = self.embed.weight, self.config
        device, dtype = device or p.device, dtype or p.dtype
        max_len += 0 if self.prompt is None else self.prompt.length  # the virtual tokens' keys and values
        if cfg.mla and masked:
            raise ValueError("left-padded rows (attention_mask) are not supported with multi-head latent attention")

        def cache(i, block):
            if block.recurrent:  # zeros shaped as the state after one token
                with torch.no_grad():
                    return StateCache(block.mixer(torch.zeros(batch, 1, cfg.d_model, device=device, dtype=p.dtype))[1])
            if cfg.mla:
                m = cfg.mla  # the latent, the shared RoPE key, the indexer's key
                return LatentKVCache(batch, max_len, m.kv_rank + m.rope_dim + m.index_dim * cfg.indexer_at(i), device,
                                     dtype)
            n_kv, head_dim = cfg.attn_shape(i)  # a KV-sharing layer reads another's: it holds none
            return (MaskedKVCache if masked or cfg.is_mod(i) else KVCache)(
                batch, n_kv, 0 if cfg.kv_shared(i) else max_len, head_dim, device, dtype)
        return [cache(i, b) for i, b in enumerate(self.blocks())]

    @torch.no_grad()  # not inference mode: FSDP2 reuses the buffers it gathers the weights into for training
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, temperature: float = 0.0,
                 top_k: Optional[int] = None, top_p: Optional[float] = None,
                 eos_token_id=None, generator=None, compile=False,
                 attention_mask: Optional[torch.Tensor] = None, stop_early: bool = True,
                 adapter_names: Optional[list] = None, inputs_embeds: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Extend input_ids (B, T) by max_new_tokens -> (B, T + max_new_tokens) on the KV cache. temperature 0: greedy,
        else sampling with top_k / top_p. eos_token_id: an id or a list of ids; a row stops at the first it produces
        and keeps emitting it, and decoding ends once every row has stopped (stop_early=False: it runs every step, as
        ranks that share each forward must). attention_mask (B, T), 0 on left padding: each row runs at its own
        positions and never attends to its padding. generator: one, or one per row (its draws then do not depend on
        the batch). compile=True runs each one-token step through torch.compile (`compiled_decode_step`);
        compile="reduce-overhead" through steps of fixed shapes that CUDA graphs replay (`static_decode_step`).
        adapter_names: the LoRA adapter of each row ('__base__': none), PEFT's mixed batches (lora.adapters_per_row).
        inputs_embeds (B, T, D): the prompt's first-layer input in place of its token embeddings (a VLM's)."""
        check_prompt(input_ids, self.config.vocab_size)
        was_training = self.training
        self.eval()
        B, T = input_ids.shape
        dev = input_ids.device
        dtype = torch.get_autocast_dtype(dev.type) if torch.is_autocast_enabled(dev.type) else None
        padded = attention_mask is not None and not bool(attention_mask.all())
        static = compile == "reduce-overhead"
        if static:
            self.check_static_decoding()
            caches = self.static_caches(B, T + max_new_tokens, dev, dtype or self.embed.weight.dtype, padded)
        else:
            caches = self.new_caches(B, T + max_new_tokens, dev, dtype, masked=padded)
        step = static_decode_step() if static else compiled_decode_step() if compile else decode_step
        real = attention_mask.bool() if padded else None
        kw = {"key_mask": real, "position_ids": (real.long().cumsum(1) - 1).clamp(min=0)} if padded else {}
        pos = kw["position_ids"][:, -1:] if padded else torch.full((B, 1), T - 1, device=dev)
        kw.update({} if inputs_embeds is None else {"inputs_embeds": inputs_embeds})
        stops = None if eos_token_id is None else torch.tensor(
            [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id), device=dev)
        out = input_ids.new_empty(B, max_new_tokens)
        done = torch.zeros(B, dtype=torch.bool, device=dev)
        with contextlib.nullcontext() if adapter_names is None else adapters_per_row(self, adapter_names):
            distinct = not adapter_names and inputs_embeds is None  # else equal ids are not equal rows
            logits = self.prefill(input_ids, caches, None if not distinct else
                                  lambda n: self.new_caches(n, T + max_new_tokens, dev, dtype, padded), **kw)
            one = {"key_mask": done.new_ones(B, 1)} if padded else {}
            slot = torch.tensor(T - 1, device=dev)  # the cache slot a step writes
            for i in range(max_new_tokens):
                nxt = sample_next(logits.float(), temperature, top_k, top_p, generator)
                if stops is not None:
                    nxt = torch.where(done, out[:, i - 1] if i else nxt, nxt)
                    done |= torch.isin(nxt, stops)
                out[:, i] = nxt
                if stops is not None and stop_early and bool(done.all()):
                    out[:, i + 1:] = nxt[:, None]
                    break
                if i + 1 < max_new_tokens:  # static: tensors of fixed addresses whose values move
                    pos, slot = (pos.add_(1), slot.add_(1)) if static else (pos + 1, T + i)
                    rows = {"position_ids": pos, **one} if static or padded else {}  # else: positions = slots
                    logits = step(self, nxt[:, None], caches, slot, **rows)
        self.train(was_training)
        return torch.cat([input_ids, out], dim=1)

    def prefill(self, input_ids: torch.Tensor, caches: list, new_caches, **kw) -> torch.Tensor:
        """The prompts' forward into `caches` -> the last logits (B, V). Rows equal to another (a prompt
        sampled several times) run once, into `new_caches(n)` for the n distinct rows, and are copied
        (new_caches None: every row runs)."""
        B = input_ids.shape[0]
        if new_caches is None:
            return self(input_ids, caches=caches, **kw)[:, -1]
        rows = torch.cat([input_ids, kw["key_mask"]], 1) if "key_mask" in kw else input_ids
        distinct, inv = torch.unique(rows, dim=0, return_inverse=True)
        if len(distinct) == B:
            return self(input_ids, caches=caches, **kw)[:, -1]
        ar = torch.arange(B, device=input_ids.device)
        first = ar.new_full((len(distinct),), B).scatter_reduce(0, inv, ar, "amin")  # a row of each
        few = new_caches(len(distinct))
        logits = self(input_ids[first], caches=few, **{k: v[first] for k, v in kw.items()})[:, -1]
        for cache, f in zip(caches, few):
            for big, small in zip(cache.buffers(), f.buffers()):
                big.copy_(small[inv])
        return logits[inv]

    def check_static_decoding(self):
        cfg = self.config
        why = ("multi-head latent attention" if cfg.mla else
               "Mixture-of-Depths" if cfg.mod_capacity > 0 else
               "prefix tuning" if any(getattr(m, "prefix", None) is not None for m in self.modules()) else None)
        if why:
            raise ValueError(f"compile='reduce-overhead' (decoding steps of fixed shapes) does not run {why}; "
                             f"use compile=True")

    def static_caches(self, batch: int, max_len: int, device, dtype, masked: bool = False) -> list:
        """KV caches kept from one static decoding to the next of the same shapes (a replayed CUDA graph
        reads and writes them at fixed addresses; what a previous decoding left is never attended)."""
        key = (batch, max_len, str(device), dtype, masked)
        if getattr(self, "_static_caches", (None,))[0] != key:
            caches = self.new_caches(batch, max_len, device, dtype, masked)
            for c in caches:
                for b in c.buffers():
                    torch._dynamo.mark_static_address(b)
            self._static_caches = (key, caches)
        return self._static_caches[1]

    # ------------------------------------------------------------------ accounting
    def num_params(self, non_embedding: bool = False, active: bool = False) -> int:
        """Parameters; active=True counts those one token uses (top_k of each MoE layer's experts)."""
        n = sum(p.numel() for p in self.parameters())
        if active:
            n -= sum((b.n_experts - b.top_k) * (b.gate_up[0].numel() + b.down[0].numel()) for b in self.moe_blocks())
        tables = [self.embed, *getattr(self, "value_embeds", [])]
        return n - sum(t.weight.numel() for t in tables) if non_embedding else n

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward): 6 * (matmul params) + attention (PaLM, 2022; recurrent layers:
        their matmuls only), with a MoE layer's routed experts only and a MoD block's matmuls at c = k / seq_len
        (attention at c^2)."""
        cfg = self.config
        n_matmul = self.num_params(non_embedding=True, active=True) + (self.embed.weight.numel() if cfg.tie_embeddings else 0)
        per_layer_attn = 12 * cfg.n_heads * cfg.resolved_head_dim * seq_len
        attn = 0.0
        for layer in self.layers:
            if getattr(layer, "recurrent", False):  # matmuls only (the scans' own work is not counted)
                continue
            if isinstance(layer, MixtureOfDepths):
                c = layer.tokens_routed(seq_len) / seq_len
                inner = sum(p.numel() for p in layer.block.parameters() if p.dim() > 1)
                if isinstance(layer.block.mlp, MoE):  # the experts a token is not routed to
                    b = layer.block.mlp
                    inner -= (b.n_experts - b.top_k) * (b.gate_up[0].numel() + b.down[0].numel())
                n_matmul -= (1 - c) * inner
                attn += per_layer_attn * c * c
            else:
                attn += per_layer_attn
        return 6 * n_matmul + attn


def decode_step(model: LLM, ids: torch.Tensor, caches: list, pos: int, **kw) -> torch.Tensor:
    """One decoding step: ids (B, 1) into cache slot pos -> next-token logits (B, V); fills the caches.
    kw: position_ids and key_mask (B, 1) of padded rows (LLM.generate). On a CPU the matrix-vector products take the
    faster routes of `MatvecCPU`: compiled, every one; in eager fp32 the output head's (`LLM.logits`), and the
    layers' through the mode only where they hold weights as large (its Python dispatch of every op costs more than
    the smaller products gain; elsewhere it gains nothing)."""
    w = model.embed.weight
    eager_fp32 = w.dtype == torch.float32 and not torch.is_autocast_enabled(w.device.type)
    faster = w.device.type == "cpu" and (torch.compiler.is_compiling() or eager_fp32 and any(
        p.numel() >= MatvecCPU.EAGER_NUMEL for p in model.layers.parameters()))
    with MatvecCPU() if faster else contextlib.nullcontext():
        return model(ids, caches=caches, start_pos=pos, **kw)[:, -1]


@functools.cache
def compiled_decode_step():
    """decode_step under torch.compile, the matrix-vector products as fused reductions on a CPU; a second
    position or cache length recompiles once with those sizes dynamic, and later calls reuse it."""
    return torch.compile(decode_step)


@functools.cache
def static_decode_step():
    """decode_step under torch.compile's reduce-overhead mode: the position a tensor, every cache slot
    attended with those past it masked, so every step has the same shapes and on a GPU one CUDA graph
    replays it (elsewhere it runs compiled, without graphs)."""
    return torch.compile(decode_step, mode="reduce-overhead", dynamic=False)


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """probs (B, V) -> (B, V) bool: each row's smallest set of most probable tokens whose mass reaches top_p (ties with
    its least probable one included). Only the values are sorted, as one flat integer sort (non-negative floats order
    as their bit patterns; a row's number above them): torch's CPU sort of float rows is many times slower."""
    B, V = probs.shape
    rows = torch.arange(B, device=probs.device)[:, None] << 32
    keys = (rows | probs.view(torch.int32).long()).flatten().sort().values.view(B, V)
    asc = (keys & 0xFFFF_FFFF).int().view(torch.float32)  # each row's probabilities, ascending
    cdf = asc.cumsum(-1)
    n = ((cdf[:, -1:] - cdf) < top_p).sum(-1, keepdim=True)  # how many have less than top_p above them
    return probs >= asc.gather(-1, V - n)


def check_prompt(input_ids: torch.Tensor, vocab_size: int):
    """generate()'s prompt must be (B, T) integer ids in [0, vocab_size), T >= 1: else one line saying which (the
    embedding's own errors name neither the shape nor the id)."""
    if input_ids.dim() != 2 or input_ids.shape[1] == 0 or input_ids.is_floating_point():
        raise ValueError(f"generate: input_ids must be (B, T) integer token ids, T >= 1; got {tuple(input_ids.shape)} "
                         f"{str(input_ids.dtype).removeprefix('torch.')}")
    lo, hi = int(input_ids.min()), int(input_ids.max())
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"generate: token id {lo if lo < 0 else hi} is outside the vocabulary [0, {vocab_size})")


def sample_next(logits: torch.Tensor, temperature: float = 0.0, top_k: Optional[int] = None,
                top_p: Optional[float] = None, generator=None, tries: int = 4) -> torch.Tensor:
    """logits (B, V) -> next token ids (B,). Sampling inverts each row's cumulative distribution (in the vocabulary's
    order) at a uniform draw from `generator` (a list: one per row). top_p: a token outside the nucleus is drawn again
    (exactly the nucleus's distribution, no sort), up to `tries` draws, then once more within the sorted nucleus."""
    if temperature <= 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    rows = torch.arange(probs.shape[0], device=probs.device)
    pick = inverse_cdf(probs, uniforms(generator, rows, probs.device))
    if top_p is None or top_p >= 1.0:
        return pick
    redraw, p = rows, probs
    for attempt in range(tries):  # the rows just drawn: is their token outside the nucleus?
        outside = torch.where(p > p.gather(1, pick[redraw, None]), p, 0.0).sum(-1) >= top_p
        redraw, p = redraw[outside], p[outside]
        if len(redraw) == 0:
            return pick
        inside = p if attempt + 1 < tries else p.masked_fill(~nucleus(p, top_p), 0.0)
        pick[redraw] = inverse_cdf(inside, uniforms(generator, redraw, probs.device))
    return pick


def uniforms(generator, rows: torch.Tensor, device) -> torch.Tensor:
    """One uniform draw for each of `rows`: from `generator`, or from each row's own of a list."""
    if isinstance(generator, (list, tuple)):
        return torch.cat([torch.rand(1, generator=generator[r], device=device) for r in rows.tolist()])
    return torch.rand(len(rows), generator=generator, device=device)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """probs (B, V), unnormalised, and uniforms u (B,) -> the token each row's cumulative sum puts u at."""
    cdf = probs.cumsum(-1)
    pick = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp(max=probs.shape[-1] - 1)
    return pick.squeeze(1)
