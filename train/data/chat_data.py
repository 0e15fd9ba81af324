"""Tokenised conversations for chat fine-tuning, and their batches: a conversation per row, padded on
the right (inputs 0, targets -100), rows of similar length batched together; or with `data.pack`,
several per row of `data.seq_len` tokens, each in a document of its own. A batch follows from (seed, index).

    x, y, n, docs = data.batch(index, rows)   # (B, T) inputs and targets, real tokens, doc keywords"""
from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch

from . import DataError, TokenizedRows, line_list
from .conversations import ChatDataConfig, ChatTemplate
from .packing import pack, pack_rows


class ChatData(TokenizedRows):
    def __init__(self, train_rows: list, val_rows: list, tokenizer, template: ChatTemplate, cfg: ChatDataConfig,
                 seed: int = 0, log=print):
        self.cfg, self.tokenizer, self.template, self.seed = cfg, tokenizer, template, seed
        self.train, _ = self._encode(train_rows, "training", log)
        self.val, self.val_rows = self._encode(val_rows, "validation", log)  # val_rows: those not cut
        self._epoch, self._batches = None, None
        n_tok = sum(len(x) for x, *_ in self.train)
        n_lab = sum(int((y != -100).sum()) for _, y, *_ in self.train)
        log(f"data: {len(self.train):,} training + {len(self.val):,} validation conversations, {n_tok:,} training "
            f"tokens ({100 * n_lab / max(n_tok, 1):.1f}% trained: "
            f"{'every token, data.train_on_prompt' if cfg.train_on_prompt else 'the assistant turns'}; template "
            f"{template.name}, vocab {tokenizer.vocab_size})")

    def _encode(self, rows: list, split: str, log) -> tuple[list, list]:
        """[(messages, (file, line))] -> ([(inputs, targets)], [the conversations kept whole]); those the template
        refuses skipped (summed up per file), those longer than seq_len + 1 tokens cut."""
        out, whole, refused, cut, dropped = [], [], defaultdict(list), 0, 0
        first, limit = None, self.cfg.seq_len + 1
        for messages, where in rows:
            try:
                ids, labels, *extra = self.encode_row(messages)
            except DataError as e:
                refused[where[0]].append((where[1], e))
                first = first or f"{where[0]}: line {where[1]}: {e}"
                continue
            if len(ids) > limit:
                cut += 1
                ids, labels = ids[:limit], labels[:limit]
            else:
                whole.append(messages)
            y = np.asarray(labels[1:], dtype=np.int64)
            if len(ids) < 2 or not (y != -100).any():
                dropped += 1
                continue
            out.append((np.asarray(ids[:-1], dtype=np.int64), y, *extra))
        for f, bad in refused.items():
            log(f"data: {f}: {len(bad)} conversations refused, skipped (lines {line_list([i for i, _ in bad])}; "
                f"line {bad[0][0]}: {bad[0][1]})")
        if cut:
            log(f"data: {cut} {split} conversations longer than data.seq_len={self.cfg.seq_len} tokens were cut there"
                + (f"; {dropped} kept no assistant token and were dropped" if dropped else ""))
        if not out:
            why = first or (f"every conversation lost its assistant tokens to data.seq_len={self.cfg.seq_len}"
                            if dropped else "no conversations")
            raise DataError(f"{self.cfg.path}: no {split} conversation left ({why})")
        return out, whole

    def encode_row(self, messages: list) -> tuple:
        """(ids, labels, anything kept with the row's tensors) of one conversation; a DataError refuses it."""
        return self.template.encode(self.tokenizer, messages, self.cfg.train_on_prompt)

    def _epoch_batches(self, epoch: int, rows: int) -> list:
        """The epoch's batches in training order: lists of rows, a row a list of conversation indices."""
        if self._epoch != (epoch, rows):
            lengths = np.array([len(x) for x, *_ in self.train])
            if self.cfg.pack:
                self._batches = packed_batches(lengths, rows, self.cfg.seq_len, self.seed, epoch)
            else:
                self._batches = [[[i] for i in b] for b in epoch_batches(lengths, rows, self.cfg.bucket_batches,
                                                                        self.seed, epoch)]
            self._epoch = (epoch, rows)
        return self._batches

    def batch(self, index: int, rows: int, part: slice = None):
        """Micro-batch `index` of `rows` rows (or a rank's `part`): (inputs, targets, real tokens, doc keywords)."""
        per_epoch = len(self._epoch_batches(0, rows))
        batch = self._epoch_batches(index // per_epoch, rows)[index % per_epoch]
        if part is not None:
            batch = batch[part]
        if not self.cfg.pack:
            return self.collate([self.train[r[0]] for r in batch])
        packed = [pack([self.train[i] for i in r], self.cfg.seq_len) for r in batch]  # one row each
        x, y, doc, pos = (torch.cat([getattr(p, k) for p in packed]) for k in
                          ("input_ids", "labels", "doc_ids", "position_ids"))
        return x, y, sum(len(self.train[i][0]) for r in batch for i in r), {"doc_ids": doc, "position_ids": pos}

    @staticmethod
    def collate(items: list) -> tuple:
        T = max(len(x) for x, *_ in items)
        x = torch.zeros(len(items), T, dtype=torch.long)
        y = torch.full((len(items), T), -100, dtype=torch.long)
        for r, (xi, yi, *_) in enumerate(items):
            x[r, :len(xi)] = torch.from_numpy(xi)
            y[r, :len(yi)] = torch.from_numpy(yi)
        return x, y, sum(len(xi) for xi, *_ in items), {}

    def val_batches(self, batch_size: int, n_batches: int):
        """The first n_batches of the validation conversations in order of length, batch_size at a time."""
        order = sorted(range(len(self.val)), key=lambda i: len(self.val[i][0]))
        for s in range(0, min(len(order), n_batches * batch_size), batch_size):
            yield self.collate([self.val[i] for i in order[s:s + batch_size]])

    def padding_waste(self, rows: int, bucket_batches: int = None, packed: bool = False) -> float:
        """The padding's share of the first epoch's training batches: padded with `bucket_batches` (default
        data.bucket_batches; 1: random conversations), or packed into rows of data.seq_len."""
        lengths = np.array([len(x) for x, *_ in self.train])
        if packed:
            batches = packed_batches(lengths, rows, self.cfg.seq_len, self.seed, 0)
            return float(1 - sum(lengths[i] for b in batches for r in b for i in r)
                         / (len(batches) * rows * self.cfg.seq_len))
        batches = lengths[epoch_batches(lengths, rows, bucket_batches or self.cfg.bucket_batches, self.seed, 0)]
        return float(1 - batches.sum() / (batches.max(1) * rows).sum())


def epoch_batches(lengths: np.ndarray, rows: int, bucket_batches: int, seed: int, epoch: int) -> np.ndarray:
    """One epoch's batches in training order, (batches, rows) indices into `lengths`: a permutation seeded by (seed,
    epoch), the last batch filled from its start, each `bucket_batches` batches sorted by length, cut and shuffled."""
    rng, n = np.random.default_rng((seed, epoch)), len(lengths)
    n_batches = -(-n // rows)
    perm = np.resize(rng.permutation(n), n_batches * rows)  # np.resize repeats from the start
    window = rows * bucket_batches
    for s in range(0, len(perm), window):
        perm[s:s + window] = perm[s:s + window][np.argsort(lengths[perm[s:s + window]], kind="stable")]
    return perm.reshape(n_batches, rows)[rng.permutation(n_batches)]


def packed_batches(lengths: np.ndarray, rows: int, seq_len: int, seed: int, epoch: int) -> list:
    """One epoch's packed batches in training order: a seeded permutation packed into rows of seq_len tokens
    (pack_rows), the rows shuffled, `rows` at a time (the last batch filled from the start)."""
    rng = np.random.default_rng((seed, epoch))
    perm = rng.permutation(len(lengths))
    packed = [[int(perm[i]) for i in r] for r in pack_rows(lengths[perm].tolist(), seq_len)]
    order = np.resize(rng.permutation(len(packed)), -(-len(packed) // rows) * rows)
    return [[packed[i] for i in order[s:s + rows]] for s in range(0, len(order), rows)]
