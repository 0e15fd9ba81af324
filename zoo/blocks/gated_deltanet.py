"""Gated DeltaNet: linear attention whose matrix state is written by the delta rule and decays by a gate.

Paper: Yang, Kautz, Hatamizadeh, "Gated Delta Networks: Improving Mamba2 with Delta Rule" (2024); the chunked form is
the WY representation of Yang et al., "Parallelizing Linear Transformers with the Delta Rule over Sequence Length"
(2024). As Qwen3.5 and Qwen3-Next use it (parameter names as Qwen3.5's, so its weights map one to one):
    q, k, v = silu(causal_conv(in_proj_qkv x)); q, k L2-normalised, q scaled by 1/sqrt(Dk)
    beta = sigmoid(in_proj_b x); g = -exp(A_log) * softplus(in_proj_a x + dt_bias)
    S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - exp(g_t) S_{t-1}^T k_t)^T;  o_t = S_t^T q_t
    y = out_proj(norm(o) * silu(in_proj_z x))   (norm: per-head RMSNorm)
Each of the Hk query/key heads serves Hv / Hk value heads. Two forms of the same recurrence: `chunk_gated_delta_rule`
(training, prefill: chunks of C tokens, a triangular solve inside each, one small matmul per chunk between them) and
`recurrent_gated_delta_rule` (decoding, token by token). On CUDA, flash-linear-attention's kernel when it is installed.
State: (conv window (B, K-1, 2 Hk Dk + Hv Dv), S (B, Hv, Dk, Dv) in fp32); doc_ids (B, T) restart it (recurrent.py).

Shapes: x (B, T, d_model) -> (B, T, d_model); q, k (B, T, Hk, Dk); v (B, T, Hv, Dv); g, beta (B, T, Hv).
Needs: recurrent.py, norm.py. flash-linear-attention (`fla`) is imported on first use, when installed.
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


class GatedDeltaNet(nn.Module):
    def __init__(self, dim: int, n_heads: int, head_dim: int, n_v_heads: Optional[int] = None,
                 v_head_dim: Optional[int] = None, conv_kernel: int = 4, eps: float = 1e-6, chunk: int = 64):
        super().__init__()
        n_v_heads, v_head_dim = n_v_heads or n_heads, v_head_dim or head_dim
        if n_v_heads % n_heads:
            raise ValueError(f"n_v_heads={n_v_heads} must be a multiple of n_heads={n_heads}")
        self.head_dim, self.v_head_dim, self.chunk = head_dim, v_head_dim, chunk
        self.key_dim, self.value_dim = n_heads * head_dim, n_v_heads * v_head_dim
        conv_dim = 2 * self.key_dim + self.value_dim
        self.in_proj_qkv = nn.Linear(dim, conv_dim, bias=False)
        self.in_proj_z = nn.Linear(dim, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(dim, n_v_heads, bias=False)
        self.in_proj_a = nn.Linear(dim, n_v_heads, bias=False)
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, conv_kernel, groups=conv_dim, bias=False, padding=conv_kernel - 1)
        self.dt_bias = nn.Parameter(torch.ones(n_v_heads))
        self.A_log = nn.Parameter(torch.empty(n_v_heads).uniform_(0.01, 16).log())
        self.norm = GatedRMSNorm(v_head_dim, eps)
        self.out_proj = nn.Linear(self.value_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, state=None, doc_ids: Optional[torch.Tensor] = None):
        """x (B, T, d_model), state from a previous call or None -> y (B, T, d_model), the state after x."""
        conv_state, S = (None, None) if state is None else state
        qkv, conv_state = causal_conv(self.in_proj_qkv(x), self.conv1d.weight, self.conv1d.bias, conv_state, doc_ids)
        q, k, v = F.silu(qkv).split([self.key_dim, self.key_dim, self.value_dim], -1)
        q, k = (t.unflatten(-1, (-1, self.head_dim)) for t in (q, k))
        v = v.unflatten(-1, (-1, self.v_head_dim))
        beta = self.in_proj_b(x).sigmoid()
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)
        o, S = gated_delta_rule(q, k, v, g, beta, S, doc_ids, self.chunk)
        o = self.norm(o, self.in_proj_z(x).unflatten(-1, (-1, self.v_head_dim)))
        return self.out_proj(o.flatten(2)), (conv_state, S)


def gated_delta_rule(q, k, v, g, beta, state=None, doc_ids=None, chunk: int = 64):
    """The recurrence for one token, flash-linear-attention's chunked kernel on CUDA when installed, else the chunked
    torch form. q, k (B, T, Hk, Dk) before the L2 norm; v (B, T, Hv, Dv); g, beta (B, T, Hv) -> o like v, state."""
    if q.shape[1] == 1:
        return recurrent_gated_delta_rule(q, k, v, g, beta, state)
    if q.is_cuda and fla_chunk() is not None:
        return fla_gated_delta_rule(q, k, v, g, beta, state, doc_ids)
    return chunk_gated_delta_rule(q, k, v, g, beta, state, doc_ids, chunk)


def _heads_first(q, k, v, g, beta):
    """fp32 (B, Hv, T, .) tensors; q, k L2-normalised (as flash-linear-attention), q scaled, repeated to Hv heads."""
    rep = v.shape[2] // k.shape[2]
    scale = (1.0 / math.sqrt(q.shape[-1]), 1.0)  # folded into the norm's factor
    q, k = (t.float() * t.float().square().sum(-1, keepdim=True).add(1e-6).rsqrt() * s for t, s in zip((q, k), scale))
    if rep > 1:
        q, k = q.repeat_interleave(rep, 2), k.repeat_interleave(rep, 2)
    return [t.float().transpose(1, 2) for t in (q, k, v, g, beta)]


def recurrent_gated_delta_rule(q, k, v, g, beta, state=None):
    """Token by token: the decoding form (and the reference for the chunked one), read and written by matmuls."""
    dtype = v.dtype
    q, k, v, g, beta = _heads_first(q, k, v, g, beta)
    S = v.new_zeros(*v.shape[:2], k.shape[-1], v.shape[-1]) if state is None else state.float()
    decay, out = g.exp()[..., None, None], []
    for t in range(q.shape[2]):
        S = S * decay[:, :, t]
        kt = k[:, :, t, None]  # (B, H, 1, Dk)
        delta = (v[:, :, t, None] - kt @ S) * beta[:, :, t, None, None]
        S = torch.baddbmm(S.flatten(0, 1), kt.flatten(0, 1).transpose(1, 2), delta.flatten(0, 1)).view_as(S)
        out.append(q[:, :, t, None] @ S)
    return torch.cat(out, 2).transpose(1, 2).to(dtype), S


def chunk_gated_delta_rule(q, k, v, g, beta, state=None, doc_ids=None, chunk: int = 64):
    """Chunks of C tokens: inside each, the delta rule's updates folded by one triangular solve (the WY form) into
    u (new values) and w (the keys that read the incoming state); between chunks S_{i+1} = M_i S_i + c_i.
    Products that share a factor run as one: [k beta; q] k^T, attn [u w] and k_tail^T [u w]."""
    dtype, T, Dv = v.dtype, q.shape[1], v.shape[-1]
    q, k, v, g, beta = (to_chunks(t, chunk) for t in _heads_first(q, k, v, g, beta))  # (B, H, n, C, .)
    starts = None if doc_ids is None else to_chunks(resets(doc_ids), chunk, 1)
    within, head, tail, whole = chunk_decays(g, starts)
    kb = k * beta[..., None]
    both = (torch.cat([kb, q], -2) @ k.transpose(-1, -2)).unflatten(-2, (2, -1))
    ut, attn = (both * within[..., None, :, :]).unbind(-3)
    uw = torch.linalg.solve_triangular(ut, torch.cat([v * beta[..., None], kb * head[..., None]], -1),
                                       upper=False, unitriangular=True)  # only ut's strictly lower triangle is read
    intra, aw = (attn @ uw).split([Dv, k.shape[-1]], -1)
    read = q * head[..., None] - aw  # o = read S_i + attn u
    c, kw = ((k * tail[..., None]).transpose(-1, -2) @ uw).split([Dv, k.shape[-1]], -1)
    M = whole[..., None, None] * torch.eye(k.shape[-1], device=k.device) - kw
    S = v.new_zeros(*v.shape[:2], k.shape[-1], Dv) if state is None else state.float()
    states = []
    for Mi, ci in zip(M.unbind(2), c.unbind(2)):  # unbind: one gradient tensor, not one per chunk
        states.append(S)
        S = torch.baddbmm(ci.flatten(0, 1), Mi.flatten(0, 1), S.flatten(0, 1)).view_as(S)
    o = intra + read @ torch.stack(states, 2)
    return o.flatten(2, 3)[:, :, :T].transpose(1, 2).to(dtype), S


def fla_chunk():
    """flash-linear-attention's chunk_gated_delta_rule when it is installed and imports, else None."""
    return optional_kernel("fla.ops.gated_delta_rule", "chunk_gated_delta_rule")


