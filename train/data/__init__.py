"""Text data for language models: sources, preparation into token shards, mixtures, random windows.

This file holds the config (`data.*`), TokenData (the LM task's data) and the document-boundary
contract. A source (`data.path`, or a mixture `data.sources`) is prepared once into `data.cache_dir`
and read as memmaps; batches are random windows seeded by (seed, step, micro), so resume is exact.
`document_ids` numbers each token's document by `data.boundary` (docs/data.md)."""
from __future__ import annotations

import hashlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

import numpy as np
import torch

from zoo.config import bounded, fail
from zoo.weights.files import atomic_write

from .loader import Prefetcher
from .shards import Shards, chunks, prepare as prepare_shards, read_manifest, token_dtype  # noqa: F401
from .sources import (DataError, Problems, corpus_files, documents, files_fingerprint, fingerprint, read_corpus,  # noqa: F401
                      line_list, needs, short_digest, stdlib_files)
from .text_tokenizers import (TRAINED_SPECIALS, ByteTokenizer, HFTokenizer, IdsTokenizer,  # noqa: F401
                              SentencePieceTokenizer, load_tokenizer_file, sample_documents, token_bytes, train_bpe,
                              train_sentencepiece)
from .tokens import TokenStream, is_pretokenized, pretokenized_splits, token_files

# data.tokenizer's names of the tokenizers trained on the corpus -> their file in the cache
TRAINED = {"sentencepiece": "sp-{}.model", "bpe": "bpe-{}.json", "superbpe": "superbpe-{}.json"}


@dataclass
class SourceConfig:
    path: str = ""                          # (required) a source in any form `data.path` takes
    weight: float = bounded(1.0, gt=0)      # its share of the training windows (weights are normalised)


