"""Causal self-attention with grouped-query heads (GQA/MQA), RoPE and a KV cache.

Papers: Vaswani et al., "Attention Is All You Need" (2017); Ainslie et al., "GQA" (2023); Shazeer, "Fast Transformer
Decoding: One Write-Head is All You Need" (2019, MQA); Dao et al., "FlashAttention" (2022); Jiang et al., "Mistral 7B"
(2023, sliding window); Xiao et al., "Efficient Streaming Language Models with Attention Sinks" (2023).

One fused projection `qkv` (rows: H*D of q, KV*D of k, KV*D of v). `qk_norm`: q and k RMS-normalised before RoPE, per
head ('head': Qwen3, Gemma 3) or over the projection ('proj': OLMo 2); `rope` False: no positions (NoPE, SmolLM3); cos,
sin narrower than a head rotate its first channels (partial rotary, Phi-3/4); `scale` replaces 1/sqrt(D) (Gemma);
`softcap` c: scores c * tanh(s / c) (Gemma 2) and `sinks`: a learned logit per head in every softmax (GPT-OSS), both
on the 'math' path; `gate`: the output times sigmoid of a gate projected beside each query head (Qwen3.5; `qkv`'s rows
then H*2D of each head's q and gate, then k, v); `kv=False`: no k/v rows, the keys and values of an earlier layer (KV
sharing, Gemma 4); `kv_same`: no v rows, the values the keys' projection; `v_norm`: values RMS-normalised without a gain
(Gemma 4); `prefix`: learned keys in front (prefix.py). `mask` says which keys a
query sees and its `attend` picks the kernel: `Causal` (None), `Step` (a tensor `start_pos`: a decoding step of fixed shapes for CUDA graphs, the
cache slots past it masked), `Documents` (attention_docs.py), `KeyMask` (attention_masked.py). Backends
(`set_backend`): 'auto' picks 'flash' (flash-attn, CUDA fp16/bf16), 'bmm' on a CPU under torch.compile for short keys
(attention_cpu.py), else 'sdpa'; 'flex'; 'math' the fp32 reference.

Shapes: x (B, T, d_model) -> (B, T, d_model); q (B, H, T, D); k, v (B, KV, T, D); cos, sin (T, D) from rope.py, or
(B, T, D) when each row has positions of its own.
Needs: rope.py, norm.py, attention_cpu.py. flash-attn is imported on first use, when installed.
"""
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

try:
    from .attention_cpu import CPU_BMM_MAX_LEN_COMPILED, attend_bmm, attention_mask
    from .norm import RMSNorm
    from .rope import apply_rope
except ImportError:  # copied next to rope.py, norm.py and attention_cpu.py, outside the zoo package
    from attention_cpu import CPU_BMM_MAX_LEN_COMPILED, attend_bmm, attention_mask
    from norm import RMSNorm
    from rope import apply_rope

BACKENDS = ("auto", "sdpa", "flash", "bmm", "math", "flex")

# flash-attn's functions, imported on first use (None when absent or failing to import)
flash_attn_func = flash_attn_varlen_func = None
_flash_imported = False


def flash_available():
    """flash-attn's flash_attn_func when it is installed and imports, else None (looked up once)."""
    global flash_attn_func, flash_attn_varlen_func, _flash_imported
    if flash_attn_func is None and not _flash_imported:
        _flash_imported = True
        try:
            import flash_attn
            flash_attn_func = flash_attn.flash_attn_func
            flash_attn_varlen_func = getattr(flash_attn, "flash_attn_varlen_func", None)
        except Exception:  # noqa: BLE001  (absent, or built for another CUDA / torch)
            pass
    return flash_attn_func


