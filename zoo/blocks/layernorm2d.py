"""LayerNorm2d: LayerNorm over the channels of each pixel of a (B, C, H, W) feature map.

Paper: Ba, Kiros & Hinton, "Layer Normalization" (2016); used per pixel by ConvNeXt (Liu et al., 2022).

Shapes: x (B, C, H, W) -> (B, C, H, W). The channels move last for F.layer_norm and back (free views on a channels-last
tensor). Parameter names (weight, bias) are timm's.
"""
import torch
import torch.nn.functional as F
from torch import nn


class LayerNorm2d(nn.LayerNorm):
    def __init__(self, channels: int, eps: float = 1e-6):
        super().__init__(channels, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.permute(0, 2, 3, 1)
        x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)
