"""Document masking: causal attention within each document of rows that pack several.

A query sees only the earlier keys of its own document, so packed documents train as if each ran alone (as in Dubey et
al., "The Llama 3 Herd of Models", 2024); `document_positions` restarts RoPE positions per document.
`Documents(doc_ids)` is CausalSelfAttention's `mask=`; backends: flash-attn's varlen kernel, 'flex', or SDPA with
`document_mask`. A learned prefix is seen by every query.

Shapes: doc_ids (B, T); q (B, H, Tq, D); k, v (B, KV, Tk, D) -> (B, H, Tq, D); masks (B, Tq, Tk).
Needs: attention.py, attention_cpu.py, rope.py, norm.py.
"""
import functools
from typing import Optional

import torch

try:
    from . import attention as A
except ImportError:  # copied beside attention.py and what it needs, outside the zoo package
    import attention as A


def document_starts(doc_ids: torch.Tensor) -> torch.Tensor:
    """doc_ids (B, T) -> (B, T) bool, True at a row's first token and wherever the id changes."""
    new = torch.ones_like(doc_ids, dtype=torch.bool)
    new[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    return new


def document_runs(doc_ids: torch.Tensor) -> torch.Tensor:
    """doc_ids (B, T) -> (B, T) int64: each row's documents numbered 0, 1, 2, ..."""
    return document_starts(doc_ids).long().cumsum(1) - 1


def document_positions(doc_ids: torch.Tensor) -> torch.Tensor:
    """doc_ids (B, T) -> (B, T) int64 positions that restart at 0 at the start of every document."""
    idx = torch.arange(doc_ids.shape[1], device=doc_ids.device).expand_as(doc_ids)
    start = torch.where(document_starts(doc_ids), idx, 0).cummax(1).values  # each token's document start
    return idx - start


def document_mask(doc_ids: torch.Tensor, k_len: Optional[int] = None, window: Optional[int] = None) -> torch.Tensor:
    """Boolean (B, Tq, Tk) mask, True = attend: query i sees key j when j <= i (and, with a window, i - j < window) and
    both are in one document. Keys before the queries (k_len > Tq: a learned prefix) are seen by every query."""
    B, Tq = doc_ids.shape
    Tk = k_len or Tq
    runs = document_runs(doc_ids)
    same = runs[:, :, None] == runs[:, None, :]  # (B, Tq, Tq)
    if Tk > Tq:
        same = torch.cat([same.new_ones(B, Tq, Tk - Tq), same], dim=-1)
    return same & A.attention_mask(Tq, Tk, window, doc_ids.device)


# 'auto' with documents: flash-attn's varlen kernel, FlexAttention on CUDA under torch.compile, else SDPA with the
# mask (on a CPU faster than 'bmm' with the same mask)
resolve_backend = functools.partial(A.resolve_backend, auto=("flash", "flex"))


def attend_documents(q, k, v, doc_ids: torch.Tensor, backend: str = "auto", window: Optional[int] = None,
                     softcap: Optional[float] = None, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Block-diagonal causal attention of q (B, H, Tq, D) over k, v (B, KV, Tk, D): a query sees
    the keys at or before it in its own document (and, with a window, fewer than `window` back).
    Keys before the queries (Tk > Tq) are seen by every query (not by 'flash' and 'flex')."""
    Tq, Tk = q.shape[2], k.shape[2]
    window = window if window is not None and Tk > window else None
    picked = resolve_backend(backend, q.device, q.dtype, Tk, softcap=softcap, sinks=sinks)
    if Tk != Tq and picked in ("flash", "flex"):
        if backend != "auto":
            raise ValueError(f"attention backend {picked!r} masks documents only without keys in front of "
                             f"the queries (got {Tk} keys for {Tq} queries); use 'sdpa'")
        picked = "sdpa"
    if picked == "flash":
        return attend_varlen(q, k, v, doc_ids, window)
    if picked == "flex":
        return A.attend_flex(q, k, v, window, document_runs(doc_ids))
    return A.attend_within(q, k, v, document_mask(doc_ids, Tk, window), picked, window, softcap, sinks)


def attend_varlen(q, k, v, doc_ids: torch.Tensor, window: Optional[int] = None) -> torch.Tensor:
    """Document masking by flash-attn's varlen kernel: the B rows of T tokens laid end to end as one
    (B*T, H, D) sequence cut into the documents, cu_seqlens their start offsets. CUDA, fp16/bf16,
    flash-attn installed. Reads the longest document on the host (a sync)."""
    varlen = A.check_flash(q, varlen=True)
    B, H, T, D = q.shape
    KV = k.shape[1]
    starts = document_starts(doc_ids).flatten().nonzero().squeeze(1)  # flat offsets of the documents' first tokens
    cu = torch.cat([starts, starts.new_full((1,), B * T)]).to(torch.int32)
    max_len = int((cu[1:] - cu[:-1]).max())
    out = varlen(q.transpose(1, 2).reshape(B * T, H, D), k.transpose(1, 2).reshape(B * T, KV, D),
                 v.transpose(1, 2).reshape(B * T, KV, D), cu, cu, max_len, max_len, causal=True,
                 window_size=(window - 1, 0) if window is not None else (-1, -1))
    return out.view(B, T, H, D).transpose(1, 2)


class Documents(A.Causal):
    """The document mask of doc_ids (B, T), as CausalSelfAttention takes it (`mask=`)."""

    def __init__(self, doc_ids: torch.Tensor):
        self.doc_ids = doc_ids

    def attend(self, q, k, v, backend="auto", window=None, softcap=None, sinks=None) -> torch.Tensor:
        return attend_documents(q, k, v, self.doc_ids, backend, window, softcap, sinks)

    def cached(self, cache, start):
        raise ValueError("doc_ids (document masking) is for forwards without a KV cache; decoding runs one sequence")
