"""Causal self-attention with grouped-query heads (GQA/MQA), RoPE and a KV cache.

Papers: Vaswani et al., "Attention Is All You Need" (2017); Ainslie et al., "GQA: Training
Generalized Multi-Query Transformer Models from Multi-Head Checkpoints" (2023); Shazeer,
"Fast Transformer Decoding: One Write-Head is All You Need" (2019, MQA); Dao et al.,
"FlashAttention" (2022); Mistral's sliding-window attention (Jiang et al., "Mistral 7B", 2023).

Backends (`backend`; each name is exactly one implementation):
- 'auto' (the default) picks per call: 'flash' on CUDA in fp16/bf16 when flash-attn is
  installed; 'bmm' on a CPU with at most CPU_BMM_MAX_LEN keys (CPU_BMM_MAX_LEN_COMPILED under
  torch.compile); 'sdpa' otherwise. `resolve_backend` says what it picks for a given shape.
- 'sdpa': torch.nn.functional.scaled_dot_product_attention (torch chooses its kernel).
- 'flash': flash-attn's flash_attn_func (CUDA, fp16/bf16); anything else is an error.
- 'bmm': the CPU speed path `attend_bmm` of attention_cpu.py (batched matmuls around an fp32
  softmax with a hand-written backward; faster than torch's CPU flash kernel up to ~1024 keys).
- 'math': a plain softmax(QK^T/sqrt(D))V in fp32, the reference for tests.
The backend is how attention runs, not what it computes: `set_backend(model, name)` sets it on
every CausalSelfAttention of a built model.

q, k and v come from one fused projection `qkv` of shape ((H + 2*KV) * D, d_model): rows
[0, H*D) are q, then KV*D rows of k, then KV*D rows of v (heads contiguous inside each).
With `qk_norm` (Qwen3; Dehghani et al., "Scaling Vision Transformers to 22 Billion
Parameters", 2023) each q and k head is RMS-normalised over D, with gains `q_norm` and `k_norm`
of shape (D,), before RoPE.

Prefix tuning: `prefix`, None by default, may be set to a module taking the keys and values
(B, KV, Tk, D) after RoPE and the cache and returning them with learned ones in front (prefix.py).

Shapes: x (B, T, d_model) -> (B, T, d_model); q (B, H, T, D); k, v (B, KV, T, D);
cos, sin (T, D) from rope.py, or (B, T, D) when each row has positions of its own; key_mask
(B, T) bool for layers that skip tokens (`attend_masked`, `KVCache(masked=True)`).
Needs: rope.py, norm.py, attention_cpu.py (copy them beside this file). Depends on torch only; flash-attn is
imported on first use of the 'flash' backend, when installed.
"""
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

try:
    from .attention_cpu import CPU_BMM_MAX_LEN, CPU_BMM_MAX_LEN_COMPILED, attend_bmm
    from .norm import RMSNorm
    from .rope import apply_rope
except ImportError:  # copied next to rope.py, norm.py and attention_cpu.py, outside the zoo package
    from attention_cpu import CPU_BMM_MAX_LEN, CPU_BMM_MAX_LEN_COMPILED, attend_bmm
    from norm import RMSNorm
    from rope import apply_rope

BACKENDS = ("auto", "sdpa", "flash", "bmm", "math")

# flash_attn.flash_attn_func(q, k, v, causal, window_size) on (B, T, H, D) tensors: imported on
# first use (None when flash-attn is absent or fails to import, e.g. built for another CUDA)
flash_attn_func = None
_flash_imported = False


def flash_available():
    """flash-attn's flash_attn_func when it is installed and imports, else None (looked up once)."""
    global flash_attn_func, _flash_imported
    if flash_attn_func is None and not _flash_imported:
        _flash_imported = True
        try:
            from flash_attn import flash_attn_func as fn
            flash_attn_func = fn
        except Exception:  # noqa: BLE001  (absent, or built for another CUDA / torch)
            pass
    return flash_attn_func


