"""Latent diffusion: images -> frozen TAESD latents (computed once) -> noise -> denoiser (U-Net or DiT) -> loss.

setup() loads the autoencoder and fills the latent cache (train/data/latents.py), so the loop trains
only the denoiser, no encoder in the step; samples() writes a guided grid to out_dir/samples.png."""
from __future__ import annotations

import copy
import dataclasses
import functools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal, Optional, Union

import torch
import torch.nn.functional as F

import zoo
from zoo.config import ConfigError, bounded
from zoo.diffusion.latent import LatentDiffusion, build_autoencoder
from zoo.diffusion.schedule import flow_timesteps
from zoo.diffusion.taesd import TAESD
from zoo.weights import diffusers_dit, diffusers_flux2
from zoo.weights.files import atomic_write

from ..checkpoint import read_weights
from ..data import DataError, cache_dir, files_fingerprint, short_digest
from ..data.latents import LatentCache, latent_cache, weights_fingerprint
from ..step import eval_mode
from . import Task


@dataclass
class DiffusionDataConfig:
    dataset: str = "digits"                 # `digits`, an image folder `root/<class>/*` (a class per folder) or a folder
                                            # of images (one class); centre crops of model.image_size
    val_fraction: float = bounded(0.1, gt=0, lt=1)  # held-out images
    hflip: bool = False                     # also encode each training image mirrored; a step takes either at random
    cache_dir: Optional[str] = None         # trained autoencoders and latent caches; null = `$ZOO_CACHE`, else the user
                                            # cache directory (`$XDG_CACHE_HOME/zoo` or `~/.cache/zoo`)
    encode_batch_size: int = bounded(64, gt=0)  # batch for the one-off encoding into the latent cache
    buckets: Optional[Union[list[tuple[int, int]], Literal["auto"]]] = None  # aspect-ratio buckets of an image
                                            # folder's training images: [[H, W], ...] pixels or `auto` (SDXL's kind, up
                                            # to model.image_size squared pixels); each image to the nearest ratio,
                                            # centre-cropped to it; a batch from one bucket; null: square crops
    # the autoencoder trained here when model.autoencoder.weights is null
    ae_steps: int = bounded(400, gt=0)      # autoencoder training (when no weights)
    ae_batch_size: int = bounded(32, gt=0)  # autoencoder training (when no weights)
    ae_lr: float = bounded(2e-3, gt=0)      # autoencoder training (when no weights)
    ae_latent_noise: float = bounded(0.1, ge=0)  # noise added to latents in training: a decoder robust to sampling error
    # samples.png
    samples_per_class: int = bounded(8, gt=0)  # columns of samples.png


@dataclass
class ImageData:
    """A dataset's two splits, read lazily: labels (N,) int64 each, read(split, start, stop) -> images
    (n, 3, size, size) float32 in [0, 1]; `key` identifies the images (for the caches). With buckets the training
    images are also split by bucket ("train-HxW", images (n, 3, H, W)): `train_splits` names what is trained on."""
    key: dict
    labels: dict
    read: Callable[[str, int, int], torch.Tensor]
    classes: int
    train_splits: tuple = ("train",)


def buckets_of(cfg) -> Optional[list]:
    """data.buckets as [(H, W)] pixels (`auto`: auto_buckets at model.image_size and the latent patch), or None."""
    from ..data.images import auto_buckets
    b, m = cfg.data.buckets, cfg.model
    if b is None:
        return None
    return auto_buckets(m.image_size, TAESD.downscale * m.latent_multiple) if b == "auto" else [tuple(x) for x in b]


