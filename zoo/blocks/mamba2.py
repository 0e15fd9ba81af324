"""Mamba-2: the selective state-space layer in its state space duality (SSD) form.

Paper: Dao and Gu, "Transformers are SSMs: Generalized Models and Efficient Algorithms Through Structured State Space
Duality" (2024). As transformers' Mamba2Mixer and Granite 4.0-H's mamba layers (same parameter names):
    z, xBC, dt = in_proj(u);  x, B, C = silu(causal_conv(xBC));  dt = softplus(dt + dt_bias), A = -exp(A_log)
    S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T;  y_t = S_t C_t + D x_t;  out = out_proj(norm(y * silu(z)))
H heads of P channels; B and C (N wide) shared by the H / n_groups heads of a group; the norm per group. Two forms:
`ssd_chunked` (training, prefill: chunks of C tokens, quadratic inside, the states passed between them) and
`ssd_recurrent` (decoding, token by token). On CUDA, mamba_ssm's chunked scan when it is installed.
State: (conv window (B, K-1, H P + 2 G N), S (B, H, P, N) in fp32); doc_ids (B, T) restart it (recurrent.py).

Shapes: u (B, T, d_model) -> (B, T, d_model); x (B, T, H, P); dt (B, T, H); B, C (B, T, G, N).
Needs: recurrent.py, norm.py. mamba_ssm is imported on first use, when installed.
"""
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

try:
    from .norm import GatedRMSNorm
    from .recurrent import causal_conv, chunk_decays, optional_kernel, resets, to_chunks
except ImportError:  # copied next to recurrent.py and norm.py, outside the zoo package
    from norm import GatedRMSNorm
    from recurrent import causal_conv, chunk_decays, optional_kernel, resets, to_chunks


