"""Integrity checks of weight files, run before any loader reads them.

A truncated or corrupt file is a one-line ValueError naming it, instead of a deep traceback or,
worse, silently wrong weights:
- .safetensors: the 8-byte header length, the JSON header, and every tensor's byte range
  within the file (reads the header only).
- .pth/.pt/.bin/.ckpt written by torch.save (a zip archive): the archive directory and the
  CRC-32 of every record (reads the file once). torch.load itself does not check the CRCs, so
  a flipped byte in a tensor would otherwise load as a wrong weight.
Legacy (pre-zip) torch files carry no checksums; torch.load(weights_only=True) judges them.
"""
from __future__ import annotations

import json
import struct
import zipfile
from pathlib import Path

WEIGHT_SUFFIXES = (".safetensors", ".pth", ".pt", ".bin", ".ckpt")


def check_safetensors(path: Path):
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: corrupt or truncated safetensors file ({size} bytes)")
        n = struct.unpack("<Q", head)[0]
        if n > size - 8:
            raise ValueError(f"{path}: corrupt or truncated safetensors file (a {n}-byte header in {size} bytes)")
        try:
            header = json.loads(f.read(n))
        except (ValueError, UnicodeDecodeError):
            raise ValueError(f"{path}: corrupt or truncated safetensors file (the header is not JSON)") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: corrupt or truncated safetensors file (the header is not a mapping)")
    end = 0
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, stop = (int(x) for x in meta["data_offsets"])
        except (TypeError, KeyError, ValueError):
            raise ValueError(f"{path}: corrupt or truncated safetensors file (bad entry for {name!r})") from None
        if not 0 <= begin <= stop:
            raise ValueError(f"{path}: corrupt or truncated safetensors file (bad byte range for {name!r})")
        end = max(end, stop)
    if 8 + n + end > size:
        raise ValueError(f"{path}: corrupt or truncated safetensors file ({size} bytes, its tensors need {8 + n + end})")


def check_torch_file(path: Path):
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"PK\x03\x04":
        return  # a legacy torch file (or not a torch file): torch.load(weights_only=True) decides
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError, ValueError) as e:
        first = (str(e).splitlines() or [type(e).__name__])[0]
        raise ValueError(f"{path}: corrupt or truncated torch file ({first})") from None
    if bad is not None:
        raise ValueError(f"{path}: corrupt or truncated torch file (checksum mismatch in record {bad})")


def check_weight_file(path):
    """Check one weight file by its suffix; other files pass through."""
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix == ".safetensors":
        check_safetensors(p)
    elif suffix in WEIGHT_SUFFIXES:
        check_torch_file(p)


def check_weights(path):
    """Check a weight file, or the weight files directly inside a folder: its .safetensors files
    (headers only), or its torch files when it has no .safetensors (the loaders prefer those; a
    Hub folder often holds both, and checking a multi-GB .bin nobody reads would be wasted time)."""
    p = Path(path)
    if not p.is_dir():
        return check_weight_file(p)
    files = sorted(f for f in p.iterdir() if f.is_file() and f.suffix.lower() in WEIGHT_SUFFIXES)
    safe = [f for f in files if f.suffix.lower() == ".safetensors"]
    for f in safe or files:
        check_weight_file(f)
