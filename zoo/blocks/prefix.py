"""Prefix and prompt tuning: learned vectors prepended to a layer's own.

Papers: Li & Liang, "Prefix-Tuning: Optimizing Continuous Prompts for Generation" (2021); Lester et al., "The Power
of Scale for Parameter-Efficient Prompt Tuning" (2021).
`KVPrefix`: P learned key and value vectors per kv head, seen by every query, never rotated
(`attn.prefix = KVPrefix(...)` on attention.py's CausalSelfAttention).
`PromptEmbedding`: P learned input embeddings (virtual tokens) in front of the token embeddings; they run through
every layer at positions [0, P) like tokens, PEFT's prompt tuning.

Shapes: KVPrefix: k, v (B, KV, T, D) -> (B, KV, P + T, D). PromptEmbedding: x (B, T, D) -> (B, P + T, D).
"""
import torch
from torch import nn


def learned(*shape, std: float, device=None, dtype=None) -> nn.Parameter:
    if shape[-2] <= 0:
        raise ValueError(f"prefix length must be > 0, got {shape[-2]}")
    return nn.Parameter(torch.randn(*shape, device=device, dtype=dtype) * std)


def prepend(p: torch.Tensor, x: torch.Tensor, dim: int) -> torch.Tensor:
    """p (...) in front of every row of x (B, ...) along `dim`."""
    return torch.cat([p.to(x.dtype).expand(x.shape[0], *p.shape), x], dim=dim)


class KVPrefix(nn.Module):
    def __init__(self, n_kv_heads: int, length: int, head_dim: int, std: float = 0.02, device=None, dtype=None):
        super().__init__()
        self.k = learned(n_kv_heads, length, head_dim, std=std, device=device, dtype=dtype)
        self.v = learned(n_kv_heads, length, head_dim, std=std, device=device, dtype=dtype)

    def forward(self, k: torch.Tensor, v: torch.Tensor):
        return prepend(self.k, k, 2), prepend(self.v, v, 2)


class PromptEmbedding(nn.Module):
    def __init__(self, length: int, dim: int, std: float = 0.02, device=None, dtype=None):
        super().__init__()
        self.weight = learned(length, dim, std=std, device=device, dtype=dtype)

    @property
    def length(self) -> int:
        return self.weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return prepend(self.weight, x, 1)
