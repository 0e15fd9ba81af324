"""Hard-swish and hard-sigmoid: piecewise-linear stand-ins for swish (x * sigmoid(x)) and the
sigmoid, cheap on any hardware and exact in low precision.

Paper: Howard et al., "Searching for MobileNetV3" (2019).

    hard_sigmoid(x) = relu6(x + 3) / 6          hard_swish(x) = x * hard_sigmoid(x)

Shapes: any tensor -> the same shape. Runs F.hardswish / F.hardsigmoid; `inplace` is accepted
(and ignored).
"""
import torch
import torch.nn.functional as F
from torch import nn


def hard_sigmoid(x: torch.Tensor) -> torch.Tensor:
    """relu6(x + 3) / 6: 0 below -3, 1 above 3, linear between."""
    return F.hardsigmoid(x)


def hard_swish(x: torch.Tensor) -> torch.Tensor:
    """x * relu6(x + 3) / 6."""
    return F.hardswish(x)


class HardSigmoid(nn.Module):
    def __init__(self, inplace: bool = False):
        super().__init__()

    def forward(self, x):
        return hard_sigmoid(x)


class HardSwish(nn.Module):
    def __init__(self, inplace: bool = False):
        super().__init__()

    def forward(self, x):
        return hard_swish(x)
