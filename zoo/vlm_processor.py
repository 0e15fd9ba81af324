"""SmolVLM's and Idefics3's processor: an image -> the tiles the encoder reads, and the text its `<image>` place in the
prompt becomes, as transformers' SmolVLMImageProcessor and SmolVLMProcessor (Idefics3's alike) make them.

    resize: the longest edge to `longest_edge`, the other in proportion (rounded up to even)   [0: not resized]
    splitting: both edges up to whole tiles of `size`, cut into rows x cols tiles row by row, then the whole image
        resized to one tile (the global image); an image of one tile stays one
    no splitting: the image resized to one tile
    each tile's 0-255 values: (x - mean / rescale) / (std / rescale)
    text: per tile `<fake_token_around_image><row_R_col_C>` and `tokens` `<image>`s, a newline after each row, a
        blank line, then `<fake_token_around_image><global-img>`, `tokens` `<image>`s, `<fake_token_around_image>`
        (an untiled image: that last part alone)

A folder's preprocessor_config.json and processor_config.json hold the settings (`from_folder`, `save`).

    proc = ImageProcessor.from_folder("SmolVLM-256M-Instruct/", model)
    pixels, text = proc(PIL.Image.open("cat.jpg"))   # (tiles + 1, 3, size, size) float32, the text of its <image>
    pixel_values, pixel_attention_mask = pad_images([pixels])   # a batch of one prompt
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from .weights.files import atomic_write, read_json

FILES = ("preprocessor_config.json", "processor_config.json")
IMAGE_TOKENS = ("<image>", "<fake_token_around_image>", "<global-img>")
RESAMPLE = {1: "lanczos", 2: "bilinear", 3: "bicubic"}  # PIL's filter codes, as the folders store them
MAX_EDGE = 4096  # transformers' cap on a resized image's edge


def image_text(tokens: int, rows: int = 0, cols: int = 0) -> str:
    """The prompt text of one image of rows x cols tiles (0 x 0: untiled), `tokens` image tokens per tile."""
    image, fake, glob = IMAGE_TOKENS
    grid = "".join("".join(f"{fake}<row_{r + 1}_col_{c + 1}>" + image * tokens for c in range(cols)) + "\n"
                   for r in range(rows))
    return grid + "\n" * bool(rows) + fake + glob + image * tokens + fake


def pad_images(pixels: list) -> tuple[torch.Tensor, torch.Tensor]:
    """Each prompt's images ((n, C, S, S) or None) -> pixel_values (B, max n, C, S, S), all-zero images padding the
    shorter, and pixel_attention_mask (B, max n, S, S), true on the real images."""
    real = [p for p in pixels if p is not None]
    out = real[0].new_zeros(len(pixels), max(len(p) for p in real), *real[0].shape[1:])
    mask = torch.zeros(out.shape[:2] + out.shape[3:], dtype=torch.bool, device=out.device)
    for r, p in enumerate(pixels):
        if p is not None:
            out[r, :len(p)], mask[r, :len(p)] = p, True
    return out, mask


def _longest_edge(h: int, w: int, edge: int) -> tuple[int, int]:
    """(h, w) resized so that the longest edge is `edge`, the other in proportion and even, within MAX_EDGE."""
    r = w / h
    h, w = (int(edge / r) + int(edge / r) % 2, edge) if w >= h else (edge, int(edge * r) + int(edge * r) % 2)
    h, w = max(h, 1), max(w, 1)
    r = w / h
    if max(h, w) > MAX_EDGE:
        h, w = (int(MAX_EDGE / r), MAX_EDGE) if w >= h else (MAX_EDGE, int(MAX_EDGE * r))
    return max(h, 1), max(w, 1)


def _whole_tiles(h: int, w: int, side: int) -> tuple[int, int]:
    """(h, w) grown to whole tiles of `side`, the longest edge first and the other from the aspect ratio."""
    r, up = w / h, lambda n: math.ceil(n / side) * side
    return (up(int(up(w) / r)), up(w)) if w >= h else (up(h), up(int(up(h) * r)))


@dataclass
class ImageProcessor:
    size: int                       # a tile's side (max_image_size.longest_edge): the encoder's image size
    tokens: int                     # the image tokens of one tile (image_seq_len)
    splitting: bool = False         # do_image_splitting: tiles plus the global image; else one tile per image
    longest_edge: int = 0           # size.longest_edge: the longest edge an image is first resized to; 0: not resized
    mean: tuple = (0.5, 0.5, 0.5)   # image_mean: per channel, of values in [0, 1]
    std: tuple = (0.5, 0.5, 0.5)    # image_std
    rescale: float = 1 / 255        # rescale_factor: 0-255 values to [0, 1]
    resample: int = 2               # the filter, PIL's code: 1 Lanczos (SmolVLM's), 2 bilinear, 3 bicubic

    @classmethod
    def for_model(cls, model) -> "ImageProcessor":
        """A VLM's images each resized to one tile of its encoder's size (bilinear)."""
        return cls(model.vision.spec["img_size"], model.image_tokens)

    @classmethod
    def from_folder(cls, folder, model) -> "ImageProcessor":
        """The settings a folder's FILES hold (transformers' defaults for what they lack) for `model`, a VLM; a
        setting Zoo cannot follow: a one-line error naming the file and key. save() writes both files, as the
        SmolVLM checkpoints hold them."""
        pre, proc = (read_json(p) if (p := Path(folder) / f).is_file() else {} for f in FILES)
        nested = "image_processor" in proc  # transformers 5 writes it into processor_config.json, and reads it first
        pre, where = proc["image_processor"] if nested else pre, f"{Path(folder) / FILES[nested]}:"
        edges = {k: pre.get(k, {"longest_edge": v}) for k, v in (("size", 4 * 364), ("max_image_size", 364))}
        for k, v in edges.items():
            if not (isinstance(v, dict) and isinstance(v.get("longest_edge"), int)):
                raise ValueError(f"{where} {k}={v}: Zoo reads its longest_edge only")
        if (r := pre.get("resample", 1)) not in RESAMPLE:
            names = ", ".join(f"{k} ({v})" for k, v in RESAMPLE.items())
            raise ValueError(f"{where} resample={r}: Zoo resizes with {names}")
        size, norm = edges["max_image_size"]["longest_edge"], pre.get("do_normalize", True)
        tokens, want = proc.get("image_seq_len", 169), model.tile_tokens(size)
        if tokens != want:
            raise ValueError(f"{Path(folder) / FILES[1]}: image_seq_len={tokens}, but a tile of {size} pixels is "
                             f"{want} image tokens of this model")
        return cls(size, tokens, pre.get("do_image_splitting", True),
                   edges["size"]["longest_edge"] * pre.get("do_resize", True),
                   tuple(pre.get("image_mean", cls.mean)) if norm else (0.0,) * 3,
                   tuple(pre.get("image_std", cls.std)) if norm else (1.0,) * 3,
                   pre.get("rescale_factor", cls.rescale) if pre.get("do_rescale", True) else 1.0, r)

    def save(self, folder) -> None:
        """Write FILES as transformers' SmolVLMProcessor reads them."""
        pre = dict(image_processor_type="SmolVLMImageProcessor", processor_class="SmolVLMProcessor",
                   do_convert_rgb=True, do_resize=bool(self.longest_edge),
                   size={"longest_edge": self.longest_edge or self.size}, do_image_splitting=self.splitting,
                   max_image_size={"longest_edge": self.size}, resample=self.resample, do_rescale=True,
                   rescale_factor=self.rescale, do_normalize=True, image_mean=self.mean, image_std=self.std,
                   do_pad=True)
        for name, data in zip(FILES, (pre, dict(image_seq_len=self.tokens, processor_class="SmolVLMProcessor"))):
            atomic_write(Path(folder) / name, json.dumps(data, indent=2) + "\n")

    def markers(self) -> tuple:
        """The texts its prompts hold that a tokenizer should keep whole: the image tokens, and the tiles' names."""
        n = math.ceil(self.longest_edge / self.size) if self.splitting else 0
        return IMAGE_TOKENS + tuple(f"<row_{r + 1}_col_{c + 1}>" for r in range(n) for c in range(n))

    def resize(self, x: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """(C, H, W) uint8 -> (C, h, w) uint8, antialiased, as torchvision resizes uint8 on the CPU."""
        if x.shape[-2:] == (h, w):
            return x
        return F.interpolate(x[None], (h, w), mode=RESAMPLE[self.resample], antialias=True, align_corners=False)[0]

    def __call__(self, image) -> tuple[torch.Tensor, str]:
        """A PIL image -> (its tiles and global image, or its one tile: (n, 3, size, size) float32, its prompt text)."""
        from PIL import Image
        if "A" in image.getbands() or image.info.get("transparency") is not None:  # onto white, as transformers does
            image = Image.alpha_composite(Image.new("RGBA", image.size, (255,) * 4), image.convert("RGBA"))
        x = torch.from_numpy(np.array(image.convert("RGB"))).permute(2, 0, 1)
        if self.longest_edge:
            x = self.resize(x, *_longest_edge(*x.shape[1:], self.longest_edge))
        s, rows, cols, tiles = self.size, 0, 0, x.new_empty(0, x.shape[0], self.size, self.size)
        if self.splitting:
            x = self.resize(x, *_whole_tiles(*x.shape[1:], s))
            if max(x.shape[1:]) > s:
                rows, cols = x.shape[1] // s, x.shape[2] // s
                tiles = x.unfold(1, s, s).unfold(2, s, s).reshape(x.shape[0], -1, s, s).transpose(0, 1)
        frames = torch.cat([tiles, self.resize(x, s, s)[None]]).float()
        mean, std = (torch.tensor(v) * (1.0 / self.rescale) for v in (self.mean, self.std))
        return frames.sub_(mean[:, None, None]).div_(std[:, None, None]), image_text(self.tokens, rows, cols)
