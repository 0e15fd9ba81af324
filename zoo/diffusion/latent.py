"""Latent diffusion: a frozen TAESD autoencoder, a class-conditional denoiser (U-Net or DiT) or a text-conditioned
FLUX.2 transformer on 2x2-patch latent tokens (`labels` then prompt embeddings (B, L, text_dim)), a noise schedule.

    images [0,1] --encode--> z = (taesd.encode(images) - latent_mean) / latent_std
    training:  loss = w(t) * |denoiser(sqrt(abar) z + sqrt(1-abar) eps, t, label) - target|^2
               flow: loss = w(s) * |denoiser((1-s) z + s eps, 1000 s, label) - (eps - z)|^2
    sampling:  x_T ~ N(0, I) -> a sampler (samplers.py) with classifier-free guidance -> z -> decode -> images

latent_mean / latent_std are per-channel buffers (unit-variance latents whatever the autoencoder); null_text (flux2)
the empty prompt's embeddings, the unconditional side of guidance. Only the denoiser is trained.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..blocks.mmdit import positions
from ..config import ConfigError, DiffusionConfig, check
from . import samplers
from .denoiser import UNet
from .dit import DiT
from .flux2 import Flux2
from .flux2_pipeline import pack, sigmas, unpack
from .schedule import (NoiseSchedule, flow_interpolate, flow_min_snr_weight, flow_target, guided,
                       vlb_term)
from .taesd import TAESD


def build_autoencoder(cfg: DiffusionConfig, source: str = "<config>", prefix: str = "model.") -> TAESD:
    """The config's TAESD: loaded from autoencoder.weights (checked against the set variant keys), or fresh."""
    a = cfg.autoencoder
    if a.weights:
        from ..weights import taesd as taesd_weights
        try:
            return taesd_weights.load(a.weights, latent_channels=a.latent_channels, midblock_gn=a.midblock_gn,
                                      channels=a.channels)
        except (ValueError, FileNotFoundError) as e:
            raise ConfigError(f"{source}: {prefix}autoencoder.weights: {e}") from None
    return TAESD(a.latent_channels or cfg.latent_channels or 4, bool(a.midblock_gn), a.channels or 64)


