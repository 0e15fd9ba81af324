"""adaLN-Zero transformer block (DiT) with bidirectional attention, optional QK-norm and 2D RoPE.

Paper: Peebles & Xie, "Scalable Diffusion Models with Transformers" (DiT, 2023). The conditioning c (timestep + class)
regresses per block the shift, scale and gate of both sub-layers, zero-init:

    x = x + gate1 * Attn(modulate(LN(x), shift1, scale1))     modulate(h, sh, sc) = h * (1 + sc) + sh
    x = x + gate2 * MLP(modulate(LN(x), shift2, scale2))

Options: `qk_norm` (Dehghani et al., "Scaling Vision Transformers to 22 Billion Parameters", 2023); `rope`, axial 2D
RoPE (Heo et al., "Rotary Position Embedding for Vision Transformer", 2024) from `axial_rope(head_dim, h, w)`.
FinalLayer: adaLN then a zero-initialised linear map.
Shapes: x (B, N, D) tokens, c (B, D) -> (B, N, D); rope cos/sin (N, head_dim).
Needs: norm.py, rope.py (copy them beside this file).
"""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

try:
    from .norm import RMSNorm
    from .rope import apply_rope, rope_cos_sin, rope_inv_freq
except ImportError:  # copied beside norm.py and rope.py, outside the zoo package
    from norm import RMSNorm
    from rope import apply_rope, rope_cos_sin, rope_inv_freq


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x (B, N, D) * (1 + scale (B, D)) + shift (B, D), in one kernel."""
    return torch.addcmul(shift.unsqueeze(1), x, (1 + scale).unsqueeze(1))


def axial_rope(head_dim: int, h: int, w: int, theta: float = 10000.0, device=None):
    """cos, sin (h*w, head_dim) for tokens in row-major order: channels [0, head_dim/2) rotate by the
    row index, [head_dim/2, head_dim) by the column index (each half in rotate-half layout)."""
    if head_dim % 4:
        raise ValueError(f"2D RoPE needs a head dimension divisible by 4, got {head_dim}")
    inv = rope_inv_freq(head_dim // 2, theta).to(device)
    rows, cols = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij")
    (cr, sr), (cc, sc) = rope_cos_sin(inv, rows.flatten()), rope_cos_sin(inv, cols.flatten())
    return torch.cat([cr, cc], dim=-1), torch.cat([sr, sc], dim=-1)


def _rotate_2d(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """apply_rope on each half of x (..., N, D) with the matching half of the axial tables."""
    half = x.shape[-1] // 2
    a, b = x.split(half, dim=-1)
    return torch.cat([apply_rope(a, cos[:, :half], sin[:, :half]), apply_rope(b, cos[:, half:], sin[:, half:])], -1)


class Attention(nn.Module):
    """Bidirectional multi-head self-attention (SDPA) over N tokens; `mask` (B, 1, 1, N), true where a key is seen."""
    rotate = staticmethod(_rotate_2d)  # how a rope (cos, sin) table turns q and k: the axial layout

    def __init__(self, dim: int, heads: int, qkv_bias: bool = True, qk_norm: bool = False):
        super().__init__()
        if dim % heads:
            raise ValueError(f"heads={heads} must divide the width {dim}")
        self.heads, self.head_dim = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)
        self.q_norm = RMSNorm(self.head_dim) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim) if qk_norm else None

    def forward(self, x: torch.Tensor, rope: Optional[tuple] = None, mask: Optional[torch.Tensor] = None):
        B, N, D = x.shape
        q, k, v = self.qkv_proj(x).view(B, N, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = self.rotate(q, *rope), self.rotate(k, *rope)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)                    # (B, heads, N, head_dim)
        return self.proj(y.transpose(1, 2).reshape(B, N, D))

    def qkv_proj(self, x: torch.Tensor) -> torch.Tensor:
        """(B, N, D) -> (B, N, 3D): q, k, v side by side (a subclass may bias them otherwise)."""
        return self.qkv(x)


class Mlp(nn.Module):
    """Linear -> GELU (tanh approximation by default, as DiT; `quick`: CLIP's x * sigmoid(1.702 x)) -> Linear."""

    def __init__(self, dim: int, hidden: int, approximate: str = "tanh"):
        super().__init__()
        self.approximate = approximate
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x):
        h = self.fc1(x)
        return self.fc2(h * torch.sigmoid(1.702 * h) if self.approximate == "quick" else
                        F.gelu(h, approximate=self.approximate))


class DiTBlock(nn.Module):
    """One adaLN-Zero transformer block: (B, N, D), c (B, D) -> (B, N, D)."""

    def __init__(self, dim: int, heads: int, mlp_ratio: float = 4.0, qkv_bias: bool = True, qk_norm: bool = False,
                 attn_norm_eps: float = 1e-6, mlp_norm_eps: float = 1e-6, approximate: str = "tanh"):
        super().__init__()
        self.attn_norm_eps, self.mlp_norm_eps = attn_norm_eps, mlp_norm_eps
        self.attn = Attention(dim, heads, qkv_bias, qk_norm)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), approximate)
        self.ada = nn.Linear(dim, 6 * dim)
        nn.init.zeros_(self.ada.weight)
        nn.init.zeros_(self.ada.bias)

    def forward(self, x: torch.Tensor, c: torch.Tensor, rope: Optional[tuple] = None) -> torch.Tensor:
        shift1, scale1, gate1, shift2, scale2, gate2 = self.ada(F.silu(c)).chunk(6, dim=-1)
        D = x.shape[-1]
        h = modulate(F.layer_norm(x, (D,), eps=self.attn_norm_eps), shift1, scale1)
        x = torch.addcmul(x, gate1.unsqueeze(1), self.attn(h, rope))
        h = modulate(F.layer_norm(x, (D,), eps=self.mlp_norm_eps), shift2, scale2)
        return torch.addcmul(x, gate2.unsqueeze(1), self.mlp(h))


class FinalLayer(nn.Module):
    """adaLN (shift, scale; no gate) then a linear map to `out_dim` per token: (B, N, D) -> (B, N, out_dim)."""

    def __init__(self, dim: int, out_dim: int, norm_eps: float = 1e-6):
        super().__init__()
        self.norm_eps = norm_eps
        self.ada = nn.Linear(dim, 2 * dim)
        self.linear = nn.Linear(dim, out_dim)
        for m in (self.ada, self.linear):
            nn.init.zeros_(m.weight)
            nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift, scale = self.ada(F.silu(c)).chunk(2, dim=-1)
        return self.linear(modulate(F.layer_norm(x, (x.shape[-1],), eps=self.norm_eps), shift, scale))
