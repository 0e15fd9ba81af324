"""Documents read lazily from a text source, one at a time, in bounded memory.

A source is `stdlib` (the embedded default), a text file, a .jsonl (.gz, .zst), a Parquet file, a
saved Hugging Face dataset, or a folder of these (docs/data.md). Bad documents are counted in `Problems`."""
from __future__ import annotations

import codecs
import gzip
import importlib
import io
import json
import re
import sysconfig
from collections import Counter
from pathlib import Path
from typing import Iterator, NamedTuple, Optional

TEXT_SUFFIXES = (".txt", ".md", ".py", ".text")
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst")
PARQUET_SUFFIX = ".parquet"
PIECE_BYTES = 1 << 16  # a text file is read (and tokenised) in pieces of about 64 KiB, cut at a line end


class DataError(ValueError):
    """Bad data: one line naming the file."""


def needs(module: str, why: str, error=DataError):
    """The optional dependency `module`, imported; when it is missing, a one-line `error(why)`."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise error(why) from None


class Doc(NamedTuple):
    text: str
    first: bool = True   # this piece starts a document
    last: bool = True    # this piece ends a document


class Problems:
    """Bad documents met while reading, counted per kind (and the files they were in)."""

    KINDS = {"undecodable": "undecodable bytes replaced with U+FFFD",
             "bad_json": "bad jsonl lines (not JSON, or no string data.column field; skipped)",
             "empty": "empty documents (skipped)"}

    def __init__(self):
        self.counts: Counter = Counter()
        self.files: dict[str, list[str]] = {k: [] for k in self.KINDS}
        self.lines: dict[str, list[int]] = {k: [] for k in self.KINDS}  # the first file's, up to 5

    def add(self, kind: str, file, n: int = 1, line: Optional[int] = None):
        if n:
            self.counts[kind] += n
            if str(file) not in self.files[kind][-1:]:
                self.files[kind].append(str(file))
            if line is not None and len(self.files[kind]) == 1 and len(self.lines[kind]) < 5:
                self.lines[kind].append(line)

    def summary(self, path: str) -> Optional[str]:
        """One line: every kind with its count and the first file it was met in; None if none."""
        if not self.counts:
            return None
        parts = []
        for k, what in self.KINDS.items():
            if self.counts[k]:
                files, lines = self.files[k], self.lines[k]
                where = files[0] + (f" (line{'s' * (len(lines) > 1)} {', '.join(map(str, lines))}"
                                    f"{', ...' if self.counts[k] > len(lines) else ''})" if lines else "")
                where += f" and {len(files) - 1} more files" if len(files) > 1 else ""
                parts.append(f"{where}: {self.counts[k]} {what}")
        return f"data: bad documents in {path}: " + "; ".join(parts)


def line_list(lines: list[int], shown: int = 10) -> str:
    """Line numbers for a log line: the first `shown`, then how many more."""
    return ", ".join(map(str, lines[:shown])) + (f" and {len(lines) - shown} more" if len(lines) > shown else "")


# ----------------------------------------------------------------------------- files
def stdlib_files() -> list[Path]:
    return sorted(p for p in Path(sysconfig.get_paths()["stdlib"]).glob("*.py") if p.is_file())


def is_saved_dataset(p: Path) -> bool:
    """A folder written by Hugging Face `datasets` save_to_disk (a Dataset or a DatasetDict)."""
    return p.is_dir() and ((p / "state.json").is_file() or (p / "dataset_dict.json").is_file())


def corpus_files(path: str) -> list[Path]:
    """The files of a source, in the order they are read."""
    if path == "stdlib":
        return stdlib_files()
    p = Path(path).expanduser()
    if is_saved_dataset(p):
        return sorted(f for f in p.rglob("*") if f.is_file())
    if p.is_file():
        return [p]
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and (f.name.lower().endswith(
            TEXT_SUFFIXES + JSONL_SUFFIXES + (PARQUET_SUFFIX,))))
        if not files:
            raise DataError(f"{path}: folder holds no .txt/.md/.jsonl(.gz/.zst)/.parquet files")
        return files
    raise DataError(f"{path}: no such file or folder")


_UNDECODED = re.compile("[\udc80-\udcff]")  # surrogateescape's stand-ins for undecodable bytes


def _clean(text: str, f, problems: Problems) -> str:
    """Text decoded with surrogateescape: each undecodable byte becomes U+FFFD and is counted."""
    if not _UNDECODED.search(text):
        return text
    text, n = _UNDECODED.subn("\ufffd", text)
    problems.add("undecodable", f, n)
    return text


def _open_binary(f: Path):
    name = f.name.lower()
    try:
        if name.endswith(".gz"):
            return gzip.open(f, "rb")
        if name.endswith(".zst"):
            zstandard = needs("zstandard", f"{f}: reading .zst needs the 'zstandard' package (pip install zstandard)")
            return io.BufferedReader(_Zstd(open(f, "rb"), zstandard.ZstdDecompressor().decompressobj))
        return open(f, "rb")
    except OSError as e:
        raise DataError(f"{f}: cannot be read ({e.strerror or e})") from None


class _Zstd(io.RawIOBase):
    """A .zst file decompressed as it is read, frame after frame; one that ends inside a frame (truncated) raises
    EOFError, where python-zstandard's stream reader would end there silently."""

    def __init__(self, fh, new_frame):
        self.fh, self.new_frame, self.frame, self.out, self.at, self.began = fh, new_frame, new_frame(), b"", 0, False

    def readable(self):
        return True

    def readinto(self, b) -> int:
        while self.at == len(self.out):
            data, self.out, self.at = self.fh.read(1 << 20), b"", 0
            if not data:
                if self.began and not self.frame.eof:
                    raise EOFError("the compressed file ends inside a frame")
                return 0
            while data:
                self.frame = self.new_frame() if self.frame.eof else self.frame
                self.out += self.frame.decompress(data)
                self.began, data = True, self.frame.unused_data if self.frame.eof else b""
        n = min(len(b), len(self.out) - self.at)
        b[:n] = self.out[self.at:self.at + n]
        self.at += n
        return n

    def close(self):
        self.fh.close()
        super().close()


