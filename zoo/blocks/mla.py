"""Multi-head latent attention (MLA) with its compressed KV cache.

Paper: DeepSeek-AI, "DeepSeek-V2: A Strong, Economical, and Efficient Mixture-of-Experts Language Model" (2024), used
by DeepSeek-V3. Queries through an optional low-rank bottleneck (q_a, RMSNorm, q_b); keys and values from one latent c
(kv_rank wide, RMS-normalised) expanded per head by kv_b into a no-RoPE key part and the value; a RoPE key part
(rope_dim) shared by all heads comes straight from x. The cache holds only c and the rotated shared key: kv_rank +
rope_dim numbers per token instead of 2 * H * D. Scores (q_nope . k_nope + q_rope . k_rope) * scale; RoPE in the
rotate-half layout (rope.py). With `absorb`, the steps on a cache fold kv_b into the attention (DeepSeek-V2's section
2.1.3): the query's no-RoPE part times each head's key matrix W_UK is a query in the latent space, the attention runs
on the cached latents, and each head's value matrix W_UV maps its output back (the same numbers, nothing expanded).
`index`: DeepSeek Sparse Attention (DeepSeek-AI, "DeepSeek-V3.2", 2025): a lightning indexer scores every key for each
query, sum_h w_h relu(q_h . k) with a single-head key (LayerNorm, RoPE on its first rope_dim channels) and queries
from the query bottleneck, and each query attends only to its `topk` best keys (the indexer's key is cached beside the
latent; the attention runs over every cached key with the others masked). The indexer reads its inputs detached,
so that only its own loss trains it: with `index_loss` set, a training forward also returns `index_kl`, the KL from the
attention's distribution (its probabilities summed over heads, L1-normalised) to the softmax of the index scores over
the keys attended (the report's continued pre-training); `dense` attends to every key (its dense warm-up).
`reuse_index`: a layer with no indexer of its own keeps the keys indexer layer `reuse_index` chose (GLM-5's "shared"
layers; Z.ai, "GLM-5", 2026), read from the `shared` dict under that layer's number (so a recomputed forward, under
activation checkpointing, reads the same choice).

Shapes: x (B, T, dim) -> (B, T, dim); cos, sin (T, rope_dim) or (B, T, rope_dim); cache (B, max_len, kv_rank +
rope_dim (+ the indexer's head width)).
Needs: norm.py, rope.py.
"""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

try:
    from .norm import RMSNorm
    from .rope import apply_rope
except ImportError:  # copied next to norm.py and rope.py, outside the zoo package
    from norm import RMSNorm
    from rope import apply_rope


class LatentKVCache(nn.Module):
    """Preallocated latents of one MLA layer: (B, max_len, kv_rank + rope_dim)."""

    def __init__(self, batch: int, max_len: int, width: int, device=None, dtype=None):
        super().__init__()
        self.register_buffer("c", torch.zeros(batch, max_len, width, device=device, dtype=dtype), persistent=False)

    def update(self, c: torch.Tensor, start: int) -> torch.Tensor:
        """Write c (B, T, width) at [start, start+T); return the latents up to start+T."""
        end = start + c.shape[1]
        if end > self.c.shape[1]:
            raise ValueError(f"KV cache holds {self.c.shape[1]} positions, asked to write up to {end}")
        self.c[:, start:end] = c
        return self.c[:, :end]


