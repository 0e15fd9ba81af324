"""Latent diffusion: images -> frozen TAESD latents (computed once) -> noise -> denoiser -> Min-SNR loss.

setup(): the autoencoder is either pretrained (model.autoencoder.weights, e.g. taef2_encoder.pth or a
diffusers AutoencoderTiny folder) or trained here on the training images and cached in
data.cache_dir (keyed by everything that determines it, so a second run reuses it). The dataset is
fixed (no augmentation), so every image is encoded once; the per-channel latent mean and std become
the model's normalisation buffers. The loop then trains only the denoiser (and keeps its EMA).
At the end, samples() writes a guided sample grid (a row per class) to out_dir/samples.png.
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

import zoo
from zoo.config import ConfigError, bounded
from zoo.diffusion.latent import LatentDiffusion, build_autoencoder
from zoo.diffusion.taesd import TAESD
from zoo.weights.files import atomic_write

from ..checkpoint import read_weights
from ..data import DataError, cache_dir
from . import Task


@dataclass
class DiffusionDataConfig:
    dataset: str = "digits"                 # `digits` or an image folder `root/<class>/*` (centre crops)
    val_fraction: float = bounded(0.1, gt=0, lt=1)  # held-out images
    cache_dir: Optional[str] = None         # trained autoencoders; null = `$ZOO_CACHE`, else the user cache directory
                                            # (`$XDG_CACHE_HOME/zoo` or `~/.cache/zoo`)
    encode_batch_size: int = bounded(64, gt=0)  # batch for the one-off encoding
    # the autoencoder trained here when model.autoencoder.weights is null
    ae_steps: int = bounded(400, gt=0)      # autoencoder training (when no weights)
    ae_batch_size: int = bounded(32, gt=0)  # autoencoder training (when no weights)
    ae_lr: float = bounded(2e-3, gt=0)      # autoencoder training (when no weights)
    ae_latent_noise: float = bounded(0.1, ge=0)  # noise added to latents in training: a decoder robust to sampling error
    # samples.png
    samples_per_class: int = bounded(8, gt=0)  # columns of samples.png


def load_images(d: DiffusionDataConfig, size: int, source: str):
    """(train images, train labels, val images, val labels, number of classes); images (N, 3, size, size)
    float32 in [0, 1]."""
    if d.dataset == "digits":
        from ..images import digits_dataset
        tr = digits_dataset("train", size, 3, d.val_fraction)
        va = digits_dataset("val", size, 3, d.val_fraction)
        return (*tr, *va, 10)
    from ..images import FolderImages, collate_images, scan_image_folder
    try:
        classes, samples = scan_image_folder(d.dataset)
    except (ValueError, FileNotFoundError) as e:
        raise ConfigError(f"{source}: data.dataset: {e}") from None
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(len(samples), generator=g).tolist()
    n_val = max(1, round(len(samples) * d.val_fraction))
    out = []
    for part in (perm[n_val:], perm[:n_val]):
        ds = FolderImages([samples[i] for i in part], size, train=False)
        x, y, bad = collate_images([ds[i] for i in range(len(ds))])
        if bad:
            raise DataError(f"{bad[0]}: unreadable image ({len(bad)} unreadable in data.dataset={d.dataset})")
        out += [x.float() / 255, y]
    return (*out, len(classes))


def _digest(obj) -> str:
    return hashlib.sha1(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:12]


def train_autoencoder(ae: TAESD, images: torch.Tensor, steps: int, batch_size: int, lr: float, noise: float,
                      device, seed: int = 0, log=print) -> TAESD:
    """Fit `ae` to reconstruct `images` (N, 3, H, W): MSE of decode(encode(x) + noise * randn), AdamW
    with a cosine learning rate. Returns it in eval mode, on the CPU."""
    ae = ae.to(device).train()
    opt = torch.optim.AdamW(ae.parameters(), lr=lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(seed)
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


@torch.no_grad()
def encode_all(ae: TAESD, images: torch.Tensor, batch_size: int, device) -> torch.Tensor:
    ae = ae.to(device).eval()
    return torch.cat([ae.encode(images[i:i + batch_size].to(device)).float().cpu()
                      for i in range(0, len(images), batch_size)])


class DiffusionTask(Task):
    DataConfig = DiffusionDataConfig
    unit = "images"

    @staticmethod
    def validate_config(cfg):
        m = cfg.model
        if m.autoencoder.weights and not Path(m.autoencoder.weights).exists():
            raise ConfigError(f"{cfg.source}: model.autoencoder.weights={m.autoencoder.weights}: no such file or "
                              f"directory")

    # -- data and the frozen autoencoder --------------------------------------------------------

    def setup(self):
        cfg, d, m = self.cfg, self.cfg.data, self.cfg.model
        x_tr, self.y_tr, x_va, self.y_va, n_classes = load_images(d, m.image_size, cfg.source)
        if n_classes > m.num_classes:
            raise ConfigError(f"{cfg.source}: model.num_classes={m.num_classes} but data.dataset has "
                              f"{n_classes} classes")
        self.log(f"data: {d.dataset}, {len(x_tr)} train / {len(x_va)} val images of {m.image_size}x{m.image_size}")
        self.autoencoder = self._autoencoder(x_tr)
        C = self.autoencoder.latent_channels
        if m.latent_channels is not None and m.latent_channels != C:
            raise ConfigError(f"{cfg.source}: model.latent_channels={m.latent_channels} does not match the "
                              f"autoencoder's {C} latent channels")
        raw_tr = encode_all(self.autoencoder, x_tr, d.encode_batch_size, self.device)
        raw_va = encode_all(self.autoencoder, x_va, d.encode_batch_size, self.device)
        x = raw_tr.transpose(0, 1).flatten(1)
        self.latent_mean, self.latent_std = x.mean(1), x.std(1).clamp(min=1e-6)
        norm = lambda r: ((r - self.latent_mean.view(1, -1, 1, 1)) / self.latent_std.view(1, -1, 1, 1))  # noqa: E731
        self.z_tr, self.z_va = norm(raw_tr).to(self.device), norm(raw_va).to(self.device)
        self.y_tr, self.y_va = self.y_tr.to(self.device), self.y_va.to(self.device)
        self.log(f"latents: {tuple(self.z_tr.shape[1:])} per image, encoded once "
                 f"(mean {[round(v, 3) for v in self.latent_mean.tolist()][:4]}..., "
                 f"std {[round(v, 3) for v in self.latent_std.tolist()][:4]}...)")

    def _autoencoder(self, x_tr) -> TAESD:
        cfg, d, m = self.cfg, self.cfg.data, self.cfg.model
        if m.autoencoder.weights:
            ae = build_autoencoder(m, cfg.source)
            self.log(f"autoencoder: {m.autoencoder.weights} (frozen) {ae.variant}")
            return ae
        ae = build_autoencoder(m, cfg.source)
        key = _digest({"ae": ae.variant, "data": d.dataset, "size": m.image_size, "val": d.val_fraction,
                       "steps": d.ae_steps, "bs": d.ae_batch_size, "lr": d.ae_lr, "noise": d.ae_latent_noise,
                       "seed": cfg.train.seed})
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
        ae = train_autoencoder(ae, x_tr, d.ae_steps, d.ae_batch_size, d.ae_lr, d.ae_latent_noise, self.device,
                               cfg.train.seed, self.log)
        zoo.save_pretrained(ae, path)
        self.log(f"autoencoder: cached in {path}")
        return ae

    def build_model(self):
        model = LatentDiffusion(self.cfg.model, autoencoder=self.autoencoder)
        model.latent_mean.copy_(self.latent_mean)
        model.latent_std.copy_(self.latent_std)
        if self.cfg.train.init_from:  # a model.safetensors of an earlier run (or the folder holding it)
            def read(path):
                p = Path(path) / "model.safetensors" if Path(path).is_dir() else Path(path)
                model.load_state_dict(read_weights(p, model), strict=False)
            self.load_pretrained(read)
        self.log(f"denoiser: {model.num_params() / 1e6:.2f}M trainable parameters")
        return model

    # -- batches and loss ---------------------------------------------------------------------

    def _noised(self, z, y, g, drop: float):
        B = len(z)
        T = self.cfg.model.num_timesteps
        t = torch.randint(T, (B,), generator=g)
        noise = torch.randn(z.shape, generator=g)
        if drop > 0:
            keep = torch.rand(B, generator=g) >= drop
            y = torch.where(keep.to(y.device), y, torch.full_like(y, self.cfg.model.num_classes))
        return {"z": z, "labels": y, "t": t.to(self.device), "noise": noise.to(self.device)}

    def train_batch(self, step, micro):
        g = self.batch_generator(step, micro)
        idx = torch.randint(len(self.z_tr), (self.global_rows(),), generator=g).to(self.device)
        batch = self._noised(self.z_tr[idx], self.y_tr[idx], g, self.cfg.model.class_dropout)
        return {k: self.own_rows(v) for k, v in batch.items()} if self.world > 1 else batch

    def loss(self, model, batch):
        per_item = model(batch["z"], batch["labels"], batch["t"], batch["noise"])
        return per_item.mean(), len(per_item)

    def example_batch(self, model, batch_size):
        s = self.cfg.model.image_size // 8
        z = torch.zeros(batch_size, model.latent_channels, s, s, device=self.device)
        labels = torch.zeros(batch_size, dtype=torch.long, device=self.device)
        return {"z": z, "labels": labels, "t": labels.clone(), "noise": torch.zeros_like(z)}

    @torch.no_grad()
    def evaluate(self, model):
        """On the held-out latents with fixed t and noise: val_loss, the training loss (same weighting),
        and val_mse, the unweighted MSE of the prediction (comparable across loss weightings)."""
        was = model.training
        model.eval()
        g = torch.Generator().manual_seed(1234)
        bs = self.cfg.train.batch_size
        n = min(len(self.z_va), bs * self.cfg.train.eval_batches)
        total, mse = 0.0, 0.0
        for i in range(0, n, bs):
            b = self._noised(self.z_va[i:i + bs][: n - i], self.y_va[i:i + bs][: n - i], g, 0.0)
            with self.autocast():
                total += model(b["z"], b["labels"], b["t"], b["noise"]).float().sum().item()
                mse += model(b["z"], b["labels"], b["t"], b["noise"], weighted=False).float().sum().item()
        model.train(was)
        return {"val_loss": total / max(n, 1), "val_mse": mse / max(n, 1)}

    # -- samples ------------------------------------------------------------------------------

    def samples(self, model, out_dir):
        path = Path(out_dir) / "samples.png"
        images = sample_grid(model, self.cfg.data.samples_per_class, self.device, self.cfg.train.seed,
                             self.autocast)
        save_grid(images, path, nrow=self.cfg.data.samples_per_class)
        m = self.cfg.model
        return (f"{path}: {len(images)} samples, a row per class ({m.sampler}, {m.sample_steps} steps, "
                f"guidance {m.guidance})")


@torch.no_grad()
def sample_grid(model: LatentDiffusion, per_class: int, device, seed: int = 0, autocast=None, **kw):
    """per_class samples of every class, class-major -> images (num_classes * per_class, 3, H, W)."""
    was = model.training
    model.eval()
    labels = torch.arange(model.config.num_classes, device=device).repeat_interleave(per_class)
    g = torch.Generator(device=device).manual_seed(seed)
    ctx = autocast() if autocast is not None else torch.autocast(device.type, enabled=False)
    with ctx:
        images = model.sample(labels, generator=g, **kw).float()
    model.train(was)
    return images


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


def save_grid(images: torch.Tensor, path, nrow: int):
    """Write images (N, C, H, W) in [0, 1] as one PNG grid (Pillow; atomically)."""
    from PIL import Image
    grid = image_grid(images.detach().float().clamp(0, 1).cpu(), nrow)
    pixels = grid.mul(255).add_(0.5).clamp_(0, 255).to(torch.uint8).permute(1, 2, 0).numpy()
    image = Image.fromarray(pixels[..., 0] if pixels.shape[-1] == 1 else pixels)
    atomic_write(path, lambda tmp: image.save(tmp, format="PNG"))
