"""Per-layer input embeddings: every layer of a decoder gets a small input of its own, made once from the tokens, and
adds it to its output through a gate.

Source: Google DeepMind, the Gemma 3n and Gemma 4 model cards (2025, 2026: "Per-Layer Embeddings").
    inputs:  (norm(W_proj e / sqrt(D)) + table[token] * sqrt(P)) / sqrt(2), split per layer   (e: the token embeddings)
    layer:   x + norm(W_out(act(W_gate x) * input))
`act`: 'silu' or 'gelu_tanh' (GELU with the tanh approximation).

Shapes: token ids (B, T) and embeddings (B, T, D) -> inputs (B, T, L, P); a layer's x (B, T, D) and its input
(B, T, P) -> (B, T, D).
Needs: norm.py.
"""
import torch
import torch.nn.functional as F
from torch import nn

try:
    from .norm import RMSNorm
except ImportError:  # copied next to norm.py, outside the zoo package
    from norm import RMSNorm


class PerLayerInputs(nn.Module):
    """The inputs of all `n_layers` layers, `width` each, from a table of `vocab` rows and the embeddings (`dim`)."""

    def __init__(self, vocab: int, dim: int, n_layers: int, width: int, eps: float = 1e-6):
        super().__init__()
        self.n_layers, self.width = n_layers, width
        self.embed = nn.Embedding(vocab, n_layers * width)
        self.proj = nn.Linear(dim, n_layers * width, bias=False)
        self.norm = RMSNorm(width, eps)

    def forward(self, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        split = (self.n_layers, self.width)
        table = self.embed(ids) * torch.tensor(self.width ** 0.5, dtype=x.dtype)
        context = self.norm((self.proj(x) * x.shape[-1] ** -0.5).unflatten(-1, split))
        return (context + table.unflatten(-1, split)) * 2 ** -0.5


class PerLayerInput(nn.Module):
    """One layer's gate: x (B, T, dim) and its input (B, T, width) -> x plus the gated input, projected and normed."""

    def __init__(self, dim: int, width: int, act: str = "gelu_tanh", eps: float = 1e-6):
        super().__init__()
        if act not in ("silu", "gelu_tanh"):
            raise ValueError(f"act={act!r} must be 'silu' or 'gelu_tanh'")
        self.act = act
        self.gate = nn.Linear(dim, width, bias=False)
        self.out = nn.Linear(width, dim, bias=False)
        self.norm = RMSNorm(dim, eps)

    def forward(self, x: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        g = self.gate(x)
        g = F.silu(g) if self.act == "silu" else F.gelu(g, approximate="tanh")
        return x + self.norm(self.out(g * inputs))