class KVCache(nn.Module):
    """Preallocated keys and values of one layer: (B, KV, max_len, D)."""

    def __init__(self, batch: int, n_kv_heads: int, max_len: int, head_dim: int, device=None, dtype=None):
        super().__init__()
        shape = (batch, n_kv_heads, max_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, device=device, dtype=dtype), persistent=False)
        self.register_buffer("v", torch.zeros(shape, device=device, dtype=dtype), persistent=False)

    def update(self, k: torch.Tensor, v: torch.Tensor, start):
        """Write k, v (B, KV, T, D) at [start, start+T); return all keys/values up to start+T."""
        return write(self.k, k, start, 2), write(self.v, v, start, 2)


def write(buf: torch.Tensor, x: torch.Tensor, start, dim: int) -> torch.Tensor:
    """x written into a cache's `buf` at [start, start+T) along `dim` -> buf up to start+T. A tensor `start` (one
    decoding step of fixed shapes): written in place there, every slot returned."""
    if isinstance(start, torch.Tensor):
        return buf.index_copy_(dim, start.view(1), x)
    end = start + x.shape[dim]
    if end > buf.shape[dim]:
        raise ValueError(f"KV cache holds {buf.shape[dim]} positions, asked to write up to {end}")
    buf.narrow(dim, start, x.shape[dim]).copy_(x)
    return buf.narrow(dim, 0, end)


