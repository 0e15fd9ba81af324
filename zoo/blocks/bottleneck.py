"""Bottleneck adapter: a small residual MLP inserted after a frozen sublayer.

Paper: Houlsby et al., "Parameter-Efficient Transfer Learning for NLP" (2019).
    y = h + up(gelu(down(dropout(h))))     down: dim -> hidden, up: hidden -> dim
`up` starts at zero, so a new adapter is the identity and the frozen model is unchanged until it trains. Used after
a transformer block's attention and after its MLP, before the residual sum (`Block.attn_adapter`, `mlp_adapter`).

Shapes: h (..., dim) -> (..., dim).
"""
import torch
from torch import nn


class BottleneckAdapter(nn.Module):
    def __init__(self, dim: int, hidden: int, dropout: float = 0.0, device=None, dtype=None):
        super().__init__()
        if hidden <= 0:
            raise ValueError(f"bottleneck width must be > 0, got {hidden}")
        self.down = nn.Linear(dim, hidden, device=device, dtype=dtype)
        self.up = nn.Linear(hidden, dim, device=device, dtype=dtype)
        self.act = nn.GELU()
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        nn.init.zeros_(self.up.weight)
        nn.init.zeros_(self.up.bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.up(self.act(self.down(self.dropout(h).to(self.down.weight.dtype)))).to(h.dtype)