def load_images(d: DiffusionDataConfig, size: int, source: str, buckets=None) -> ImageData:
    """The digits (in memory), or an image folder split at random (fixed seed) into train and val, centre
    crops of size x size (and of `buckets`) read lazily; a missing or unreadable file is a one-line error naming it."""
    key = {"dataset": d.dataset, "size": size, "val": d.val_fraction}
    if d.dataset == "digits":
        from ..data.images import digits_dataset
        x = {s: digits_dataset(s, size, 3, d.val_fraction) for s in ("train", "val")}
        return ImageData(key, {s: y for s, (_, y) in x.items()}, lambda s, i, j: x[s][0][i:j], 10)
    from ..data.images import scan_image_folder
    try:
        classes, samples = scan_image_folder(d.dataset, flat=True)
    except (ValueError, FileNotFoundError) as e:
        raise ConfigError(f"{source}: data.dataset: {e}") from None
    return split_images(d, samples, size, source, dict(key, classes=classes), len(classes), buckets)


def split_images(d: DiffusionDataConfig, samples: list, size: int, source: str, key: dict, classes: int,
                 buckets=None) -> ImageData:
    """[(path, label)] split at random (fixed seed) into train and val, centre crops read lazily, and the training
    images by `buckets` [(H, W)] (whole centred boxes of the bucket's shape); an unreadable file is a one-line error
    naming it."""
    from ..data.images import FolderImages, bucketed, collate_images
    if len(samples) < 2:
        raise ConfigError(f"{source}: data.dataset: {d.dataset}: {len(samples)} image; a train and a val split need two")
    perm = torch.randperm(len(samples), generator=torch.Generator().manual_seed(0)).tolist()
    n_val = min(len(samples) - 1, max(1, round(len(samples) * d.val_fraction)))
    parts = {"train": [samples[i] for i in perm[n_val:]], "val": [samples[i] for i in perm[:n_val]]}
    sets = {s: FolderImages(p, size, train=False) for s, p in parts.items()}
    for b, p in sorted(bucketed(parts["train"], buckets).items()) if buckets else ():
        name = "train-{}x{}".format(*buckets[b])
        parts[name], sets[name] = p, FolderImages(p, buckets[b], train=False, crop_pct=1.0)

    def read(split, i, j):
        x, _, bad = collate_images([sets[split][k] for k in range(i, j)])
        if bad:
            raise DataError(f"{bad[0]}: unreadable image (in data.dataset={d.dataset})")
        return x.float() / 255

    key.update(crop="centre", files=files_fingerprint(p for p, _ in samples))
    if buckets:
        key["buckets"] = [list(b) for b in buckets]
    labels = {s: torch.tensor([y for _, y in p], dtype=torch.int64) for s, p in parts.items()}
    return ImageData(key, labels, read, classes, tuple(s for s in parts if s.startswith("train-")) or ("train",))


def train_autoencoder(ae: TAESD, images: torch.Tensor, steps: int, batch_size: int, lr: float, noise: float,
                      device, seed: int = 0, log=print) -> TAESD:
    """Fit `ae` to reconstruct `images` (N, 3, H, W) with noisy latents (AdamW, cosine); eval mode, CPU."""
    ae = ae.to(device).train()
    opt, g = torch.optim.AdamW(ae.parameters(), lr=lr, weight_decay=0.0), torch.Generator().manual_seed(seed)
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr * 0.5 * (1 + math.cos(math.pi * step / steps))
        x = images[torch.randint(len(images), (batch_size,), generator=g)].to(device)
        z = ae.encode(x)
        z = z + noise * torch.randn(z.shape, generator=g).to(device)
        loss = F.mse_loss(ae.decode(z), x)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 100 == 0 or step == steps - 1:
            log(f"autoencoder: step {step + 1}/{steps} reconstruction mse {loss.item():.5f}")
    return ae.eval().cpu()


