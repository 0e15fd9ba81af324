"""SwiGLU feed-forward block.

Paper: Shazeer, "GLU Variants Improve Transformer" (2020); used by PaLM and Llama.
    y = W_down( silu(W_gate x) * (W_up x) )
W_gate and W_up are one fused (2*F, D) matrix `gate_up` (gate rows first): one input matmul.

Shapes: x (B, T, D) -> (B, T, D); hidden F.
Depends on torch only.
"""
import torch
import torch.nn.functional as F
from torch import nn


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int, bias: bool = False):
        super().__init__()
        self.hidden = hidden
        self.gate_up = nn.Linear(dim, 2 * hidden, bias=bias)
        self.down = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)
