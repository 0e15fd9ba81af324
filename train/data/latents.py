"""The latent cache: a dataset's images encoded once by a frozen autoencoder and kept on disk.

    latent_cache(folder, key, splits, encode, views, ...) -> LatentCache (built, resumed or reused)
    cache.latents("train", rows, views) -> raw latents (B, C, h, w) read from the memmap
    prompt_cache(folder, key, prompts, encode) -> (P, L, D) memmap: a text encoder's embeddings per prompt

The folder's name carries a digest of `key`; it holds train.npy (N, V, C, h, w) (with aspect-ratio buckets an array
per bucket, train-HxW.npy), val.npy, labels and meta.json (a prompt cache: embeds.npy and meta.json). Built in a
`.partial` folder (a killed latent build resumes), one builder at a time."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

from zoo.weights.files import atomic_write, fsync_dir

from .shards import exclusive, read_record
from .sources import DataError

VERSION, META = 1, "meta.json"
PROGRESS = "progress.json"


def weights_fingerprint(module: torch.nn.Module) -> str:
    """Identifies a module's weights: a digest of every state-dict entry's name, dtype, shape and bytes."""
    h = hashlib.sha1()
    for name, t in sorted(module.state_dict().items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}\n".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:16]


class LatentCache:
    """A complete cache folder, its arrays (a split each: val and the training ones) opened as read-only memmaps."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.meta = json.loads((self.folder / META).read_text())
        splits = sorted(p.name.removesuffix(".labels.npy") for p in self.folder.glob("*.labels.npy"))
        self.arrays = {s: np.load(self.folder / f"{s}.npy", mmap_mode="r") for s in splits}
        self.labels = {s: torch.from_numpy(np.load(self.folder / f"{s}.labels.npy")) for s in splits}
        self.mean = torch.tensor(self.meta["mean"], dtype=torch.float32)
        self.std = torch.tensor(self.meta["std"], dtype=torch.float32)

    @property
    def views(self) -> int:
        """Latents per training image: 2 with flips (view 1 mirrored), else 1."""
        return next(a for s, a in self.arrays.items() if s != "val").shape[1]

    @property
    def shape(self) -> tuple:
        """(C, h, w) of one image's latents (the first training split's)."""
        return tuple(next(a for s, a in self.arrays.items() if s != "val").shape[2:])

    def latents(self, split: str, rows, views=None) -> torch.Tensor:
        """Raw latents (B, C, h, w) of a split's rows (tensor, list or slice) in their views (None: 0), on the CPU."""
        a = self.arrays[split]
        if isinstance(rows, slice):
            return torch.from_numpy(np.array(a[rows, 0]))
        rows = np.asarray(rows)
        views = np.zeros_like(rows) if views is None else np.asarray(views)
        return torch.from_numpy(a[rows, views])


def read_cache(folder: Path, key: dict) -> Optional[LatentCache]:
    """The complete cache in `folder` when it holds `key`'s latents, else None."""
    try:
        return LatentCache(folder) if read_record(Path(folder) / META, version=VERSION, key=key) else None
    except (OSError, ValueError):
        return None


