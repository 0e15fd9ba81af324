"""Weight files: the one atomic writer, the one safetensors header reader, integrity checks and the one checked reader
that every loader goes through.

`atomic_write` (temp file, fsync, rename); `save_safetensors` (with a CRC-32 in the metadata);
`read_safetensors_header`; `check_weights`; `load_tensors` (torch files with weights_only=True). Every problem is a
one-line ValueError naming the file.
"""
from __future__ import annotations

import json
import os
import pickle
import struct
import tempfile
import warnings
import zipfile
import zlib
from pathlib import Path
from typing import Callable, Union

import torch

WEIGHT_SUFFIXES = (".safetensors", ".pth", ".pt", ".bin", ".ckpt")
CHECKSUM_KEY = "zoo.crc32"
_PLACEHOLDER = "0" * 8
_MAX_HEADER = 100_000_000  # the safetensors format's own limit
# safetensors dtype tag -> torch dtype
FILE_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
               "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
               "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}

_UMASK = os.umask(0)
os.umask(_UMASK)


def fsync_file(path):
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path):
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems cannot fsync a directory
        pass
    finally:
        os.close(fd)


def atomic_write(path, content: Union[bytes, str, Callable[[Path], object]]) -> Path:
    """Write `content` (bytes, text, or a function that writes the temporary path it is given) to `path`
    atomically, through a file of the final name in a temporary folder beside it (torch.save records
    the name); usual permissions (0666 less the umask)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
    tmp = folder / path.name
    try:
        if callable(content):
            content(tmp)
        else:
            tmp.write_bytes(content.encode() if isinstance(content, str) else content)
        os.chmod(tmp, 0o666 & ~_UMASK)
        fsync_file(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
        folder.rmdir()
    fsync_dir(path.parent)
    return path


def file_crc32(path, start: int = 0) -> str:
    """The CRC-32 of a file's bytes from `start` (hex): the one checksum Zoo writes and checks."""
    with open(path, "rb") as f:
        return f"{_data_crc32(f, start, os.fstat(f.fileno()).st_size):08x}"


def self_checked(path) -> bool:
    """Whether the file carries its own checksum (safetensors files Zoo wrote, torch zip archives)."""
    return Path(path).suffix.lower() in WEIGHT_SUFFIXES


def _data_crc32(f, start: int, end: int) -> int:
    f.seek(start)
    crc, left = 0, end - start
    while left > 0:
        chunk = f.read(min(left, 16 << 20))
        if not chunk:
            break
        crc = zlib.crc32(chunk, crc)
        left -= len(chunk)
    return crc


def _seal(path: Path):
    """Sort the header's metadata (safetensors writes a hash map's order, which changes per process) and
    write the data's CRC-32 over the placeholder, same length, so nothing moves."""
    with open(path, "r+b") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = f.read(n)
        meta = json.loads(header).get("__metadata__") or {}
        dump = lambda d: json.dumps(d, separators=(",", ":"), ensure_ascii=False).encode()  # noqa: E731 - serde's form
        if dump(meta) in header:
            header = header.replace(dump(meta), dump(dict(sorted(meta.items()))), 1)
            f.seek(8)
            f.write(header)
        mark = f'"{CHECKSUM_KEY}":"{_PLACEHOLDER}"'.encode()
        at = header.find(mark)
        if at < 0 or header.find(mark, at + 1) >= 0:
            raise RuntimeError(f"{path}: cannot place the checksum in the safetensors header")
        crc = _data_crc32(f, 8 + n, os.fstat(f.fileno()).st_size)
        f.seek(8 + at + len(mark) - len(_PLACEHOLDER) - 1)
        f.write(f"{crc:08x}".encode())


def save_safetensors(tensors: Union[dict, torch.nn.Module], path, metadata: dict | None = None) -> Path:
    """A dict of tensors, or a module's state dict (tied tensors stored once, as safetensors'
    save_model does), written atomically to `path` with a CRC-32 of the data in the metadata."""
    from safetensors.torch import save_file, save_model
    meta = {"format": "pt", **(metadata or {}), CHECKSUM_KEY: _PLACEHOLDER}

    def write(tmp: Path):
        if isinstance(tensors, torch.nn.Module):
            save_model(tensors, str(tmp), metadata=meta)
        else:
            save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(tmp), metadata=meta)
        _seal(tmp)

    return atomic_write(path, write)


