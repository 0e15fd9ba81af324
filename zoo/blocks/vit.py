"""The Vision Transformer's encoder block, its token prefix and the resampling of its position table.

Papers: Dosovitskiy et al., "An Image is Worth 16x16 Words" (ViT, 2021); Touvron et al., "Training data-efficient
image transformers & distillation through attention" (DeiT, 2021: the distillation token); Touvron et al., "Going
deeper with Image Transformers" (CaiT, 2021: LayerScale); Darcet et al., "Vision Transformers Need Registers" (2024).

    ViTBlock (pre-norm):  x = x + drop_path(ls1 * attn(norm1(x)));  x = x + drop_path(ls2 * mlp(norm2(x)))
    add_prefix(x, pos, tokens, embed_prefix): [class, distillation, registers] tokens in front of the patches and
        the learned position table added to all of them, or to the patches only (embed_prefix False: DeiT III,
        DINOv2 with registers)
    resample_pos_embed: the table's patch grid resized bicubically (antialiased) to another grid, prefix rows kept

Names are timm's (norm1, attn.qkv, attn.proj, ls1.gamma, norm2, mlp.fc1, mlp.fc2, ls2.gamma).
Shapes: x (B, N, D) -> (B, N, D); add_prefix: (B, N, D) -> (B, P + N, D); pos (1, N or P + N, D).
Needs: adaln.py, norm.py, rope.py, drop_path.py.
"""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

try:
    from .adaln import Attention, Mlp
    from .drop_path import DropPath
except ImportError:  # copied beside adaln.py (and its norm.py, rope.py) and drop_path.py, outside the zoo package
    from adaln import Attention, Mlp
    from drop_path import DropPath


class LayerScale(nn.Module):
    """A learned per-channel scale of a residual branch, starting at `init`."""

    def __init__(self, dim: int, init: float):
        super().__init__()
        self.gamma = nn.Parameter(torch.full((dim,), float(init)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma


class ViTBlock(nn.Module):
    """Pre-norm attention + GELU MLP, each residual branch optionally scaled (LayerScale, `init_values`)."""

    def __init__(self, dim: int, heads: int, mlp_ratio: float = 4.0, qkv_bias: bool = True,
                 init_values: Optional[float] = None, drop_path: float = 0.0, eps: float = 1e-6):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim, eps=eps), nn.LayerNorm(dim, eps=eps)
        self.attn = Attention(dim, heads, qkv_bias=qkv_bias)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), approximate="none")
        scale = (lambda: LayerScale(dim, init_values)) if init_values else nn.Identity
        self.ls1, self.ls2 = scale(), scale()
        self.drop_path1, self.drop_path2 = DropPath(drop_path), DropPath(drop_path)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop_path1(self.ls1(self.attn(self.norm1(x))))
        return x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))


def add_prefix(x: torch.Tensor, pos: torch.Tensor, tokens: list, embed_prefix: bool = True) -> torch.Tensor:
    """(B, N, D) patch tokens -> (B, P + N, D): the (1, k, D) `tokens` in front, in order, plus the position table."""
    prefix = [t.expand(x.shape[0], -1, -1) for t in tokens]
    if embed_prefix:
        return torch.cat(prefix + [x], dim=1) + pos
    return torch.cat(prefix + [x + pos], dim=1)


def resample_pos_embed(pos: torch.Tensor, new_hw: tuple, old_hw: tuple, n_prefix: int = 0) -> torch.Tensor:
    """(1, n_prefix + h*w, D) -> (1, n_prefix + H*W, D): the grid rows resized bicubically, the prefix rows kept."""
    if tuple(new_hw) == tuple(old_hw):
        return pos
    prefix, grid = pos[:, :n_prefix], pos[:, n_prefix:]
    grid = grid.float().reshape(1, *old_hw, -1).permute(0, 3, 1, 2)
    grid = F.interpolate(grid, size=tuple(new_hw), mode="bicubic", antialias=True)
    return torch.cat([prefix, grid.permute(0, 2, 3, 1).reshape(1, -1, pos.shape[-1]).to(pos.dtype)], dim=1)
