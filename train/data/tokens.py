"""Token streams: memory-mapped token files read as one sequence, and pre-tokenized inputs read in place.

Pre-tokenized formats (`data.path` a file, folder or glob; never copied): nanoGPT's raw `train.bin`
(uint16, or `data.token_dtype: uint32`) with `val.bin` beside it, and llm.c / modded-nanogpt shards
(a 256 x int32 header, then uint16 ids), files named with `val` being the validation split."""
from __future__ import annotations

import glob
import json
import re
from pathlib import Path
from typing import Optional

import numpy as np

from .sources import DataError

LLMC_MAGIC, LLMC_VERSION, LLMC_HEADER_INTS = 20240520, 1, 256
TOKEN_SUFFIX = ".bin"
_VAL = re.compile(r"(^|[^a-z])val([^a-z]|$)")


class TokenStream:
    """Token arrays (memmaps) read as one sequence without copying them: len(), slices (a copy
    only when a slice spans two arrays), `sub(a, b)` (a view), np.asarray (a copy of all)."""

    def __init__(self, parts: list[np.ndarray]):
        self.parts = [p for p in parts if len(p)]
        self.offsets = np.cumsum([0] + [len(p) for p in self.parts])
        self.dtype = self.parts[0].dtype if self.parts else np.dtype(np.uint16)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getitem__(self, s: slice) -> np.ndarray:
        a, b, _ = s.indices(len(self))
        if b <= a:
            return np.zeros(0, self.dtype)
        k = int(np.searchsorted(self.offsets, a, side="right")) - 1
        off = int(self.offsets[k])
        if b <= self.offsets[k + 1]:
            return self.parts[k][a - off:b - off]
        return np.concatenate([p[:] for p in self.sub(a, b).parts])

    def sub(self, a: int, b: int) -> "TokenStream":
        """Tokens [a, b) as a stream of views."""
        bounds = zip(self.parts, self.offsets[:-1].tolist(), self.offsets[1:].tolist())
        return TokenStream([p[max(a, lo) - lo:min(b, hi) - lo] for p, lo, hi in bounds if hi > a and lo < b])

    def __array__(self, dtype=None, copy=None):
        whole = np.concatenate([np.asarray(p) for p in self.parts]) if self.parts else np.zeros(0, self.dtype)
        return whole if dtype is None else whole.astype(dtype)

    def blocks(self, size: int = 1 << 24):
        """The tokens in consecutive arrays of at most `size` (for a pass in bounded memory)."""
        for p in self.parts:
            for i in range(0, len(p), size):
                yield p[i:i + size]

    def max_id(self) -> int:
        return max((int(b.max()) for b in self.blocks()), default=-1)


def prepared_dtype(path: str) -> Optional[str]:
    """The token dtype recorded in the manifest.json of a folder train/data/shards.py prepared, else None."""
    manifest = Path(path).expanduser() / "manifest.json"
    return json.loads(manifest.read_text()).get("dtype") if manifest.is_file() else None


def is_pretokenized(path: str) -> bool:
    """A .bin file, a glob of them, or a folder holding .bin files only (a prepared folder's manifest.json and
    .docs.npy document index aside)."""
    if any(c in path for c in "*?["):
        return True
    p = Path(path).expanduser()
    if p.is_file():
        return p.suffix == TOKEN_SUFFIX
    if p.is_dir():
        files = [f for f in p.iterdir() if f.is_file() and not f.name.startswith(".")
                 and f.name != "manifest.json" and not f.name.endswith(".docs.npy")]
        return bool(files) and all(f.suffix == TOKEN_SUFFIX for f in files)
    return False


def token_files(path: str) -> list[Path]:
    if any(c in path for c in "*?["):
        files = sorted(Path(f) for f in glob.glob(str(Path(path).expanduser()), recursive=True))
    else:
        p = Path(path).expanduser()
        files = sorted(p.glob(f"*{TOKEN_SUFFIX}")) if p.is_dir() else [p]
    files = [f for f in files if f.is_file()]
    if not files:
        raise DataError(f"{path}: no token files (.bin) found")
    return files


def read_token_file(f: Path, dtype: str = "uint16") -> np.ndarray:
    """The ids of one token file as a memmap: an llm.c shard (by its magic number) or raw `dtype` ids."""
    size = f.stat().st_size
    with open(f, "rb") as fh:
        head = np.frombuffer(fh.read(4 * LLMC_HEADER_INTS), dtype="<i4")
    if len(head) == LLMC_HEADER_INTS and head[0] == LLMC_MAGIC:
        if head[1] != LLMC_VERSION:
            raise DataError(f"{f}: llm.c shard version {head[1]}, only {LLMC_VERSION} is read")
        n, off = int(head[2]), 4 * LLMC_HEADER_INTS
        if size < off + 2 * n:
            raise DataError(f"{f}: llm.c shard truncated ({size} bytes for a header saying {n:,} tokens)")
        return np.memmap(f, dtype="<u2", mode="r", offset=off, shape=(n,)) if n else np.zeros(0, np.uint16)
    if size % (item := np.dtype(dtype).itemsize):
        raise DataError(f"{f}: {size} bytes is not a whole number of {dtype} tokens (data.token_dtype)")
    return np.memmap(f, dtype=dtype, mode="r") if size else np.zeros(0, dtype)


def pretokenized_splits(path: str, dtype: str = "uint16") -> tuple[TokenStream, Optional[TokenStream]]:
    """(train, val or None) of pre-tokenized files: those named like `val`, or a val.bin beside a train.bin."""
    files, dtype = token_files(path), prepared_dtype(path) or dtype
    val = [f for f in files if _VAL.search(f.stem.lower())]
    train = [f for f in files if f not in val]
    if len(files) == 1 and not val and (files[0].parent / "val.bin").is_file():
        val = [files[0].parent / "val.bin"]
    if not train:
        raise DataError(f"{path}: only validation token files (named like 'val') found")
    t = TokenStream([read_token_file(f, dtype) for f in train])
    return t, TokenStream([read_token_file(f, dtype) for f in val]) if val else None