def read_safetensors_header(path) -> tuple[dict, dict, int]:
    """(tensor table {name: {"dtype", "shape", "data_offsets"}}, metadata, byte where the data
    starts) of a safetensors file, after checking that every tensor's bytes lie inside the file
    and match its shape and dtype. Reads the header only."""
    path = Path(path)
    size = path.stat().st_size

    def corrupt(why):
        return ValueError(f"{path}: corrupt or truncated safetensors file ({why})")

    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise corrupt(f"{size} bytes, shorter than the 8-byte header length")
        n = struct.unpack("<Q", head)[0]
        if n > min(size - 8, _MAX_HEADER):
            raise corrupt(f"a header of {n} bytes does not fit in a {size}-byte file")
        raw = f.read(n)
    try:
        table = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise corrupt("the header is not valid JSON") from None
    if not isinstance(table, dict):
        raise corrupt("the header is not a JSON object")
    metadata = table.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise corrupt("__metadata__ is not a JSON object")
    data_size = size - 8 - n
    for name, t in table.items():
        if isinstance(t, dict) and t.get("dtype") not in FILE_DTYPES:
            raise ValueError(f"{path}: tensor '{name}' has dtype {t.get('dtype')!r}, which Zoo does not read "
                             f"(supported: {', '.join(FILE_DTYPES)})")
        try:
            begin, end = (int(x) for x in t["data_offsets"])
            numel = 1
            for s in t["shape"]:
                numel *= int(s)
            nbytes = numel * FILE_DTYPES[t["dtype"]].itemsize
        except (KeyError, TypeError, ValueError):
            raise corrupt(f"bad entry for tensor '{name}'") from None
        if not 0 <= begin <= end <= data_size:
            raise corrupt(f"tensor '{name}' ends at byte {end} of a {data_size}-byte data section")
        if end - begin != nbytes:
            raise corrupt(f"tensor '{name}' has {end - begin} bytes, its shape and dtype need {nbytes}")
    return table, metadata, 8 + n


def check_weight_file(path):
    """Check one weight file by its suffix: a safetensors file against the CRC-32 it carries (if any), a torch
    zip archive against its records' checksums (a legacy torch file: torch.load(weights_only=True) decides);
    other files pass through."""
    path = Path(path)
    if path.suffix.lower() == ".safetensors":
        _, metadata, start = read_safetensors_header(path)
        want = metadata.get(CHECKSUM_KEY)
        got = None if want is None else file_crc32(path, start)
        if got != want:
            raise ValueError(f"{path}: checksum mismatch (the data's CRC-32 is {got}, the file says {want}): "
                             f"the file is corrupt")
    elif path.suffix.lower() in WEIGHT_SUFFIXES:
        with open(path, "rb") as f:
            if f.read(4) != b"PK\x03\x04":
                return
        try:
            with zipfile.ZipFile(path) as z:
                bad = z.testzip()
        except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError, ValueError, zlib.error) as e:
            first = (str(e).splitlines() or [type(e).__name__])[0]
            raise ValueError(f"{path}: corrupt or truncated torch file ({first})") from None
        if bad is not None:
            raise ValueError(f"{path}: corrupt or truncated torch file (checksum mismatch in record {bad})")


def check_weights(path):
    """Check a weight file, or the weight files directly in a folder: its .safetensors files, else its
    torch files (the loaders prefer safetensors, so a .bin beside them goes unread and unchecked)."""
    p = Path(path)
    if not p.is_dir():
        return check_weight_file(p)
    files = sorted(f for f in p.iterdir() if f.is_file() and f.suffix.lower() in WEIGHT_SUFFIXES)
    safe = [f for f in files if f.suffix.lower() == ".safetensors"]
    for f in safe or files:
        check_weight_file(f)


