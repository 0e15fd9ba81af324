"""Streaming preparation: a text source -> sharded token files and a document index, in bounded memory.

Worker processes tokenise chunks, the main process writes them in order to shards (shard-NNNNN.bin,
shard-NNNNN.docs.npy, manifest.json); at most two chunks per worker in flight. Kill-safe: a rerun
drops what the manifest does not list and goes on, with the same bytes as an uninterrupted run."""
from __future__ import annotations

import contextlib
import gc
import itertools
import json
import multiprocessing as mp
import os
import shutil
import sys
import time
from collections import deque
from pathlib import Path
from typing import Iterator, Optional

import numpy as np

from zoo.weights.files import atomic_write

from .sources import DataError, Doc, Problems, corpus_files, documents
from .text_tokenizers import load_tokenizer_file

MANIFEST, VERSION = "manifest.json", 1


def token_dtype(vocab_size: int):
    return np.dtype(np.uint16 if vocab_size <= 65536 else np.uint32)


# ----------------------------------------------------------------------------- chunks
def chunks(docs: Iterator[Doc], chunk_chars: int, max_chars: Optional[int]) -> Iterator[list[Doc]]:
    """Documents grouped into chunks of about chunk_chars (a function of the source); max_chars in all."""
    chunk, size, total = [], 0, 0
    for d in docs:
        if max_chars is not None and total + len(d.text) >= max_chars:
            d = Doc(d.text[:max_chars - total], d.first, True)
        chunk.append(d)
        size += len(d.text)
        total += len(d.text)
        if size >= chunk_chars:
            yield chunk
            chunk, size = [], 0
        if max_chars is not None and total >= max_chars:
            break
    if chunk:
        yield chunk


_worker_tok = None


def _init_worker(spec):
    global _worker_tok
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker: the workers are the parallelism
    _worker_tok = load_tokenizer_file(spec[1] or "bytes", threads=1)  # spec: (kind, file)


def pack(chunk: list[Doc]) -> tuple[list[str], np.ndarray, np.ndarray]:
    """A chunk as a worker gets it: its texts, and whether each starts and ends its document."""
    return ([d.text for d in chunk], np.fromiter((d.first for d in chunk), bool, len(chunk)),
            np.fromiter((d.last for d in chunk), bool, len(chunk)))


def encode_chunk(chunk, bos: Optional[int], eos: Optional[int], dtype, tok=None):
    """(tokens, document starts) of a packed chunk, with BOS before a document's first piece and EOS after its last."""
    texts, first, last = chunk
    ids = (tok or _worker_tok).encode_many(texts)
    n = np.fromiter(map(len, ids), np.int64, len(ids))
    flat = np.frombuffer(b"".join(ids), np.uint8) if ids and isinstance(ids[0], bytes) else \
        np.fromiter(itertools.chain.from_iterable(ids), dtype, int(n.sum()))
    head, tail = first & (bos is not None), last & (eos is not None)
    ends = np.cumsum(n + head + tail)
    begins = ends - n - head - tail
    out = np.empty(int(ends[-1]) if len(ends) else 0, dtype)
    keep = np.ones(len(out), bool)
    for at, special in ((begins[head], bos), (ends[tail] - 1, eos)):
        if len(at):
            out[at], keep[at] = special, False
    out[keep] = flat
    return out, begins[first]


# ----------------------------------------------------------------------------- shards
class Shards:
    """The complete shards of a prepared folder: memmaps of tokens and their document starts."""

    def __init__(self, out: Path):
        self.out = Path(out)
        m = read_manifest(self.out)
        if not m or not m.get("complete"):
            raise DataError(f"{out}: preparation not complete")
        self.manifest, self.dtype = m, np.dtype(m["dtype"])
        self.files = [self.out / s["name"] for s in m["shards"]]
        self.tokens = [np.memmap(f, dtype=self.dtype, mode="r") if f.stat().st_size else np.zeros(0, self.dtype)
                       for f in self.files]
        self.doc_starts = [np.load(f.with_suffix(".docs.npy")) for f in self.files]


def read_record(path: Path, **want) -> Optional[dict]:
    """The JSON file at `path` when it is readable and holds `want`'s values (its version, its key), else None."""
    try:
        record = json.loads(Path(path).read_text())
        return record if all(record.get(k) == v for k, v in want.items()) else None
    except (OSError, ValueError):
        return None