def _text_pieces(f: Path, problems: Problems) -> Iterator[Doc]:
    """The file as one document, in pieces cut at a blank line (else a line end) every PIECE_BYTES."""
    dec = codecs.getincrementaldecoder("utf-8")(errors="surrogateescape")
    first, rest = True, ""
    with _open_binary(f) as fh:
        while True:
            block = fh.read(PIECE_BYTES)
            text = rest + dec.decode(block, final=not block)
            if not block:
                break
            cut = text.rfind("\n\n", 0, len(text) - 1)
            cut = cut + 2 if cut >= 0 else text.rfind("\n") + 1
            if len(text) < PIECE_BYTES or (cut <= 0 and len(text) < 4 * PIECE_BYTES):
                rest = text  # too short to cut yet, or no line end in it
                continue
            cut = cut if cut > 0 else len(text)  # no line end in 16 MiB: cut anywhere
            piece, rest = text[:cut], text[cut:]
            yield Doc(_clean(piece, f, problems), first, False)
            first = False
    if first and not text.strip():
        problems.add("empty", f)
        return
    yield Doc(_clean(text, f, problems), first, True)


def _jsonl_docs(f: Path, column: str, problems: Problems) -> Iterator[Doc]:
    with _open_binary(f) as fh:
        for number, raw in enumerate(fh, 1):
            if not raw.strip():
                continue
            line = raw.decode("utf-8", errors="surrogateescape")
            try:
                text = json.loads(line)[column]
                if not isinstance(text, str):
                    raise TypeError
            except (ValueError, KeyError, TypeError, IndexError):
                problems.add("bad_json", f, line=number)
                continue
            if not text.strip():
                problems.add("empty", f)
                continue
            yield Doc(_clean(text, f, problems))


def _column_docs(batches, f, problems: Problems) -> Iterator[Doc]:
    """Rows of an Arrow column, batch by batch: empty or null rows counted and skipped."""
    for batch in batches:
        for text in batch:
            if not isinstance(text, str) or not text.strip():
                problems.add("empty", f)
                continue
            yield Doc(text)


