"""TAESD: the tiny autoencoder for latent diffusion (images <-> latents, 8x spatial downscale).

Ollin Boer Bohan's "Tiny AutoEncoder for Stable Diffusion" (TAESD, 2023): plain convs and ReLU residual blocks, fast
enough to decode every sampling step. Latent channels 4 (SD 1.x / SDXL), 16 (SD3 / FLUX.1) or 32 (FLUX.2, with an extra
GroupNorm branch at the lowest resolution). Images in [0, 1] (decode() does not clamp); latents raw; module indices
the original's.
Shapes: encode (B, 3, H, W) -> (B, C, H/8, W/8); decode (B, C, h, w) -> (B, 3, 8h, 8w).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def conv3x3(c_in: int, c_out: int, stride: int = 1, bias: bool = True) -> nn.Conv2d:
    return nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=bias)


class Clamp(nn.Module):
    """Soft clamp of latents to (-3, 3): tanh(x / 3) * 3."""

    def forward(self, x):
        return torch.tanh(x / 3) * 3


class MidBranch(nn.Sequential):
    """The FLUX.2 variant's extra branch: 1x1 conv to 4C, GroupNorm(4), ReLU, 1x1 conv back to C."""

    def __init__(self, c: int, groups: int = 4):
        super().__init__(nn.Conv2d(c, 4 * c, 1, bias=False), nn.GroupNorm(groups, 4 * c), nn.ReLU(inplace=True),
                         nn.Conv2d(4 * c, c, 1, bias=False))


# Nearest 2x upsampling then a 3x3 conv: output row 2i+a only sees input rows {i-1, i} (a = 0) or
# {i, i+1} (a = 1), so each of the four output phases (a, b) is a 2x2 conv of the small input whose
# taps are sums of the 3x3 taps: PHASE_TAPS[a] (2 x 3) maps kernel rows (and columns) to phase taps.
PHASE_TAPS = ((1, 0, 0), (0, 1, 1)), ((1, 1, 0), (0, 0, 1))


class UpsampleConv(nn.Conv2d):
    """conv3x3(upsample_nearest_2x(x)) computed at the input resolution as one 2x2 conv with 4x the
    output channels (the four phases), then interleaved: fewer multiply-adds, the same weights and keys.
    (B, C, H, W) -> (B, C_out, 2H, 2W)."""

    def __init__(self, c_in: int, c_out: int):
        super().__init__(c_in, c_out, 3, padding=1, bias=False)

    def forward(self, x):
        w = self.weight
        taps = torch.tensor(PHASE_TAPS, dtype=w.dtype, device=w.device)            # (2, 2, 3)
        k = torch.einsum("aru,oiuv,bsv->aboirs", taps, w, taps).reshape(-1, w.shape[1], 2, 2)
        y = F.conv2d(F.pad(x, (1, 1, 1, 1)), k)                                    # (B, 4 C_out, H+1, W+1)
        B, O, H, W = x.shape[0], w.shape[0], x.shape[2], x.shape[3]
        y = y.unflatten(1, (2, 2, O))                                              # (B, a, b, C_out, H+1, W+1)
        if x.is_contiguous(memory_format=torch.channels_last):
            out = y.new_empty(B, H, 2, W, 2, O).permute(0, 5, 1, 2, 3, 4)
        else:
            out = y.new_empty(B, O, H, 2, W, 2)
        for a in (0, 1):
            for b in (0, 1):
                out[:, :, :, a, :, b] = y[:, a, b, :, a:a + H, b:b + W]            # row 2i+a, column 2j+b
        return out.flatten(4, 5).flatten(2, 3)


class Block(nn.Module):
    """relu(conv(relu(conv(relu(conv(x))))) + x), optionally after x = x + mid_branch(x)."""

    def __init__(self, c: int, mid_branch: bool = False):
        super().__init__()
        self.conv = nn.Sequential(conv3x3(c, c), nn.ReLU(inplace=True), conv3x3(c, c), nn.ReLU(inplace=True),
                                  conv3x3(c, c))
        if mid_branch:
            self.pool = MidBranch(c)  # the original name of this branch in the weight files

    def forward(self, x):
        if hasattr(self, "pool"):
            x = x + self.pool(x)
        return F.relu_(self.conv(x).add_(x))


def encoder(latent_channels: int = 4, channels: int = 64, mid_branch: bool = False) -> nn.Sequential:
    c = channels
    layers = [conv3x3(3, c), Block(c)]
    for stage in range(3):  # the mid branch in the last stage's blocks
        layers += [conv3x3(c, c, stride=2, bias=False)] + [Block(c, mid_branch and stage == 2) for _ in range(3)]
    return nn.Sequential(*layers, conv3x3(c, latent_channels))


def decoder(latent_channels: int = 4, channels: int = 64, mid_branch: bool = False) -> nn.Sequential:
    c = channels
    layers = [Clamp(), conv3x3(latent_channels, c), nn.ReLU(inplace=True)]
    for stage in range(3):  # the mid branch in the first stage's blocks
        layers += [Block(c, mid_branch and stage == 0) for _ in range(3)]
        layers += [nn.Identity(), UpsampleConv(c, c)]  # Identity keeps the original indices (was nn.Upsample)
    return nn.Sequential(*layers, Block(c), conv3x3(c, 3))


class TAESD(nn.Module):
    """midblock_gn: the FLUX.2 branch. `scaling_factor` and `shift_factor` are kept only so that a diffusers
    export round-trips them."""

    downscale = 8

    def __init__(self, latent_channels: int = 4, midblock_gn: bool = False, channels: int = 64):
        super().__init__()
        self.latent_channels, self.midblock_gn, self.channels = latent_channels, midblock_gn, channels
        self.encoder = encoder(latent_channels, channels, midblock_gn)
        self.decoder = decoder(latent_channels, channels, midblock_gn)
        self.scaling_factor, self.shift_factor = 1.0, 0.0

    @property
    def variant(self) -> dict:
        return {"latent_channels": self.latent_channels, "midblock_gn": self.midblock_gn, "channels": self.channels}

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        h, w = images.shape[-2:]
        if images.dim() != 4 or images.shape[1] != 3 or h % 8 or w % 8:
            raise ValueError(f"TAESD.encode expects (B, 3, H, W) images with H and W divisible by 8, "
                             f"got {tuple(images.shape)}")
        return self.encoder(images)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        if latents.dim() != 4 or latents.shape[1] != self.latent_channels:
            raise ValueError(f"TAESD.decode expects (B, {self.latent_channels}, h, w) latents, "
                             f"got {tuple(latents.shape)}")
        return self.decoder(latents)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Reconstruction: decode(encode(images))."""
        return self.decode(self.encode(images))