def read_manifest(out: Path) -> Optional[dict]:
    return read_record(Path(out) / MANIFEST, version=VERSION)


class _Writer:
    """Appends chunks to the current shard (a temporary file) and commits whole shards."""

    def __init__(self, out: Path, meta: dict, shard_tokens: int, resume: Optional[dict]):
        self.out, self.meta, self.shard_tokens = out, meta, shard_tokens
        self.shards = list(resume["shards"]) if resume else []
        self.chunks_done = resume["chunks"] if resume else 0
        self._open()

    def _open(self):
        self.name = f"shard-{len(self.shards):05d}.bin"
        self.tmp = self.out / (self.name + ".tmp")
        self.fh = open(self.tmp, "wb")
        self.n, self.starts = 0, []

    def add(self, tokens: np.ndarray, starts: np.ndarray):
        self.fh.write(memoryview(tokens).cast("B"))
        self.starts.append(starts + self.n)
        self.n += len(tokens)
        self.chunks_done += 1
        if self.n >= self.shard_tokens:
            self.commit()
            self._open()

    def commit(self, complete: bool = False, extra: Optional[dict] = None):
        """The shard made whole (renamed), then the manifest rewritten to list it."""
        self.fh.flush()
        os.fsync(self.fh.fileno())
        self.fh.close()
        if self.n or not self.shards:
            final = self.out / self.name
            starts = np.concatenate(self.starts) if self.starts else np.zeros(0, np.int64)
            atomic_write(final.with_suffix(".docs.npy"), lambda f: np.save(f, starts))
            os.replace(self.tmp, final)
            self.shards.append({"name": self.name, "tokens": self.n, "docs": int(len(starts))})
        else:
            self.tmp.unlink()
        m = {**self.meta, "shards": self.shards, "chunks": self.chunks_done, "complete": complete, **(extra or {})}
        atomic_write(self.out / MANIFEST, json.dumps(m, indent=1))


def prepare(source: str, tokenizer, out: Path, *, column: str = "text", max_chars: Optional[int] = None,
            boundary: tuple = (None, None), workers: int = 0, chunk_chars: int = 1 << 20,
            shard_tokens: int = 1 << 28, progress: bool = False, log=print) -> Shards:
    """Prepare `source` into the folder `out` (resumed after a kill) unless complete already. boundary: the (BOS,
    EOS) ids put around each document (None: not put). workers: tokenising processes (0: one per core)."""
    out = Path(out)
    done = read_manifest(out)
    if done and done.get("complete"):
        return Shards(out)
    out.mkdir(parents=True, exist_ok=True)
    with exclusive(out):  # one preparer at a time (torchrun's ranks)
        done = read_manifest(out)
        if done and done.get("complete"):  # another process prepared it while this one waited
            return Shards(out)
        bos, eos = boundary
        dtype = token_dtype(tokenizer.vocab_size)
        meta = {"version": VERSION, "source": source, "dtype": dtype.name, "vocab_size": tokenizer.vocab_size,
                "bos_id": bos, "eos_id": eos, "chunk_chars": chunk_chars, "shard_tokens": shard_tokens}
        resume = done if done and all(done.get(k) == v for k, v in meta.items()) else None
        listed = {s["name"] for s in resume["shards"]} if resume else set()
        for f in out.iterdir():  # what a killed run left and the manifest does not list
            if f.name != MANIFEST and f.name.split(".")[0] + ".bin" not in listed:
                shutil.rmtree(f) if f.is_dir() else f.unlink()
        if resume is None:
            (out / MANIFEST).unlink(missing_ok=True)
        skip = resume["chunks"] if resume else 0
        if resume:
            log(f"data: resuming the preparation of {source} after {len(listed)} shards ({skip} chunks)")
        workers = workers or os.cpu_count() or 1
        total_bytes, problems = sum(f.stat().st_size for f in corpus_files(source)), Problems()
        writer = _Writer(out, meta, shard_tokens, resume)
        bar, t0 = _Progress(total_bytes, max_chars, progress, workers, skip), time.perf_counter()
        pool, frozen = None, False
        try:
            it = chunks(documents(source, column, problems), chunk_chars, max_chars)
            deque(itertools.islice(it, skip), maxlen=0)  # chunks already in the shards: read again, not tokenised
            it = map(pack, it)
            if workers == 1:
                tok = load_tokenizer_file(tokenizer.spec[1], threads=1) if tokenizer.spec[0] != "bytes" else tokenizer
                results = (((encode_chunk(c, bos, eos, dtype, tok)), c) for c in it)
            else:
                ctx = mp.get_context("fork" if sys.platform.startswith("linux") else "spawn")
                frozen = _freeze_gc()
                pool = ctx.Pool(workers, initializer=_init_worker, initargs=(tokenizer.spec,))
                results = _ordered(pool, it, bos, eos, dtype, 2 * workers)
            for (tokens, starts), chunk in results:
                writer.add(tokens, starts)
                bar.update(chunk, len(tokens))
            n_tokens = sum(s["tokens"] for s in writer.shards) + writer.n
            n_docs = sum(s["docs"] for s in writer.shards) + sum(len(s) for s in writer.starts)
            summary = problems.summary(source)
            if n_tokens == 0 or n_docs == 0:
                raise DataError(f"{source}: the corpus is empty"
                                + (f" ({summary.split(': ', 2)[2]})" if summary else ""))
            writer.commit(complete=True, extra={"tokens": n_tokens, "documents": n_docs,
                                                "problems": dict(problems.counts), "summary": summary})
        finally:
            if pool is not None:
                pool.terminate()
                pool.join()
            if frozen:
                gc.unfreeze()
            bar.close()
            if not writer.fh.closed:
                writer.fh.close()
        if summary:
            log(summary)
        secs = time.perf_counter() - t0
        log(f"data: prepared {source}: {n_docs:,} documents, {n_tokens:,} tokens in {len(writer.shards)} shards "
            f"({secs:.1f} s, {n_tokens / max(secs, 1e-9):,.0f} tokens/s) -> {out}")
        return Shards(out)


