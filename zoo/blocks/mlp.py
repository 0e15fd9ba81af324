"""Feed-forward blocks: SwiGLU (GeGLU with act='gelu_tanh', as Gemma's) and the ungated ReLU^2 MLP.

Paper: Shazeer, "GLU Variants Improve Transformer" (2020); used by PaLM and Llama.
    y = W_down( act(W_gate x) * (W_up x) ),  act: silu, or gelu with the tanh approximation
W_gate and W_up are one fused (2*F, D) matrix `gate_up` (gate rows first): one input matmul. `norm_eps`: a LayerNorm
on the F gated features before W_down (sub-LN: Wang et al., "Foundation Transformers", 2022; EVA-02's larger sizes).

ReLU^2: So et al., "Primer: Searching for Efficient Transformers" (2021); used by modded-nanogpt.
    y = W_down( relu(W_up x)^2 )

Shapes: x (B, T, D) -> (B, T, D); hidden F.
"""
import torch
import torch.nn.functional as F
from torch import nn


def gated(gate: torch.Tensor, up: torch.Tensor, act: str = "silu") -> torch.Tensor:
    """act(gate) * up: act silu, or gelu with the tanh approximation (GeGLU)."""
    return (F.silu(gate) if act == "silu" else F.gelu(gate, approximate="tanh")) * up


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int, bias: bool = False, act: str = "silu", norm_eps: float = 0.0):
        super().__init__()
        if act not in ("silu", "gelu_tanh"):
            raise ValueError(f"act={act!r} must be 'silu' or 'gelu_tanh'")
        self.hidden, self.act = hidden, act
        self.gate_up = nn.Linear(dim, 2 * hidden, bias=bias)
        self.norm = nn.LayerNorm(hidden, eps=norm_eps) if norm_eps else None
        self.down = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = gated(*self.gate_up(x).chunk(2, dim=-1), self.act)
        return self.down(h if self.norm is None else self.norm(h))


class ReLU2MLP(nn.Module):
    def __init__(self, dim: int, hidden: int, bias: bool = False):
        super().__init__()
        self.hidden = hidden
        self.up = nn.Linear(dim, hidden, bias=bias)
        self.down = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.relu(self.up(x)).square())
