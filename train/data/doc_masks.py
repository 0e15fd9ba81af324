"""Document boundaries in a token stream -> the document ids of document masking.

`document_ids(tokens, boundary_id, mode)` numbers each row's documents 0, 1, 2, ... from the BOS
in front of each (`bos`) or the EOS after each (`eos`); the model confines attention to each
(zoo/llm.py, `forward(..., doc_ids=)`). Which token bounds the documents is `data.boundary`'s.
"""
from __future__ import annotations

from typing import Literal

import torch

BOUNDARY_MODES = ("bos", "eos")


def document_ids(tokens: torch.Tensor, boundary_id: int, mode: Literal["bos", "eos"] = "bos") -> torch.Tensor:
    """tokens (..., T) ints -> doc_ids (..., T) int64, non-decreasing from 0 along each row: 'bos' starts a
    document at every boundary token, 'eos' ends one there; a row starting mid-document starts at 0."""
    if mode not in BOUNDARY_MODES:
        raise ValueError(f"unknown document boundary mode {mode!r} (supported: {', '.join(BOUNDARY_MODES)})")
    at = (tokens == boundary_id).long()
    ids = at.cumsum(-1)
    return ids - at[..., :1] if mode == "bos" else ids - at  # bos: the first token's own BOS opens document 0
