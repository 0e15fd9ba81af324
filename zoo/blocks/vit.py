"""The Vision Transformer's encoder block, its token prefix, its position table's resampling and 2-D RoPE (DINOv3's,
EVA-02's).

Papers: Dosovitskiy et al., "An Image is Worth 16x16 Words" (ViT, 2021); Touvron et al., "Training data-efficient
image transformers & distillation through attention" (DeiT, 2021: the distillation token); Touvron et al., "Going
deeper with Image Transformers" (CaiT, 2021: LayerScale); Darcet et al., "Vision Transformers Need Registers" (2024);
Simeoni et al., "DINOv3" (2025: RoPE on patch centres); Tschannen et al., "SigLIP 2" (2025: NaFlex, one table
resized to each image's patch grid); Fang et al., "EVA-02: A Visual Representation for Neon Genesis" (2023: RoPE on
patch indices beside the table, q and v biases without a k bias, SwiGLU with a LayerNorm inside).

    ViTBlock (pre-norm):  x = x + drop_path(ls1 * attn(norm1(x)));  x = x + drop_path(ls2 * mlp(norm2(x)))
        attention optionally with a RoPE table (rotate-half, or adjacent pairs: EVA-02) and a key mask, biased q, k,
        v or (k_bias False) q and v only; the MLP GELU (exact or tanh) or SwiGLU (mlp_norm: a LayerNorm before down)
    add_prefix(x, pos, tokens, embed_prefix): [class, distillation, registers] tokens in front of the patches and
        the learned position table added to all of them, or to the patches only (embed_prefix False: DeiT III,
        DINOv2 with registers)
    resample_pos_embed: the table's patch grid resized (bicubic or bilinear, antialiased) to another grid, prefix
        rows kept; naflex_pos_embed: resized per image to its own grid and padded (SigLIP 2)
    patch_rope(head_dim, h, w, theta, n_prefix): cos, sin of DINOv3's RoPE: each patch centre's row and column in
        [-1, 1], turned by the periods theta^(4i / head_dim); the prefix tokens' rows leave them as they are;
        ref_grid > 0: EVA-02's instead, the row and column indices scaled to a ref_grid-sided grid (i * ref_grid / h)
        turned by theta^(-4i / head_dim) radians, in the pair layout
    augment_coords(coords, shift, jitter, rescale): DINOv3's training-time box augmentation of those centres, one
        draw per batch: + U(-shift, shift) per axis, x exp(U(-ln jitter, ln jitter)) per axis, x exp(U(-ln rescale,
        ln rescale)) for both axes (transformers' draws, in that order)
    drop_patches(x, rate, n_prefix, rope): patch dropout in training (Liu et al., "PatchDropout", 2022; Li et al.,
        FLIP, 2023): each image keeps a random subset of its patch tokens (and their RoPE rows), the prefix all

Names are timm's (norm1, attn.qkv, attn.proj, ls1.gamma, norm2, mlp.fc1, mlp.fc2, ls2.gamma; k_bias False:
attn.q_bias, attn.v_bias beside a bias-free qkv; SwiGLU: mlp.gate_up, mlp.norm, mlp.down).
Shapes: x (B, N, D) -> (B, N, D); add_prefix: (B, N, D) -> (B, P + N, D); pos (1, N or P + N, D); rope cos, sin
(P + N, head_dim); mask (B, 1, 1, N) true where a key is seen.
Needs: adaln.py, norm.py, rope.py, mlp.py, drop_path.py.
"""
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

try:
    from .adaln import Attention, Mlp
    from .drop_path import DropPath
    from .mlp import SwiGLU
    from .rope import apply_rope, apply_rope_pairs
except ImportError:  # copied beside adaln.py (and its norm.py, rope.py), mlp.py and drop_path.py, outside the zoo package
    from adaln import Attention, Mlp
    from drop_path import DropPath
    from mlp import SwiGLU
    from rope import apply_rope, apply_rope_pairs


