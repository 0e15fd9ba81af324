"""A ConvNet's evaluation preprocessing, as a run evaluated it: decode, centre-crop, resize, normalise.

A ConvNet run folder holds it in preprocess.json (with the class names), so the folder is usable
on its own:

    model = zoo.from_pretrained("runs/imgs").eval()
    prep = Preprocess.from_folder("runs/imgs")
    probs = model(prep(["cat.jpg", "dog.png"])).softmax(-1)     # (B, len(prep.classes))
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

FILE = "preprocess.json"


def center_crop_box(w: int, h: int, crop_pct: float = 0.875, aspect: float = 1.0):
    """The box that 'resize the short side to size / crop_pct, then centre-crop size' keeps; for another `aspect`
    (width / height) the largest centred box of that shape, times crop_pct."""
    bw = min(w, h * aspect) * crop_pct
    x0, y0 = (w - bw) / 2, (h - bw / aspect) / 2
    return (x0, y0, x0 + bw, y0 + bw / aspect)


def load_crop(path: str, size, box_fn, mode: str = "RGB", flip: bool = False) -> np.ndarray:
    """Decode `path` with PIL, crop box_fn(w, h) and resize it to size x size (or size (H, W)) -> uint8 (H, W, C).
    JPEGs are decoded at the smallest DCT scale that still leaves the crop >= size pixels."""
    from PIL import Image
    H, W = (size, size) if isinstance(size, int) else size
    with Image.open(path) as img:
        w, h = img.size
        box = box_fn(w, h)
        if img.format == "JPEG":
            need = max(W / max(1e-6, box[2] - box[0]), H / max(1e-6, box[3] - box[1]))  # output px per source px
            if need < 1.0:
                img.draft(img.mode if img.mode in ("RGB", "L") else "RGB", (math.ceil(w * need), math.ceil(h * need)))
                sx, sy = img.size[0] / w, img.size[1] / h
                box = (box[0] * sx, box[1] * sy, box[2] * sx, box[3] * sy)
        img = img.convert(mode)
        out = img.resize((W, H), Image.BILINEAR, box=box)
    if flip:
        out = out.transpose(Image.FLIP_LEFT_RIGHT)
    arr = np.asarray(out, dtype=np.uint8)
    return arr[:, :, None] if arr.ndim == 2 else arr


@dataclass
class Preprocess:
    size: int                  # the square the images are resized to
    channels: int              # 1 (grey) or 3 (RGB)
    mean: tuple                # per channel, of images in [0, 1]
    std: tuple
    crop_pct: float = 0.875    # the centre crop: the short side resized to size / crop_pct, then cropped
    classes: tuple = ()        # the class names, in the order of the model's outputs

    @classmethod
    def from_folder(cls, folder) -> "Preprocess":
        path = Path(folder) / FILE
        if not path.is_file():
            raise FileNotFoundError(f"{folder}: no {FILE} (a ConvNet run folder of train/run.py has one)")
        return cls(**json.loads(path.read_text()))

    def save(self, folder) -> Path:
        path = Path(folder) / FILE
        path.write_text(json.dumps(asdict(self), indent=1) + "\n")
        return path

    def __call__(self, paths) -> torch.Tensor:
        """Image files -> float32 (B, C, size, size), normalised."""
        mode = "L" if self.channels == 1 else "RGB"
        x = torch.stack([torch.from_numpy(load_crop(str(p), self.size, lambda w, h: center_crop_box(w, h, self.crop_pct),
                                                    mode).copy()).permute(2, 0, 1) for p in paths]).float() / 255
        mean, std = (torch.tensor(v, dtype=torch.float32).view(1, -1, 1, 1) for v in (self.mean, self.std))
        return (x - mean) / std
