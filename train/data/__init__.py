"""Text data for language models: corpus reading, tokenizers, token memmaps, random windows.

Sources (`data.path`): a text file, a folder of .txt files, a .jsonl file with a "text"
field per line, or `stdlib`: the Python standard library's own .py files, a corpus every
machine with Python has (the embedded default; no download).

Tokenizers (`data.tokenizer`): `bytes` (vocab 256, no setup), `sentencepiece` (trained on
the corpus with `data.vocab_size` and cached), or a path to a sentencepiece tokenizer.model
or a Hugging Face tokenizer.json.

The corpus is tokenised once into a uint16/uint32 memmap cached in `data.cache_dir` (default:
the user cache directory, never beside the corpus); the last `data.val_fraction` of the tokens is held out for validation.
Training batches are random windows drawn from a generator seeded by (seed, step, micro),
so any step's batch can be rebuilt exactly on resume.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

import numpy as np
import torch

from zoo.config import bounded, fail
from zoo.weights.files import atomic_write

TEXT_SUFFIXES = (".txt", ".md", ".py", ".text")


@dataclass
class TextDataConfig:
    path: str = "stdlib"                    # a text file, a folder of .txt files, a .jsonl file with a `"text"` field
                                            # per line, or `stdlib` (the Python standard library's .py files: the
                                            # embedded default)
    tokenizer: str = "sentencepiece"        # `bytes` (vocab 256), `sentencepiece` (BPE trained on the corpus,
                                            # cached), or a path to a sentencepiece `tokenizer.model` or a Hugging
                                            # Face `tokenizer.json`; with `train.init_from`, `sentencepiece` means the
                                            # checkpoint's own tokenizer (`tokenizer.model`, else `tokenizer.json`)
    vocab_size: int = bounded(2048, ge=16, le=2**31)  # vocabulary of the trained sentencepiece tokenizer
    seq_len: int = bounded(256, ge=2)       # tokens per training window; <= `model.max_seq_len`
    seq_len_schedule: Optional[list[list[int]]] = None  # sequence-length curriculum: `[[until, seq_len], ...]`,
                                            # shorter windows first: windows of each stage's length until its `until`,
                                            # then `seq_len` (e.g. `[[1000, 64], [3000, 128]]`); lengths increasing
                                            # and < `seq_len`. The window of a step follows from the config alone, so
                                            # a resumed run gets the same ones; the log names each change
    seq_len_schedule_unit: Literal["steps", "tokens"] = "steps"  # what `until` counts: `steps`, or `tokens` trained
                                            # before the step (batch_size x micro-batches x window, step by step)
    val_fraction: float = bounded(0.05, gt=0, lt=1)  # the held-out tail of the token stream used for validation
    cache_dir: Optional[str] = None         # where the tokenizer and the token memmap are cached; null =
                                            # `$ZOO_CACHE`, else the user cache directory (`$XDG_CACHE_HOME/zoo` or
                                            # `~/.cache/zoo`); never beside your data
    max_chars: Optional[int] = bounded(None, gt=0)  # read at most this many characters of the corpus
    sp_train_chars: int = bounded(4_000_000, gt=0)  # characters of the corpus used to train sentencepiece

    def validate(self, source, prefix="data."):
        if not self.path:
            raise fail(source, prefix + "path", "must not be empty")
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


class DataError(ValueError):
    """Bad data: one line naming the file."""


# ----------------------------------------------------------------------------- corpus
def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.glob("*.py") if p.is_file())


def corpus_files(path: str) -> list[Path]:
    if path == "stdlib":
        return stdlib_files()
    p = Path(path).expanduser()
    if p.is_file():
        return [p]
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in TEXT_SUFFIXES + (".jsonl",))
        if not files:
            raise DataError(f"{path}: folder holds no .txt/.jsonl files")
        return files
    raise DataError(f"{path}: no such file or folder")


_UNDECODED = re.compile("[\udc80-\udcff]")  # surrogateescape's stand-ins for undecodable bytes


def _read_text(f: Path, problems: list) -> str:
    """UTF-8 text of `f`; every undecodable byte becomes U+FFFD and is counted."""
    try:
        raw = f.read_bytes()
    except OSError as e:
        raise DataError(f"{f}: cannot be read ({e.strerror or e})") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        text, n = _UNDECODED.subn("\ufffd", raw.decode("utf-8", errors="surrogateescape"))
        problems.append(f"{f}: {n} undecodable bytes replaced with U+FFFD")
        return text


def read_corpus(path: str, max_chars: Optional[int] = None, log=print) -> str:
    """All documents of the source joined by blank lines. Undecodable bytes are replaced
    (and counted); bad .jsonl lines are skipped (and counted); an empty corpus is an error."""
    parts, problems, total = [], [], 0
    for f in corpus_files(path):
        if f.suffix == ".jsonl":
            bad = 0
            for i, line in enumerate(_read_text(f, problems).splitlines()):
                if not line.strip():
                    continue
                try:
                    text = json.loads(line)["text"]
                    if not isinstance(text, str):
                        raise TypeError
                except (ValueError, KeyError, TypeError):
                    bad += 1
                    continue
                parts.append(text)
                total += len(text)
            if bad:
                problems.append(f"{f}: {bad} bad jsonl lines (skipped)")
        else:
            text = _read_text(f, problems)
            parts.append(text)
            total += len(text)
        if max_chars is not None and total >= max_chars:
            break
    for msg in problems[:20]:
        log(f"data: {msg}")
    if len(problems) > 20:
        log(f"data: {path}: {len(problems) - 20} more files with undecodable bytes or bad lines")
    text = "\n\n".join(parts)
    if max_chars is not None:
        text = text[:max_chars]
    if not text.strip():
        why = f" ({problems[0]})" if problems else ""
        raise DataError(f"{path}: the corpus is empty{why}")
    return text


# ----------------------------------------------------------------------------- tokenizers
class ByteTokenizer:
    vocab_size = 256
    bos_id = eos_id = None
    model_path = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class SentencePieceTokenizer:
    def __init__(self, model_path):
        import sentencepiece as spm
        self.model_path = str(model_path)
        try:
            self.sp = spm.SentencePieceProcessor(model_file=self.model_path)
        except Exception as e:
            raise DataError(f"{model_path}: not a readable sentencepiece model ({str(e).splitlines()[0] if str(e) else e})") from None
        self.vocab_size = self.sp.get_piece_size()
        self.bos_id = self.sp.bos_id() if self.sp.bos_id() >= 0 else None
        self.eos_id = self.sp.eos_id() if self.sp.eos_id() >= 0 else None

    def encode(self, text: str) -> list[int]:
        return self.sp.encode(text)

    def encode_many(self, texts: list[str]) -> list[list[int]]:
        return self.sp.encode(texts, num_threads=os.cpu_count() or 1)

    def decode(self, ids) -> str:
        return self.sp.decode([int(i) for i in ids])


class HFTokenizer:
    """A Hugging Face tokenizer.json (Llama 3, Qwen2, ... ship only this), via `tokenizers`."""

    def __init__(self, path):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise DataError(f"{path}: reading tokenizer.json needs the 'tokenizers' package") from None
        self.model_path = str(path)
        try:
            self.tok = Tokenizer.from_file(self.model_path)
        except Exception as e:
            raise DataError(f"{path}: not a readable tokenizer.json ({str(e).splitlines()[0] if str(e) else e})") from None
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        self.bos_id = self.eos_id = None

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_many(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)


def load_tokenizer_file(path):
    """tokenizer.json -> HFTokenizer; anything else is read as a sentencepiece model."""
    return HFTokenizer(path) if Path(path).suffix == ".json" else SentencePieceTokenizer(path)


def train_sentencepiece(text: str, vocab_size: int, out_path: Path, train_chars: int, log=print) -> Path:
    """Train a BPE sentencepiece model on (a sample of) the corpus, with byte fallback so any
    text round-trips. Written atomically to out_path."""
    import sentencepiece as spm
    lines = [ln for ln in text[:train_chars].splitlines() if ln.strip()]
    if not lines:
        raise DataError("cannot train a tokenizer: the corpus has no non-empty lines")
    log(f"data: training a sentencepiece tokenizer (vocab {vocab_size}) on {min(len(text), train_chars):,} chars")
    buf = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(lines), model_writer=buf, vocab_size=vocab_size, model_type="bpe",
            byte_fallback=True, character_coverage=0.9995, split_digits=True, allow_whitespace_only_pieces=True,
            remove_extra_whitespaces=False, normalization_rule_name="identity", max_sentence_length=1 << 16,
            num_threads=os.cpu_count() or 1, minloglevel=2, bos_id=-1, eos_id=-1, pad_id=-1, unk_id=0)
    except RuntimeError as e:
        raise DataError(f"cannot train a sentencepiece tokenizer with vocab_size={vocab_size}: "
                        f"{str(e).splitlines()[0]}") from None
    atomic_write(out_path, buf.getvalue())
    return out_path


# ----------------------------------------------------------------------------- curriculum
class SeqLenSchedule:
    """Sequence-length curriculum (`data.seq_len_schedule`): windows of each stage's length until its
    `until` (a step, or a number of tokens trained), then data.seq_len. With tokens, the stage of a
    step follows from the tokens of the steps before it (batch_size x micro-batches x window), so
    the window of any step is a function of the config alone and a resumed run gets the same ones."""

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
        for until, length in self.stages:
            if step < until:
                return length
        return self.final


# ----------------------------------------------------------------------------- token streams
def cache_dir(configured: Optional[str] = None) -> Path:
    """Where derived data (tokenizers, token streams, trained autoencoders, latents) is cached: the
    configured folder (`data.cache_dir`), else $ZOO_CACHE, else the user cache directory
    ($XDG_CACHE_HOME/zoo or ~/.cache/zoo). Never beside the user's own data."""
    if configured:
        d = Path(configured).expanduser()
    elif os.environ.get("ZOO_CACHE"):
        d = Path(os.environ["ZOO_CACHE"]).expanduser()
    else:
        d = Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "zoo"
    d.mkdir(parents=True, exist_ok=True)
    return d


