"""Attention restricted to the keys a layer processed: the causal decoding of Mixture-of-Depths.

Paper: Raposo et al., "Mixture-of-Depths: Dynamically allocating compute in transformer-based
language models" (2024). `KeyMask(key_mask)` is CausalSelfAttention's mask: no query sees a skipped
token's key (one with no key left to see sees its own: no empty rows); `MaskedKVCache` keeps the mask of its keys.
A right-padded row is transformers' padding: its padded queries see the real tokens only.

Shapes: q (B, H, Tq, D); k, v (B, KV, Tk, D); key_mask (B, Tk); doc_ids (B, Tq) -> (B, H, Tq, D).
Needs: attention.py, attention_docs.py, attention_cpu.py, rope.py, norm.py.
"""
from typing import Optional

import torch
import torch.nn.functional as F

try:
    from . import attention as A
    from .attention_docs import document_mask
except ImportError:  # copied beside attention.py and what it needs, outside the zoo package
    import attention as A
    from attention_docs import document_mask


class MaskedKVCache(A.KVCache):
    """A KV cache that also keeps `valid` (B, max_len) bool: the positions holding a processed key."""

    def __init__(self, batch: int, n_kv_heads: int, max_len: int, head_dim: int, device=None, dtype=None):
        super().__init__(batch, n_kv_heads, max_len, head_dim, device, dtype)
        self.register_buffer("valid", torch.zeros(batch, max_len, dtype=torch.bool, device=device), persistent=False)

    def update_mask(self, key_mask: torch.Tensor, start: int) -> torch.Tensor:
        """Record key_mask (B, T) at [start, start+T); return the mask of all positions up to start+T."""
        return A.write(self.valid, key_mask, start, 1)


class KeyMask(A.Causal):
    """The keys a layer may attend to, key_mask (B, Tk) bool, as CausalSelfAttention's `mask=`; with doc_ids
    (B, Tq), only those of a query's own document too. Runs as SDPA with a (B, 1, Tq, Tk) boolean mask."""

    def __init__(self, key_mask: torch.Tensor, doc_ids: Optional[torch.Tensor] = None):
        self.key_mask, self.doc_ids = key_mask, doc_ids

    def attend(self, q, k, v, backend="auto", window=None, softcap=None, sinks=None) -> torch.Tensor:
        Tq, Tk = q.shape[2], k.shape[2]
        own = A.attention_mask(Tq, Tk, 1, q.device)  # (Tq, Tk): each query's own position
        mask = A.attention_mask(Tq, Tk, window, q.device) & self.key_mask[:, None, :]  # (B, Tq, Tk)
        if self.doc_ids is not None:
            mask = mask & document_mask(self.doc_ids, Tk)
        mask = mask | (own & ~mask.any(-1, keepdim=True))
        return A.attend_within(q, k, v, mask, backend, window, softcap, sinks)

    def cached(self, cache, start) -> A.Causal:
        if not isinstance(cache, MaskedKVCache):
            raise ValueError("a key mask needs a MaskedKVCache, which keeps the mask of the keys it holds")
        held = cache.update_mask(self.key_mask, start)
        return A.Step(start, held) if isinstance(start, torch.Tensor) else KeyMask(held, self.doc_ids)

    def prefixed(self, n: int) -> "KeyMask":  # n keys in front that every query sees (a learned prefix)
        return KeyMask(F.pad(self.key_mask, (n, 0), value=True), self.doc_ids)