class KVCache(nn.Module):
    """Preallocated keys and values of one layer: (B, KV, max_len, D). With `masked`, also which
    positions of each row hold a key the layer processed, `valid` (B, max_len) bool (a layer that
    skips tokens, as Mixture-of-Depths does: see `update_mask`)."""

    def __init__(self, batch: int, n_kv_heads: int, max_len: int, head_dim: int, device=None, dtype=None,
                 masked: bool = False):
        super().__init__()
        shape = (batch, n_kv_heads, max_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, device=device, dtype=dtype), persistent=False)
        self.register_buffer("v", torch.zeros(shape, device=device, dtype=dtype), persistent=False)
        valid = torch.zeros(batch, max_len, dtype=torch.bool, device=device) if masked else None
        self.register_buffer("valid", valid, persistent=False)

    def update_mask(self, key_mask: torch.Tensor, start: int) -> torch.Tensor:
        """Record key_mask (B, T) bool (True: a key later queries may see) at [start, start+T);
        return the mask of all positions up to start+T, (B, start+T)."""
        if self.valid is None:
            raise ValueError("this KV cache was made without masked=True, so it cannot keep a key mask")
        end = start + key_mask.shape[1]
        self.valid[:, start:end] = key_mask
        return self.valid[:, :end]

    def update(self, k: torch.Tensor, v: torch.Tensor, start: int):
        """Write k, v (B, KV, T, D) at [start, start+T); return all keys/values up to start+T."""
        end = start + k.shape[2]
        if end > self.k.shape[2]:
            raise ValueError(f"KV cache holds {self.k.shape[2]} positions, asked to write up to {end}")
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]


