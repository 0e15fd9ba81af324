"""Patchify / unpatchify for vision transformers, and the fixed 2D sin-cos position embedding.

Papers: Dosovitskiy et al., "An Image is Worth 16x16 Words" (ViT, 2021) for patches as tokens; He et al., "Masked
Autoencoders Are Scalable Vision Learners" (2022) for the 2D sin-cos table DiT (Peebles & Xie, 2023) uses.

    PatchEmbed:    (B, C, H, W) -> conv p x p, stride p -> (B, N, D), N = (H/p) * (W/p), row-major;
                   embed_patches: (B, N, p*p*C) patches already cut -> the same projection (B, N, D)
    unpatchify:    (B, N, p*p*C) -> (B, C, H, W)
    sincos_pos_embed_2d(D, h, w): (h*w, D), positions scaled by base_size / h (and / w)

Shapes as above; H and W divisible by p; D divisible by 4.
"""
from typing import Optional

import torch
from torch import nn


class PatchEmbed(nn.Module):
    """Non-overlapping p x p patches of a (B, C, H, W) map, linearly embedded: (B, N, D)."""

    def __init__(self, in_channels: int, dim: int, patch_size: int, bias: bool = True):
        super().__init__()
        self.patch_size = patch_size
        self.proj = nn.Conv2d(in_channels, dim, patch_size, stride=patch_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.patch_size
        if x.dim() != 4 or x.shape[-2] % p or x.shape[-1] % p:
            raise ValueError(f"PatchEmbed expects (B, C, H, W) with H and W divisible by patch_size={p}, "
                             f"got {tuple(x.shape)}")
        return self.proj(x).flatten(2).transpose(1, 2)

    def embed_patches(self, x: torch.Tensor) -> torch.Tensor:
        """(B, N, p*p*C) patches cut already, each (p, p, C) flattened (SigLIP 2's processor) -> (B, N, D)."""
        w = self.proj.weight
        return nn.functional.linear(x, w.permute(0, 2, 3, 1).flatten(1), self.proj.bias)


def unpatchify(x: torch.Tensor, patch_size: int, h: int, w: int) -> torch.Tensor:
    """(B, h*w, p*p*C) tokens in row-major order -> (B, C, h*p, w*p); each token holds (p, p, C)."""
    B, N, K = x.shape
    p = patch_size
    C = K // (p * p)
    if N != h * w or K != p * p * C:
        raise ValueError(f"unpatchify: {tuple(x.shape)} is not (B, {h}*{w}, {p}*{p}*C)")
    return x.reshape(B, h, w, p, p, C).permute(0, 5, 1, 3, 2, 4).reshape(B, C, h * p, w * p)


def _sincos_1d(dim: int, pos: torch.Tensor) -> torch.Tensor:
    omega = 1.0 / 10000 ** (torch.arange(dim // 2, dtype=torch.float64) / (dim / 2))
    out = pos.double().reshape(-1, 1) * omega[None]
    return torch.cat([out.sin(), out.cos()], dim=1)


def sincos_pos_embed_2d(dim: int, h: int, w: int, base_size: Optional[int] = None) -> torch.Tensor:
    """(h*w, dim) float32 table, row-major; base_size None = h (no interpolation)."""
    if dim % 4:
        raise ValueError(f"the 2D sin-cos embedding needs a width divisible by 4, got {dim}")
    base = base_size or h
    rows = torch.arange(h, dtype=torch.float64) * (base / h)
    cols = torch.arange(w, dtype=torch.float64) * (base / w)
    r, c = torch.meshgrid(rows, cols, indexing="ij")
    return torch.cat([_sincos_1d(dim // 2, c), _sincos_1d(dim // 2, r)], dim=1).float()
