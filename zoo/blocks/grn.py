"""Global Response Normalization (GRN): scale each channel by its share of the feature map's energy, which keeps
channels from collapsing to copies of each other.

Paper: Woo et al., "ConvNeXt V2: Co-designing and Scaling ConvNets with Masked Autoencoders" (2023).

    g[c] = ||x[:, :, c]||_2 over H, W        n[c] = g[c] / (mean over c of g + eps)
    y = x + bias + weight * (x * n)           (weight, bias start at 0: the block starts as identity)

Shapes: x (B, H, W, C) channels-last -> (B, H, W, C); weight, bias (C,) (timm's names).
"""
import torch
from torch import nn


class GRN(nn.Module):
    def __init__(self, channels: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(channels))
        self.bias = nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = x.norm(p=2, dim=(1, 2), keepdim=True)             # (B, 1, 1, C)
        n = g / (g.mean(dim=-1, keepdim=True) + self.eps)
        return x + torch.addcmul(self.bias, self.weight, x * n)