@dataclass
class TextDataConfig:
    format: str = "text"                    # `text`: language modelling (these keys); `messages`, `prompt_completion`,
                                            # `alpaca` (chat) and `preference` (DPO) take docs/post-training.md's keys
    path: str = "stdlib"                    # text, .jsonl, .parquet, a saved dataset, pre-tokenized `.bin` files, a
                                            # folder or glob (docs/data.md), or `stdlib` (the embedded default)
    sources: Optional[list[SourceConfig]] = None  # a mixture instead of `path`: `[{path: ..., weight: ...}, ...]`,
                                            # windows drawn from each with probability weight / sum of weights
    column: str = "text"                    # the field of a .jsonl line, the column of Parquet and saved datasets
    val_path: Optional[str] = None          # a separate validation source (any `path` form); null = the `val` files
                                            # of pre-tokenized inputs, else each source's tail (`val_fraction`)
    tokenizer: str = "sentencepiece"        # `bytes`, `sentencepiece` (BPE trained on the corpus; with
                                            # `train.init_from`: the checkpoint's own), `bpe` (byte-level BPE trained
                                            # on the corpus), `superbpe` (SuperBPE: `bpe`, then merges across spaces)
                                            # or a tokenizer file's path
    vocab_size: int = bounded(2048, ge=16, le=2**31)  # vocabulary of a tokenizer trained on the corpus (`bpe` and
                                            # `superbpe`: at least 257, the bytes and `<|endoftext|>`)
    superbpe_transition: float = bounded(0.9, gt=0, lt=1)  # `superbpe`: the share of `vocab_size` learnt as
                                            # subwords (stage 1) before merges may cross whitespace
    seq_len: int = bounded(256, ge=2)       # tokens per training window; <= `model.max_seq_len`
    seq_len_schedule: Optional[list[list[int]]] = None  # sequence-length curriculum `[[until, seq_len], ...]`
                                            # (e.g. `[[1000, 64], [3000, 128]]`), then `seq_len`; lengths increasing
    seq_len_schedule_unit: Literal["steps", "tokens"] = "steps"  # what `until` counts: `steps`, or `tokens` trained
                                            # before the step (batch_size x micro-batches x window, step by step)
    val_fraction: float = bounded(0.05, gt=0, lt=1)  # the held-out tail of each source used for validation, from
                                            # the first document that starts in it (the token tail when none does)
    boundary: Literal["auto", "bos", "eos", "both", "none"] = "auto"  # what separates documents: BOS before,
                                            # EOS after, both or nothing; `auto`: `eos`, else `bos`, else `none`
    token_dtype: Literal["uint16", "uint32"] = "uint16"  # the ids of raw pre-tokenized `.bin` files (nanoGPT);
                                            # llm.c shards say theirs
    workers: int = bounded(0, ge=0)         # processes that tokenise during preparation; 0 = one per core
    shard_tokens: int = bounded(1 << 28, gt=0)  # tokens per prepared shard file
    prefetch: int = bounded(2, ge=0)        # training batches made ahead on a background thread (pinned memory on
                                            # CUDA); 0 = made by the training thread when asked
    cache_dir: Optional[str] = None         # where the tokenizer and the token memmap are cached; null =
                                            # `$ZOO_CACHE`, else `$XDG_CACHE_HOME/zoo` or `~/.cache/zoo`
    max_chars: Optional[int] = bounded(None, gt=0)  # read at most this many characters of the corpus
    sp_train_chars: int = bounded(4_000_000, gt=0)  # characters of documents sampled across the whole corpus
                                            # (every source) to train `sentencepiece`, `bpe` or `superbpe`
    eval_tasks: Optional[list[str]] = None  # task files (train/eval.py: multiple choice, generation, loss)
                                            # scored at every evaluation, logged as `eval_<file stem>_<metric>`
    # document masking (document_ids below, zoo/blocks/attention.py)
    attention: Literal["causal", "document"] = "causal"  # `causal`: every token attends to all earlier tokens of
                                            # its window; `document`: only to those of its own document
    positions: Literal["global", "document"] = "global"  # RoPE positions: `global` (0..T-1 along the window) or
                                            # `document` (from 0 in each document; needs `attention: document`)

    def validate(self, source, prefix="data."):
        if not self.path:
            raise fail(source, prefix + "path", "must not be empty")
        t = self.tokenizer
        if t not in ("bytes", *TRAINED) and Path(t).suffix not in (".json", ".model")\
                and not Path(t).expanduser().exists():
            raise fail(source, prefix + "tokenizer", f"unknown tokenizer {t!r} (bytes, {', '.join(TRAINED)}, or a "
                                                     f"tokenizer.model / tokenizer.json path)")
        if t in ("bpe", "superbpe") and self.vocab_size < 256 + len(TRAINED_SPECIALS):
            raise fail(source, prefix + "vocab_size", f"must be at least {256 + len(TRAINED_SPECIALS)} with "
                                                      f"data.tokenizer={t} (the 256 bytes and <|endoftext|>)")
        if self.sources is not None and not self.sources:
            raise fail(source, prefix + "sources", "must list at least one {path, weight} (or be null)")
        for i, s in enumerate(self.sources or []):
            if not (s.get("path") if isinstance(s, dict) else s.path):
                raise fail(source, f"{prefix}sources[{i}].path", "must be given")
        check_files(self.eval_tasks, source, prefix + "eval_tasks")
        if self.positions == "document" and self.attention != "document":
            raise fail(source, prefix + "positions", "`document` needs data.attention: document (positions that "
                                                     "restart while attention crosses documents mislead the model)")
        if self.seq_len_schedule is not None:
            k, sched = prefix + "seq_len_schedule", self.seq_len_schedule
            if not sched or any(len(stage) != 2 for stage in sched):
                raise fail(source, k, f"must be a non-empty list of [until, seq_len] pairs, got {sched}")
            untils, lens = [u for u, _ in sched], [n for _, n in sched]
            if untils[0] <= 0 or any(b <= a for a, b in zip(untils, untils[1:])):
                raise fail(source, k, f"must have increasing `until` values > 0, got {untils}")
            if lens[0] < 2 or any(b <= a for a, b in zip(lens, lens[1:])) or lens[-1] >= self.seq_len:
                raise fail(source, k, f"must have increasing window lengths >= 2 and < {prefix}seq_len={self.seq_len}, "
                                      f"got {lens}")


class TokenizedRows:
    """Rows tokenised by `tokenizer`: the model's vocabulary must cover its and `max_id` (pre-tokenized data's)."""
    max_id = -1

    def __init__(self, train: list, val: list, tokenizer):
        self.train, self.val, self.tokenizer = train, val, tokenizer

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size


