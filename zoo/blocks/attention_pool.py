"""Multi-head attention pooling (MAP): a learned latent query attends over the tokens, then a residual MLP.

Papers: Lee et al., "Set Transformer" (2019: pooling by multi-head attention); Zhai et al., "Sigmoid Loss for
Language Image Pre-Training" (SigLIP, 2023) and "Scaling Vision Transformers" (2022) pool images with it.

    q = W_q latent;  k, v = W_kv x;  y = W_proj attention(q, k, v);  y = y + mlp(norm(y))

Names are timm's AttentionPoolLatent's (latent, q, kv, proj, norm, mlp); the MLP is passed in (its names fc1, fc2 in
timm's). Shapes: x (B, N, D), mask (B, N) true where a token counts -> (B, D).
"""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


class AttentionPool(nn.Module):
    """One learned query over the tokens: (B, N, D) -> (B, D)."""

    def __init__(self, dim: int, heads: int, mlp: nn.Module, eps: float = 1e-6):
        super().__init__()
        if dim % heads:
            raise ValueError(f"heads={heads} must divide the width {dim}")
        self.heads = heads
        self.latent = nn.Parameter(torch.zeros(1, 1, dim))
        self.q, self.kv, self.proj = nn.Linear(dim, dim), nn.Linear(dim, 2 * dim), nn.Linear(dim, dim)
        self.norm, self.mlp = nn.LayerNorm(dim, eps=eps), mlp

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        B, N, D = x.shape
        q = self.q(self.latent).view(1, 1, self.heads, -1).transpose(1, 2).expand(B, -1, -1, -1)
        k, v = self.kv(x).view(B, N, 2, self.heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None if mask is None else mask[:, None, None, :])
        y = self.proj(y.transpose(1, 2).reshape(B, D))
        return y + self.mlp(self.norm(y))
