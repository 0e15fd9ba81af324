"""The pixel-shuffle connector of Idefics3 and SmolVLM: a vision encoder's patch tokens folded s x s into fewer,
wider tokens (space to depth), then linearly projected to the language model's width.

Papers: Laurencon et al., "Building and better understanding vision-language models: insights and future directions"
(Idefics3, 2024); Marafioti et al., "SmolVLM: Redefining small and efficient multimodal models" (2025).

    pixel_shuffle(x, s, h, w): (B, h*w, D) row-major patch tokens -> (B, (h/s)*(w/s), D*s*s); each output token
        holds its s x s block row by row, each token's D channels together (Idefics3Connector's order)
    PixelShuffleProjector: pixel_shuffle, then a linear map without bias (proj) -> (B, N/s^2, out_dim)
Shapes: h and w divisible by s; h = w = sqrt(N) when not given.
"""
from typing import Optional

import torch
from torch import nn


def pixel_shuffle(x: torch.Tensor, s: int, h: Optional[int] = None, w: Optional[int] = None) -> torch.Tensor:
    """(B, h*w, D) -> (B, h*w / s^2, D*s^2), s x s neighbouring tokens in one."""
    B, N, D = x.shape
    h = h or round(N ** 0.5)
    w = w or N // h
    if h * w != N or h % s or w % s:
        raise ValueError(f"pixel_shuffle: {N} tokens as a {h} x {w} grid cannot fold by {s}")
    x = x.reshape(B, h // s, s, w // s, s, D).permute(0, 1, 3, 2, 4, 5)  # (B, h/s, w/s, s, s, D)
    return x.reshape(B, N // (s * s), s * s * D)


class PixelShuffleProjector(nn.Module):
    """(B, N, in_dim) patch tokens -> (B, N / s^2, out_dim): pixel_shuffle by s, then `proj` (no bias)."""

    def __init__(self, in_dim: int, out_dim: int, scale: int = 2):
        super().__init__()
        self.scale = scale
        self.proj = nn.Linear(in_dim * scale * scale, out_dim, bias=False)

    def forward(self, x: torch.Tensor, h: Optional[int] = None, w: Optional[int] = None) -> torch.Tensor:
        return self.proj(pixel_shuffle(x, self.scale, h, w))
