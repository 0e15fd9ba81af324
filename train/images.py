"""Image datasets: the embedded digits default and ImageFolder-style directories.

    digits_dataset("train", size=32)   -> images (N, C, 32, 32) float32 in [0, 1], labels (N,) int64
    scan_image_folder(root)            -> (class names, [(path, label), ...]) with one-line errors
    FolderImages(samples, size, train) -> a Dataset of uint8 (C, size, size) crops, PIL-decoded

Augmentations are drawn from a per-sample seed, never from global RNG state, so a batch is a
pure function of (seed, step, micro) and a resumed run sees exactly the same images whatever
the number of DataLoader workers. Normalisation happens on the device (uint8 travels to it).
"""
from __future__ import annotations

import functools
import math
import random
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm")
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


# ----------------------------------------------------------------------------------------
# embedded default: scikit-learn's bundled 8x8 handwritten digits (1797 images, 10 classes)
# ----------------------------------------------------------------------------------------

def digits_dataset(split: str = "train", size: int = 32, channels: int = 1, val_fraction: float = 0.2,
                   seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The digits, bilinearly upsampled from 8x8 to size x size.

    Returns (images (N, channels, size, size) float32 in [0, 1], labels (N,) int64 in 0..9).
    split: "train", "val" or "all"; the split is stratified per class and fixed by `seed`, so
    train and val never overlap. channels=3 repeats the grey channel (for RGB models).
    Needs scikit-learn (the data ships inside it: no download)."""
    if split not in ("train", "val", "all"):
        raise ValueError(f"digits_dataset: split must be 'train', 'val' or 'all', got {split!r}")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"digits_dataset: val_fraction must be in (0, 1), got {val_fraction}")
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise ImportError("the embedded digits dataset needs scikit-learn: pip install scikit-learn") from None
    d = load_digits()
    x = torch.from_numpy(d.images.astype(np.float32) / 16.0)[:, None]  # (N, 1, 8, 8) in [0, 1]
    y = torch.from_numpy(d.target.astype(np.int64))
    if split != "all":
        g = torch.Generator().manual_seed(seed)
        val = torch.zeros(len(y), dtype=torch.bool)
        for c in range(10):
            idx = torch.nonzero(y == c).flatten()
            idx = idx[torch.randperm(len(idx), generator=g)]
            val[idx[:round(len(idx) * val_fraction)]] = True
        keep = val if split == "val" else ~val
        x, y = x[keep], y[keep]
    if size != 8:
        x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False).clamp_(0.0, 1.0)
    if channels != 1:
        x = x.expand(-1, channels, -1, -1).contiguous()
    return x, y


def random_shift(x: torch.Tensor, max_shift: int, generator: torch.Generator) -> torch.Tensor:
    """Translate each image of x (B, C, H, W) by its own random offset in [-max_shift, max_shift]
    pixels (zero fill) -> (B, C, H, W). The offsets come from `generator` (on x's device or CPU)."""
    if max_shift <= 0:
        return x
    B, C, H, W = x.shape
    off = torch.randint(-max_shift, max_shift + 1, (2, B), generator=generator, device=generator.device).to(x.device)
    pad = F.pad(x, (max_shift,) * 4)
    rows = (torch.arange(H, device=x.device)[None] + max_shift - off[0][:, None])  # (B, H)
    cols = (torch.arange(W, device=x.device)[None] + max_shift - off[1][:, None])  # (B, W)
    out = pad.gather(2, rows[:, None, :, None].expand(B, C, H, W + 2 * max_shift))
    return out.gather(3, cols[:, None, None, :].expand(B, C, H, W))


# ----------------------------------------------------------------------------------------
# ImageFolder-style directories: root/<class>/<image>
# ----------------------------------------------------------------------------------------

def scan_image_folder(root, classes: Optional[Sequence[str]] = None) -> tuple[list, list]:
    """root/<class name>/**/<image> -> (class names sorted, [(path, label), ...]).

    A missing root, a root without class folders, fewer than two classes or a class folder
    without images is a one-line error naming the path. `classes` fixes the label order
    (e.g. the val folder uses the train folder's classes)."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: image folder not found")
    found = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if classes is None:
        classes = found
        if len(classes) < 2:
            raise ValueError(f"{root}: an image folder needs at least two class folders, found {len(classes)}"
                             f"{' (' + ', '.join(classes) + ')' if classes else ''}")
    else:
        extra = sorted(set(found) - set(classes))
        if extra:
            raise ValueError(f"{root}: class folders not in the training set: {', '.join(extra[:5])}")
    samples = []
    for label, name in enumerate(classes):
        folder = root / name
        if not folder.is_dir():
            continue  # a val folder may lack a class
        files = sorted(p for p in folder.rglob("*") if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file())
        if not files:
            raise ValueError(f"{folder}: class folder has no images ({', '.join(IMAGE_EXTENSIONS)})")
        samples += [(str(p), label) for p in files]
    if not samples:
        raise ValueError(f"{root}: no images found")
    return list(classes), samples


def random_resized_crop_box(w: int, h: int, rng: random.Random, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)):
    """A crop box (left, top, right, bottom) covering a random fraction `scale` of the area with a
    log-uniform aspect ratio in `ratio` (Szegedy et al., "Going Deeper with Convolutions", 2014);
    after 10 failed draws, the largest centred box with an aspect ratio inside `ratio`."""
    area = w * h
    log_r = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target = area * rng.uniform(*scale)
        r = math.exp(rng.uniform(*log_r))
        cw, ch = round(math.sqrt(target * r)), round(math.sqrt(target / r))
        if 0 < cw <= w and 0 < ch <= h:
            x0, y0 = rng.randint(0, w - cw), rng.randint(0, h - ch)
            return (x0, y0, x0 + cw, y0 + ch)
    r = w / h
    if r < ratio[0]:
        cw, ch = w, round(w / ratio[0])
    elif r > ratio[1]:
        cw, ch = round(h * ratio[1]), h
    else:
        cw, ch = w, h
    x0, y0 = (w - cw) // 2, (h - ch) // 2
    return (x0, y0, x0 + cw, y0 + ch)


def center_crop_box(w: int, h: int, crop_pct: float = 0.875):
    """The box that 'resize the short side to size / crop_pct, then centre-crop size' keeps."""
    side = min(w, h) * crop_pct
    x0, y0 = (w - side) / 2, (h - side) / 2
    return (x0, y0, x0 + side, y0 + side)


def load_crop(path: str, size: int, box_fn, mode: str = "RGB", flip: bool = False) -> np.ndarray:
    """Decode `path` with PIL, crop box_fn(w, h) and resize it to size x size -> uint8 (size, size, C).
    JPEGs are decoded at the smallest DCT scale that still leaves the crop >= size pixels."""
    from PIL import Image
    with Image.open(path) as img:
        w, h = img.size
        box = box_fn(w, h)
        if img.format == "JPEG":
            need = size / max(1e-6, min(box[2] - box[0], box[3] - box[1]))  # output px per source px
            if need < 1.0:
                img.draft(img.mode if img.mode in ("RGB", "L") else "RGB", (math.ceil(w * need), math.ceil(h * need)))
                sx, sy = img.size[0] / w, img.size[1] / h
                box = (box[0] * sx, box[1] * sy, box[2] * sx, box[3] * sy)
        img = img.convert(mode)
        out = img.resize((size, size), Image.BILINEAR, box=box)
    if flip:
        out = out.transpose(Image.FLIP_LEFT_RIGHT)
    arr = np.asarray(out, dtype=np.uint8)
    return arr[:, :, None] if arr.ndim == 2 else arr


class FolderImages(torch.utils.data.Dataset):
    """samples [(path, label)] -> item (uint8 image (C, size, size) or None, label, bad path or None).

    Indexed by (index, seed): training items draw their random-resized crop and flip from a
    random.Random(seed), so the item does not depend on which worker made it. Eval items
    (train=False) are resized and centre-cropped. An unreadable file gives image None and its
    path (with the reason); the collate function drops it and the task reports it."""

    def __init__(self, samples, size: int, train: bool, channels: int = 3, scale=(0.08, 1.0),
                 ratio=(3 / 4, 4 / 3), hflip: float = 0.5, crop_pct: float = 0.875):
        if channels not in (1, 3):
            raise ValueError(f"image folders give 1 (grey) or 3 (RGB) channels, not {channels}")
        self.samples, self.size, self.train = samples, size, train
        self.mode = "L" if channels == 1 else "RGB"
        self.scale, self.ratio, self.hflip, self.crop_pct = tuple(scale), tuple(ratio), hflip, crop_pct

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, key):
        index, seed = key if isinstance(key, tuple) else (key, 0)
        path, label = self.samples[index]
        try:
            if self.train:
                rng = random.Random(seed)
                arr = load_crop(path, self.size, lambda w, h: random_resized_crop_box(w, h, rng, self.scale, self.ratio),
                                self.mode, flip=rng.random() < self.hflip)
            else:
                arr = load_crop(path, self.size, lambda w, h: center_crop_box(w, h, self.crop_pct), self.mode)
        except Exception as e:  # any decoding failure: report the file, never crash the worker
            return None, label, f"{path} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        return torch.from_numpy(arr.copy()).permute(2, 0, 1), label, None


def collate_images(items):
    """[(image or None, label, bad or None)] -> (uint8 images (B, C, H, W), labels (B,), [bad paths])."""
    good = [(x, y) for x, y, _ in items if x is not None]
    bad = [b for _, _, b in items if b is not None]
    if not good:
        return None, None, bad
    return torch.stack([x for x, _ in good]), torch.tensor([y for _, y in good], dtype=torch.int64), bad


@functools.lru_cache(maxsize=2)
def _epoch_perm(n: int, seed: int, epoch: int) -> torch.Tensor:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))


def epoch_positions(n: int, seed: int, start: int, count: int) -> list:
    """Sample positions start..start+count-1 of an endless stream of epochs, each a fresh
    permutation of range(n) drawn from (seed, epoch) -> [(index, per-sample seed)]."""
    return [(int(_epoch_perm(n, seed, p // n)[p % n]), (seed * 2_654_435_761 + p) % 2**63)
            for p in range(start, start + count)]
