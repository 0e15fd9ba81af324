"""Each block in zoo/blocks against a plain reference (fp32 tolerance 1e-4 unless stated)."""
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from zoo.blocks.attention import CausalSelfAttention, KVCache, attend, attention_mask
from zoo.blocks.chunked_ce import chunked_cross_entropy
from zoo.blocks.mlp import SwiGLU
from zoo.blocks.norm import RMSNorm
from zoo.blocks.rope import RotaryEmbedding, apply_rope, rope_cos_sin, rope_inv_freq
from conftest import CPU

TOL = 1e-4


# ---------------------------------------------------------------------------- RMSNorm / SwiGLU

def test_rmsnorm_formula():
    torch.manual_seed(0)
    norm = RMSNorm(48, eps=1e-5)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(3, 7, 48) * 3
    ref = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5) * norm.weight
    assert (norm(x) - ref).abs().max() <= TOL
    # the gradient flows to both input and weight like the formula's
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    norm(x1).square().sum().backward()
    w_grad = norm.weight.grad.clone()
    norm.weight.grad = None
    (x2 / torch.sqrt((x2 * x2).mean(-1, keepdim=True) + 1e-5) * norm.weight).square().sum().backward()
    assert (x1.grad - x2.grad).abs().max() <= TOL
    assert (w_grad - norm.weight.grad).abs().max() <= 1e-3 * w_grad.abs().max()


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_low_precision_keeps_dtype_and_value(weight_dtype):
    """bf16 input (a bf16 model, or an fp32 norm weight under autocast) -> bf16 output whose
    statistics were taken in fp32: no overflow for large activations."""
    torch.manual_seed(0)
    norm = RMSNorm(64).to(weight_dtype)
    x = torch.randn(4, 64, dtype=torch.bfloat16) * 1e4
    y = norm(x)
    assert y.dtype == torch.bfloat16
    xf = x.float()
    ref = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert (y.float() - ref).abs().max() <= 2e-2  # bf16 rounding of values ~|3|


def test_swiglu_formula():
    torch.manual_seed(0)
    mlp = SwiGLU(32, 80)
    x = torch.randn(2, 5, 32)
    w_gate, w_up = mlp.gate_up.weight[:80], mlp.gate_up.weight[80:]
    ref = (F.silu(x @ w_gate.t()) * (x @ w_up.t())) @ mlp.down.weight.t()
    assert (mlp(x) - ref).abs().max() <= TOL


# ---------------------------------------------------------------------------- RoPE

def test_rope_relative_position():
    """<rope(q, m), rope(k, n)> depends only on m - n."""
    torch.manual_seed(0)
    D = 32
    q, k = torch.randn(D, dtype=torch.float64), torch.randn(D, dtype=torch.float64)
    inv = rope_inv_freq(D, 10000.0).double()
    pos = torch.arange(64)
    cos, sin = rope_cos_sin(inv, pos)
    rq = apply_rope(q.expand(1, 1, 64, D), cos.double(), sin.double())[0, 0]  # (T, D): q at every position
    rk = apply_rope(k.expand(1, 1, 64, D), cos.double(), sin.double())[0, 0]
    dots = rq @ rk.t()  # dots[m, n]
    for delta in (0, 1, 5, 17, -3):
        diag = torch.diagonal(dots, offset=-delta)  # entries with m - n = delta
        assert (diag - diag[0]).abs().max() <= 1e-5, delta  # the cos/sin tables are fp32
    # and it is not a constant: the dot product does change with the offset
    assert (dots[10, 10] - dots[10, 3]).abs() > 1e-3
    # rotation keeps the norm
    assert torch.allclose(rq.norm(dim=-1), q.norm().expand(64), atol=1e-5)


