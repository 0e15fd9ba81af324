"""Hard-swish and hard-sigmoid: piecewise-linear stand-ins for swish (x * sigmoid(x)) and the sigmoid, cheap on any
hardware and exact in low precision.

Paper: Howard et al., "Searching for MobileNetV3" (2019).

    hard_sigmoid(x) = relu6(x + 3) / 6          hard_swish(x) = x * hard_sigmoid(x)

Shapes: any tensor -> the same shape. Runs F.hardswish / F.hardsigmoid; `inplace` is accepted (and ignored).
"""
import torch
import torch.nn.functional as F
from torch import nn


class HardSigmoid(nn.Module):
    def __init__(self, inplace: bool = False):
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.hardsigmoid(x)


class HardSwish(nn.Module):
    def __init__(self, inplace: bool = False):
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.hardswish(x)
