"""Image datasets: the embedded digits default and ImageFolder-style directories, and timm's
training recipe (RandAugment / TrivialAugment, random erasing, Mixup / CutMix).

Augmentations draw from a per-sample seed, so a batch is a function of (seed, step, micro) whatever
the number of workers (exact resume). uint8 crops are normalised on the device."""
from __future__ import annotations

import functools
import itertools
import math
import random
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from zoo.convnet.preprocess import center_crop_box, load_crop

from .sources import DataError, needs

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm")
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
DIGIT_NAMES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")  # the digits' words


def normalization(d, channels: int) -> tuple:
    """(mean, std) per channel: data.mean / data.std, else 0.5 (digits), ImageNet's (RGB) or 0.449 / 0.226 (grey)."""
    if d.mean is not None:
        return tuple(d.mean), tuple(d.std)
    if d.path == "digits":
        return (0.5,), (0.5,)
    return (IMAGENET_MEAN, IMAGENET_STD) if channels == 3 else ((0.449,), (0.226,))


# ---------- embedded default: scikit-learn's bundled 8x8 handwritten digits (1797 images, 10 classes)

def digits_dataset(split: str = "train", size: int = 32, channels: int = 1, val_fraction: float = 0.2,
                   seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's 8x8 digits upsampled to size x size -> (images (N, channels, size, size) float32 in
    [0, 1], labels (N,)); split "train", "val" or "all", stratified and fixed by `seed`."""
    if split not in ("train", "val", "all"):
        raise ValueError(f"digits_dataset: split must be 'train', 'val' or 'all', got {split!r}")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"digits_dataset: val_fraction must be in (0, 1), got {val_fraction}")
    d = needs("sklearn.datasets", "the embedded digits dataset needs scikit-learn: pip install scikit-learn",
              ImportError).load_digits()
    x = torch.from_numpy(d.images.astype(np.float32) / 16.0)[:, None]  # (N, 1, 8, 8) in [0, 1]
    y = torch.from_numpy(d.target.astype(np.int64))
    if split != "all":
        g, val = torch.Generator().manual_seed(seed), torch.zeros(len(y), dtype=torch.bool)
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
    """x (B, C, H, W), each image shifted by its own offset in [-max_shift, max_shift] pixels (zero fill)."""
    if max_shift <= 0:
        return x
    B, C, H, W = x.shape
    off = torch.randint(-max_shift, max_shift + 1, (2, B), generator=generator, device=generator.device).to(x.device)
    pad = F.pad(x, (max_shift,) * 4)
    rows = (torch.arange(H, device=x.device)[None] + max_shift - off[0][:, None])  # (B, H)
    cols = (torch.arange(W, device=x.device)[None] + max_shift - off[1][:, None])  # (B, W)
    out = pad.gather(2, rows[:, None, :, None].expand(B, C, H, W + 2 * max_shift))
    return out.gather(3, cols[:, None, None, :].expand(B, C, H, W))


# ------------------------------------ ImageFolder-style directories: root/<class>/<image>

def folder_channels(paths, sample: int = 16) -> int:
    """3 if any of the first `sample` images has colour (RGB, palette, CMYK, ...), else 1 (all grey)."""
    from PIL import Image
    for path in itertools.islice(paths, sample):
        try:
            with Image.open(path) as im:
                if im.mode not in ("1", "L", "LA", "I", "I;16", "F"):
                    return 3
        except OSError:
            continue  # unreadable: skipped when training too
    return 1


def scan_image_folder(root, classes: Optional[Sequence[str]] = None, flat: bool = False) -> tuple[list, list]:
    """root/<class name>/**/<image> -> (class names sorted, [(path, label), ...]); one-line errors naming
    the path. `classes` fixes the label order; flat=True takes a root of images as one class."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: image folder not found")
    found = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if flat and classes is None and not found:
        files = sorted(p for p in root.iterdir() if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file())
        if not files:
            raise ValueError(f"{root}: no images and no class folders ({', '.join(IMAGE_EXTENSIONS)})")
        return [root.name], [(str(p), 0) for p in files]
    if classes is None:
        classes = found
        if len(classes) < 2:
            raise ValueError(f"{root}: an image folder needs at least two class folders, found {len(classes)}"
                             f"{' (' + ', '.join(classes) + ')' if classes else ''}")
    elif extra := sorted(set(found) - set(classes)):
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
    """A crop box (left, top, right, bottom) of a random `scale` fraction of the area, its aspect ratio log-uniform in
    `ratio` (Szegedy et al., "Going Deeper with Convolutions", 2014); after 10 failed draws, the largest centred one."""
    area, log_r = w * h, (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target, r = area * rng.uniform(*scale), math.exp(rng.uniform(*log_r))
        cw, ch = round(math.sqrt(target * r)), round(math.sqrt(target / r))
        if 0 < cw <= w and 0 < ch <= h:
            x0, y0 = rng.randint(0, w - cw), rng.randint(0, h - ch)
            return (x0, y0, x0 + cw, y0 + ch)
    cw, ch = min(w, round(h * ratio[1])), min(h, round(w / ratio[0]))  # the whole image, its aspect ratio clamped
    x0, y0 = (w - cw) // 2, (h - ch) // 2
    return (x0, y0, x0 + cw, y0 + ch)


def auto_buckets(size: int, multiple: int) -> list:
    """Aspect-ratio buckets [(H, W)] of at most size x size pixels, as kohya's sd-scripts makes them: the square and,
    for each side from half to twice `size` in steps of `multiple`, the longest other side within the area (a
    multiple too, at most twice `size`), both ways round."""
    area, lo, out = size * size, max(multiple, -(-size // 2 // multiple) * multiple), {(size, size)}
    for a in range(lo, 2 * size + 1, multiple):
        if (b := min(2 * size, area // a // multiple * multiple)) >= lo:
            out |= {(a, b), (b, a)}
    return sorted(out)


def bucketed(samples, buckets) -> dict:
    """[(path, label)] -> {bucket index: [(path, label)]}: each image to the bucket (H, W) whose aspect ratio is the
    nearest its own (in log ratio; the first of equals); a file that does not open is a DataError naming it."""
    from PIL import Image
    logs, out = [math.log(w / h) for h, w in buckets], {}
    for path, label in samples:
        try:
            with Image.open(path) as im:
                r = math.log(im.size[0] / im.size[1])
        except Exception as e:  # any decoding failure (or a missing file)
            raise DataError(f"{path}: unreadable image ({type(e).__name__})") from None
        out.setdefault(min(range(len(logs)), key=lambda i: abs(logs[i] - r)), []).append((path, label))
    return out


class FolderImages(torch.utils.data.Dataset):
    """samples [(path, label)] -> item (uint8 (C, H, W) or None, label, bad path or None) by (index, seed): a
    training item's crop, flip and `augment` come from its seed alone, whatever the worker (None: unreadable); `size`
    an int (square) or (H, W) (evaluation's centre crop of that shape)."""

    def __init__(self, samples, size, train: bool, channels: int = 3, scale=(0.08, 1.0),
                 ratio=(3 / 4, 4 / 3), hflip: float = 0.5, crop_pct: float = 0.875, augment=None):
        if channels not in (1, 3):
            raise ValueError(f"image folders give 1 (grey) or 3 (RGB) channels, not {channels}")
        self.samples, self.size, self.train = samples, size, train
        self.aspect = 1.0 if isinstance(size, int) else size[1] / size[0]
        self.mode = "L" if channels == 1 else "RGB"
        self.scale, self.ratio, self.hflip, self.crop_pct = tuple(scale), tuple(ratio), hflip, crop_pct
        self.augment = augment  # training: RandAugment / TrivialAugment after the crop (auto_augment_op)

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
                arr = load_crop(path, self.size, lambda w, h: center_crop_box(w, h, self.crop_pct, self.aspect),
                                self.mode)
        except Exception as e:  # any decoding failure: report the file, never crash the worker
            return None, label, f"{path} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        img = torch.from_numpy(arr.copy()).permute(2, 0, 1)
        if self.train and self.augment is not None:
            img = augment_seeded(self.augment, img, seed)
        return img, label, None


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
    """Positions start..start+count-1 of endless seeded epochs -> [(index, per-sample seed)]."""
    return [(int(_epoch_perm(n, seed, p // n)[p % n]), (seed * 2_654_435_761 + p) % 2**63)
            for p in range(start, start + count)]


# --------------------- a folder of real photographs, made on the spot (tests, benchmarks)

def write_photo_tiles(folder, tile: int = 48) -> int:
    """Cut scikit-image's colour photographs into tile x tile PNGs, folder/<photo>/<row>_<col>.png; returns how many."""
    data = needs("skimage.data", "the photo tiles need scikit-image: pip install scikit-image", ImportError)
    from PIL import Image
    n = 0
    for name in ("astronaut", "coffee", "chelsea", "rocket"):
        img, out = getattr(data, name)(), Path(folder) / name
        out.mkdir(parents=True, exist_ok=True)
        for r in range(img.shape[0] // tile):
            for c in range(img.shape[1] // tile):
                Image.fromarray(img[r * tile:(r + 1) * tile, c * tile:(c + 1) * tile]).save(out / f"{r}_{c}.png")
                n += 1
    return n


# ---------- the training recipe (timm's): RandAugment / TrivialAugment, random erasing, Mixup / CutMix

def auto_augment_op(kind: str, num_ops: int = 2, magnitude: int = 9):
    """torchvision transforms v2's RandAugment (Cubuk et al., "RandAugment", 2020) or TrivialAugmentWide
    (Müller & Hutter, "TrivialAugment", 2021) for uint8 (C, H, W) images; None for "none"."""
    if kind == "none":
        return None
    v2 = needs("torchvision.transforms.v2", f"data.auto_augment={kind} needs torchvision: pip install -e '.[convnet]'",
               ImportError)
    return v2.RandAugment(num_ops=num_ops, magnitude=magnitude) if kind == "randaugment" else v2.TrivialAugmentWide()


def augment_seeded(op, images: torch.Tensor, seeds) -> torch.Tensor:
    """op on each uint8 image of (B, C, H, W) (or one (C, H, W)), seeded by the image's seed in a forked RNG."""
    one = images.dim() == 3
    with torch.random.fork_rng(devices=[]):
        out = []
        for img, seed in zip(images[None] if one else images, [seeds] if one else seeds):
            torch.manual_seed(int(seed))
            out.append(op(img))
    return out[0] if one else torch.stack(out)


def random_erase(x: torch.Tensor, prob: float, rng: random.Random, scale=(0.02, 1 / 3), ratio=(0.3, 3.3)) -> torch.Tensor:
    """Zhong et al., "Random Erasing Data Augmentation" (2017), timm's 'pixel' mode: each image of x
    (B, C, H, W), with probability prob, gets a box of N(0, 1) noise; draws from rng; a new tensor."""
    B, C, H, W = x.shape
    x = x.clone()
    for i in range(B):
        if rng.random() >= prob:
            continue
        for _ in range(10):
            area = H * W * rng.uniform(*scale)
            r = math.exp(rng.uniform(math.log(ratio[0]), math.log(ratio[1])))
            h, w = int(round(math.sqrt(area * r))), int(round(math.sqrt(area / r)))
            if 0 < h < H and 0 < w < W:
                top, left = rng.randint(0, H - h), rng.randint(0, W - w)
                noise = torch.randn(C, h, w, generator=torch.Generator().manual_seed(rng.getrandbits(62)))
                x[i, :, top:top + h, left:left + w] = noise.to(x.device, x.dtype)
                break
    return x


def smooth_one_hot(y: torch.Tensor, num_classes: int, smoothing: float) -> torch.Tensor:
    """(B,) labels -> (B, num_classes) targets: 1 - smoothing + smoothing / K on the label, smoothing / K elsewhere."""
    off = smoothing / num_classes
    return torch.full((len(y), num_classes), off, device=y.device).scatter_(1, y[:, None], 1.0 - smoothing + off)


def mix_batch(x: torch.Tensor, y: torch.Tensor, num_classes: int, rng: random.Random, mixup_alpha: float = 0.0,
              cutmix_alpha: float = 0.0, prob: float = 1.0, switch_prob: float = 0.5, smoothing: float = 0.0):
    """Mixup (Zhang et al., 2018) or CutMix (Yun et al., 2019) of a batch with itself reversed, as timm's
    batch mode: x (B, C, H, W), labels (B,) -> (mixed x, soft targets (B, num_classes), lam); mixed
    with probability `prob`, CutMix with `switch_prob` when both alphas are on."""
    t = smooth_one_hot(y, num_classes, smoothing)
    if rng.random() >= prob or (mixup_alpha <= 0 and cutmix_alpha <= 0):
        return x, t, 1.0
    cutmix = cutmix_alpha > 0 and (mixup_alpha <= 0 or rng.random() < switch_prob)
    alpha = cutmix_alpha if cutmix else mixup_alpha
    lam, partner = rng.betavariate(alpha, alpha), x.flip(0)
    if cutmix:
        H, W = x.shape[-2:]
        cut = math.sqrt(1.0 - lam)
        h, w = int(H * cut), int(W * cut)
        cy, cx = rng.randrange(H), rng.randrange(W)
        y0, y1 = max(cy - h // 2, 0), min(cy + h // 2, H)
        x0, x1 = max(cx - w // 2, 0), min(cx + w // 2, W)
        x = x.clone()
        x[:, :, y0:y1, x0:x1] = partner[:, :, y0:y1, x0:x1]
        lam = 1.0 - (y1 - y0) * (x1 - x0) / (H * W)
    else:
        x = x * lam + partner * (1.0 - lam)
    return x, t * lam + t.flip(0) * (1.0 - lam), lam


def processed_image(processor, path: str) -> tuple[torch.Tensor, str]:
    """An image file through a VLM's ImageProcessor (zoo/vlm_processor.py): (its tiles (n, C, S, S), the text of its
    place in the prompt); a file that is missing or not an image: a one-line error naming it."""
    from PIL import Image
    try:
        with Image.open(path) as img:
            return processor(img)
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except OSError as e:
        raise DataError(f"{path}: cannot decode it as an image ({type(e).__name__})") from None


def image_processor(model, path=None):
    """The ImageProcessor of a VLM loaded from `path`: as the first of its model_sources holding a
    preprocessor_config.json or processor_config.json says, else one tile of the encoder's size per image."""
    from zoo.vlm_processor import FILES, ImageProcessor
    from .conversations import model_sources
    for src in model_sources(path) if path is not None else []:
        if any((src / f).is_file() for f in FILES):
            return ImageProcessor.from_folder(src, model)
    return ImageProcessor.for_model(model)