def attend_math(q, k, v, mask: torch.Tensor, softcap: Optional[float] = None,
                sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The fp32 reference softmax(q k^T / sqrt(D)) v within `mask` (True = attend); scores soft-capped at
    `softcap`; `sinks` (H,): a logit per head that joins each softmax and takes no value."""
    B, H, Tq, _ = q.shape
    KV = k.shape[1]
    if KV != H:
        k = k.repeat_interleave(H // KV, dim=1)
        v = v.repeat_interleave(H // KV, dim=1)
    scores = (q.float() @ k.float().transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return (scores.softmax(-1) @ v.float()).to(q.dtype)
    scores = torch.cat([scores, sinks.float().view(1, H, 1, 1).expand(B, H, Tq, 1)], dim=-1)
    return (scores.softmax(-1)[..., :-1] @ v.float()).to(q.dtype)


def sdpa(q, k, v, **kw) -> torch.Tensor:
    """torch's scaled_dot_product_attention, with grouped kv heads when there are fewer of them."""
    gqa = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
    return F.scaled_dot_product_attention(q, k, v, **kw, **gqa)


def check_backend(backend: str) -> str:
    """`backend` when it is one of BACKENDS (else a one-line error); flash-attn imported for 'auto' and 'flash'
    (here, not inside a compiled forward)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r} (supported: {', '.join(BACKENDS)})")
    if backend in ("auto", "flash"):
        flash_available()
    return backend


def resolve_backend(backend: str, device: torch.device, dtype: torch.dtype, k_len: int = 0, compiling: bool = False,
                    auto=("flash", "bmm"), softcap: Optional[float] = None, sinks=None) -> str:
    """The implementation `backend` runs for keys of length k_len on `device` in `dtype` (`compiling`, or when
    torch.compile traces the call): 'math' for soft-capped scores or sinks; 'auto' the first of `auto` that runs there
    ('flash': flash-attn, CUDA fp16/bf16; 'flex': CUDA under torch.compile; 'bmm': a CPU under torch.compile, up to
    CPU_BMM_MAX_LEN_COMPILED keys), else 'sdpa'."""
    if softcap is not None or sinks is not None:
        return "math"
    if check_backend(backend) != "auto":
        return backend
    cuda, compiling = device.type == "cuda", compiling or torch.compiler.is_compiling()
    fits = {"flash": cuda and dtype in (torch.float16, torch.bfloat16) and flash_available() is not None,
            "flex": cuda and compiling,
            "bmm": device.type == "cpu" and compiling and k_len <= CPU_BMM_MAX_LEN_COMPILED}
    return ([b for b in auto if fits[b]] + ["sdpa"])[0]


def check_flash(q, varlen: bool = False):
    """flash_attn_func (flash_attn_varlen_func), or a one-line error saying why the 'flash' backend cannot run here."""
    fn = flash_available() and (flash_attn_varlen_func if varlen else flash_attn_func)
    if fn is None or not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16):
        raise RuntimeError(f"attention backend 'flash' needs flash-attn installed{' with its varlen kernel' * varlen}, "
                           f"CUDA and fp16/bf16 (got {q.device.type}, {q.dtype}, flash-attn "
                           f"{'installed' if flash_attn_func is not None else 'not installed'}); use 'auto' or 'sdpa'")
    return fn


def attend(q, k, v, backend: str = "auto", window: Optional[int] = None, softcap: Optional[float] = None,
           sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal attention of q (B, H, Tq, D), the last Tq positions, over k, v (B, KV, Tk, D) -> (B, H, Tq, D);
    soft-capped scores or sinks: the 'math' path (attend_math)."""
    Tq, Tk = q.shape[2], k.shape[2]
    window = window if window is not None and Tk > window else None
    backend = resolve_backend(backend, q.device, q.dtype, Tk, softcap=softcap, sinks=sinks)
    if backend == "flash":
        out = check_flash(q)(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True,
                             window_size=(window - 1, 0) if window else (-1, -1))
        return out.transpose(1, 2)
    if backend == "bmm":
        return attend_bmm(q, k, v, window)
    if backend == "flex":
        return attend_flex(q, k, v, window)
    if backend == "sdpa" and window is None and Tq in (Tk, 1):  # the causal rule needs no mask
        return sdpa(q, k, v, is_causal=bool(Tq == Tk))  # a bool also where the lengths are symbolic (torch.export)
    return attend_within(q, k, v, attention_mask(Tq, Tk, window, q.device), backend, window, softcap, sinks)


def attend_within(q, k, v, mask: torch.Tensor, backend: str = "auto", window: Optional[int] = None,
                  softcap: Optional[float] = None, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Attention within a boolean mask (B or 1, Tq, Tk) or (Tq, Tk), True = attend, that holds every rule: 'math'
    (attend_math; soft-capped scores, sinks), 'bmm' (skipping the keys before `window`), else SDPA."""
    backend = resolve_backend(backend, q.device, q.dtype, k.shape[2], softcap=softcap, sinks=sinks)
    if backend == "bmm":
        return attend_bmm(q, k, v, window, mask=mask)
    mask = mask[:, None] if mask.dim() == 3 else mask  # (B, 1, Tq, Tk), or one (Tq, Tk) for every row
    return attend_math(q, k, v, mask, softcap, sinks) if backend == "math" else sdpa(q, k, v, attn_mask=mask)


def attend_flex(q, k, v, window: Optional[int] = None, runs: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Causal (and windowed) attention through torch's FlexAttention with a block mask, which skips
    blocks no query of a tile sees; with `runs` (B, Tq), a query sees only keys of its own run.
    Fused under torch.compile; no backward on a CPU."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    B, H, Tq, D = q.shape
    KV, Tk = k.shape[1], k.shape[2]
    if q.device.type == "cpu" and torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
        raise RuntimeError("attention backend 'flex' has no backward on a CPU (torch's FlexAttention); "
                           "use 'auto', 'bmm' or 'sdpa' to train there")
    off = Tk - Tq  # query i sits at position off + i

    def visible(b, h, i, j):
        m = j <= i + off
        if window is not None:
            m = m & (i + off - j < window)
        if runs is not None:
            m = m & (runs[b, i] == runs[b, j])
        return m

    block_mask = create_block_mask(visible, B if runs is not None else None, None, Tq, Tk, device=q.device)
    return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=KV != H)


class Causal:
    """The causal rule alone (with the layer's window): CausalSelfAttention's `mask=None`. Every mask narrows it
    with the same three methods: `attend(q, k, v, backend, window, softcap, sinks)` picks the kernel; `cached(cache,
    start)`, the mask over what a cache holds after a write at `start`; `prefixed(n)`, with n learned keys in front."""
    attend = staticmethod(attend)

    def cached(self, cache, start) -> "Causal":
        return Step(start) if isinstance(start, torch.Tensor) else self

    def prefixed(self, n: int) -> "Causal":
        return self  # keys in front of the queries are seen by every query

    def keys(self, k, v, cache: Optional[KVCache] = None, start=0, prefix=None):
        """k, v (B, KV, T, D) at positions [start, start + T) -> (k, v, mask): the keys and values attended (the
        cache's, a learned prefix's in front: prefix.py) and the mask over them."""
        mask = self
        if cache is not None:
            k, v = cache.update(k, v, start)
            mask = self.cached(cache, start)
        if prefix is not None:
            n = k.shape[2]
            k, v = prefix(k, v)
            mask = mask.prefixed(k.shape[2] - n)
        return k, v, mask


class Step(Causal):
    """A decoding step of fixed shapes (CUDA graphs): the query at position `start` (a tensor) over every cache
    slot, those past it masked (and, as `held` (B, Tk) says, those a padded row does not hold)."""

    def __init__(self, start: torch.Tensor, held=True):
        self.start, self.held = start, held

    def attend(self, q, k, v, backend="auto", window=None, softcap=None, sinks=None) -> torch.Tensor:
        j = torch.arange(k.shape[2], device=k.device)[None]
        seen = (j <= self.start) & self.held  # (B or 1, Tk)
        if window is not None:
            seen = seen & (self.start - j < window)
        return attend_within(q, k, v, seen[:, None], backend, None, softcap, sinks)

    def prefixed(self, n: int):
        raise ValueError("a decoding step of fixed shapes takes no learned prefix")


CAUSAL = Causal()


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: Optional[int] = None, head_dim: Optional[int] = None,
                 qkv_bias: bool = False, backend: str = "auto", sliding_window: Optional[int] = None,
                 qk_norm=False, norm_eps: float = 1e-6, rope: bool = True, scale: Optional[float] = None,
                 softcap: Optional[float] = None, sinks: bool = False, out_bias: bool = False, gate: bool = False,
                 kv: bool = True, kv_same: bool = False, v_norm: bool = False):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads or n_heads, head_dim or dim // n_heads
        if n_heads % self.n_kv_heads:
            raise ValueError(f"n_kv_heads={self.n_kv_heads} must divide n_heads={n_heads}")
        self.backend, self.sliding_window = check_backend(backend), sliding_window
        self.rope, self.softcap = rope, softcap
        self.q_scale = None if scale is None else scale * math.sqrt(self.head_dim)  # on q: every backend's 1/sqrt(D)
        self.gate, self.kv, self.kv_same, self.v_norm, self.eps = gate, kv, kv_same, v_norm, norm_eps
        self.qkv = nn.Linear(dim, ((1 + gate) * n_heads + self.k_rows + self.v_rows) * self.head_dim, bias=qkv_bias)
        self.proj = nn.Linear(n_heads * self.head_dim, dim, bias=out_bias)
        self.qk_norm = "head" if qk_norm is True else qk_norm or None
        if self.qk_norm not in (None, "head", "proj"):
            raise ValueError(f"qk_norm={qk_norm!r} must be False, True / 'head' or 'proj'")
        per_proj = self.qk_norm == "proj"
        self.q_norm = RMSNorm(self.head_dim * (n_heads if per_proj else 1), norm_eps) if self.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim * (self.n_kv_heads if per_proj else 1), norm_eps) \
            if self.qk_norm and kv else None
        self.sinks = nn.Parameter(torch.zeros(n_heads)) if sinks else None
        self.prefix = None  # prefix tuning: a module (k, v) -> (k, v) with learned keys/values in front (prefix.py)

    @property
    def k_rows(self) -> int:
        """Heads of k this layer projects (0: KV sharing); of n_kv_heads, which tensor parallelism sets per rank."""
        return self.kv * self.n_kv_heads

    @property
    def v_rows(self) -> int:
        return self.kv * (not self.kv_same) * self.n_kv_heads

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: Optional[KVCache] = None, start_pos: int = 0, mask: Optional[Causal] = None,
                ve: Optional[torch.Tensor] = None, shared: Optional[dict] = None) -> torch.Tensor:
        """x (B, T, dim) at positions [start_pos, start_pos + T); cos, sin (T, D), or (B, T, D) for
        rows at positions of their own; mask: a narrower rule than causal (see the module's docstring);
        ve (B, T, n_kv_heads * head_dim): added to the values (value embeddings). shared: a dict the layers of one
        forward share, keyed by window: a layer keeps its keys, values and mask there, one built with kv=False (no k/v
        rows) attends to those of the last layer of its window (KV sharing); kv_same: the values are the keys'
        projection; v_norm: the values RMS-normalised without a gain."""
        B, T, _ = x.shape
        H, KV, D = self.n_heads, self.n_kv_heads, self.head_dim
        qk, v = self.qkv(x).view(B, T, -1, D).split([(1 + self.gate) * H + self.k_rows, self.v_rows], dim=2)
        v = qk[:, :, -KV:] if self.kv_same else v
        if self.gate:
            (q, gate), k = qk[:, :, :2 * H].unflatten(2, (H, 2)).unbind(3), qk[:, :, 2 * H:]
            qk = torch.cat([q, k], 2)
        v = v if ve is None else v + ve.view_as(v)
        v = F.rms_norm(v, (D,), None, self.eps) if self.v_norm else v
        q, k = self.rotate(self.norm_qk(qk), cos, sin)  # (B, H, T, D), (B, KV, T, D)
        if self.k_rows:
            k, v, mask = (mask or CAUSAL).keys(k, v.transpose(1, 2), cache, start_pos, self.prefix)
            if shared is not None:
                shared[self.sliding_window] = k, v, mask
        else:
            k, v, mask = shared[self.sliding_window]
        y = mask.attend(q, k, v, self.backend, self.sliding_window, self.softcap, self.sinks).transpose(1, 2)
        return self.proj((y if not self.gate else y * gate.sigmoid()).reshape(B, T, H * D))

    def norm_qk(self, qk: torch.Tensor) -> torch.Tensor:
        """qk (B, T, H + KV, D) with q and k RMS-normalised (`qk_norm`)."""
        H, KV, D = self.n_heads, self.k_rows, self.head_dim
        if self.qk_norm == "head":  # one RMSNorm over every q and k head, then each side's weight
            w = torch.cat([self.q_norm.weight.expand(H, D)] + ([self.k_norm.weight.expand(KV, D)] if KV else [])
                          ).to(qk.dtype)
            return F.rms_norm(qk, (D,), None, self.q_norm.eps) * w
        if self.qk_norm == "proj":
            q, k = qk.flatten(2).split([H * D, KV * D], dim=2)
            return torch.cat([self.q_norm(q), self.k_norm(k)], dim=2).view_as(qk)
        return qk

    def rotate(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """RoPE on qk (B, T, H + KV, D), q and k heads in one go (a narrower table: their first channels only)
        -> q (B, H, T, D), scaled by `scale`, and k (B, KV, T, D)."""
        if self.rope:
            r = cos.shape[-1]
            rot = apply_rope(qk[..., :r], cos.unsqueeze(-2), sin.unsqueeze(-2))
            qk = rot if r == qk.shape[-1] else torch.cat([rot, qk[..., r:]], dim=-1)
        q, k = qk.transpose(1, 2).split([self.n_heads, self.k_rows], dim=1)
        return (q if self.q_scale is None else q * self.q_scale), k


def set_backend(model: nn.Module, backend: str) -> int:
    """Set the attention backend (BACKENDS) of every CausalSelfAttention in `model`; returns how many."""
    check_backend(backend)
    mods = [m for m in model.modules() if isinstance(m, CausalSelfAttention)]
    for m in mods:
        m.backend = backend
    return len(mods)
