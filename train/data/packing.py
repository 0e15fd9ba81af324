"""Packing variable-length sequences (conversations, instructions) into rows of a fixed length.

`pack_rows` assigns (input_ids, labels) sequences to rows by best-fit decreasing; `pack` lays them
out as (R, seq_len) tensors with document ids and positions, so each sequence runs as if alone."""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass
class Packed:
    input_ids: torch.Tensor     # (R, seq_len) int64
    labels: torch.Tensor        # (R, seq_len) int64, -100 where not trained (and in the padding)
    doc_ids: torch.Tensor       # (R, seq_len) int64: 0, 1, ... per sequence of the row; the padding one more
    position_ids: torch.Tensor  # (R, seq_len) int64: 0, 1, ... within each sequence (and the padding)


def pack_rows(lengths: Sequence[int], seq_len: int) -> list[list[int]]:
    """Sequence indices per row of at most seq_len tokens: best-fit decreasing, each row's indices sorted."""
    for i, n in enumerate(lengths):
        if not 0 < n <= seq_len:
            raise ValueError(f"sequence {i} has {n} tokens; packing needs 1 to seq_len={seq_len}")
    rows: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (tokens left, row) of the rows with room, sorted
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n = lengths[i]
        j = bisect.bisect_left(room, (n, -1))  # the row with the least room that still fits
        if j == len(room):
            rows.append([i])
            left, r = seq_len - n, len(rows) - 1
        else:
            left, r = room.pop(j)
            rows[r].append(i)
            left -= n
        if left:
            bisect.insort(room, (left, r))
    return [sorted(r) for r in rows]


def pack(sequences: Sequence[tuple], seq_len: int, pad_id: int = 0) -> Packed:
    """(input_ids, labels) pairs of 1 to seq_len tokens -> a Packed batch of R rows (`pack_rows`)."""
    seqs = []
    for i, (ids, labels) in enumerate(sequences):
        ids, labels = torch.as_tensor(ids, dtype=torch.long), torch.as_tensor(labels, dtype=torch.long)
        if ids.dim() != 1 or ids.shape != labels.shape:
            raise ValueError(f"sequence {i}: input_ids {tuple(ids.shape)} and labels {tuple(labels.shape)} must be "
                             f"1-D and of one length")
        seqs.append((ids, labels))
    rows = pack_rows([len(ids) for ids, _ in seqs], seq_len)
    R = len(rows)
    input_ids = torch.full((R, seq_len), pad_id, dtype=torch.long)
    labels = torch.full((R, seq_len), -100, dtype=torch.long)
    doc_ids = torch.empty((R, seq_len), dtype=torch.long)
    position_ids = torch.empty((R, seq_len), dtype=torch.long)
    for r, members in enumerate(rows):
        at = 0
        for d, i in enumerate(members):
            ids, lab = seqs[i]
            n = len(ids)
            input_ids[r, at:at + n], labels[r, at:at + n] = ids, lab
            doc_ids[r, at:at + n] = d
            position_ids[r, at:at + n] = torch.arange(n)
            at += n
        doc_ids[r, at:] = len(members)  # the padding: a document of its own
        position_ids[r, at:] = torch.arange(seq_len - at)
    return Packed(input_ids, labels, doc_ids, position_ids)
