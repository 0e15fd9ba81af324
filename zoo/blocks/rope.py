"""Rotary position embedding (RoPE) with optional 'linear' and 'llama3' frequency scaling.

Paper: Su et al., "RoFormer: Enhanced Transformer with Rotary Position Embedding" (2021).
Scaling: 'linear' = Chen et al., "Extending Context Window of Large Language Models via
Positional Interpolation" (2023); 'llama3' = the wavelength-dependent rule of Llama 3.1
(Meta, "The Llama 3 Herd of Models", 2024).
The "rotate-half" layout (channel i paired with i + D/2), as Hugging Face's: no weight permutation.

Shapes: inv_freq (D/2,); cos, sin (T, D), or (B, T, D) for a row of positions per sequence
(`RotaryEmbedding.at`); x (B, H, T, D) -> (B, H, T, D) (or (B, T, H, D) with cos, sin (T, 1, D)).
Depends on torch only.
"""
import math
from typing import Optional

import torch
from torch import nn


def rope_inv_freq(head_dim: int, theta: float = 10000.0, scaling: Optional[dict] = None) -> torch.Tensor:
    """Inverse frequencies theta^(-2i/D), i < D/2, in fp32, with the scaling rule applied. scaling: None,
    or {'type': 'linear' | 'llama3', 'factor'} and for llama3 'low_freq_factor', 'high_freq_factor',
    'original_max_position_embeddings'."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv_freq
    kind, factor = scaling["type"], float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor
    if kind == "llama3":
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        # long wavelengths divided by factor, short ones kept, the band between interpolated
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_mid, mid, scaled)
    raise ValueError(f"unknown rope scaling type {kind!r} (supported: 'linear', 'llama3')")


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor):
    """cos, sin tables of shape (T, D) for integer positions (T,), computed in fp32."""
    freqs = torch.outer(positions.float(), inv_freq.float())  # (T, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (T, D)
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) on the two halves of the last dim (the reference form of RoPE)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (..., T, D) by the angles in cos/sin (T, D) (or anything broadcasting, e.g. (T, 1, D) for
    x (B, T, H, D)); returns x's dtype. Eagerly x * cos + roll(x, D/2) * [-sin, sin] (fewer kernels);
    under torch.compile the two halves as one (..., 2, D/2) view, which inductor vectorises."""
    half = x.shape[-1] // 2
    if torch.compiler.is_compiling():
        x1, x2 = x.unflatten(-1, (2, half)).unbind(-2)
        c, s = cos[..., :half], sin[..., :half]  # both halves use the same angles
        return torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-2).flatten(-2).to(x.dtype)
    signed_sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)  # tiny: (T, D)
    return torch.addcmul(x * cos, x.roll(half, dims=-1), signed_sin).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """Holds inv_freq and a cos/sin cache for positions [0, max_seq_len)."""

    def __init__(self, head_dim: int, max_seq_len: int, theta: float = 10000.0, scaling: Optional[dict] = None):
        super().__init__()
        self.head_dim, self.theta, self.scaling = head_dim, theta, scaling
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta, scaling), persistent=False)
        self._build(max_seq_len)

    def _build(self, n: int, device=None):
        inv = self.inv_freq if device is None else self.inv_freq.to(device)
        cos, sin = rope_cos_sin(inv, torch.arange(n, device=inv.device))
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, start: int, length: int, dtype: torch.dtype):
        """cos, sin of shape (length, D) for positions [start, start + length), in `dtype`."""
        end = start + length
        if end > self.cos.shape[0]:
            self._build(max(end, 2 * self.cos.shape[0]), self.inv_freq.device)
        return self.cos[start:end].to(dtype), self.sin[start:end].to(dtype)

    def at(self, positions: torch.Tensor, dtype: torch.dtype):
        """cos, sin of shape (*positions.shape, D) for integer positions of any shape (e.g. (B, T), restarting
        per document), in `dtype`; positions must be below max(cache length, T) (no host sync to check)."""
        n = positions.shape[-1] if positions.dim() else 1
        if n > self.cos.shape[0]:
            self._build(max(n, 2 * self.cos.shape[0]), self.inv_freq.device)
        return self.cos[positions].to(dtype), self.sin[positions].to(dtype)