def _freeze_gc() -> bool:
    """Keep the cyclic GC off the objects that exist before the workers fork: a full collection in this process
    writes to every object's header, copying the pages it shares with the workers (a step of the memory that
    longer preparations reached). False, and nothing done, when the caller has frozen objects of its own (unfreezing would thaw them)."""
    if gc.get_freeze_count():
        return False
    gc.freeze()
    return True


@contextlib.contextmanager
def exclusive(out: Path):
    """An exclusive lock on `.<name>.lock` beside `out` (others wait); none without fcntl."""
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        with contextlib.suppress(ImportError):  # not POSIX: no lock
            import fcntl
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _ordered(pool, chunks_: Iterator[tuple], bos, eos, dtype, in_flight: int):
    """The pool's results in chunk order, at most `in_flight` chunks submitted and not yet taken."""
    pending: deque = deque()
    for c in chunks_:
        pending.append((pool.apply_async(encode_chunk, (c, bos, eos, dtype)), c))
        if len(pending) >= in_flight:
            r, c0 = pending.popleft()
            yield r.get(), c0
    for r, c0 in pending:
        yield r.get(), c0


class _Progress:
    """A tqdm bar over the source's bytes, with MB/s and tokens/s."""

    def __init__(self, total_bytes: int, max_chars, on: bool, workers: int, skipped: int = 0):
        from tqdm import tqdm
        total = min(total_bytes, max_chars) if max_chars else total_bytes
        desc = f"resumed after {skipped} chunks" if skipped else f"preparing ({workers} workers)"
        self.bar = tqdm(total=total, disable=not on, unit="B", unit_scale=True, dynamic_ncols=True, desc=desc,
                        file=sys.stderr)
        self.tokens, self.chars, self.t0 = 0, 0, time.perf_counter()

    def update(self, chunk, n_tokens: int):
        n = sum(map(len, chunk[0]))
        self.tokens += n_tokens
        self.chars += n
        dt = max(time.perf_counter() - self.t0, 1e-9)
        self.bar.update(min(n, max(0, self.bar.total - self.bar.n)))
        self.bar.set_postfix({"MB/s": f"{self.chars / dt / 1e6:.1f}", "tokens/s": f"{self.tokens / dt:,.0f}"},
                             refresh=False)

    def close(self):
        self.bar.close()
