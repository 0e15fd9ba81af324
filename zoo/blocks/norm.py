"""RMSNorm: root-mean-square layer normalisation; LayerNorm without a bias (Cohere's).

Papers: Zhang & Sennrich, "Root Mean Square Layer Normalization" (2019); Ba et al., "Layer Normalization" (2016).
    RMSNorm:   y = x / sqrt(mean(x^2, dim=-1) + eps) * weight
    LayerNorm: y = (x - mean(x)) / sqrt(var(x) + eps) * weight
    GatedRMSNorm: RMSNorm with a SiLU gate after it (Gated DeltaNet) or before it (Mamba-2), over channel groups
Statistics in fp32, cast back to the input dtype before the weight, as Llama does.

Shapes: x (..., D) -> (..., D); weight (D,).
"""
from typing import Optional

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


class GatedRMSNorm(RMSNorm):
    """RMSNorm with a SiLU gate: norm(x) * weight * silu(gate) (Gated DeltaNet), or with `gate_first`
    norm(x * silu(gate)) * weight (Mamba-2); statistics over groups of `group` channels (all when None), in fp32."""

    def __init__(self, dim: int, eps: float = 1e-6, group: Optional[int] = None, gate_first: bool = False):
        super().__init__(dim, eps)
        self.group, self.gate_first = group or dim, gate_first

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype, gate = x.dtype, F.silu(gate.float())
        x = x.float() * gate if self.gate_first else x.float()
        x = F.rms_norm(x.unflatten(-1, (-1, self.group)), (self.group,), None, self.eps).flatten(-2)
        x = self.weight * x.to(dtype)
        return x if self.gate_first else (x * gate).to(dtype)