def _parquet_docs(f: Path, column: str, problems: Problems) -> Iterator[Doc]:
    pq = needs("pyarrow.parquet", f"{f}: reading Parquet needs the 'pyarrow' package (pip install pyarrow)")
    try:
        pf = pq.ParquetFile(f)
    except Exception as e:
        raise DataError(f"{f}: not a readable Parquet file ({str(e).splitlines()[0]})") from None
    if column not in pf.schema_arrow.names:
        raise DataError(f"{f}: no column {column!r} (data.column; columns: {', '.join(pf.schema_arrow.names)})")
    # one reader per row group: a reader over the whole file keeps buffers as it goes (memory grew with the file)
    batches = (b.column(0).to_pylist() for g in range(pf.num_row_groups)
               for b in pf.iter_batches(batch_size=1024, row_groups=[g], columns=[column]))
    yield from _column_docs(batches, f, problems)


def _saved_dataset_docs(p: Path, column: str, problems: Problems) -> Iterator[Doc]:
    datasets = needs("datasets", f"{p}: reading a saved dataset needs the 'datasets' package (pip install datasets)")
    try:
        ds = datasets.load_from_disk(str(p))
    except Exception as e:
        raise DataError(f"{p}: not a readable saved dataset ({str(e).splitlines()[0]})") from None
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise DataError(f"{p}: a DatasetDict without a 'train' split (splits: {', '.join(ds)})")
        ds = ds["train"]
    if column not in ds.column_names:
        raise DataError(f"{p}: no column {column!r} (data.column; columns: {', '.join(ds.column_names)})")
    yield from _column_docs((b[column] for b in ds.select_columns([column]).iter(batch_size=1024)), p, problems)


def documents(path: str, column: str = "text", problems: Optional[Problems] = None) -> Iterator[Doc]:
    """Every document (or piece of one) of the source, in order, read lazily."""
    problems = Problems() if problems is None else problems
    p = Path(path).expanduser()
    if path != "stdlib" and is_saved_dataset(p):
        yield from _saved_dataset_docs(p, column, problems)
        return
    for f in corpus_files(path):
        name = f.name.lower()
        try:
            if name.endswith(JSONL_SUFFIXES):
                yield from _jsonl_docs(f, column, problems)
            else:
                yield from _parquet_docs(f, column, problems) if name.endswith(PARQUET_SUFFIX) else _text_pieces(f, problems)
        except (OSError, EOFError) as e:  # a truncated .gz/.zst, a damaged Parquet row group, a read error
            raise DataError(f"{f}: truncated or damaged ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None


def read_corpus(path: str, max_chars: Optional[int] = None, log=print, column: str = "text") -> str:
    """All documents of a small source (tests; preparation streams) joined by blank lines, at most max_chars;
    bad documents reported in one line; an empty corpus is an error."""
    problems, pieces, total = Problems(), [], 0
    for d in documents(path, column, problems):
        pieces += [d.text, "\n\n" if d.last else ""]  # documents joined by a blank line (the last's dropped below)
        total += len(d.text)
        if max_chars is not None and total >= max_chars:
            break
    why = problems.summary(path)
    if why:
        log(why)
    text = "".join(pieces[:-1])[:max_chars]
    if not text.strip():
        raise DataError(f"{path}: the corpus is empty" + (f" ({why.split(': ', 2)[2]})" if why else ""))
    return text


def fingerprint(path: str) -> str:
    """Identifies the source's content as it is now (each file's path, size and mtime)."""
    return files_fingerprint(corpus_files(path))


def short_digest(*parts) -> str:
    """A short stable digest of `parts` (a cache entry's name); dicts and lists as sorted-key JSON."""
    import hashlib
    text = ":".join(json.dumps(p, sort_keys=True, default=str) if isinstance(p, (dict, list)) else str(p)
                    for p in parts)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def files_fingerprint(files) -> str:
    """Identifies the content of these files as it is now (each one's path, size and mtime)."""
    return short_digest(*(f"{f.resolve()}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in map(Path, files)))
