"""FLUX.2: a text-to-image MMDiT over latent tokens, as diffusers' Flux2Transformer2DModel.

Black Forest Labs' FLUX.2 (2025) on the MMDiT of Esser et al., "Scaling Rectified Flow Transformers" (2024): text and
image tokens through `double_depth` double-stream blocks, then together through `single_depth` parallel single-stream
blocks; one conditioning vector (timestep, plus guidance when the model has it) modulates all of them through three
shared modulations; 4-axis RoPE over the positions `zoo.blocks.mmdit.positions` assigns.

Called as diffusers' model: `flux2(hidden_states, encoder_hidden_states, timestep, img_ids, txt_ids, guidance)`,
hidden_states (B, N, in_channels) latent tokens, encoder_hidden_states (B, L, text_dim), timestep (B,) in [0, 1],
ids (N, 4) and (L, 4) (or batched, the first row used), guidance (B,) or None -> (B, N, out_channels).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..blocks.mmdit import (DoubleStreamBlock, Modulation, SingleStreamBlock, TimeGuidanceEmbedder, modulated,
                            rope_4d)
from ..config import Flux2Config, check


class OutputNorm(nn.Module):
    """LayerNorm modulated by (scale, shift) regressed from the conditioning: (B, N, D), (B, D) -> (B, N, D)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps, self.linear = eps, nn.Linear(dim, 2 * dim, bias=False)

    def forward(self, x, temb):
        scale, shift = self.linear(F.silu(temb)).unsqueeze(1).chunk(2, -1)
        return modulated(x, shift, scale, self.eps)


class Flux2(nn.Module):
    def __init__(self, cfg: Optional[Flux2Config] = None):
        super().__init__()
        cfg = cfg or Flux2Config()
        check(cfg)
        self.config = cfg
        D, H, Dh, r, eps = cfg.heads * cfg.head_dim, cfg.heads, cfg.head_dim, cfg.mlp_ratio, cfg.eps
        self.out_channels = cfg.out_channels or cfg.in_channels
        self.time_guidance_embed = TimeGuidanceEmbedder(D, cfg.timestep_dim, cfg.guidance)
        self.double_stream_modulation_img = Modulation(D, 2)
        self.double_stream_modulation_txt = Modulation(D, 2)
        self.single_stream_modulation = Modulation(D, 1)
        self.x_embedder = nn.Linear(cfg.in_channels, D, bias=False)
        self.context_embedder = nn.Linear(cfg.text_dim, D, bias=False)
        self.double_blocks = nn.ModuleList(DoubleStreamBlock(D, H, Dh, r, eps) for _ in range(cfg.double_depth))
        self.single_blocks = nn.ModuleList(SingleStreamBlock(D, H, Dh, r, eps) for _ in range(cfg.single_depth))
        self.norm_out = OutputNorm(D, eps)
        self.proj_out = nn.Linear(D, self.out_channels, bias=False)

    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, timestep: torch.Tensor,
                img_ids: torch.Tensor, txt_ids: torch.Tensor, guidance: Optional[torch.Tensor] = None) -> torch.Tensor:
        x, c = self.x_embedder(hidden_states), self.context_embedder(encoder_hidden_states)
        dt = hidden_states.dtype
        temb = self.time_guidance_embed(timestep.to(dt), None if guidance is None else guidance.to(dt))
        mod_img, mod_txt = self.double_stream_modulation_img(temb), self.double_stream_modulation_txt(temb)
        mod_single = self.single_stream_modulation(temb)
        ids = torch.cat([i[0] if i.ndim == 3 else i for i in (txt_ids, img_ids)])
        rope = rope_4d(ids, self.config.rope_axes, self.config.rope_theta)
        for block in self.double_blocks:
            x, c = block(x, c, mod_img, mod_txt, rope)
        x = torch.cat([c, x], 1)
        for block in self.single_blocks:
            x = block(x, mod_single, rope)
        return self.proj_out(self.norm_out(x[:, c.shape[1]:], temb))

    def repeated_units(self) -> list:
        """The double- and single-stream blocks: what a data-parallel wrapper shards, and checkpointing applies to."""
        return [*self.double_blocks, *self.single_blocks]

    checkpoint_units = repeated_units

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
