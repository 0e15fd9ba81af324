"""DiT: a class-conditional diffusion transformer on latent patches.

Peebles & Xie, "Scalable Diffusion Models with Transformers" (2023): p x p latent patches through `depth` adaLN-Zero
blocks conditioned on timestep + class. Learned sigma doubles the output channels (Nichol & Dhariwal 2021);
`block_conditioning` keeps one embedder per block, as diffusers does.

Called as diffusers' DiTTransformer2DModel: `dit(latents, timestep, class_labels)`, latents (B, C, h, w), timestep (B,)
or a scalar, class_labels (B,) -> (B, out_channels, h, w).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..blocks.adaln import DiTBlock, FinalLayer, axial_rope
from ..blocks.patch import PatchEmbed, sincos_pos_embed_2d, unpatchify
from ..blocks.timestep import LabelEmbedder, TimestepEmbedder
from ..config import DiTConfig, check


class Conditioning(nn.Module):
    """c = TimestepEmbedder(t) + LabelEmbedder(labels): (B,), (B,) -> (B, D)."""

    def __init__(self, dim: int, num_classes: int, freq_shift: float):
        super().__init__()
        self.t_embed = TimestepEmbedder(dim, 256, freq_shift)
        self.y_embed = LabelEmbedder(num_classes, dim)

    def forward(self, t, labels):
        return self.t_embed(t) + self.y_embed(labels)


class DiT(nn.Module):
    def __init__(self, cfg: Optional[DiTConfig] = None, in_channels: int = 4, num_classes: int = 10,
                 sample_size: int = 32):
        super().__init__()
        cfg = cfg or DiTConfig()
        check(cfg)
        self.config, self.in_channels, self.num_classes, self.sample_size = cfg, in_channels, num_classes, sample_size
        self.null_label = num_classes
        D, H, p = cfg.resolved_width, cfg.resolved_heads, cfg.patch_size
        if sample_size % p:
            raise ValueError(f"DiT: patch_size={p} must divide the latent size {sample_size}")
        self.out_channels = 2 * in_channels if cfg.learn_sigma else in_channels
        self.patch = PatchEmbed(in_channels, D, p)
        n_cond = cfg.resolved_depth if cfg.block_conditioning else 1
        self.cond = nn.ModuleList(Conditioning(D, num_classes, cfg.freq_shift) for _ in range(n_cond))
        self.blocks = nn.ModuleList(
            DiTBlock(D, H, cfg.mlp_ratio, cfg.qkv_bias, cfg.qk_norm, 1e-6, cfg.norm_eps)
            for _ in range(cfg.resolved_depth))
        self.final = FinalLayer(D, p * p * self.out_channels)
        self._init_weights()
        n = sample_size // p  # the trained grid's tables, kept (not saved); another grid makes its own per call
        pos = axial_rope(D // H, n, n) if cfg.rope else (sincos_pos_embed_2d(D, n, n).unsqueeze(0), None)
        self.register_buffer("pos_table", pos[0], persistent=False)        # (1, N, D), or rope's cos (N, head_dim)
        self.register_buffer("rope_sin", pos[1], persistent=False)         # rope's sin (N, head_dim)

    def _init_weights(self):
        """DiT's: Xavier-uniform linears (and the patch conv seen as one), N(0, 0.02) embeddings and
        timestep MLP, zero adaLN regressions and output layer (blocks start as the identity)."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        w = self.patch.proj.weight
        nn.init.xavier_uniform_(w.view(w.shape[0], -1))
        nn.init.zeros_(self.patch.proj.bias)
        for c in self.cond:
            for w in (c.y_embed.table.weight, c.t_embed.linear_1.weight, c.t_embed.linear_2.weight):
                nn.init.normal_(w, std=0.02)
        for m in [b.ada for b in self.blocks] + [self.final.ada, self.final.linear]:
            nn.init.zeros_(m.weight)
            nn.init.zeros_(m.bias)

    def drop_labels(self, labels: torch.Tensor, p: float, generator: Optional[torch.Generator] = None):
        """Replace each label by the "no label" class with probability p (for guidance)."""
        return self.cond[0].y_embed.drop(labels, p, generator)

    def _positions(self, h: int, w: int, device):
        """The 2D sin-cos table (1, h*w, D) or, with rope, the axial (cos, sin) tables (h*w, head_dim): the
        kept ones for the trained grid, else made for (h, w) (the sin-cos table interpolated to the
        trained grid, as diffusers does)."""
        cfg = self.config
        n = self.sample_size // cfg.patch_size
        if (h, w) == (n, n):
            return (self.pos_table, self.rope_sin) if cfg.rope else self.pos_table
        if cfg.rope:
            return axial_rope(cfg.resolved_width // cfg.resolved_heads, h, w, device=device)
        return sincos_pos_embed_2d(cfg.resolved_width, h, w, n).to(device).unsqueeze(0)

    def forward(self, x: torch.Tensor, timestep: torch.Tensor, class_labels: torch.Tensor) -> torch.Tensor:
        B, _, Hl, Wl = x.shape
        p = self.config.patch_size
        h, w = Hl // p, Wl // p
        t, labels = (torch.as_tensor(v, device=x.device).expand(B) for v in (timestep, class_labels))  # scalars too
        tokens = self.patch(x)
        pos = self._positions(h, w, x.device)
        rope = tuple(v.to(tokens.dtype) for v in pos) if self.config.rope else None
        if rope is None:
            tokens = tokens + pos.to(tokens.dtype)
        conds = [c(t, labels) for c in self.cond]
        for i, block in enumerate(self.blocks):
            tokens = block(tokens, conds[i if len(conds) > 1 else 0], rope)
        return unpatchify(self.final(tokens, conds[0]), p, h, w)

    def repeated_units(self) -> list:
        """The transformer blocks: what a data-parallel wrapper shards, and activation checkpointing applies to."""
        return list(self.blocks)

    checkpoint_units = repeated_units

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