def check_files(paths, source, key):
    """A list of files that must exist (checked with the config, not when first read)."""
    for f in paths or ():
        if not Path(f).expanduser().is_file():
            raise fail(source, key, f"{f}: no such file")


def tokenizer_folder(path, cache: Optional[str] = None) -> Path:
    """Where a model's tokenizer files are: its folder, or a GGUF file's, saved once to the cache as Hugging Face's."""
    p = Path(path).expanduser()
    if not (p.suffix == ".gguf" and p.is_file()):
        return p
    from zoo.weights.gguf_llm import load_tokenizer
    out = cache_dir(cache) / f"gguf-tokenizer-{files_fingerprint([p])}"
    if not (out / "tokenizer_config.json").is_file():
        try:
            load_tokenizer(p).save(out)
        except (ValueError, OSError) as e:
            raise DataError(str(e).splitlines()[0]) from None
    return out


def tokenizer_file(spec: str):
    """data.tokenizer `bytes` or a tokenizer file's path; a missing file is a one-line error."""
    if spec != "bytes" and not Path(spec).expanduser().is_file():
        raise DataError(f"{spec}: tokenizer file not found (data.tokenizer must be bytes, sentencepiece or a path "
                        f"to a tokenizer.model / tokenizer.json)")
    return load_tokenizer_file(spec if spec == "bytes" else Path(spec).expanduser())


def model_tokenizer(folder, names=("tokenizer.model", "tokenizer.json")) -> Optional[str]:
    """The tokenizer of a model folder: the first of `names` it holds, 'bytes', or None."""
    from zoo.weights import zoo_folder
    for name in names:
        if (Path(folder) / name).is_file():
            return str(Path(folder) / name)
    return "bytes" if zoo_folder.detect(folder) and zoo_folder.tokenizer_of(folder) == "bytes" else None


class SeqLenSchedule:
    """Sequence-length curriculum (`data.seq_len_schedule`): each stage's window length until its `until`
    (a step, or tokens trained), then data.seq_len; a function of the config alone, so resume agrees."""

    def __init__(self, cfg: TextDataConfig, batch_size: int, micro_batches):
        self.final = cfg.seq_len
        stages = [tuple(s) for s in cfg.seq_len_schedule or []]
        if cfg.seq_len_schedule_unit == "tokens":  # turn token counts into the first step past each
            steps, step, tokens = [], 0, 0
            for until, length in stages:
                while tokens < until:
                    tokens += batch_size * micro_batches(step) * length
                    step += 1
                steps.append((step, length))
            stages = steps
        self.stages = stages  # [(first step of the next stage, window length)]

    def __call__(self, step: int) -> int:
        return next((length for until, length in self.stages if step < until), self.final)