def _fingerprint(path: str) -> str:
    h = hashlib.sha256()
    for f in corpus_files(path):
        st = f.stat()
        h.update(f"{f.resolve()}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


class TokenData:
    """Train/val token memmaps plus the tokenizer."""

    def __init__(self, cfg: TextDataConfig, tokenizer_path: Optional[str] = None, log=print):
        self.cfg = cfg
        cache = cache_dir(cfg.cache_dir)
        fp = _fingerprint(cfg.path)
        tok_spec = tokenizer_path or cfg.tokenizer
        if tok_spec == "bytes":
            self.tokenizer, tok_key = ByteTokenizer(), "bytes"
        elif tok_spec == "sentencepiece":
            sp_path = cache / f"sp-{fp}-{cfg.max_chars}-{cfg.vocab_size}.model"
            if sp_path.is_file():
                try:
                    SentencePieceTokenizer(sp_path)
                except DataError as e:  # a damaged cache: train it again
                    log(f"data: {e}; training it again")
                    sp_path.unlink()
            if not sp_path.is_file():
                train_sentencepiece(read_corpus(cfg.path, cfg.max_chars, log), cfg.vocab_size, sp_path,
                                    cfg.sp_train_chars, log)
            # tokens are cached under the model's content, so a retrained tokenizer never meets stale tokens
            self.tokenizer = SentencePieceTokenizer(sp_path)
            tok_key = hashlib.sha256(sp_path.read_bytes()).hexdigest()[:16]
        else:
            p = Path(tok_spec).expanduser()
            if not p.is_file():
                raise DataError(f"{tok_spec}: tokenizer file not found (data.tokenizer must be bytes, "
                                f"sentencepiece or a path to a tokenizer.model / tokenizer.json)")
            self.tokenizer = load_tokenizer_file(p)
            tok_key = hashlib.sha256(p.read_bytes()).hexdigest()[:16]
        key = hashlib.sha256(f"{fp}:{cfg.max_chars}:{tok_key}".encode()).hexdigest()[:16]
        bin_path = cache / f"tokens-{key}.bin"
        dtype = np.uint16 if self.tokenizer.vocab_size <= 65536 else np.uint32
        if bin_path.is_file() and bin_path.stat().st_size % np.dtype(dtype).itemsize:
            log(f"data: {bin_path}: truncated token cache ({bin_path.stat().st_size} bytes); rebuilding it")
            bin_path.unlink()
        if not bin_path.is_file():
            self._tokenize(bin_path, log)
        tokens = np.memmap(bin_path, dtype=dtype, mode="r")
        n_val = max(int(len(tokens) * cfg.val_fraction), cfg.seq_len + 1)
        if len(tokens) - n_val < cfg.seq_len + 1:
            raise DataError(f"{cfg.path}: {len(tokens)} tokens is too short for data.seq_len={cfg.seq_len} "
                            f"(need more than {2 * (cfg.seq_len + 1)} for a training and a validation window)")
        self.train, self.val = tokens[:-n_val], tokens[-n_val:]
        self.bin_path = bin_path
        log(f"data: {cfg.path}: {len(self.train):,} train + {len(self.val):,} val tokens "
            f"(vocab {self.tokenizer.vocab_size}, cache {bin_path})")

    def _tokenize(self, bin_path: Path, log):
        text = read_corpus(self.cfg.path, self.cfg.max_chars, log)
        log(f"data: tokenising {len(text):,} chars")
        docs = text.split("\n\n")
        if hasattr(self.tokenizer, "encode_many"):
            ids = [i for d in self.tokenizer.encode_many([d + "\n\n" for d in docs]) for i in d]
        else:
            ids = self.tokenizer.encode(text)
        dtype = np.uint16 if self.tokenizer.vocab_size <= 65536 else np.uint32
        arr = np.asarray(ids, dtype=dtype)
        atomic_write(bin_path, arr.tofile)

    def unigram_entropy(self) -> float:
        """Entropy (nats/token) of the training tokens' unigram distribution: the loss of the
        best model that ignores context."""
        counts = np.bincount(np.asarray(self.train), minlength=self.tokenizer.vocab_size).astype(np.float64)
        p = counts[counts > 0] / counts.sum()
        return float(-(p * np.log(p)).sum())

    def batch(self, split: str, batch_size: int, generator: torch.Generator, device,
              seq_len: Optional[int] = None, rows: Optional[slice] = None) -> tuple:
        """Random windows (B, T) of inputs and next-token targets; T = seq_len or data.seq_len.
        rows: only those of the batch_size windows drawn (a rank's part of a global batch)."""
        data = self.train if split == "train" else self.val
        T = seq_len or self.cfg.seq_len
        starts = torch.randint(0, len(data) - T, (batch_size,), generator=generator).tolist()
        if rows is not None:
            starts = starts[rows]
        rows = np.stack([np.asarray(data[s:s + T + 1], dtype=np.int64) for s in starts])
        xy = torch.from_numpy(rows)
        if device.type == "cuda":
            xy = xy.pin_memory().to(device, non_blocking=True)
        else:
            xy = xy.to(device)
        return xy[:, :-1], xy[:, 1:]

    def val_batches(self, batch_size: int, n_batches: int):
        """Fixed, non-overlapping validation windows (the same every evaluation)."""
        T = self.cfg.seq_len
        n_windows = (len(self.val) - 1) // T
        idx = 0
        for _ in range(n_batches):
            if idx >= n_windows:
                return
            rows = []
            while len(rows) < batch_size and idx < n_windows:
                rows.append(np.asarray(self.val[idx * T: idx * T + T + 1], dtype=np.int64))
                idx += 1
            xy = torch.from_numpy(np.stack(rows))
            yield xy[:, :-1], xy[:, 1:]