def load_dit_into(model: LatentDiffusion, path):
    """The denoiser's weights from a diffusers DiTTransformer2DModel folder: the run's `model.dit` keys
    and classes must describe that DiT (each difference a one-line error naming the key to set)."""
    ours, theirs = model.denoiser, diffusers_dit.load(path)
    if model.config.denoiser != "dit":
        raise ValueError(f"{path}: a DiT; set model.denoiser=dit")
    for k in ("resolved_depth", "resolved_width", "resolved_heads", "patch_size", "learn_sigma", "qkv_bias", "norm_eps",
              "freq_shift", "block_conditioning", "mlp_ratio", "qk_norm", "rope"):
        if (value := getattr(theirs.config, k)) != getattr(ours.config, k):
            name = k.removeprefix("resolved_")
            raise ValueError(f"{path}: the DiT there has {name}={value}; set model.dit.{name}={value}")
    if (ours.num_classes, ours.in_channels) != (theirs.num_classes, theirs.in_channels):
        raise ValueError(f"{path}: the DiT there has {theirs.num_classes} classes and {theirs.in_channels} latent "
                         f"channels, this run {ours.num_classes} and {ours.in_channels}")
    if theirs.sample_size != ours.sample_size:
        raise ValueError(f"{path}: the DiT there was trained on {theirs.sample_size}x{theirs.sample_size} latents; "
                         f"set model.image_size={theirs.sample_size * 8}")
    ours.load_state_dict(theirs.state_dict())


def load_flux2_into(model: LatentDiffusion, path):
    """The denoiser's weights from a diffusers Flux2Transformer2DModel folder (or a pipeline's transformer/): the run's
    `model.flux2` keys must describe it (the first difference a one-line error naming the key to set)."""
    theirs = diffusers_flux2.load(path)
    if model.config.denoiser != "flux2":
        raise ValueError(f"{path}: a FLUX.2 transformer; set model.denoiser=flux2")
    for f in dataclasses.fields(theirs.config):
        if (value := getattr(theirs.config, f.name)) != getattr(model.config.flux2, f.name):
            raise ValueError(f"{path}: the FLUX.2 transformer there has {f.name}={value}; set model.flux2.{f.name}="
                             f"{list(value) if isinstance(value, tuple) else value}")
    model.denoiser.load_state_dict(theirs.state_dict())


