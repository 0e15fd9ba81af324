"""A small class-conditional U-Net that denoises latents.

After Ho et al., "Denoising Diffusion Probabilistic Models" (2020) and Dhariwal & Nichol, "Diffusion Models Beat GANs
on Image Synthesis" (2021): GroupNorm/SiLU residual blocks with AdaGN conditioning, self-attention at the lowest
resolution; class `num_classes` is "no label".

Shapes: x (B, C, h, w) latents, t (B,) int timesteps, labels (B,) int -> (B, C, h, w); h, w divisible by
2 ** (len(channels) - 1).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..blocks.timestep import drop_labels, timestep_embedding


def norm(c: int) -> nn.GroupNorm:
    return nn.GroupNorm(min(32, c // 4) if c >= 8 else 1, c)


class ResBlock(nn.Module):
    """x + conv(SiLU(AdaGN(conv(SiLU(GN(x))), emb))), with a 1x1 conv on the skip when C changes."""

    def __init__(self, c_in: int, c_out: int, emb_dim: int):
        super().__init__()
        self.norm1, self.conv1 = norm(c_in), nn.Conv2d(c_in, c_out, 3, padding=1)
        self.emb = nn.Linear(emb_dim, 2 * c_out)
        self.norm2, self.conv2 = norm(c_out), nn.Conv2d(c_out, c_out, 3, padding=1)
        self.skip = nn.Conv2d(c_in, c_out, 1) if c_in != c_out else nn.Identity()
        nn.init.zeros_(self.conv2.weight)
        nn.init.zeros_(self.conv2.bias)

    def forward(self, x, emb):
        h = self.conv1(F.silu(self.norm1(x)))
        scale, shift = self.emb(F.silu(emb))[:, :, None, None].chunk(2, dim=1)
        h = self.norm2(h) * (1 + scale) + shift
        return self.skip(x) + self.conv2(F.silu(h))


class Attention(nn.Module):
    """Multi-head self-attention over the h*w positions, pre-GroupNorm, residual."""

    def __init__(self, c: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm, self.qkv, self.proj = norm(c), nn.Conv2d(c, 3 * c, 1), nn.Conv2d(c, c, 1)
        nn.init.zeros_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)

    def forward(self, x):
        B, C, H, W = x.shape
        q, k, v = self.qkv(self.norm(x)).reshape(B, 3, self.heads, C // self.heads, H * W).transpose(-1, -2).unbind(1)
        o = F.scaled_dot_product_attention(q, k, v)                        # (B, heads, HW, C/heads)
        return x + self.proj(o.transpose(-1, -2).reshape(B, C, H, W))


class UNet(nn.Module):
    def __init__(self, latent_channels: int = 4, num_classes: int = 10, channels: Sequence[int] = (64, 128),
                 blocks_per_level: int = 2, attention: bool = True, heads: int = 4):
        super().__init__()
        if any(c % heads for c in channels):
            raise ValueError(f"every denoiser width must be divisible by heads={heads}, got {list(channels)}")
        self.num_classes, self.null_label = num_classes, num_classes
        c0, emb = channels[0], 4 * channels[0]
        self.time_mlp = nn.Sequential(nn.Linear(c0, emb), nn.SiLU(), nn.Linear(emb, emb))
        self.class_embed = nn.Embedding(num_classes + 1, emb)     # last row: "no label" (guidance)
        self.conv_in = nn.Conv2d(latent_channels, c0, 3, padding=1)

        self.down, self.downsample = nn.ModuleList(), nn.ModuleList()
        skips, c = [c0], c0
        for i, ch in enumerate(channels):
            level = nn.ModuleList()
            for _ in range(blocks_per_level):
                level.append(ResBlock(c, ch, emb))
                c = ch
                skips.append(c)
            self.down.append(level)
            if i + 1 < len(channels):
                self.downsample.append(nn.Conv2d(c, c, 3, stride=2, padding=1))
                skips.append(c)
        self.mid1, self.mid2 = ResBlock(c, c, emb), ResBlock(c, c, emb)
        self.mid_attn = Attention(c, heads) if attention else nn.Identity()

        self.up, self.upsample = nn.ModuleList(), nn.ModuleList()
        for i, ch in reversed(list(enumerate(channels))):
            level = nn.ModuleList()
            for _ in range(blocks_per_level + 1):
                level.append(ResBlock(c + skips.pop(), ch, emb))
                c = ch
            self.up.append(level)
            if i > 0:
                self.upsample.append(nn.Conv2d(c, c, 3, padding=1))
        self.norm_out, self.conv_out = norm(c), nn.Conv2d(c, latent_channels, 3, padding=1)
        nn.init.zeros_(self.conv_out.weight)
        nn.init.zeros_(self.conv_out.bias)
        self.factor = 2 ** (len(channels) - 1)

    def drop_labels(self, labels: torch.Tensor, p: float, generator: Optional[torch.Generator] = None):
        """Replace each label by the "no label" class with probability p (for guidance)."""
        return drop_labels(labels, p, self.null_label, generator)

    def forward(self, x: torch.Tensor, t: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] % self.factor or x.shape[-2] % self.factor:
            raise ValueError(f"latent size {tuple(x.shape[-2:])} must be divisible by {self.factor} "
                             f"(2 ** (number of denoiser levels - 1))")
        emb = self.time_mlp(timestep_embedding(t, self.conv_in.out_channels).to(x.dtype)) + self.class_embed(labels)
        h = self.conv_in(x)
        skips = [h]
        for i, level in enumerate(self.down):
            for block in level:
                h = block(h, emb)
                skips.append(h)
            if i < len(self.downsample):
                h = self.downsample[i](h)
                skips.append(h)
        h = self.mid2(self.mid_attn(self.mid1(h, emb)), emb)  # mid_attn: nn.Identity without attention
        for i, level in enumerate(self.up):
            for block in level:
                h = block(torch.cat([h, skips.pop()], dim=1), emb)
            if i < len(self.upsample):
                h = self.upsample[i](F.interpolate(h, scale_factor=2.0, mode="nearest"))
        return self.conv_out(F.silu(self.norm_out(h)))

    def repeated_units(self) -> list:
        """The residual and attention blocks in the order they run: what a data-parallel wrapper shards, and
        activation checkpointing applies to."""
        mid = [self.mid1] + ([] if isinstance(self.mid_attn, nn.Identity) else [self.mid_attn]) + [self.mid2]
        return [b for level in self.down for b in level] + mid + [b for level in self.up for b in level]

    checkpoint_units = repeated_units