class Mamba2(nn.Module):
    def __init__(self, dim: int, n_heads: int, head_dim: int, state_size: int = 128, n_groups: int = 1,
                 conv_kernel: int = 4, chunk: int = 256, bias: bool = False, conv_bias: bool = True,
                 eps: float = 1e-6, dt_limit: tuple = (0.0, float("inf")), dt_range: tuple = (1e-3, 0.1)):
        super().__init__()
        if n_heads % n_groups:
            raise ValueError(f"n_heads={n_heads} must be a multiple of n_groups={n_groups}")
        inner = n_heads * head_dim
        self.sizes = [inner, inner + 2 * n_groups * state_size, n_heads]  # z, xBC, dt
        self.split = [inner, n_groups * state_size, n_groups * state_size]  # x, B, C
        self.head_dim, self.n_groups, self.chunk, self.dt_limit = head_dim, n_groups, chunk, dt_limit
        self.in_proj = nn.Linear(dim, sum(self.sizes), bias=bias)
        conv_dim = self.sizes[1]
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, conv_kernel, groups=conv_dim, bias=conv_bias,
                                padding=conv_kernel - 1)
        dt = torch.empty(n_heads).uniform_(*map(math.log, dt_range)).exp().clamp(min=1e-4)
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # softplus(dt_bias) = dt
        self.A_log = nn.Parameter(torch.arange(1, n_heads + 1, dtype=torch.float32).log())
        self.D = nn.Parameter(torch.ones(n_heads))
        self.norm = GatedRMSNorm(inner, eps, group=inner // n_groups, gate_first=True)
        self.out_proj = nn.Linear(inner, dim, bias=bias)

    def forward(self, u: torch.Tensor, state=None, doc_ids: Optional[torch.Tensor] = None):
        """u (B, T, d_model), state from a previous call or None -> y (B, T, d_model), the state after u."""
        conv_state, S = (None, None) if state is None else state
        z, xBC, dt = self.in_proj(u).split(self.sizes, -1)
        xBC, conv_state = causal_conv(xBC, self.conv1d.weight, self.conv1d.bias, conv_state, doc_ids)
        x, B, C = F.silu(xBC).split(self.split, -1)
        x, (B, C) = x.unflatten(-1, (-1, self.head_dim)), (t.unflatten(-1, (self.n_groups, -1)) for t in (B, C))
        dt = F.softplus(dt.float() + self.dt_bias).clamp(*self.dt_limit)
        y, S = ssd(x, dt, -self.A_log.float().exp(), B, C, S, doc_ids, self.chunk)
        y = y + x * self.D[:, None].to(x.dtype)
        return self.out_proj(self.norm(y.flatten(2), z).to(u.dtype)), (conv_state, S)


def ssd(x, dt, A, B, C, state=None, doc_ids=None, chunk: int = 256):
    """The scan without D: the recurrence for one token, mamba_ssm's chunked kernel on CUDA when installed, else the
    chunked torch form. x (B, T, H, P); dt (B, T, H) after softplus; A (H,); B, C (B, T, G, N) -> y like x, state."""
    if x.shape[1] == 1:
        return ssd_recurrent(x, dt, A, B, C, state)
    if x.is_cuda and mamba_scan() is not None:
        seq_idx = None if doc_ids is None else resets(doc_ids).cumsum(1).int()
        return mamba_scan()(x, dt, A, B, C, chunk, initial_states=state, seq_idx=seq_idx, return_final_states=True)
    return ssd_chunked(x, dt, A, B, C, state, doc_ids, chunk)


def _heads_first(x, dt, A, B, C):
    """fp32 (B, H, T, .) tensors: x scaled by dt, B and C repeated to the heads, the log decays dt A (B, H, T)."""
    rep = x.shape[2] // B.shape[2]
    B, C = (t.float().repeat_interleave(rep, 2).transpose(1, 2) for t in (B, C))
    return (x.float() * dt[..., None]).transpose(1, 2), (dt * A).transpose(1, 2), B, C


def ssd_recurrent(x, dt, A, B, C, state=None):
    """Token by token: the decoding form (and the reference for the chunked one)."""
    dtype = x.dtype
    x, a, B, C = _heads_first(x, dt, A, B, C)
    S = x.new_zeros(*x.shape[:2], x.shape[-1], B.shape[-1]) if state is None else state.float()
    out = []
    for t in range(x.shape[2]):
        S = S * a[:, :, t, None, None].exp() + x[:, :, t, :, None] * B[:, :, t, None, :]
        out.append(S @ C[:, :, t, :, None])
    return torch.cat(out, -1).permute(0, 3, 1, 2).to(dtype), S


def ssd_chunked(x, dt, A, B, C, state=None, doc_ids=None, chunk: int = 256):
    """Chunks of C tokens: inside each, attention-like (C B^T masked by the decays) over x; between them the chunks'
    states carried forward, S_{i+1} = whole_i S_i + (what chunk i writes)."""
    dtype, T = x.dtype, x.shape[1]
    x, a, B, C = (to_chunks(t, chunk) for t in _heads_first(x, dt, A, B, C))  # (B, H, n, C, .)
    starts = None if doc_ids is None else to_chunks(resets(doc_ids), chunk, 1)
    within, head, tail, whole = chunk_decays(a, starts)
    y = ((C @ B.transpose(-1, -2)) * within) @ x
    written = (x * tail[..., None]).transpose(-1, -2) @ B  # (B, H, n, P, N)
    S = x.new_zeros(*x.shape[:2], x.shape[-1], B.shape[-1]) if state is None else state.float()
    states = []
    for wi, si in zip(whole.unbind(2), written.unbind(2)):  # unbind: one gradient tensor, not one per chunk
        states.append(S)
        S = wi[..., None, None] * S + si
    y = y + (C @ torch.stack(states, 2).transpose(-1, -2)) * head[..., None]
    return y.flatten(2, 3)[:, :, :T].transpose(1, 2).to(dtype), S


def mamba_scan():
    """mamba_ssm's mamba_chunk_scan_combined when it is installed and imports, else None."""
    return optional_kernel("mamba_ssm.ops.triton.ssd_combined", "mamba_chunk_scan_combined")