class DiffusionTask(Task):
    DataConfig, unit = DiffusionDataConfig, "images"
    formats = {"captions": "train.tasks.text_to_image:TextToImageTask"}

    @staticmethod
    def validate_config(cfg):
        m = cfg.model
        if m.autoencoder.weights and not Path(m.autoencoder.weights).exists():
            raise ConfigError(f"{cfg.source}: model.autoencoder.weights={m.autoencoder.weights}: no such file or "
                              f"directory")
        if (m.denoiser == "flux2") != (getattr(cfg.data, "format", None) == "captions"):
            raise ConfigError(f"{cfg.source}: model.denoiser={m.denoiser}: the text-conditioned denoiser (flux2) "
                              f"trains on data.format: captions, the class-conditional ones (unet, dit) on classes")
        if cfg.data.buckets is None:
            return
        why = "model.denoiser=dit denoises one latent size (model.image_size); buckets need flux2 or unet" if \
            m.denoiser == "dit" else "the digits are square; buckets sort an image folder" if \
            cfg.data.dataset == "digits" else None if buckets_of(cfg) else "an empty list (null: square crops)"
        if why:
            raise ConfigError(f"{cfg.source}: data.buckets: {why}")
        step = TAESD.downscale * m.latent_multiple
        for i, (h, w) in enumerate(buckets_of(cfg)):
            if min(h, w) <= 0 or h % step or w % step:
                raise ConfigError(f"{cfg.source}: data.buckets[{i}]=[{h}, {w}]: each side must be a positive multiple "
                                  f"of {step} (the autoencoder's {TAESD.downscale} x the latent patch "
                                  f"{m.latent_multiple})")

    @property
    def null_label(self) -> int:
        """The condition that dropped labels take (classifier-free guidance's unconditional side)."""
        return self.cfg.model.num_classes

    def label_dropout(self) -> float:
        return self.cfg.model.class_dropout

    def condition(self, labels: torch.Tensor) -> torch.Tensor:
        """What the denoiser is conditioned on, from the (possibly dropped) labels: the labels themselves."""
        return labels

    def load_data(self) -> ImageData:
        cfg, m = self.cfg, self.cfg.model
        data = load_images(cfg.data, m.image_size, cfg.source, buckets_of(cfg))
        if data.classes > m.num_classes:
            raise ConfigError(f"{cfg.source}: model.num_classes={m.num_classes} but data.dataset has "
                              f"{data.classes} classes")
        return data

    def setup(self):
        cfg, d, m = self.cfg, self.cfg.data, self.cfg.model
        data = self.load_data()
        n_tr, n_va = len(data.labels["train"]), len(data.labels["val"])
        self.log(f"data: {d.dataset}, {n_tr} train / {n_va} val images of {m.image_size}x{m.image_size}")
        if d.buckets is not None:
            self.log("buckets (H x W: training images): " + ", ".join(
                f"{s.removeprefix('train-')}: {len(data.labels[s])}" for s in data.train_splits))
        self.autoencoder = self._autoencoder(data)
        C = self.autoencoder.latent_channels
        if m.latent_channels is not None and m.latent_channels != C:
            raise ConfigError(f"{cfg.source}: model.latent_channels={m.latent_channels} does not match the "
                              f"autoencoder's {C} latent channels")
        self.latents, self.splits = self._latent_cache(data), list(data.train_splits)
        self.y_tr = {s: self.latents.labels[s].to(self.device) for s in self.splits}
        self.split_weights = torch.tensor([float(len(self.y_tr[s])) for s in self.splits])  # a bucket per its images
        self._standardise(self.latents.mean, self.latents.std)
        self.log(f"latents: {self.latents.shape} per image, {self.latents.views} per training image "
                 f"(mean {[round(v, 3) for v in self.latent_mean.tolist()][:4]}..., "
                 f"std {[round(v, 3) for v in self.latent_std.tolist()][:4]}...)")

    def _latent_cache(self, data: ImageData) -> LatentCache:
        """Every image encoded once by the frozen autoencoder into the on-disk latent cache (reused)."""
        d, ae = self.cfg.data, self.autoencoder.to(self.device).eval()
        key = {**data.key, "autoencoder": weights_fingerprint(ae), "variant": ae.variant, "hflip": d.hflip}
        folder = cache_dir(d.cache_dir) / f"latents-{Path(d.dataset).name}-{short_digest(key)}"
        splits = {s: (data.labels[s], functools.partial(data.read, s)) for s in (*data.train_splits, "val")}
        return latent_cache(folder, key, splits, lambda x: ae.encode(x.to(self.device)), 2 if d.hflip else 1,
                            d.encode_batch_size, log=self.log)

    def _standardise(self, mean: torch.Tensor, std: torch.Tensor):
        """Latents standardised per channel by `mean` and `std` (the data's, or a loaded run's): the validation
        latents that evaluate() reads, kept on the device."""
        self.latent_mean, self.latent_std = mean.clone(), std.clone()
        n_eval = self.cfg.train.batch_size * self.cfg.train.eval_batches
        self.z_va = self._normalised(self.latents.latents("val", slice(0, n_eval)))
        self.y_va = self.latents.labels["val"][:n_eval].to(self.device)

    def _normalised(self, raw: torch.Tensor) -> torch.Tensor:
        """Raw latents (B, C, h, w) -> on the device, per-channel standardised."""
        raw = raw.to(self.device)
        return (raw - self.latent_mean.to(raw).view(1, -1, 1, 1)) / self.latent_std.to(raw).view(1, -1, 1, 1)

    def _autoencoder(self, data: ImageData) -> TAESD:
        cfg, d, m = self.cfg, self.cfg.data, self.cfg.model
        ae = build_autoencoder(m, cfg.source)
        if m.autoencoder.weights:
            self.log(f"autoencoder: {m.autoencoder.weights} (frozen) {ae.variant}")
            return ae
        key = short_digest({"ae": ae.variant, "data": d.dataset, "size": m.image_size, "val": d.val_fraction,
                       "steps": d.ae_steps, "bs": d.ae_batch_size, "lr": d.ae_lr, "noise": d.ae_latent_noise,
                       "seed": cfg.train.seed, **({"files": data.key["files"]} if "files" in data.key else {})})
        path = cache_dir(d.cache_dir) / f"taesd-{Path(d.dataset).name}-{key}_encoder.safetensors"
        if path.is_file():
            try:
                cached = zoo.from_pretrained(path, **ae.variant)
                self.log(f"autoencoder: reusing {path}")
                return cached
            except (ValueError, OSError) as e:  # a truncated, corrupt or half-written cache: train it again
                self.log(f"autoencoder: cached file unusable ({e}); training it again")
        self.log(f"autoencoder: training a TAESD {ae.variant} on the training images ({d.ae_steps} steps)")
        torch.manual_seed(cfg.train.seed)
        ae = train_autoencoder(ae, data.read("train", 0, len(data.labels["train"])), d.ae_steps, d.ae_batch_size,
                               d.ae_lr, d.ae_latent_noise, self.device, cfg.train.seed, self.log)
        zoo.save_pretrained(ae, path)
        self.log(f"autoencoder: cached in {path}")
        return ae

    def build_model(self):
        # a copy each: FSDP2 with an adapter shards the trained model's frozen autoencoder in place
        model = LatentDiffusion(self.cfg.model, autoencoder=copy.deepcopy(self.autoencoder))
        model.latent_mean.copy_(self.latent_mean)
        model.latent_std.copy_(self.latent_std)
        if self.cfg.train.init_from:  # a model.safetensors of an earlier run (or the folder holding it), or a
            def read(path):              # diffusers DiTTransformer2DModel / Flux2Transformer2DModel folder (the denoiser)
                if diffusers_dit.detect(path):
                    return load_dit_into(model, path)
                if diffusers_flux2.detect(path):
                    return load_flux2_into(model, path)
                p = Path(path) / "model.safetensors" if Path(path).is_dir() else Path(path)
                model.load_state_dict(read_weights(p, model), strict=False)
            self.load_pretrained(read)
            self._standardise(model.latent_mean, model.latent_std)  # a Zoo run's: the latents its denoiser learnt
        self.log(f"denoiser: {model.num_params() / 1e6:.2f}M trainable parameters")
        return model

    def _noised(self, z, y, g, drop: float):
        B, m = len(z), self.cfg.model
        t = flow_timesteps(B, m.flow_timesteps, m.flow_logit_mean, m.flow_logit_std, g) if m.prediction == "flow" \
            else torch.randint(m.num_timesteps, (B,), generator=g)
        noise = torch.randn(z.shape, generator=g)
        if drop > 0:
            keep = torch.rand(B, generator=g) >= drop
            y = torch.where(keep.to(y.device), y, torch.full_like(y, self.null_label))
        return {"z": z, "labels": self.condition(y), "t": t.to(self.device), "noise": noise.to(self.device)}

    def train_batch(self, step, micro):
        g = self.batch_generator(step, micro)
        split = self.splits[int(torch.multinomial(self.split_weights, 1, generator=g))] if len(self.splits) > 1 \
            else self.splits[0]
        idx = torch.randint(len(self.y_tr[split]), (self.global_rows(),), generator=g)
        views = torch.randint(self.latents.views, idx.shape, generator=g) if self.latents.views > 1 else None
        z = self._normalised(self.latents.latents(split, idx, views))
        batch = self._noised(z, self.y_tr[split][idx.to(self.device)], g, self.label_dropout())
        return {k: self.own_rows(v) for k, v in batch.items()} if self.world > 1 else batch

    def loss(self, model, batch):
        per_item = model(batch["z"], batch["labels"], batch["t"], batch["noise"])
        return per_item.mean(), len(per_item)

    def example_batch(self, model, batch_size):
        S = self.cfg.model.image_size
        H, W = max(buckets_of(self.cfg) or [(S, S)], key=lambda b: b[0] * b[1])  # the most pixels
        z = torch.zeros(batch_size, model.latent_channels, H // TAESD.downscale, W // TAESD.downscale,
                        device=self.device)
        labels = torch.zeros(batch_size, dtype=torch.long, device=self.device)
        t = torch.zeros(batch_size, device=self.device) if self.cfg.model.prediction == "flow" else labels.clone()
        return {"z": z, "labels": labels, "t": t, "noise": torch.zeros_like(z)}

    @torch.no_grad()
    def evaluate(self, model):
        """On the held-out latents with fixed t and noise: val_loss, the training loss (same weighting),
        and val_mse, the unweighted MSE of the prediction (comparable across loss weightings)."""
        with eval_mode(model):
            g, bs = torch.Generator().manual_seed(1234), self.cfg.train.batch_size
            n = min(len(self.z_va), bs * self.cfg.train.eval_batches)
            total, mse = 0.0, 0.0
            for i in range(0, n, bs):
                b = self._noised(self.z_va[i:i + bs][: n - i], self.y_va[i:i + bs][: n - i], g, 0.0)
                with self.autocast():
                    total += model(b["z"], b["labels"], b["t"], b["noise"]).float().sum().item()
                    mse += model(b["z"], b["labels"], b["t"], b["noise"], weighted=False).float().sum().item()
        return {"val_loss": total / max(n, 1), "val_mse": mse / max(n, 1)}

    def samples(self, model, out_dir):
        path = Path(out_dir) / "samples.png"
        images = sample_grid(model, self.cfg.data.samples_per_class, self.device, self.cfg.train.seed, self.autocast)
        save_grid(images, path, nrow=self.cfg.data.samples_per_class)
        m = self.cfg.model
        return (f"{path}: {len(images)} samples, a row per class ({m.sampler}, {m.sample_steps} steps, "
                f"guidance {m.guidance})")


