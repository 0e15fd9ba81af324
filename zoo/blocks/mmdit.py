"""MMDiT blocks as FLUX.2 uses them: double-stream blocks, parallel single-stream blocks, 4-axis RoPE, modulation.

Papers: Esser et al., "Scaling Rectified Flow Transformers for High-Resolution Image Synthesis" (MMDiT, SD3, 2024);
Black Forest Labs, FLUX.1 (2024) and FLUX.2 (2025); Dehghani et al., "Scaling Vision Transformers to 22 Billion
Parameters" (2023) for the parallel block and QK-norm; Shazeer, "GLU Variants Improve Transformer" (2020).

    DoubleStreamBlock: text and image tokens keep separate weights (QKV, QK-norm, output, SwiGLU MLP) and separate
        modulation, but attend jointly over [text; image]:
        x = x + g1 * Attn(mod(LN(x)))[image];  x = x + g2 * MLP(mod(LN(x)))   (and the same for the text stream)
    SingleStreamBlock: one fused projection to QKV and the MLP input, one fused output projection, run in parallel:
        x = x + g * Out([Attn(q, k, v); SwiGLU(m)]),  [q, k, v, m] = In(mod(LN(x)))
    Modulation: SiLU then a linear map of the conditioning vector to `sets` x (shift, scale, gate), shared by all the
        blocks of one kind (FLUX.2's layout). LayerNorms carry no weights; mod(h) = h * (1 + scale) + shift.
    TimeGuidanceEmbedder: MLP(sinusoids(1000 t)) (+ MLP(sinusoids(1000 guidance)) for guidance-distilled models).
    rope_4d / positions: RoPE over four position axes (time, height, width, text index), each axis rotating its own
        slice of the head in adjacent channel pairs; image tokens sit at (0, row, col, 0), text tokens at (0, 0, 0, i).

Shapes: image x (B, N, D), text c (B, L, D), conditioning temb (B, D); ids (S, 4) -> rope cos, sin (S, head_dim);
blocks return tensors of their inputs' shapes.
Needs: norm.py, timestep.py (copy them beside this file).
"""
import torch
import torch.nn.functional as F
from torch import nn

try:
    from .norm import RMSNorm
    from .timestep import TimestepEmbedder
except ImportError:  # copied beside norm.py and timestep.py, outside the zoo package
    from norm import RMSNorm
    from timestep import TimestepEmbedder


def positions(n_text: int, h: int, w: int, device=None) -> tuple:
    """FLUX.2's position ids: text (n_text, 4) rows (0, 0, 0, i); image (h*w, 4) rows (0, row, col, 0), row-major."""
    txt = torch.zeros(n_text, 4, dtype=torch.long, device=device)
    txt[:, 3] = torch.arange(n_text, device=device)
    rows, cols = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij")
    img = torch.zeros(h * w, 4, dtype=torch.long, device=device)
    img[:, 1], img[:, 2] = rows.flatten(), cols.flatten()
    return txt, img


def rope_4d(ids: torch.Tensor, axes_dims, theta: float = 2000.0):
    """(S, n_axes) positions -> cos, sin (S, sum(axes_dims)) fp32: per axis, angles pos * theta^(-2i/d) in fp64
    (fp32 where the device has no fp64), each repeated for its channel pair."""
    dtype = torch.float32 if ids.device.type == "mps" else torch.float64
    parts = []
    for a, d in enumerate(axes_dims):
        inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=dtype, device=ids.device) / d)
        parts.append(torch.outer(ids[:, a].float().to(dtype), inv))
    ang = torch.cat(parts, -1)
    return ang.cos().repeat_interleave(2, -1).float(), ang.sin().repeat_interleave(2, -1).float()


def apply_rope_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent channel pairs (x0, x1) of x (B, S, H, Dh) by the angles of cos, sin (S, Dh), in fp32."""
    turn = torch.complex(cos[:, None, 0::2], sin[:, None, 0::2])  # a pair is a complex number: one multiply
    return torch.view_as_real(torch.view_as_complex(x.float().unflatten(-1, (-1, 2))) * turn).flatten(-2).to(x.dtype)


def attend(q, k, v, rope) -> torch.Tensor:
    """Bidirectional attention of (B, S, H, Dh) heads after RoPE -> (B, S, H * Dh)."""
    q, k = (apply_rope_pairs(t, *rope) for t in (q, k))
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2).flatten(2)


def modulated(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm without weights, then x * (1 + scale) + shift (in one kernel); shift, scale (B, 1, D)."""
    return torch.addcmul(shift, F.layer_norm(x, (x.shape[-1],), eps=eps), 1 + scale)


class Modulation(nn.Module):
    """temb (B, D) -> `sets` tuples (shift, scale, gate), each (B, 1, D)."""

    def __init__(self, dim: int, sets: int):
        super().__init__()
        self.sets = sets
        self.linear = nn.Linear(dim, 3 * sets * dim, bias=False)

    def forward(self, temb: torch.Tensor) -> tuple:
        chunks = self.linear(F.silu(temb)).unsqueeze(1).chunk(3 * self.sets, -1)
        return tuple(chunks[3 * i:3 * i + 3] for i in range(self.sets))


