"""What the recurrent blocks share: a causal depthwise convolution with a state, document resets, chunk decays.

Used by gated_deltanet.py, mamba2.py and short_conv.py. Packed documents: `doc_ids` (B, T) as the attention blocks
take them; the recurrence restarts wherever the id changes inside a row, and the state passed in is the past of each
row's first document (flash-linear-attention's cu_seqlens rule, with a row's documents numbered by id changes).
- `causal_conv`: y_t = sum_j w_j x_{t-K+1+j} (+ bias) over channels, never reading another document's input; the
  state is the window of the K-1 inputs before the next token (zeros where they lie before its document).
- `optional_kernel`: a CUDA kernel package's function when it is installed and imports, else None.
- `StateCache`: a layer's state between calls (decoding), in buffers written in place (fixed addresses: CUDA graphs).
- `chunk_decays`: for a scan whose state decays by exp(g_t) per token, cut in chunks of C tokens, the decays between
  the tokens of a chunk and from/to its ends, zero across a document start (Dao and Gu, "Transformers are SSMs:
  Generalized Models and Efficient Algorithms Through Structured State Space Duality", 2024, the SSD chunked form).

Shapes: x (B, T, D); weight (D, 1, K) as nn.Conv1d holds it; conv state (B, K-1, D); g (B, H, n, C).
"""
import functools
import importlib
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


@functools.cache
def optional_kernel(module: str, name: str):
    """`module`.`name` when installed and importable, else None (absent, or built for another CUDA / torch)."""
    try:
        return getattr(importlib.import_module(module), name)
    except Exception:  # noqa: BLE001
        return None


def resets(doc_ids: torch.Tensor) -> torch.Tensor:
    """doc_ids (B, T) -> (B, T) bool: True where a new document starts inside the row (never at its first token)."""
    return F.pad(doc_ids[:, 1:] != doc_ids[:, :-1], (1, 0), value=False)


class StateCache(nn.Module):
    """A recurrent layer's state (a tensor, or a block's tuple of them) kept between calls: zeros like `state` to start
    with (a zero state is a fresh one), each `write` copied into the same buffers."""

    def __init__(self, state):
        super().__init__()
        self.one = torch.is_tensor(state)
        for i, t in enumerate([state] if self.one else state):
            self.register_buffer(f"s{i}", torch.zeros_like(t), persistent=False)

    def read(self):
        s = tuple(self.buffers())
        return s[0] if self.one else s

    def write(self, state):
        for b, t in zip(self.buffers(), [state] if self.one else state):
            b.copy_(t)


def causal_conv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                state: Optional[torch.Tensor] = None, doc_ids: Optional[torch.Tensor] = None):
    """Depthwise causal convolution of x (B, T, D) after the window `state` (B, K-1, D; zeros when None) -> y (B, T, D)
    and the window before the next token."""
    (B, T, D), K = x.shape, weight.shape[-1]
    past = x.new_zeros(B, K - 1, D) if state is None else state.to(x.dtype)
    xp, w = torch.cat([past, x], 1), weight.view(D, K).to(x.dtype)
    if doc_ids is None:
        y = sum(xp[:, j:j + T] * w[:, j] for j in range(K))
        new_state = xp[:, T:]
    else:  # reach: how many inputs before each token (and the next one) are of its document
        idx = torch.arange(T + 1, device=x.device)
        new = F.pad(resets(doc_ids), (0, 1), value=False)
        reach = (idx - torch.where(new, idx, -K).cummax(1).values)[..., None]
        y = sum(xp[:, j:j + T] * w[:, j] * (reach[:, :T] >= K - 1 - j) for j in range(K))
        new_state = xp[:, T:] * (reach[:, T:] >= torch.arange(K - 1, 0, -1, device=x.device)[:, None])
    return (y if bias is None else y + bias.to(x.dtype)), new_state


def to_chunks(x: torch.Tensor, C: int, dim: int = 2) -> torch.Tensor:
    """x padded with zeros along `dim` to a multiple of C, that dim split in (n, C)."""
    pad = -x.shape[dim] % C
    x = F.pad(x, (0, 0) * (x.dim() - dim - 1) + (0, pad)) if pad else x
    return x.unflatten(dim, (-1, C))


def chunk_decays(g: torch.Tensor, starts: Optional[torch.Tensor] = None):
    """g (B, H, n, C) log decays of the state per token, starts (B, n, C) bool (resets, chunked) ->
    within (B, H, n, C, C): exp(sum g over (j, i]) for j <= i in one document, else 0;
    head (B, H, n, C): exp(sum g over the chunk up to i), 0 once a document started in the chunk (the state read);
    tail (B, H, n, C): exp(sum g over (i, chunk end]) for i in the chunk's last document, else 0 (the state written);
    whole (B, H, n): exp(sum g over the chunk), 0 if a document starts in it (the state carried)."""
    C = g.shape[-1]
    cum = g.cumsum(-1)
    keep = torch.ones(C, C, dtype=torch.bool, device=g.device).tril()
    head, tail, whole = cum.exp(), (cum[..., -1:] - cum).exp(), cum[..., -1].exp()
    if starts is not None:
        doc = starts.long().cumsum(-1)[:, None]  # each token's document, numbered within its chunk
        keep = keep & (doc[..., :, None] == doc[..., None, :])
        head, tail, whole = head * (doc == 0), tail * (doc == doc[..., -1:]), whole * (doc[..., -1] == 0)
    within = (cum[..., :, None] - cum[..., None, :]).masked_fill(~keep, float("-inf")).exp()
    return within, head, tail, whole