@torch.no_grad()
def sample_grid(model: LatentDiffusion, per_class: int, device, seed: int = 0, autocast=None, conditions=None, **kw):
    """per_class samples of every class (or of each of `conditions`' rows: prompt embeddings), class-major ->
    images (num_classes * per_class, 3, H, W)."""
    rows = torch.arange(model.config.num_classes, device=device) if conditions is None else conditions.to(device)
    labels = rows.repeat_interleave(per_class, 0)
    g = torch.Generator(device=device).manual_seed(seed)
    with eval_mode(model), (autocast() if autocast is not None else torch.autocast(device.type, enabled=False)):
        return model.sample(labels, generator=g, **kw).float()


def image_grid(images: torch.Tensor, nrow: int, padding: int = 2, pad_value: float = 0.5) -> torch.Tensor:
    """images (N, C, H, W) -> one (C, rows * (H + padding) + padding, nrow * (W + padding) + padding)
    image: `nrow` images per row, `padding` pixels of `pad_value` around and between them."""
    N, C, H, W = images.shape
    cols = min(nrow, N)
    rows = -(-N // cols)
    grid = images.new_full((C, rows * (H + padding) + padding, cols * (W + padding) + padding), pad_value)
    for k in range(N):
        y, x = divmod(k, cols)
        top, left = y * (H + padding) + padding, x * (W + padding) + padding
        grid[:, top:top + H, left:left + W] = images[k]
    return grid


def save_grid(images: torch.Tensor, path, nrow: int, padding: int = 2):
    """Write images (N, C, H, W) in [0, 1] as one PNG grid (Pillow; atomically)."""
    from PIL import Image
    grid = image_grid(images.detach().float().clamp(0, 1).cpu(), nrow, padding)
    pixels = grid.mul(255).add_(0.5).clamp_(0, 255).to(torch.uint8).permute(1, 2, 0).numpy()
    image = Image.fromarray(pixels[..., 0] if pixels.shape[-1] == 1 else pixels)
    atomic_write(path, lambda tmp: image.save(tmp, format="PNG"))
