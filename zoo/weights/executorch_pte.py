"""ExecuTorch programs (`.pte`): a Zoo LLM for ExecuTorch's on-device runtime.

`save(model, "m.pte")` exports the forward, token ids (1, T) -> logits (1, T, V) for any 2 <= T <= max_seq_len, with
torch.export and lowers it through ExecuTorch's edge dialect (`to_edge_transform_and_lower`), its matmuls delegated to
XNNPACK; each call computes the whole sequence (no KV cache). Export only: Zoo reads no `.pte` back.
"""
from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from ..blocks.attention import CausalSelfAttention
from .files import atomic_write


@contextlib.contextmanager
def _exportable(model):
    """The model in eval mode with torch's SDPA as its attention (the CPU path 'auto' picks under tracing specialises
    the sequence length), both restored on exit."""
    attns = {m: m.backend for m in model.modules() if isinstance(m, CausalSelfAttention)}
    training = model.training
    try:
        for m in attns:
            m.backend = "sdpa"
        yield model.eval()
    finally:
        for m, b in attns.items():
            m.backend = b
        model.train(training)


def save(model, path) -> Path:
    """Write `model` (an LLM) as an ExecuTorch program at `path`."""
    try:
        from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
        from executorch.exir import to_edge_transform_and_lower
    except ImportError as e:  # absent, or built for another torch
        raise ImportError(f"{path}: a .pte needs the executorch package: pip install -e '.[executorch]' ({e})") from None
    model, out = getattr(model, "_orig_mod", model), Path(path)
    if getattr(model, "family", None) != "llm":
        raise ValueError(f"{out}: the .pte export takes an LLM, not a {type(model).__name__}")
    seq = torch.export.Dim("T", min=2, max=model.config.max_seq_len)
    ids = torch.zeros(1, min(8, model.config.max_seq_len), dtype=torch.long, device=next(model.parameters()).device)
    with _exportable(model), torch.no_grad():
        program = torch.export.export(model, (ids,), dynamic_shapes=({1: seq},), strict=False)
    lowered = to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()]).to_executorch()
    return atomic_write(out, lowered.buffer)
