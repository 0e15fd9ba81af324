"""CPU speed path for causal attention: batched matmuls around an fp32 softmax, the queries in blocks that skip the keys
they cannot see, with a hand-written backward.

Plain attention (Vaswani et al., "Attention Is All You Need", 2017); the backward uses FlashAttention's
dS = P * (dP - rowsum(dO * O)) (Dao et al., 2022). attention.py's 'auto' picks it ('bmm') under torch.compile, which
fuses its softmax; eagerly torch's flash kernel is as fast on one thread and several times faster on a busy CPU.

Shapes: q (B, H, Tq, D); k, v (B, KV, Tk, D), Tk >= Tq, the queries being the last Tq positions, H a multiple of KV
(grouped heads) -> (B, H, Tq, D); an optional extra mask (B, Tq, Tk) bool (True = attend) narrows the causal rule.
"""
from typing import Optional

import torch


def attention_mask(q_len: int, k_len: int, window: Optional[int], device) -> torch.Tensor:
    """Boolean (q_len, k_len) mask, True = attend. Query i sits at position k_len - q_len + i;
    it sees keys at positions <= its own and, with a window, fewer than `window` back."""
    q_pos = torch.arange(k_len - q_len, k_len, device=device)[:, None]
    k_pos = torch.arange(k_len, device=device)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask = mask & (q_pos - k_pos < window)
    return mask


CPU_BMM_MAX_LEN_COMPILED = 1024   # under torch.compile: the longest key length 'auto' runs `attend_bmm` for


def bmm_block_size(tq: int) -> int:
    """Queries per block in `attend_bmm`: a quarter of the queries, within [64, 256]."""
    return min(256, max(64, tq // 4))


class _AttendBlock(torch.autograd.Function):
    """One block of `attend_bmm`: all Tq queries (the last Tq positions) against all Tk keys. Its backward
    keeps the probabilities once, in the compute dtype, and uses FlashAttention's identity in fp32
    (autograd would keep an fp32 copy of P as well)."""

    @staticmethod
    def forward(ctx, q, k, v, window: Optional[int], mask: Optional[torch.Tensor] = None):
        B, H, Tq, D = q.shape
        KV, Tk = k.shape[1], k.shape[2]
        G = H // KV
        scale = D ** -0.5
        scores = (q.reshape(B, KV, G * Tq, D) @ k.transpose(-2, -1)).float() * scale  # (B, KV, G*Tq, Tk)
        if Tq > 1 or window is not None or mask is not None:  # one query, no window: it sees every key
            # row g*Tq + i is query i of head g: seen as (B, KV, G, Tq, Tk) the (Tq, Tk) mask
            # broadcasts, with no per-row index arithmetic in a compiled kernel
            allowed = attention_mask(Tq, Tk, window, q.device)
            if mask is not None:  # (B, Tq, Tk) -> (B, 1, 1, Tq, Tk)
                allowed = (allowed & mask)[:, None, None]
            scores = scores.view(B, KV, G, Tq, Tk).masked_fill(~allowed, float("-inf")).view(B, KV, G * Tq, Tk)
        probs = scores.softmax(-1).to(v.dtype)
        out = probs @ v  # (B, KV, G*Tq, D)
        ctx.save_for_backward(q, k, v, probs, out)
        ctx.scale = scale
        return out.view(B, H, Tq, D)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        q, k, v, probs, out = ctx.saved_tensors
        B, H, Tq, D = q.shape
        KV = k.shape[1]
        grad_out = grad_out.reshape(B, KV, (H // KV) * Tq, D).to(v.dtype)
        grad_v = probs.transpose(-2, -1) @ grad_out
        grad_p = (grad_out @ v.transpose(-2, -1)).float()
        delta = (grad_out.float() * out.float()).sum(-1, keepdim=True)  # = rowsum(dP * P)
        grad_s = (probs.float() * (grad_p - delta) * ctx.scale).to(q.dtype)  # masked keys: P = 0
        grad_q = (grad_s @ k).view(B, H, Tq, D)
        grad_k = grad_s.transpose(-2, -1) @ q.reshape(B, KV, (H // KV) * Tq, D)
        return grad_q, grad_k, grad_v, None, None


def attend_bmm(q, k, v, window: Optional[int] = None, block: Optional[int] = None,
               mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """softmax(q k^T / sqrt(D), causal, windowed and within `mask` (B, Tq, Tk)) v as batched matmuls, softmax
    in fp32; every query must see a key. Grouped heads share their kv head without copies; queries go
    in blocks that multiply only the keys they can see (about half of a causal score matrix is skipped)."""
    Tq, Tk = q.shape[2], k.shape[2]
    block = block or bmm_block_size(Tq)
    if Tq <= block:
        return _AttendBlock.apply(q, k, v, window, mask)
    off = Tk - Tq  # query i sits at position off + i
    outs = []
    for s in range(0, Tq, block):
        e = min(s + block, Tq)
        lo = 0 if window is None else max(0, off + s - window + 1)
        m = None if mask is None else mask[:, s:e, lo:off + e]
        outs.append(_AttendBlock.apply(q[:, :, s:e], k[:, :, lo:off + e], v[:, :, lo:off + e], window, m))
    return torch.cat(outs, dim=2)
