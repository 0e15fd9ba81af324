"""Prefix tuning: learned keys and values prepended to one attention layer's own.

Paper: Li & Liang, "Prefix-Tuning: Optimizing Continuous Prompts for Generation" (2021).
P learned key and value vectors per kv head, seen by every query, never rotated; only they train.
Use: `attn.prefix = KVPrefix(...)` on attention.py's CausalSelfAttention.

Shapes: k, v (B, KV, T, D) -> (B, KV, P + T, D).
"""
import torch
from torch import nn


class KVPrefix(nn.Module):
    def __init__(self, n_kv_heads: int, length: int, head_dim: int, std: float = 0.02, device=None, dtype=None):
        super().__init__()
        if length <= 0:
            raise ValueError(f"prefix length must be > 0, got {length}")
        self.k = nn.Parameter(torch.randn(n_kv_heads, length, head_dim, device=device, dtype=dtype) * std)
        self.v = nn.Parameter(torch.randn(n_kv_heads, length, head_dim, device=device, dtype=dtype) * std)

    def forward(self, k: torch.Tensor, v: torch.Tensor):
        pk, pv = (p.to(k.dtype).expand(k.shape[0], -1, -1, -1) for p in (self.k, self.v))  # (B, KV, P, D)
        return torch.cat([pk, k], dim=2), torch.cat([pv, v], dim=2)
