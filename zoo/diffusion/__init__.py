"""Latent diffusion: the TAESD autoencoder, noise schedules and samplers, a class-conditional U-Net, and
LatentDiffusion, which ties them together (see docs/diffusion.md)."""
from .denoiser import UNet
from .latent import LatentDiffusion
from .schedule import NoiseSchedule
from .taesd import TAESD

__all__ = ["TAESD", "NoiseSchedule", "UNet", "LatentDiffusion"]