class LightningIndexer(nn.Module):
    """x (B, T, dim), the query bottleneck's output (B, T, q_rank) and the cached indexer keys (B, Tk, head_dim) ->
    which keys each query keeps (B, T, Tk) bool: its `topk` best of those causality allows (all when fewer)."""

    def __init__(self, dim: int, q_rank: int, n_heads: int, head_dim: int, rope_dim: int, topk: int):
        super().__init__()
        self.n_heads, self.head_dim, self.rope_dim, self.topk = n_heads, head_dim, rope_dim, topk
        self.q = nn.Linear(q_rank, n_heads * head_dim, bias=False)
        self.k = nn.Linear(dim, head_dim, bias=False)
        self.k_norm = nn.LayerNorm(head_dim, eps=1e-6)
        self.weights = nn.Linear(dim, n_heads, bias=False)

    def key(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        k = self.k_norm(self.k(x))
        return torch.cat([apply_rope(k[..., :self.rope_dim], cos, sin), k[..., self.rope_dim:]], dim=-1)

    def forward(self, x, q_low, k, cos, sin, causal: torch.Tensor) -> torch.Tensor:
        """-> the index scores (B, T, Tk), fp32, -inf where `causal` (T, Tk) is False."""
        B, T, _ = x.shape
        q = self.q(q_low).view(B, T, self.n_heads, self.head_dim)
        q = torch.cat([apply_rope(q[..., :self.rope_dim], cos.unsqueeze(-2), sin.unsqueeze(-2)), q[..., self.rope_dim:]], -1)
        scores = (q.float() @ k.float().transpose(1, 2)[:, None] * self.head_dim ** -0.5).relu()  # (B, T, h, Tk)
        w = self.weights(x).float() * self.n_heads ** -0.5
        return (w[..., None, :] @ scores).squeeze(-2).masked_fill(~causal, float("-inf"))

    def select(self, index: torch.Tensor, causal: torch.Tensor) -> torch.Tensor:
        """The index scores (B, T, Tk) -> which keys each query keeps (B, T, Tk) bool."""
        top = index.topk(min(self.topk, index.shape[-1]), dim=-1).indices
        return torch.zeros_like(index, dtype=torch.bool).scatter_(-1, top, True) & causal


def index_kl(p: torch.Tensor, index: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """The mean over queries of KL(p || softmax(index)) over the kept keys: p the target distribution (B, T, Tk), zero
    outside `keep` (B, T, Tk) bool; index the index scores (B, T, Tk)."""
    log_q = index.masked_fill(~keep, float("-inf")).log_softmax(-1).masked_fill(~keep, 0.0)
    return (torch.xlogy(p, p) - p * log_q).sum(-1).mean()


class MultiHeadLatentAttention(nn.Module):
    def __init__(self, dim: int, n_heads: int, kv_rank: int, rope_dim: int, nope_dim: int, v_dim: int,
                 q_rank: Optional[int] = None, norm_eps: float = 1e-6, scale: Optional[float] = None,
                 absorb: bool = False, index: Optional[tuple] = None, reuse_index: Optional[int] = None,
                 layer: int = 0):
        """index: (heads, head width, top-k) of a lightning indexer (needs q_rank); None: every key, or, with
        reuse_index, the keys indexer layer `reuse_index` kept. layer: this layer's number (where its choice is left)."""
        super().__init__()
        self.indexer = LightningIndexer(dim, q_rank, *index[:2], rope_dim, index[2]) if index else None
        self.reuse_index, self.layer = None if self.indexer is not None else reuse_index, layer
        self.n_heads, self.kv_rank, self.rope_dim, self.nope_dim, self.v_dim = n_heads, kv_rank, rope_dim, nope_dim, v_dim
        self.absorb = absorb  # with a cache: attend over the latents, kv_b folded into q and the output
        self.index_loss = self.dense = False  # training forwards return (y, index_kl); attend to every key
        self.scale = scale if scale is not None else (nope_dim + rope_dim) ** -0.5
        qk = n_heads * (nope_dim + rope_dim)
        self.q_a = nn.Linear(dim, q_rank, bias=False) if q_rank else None
        self.q_norm = RMSNorm(q_rank, norm_eps) if q_rank else None
        self.q_b = nn.Linear(q_rank or dim, qk, bias=False)
        self.kv_a = nn.Linear(dim, kv_rank + rope_dim, bias=False)
        self.kv_norm = RMSNorm(kv_rank, norm_eps)
        self.kv_b = nn.Linear(kv_rank, n_heads * (nope_dim + v_dim), bias=False)
        self.proj = nn.Linear(n_heads * v_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: Optional[LatentKVCache] = None, start_pos: int = 0, mask=None,
                q_scale: Optional[torch.Tensor] = None, shared: Optional[dict] = None) -> torch.Tensor:
        """x (B, T, dim) at positions [start_pos, start_pos + T); causal attention over the cache. q_scale (T,) or
        (B, T): each position's queries times it (Llama 4's attention temperature, Mistral 4). shared: where an
        indexer layer leaves its selection (under ('index', its layer)) for the `reuse_index` layers after it."""
        if mask is not None:
            raise ValueError("multi-head latent attention takes no narrower mask (packed documents, Mixture-of-Depths)")
        B, T, _ = x.shape
        H, R = self.n_heads, self.rope_dim
        q_low = self.q_norm(self.q_a(x)) if self.q_a is not None else x
        q = self.q_b(q_low).view(B, T, H, self.nope_dim + R)
        if q_scale is not None:
            q = q * q_scale[..., None, None].to(q.dtype)
        q_rope = apply_rope(q[..., self.nope_dim:], cos.unsqueeze(-2), sin.unsqueeze(-2))
        c, k_rope = self.kv_a(x).split([self.kv_rank, R], dim=-1)
        k_rope = apply_rope(k_rope, cos, sin)
        latent = torch.cat([self.kv_norm(c), k_rope], dim=-1)
        index = [] if self.indexer is None else [self.indexer.key(x.detach(), cos, sin)]  # apart: no gradient crosses
        if cache is not None:  # it keeps the latent, the shared RoPE key and the indexer's key
            widths = [self.kv_rank + R] + [k.shape[-1] for k in index]
            latent, *index = cache.update(torch.cat([latent, *index], dim=-1), start_pos).split(widths, dim=-1)
        Tk = latent.shape[1]
        mask = None if T in (1, Tk) else torch.ones(T, Tk, dtype=torch.bool, device=x.device).tril(Tk - T)
        if self.indexer is not None:  # each query's top-k keys, within the causal mask
            causal = torch.ones(T, Tk, dtype=torch.bool, device=x.device).tril(Tk - T) if mask is None else mask
            scores = self.indexer(x.detach(), q_low.detach(), index[0], cos, sin, causal)
            mask = (causal.expand_as(scores) if self.dense else self.indexer.select(scores, causal))[:, None]
            if shared is not None:
                shared["index", self.layer] = mask
        elif self.reuse_index is not None:
            if ("index", self.reuse_index) not in (shared or {}):
                raise ValueError(f"this layer keeps the keys indexer layer {self.reuse_index} chose: run that layer "
                                 f"first, in the same forward")
            mask = shared["index", self.reuse_index]
        if cache is not None and self.absorb:
            return self.proj(self._absorbed(q[..., :self.nope_dim], q_rope, latent, mask).reshape(B, T, H * self.v_dim))
        c, k_rope = latent.split([self.kv_rank, R], dim=-1)
        k_nope, v = self.kv_b(c).view(B, Tk, H, self.nope_dim + self.v_dim).split([self.nope_dim, self.v_dim], dim=-1)
        q = torch.cat([q[..., :self.nope_dim], q_rope], dim=-1).transpose(1, 2)  # (B, H, T, Dqk)
        k = torch.cat([k_nope, k_rope[:, :, None].expand(B, Tk, H, R)], dim=-1).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v.transpose(1, 2), scale=self.scale, is_causal=T == Tk and mask is None,
                                           attn_mask=mask)
        y = self.proj(y.transpose(1, 2).reshape(B, T, H * self.v_dim))
        if not (self.index_loss and self.training and self.indexer is not None):
            return y
        with torch.no_grad():  # the target: the attention's probabilities summed over heads, L1-normalised
            p = (q.float() @ k.float().transpose(-1, -2) * self.scale).masked_fill(~mask, float("-inf")).softmax(-1)
        return y, index_kl(p.mean(1), scores, mask[:, 0])

    def _absorbed(self, q_nope, q_rope, latent, mask) -> torch.Tensor:
        """Attention in the latent space: q_nope (B, T, H, nope), q_rope (B, T, H, rope), latent (B, Tk, kv_rank +
        rope) -> (B, T, H, v_dim). The latent serves as every head's key, its first kv_rank channels as the value."""
        B, T, H, _ = q_nope.shape
        w = self.kv_b.weight.view(H, self.nope_dim + self.v_dim, self.kv_rank)
        q = torch.cat([torch.einsum("bthn,hnc->bthc", q_nope, w[:, :self.nope_dim]), q_rope], dim=-1).transpose(1, 2)
        k = latent[:, None].expand(B, H, *latent.shape[1:])
        y = F.scaled_dot_product_attention(q, k, k[..., :self.kv_rank], scale=self.scale,
                                           is_causal=T == latent.shape[1] and mask is None, attn_mask=mask)
        return torch.einsum("bhtc,hvc->bthv", y, w[:, self.nope_dim:])