def read_json(path: Path) -> dict:
    """The JSON object in file `path`; a missing file, bad JSON or another JSON value is a one-line error."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def config_folder(path) -> Path:
    """`path`, or the folder of the config.json it names."""
    p = Path(path)
    return p.parent if p.is_file() and p.name == "config.json" else p


def shards(folder: Path, weights: str) -> list[Path]:
    """The file `weights` in `folder`, or the shards its index (`weights`.index.json, as transformers and diffusers
    write a large model) lists; [] when neither is there. A listed shard missing is a one-line error."""
    index = folder / f"{weights}.index.json"
    if not index.is_file():
        return [folder / weights] if (folder / weights).is_file() else []
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index}: no 'weight_map' listing the shards")
    files = [folder / f for f in dict.fromkeys(weight_map.values())]
    if missing := [f for f in files if not f.is_file()]:
        raise FileNotFoundError(f"{missing[0]}: shard listed in {index.name} is missing")
    return files


def load_shards(folder: Path, weights: str) -> dict:
    """{name: tensor} of every file `shards` finds (load_tensors each)."""
    return {k: v for f in shards(folder, weights) for k, v in load_tensors(f).items()}


def diffusers_folder(path, class_name: str, weights: str, subfolder: str = "transformer") -> Path | None:
    """The folder at `path`, or its pipeline's `subfolder` ('': none), holding `weights` (or its shards' index) and a
    config.json naming diffusers' `class_name`; else None."""
    for p in dict.fromkeys((Path(path), Path(path) / subfolder)):
        try:
            held = (p / weights).is_file() or (p / f"{weights}.index.json").is_file()
            if held and read_json(p / "config.json").get("_class_name") == class_name:
                return p
        except (ValueError, OSError):
            pass
    return None


def mismatches(found: dict, expected: dict, ignorable=lambda name: False, limit: int = 8) -> str:
    """What differs between the tensors a file holds and those expected ({name: tensor or shape} both):
    "missing: ...; unexpected: ...; wrong shape: ..." (each list cut to `limit`), or "" when they match."""
    shape = lambda v: list(getattr(v, "shape", v))  # noqa: E731
    missing = [n for n in expected if n not in found]
    unexpected = [n for n in found if n not in expected and not ignorable(n)]
    wrong = [f"{n} {shape(found[n])} (expected {shape(s)})" for n, s in expected.items()
             if n in found and shape(found[n]) != shape(s)]
    more = lambda names: f" (+{len(names) - limit} more)" if len(names) > limit else ""  # noqa: E731
    return "; ".join(f"{label}: {', '.join(names[:limit])}{more(names)}" for label, names in
                     (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong)) if names)


def _first_line(e: BaseException) -> str:
    return ((str(e).strip().splitlines() or [""])[0] or type(e).__name__)[:200]


def _torch_load(path):
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError as e:
        if "mmap" not in str(e):
            raise
        return torch.load(path, map_location="cpu", weights_only=True)  # legacy files cannot be mapped


def load_tensors(path) -> dict:
    """{name: tensor} of one checked weight file, on the CPU. A torch file is read with
    weights_only=True (memory-mapped when it is a zip archive); a state dict wrapped as
    {"state_dict": ...} or {"model": ...} is unwrapped."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    check_weight_file(path)
    if path.suffix.lower() == ".safetensors":
        from safetensors.torch import load_file
        try:
            return load_file(str(path))
        except Exception as e:  # noqa: BLE001 - whatever the reader says: one line naming the file
            raise ValueError(f"{path}: unreadable safetensors file ({_first_line(e)})") from None
    try:
        with warnings.catch_warnings():  # e.g. "Detected pickle protocol 4": the error below says it all
            warnings.simplefilter("ignore")
            obj = _torch_load(path)
    except pickle.UnpicklingError:
        raise ValueError(f"{path}: refused: it holds pickled objects other than tensors and plain containers "
                         f"(loading them could run code)") from None
    except Exception as e:  # noqa: BLE001 - a truncated or foreign file
        raise ValueError(f"{path}: not a readable weights file ({type(e).__name__}: {_first_line(e)})") from None
    if isinstance(obj, dict):
        for k in ("state_dict", "model"):
            if isinstance(obj.get(k), dict):
                obj = obj[k]
                break
    tensors = {k: v for k, v in obj.items() if isinstance(v, torch.Tensor)} if isinstance(obj, dict) else {}
    if not tensors:
        raise ValueError(f"{path}: does not hold a state dict of tensors")
    return tensors
