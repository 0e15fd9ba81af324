"""LFM2's gated short convolution: a depthwise causal convolution between two multiplicative gates.

Papers: Liquid AI, "LFM2 Technical Report" (2025); the gated convolution of Poli et al., "Hyena Hierarchy: Towards
Larger Convolutional Language Models" (2023).
    b, c, h = in_proj(x) split in three;  y = out_proj(c * causal_conv(b * h))
Parameter names as transformers' Lfm2ShortConv. State: the conv window (B, K-1, D), restarted by doc_ids (B, T) at
every document start (recurrent.py); one token with the window of the tokens before it is the decoding form.

Shapes: x (B, T, D) -> (B, T, D).
Needs: recurrent.py.
"""
from typing import Optional

import torch
from torch import nn

try:
    from .recurrent import causal_conv
except ImportError:  # copied next to recurrent.py, outside the zoo package
    from recurrent import causal_conv


class ShortConv(nn.Module):
    def __init__(self, dim: int, kernel: int = 3, bias: bool = False):
        super().__init__()
        self.in_proj = nn.Linear(dim, 3 * dim, bias=bias)
        self.conv = nn.Conv1d(dim, dim, kernel, groups=dim, bias=bias, padding=kernel - 1)
        self.out_proj = nn.Linear(dim, dim, bias=bias)

    def forward(self, x: torch.Tensor, state: Optional[torch.Tensor] = None, doc_ids: Optional[torch.Tensor] = None):
        """x (B, T, D), the conv window from a previous call or None -> y (B, T, D), the window after x."""
        b, c, h = self.in_proj(x).chunk(3, -1)
        y, state = causal_conv(b * h, self.conv.weight, self.conv.bias, state, doc_ids)
        return self.out_proj(c * y), state