class LatentDiffusion(nn.Module):
    family = "diffusion"

    def __init__(self, cfg: DiffusionConfig, autoencoder: Optional[TAESD] = None):
        super().__init__()
        check(cfg)
        self.config = cfg
        self.autoencoder = autoencoder if autoencoder is not None else build_autoencoder(cfg)
        self.autoencoder.requires_grad_(False)
        C = self.autoencoder.latent_channels
        if cfg.latent_channels is not None and cfg.latent_channels != C:
            raise ConfigError(f"model.latent_channels={cfg.latent_channels} does not match the autoencoder's "
                              f"{C} latent channels")
        self.latent_channels = C
        if cfg.denoiser == "flux2" and cfg.flux2.in_channels != 4 * C:
            raise ConfigError(f"model.flux2.in_channels={cfg.flux2.in_channels} must be 4 x the autoencoder's {C} "
                              f"latent channels (2x2 patches): set it to {4 * C}")
        self.denoiser = DiT(cfg.dit, C, cfg.num_classes, self.latent_size) if cfg.denoiser == "dit" else \
            Flux2(cfg.flux2) if cfg.denoiser == "flux2" else \
            UNet(C, cfg.num_classes, cfg.channels, cfg.blocks_per_level, cfg.attention, cfg.heads)
        if cfg.denoiser == "flux2":
            self.register_buffer("null_text", torch.zeros(cfg.text_length, cfg.flux2.text_dim))
        self.schedule = NoiseSchedule(cfg.schedule, cfg.num_timesteps, cfg.beta_start, cfg.beta_end)
        self.register_buffer("latent_mean", torch.zeros(C))
        self.register_buffer("latent_std", torch.ones(C))

    def repeated_units(self) -> list:
        """The denoiser's blocks (the autoencoder is frozen): what a data-parallel wrapper shards, and
        activation checkpointing applies to."""
        return self.denoiser.repeated_units()

    checkpoint_units = repeated_units

    @property
    def latent_size(self) -> int:
        return self.config.image_size // TAESD.downscale

    def _stats(self, z):
        return self.latent_mean.view(1, -1, 1, 1).to(z.dtype), self.latent_std.view(1, -1, 1, 1).to(z.dtype)

    @torch.no_grad()
    def encode(self, images: torch.Tensor) -> torch.Tensor:
        z = self.autoencoder.encode(images)
        mean, std = self._stats(z)
        return (z - mean) / std

    @torch.no_grad()
    def decode(self, z: torch.Tensor) -> torch.Tensor:
        mean, std = self._stats(z)
        return self.autoencoder.decode(z * std + mean).clamp(0, 1)

    def forward(self, z: torch.Tensor, labels: torch.Tensor, t: torch.Tensor, noise: torch.Tensor,
                weighted: bool = True) -> torch.Tensor:
        """Per-item loss (B,) of denoising normalised latents z at timesteps t (ints; flow: s in (0, 1)),
        Min-SNR-weighted as configured or, weighted=False, the plain MSE. Dropped labels are already "no label"."""
        cfg = self.config
        if cfg.prediction == "flow":
            out = self.denoise(flow_interpolate(z, noise, t), t * 1000, labels)
            mse = (out.float() - flow_target(z, noise).float()).pow(2).flatten(1).mean(1)
            return flow_min_snr_weight(t, cfg.min_snr_gamma) * mse if weighted else mse
        x_t = self.schedule.add_noise(z, noise, t)
        out = self.denoiser(x_t, t, labels)
        C = z.shape[1]
        var_out = out[:, C:] if out.shape[1] == 2 * C else None        # DiT with learned sigma
        out = out[:, :C]
        mse = (out.float() - self.schedule.target(z, noise, t, cfg.prediction).float()).pow(2).flatten(1).mean(1)
        if not weighted:
            return mse
        loss = self.schedule.min_snr_weight(t, cfg.min_snr_gamma, cfg.prediction) * mse
        if var_out is not None:
            x0_pred = self.schedule.split(out.detach().float(), x_t.float(), t, cfg.prediction)[0]
            loss = loss + vlb_term(self.schedule, var_out, x0_pred, z.float(), x_t.float(), t)
        return loss

    def denoise(self, x: torch.Tensor, t: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The denoiser on latents x (B, C, h, w) at t (B,) in [0, num_timesteps]; flux2: packed into tokens, its
        timestep t / 1000, labels the prompt embeddings (B, L, text_dim)."""
        if self.config.denoiser != "flux2":
            return self.denoiser(x, t, labels)
        h, w = x.shape[2] // 2, x.shape[3] // 2
        txt, img = positions(labels.shape[1], h, w, x.device)
        return unpack(self.denoiser(pack(x), labels.to(x.dtype), t / 1000, img, txt), h, w)

    def sample_sigmas(self, steps: int, h: int, w: int) -> Optional[torch.Tensor]:
        """flow_euler's noise levels for (h, w) latents as model.sample_shift says (None: flow_sigmas, unshifted)."""
        k = self.config.sample_shift
        if k is None or (k == "auto" and self.config.denoiser != "flux2"):
            return None
        return sigmas(steps, (h // 2) * (w // 2), k)

    @torch.no_grad()
    def sample_latents(self, labels: torch.Tensor, steps: Optional[int] = None, guidance: Optional[float] = None,
                       sampler: Optional[str] = None, eta: Optional[float] = None,
                       generator: Optional[torch.Generator] = None, size=None) -> torch.Tensor:
        cfg = self.config
        scale, steps = cfg.guidance if guidance is None else guidance, steps or cfg.sample_steps
        (H, W), m = size or (cfg.image_size, cfg.image_size), TAESD.downscale * cfg.latent_multiple
        if cfg.denoiser == "dit" and (H, W) != (cfg.image_size, cfg.image_size):
            raise ValueError(f"sample size {H}x{W}: a DiT samples at model.image_size={cfg.image_size} only")
        if H % m or W % m:
            raise ValueError(f"sample size {H}x{W}: each side must be a multiple of {m}")
        C, h, w = self.latent_channels, H // TAESD.downscale, W // TAESD.downscale
        # the noise prediction only: a learned-sigma DiT's variance channels are not used by these samplers
        null = self.null_text.expand_as(labels) if hasattr(self, "null_text") else \
            torch.full_like(labels, self.denoiser.null_label)
        fn = lambda x, t: guided(self.denoise, x, t, labels, null, scale)[:, :C]  # noqa: E731
        return samplers.sample(fn, (len(labels), C, h, w), sampler or cfg.sampler, steps, self.schedule,
                               cfg.prediction, cfg.beta_start, cfg.beta_end, cfg.eta if eta is None else eta, generator,
                               labels.device, self.latent_mean.dtype, self.sample_sigmas(steps, h, w))

    @torch.no_grad()
    def sample(self, labels: torch.Tensor, **kw) -> torch.Tensor:
        """Images (B, 3, H, W) in [0, 1] of the classes `labels` (B,) (flux2: prompt embeddings). Keywords: steps,
        guidance, sampler, eta, generator, size (H, W) pixels (default: the config's; model.image_size square)."""
        return self.decode(self.sample_latents(labels, **kw))

    def num_params(self, trainable: bool = True) -> int:
        return sum(p.numel() for p in self.parameters() if p.requires_grad or not trainable)