def fla_gated_delta_rule(q, k, v, g, beta, state=None, doc_ids=None):
    """flash-linear-attention's kernel; packed documents as one flat row cut at cu_seqlens (every document start and
    row start), the incoming state given to each row's first document, the state of each row's last one returned."""
    rep = v.shape[2] // k.shape[2]
    q, k = q.repeat_interleave(rep, 2), k.repeat_interleave(rep, 2)
    kw = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
    if doc_ids is None:
        return fla_chunk()(q, k, v, g.float(), beta, initial_state=state, **kw)
    B, T = doc_ids.shape
    new = resets(doc_ids)
    new[:, 0] = True
    starts = new.flatten().nonzero().squeeze(1)
    first = (starts % T == 0).nonzero().squeeze(1)  # the documents that open a row, in row order
    last = torch.cat([first[1:] - 1, first.new_tensor([len(starts) - 1])])
    init = None if state is None else state.new_zeros(len(starts), *state.shape[1:]).index_copy(0, first, state)
    flat = (t.flatten(0, 1)[None] for t in (q, k, v, g.float(), beta))
    o, S = fla_chunk()(*flat, initial_state=init, cu_seqlens=F.pad(starts, (0, 1), value=B * T), **kw)
    return o.view(B, T, *o.shape[2:]), S[last]
