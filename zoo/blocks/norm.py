"""RMSNorm: root-mean-square layer normalisation; LayerNorm without a bias (Cohere's).

Papers: Zhang & Sennrich, "Root Mean Square Layer Normalization" (2019); Ba et al., "Layer Normalization" (2016).
    RMSNorm:   y = x / sqrt(mean(x^2, dim=-1) + eps) * weight
    LayerNorm: y = (x - mean(x)) / sqrt(var(x) + eps) * weight
Statistics in fp32, cast back to the input dtype before the weight, as Llama does.

Shapes: x (..., D) -> (..., D); weight (D,).
"""
import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # torch's rms_norm computes the statistics in fp32 for bf16/fp16 input and casts back
        # before the weight; one call instead of six elementwise kernels (forward and backward)
        return F.rms_norm(x, (x.shape[-1],), self.weight.to(x.dtype), self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class LayerNorm(RMSNorm):
    """LayerNorm with a gain and no bias (Cohere's), the state dict of RMSNorm."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight.to(x.dtype), None, self.eps)
