"""Conditioning embeddings of diffusion denoisers: sinusoidal timesteps, an MLP on them, class labels.

Papers: Vaswani et al., "Attention Is All You Need" (2017) for the sinusoids; Peebles & Xie, "Scalable Diffusion Models
with Transformers" (DiT, 2023) for the embedders; Ho & Salimans, "Classifier-Free Diffusion Guidance" (2022).

    timestep_embedding(t, dim): [cos(t f_i), sin(t f_i)], f_i = max_period ** (-i / (dim/2 - freq_shift))
    TimestepEmbedder:          linear_2(SiLU(linear_1(timestep_embedding(t))))
    LabelEmbedder:             table[label], row `num_classes` = "no label" (for guidance)

freq_shift 0 is DiT's convention, 1 diffusers'. Timesteps may be ints or floats (flow: t * 1000).
Shapes: t (B,) -> (B, dim) float32; TimestepEmbedder (B,) -> (B, D); LabelEmbedder (B,) int -> (B, D).
"""
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


def timestep_embedding(t: torch.Tensor, dim: int, max_period: float = 10000.0, freq_shift: float = 0.0) -> torch.Tensor:
    """Sinusoidal embedding of (B,) timesteps -> (B, dim) float32, cosines first (zero-padded if dim is odd)."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, device=t.device, dtype=torch.float32)
                      / (half - freq_shift))
    args = t.float()[:, None] * freqs[None]
    emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    return F.pad(emb, (0, 1)) if dim % 2 else emb


def drop_labels(labels: torch.Tensor, p: float, null_label: int, generator: Optional[torch.Generator] = None):
    """Each label replaced by `null_label` ("no label") with probability p (training for classifier-free guidance)."""
    if p <= 0:
        return labels
    dropped = torch.rand(labels.shape, generator=generator, device=labels.device) < p
    return torch.where(dropped, torch.full_like(labels, null_label), labels)


class TimestepEmbedder(nn.Module):
    """(B,) timesteps -> (B, dim): the sinusoids (freq_dim of them) through a two-layer SiLU MLP."""

    def __init__(self, dim: int, freq_dim: int = 256, freq_shift: float = 0.0, bias: bool = True):
        super().__init__()
        self.freq_dim, self.freq_shift = freq_dim, freq_shift
        self.linear_1, self.linear_2 = nn.Linear(freq_dim, dim, bias=bias), nn.Linear(dim, dim, bias=bias)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        emb = timestep_embedding(t, self.freq_dim, freq_shift=self.freq_shift).to(self.linear_1.weight.dtype)
        return self.linear_2(F.silu(self.linear_1(emb)))


class LabelEmbedder(nn.Module):
    """(B,) class labels -> (B, dim); label `num_classes` is the learned "no label" embedding."""

    def __init__(self, num_classes: int, dim: int):
        super().__init__()
        self.num_classes = num_classes
        self.table = nn.Embedding(num_classes + 1, dim)

    def drop(self, labels: torch.Tensor, p: float, generator: Optional[torch.Generator] = None) -> torch.Tensor:
        return drop_labels(labels, p, self.num_classes, generator)

    def forward(self, labels: torch.Tensor) -> torch.Tensor:
        return self.table(labels)