@pytest.mark.parametrize("compiled", [False, True])
def test_rope_matches_complex_rotation(compiled):
    """Rotate-half layout: channel pair (i, i + D/2) is rotated by angle pos * inv_freq[i].
    Eagerly and under torch.compile (a different formulation), in the (B, H, T, D) layout and
    the (B, T, H, D) one with cos/sin (T, 1, D); the gradient is the inverse rotation."""
    torch.manual_seed(0)
    B, H, T, D = 2, 3, 9, 16
    x = torch.randn(B, H, T, D, requires_grad=True)
    inv = rope_inv_freq(D, 500.0)
    cos, sin = rope_cos_sin(inv, torch.arange(T))
    z = torch.complex(x[..., : D // 2], x[..., D // 2:]).detach()
    angle = torch.arange(T).float()[:, None] * inv[None, :]
    rz = z * torch.polar(torch.ones_like(angle), angle)
    ref = torch.cat([rz.real, rz.imag], dim=-1)
    rope = torch.compile(apply_rope, fullgraph=True) if compiled else apply_rope
    out = rope(x, cos, sin)
    assert (out - ref).abs().max() <= TOL
    assert (rope(x.detach().transpose(1, 2), cos[:, None], sin[:, None]).transpose(1, 2) - ref).abs().max() <= TOL
    g = torch.randn_like(out)
    out.backward(g)
    gz = torch.complex(g[..., : D // 2], g[..., D // 2:]) * torch.polar(torch.ones_like(angle), -angle)
    assert (x.grad - torch.cat([gz.real, gz.imag], dim=-1)).abs().max() <= TOL


def _llama3_reference(inv_freq, factor, low, high, old_len):
    """The Llama 3.1 rule written per frequency, from its description."""
    out = []
    for f in inv_freq.tolist():
        wavelen = 2 * math.pi / f
        if wavelen < old_len / high:
            out.append(f)
        elif wavelen > old_len / low:
            out.append(f / factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append((1 - smooth) * f / factor + smooth * f)
    return torch.tensor(out)


def test_rope_scaling_independent_formula():
    D, theta = 128, 500000.0
    plain = torch.tensor([theta ** (-2 * i / D) for i in range(D // 2)], dtype=torch.float32)
    assert (rope_inv_freq(D, theta) - plain).abs().max() <= 1e-6
    lin = rope_inv_freq(D, theta, {"type": "linear", "factor": 4.0})
    assert torch.allclose(lin, plain / 4, rtol=1e-5, atol=0)
    sc = {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
    got = rope_inv_freq(D, theta, sc)
    ref = _llama3_reference(plain, 8.0, 1.0, 4.0, 8192)
    assert torch.allclose(got, ref, rtol=1e-5, atol=0)
    # all three regimes are exercised: kept, divided by the factor, interpolated
    ratio = plain / got
    assert (ratio - 1).abs().min() < 1e-6 and (ratio - 8).abs().min() < 1e-4
    assert ((ratio > 1.01) & (ratio < 7.99)).any()


@pytest.mark.parametrize("kind", ["linear", "llama3"])
def test_rope_scaling_matches_transformers(kind):
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    D, theta = 64, 500000.0
    params = {"rope_type": kind, "rope_theta": theta, "factor": 8.0}
    ours = {"type": kind, "factor": 8.0}
    if kind == "llama3":
        extra = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        params.update(extra)
        ours.update(extra)
    cfg = transformers.LlamaConfig(hidden_size=4 * D, num_attention_heads=4, max_position_embeddings=131072,
                                   rope_parameters=params)
    ref, _ = ROPE_INIT_FUNCTIONS[kind](cfg)
    assert torch.allclose(rope_inv_freq(D, theta, ours), ref, rtol=1e-6, atol=0)


def test_rope_apply_matches_transformers():
    import transformers  # noqa: F401
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    torch.manual_seed(0)
    q, k = torch.randn(2, 4, 10, 32), torch.randn(2, 4, 10, 32)
    cos, sin = rope_cos_sin(rope_inv_freq(32, 10000.0), torch.arange(10))
    rq, rk = apply_rotary_pos_emb(q, k, cos[None], sin[None])
    assert (apply_rope(q, cos, sin) - rq).abs().max() <= TOL
    assert (apply_rope(k, cos, sin) - rk).abs().max() <= TOL


def test_rotary_embedding_cache_grows_and_offsets():
    rope = RotaryEmbedding(16, max_seq_len=8)
    cos, sin = rope(6, 10, torch.float32)  # past the initial table: it must grow
    ref_cos, ref_sin = rope_cos_sin(rope_inv_freq(16), torch.arange(6, 16))
    assert cos.shape == (10, 16)
    assert (cos - ref_cos).abs().max() <= 1e-5 and (sin - ref_sin).abs().max() <= 1e-5


# ---------------------------------------------------------------------------- attention

def _qkv(B=2, H=4, KV=2, Tq=7, Tk=7, D=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, Tq, D, generator=g), torch.randn(B, KV, Tk, D, generator=g),
            torch.randn(B, KV, Tk, D, generator=g))


def _naive_attention(q, k, v, window=None):
    """Loop-over-queries reference: query i (at position Tk - Tq + i) sees keys j <= its position
    and, with a window, j > position - window."""
    B, H, Tq, D = q.shape
    KV, Tk = k.shape[1], k.shape[2]
    out = torch.zeros_like(q)
    for h in range(H):
        kh, vh = k[:, h // (H // KV)], v[:, h // (H // KV)]
        for i in range(Tq):
            p = Tk - Tq + i
            lo = 0 if window is None else max(0, p - window + 1)
            s = (q[:, h, i:i + 1] @ kh[:, lo:p + 1].transpose(-1, -2)) / math.sqrt(D)
            out[:, h, i] = (s.softmax(-1) @ vh[:, lo:p + 1])[:, 0]
    return out


@pytest.mark.parametrize("H,KV,Tq,Tk,window", [
    (4, 4, 7, 7, None),    # MHA, causal
    (4, 2, 7, 7, None),    # GQA
    (4, 1, 7, 7, None),    # MQA
    (4, 2, 3, 10, None),   # a chunk of queries after a KV-cache prefix
    (4, 2, 1, 10, None),   # one decoding step
    (4, 2, 9, 9, 4),       # sliding window
    (4, 2, 3, 12, 5),      # sliding window with a cache offset
    (4, 2, 1, 12, 5),      # sliding window, one decoding step
    (4, 2, 11, 30, 6),     # sliding window shorter than the cache offset
    (6, 3, 300, 300, None),  # more queries than one block of the default size
    (6, 3, 300, 300, 100),   # the same with a window spanning blocks
])
def test_every_backend_equals_reference(H, KV, Tq, Tk, window, monkeypatch):
    """Every backend: 'math', 'sdpa' (torch's kernel), 'bmm' (the batched-matmul blocks) and
    'auto'."""
    import zoo.blocks.attention as A
    q, k, v = _qkv(H=H, KV=KV, Tq=Tq, Tk=Tk)
    ref = _naive_attention(q, k, v, window)
    assert (A.attend_bmm(q, k, v, window) - ref).abs().max() <= TOL
    for block in (1, 2, 4):  # queries in blocks that each see only the keys up to their last query
        assert (A.attend_bmm(q, k, v, window, block=block) - ref).abs().max() <= TOL, block
    for backend in ("math", "sdpa", "bmm", "auto"):
        assert (attend(q, k, v, backend, window) - ref).abs().max() <= TOL, backend


def test_each_backend_name_runs_exactly_its_implementation(monkeypatch):
    """'sdpa' calls torch's scaled_dot_product_attention at any length, 'bmm' never does; 'auto'
    picks sdpa on a CPU eagerly, bmm under torch.compile up to its limit, and says so through resolve_backend."""
    import zoo.blocks.attention as A
    calls = []
    real = A.F.scaled_dot_product_attention
    monkeypatch.setattr(A.F, "scaled_dot_product_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    q, k, v = _qkv(H=4, KV=2, Tq=8, Tk=8)
    attend(q, k, v, "sdpa")
    assert calls == [1]
    attend(q, k, v, "bmm")
    assert calls == [1]
    attend(q, k, v, "auto")  # eager on a CPU: sdpa
    assert calls == [1, 1]
    assert A.resolve_backend("auto", CPU, torch.float32, 8) == "sdpa"
    assert A.resolve_backend("auto", CPU, torch.float32, 8, compiling=True) == "bmm"
    assert A.resolve_backend("auto", CPU, torch.float32, A.CPU_BMM_MAX_LEN_COMPILED + 1, compiling=True) == "sdpa"
    assert A.resolve_backend("sdpa", CPU, torch.float32, 8) == "sdpa"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [16, 200])  # one block; blocks of 64, 64, 64 and 8 queries
def test_cpu_short_sequence_path_gradients_match_torch_sdpa(dtype, T, monkeypatch):
    """The batched-matmul path and torch's SDPA kernel: same outputs and input gradients
    (fp32: <= 1e-5; bf16 autocast-style inputs: within bf16 rounding of the scores)."""
    import zoo.blocks.attention as A
    q, k, v = (t.to(dtype) for t in _qkv(H=4, KV=2, Tq=T, Tk=T))
    go = torch.randn(q.shape, generator=torch.Generator().manual_seed(3)).to(dtype)
    outs = []
    for backend in ("bmm", "sdpa"):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = attend(*leaves, backend)
        out.backward(go)
        outs.append([out.float()] + [t.grad.float() for t in leaves])
    tol = 1e-5 if dtype == torch.float32 else 0.1
    for a, b in zip(*outs):
        assert (a - b).abs().max() <= tol


@pytest.mark.parametrize("H,KV,Tq,Tk,window", [
    (4, 2, 9, 9, None), (4, 1, 3, 12, None), (4, 2, 9, 9, 4), (4, 2, 11, 30, 6), (6, 3, 1, 12, 5)])
def test_batched_matmul_path_gradients_match_reference(H, KV, Tq, Tk, window):
    """The hand-written backward of `attend_bmm`'s blocks against autograd through the
    loop-over-queries reference: windows, grouped heads, a cache offset, several block sizes
    (fp32, <= 1e-5)."""
    import zoo.blocks.attention as A
    q, k, v = _qkv(H=H, KV=KV, Tq=Tq, Tk=Tk)
    go = torch.randn(q.shape, generator=torch.Generator().manual_seed(4))
    ref_leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    _naive_attention(*ref_leaves, window).backward(go)
    for block in (None, 1, 2, 4):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        A.attend_bmm(*leaves, window, block=block).backward(go)
        for name, a, b in zip("qkv", leaves, ref_leaves):
            assert (a.grad - b.grad).abs().max() <= 1e-5, (name, block)


def test_flash_backend_is_an_error_where_it_cannot_run():
    """'flash' means flash-attn and nothing else: on a CPU (or without flash-attn) it is an error
    naming what is missing, never a silent fallback; an LLM asking for it without flash-attn
    installed fails where the run applies it (train/builder.py) with a one-line config error."""
    import zoo.blocks.attention as A
    from train.config import TrainConfig
    from train.model import apply_runtime
    from zoo.config import ConfigError, LLMConfig
    from zoo.llm import LLM
    q, k, v = _qkv()
    with pytest.raises(RuntimeError, match="'flash' needs flash-attn"):
        attend(q, k, v, "flash")
    if A.flash_available() is None:
        with pytest.raises(ConfigError, match="attn_backend=flash needs flash-attn"):
            apply_runtime(LLM(LLMConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2)),
                          TrainConfig(attn_backend="flash"))


def test_block_finds_an_installed_flash_attn_on_first_use(tmp_path):
    """The block imports flash-attn itself, on first use (a stand-in package here, in a fresh
    process, with nothing of zoo imported but the block); None when it is absent or fails to import."""
    import os
    import subprocess
    import sys
    code = ("import zoo.blocks.attention as A; f = A.flash_available(); "
            "print(None if f is None else f.__module__)")
    repo = str(Path(__file__).resolve().parents[1])
    for i, (body, want) in enumerate((("def flash_attn_func(*a, **k):\n    pass\n", "flash_attn"),
                                      ("raise ImportError('built for another CUDA')\n", "None"),
                                      (None, "None"))):
        path = [repo]
        if body is not None:
            (tmp_path / str(i) / "flash_attn").mkdir(parents=True)
            (tmp_path / str(i) / "flash_attn" / "__init__.py").write_text(body)
            path.insert(0, str(tmp_path / str(i)))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
        assert out.stdout.strip() == want, (body, out.stdout, out.stderr[-500:])


def test_unknown_backend_is_an_error():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="unknown attention backend"):
        attend(q, k, v, "nope")


def test_attention_mask_shape_and_window():
    m = attention_mask(2, 5, 2, "cpu")
    assert m.tolist() == [[False, False, True, True, False], [False, False, False, True, True]]


def test_gqa_equals_mha_with_repeated_kv_heads():
    torch.manual_seed(0)
    dim, H, KV, D = 64, 8, 2, 8
    gqa = CausalSelfAttention(dim, H, KV, qkv_bias=True)
    mha = CausalSelfAttention(dim, H, H, qkv_bias=True)
    with torch.no_grad():
        wq, wk, wv = gqa.qkv.weight.split([H * D, KV * D, KV * D])
        bq, bk, bv = gqa.qkv.bias.split([H * D, KV * D, KV * D])
        rep = lambda t: t.view(KV, D, *t.shape[1:]).repeat_interleave(H // KV, dim=0).reshape(H * D, *t.shape[1:])
        mha.qkv.weight.copy_(torch.cat([wq, rep(wk), rep(wv)]))
        mha.qkv.bias.copy_(torch.cat([bq, rep(bk), rep(bv)]))
        mha.proj.weight.copy_(gqa.proj.weight)
    x = torch.randn(2, 11, dim)
    rope = RotaryEmbedding(D, 32)
    cos, sin = rope(0, 11, torch.float32)
    for backend in ("sdpa", "math"):
        gqa.backend = mha.backend = backend
        assert (gqa(x, cos, sin) - mha(x, cos, sin)).abs().max() <= TOL, backend


def test_attention_with_cache_equals_full_sequence():
    """Prefill then step-by-step decoding through the KV cache reproduces the full causal pass."""
    torch.manual_seed(0)
    dim, H, KV, T = 32, 4, 2, 10
    D = dim // H
    for window in (None, 4):
        attn = CausalSelfAttention(dim, H, KV, sliding_window=window)
        rope = RotaryEmbedding(D, 32)
        x = torch.randn(2, T, dim)
        full = attn(x, *rope(0, T, torch.float32))
        cache = KVCache(2, KV, T, D)
        parts = [attn(x[:, :6], *rope(0, 6, torch.float32), cache, 0)]
        for t in range(6, T):
            parts.append(attn(x[:, t:t + 1], *rope(t, 1, torch.float32), cache, t))
        assert (torch.cat(parts, 1) - full).abs().max() <= TOL, window


def test_kv_cache_overflow_is_an_error():
    cache = KVCache(1, 2, 4, 8)
    with pytest.raises(ValueError, match="KV cache holds 4 positions"):
        cache.update(torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3, 8), 2)


def test_attention_rejects_bad_heads():
    with pytest.raises(ValueError, match="n_kv_heads"):
        CausalSelfAttention(64, 8, 3)


# ---------------------------------------------------------------------------- chunked loss

@pytest.mark.parametrize("chunk,compiled", [(5, False), (16, False), (1000, False), (16, True)])
def test_chunked_ce_equals_cross_entropy(chunk, compiled):
    """Value and gradients (h and W) equal F.cross_entropy on the full logits, with ignored
    targets, and a chunk size that does not divide N; eagerly and under torch.compile (which
    takes the fusion-friendly formulation)."""
    torch.manual_seed(0)
    ce = torch.compile(chunked_cross_entropy) if compiled else chunked_cross_entropy
    N, D, V = 37, 16, 50
    h = torch.randn(N, D, dtype=torch.float64, requires_grad=True)
    w = torch.randn(V, D, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, V, (N,))
    t[::4] = -100
    h2, w2 = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    loss = ce(h, w, t, chunk_size=chunk)
    ref = F.cross_entropy(h2 @ w2.t(), t, ignore_index=-100)
    (loss * 3).backward()
    (ref * 3).backward()
    assert abs(loss.item() - ref.item()) <= 1e-10
    assert (h.grad - h2.grad).abs().max() <= 1e-10
    assert (w.grad - w2.grad).abs().max() <= 1e-10
    with torch.no_grad():  # the no-grad path (evaluation) gives the same value
        assert abs(ce(h, w, t, chunk_size=chunk).item() - ref.item()) <= 1e-10


def test_chunked_ce_fp32_and_bf16_autocast():
    torch.manual_seed(0)
    N, D, V = 40, 32, 100
    h = torch.randn(N, D, requires_grad=True)
    w = (torch.randn(V, D) * 0.2).requires_grad_()
    t = torch.randint(0, V, (N,))
    ref = F.cross_entropy(h @ w.t(), t)
    assert abs(chunked_cross_entropy(h, w, t, chunk_size=7).item() - ref.item()) <= TOL
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = chunked_cross_entropy(h, w, t, chunk_size=7)
    loss.backward()
    assert loss.dtype == torch.float32 and abs(loss.item() - ref.item()) <= 5e-2  # bf16 matmul
    assert h.grad.dtype == h.dtype and w.grad.dtype == w.dtype
    assert torch.isfinite(h.grad).all() and torch.isfinite(w.grad).all()


def test_chunked_ce_bad_shapes():
    with pytest.raises(ValueError, match=r"expected h \(N, D\)"):
        chunked_cross_entropy(torch.zeros(2, 3, 4), torch.zeros(5, 4), torch.zeros(6, dtype=torch.long))


def test_chunked_ce_all_targets_ignored():
    h = torch.randn(6, 4, requires_grad=True)
    w = torch.randn(9, 4, requires_grad=True)
    loss = chunked_cross_entropy(h, w, torch.full((6,), -100), chunk_size=4)
    loss.backward()
    assert loss.item() == 0.0 and (h.grad == 0).all() and (w.grad == 0).all()