class LayerScale(nn.Module):
    """A learned per-channel scale of a residual branch, starting at `init`."""

    def __init__(self, dim: int, init: float):
        super().__init__()
        self.gamma = nn.Parameter(torch.full((dim,), float(init)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma


class RopeAttention(Attention):
    """adaln.py's attention, a RoPE table turning each head whole in the rotate-half layout (DINOv3's) or, `pairs`,
    in adjacent channel pairs (EVA-02's); `k_bias` False with qkv_bias: q and v biased, k not (EVA-02's: a key bias
    would move the logits once RoPE turns it), held as timm's q_bias and v_bias."""

    def __init__(self, dim: int, heads: int, qkv_bias: bool = True, k_bias: bool = True, pairs: bool = False):
        super().__init__(dim, heads, qkv_bias=qkv_bias and k_bias)
        self.rotate = apply_rope_pairs if pairs else apply_rope
        self.q_bias = self.v_bias = None
        if qkv_bias and not k_bias:
            self.q_bias, self.v_bias = nn.Parameter(torch.zeros(dim)), nn.Parameter(torch.zeros(dim))

    def qkv_proj(self, x: torch.Tensor) -> torch.Tensor:
        """self.qkv (whatever wraps it: adapters), then the q and v biases (timm's qkv_bias_separate order)."""
        qkv = self.qkv(x)
        if self.q_bias is None:
            return qkv
        return qkv + torch.cat((self.q_bias, torch.zeros_like(self.q_bias), self.v_bias)).to(qkv.dtype)


def vit_mlp(dim: int, hidden: int, kind: str = "gelu", norm_eps: float = 0.0) -> nn.Module:
    """`gelu` (exact, timm's), `gelu_tanh` (SigLIP's), `quick_gelu` (OpenAI CLIP's) or `swiglu` (gated, with biases:
    DINOv3's larger sizes; with `norm_eps` a LayerNorm before the down projection: EVA-02's base and large)."""
    if kind == "swiglu":
        return SwiGLU(dim, hidden, bias=True, norm_eps=norm_eps)
    if kind not in ("gelu", "gelu_tanh", "quick_gelu"):
        raise ValueError(f"mlp={kind!r} must be 'gelu', 'gelu_tanh', 'quick_gelu' or 'swiglu'")
    if norm_eps:
        raise ValueError(f"a LayerNorm inside the MLP (mlp_norm) needs mlp='swiglu', got {kind!r}")
    return Mlp(dim, hidden, approximate={"gelu_tanh": "tanh", "quick_gelu": "quick"}.get(kind, "none"))


class ViTBlock(nn.Module):
    """Pre-norm attention + MLP, each residual branch optionally scaled (LayerScale, `init_values`); EVA-02's
    `k_bias` False, `pairs` (RoPE layout) and `mlp_norm` as RopeAttention and vit_mlp take them."""

    def __init__(self, dim: int, heads: int, mlp_ratio: float = 4.0, qkv_bias: bool = True,
                 init_values: Optional[float] = None, drop_path: float = 0.0, eps: float = 1e-6, mlp: str = "gelu",
                 k_bias: bool = True, pairs: bool = False, mlp_norm: bool = False):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim, eps=eps), nn.LayerNorm(dim, eps=eps)
        self.attn = RopeAttention(dim, heads, qkv_bias, k_bias, pairs)
        self.mlp = vit_mlp(dim, int(dim * mlp_ratio), mlp, eps if mlp_norm else 0.0)
        scale = (lambda: LayerScale(dim, init_values)) if init_values else nn.Identity
        self.ls1, self.ls2 = scale(), scale()
        self.drop_path1, self.drop_path2 = DropPath(drop_path), DropPath(drop_path)

    def forward(self, x: torch.Tensor, rope: Optional[tuple] = None, mask: Optional[torch.Tensor] = None):
        x = x + self.drop_path1(self.ls1(self.attn(self.norm1(x), rope, mask)))
        return x + self.drop_path2(self.ls2(self.mlp(self.norm2(x))))


def add_prefix(x: torch.Tensor, pos: Optional[torch.Tensor], tokens: list, embed_prefix: bool = True) -> torch.Tensor:
    """(B, N, D) patch tokens -> (B, P + N, D): the (1, k, D) `tokens` in front, in order, plus the position table
    (None: none, RoPE's models)."""
    prefix = [t.expand(x.shape[0], -1, -1) for t in tokens]
    if pos is None:
        return torch.cat(prefix + [x], dim=1)
    if embed_prefix:
        return torch.cat(prefix + [x], dim=1) + pos
    return torch.cat(prefix + [x + pos], dim=1)


def resample_pos_embed(pos: torch.Tensor, new_hw: tuple, old_hw: tuple, n_prefix: int = 0,
                       mode: str = "bicubic") -> torch.Tensor:
    """(1, n_prefix + h*w, D) -> (1, n_prefix + H*W, D): the grid rows resized (`mode`: bicubic or bilinear,
    antialiased), the prefix rows kept."""
    if tuple(new_hw) == tuple(old_hw):
        return pos
    prefix, grid = pos[:, :n_prefix], pos[:, n_prefix:]
    grid = grid.float().reshape(1, *old_hw, -1).permute(0, 3, 1, 2)
    grid = F.interpolate(grid, size=tuple(new_hw), mode=mode, antialias=True)
    return torch.cat([prefix, grid.permute(0, 2, 3, 1).reshape(1, -1, pos.shape[-1]).to(pos.dtype)], dim=1)


def naflex_pos_embed(pos: torch.Tensor, old_hw: tuple, shapes: torch.Tensor, length: int,
                     mode: str = "bilinear") -> torch.Tensor:
    """(1, h*w, D) -> (B, length, D): the table resized to each image's (rows, columns) in `shapes` (B, 2), padded
    to `length` with its first row (SigLIP 2's NaFlex)."""
    out = []
    for hw in shapes.tolist():
        t = resample_pos_embed(pos, hw, old_hw, 0, mode)[0]
        if t.shape[0] > length:
            raise ValueError(f"an image of {hw[0]}x{hw[1]} patches does not fit in {length} tokens")
        out.append(torch.cat([t, t[:1].expand(length - t.shape[0], -1)]))
    return torch.stack(out)


def augment_coords(coords: torch.Tensor, shift: Optional[float] = None, jitter: Optional[float] = None,
                   rescale: Optional[float] = None) -> torch.Tensor:
    """(N, 2) patch centres moved as DINOv3 trains (so RoPE sees boxes other than [-1, 1]): shifted per axis, then
    stretched per axis, then scaled as a whole; one draw each for the batch, skipped where its value is null or 0."""
    def draw(n: int, low: float, high: float) -> torch.Tensor:
        return torch.empty(n, device=coords.device, dtype=coords.dtype).uniform_(low, high)
    if shift:
        coords = coords + draw(2, -shift, shift)
    if jitter:
        coords = coords * draw(2, -math.log(jitter), math.log(jitter)).exp()
    if rescale:
        coords = coords * draw(1, -math.log(rescale), math.log(rescale)).exp()
    return coords


def patch_coords(h: int, w: int, ref_grid: int = 0, device=None) -> torch.Tensor:
    """(h*w, 2) row and column of each patch, row-major: the centres in [-1, 1] (DINOv3), or (ref_grid > 0, EVA-02)
    the indices scaled to a ref_grid-sided grid, i * ref_grid / h (timm's ref_feat_shape)."""
    def axis(n: int) -> torch.Tensor:
        if ref_grid:
            return torch.arange(n, dtype=torch.float32, device=device) / n * ref_grid
        return 2.0 * (torch.arange(0.5, n, dtype=torch.float32, device=device) / n) - 1.0
    return torch.stack(torch.meshgrid(axis(h), axis(w), indexing="ij"), dim=-1).flatten(0, 1)


def patch_rope(head_dim: int, h: int, w: int, theta: float = 100.0, n_prefix: int = 0, device=None,
               ref_grid: int = 0, **augment) -> tuple:
    """cos, sin (n_prefix + h*w, head_dim): frequencies [0, D/4) turn with the patch's row, [D/4, D/2) with its
    column (patch_coords), in the rotate-half layout (repeated for the second half, angles 2 pi coord / period:
    DINOv3) or, ref_grid > 0, in the pair layout (each repeated for its pair, angles coord / period: EVA-02); the
    prefix rows turn by 0. `augment`: augment_coords' shift, jitter, rescale (training only)."""
    if head_dim % 4:
        raise ValueError(f"2-D RoPE needs a head dimension divisible by 4, got {head_dim}")
    inv = 1 / theta ** torch.arange(0, 1, 4 / head_dim, dtype=torch.float32, device=device)
    coords = augment_coords(patch_coords(h, w, ref_grid, device), **augment)
    angles = ((1.0 if ref_grid else 2 * math.pi) * coords[:, :, None] * inv).flatten(1)
    angles = angles.repeat_interleave(2, -1) if ref_grid else angles.tile(2)
    angles = torch.cat([angles.new_zeros(n_prefix, head_dim), angles])
    return angles.cos(), angles.sin()


def drop_patches(x: torch.Tensor, rate: float, n_prefix: int, rope: Optional[tuple] = None) -> tuple:
    """(B, P + N, D) -> (B, P + K, D), K = max(1, int(N (1 - rate))): the prefix tokens, then K patch tokens per image
    in a random order (the argsort of Gaussian noise from torch's generator, timm's draw); a RoPE table (P + N, hd)
    becomes the kept rows per image (B, 1, P + K, hd)."""
    B, N = x.shape[0], x.shape[1] - n_prefix
    keep = torch.randn(B, N, device=x.device).argsort(dim=-1)[:, :max(1, int(N * (1.0 - rate)))] + n_prefix
    idx = torch.cat([torch.arange(n_prefix, device=x.device).expand(B, -1), keep], dim=1)
    x = x.gather(1, idx[..., None].expand(-1, -1, x.shape[-1]))
    return x, None if rope is None else tuple(t[idx][:, None] for t in rope)