def attend_masked(q, k, v, key_mask: torch.Tensor, backend: str = "auto", window: Optional[int] = None):
    """`attend` where, besides the causal (and window) rule, query i sees key j only when
    key_mask[b, j] is True or j is query i's own position; key_mask (B, Tk) bool. A query always
    sees itself, so no row of the softmax is empty. Runs as SDPA with a (B, 1, Tq, Tk) boolean
    mask ('math': the fp32 reference with the same mask)."""
    B, H, Tq, D = q.shape
    KV, Tk = k.shape[1], k.shape[2]
    q_pos = torch.arange(Tk - Tq, Tk, device=q.device)[:, None]
    own = torch.arange(Tk, device=q.device)[None, :] == q_pos  # (Tq, Tk)
    mask = attention_mask(Tq, Tk, window, q.device) & (key_mask[:, None, :] | own)  # (B, Tq, Tk)
    mask = mask[:, None]
    if backend == "math":
        if KV != H:
            k = k.repeat_interleave(H // KV, dim=1)
            v = v.repeat_interleave(H // KV, dim=1)
        scores = (q.float() @ k.float().transpose(-2, -1)) / math.sqrt(D)
        return (scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v.float()).to(q.dtype)
    gqa = {"enable_gqa": True} if KV != H else {}
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **gqa)


def attention_mask(q_len: int, k_len: int, window: Optional[int], device) -> torch.Tensor:
    """Boolean (q_len, k_len) mask, True = attend. Query i sits at position k_len - q_len + i;
    it sees keys at positions <= its own and, with a window, fewer than `window` back."""
    q_pos = torch.arange(k_len - q_len, k_len, device=device)[:, None]
    k_pos = torch.arange(k_len, device=device)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask = mask & (q_pos - k_pos < window)
    return mask


def resolve_backend(backend: str, device: torch.device, dtype: torch.dtype, k_len: int,
                    compiling: bool = False) -> str:
    """The implementation that `backend` runs for keys of length k_len on `device` in `dtype`."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r} (supported: {', '.join(BACKENDS)})")
    if backend != "auto":
        return backend
    if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and flash_available() is not None:
        return "flash"
    if device.type == "cpu" and k_len <= (CPU_BMM_MAX_LEN_COMPILED if compiling else CPU_BMM_MAX_LEN):
        return "bmm"
    return "sdpa"


def attend(q, k, v, backend: str = "auto", window: Optional[int] = None) -> torch.Tensor:
    """Causal attention of q (B, H, Tq, D) over k, v (B, KV, Tk, D), Tk >= Tq, the queries being
    the last Tq positions. Returns (B, H, Tq, D)."""
    B, H, Tq, D = q.shape
    KV, Tk = k.shape[1], k.shape[2]
    windowed = window is not None and Tk > window
    backend = resolve_backend(backend, q.device, q.dtype, Tk, torch.compiler.is_compiling())
    if backend == "flash":
        fn = flash_available()
        if fn is None or not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16):
            raise RuntimeError(f"attention backend 'flash' needs flash-attn installed, CUDA and fp16/bf16 "
                               f"(got {q.device.type}, {q.dtype}, flash-attn "
                               f"{'installed' if fn is not None else 'not installed'}); use 'auto' or 'sdpa'")
        out = fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True,
                 window_size=(window - 1, 0) if windowed else (-1, -1))
        return out.transpose(1, 2)
    if backend == "bmm":
        return attend_bmm(q, k, v, window if windowed else None)
    if backend == "sdpa":
        gqa = {"enable_gqa": True} if KV != H else {}
        if not windowed and Tq == Tk:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, **gqa)
        if not windowed and Tq == 1:
            return F.scaled_dot_product_attention(q, k, v, **gqa)
        mask = attention_mask(Tq, Tk, window, q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **gqa)
    # math
    if KV != H:
        k = k.repeat_interleave(H // KV, dim=1)
        v = v.repeat_interleave(H // KV, dim=1)
    scores = (q.float() @ k.float().transpose(-2, -1)) / math.sqrt(D)
    scores = scores.masked_fill(~attention_mask(Tq, Tk, window, q.device), float("-inf"))
    return (scores.softmax(-1) @ v.float()).to(q.dtype)


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: Optional[int] = None, head_dim: Optional[int] = None,
                 qkv_bias: bool = False, backend: str = "auto", sliding_window: Optional[int] = None,
                 qk_norm: bool = False, norm_eps: float = 1e-6):
        super().__init__()
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads or n_heads
        self.head_dim = head_dim or dim // n_heads
        if n_heads % self.n_kv_heads:
            raise ValueError(f"n_kv_heads={self.n_kv_heads} must divide n_heads={n_heads}")
        if backend not in BACKENDS:
            raise ValueError(f"unknown attention backend {backend!r} (supported: {', '.join(BACKENDS)})")
        if backend in ("auto", "flash"):
            flash_available()  # import it now, not inside a compiled forward
        self.backend, self.sliding_window = backend, sliding_window
        self.qkv = nn.Linear(dim, (n_heads + 2 * self.n_kv_heads) * self.head_dim, bias=qkv_bias)
        self.proj = nn.Linear(n_heads * self.head_dim, dim, bias=False)
        self.q_norm = RMSNorm(self.head_dim, norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, norm_eps) if qk_norm else None
        self.prefix = None  # prefix tuning: a module (k, v) -> (k, v) with learned keys/values in front (prefix.py)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: Optional[KVCache] = None, start_pos: int = 0,
                key_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x (B, T, dim) at positions [start_pos, start_pos + T); cos, sin (T, D), or (B, T, D) for
        rows at positions of their own (Mixture-of-Depths' routed tokens, in order). key_mask
        (B, T) bool: the keys later queries may see (`attend_masked`; kept in a masked cache)."""
        B, T, _ = x.shape
        H, KV, D = self.n_heads, self.n_kv_heads, self.head_dim
        qk, v = self.qkv(x).view(B, T, H + 2 * KV, D).split([H + KV, KV], dim=2)
        if self.q_norm is not None:
            q, k = qk.split([H, KV], dim=2)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=2)
        qk = apply_rope(qk, cos.unsqueeze(-2), sin.unsqueeze(-2))  # q and k heads rotated in one go
        q, k = qk.transpose(1, 2).split([H, KV], dim=1)  # (B, H, T, D), (B, KV, T, D)
        v = v.transpose(1, 2)
        if cache is not None:
            k, v = cache.update(k, v, start_pos)
            if key_mask is not None:
                key_mask = cache.update_mask(key_mask, start_pos)
        if self.prefix is not None:
            n = k.shape[2]
            k, v = self.prefix(k, v)
            if key_mask is not None:  # the learned prefix is visible to every query
                key_mask = torch.cat([key_mask.new_ones(B, k.shape[2] - n), key_mask], dim=1)
        if key_mask is not None:
            y = attend_masked(q, k, v, key_mask, self.backend, self.sliding_window)
        else:
            y = attend(q, k, v, self.backend, self.sliding_window)
        return self.proj(y.transpose(1, 2).reshape(B, T, H * D))


def set_backend(model: nn.Module, backend: str) -> int:
    """Set the attention backend (BACKENDS) of every CausalSelfAttention in `model`; returns how
    many. A choice of how attention runs, made on a built model (train.attn_backend)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r} (supported: {', '.join(BACKENDS)})")
    if backend in ("auto", "flash"):
        flash_available()  # import it now, not inside a compiled forward
    mods = [m for m in model.modules() if isinstance(m, CausalSelfAttention)]
    for m in mods:
        m.backend = backend
    return len(mods)