def latent_cache(folder, key: dict, splits: dict, encode: Callable[[torch.Tensor], torch.Tensor], views: int = 1,
                 batch_size: int = 64, commit_every: int = 1024, log=print) -> LatentCache:
    """The cache of `key` in `folder`: reused when complete, else built (or resumed). splits: {"val" and the training
    ones ("train", or one per bucket): (labels, read(start, stop) -> images (n, 3, H, W) in [0, 1])}; encode: images
    -> raw latents (n, C, h, w); views=2 also encodes each training image mirrored. An empty split is an error."""
    folder = Path(folder)
    cache = read_cache(folder, key)
    if cache is not None:
        log(f"latents: reusing {folder}")
        return cache
    for name, (labels, _) in splits.items():
        if len(labels) == 0:
            raise DataError(f"{folder.name}: the {name} split has no images")
    folder.parent.mkdir(parents=True, exist_ok=True)
    with exclusive(folder), torch.no_grad():
        if (cache := read_cache(folder, key)) is not None:  # another process built it while this one waited
            return cache
        if folder.exists():  # a cache of another key under this name (a digest collision) or an older version
            shutil.rmtree(folder)
        part = folder.parent / f".{folder.name}.partial"
        if read_cache(part, key) is not None:  # complete when a kill came just before the rename
            os.replace(part, folder)
            return LatentCache(folder)
        progress = read_record(part / PROGRESS, version=VERSION, key=key)
        if progress is None:
            shutil.rmtree(part, ignore_errors=True)
            part.mkdir()
            progress = {"version": VERSION, "key": key, "done": {}}
        elif any(progress["done"].values()):
            log(f"latents: resuming {folder.name} after {progress['done']} images")
        t0, n_encoded = time.perf_counter(), 0
        for name, (labels, read) in splits.items():
            n, v = len(labels), views if name != "val" else 1
            path, start = part / f"{name}.npy", progress["done"].get(name, 0)
            if start == 0 or not path.exists():
                atomic_write(part / f"{name}.labels.npy", lambda f: np.save(f, labels.numpy().astype(np.int64)))
                first = _encode_views(encode, read(0, min(batch_size, n)), v)
                out = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(n, *first.shape[1:]))
                start = 0
            else:
                out = np.load(path, mmap_mode="r+")
            last = start
            for i in range(start, n, batch_size):
                j = min(i + batch_size, n)
                out[i:j] = (first if i == 0 else _encode_views(encode, read(i, j), v)).numpy()
                n_encoded += (j - i) * v
                if j - last >= commit_every or j == n:
                    out.flush()
                    progress["done"][name] = last = j
                    atomic_write(part / PROGRESS, json.dumps(progress))
            del out
        arrays = {s: np.load(part / f"{s}.npy", mmap_mode="r") for s in splits}
        mean, std = _channel_stats([a for s, a in arrays.items() if s != "val"])
        meta = {"version": VERSION, "key": key, **{s: list(a.shape) for s, a in arrays.items()}, "mean": mean,
                "std": std}
        del arrays
        atomic_write(part / META, json.dumps(meta, indent=1))
        (part / PROGRESS).unlink()
        os.replace(part, folder)
        fsync_dir(folder.parent)
        secs = time.perf_counter() - t0
        log(f"latents: encoded {n_encoded} images in {secs:.1f} s ({n_encoded / max(secs, 1e-9):.0f} images/s) "
            f"into {folder}")
        return LatentCache(folder)


def _encode_views(encode, images: torch.Tensor, views: int) -> torch.Tensor:
    """(n, V, C, h, w) float32 CPU latents of the images, and with V = 2 of their mirror images."""
    z = [encode(images)] + ([encode(images.flip(-1))] if views == 2 else [])
    return torch.stack([x.float().cpu() for x in z], 1)


def _channel_stats(arrays: list, rows: int = 4096) -> tuple[list, list]:
    """Per-channel mean and (unbiased) std of latents [(N, V, C, h, w)] together, in float64, a block of rows at a
    time."""
    C = arrays[0].shape[2]
    s, ss, n = np.zeros(C), np.zeros(C), 0
    for a, i in ((a, i) for a in arrays for i in range(0, len(a), rows)):
        x = np.asarray(a[i:i + rows], dtype=np.float64).swapaxes(0, 2).reshape(C, -1)
        s += x.sum(1)
        ss += (x * x).sum(1)
        n += x.shape[1]
    mean = s / n
    var = np.maximum(ss - n * mean * mean, 0.0) / max(n - 1, 1)
    return mean.tolist(), np.maximum(np.sqrt(var), 1e-6).tolist()


def prompt_cache(folder, key: dict, prompts: list, encode: Callable[[list], torch.Tensor], batch_size: int = 64,
                 log=print) -> np.ndarray:
    """The embeddings (len(prompts), L, D) of `key`'s prompts in `folder` (encode: prompts -> (n, L, D)), as a
    read-only memmap: reused when complete, else built whole in a `.partial` folder, one builder at a time."""
    folder = Path(folder)
    complete = lambda: read_record(folder / META, version=VERSION, key=key) is not None  # noqa: E731
    if complete():
        log(f"prompts: reusing {folder}")
        return np.load(folder / "embeds.npy", mmap_mode="r")
    folder.parent.mkdir(parents=True, exist_ok=True)
    with exclusive(folder), torch.no_grad():
        if not complete():
            t0, part, out = time.perf_counter(), folder.parent / f".{folder.name}.partial", None
            for old in (part, folder):
                shutil.rmtree(old, ignore_errors=True)
            part.mkdir()
            for i in range(0, len(prompts), batch_size):
                e = encode(prompts[i:i + batch_size]).float().cpu().numpy()
                if out is None:
                    out = np.lib.format.open_memmap(part / "embeds.npy", "w+", np.float32, (len(prompts), *e.shape[1:]))
                out[i:i + len(e)] = e
            out.flush()
            del out
            atomic_write(part / META, json.dumps({"version": VERSION, "key": key, "prompts": prompts}, indent=1))
            os.replace(part, folder)
            fsync_dir(folder.parent)
            log(f"prompts: encoded {len(prompts)} prompts in {time.perf_counter() - t0:.1f} s into {folder}")
    return np.load(folder / "embeds.npy", mmap_mode="r")