class FeedForward(nn.Module):
    """SwiGLU with the gate and value in one input projection: (B, N, D) -> (B, N, D)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.linear_in = nn.Linear(dim, 2 * hidden, bias=False)
        self.linear_out = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, value = self.linear_in(x).chunk(2, -1)
        return self.linear_out(F.silu(gate) * value)


class JointAttention(nn.Module):
    """Image and text projections of their own, one attention over [text; image]."""

    def __init__(self, dim: int, heads: int, head_dim: int, eps: float):
        super().__init__()
        inner, self.head_dim = heads * head_dim, head_dim
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, inner, bias=False) for _ in range(3))
        self.add_q_proj, self.add_k_proj, self.add_v_proj = (nn.Linear(dim, inner, bias=False) for _ in range(3))
        self.norm_q, self.norm_k, self.norm_added_q, self.norm_added_k = (RMSNorm(head_dim, eps) for _ in range(4))
        self.to_out, self.to_add_out = nn.Linear(inner, dim, bias=False), nn.Linear(inner, dim, bias=False)

    def forward(self, x, c, rope):
        split = lambda t: t.unflatten(-1, (-1, self.head_dim))  # noqa: E731
        q = torch.cat([self.norm_added_q(split(self.add_q_proj(c))), self.norm_q(split(self.to_q(x)))], 1)
        k = torch.cat([self.norm_added_k(split(self.add_k_proj(c))), self.norm_k(split(self.to_k(x)))], 1)
        v = torch.cat([split(self.add_v_proj(c)), split(self.to_v(x))], 1)
        out_c, out_x = attend(q, k, v, rope).split([c.shape[1], x.shape[1]], 1)
        return self.to_out(out_x), self.to_add_out(out_c)


class DoubleStreamBlock(nn.Module):
    """(x (B, N, D), c (B, L, D), image and text modulations, rope over L + N) -> (x, c)."""

    def __init__(self, dim: int, heads: int, head_dim: int, mlp_ratio: float = 3.0, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.attn = JointAttention(dim, heads, head_dim, eps)
        self.ff, self.ff_context = (FeedForward(dim, int(dim * mlp_ratio)) for _ in range(2))

    def forward(self, x, c, mod_img, mod_txt, rope):
        (sh, sc, g), (sh2, sc2, g2) = mod_img
        (csh, csc, cg), (csh2, csc2, cg2) = mod_txt
        ax, ac = self.attn(modulated(x, sh, sc, self.eps), modulated(c, csh, csc, self.eps), rope)
        x = torch.addcmul(x, g, ax)
        x = torch.addcmul(x, g2, self.ff(modulated(x, sh2, sc2, self.eps)))
        c = torch.addcmul(c, cg, ac)
        return x, torch.addcmul(c, cg2, self.ff_context(modulated(c, csh2, csc2, self.eps)))


class SingleStreamBlock(nn.Module):
    """(x (B, S, D) text and image tokens together, modulation, rope over S) -> (B, S, D): parallel attention + MLP."""

    def __init__(self, dim: int, heads: int, head_dim: int, mlp_ratio: float = 3.0, eps: float = 1e-6):
        super().__init__()
        self.eps, self.head_dim, self.inner, self.hidden = eps, head_dim, heads * head_dim, int(dim * mlp_ratio)
        self.to_qkv_mlp_proj = nn.Linear(dim, 3 * self.inner + 2 * self.hidden, bias=False)
        self.norm_q, self.norm_k = RMSNorm(head_dim, eps), RMSNorm(head_dim, eps)
        self.to_out = nn.Linear(self.inner + self.hidden, dim, bias=False)

    def forward(self, x, mod, rope):
        (shift, scale, gate), = mod
        qkv, mlp = self.to_qkv_mlp_proj(modulated(x, shift, scale, self.eps)).split([3 * self.inner, 2 * self.hidden],
                                                                                   -1)
        q, k, v = (t.unflatten(-1, (-1, self.head_dim)) for t in qkv.chunk(3, -1))
        a, b = mlp.chunk(2, -1)
        out = torch.cat([attend(self.norm_q(q), self.norm_k(k), v, rope), F.silu(a) * b], -1)
        return torch.addcmul(x, gate, self.to_out(out))


class TimeGuidanceEmbedder(nn.Module):
    """(B,) timesteps in [0, 1] (and guidance scales) -> (B, D): sinusoids of 1000 t through a bias-free MLP."""

    def __init__(self, dim: int, freq_dim: int = 256, guidance: bool = False):
        super().__init__()
        self.timestep_embedder = TimestepEmbedder(dim, freq_dim, 0.0, bias=False)
        self.guidance_embedder = TimestepEmbedder(dim, freq_dim, 0.0, bias=False) if guidance else None

    def forward(self, t: torch.Tensor, guidance=None) -> torch.Tensor:
        emb = self.timestep_embedder(t * 1000)
        if guidance is not None and self.guidance_embedder is not None:
            emb = emb + self.guidance_embedder(guidance * 1000)
        return emb