# ----------------------------------------------------------------------------- token data
def cache_dir(configured: Optional[str] = None) -> Path:
    """Where derived data is cached: `data.cache_dir`, $ZOO_CACHE, $XDG_CACHE_HOME/zoo or ~/.cache/zoo."""
    d = Path(configured or os.environ.get("ZOO_CACHE")
             or Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache") / "zoo").expanduser()
    d.mkdir(parents=True, exist_ok=True)
    return d


def resolve_boundary(mode: str, tokenizer, pretokenized: bool = False) -> tuple[str, Optional[int], Optional[int]]:
    """(mode in force, BOS id or None, EOS id or None) of `data.boundary` for this tokenizer."""
    bos, eos = tokenizer.bos_id, tokenizer.eos_id
    if mode == "auto":
        mode = "none" if pretokenized else "eos" if eos is not None else "bos" if bos is not None else "none"
    need = {"bos": ("BOS",), "eos": ("EOS",), "both": ("BOS", "EOS"), "none": ()}[mode]
    for name, i in (("BOS", bos), ("EOS", eos)):
        if name in need and i is None:
            raise DataError(f"data.boundary={mode}: the tokenizer ({tokenizer.model_path or tokenizer.spec[0]}) "
                            f"has no {name} token")
    return mode, (bos if "BOS" in need else None), (eos if "EOS" in need else None)


def document_ids(tokens: torch.Tensor, boundary: str, bos_id: Optional[int] = None,
                 eos_id: Optional[int] = None) -> torch.Tensor:
    """The document of each token of windows (..., T) of ids, from the window alone: int64 of the same
    shape, non-decreasing from 0 along each row. `bos` / `both` start a document at every BOS, `eos`
    ends one at every EOS (data.boundary); a row starting mid-document starts at 0; `none`: all 0."""
    if boundary not in ("none", "bos", "eos", "both"):
        raise ValueError(f"unknown document boundary {boundary!r} (supported: none, bos, eos, both)")
    if boundary == "none":
        return torch.zeros_like(tokens, dtype=torch.long)
    at = (tokens == (eos_id if boundary == "eos" else bos_id)).long()
    ids = at.cumsum(-1)
    return ids - at if boundary == "eos" else ids - at[..., :1]  # bos: the first token's own BOS opens document 0


class TokenData(TokenizedRows):
    """The tokenizer and the train/val token streams of `data.path` or `data.sources`, sampled into windows."""

    def __init__(self, cfg: TextDataConfig, tokenizer_path: Optional[str] = None, log=print, progress: bool = False):
        self.cfg, self.log, self.progress = cfg, log, progress
        self.cache = cache_dir(cfg.cache_dir)
        specs = [SourceConfig(**s) if isinstance(s, dict) else s for s in cfg.sources or [SourceConfig(cfg.path)]]
        pre = [is_pretokenized(s.path) for s in specs]
        tok_spec = tokenizer_path or cfg.tokenizer
        texts = [s.path for s, p in zip(specs, pre) if not p]
        if cfg.val_path and not is_pretokenized(cfg.val_path):
            texts.append(cfg.val_path)
        ids_only = tok_spec == "sentencepiece" and not texts  # no tokenizer: sized by the largest id below
        if any(pre) and tok_spec in TRAINED and not ids_only:
            raise DataError(f"{specs[pre.index(True)].path}: pre-tokenized ids mixed with text need the tokenizer "
                            f"they were made with (set data.tokenizer to its tokenizer.model or tokenizer.json)")
        self.tokenizer = None if ids_only else self._tokenizer(tok_spec, texts)
        self.boundary, self.bos_id, self.eos_id = (
            resolve_boundary(cfg.boundary, self.tokenizer, pretokenized=not texts) if self.tokenizer
            else (cfg.boundary if cfg.boundary != "auto" else "none", None, None))
        if self.tokenizer is None and self.boundary != "none":
            raise DataError(f"data.boundary={self.boundary}: pre-tokenized data without a tokenizer file has no "
                            f"BOS/EOS ids (set data.tokenizer)")
        parts = [self._source(s.path, p) for s, p in zip(specs, pre)]
        self.max_id = max([-1] + [self._max_id(s.path) for s, p in zip(specs, pre) if p])
        if self.tokenizer is None:
            self.tokenizer = IdsTokenizer(self.max_id + 1)
        elif self.max_id >= self.tokenizer.vocab_size:
            raise DataError(f"{cfg.sources and 'data.sources' or cfg.path}: token id {self.max_id} is outside the "
                            f"tokenizer's vocabulary of {self.tokenizer.vocab_size}")
        self._split(specs, parts)
        self.weights = torch.tensor([s.weight for s in specs], dtype=torch.float64)
        kinds = f", {len(specs)} sources" if len(specs) > 1 else ""
        log(f"data: {specs[0].path if len(specs) == 1 else 'data.sources'}: {len(self.train):,} train + {len(self.val):,} "
            f"val tokens (vocab {self.tokenizer.vocab_size}, documents separated by {self.boundary}{kinds})")

    def _tokenizer(self, spec: str, texts: list[str]):
        cfg, log = self.cfg, self.log
        if spec not in TRAINED:
            return tokenizer_file(spec)
        key = short_digest(*(fingerprint(t) for t in texts), cfg.max_chars, cfg.column, cfg.vocab_size,
                           cfg.sp_train_chars, *((cfg.superbpe_transition,) if spec == "superbpe" else ()))
        path = self.cache / TRAINED[spec].format(key)
        if path.is_file():
            try:
                load_tokenizer_file(path)
            except DataError as e:  # a damaged cache: train it again
                log(f"data: {e}; training it again")
                path.unlink()
        if not path.is_file():
            docs = (d.text for t in texts for c in chunks(documents(t, cfg.column), 1 << 20, cfg.max_chars) for d in c)
            try:
                self._train_tokenizer(spec, sample_documents(docs, cfg.sp_train_chars), path)
            except DataError as e:  # which corpus and keys: the trainer knows neither
                raise DataError(f"{', '.join(texts)} (data.tokenizer={spec}, data.vocab_size={cfg.vocab_size}): "
                                f"{e}") from None
        return load_tokenizer_file(path)

    def _train_tokenizer(self, spec: str, sample: list[str], path: Path):
        cfg, log = self.cfg, self.log
        if spec == "sentencepiece":
            train_sentencepiece(sample, cfg.vocab_size, path, log)
        else:
            transition = max(256 + len(TRAINED_SPECIALS), int(cfg.vocab_size * cfg.superbpe_transition))
            train_bpe(sample, cfg.vocab_size, path, transition if spec == "superbpe" else None, log)

    def _source(self, path: str, pretokenized: bool) -> tuple[TokenStream, object]:
        """(the source's tokens, its validation tokens or its document starts): pre-tokenized files
        read in place ((train, val or None)), or text prepared into the cache ((tokens, starts))."""
        if pretokenized:
            return pretokenized_splits(path, self.cfg.token_dtype)
        shards = self._prepared(path)
        starts = np.concatenate([s + off for s, off in zip(shards.doc_starts, np.cumsum(
            [0] + [len(t) for t in shards.tokens])[:-1])]) if shards.doc_starts else np.zeros(0, np.int64)
        return TokenStream(shards.tokens), starts

    def _max_id(self, path: str) -> int:
        """The largest id of pre-tokenized files (a pass over them, cached under their fingerprint)."""
        key = short_digest(files_fingerprint(token_files(path)), self.cfg.token_dtype)
        cached = self.cache / f"max-id-{key}.txt"
        if cached.is_file():
            return int(cached.read_text())
        train, val = pretokenized_splits(path, self.cfg.token_dtype)
        m = max(train.max_id(), val.max_id() if val is not None else -1)
        atomic_write(cached, str(m))
        return m

    def _prepared(self, path: str) -> Shards:
        cfg, tok = self.cfg, self.tokenizer
        tok_key = "bytes" if tok.spec[0] == "bytes" else hashlib.sha256(
            Path(tok.model_path).read_bytes()).hexdigest()[:16]
        out = self.cache / f"tokens-{short_digest(fingerprint(path), cfg.column, cfg.max_chars, tok_key, self.bos_id, self.eos_id, cfg.shard_tokens)}"
        if (m := read_manifest(out)) and m.get("complete"):
            for s in m["shards"]:  # a damaged cache (a truncated or missing shard) is prepared again
                f, want = out / s["name"], s["tokens"] * np.dtype(m["dtype"]).itemsize
                have = f.stat().st_size if f.is_file() else 0
                if have != want:
                    self.log(f"data: {f}: truncated token cache ({have} bytes, {want} expected); rebuilding it")
                    shutil.rmtree(out)
                    break
        return prepare_shards(path, tok, out, column=cfg.column, max_chars=cfg.max_chars, boundary=(self.bos_id, self.eos_id),
                       workers=cfg.workers, shard_tokens=cfg.shard_tokens, progress=self.progress, log=self.log)

    def _split(self, specs, parts):
        """self.mixture (each source's training tokens), self.train (all of them) and self.val."""
        cfg, T = self.cfg, self.cfg.seq_len
        trains, vals = [], []
        for stream, extra in parts:
            if cfg.val_path or isinstance(extra, TokenStream):
                trains.append(stream)
                vals.append(extra)
            else:  # the held-out tail, from its first document start (pre-tokenized without val files: none)
                n = len(stream)
                cut = n - max(int(n * cfg.val_fraction), T + 1)
                later = extra[extra >= cut] if extra is not None else []
                if len(later) and n - int(later[0]) >= T + 1:
                    cut = int(later[0])
                trains.append(stream.sub(0, cut))
                vals.append(stream.sub(cut, n))
        if cfg.val_path:
            pre = is_pretokenized(cfg.val_path)
            v = self._source(cfg.val_path, pre)
            vals = [TokenStream([*v[0].parts, *(v[1].parts if pre and v[1] is not None else [])])]
        for s, t, (stream, _) in zip(specs, trains, parts):
            if len(t) < T + 1:
                raise DataError(f"{s.path}: {len(stream)} tokens ({len(t)} for training) is too short for "
                                f"data.seq_len={T} (need more than {2 * (T + 1)} for a training and a validation window)")
        self.mixture, self.train = trains, TokenStream([p for t in trains for p in t.parts])
        self.val = TokenStream([p for v in vals for p in v.parts])
        if len(self.val) < T + 1:
            raise DataError(f"{cfg.val_path or cfg.path}: {len(self.val)} validation tokens is too short for "
                            f"data.seq_len={T}")

    def document_ids(self, tokens: torch.Tensor) -> torch.Tensor:
        """The document of each token of windows (..., T) (the contract in the module docstring)."""
        return document_ids(tokens, self.boundary, self.bos_id, self.eos_id)

    def unigram_entropy(self, sample_tokens: int = 1 << 26) -> float:
        """The training tokens' unigram entropy (nats/token: a context-free model's best loss), on spread blocks."""
        counts, n = np.zeros(self.vocab_size, dtype=np.float64), len(self.train)
        size = sample_tokens // 64
        blocks = self.train.blocks() if n <= sample_tokens else (
            self.train[i:i + size] for i in np.linspace(0, n - size, 64).astype(np.int64).tolist())
        for b in blocks:
            counts += np.bincount(b, minlength=self.vocab_size)
        p = counts[counts > 0] / counts.sum()
        return float(-(p * np.log(p)).sum())

    def windows(self, split: str, batch_size: int, generator: torch.Generator, seq_len: Optional[int] = None,
                rows: Optional[slice] = None, pin: bool = False) -> torch.Tensor:
        """Random windows (B, T + 1) of ids on the CPU (pinned when `pin`), each window's source drawn by
        weight in a mixture; rows: only those of a rank's part of the batch."""
        T = seq_len or self.cfg.seq_len
        if split == "train" and len(self.mixture) > 1:
            src = torch.multinomial(self.weights, batch_size, replacement=True, generator=generator).tolist()
            picks = [(d, int(torch.randint(0, len(d) - T, (1,), generator=generator, device=generator.device)))
                     for d in (self.mixture[k] for k in src)]
        else:
            data = self.train if split == "train" else self.val
            picks = [(data, s) for s in torch.randint(0, len(data) - T, (batch_size,), generator=generator,
                                                    device=generator.device).tolist()]
        if rows is not None:
            picks = picks[rows]
        xy = torch.from_numpy(np.stack([np.asarray(d[s:s + T + 1], dtype=np.int64) for d, s in picks]))
        return xy.pin_memory() if pin else xy

    def batch(self, split: str, batch_size: int, generator: torch.Generator, device,
              seq_len: Optional[int] = None, rows: Optional[slice] = None) -> tuple:
        """Random windows (B, T) of inputs and next-token targets on `device`; T = seq_len or data.seq_len."""
        xy = self.windows(split, batch_size, generator, seq_len, rows, pin=device.type == "cuda")
        xy = xy.to(device, non_blocking=True)
        return xy[:, :-1], xy[:, 1:]

    def val_batches(self, batch_size: int, n_batches: int):
        """Fixed, non-overlapping validation windows (the same every evaluation)."""
        T = self.cfg.seq_len
        n_windows = (len(self.val) - 1) // T
        for s in range(0, min(n_windows, n_batches * batch_size), batch_size):
            xy = torch.from_numpy(np.stack([np.asarray(self.val[i * T:i * T + T + 1], dtype=np.int64)
                                            for i in range(s, min(s + batch_size, n_windows))]))
            yield xy[:, :-1], xy[:, 1:]
