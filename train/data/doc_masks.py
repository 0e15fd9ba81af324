"""Document boundaries in a token stream -> the document ids of document masking.

A stream separates its documents by a boundary token: BOS in front of each document (`bos`) or
EOS after each (`eos`). `document_ids(tokens, boundary_id, mode)` numbers each row's documents
0, 1, 2, ... along the row (the boundary token belongs to the document it opens or closes); the
model (zoo/llm.py, `forward(..., doc_ids=)`) then confines attention to each document, and
`zoo.llm.document_positions` gives positions restarting per document. Which token bounds the
documents of a prepared stream is `data.boundary`'s business (train/data/__init__.py, TokenData).
"""
from __future__ import annotations

from typing import Literal

import torch

BOUNDARY_MODES = ("bos", "eos")


def document_ids(tokens: torch.Tensor, boundary_id: int, mode: Literal["bos", "eos"] = "bos") -> torch.Tensor:
    """tokens (..., T) ints -> doc_ids of the same shape, int64, non-decreasing along each row from 0. mode 'bos':
    a document starts at every boundary token; 'eos': a document ends at every boundary token (the
    next token starts the next one). A row that starts inside a document starts with id 0."""
    if mode not in BOUNDARY_MODES:
        raise ValueError(f"unknown document boundary mode {mode!r} (supported: {', '.join(BOUNDARY_MODES)})")
    at = (tokens == boundary_id).long()
    ids = at.cumsum(-1)
    return ids - at[..., :1] if mode == "bos" else ids - at  # bos: the first token's own BOS opens document 0
