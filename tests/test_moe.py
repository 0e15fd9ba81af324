"""Mixture-of-Experts: the block (zoo/blocks/moe.py) against plain per-token references, its
dispatch paths, capacity, balancing; MoE LLMs in training (loss, metrics, bias balancing,
resume, compile), generation and accounting. fp32 tolerance 1e-5 for the block, 1e-4 for the
model (as tests/test_llm.py)."""
import copy
import json
import math
import shutil

import pytest
import torch
import torch.nn.functional as F
from conftest import CPU, assert_compiled_step_equals_eager, aux_loss
from safetensors.torch import load_file

import zoo
from zoo.blocks.checkpoint import checkpoint_units
from zoo.blocks.moe import MoE, grouped_mm_supported
from zoo.config import ConfigError, LLMConfig, from_dict
from train.metrics import read_rows

TOL = 1e-5
MODEL_TOL = 1e-4


def block(seed=0, **kw):
    torch.manual_seed(seed)
    args = dict(dim=16, hidden=24, n_experts=6, top_k=2)
    args.update(kw)
    m = MoE(**args)
    with torch.no_grad():  # router logits of O(1): distinct choices, weights far from uniform
        m.router.weight.normal_(0, 0.5)
        if m.score_bias is not None:
            m.score_bias.copy_(torch.linspace(-0.3, 0.3, m.n_experts))
        for name, p in m.named_parameters():  # router_norm's scales, branch_norms' gains: not their init of ones
            if name.endswith(("_scale", "norm.weight")):
                p.uniform_(0.75, 1.25)
    return m


def tokens(n=40, dim=16, seed=1):
    return torch.randn(n, dim, generator=torch.Generator().manual_seed(seed))


def reference(m: MoE, x: torch.Tensor) -> torch.Tensor:
    """The block's function token by token, written from its definition with plain ops."""
    out = []
    act = F.silu if m.act == "silu" else lambda g: F.gelu(g, approximate="tanh")
    for xn in x:
        xr = xn if m.router_scale is None else xn / (xn.square().mean() + m.eps).sqrt() * m.router_scale / m.dim ** 0.5
        logits = m.router.weight @ xr
        scores = logits.softmax(-1) if m.scoring == "softmax" else logits.sigmoid()
        choice = scores + (m.score_bias if m.score_bias is not None else 0)
        picked = sorted(range(m.n_experts), key=lambda e: -choice[e].item())[:m.top_k]
        w = torch.stack([scores[e] for e in picked])
        if m.norm_topk_prob:
            w = w / w.sum()
        if m.expert_scale is not None:
            w = w * m.expert_scale[picked]
        y, xe = 0, m.routed_norm(xn)
        for wj, e in zip(w, picked):
            gate, up = (m.gate_up[e] @ xe).chunk(2)
            y = y + wj * (m.down[e] @ (act(gate) * up))
        y = m.routed_post_norm(y)
        if m.shared is not None:
            s = m.shared_post_norm(m.shared(m.shared_norm(xn)))
            y = y + (torch.sigmoid(m.shared_gate(xn)) * s if m.shared_gate is not None else s)
        out.append(y)
    return torch.stack(out)


def grads(m, x, y):
    w = torch.randn(y.shape, generator=torch.Generator().manual_seed(7))  # a loss whose gradient is dense
    return torch.autograd.grad((y * w).sum(), [x] + [p for p in m.parameters()], allow_unused=True)


CASES = {
    "softmax-renormalised": {},
    "softmax-raw-top3": dict(top_k=3, norm_topk_prob=False),
    "sigmoid": dict(scoring="sigmoid"),
    "shared-gated": dict(n_shared=2, shared_hidden=8, shared_gate=True),
    "bias-balancing": dict(bias_balancing=True),
    "top1": dict(top_k=1),
    "router-norm-branch-norms-geglu": dict(n_shared=1, shared_hidden=20, router_norm=True, branch_norms=True,
                                           act="gelu_tanh"),  # Gemma 4
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dispatch", ["grouped", "loop"])
def test_block_equals_per_token_reference(case, dispatch):
    m = block(**CASES[case], dispatch=dispatch)
    x = tokens().requires_grad_()
    y, stats = m(x)
    ref = reference(m, x)
    assert (y - ref).abs().max() <= TOL
    for g, r in zip(grads(m, x, y), grads(m, x, ref)):
        if g is None:
            assert r is None
            continue
        assert (g - r).abs().max() <= TOL * max(1.0, r.abs().max())  # relative to gradients summed over the tokens
    assert stats["load"].sum() == x.shape[0] * m.top_k and stats["dropped"] == 0


def test_block_keeps_batch_shape():
    m = block()
    x = torch.randn(2, 5, 16)
    y, _ = m(x)
    assert y.shape == x.shape and (y.view(10, 16) - m(x.view(10, 16))[0]).abs().max() <= TOL


@pytest.mark.parametrize("capacity", [None, 0.6])
def test_grouped_and_loop_dispatch_equal(capacity):
    grouped = block(dispatch="grouped", capacity_factor=capacity)
    loop = copy.deepcopy(grouped)
    loop.dispatch = "loop"
    x = tokens(n=64).requires_grad_()
    yg, sg = grouped(x)
    yl, sl = loop(x)
    assert (yg - yl).abs().max() <= TOL and sg["dropped"] == sl["dropped"]
    assert (sg["dropped"] > 0) == (capacity is not None)
    for a, b in zip(grads(grouped, x, yg), grads(loop, x, yl)):
        assert (a - b).abs().max() <= TOL


def test_every_routed_expert_gets_a_gradient():
    m = block(n_experts=8, top_k=1)
    with torch.no_grad():
        m.router.weight[5:] = -10 * m.router.weight[5:].abs().sum(1, keepdim=True)  # never chosen...
    x = tokens(n=200).abs()                                                      # ...for positive inputs
    y, stats = m(x)
    F.mse_loss(y, torch.randn_like(y)).backward()
    load = stats["load"]
    assert (load[:5] > 0).all() and (load[5:] == 0).all()
    for e in range(8):
        for p in (m.gate_up, m.down):
            assert (p.grad[e].abs().sum() > 0) == (load[e] > 0), (e, load.tolist())


def test_load_balancing_loss_equals_transformers():
    import transformers.models.mixtral.modeling_mixtral as moe_utils
    for top_k, n_experts in ((2, 8), (1, 4), (3, 6)):
        m = block(n_experts=n_experts, top_k=top_k)
        x = tokens(n=50)
        _, stats = m(x)
        logits = m.router(x)
        ref = moe_utils.load_balancing_loss_func((logits,), n_experts, top_k)
        assert abs(stats["lb_loss"].item() - ref.item()) <= TOL
        ref_z = torch.logsumexp(logits, -1).pow(2).mean()  # ST-MoE, eq. 5
        assert abs(stats["z_loss"].item() - ref_z.item()) <= TOL
    # perfectly uniform routing gives top_k; everything on one expert gives top_k * E
    m = block(n_experts=4, top_k=1)
    with torch.no_grad():
        m.router.weight.zero_()
        m.router.weight[0] = 50.0
    _, stats = m(tokens(n=30).abs() + 0.1)
    assert abs(stats["lb_loss"].item() - 4.0) < 1e-3


def test_capacity_drops_exactly_the_overflow():
    """Capacity C = ceil(factor * N * k / E). Every expert keeps its first C choices, first
    choices before second ones, earlier tokens first; the rest are dropped and counted."""
    N, E, k, factor = 30, 4, 2, 0.75
    m = block(n_experts=E, top_k=k, capacity_factor=factor, dispatch="grouped")
    x = tokens(n=N)
    m.train()
    y, stats = m(x)
    cap = math.ceil(factor * N * k / E)
    # the reference: walk the choices in priority order and fill each expert up to cap
    logits = m.router(x)
    picked = logits.softmax(-1).topk(k, -1).indices
    taken = {e: 0 for e in range(E)}
    dropped = set()
    for j in range(k):
        for n in range(N):
            e = picked[n, j].item()
            if taken[e] < cap:
                taken[e] += 1
            else:
                dropped.add((n, j))
    counts = torch.bincount(picked.flatten(), minlength=E)
    assert len(dropped) > 0 and stats["dropped"].item() == len(dropped) == (counts - cap).clamp(min=0).sum()
    assert stats["load"].tolist() == counts.float().tolist()  # the load counts choices before the drops
    # the output is the dropless one without the dropped (token, expert) contributions
    m.capacity_factor = None
    with torch.no_grad():
        full, _ = m(x)
        w = logits.softmax(-1).gather(-1, picked)
        w = w / w.sum(-1, keepdim=True)
        for n, j in dropped:
            e = picked[n, j]
            gate, up = (m.gate_up[e] @ x[n]).chunk(2)
            full[n] -= w[n, j] * (m.down[e] @ (F.silu(gate) * up))
    assert (y - full).abs().max() <= TOL
    # in eval mode the capacity is not applied
    m.capacity_factor = factor
    m.eval()
    assert m(x)[1]["dropped"] == 0


def test_capacity_gradients_stay_finite_and_zero_for_dropped_rows():
    """The grouped matmuls leave the dropped rows undefined: no value of them may leak into
    the output or the gradients (the loop path computes them as zeros)."""
    g = block(n_experts=4, top_k=2, capacity_factor=0.3, dispatch="grouped")
    l = copy.deepcopy(g)
    l.dispatch = "loop"
    x = tokens(n=64).requires_grad_()
    for a, b in zip(grads(g, x, g(x)[0]), grads(l, x, l(x)[0])):
        assert torch.isfinite(a).all() and (a - b).abs().max() <= TOL


@pytest.mark.parametrize("scoring,rate,steps,bound", [("sigmoid", 0.01, 200, 1.2), ("softmax", 0.001, 600, 1.5)])
def test_bias_balancing_moves_load_toward_uniform(scoring, rate, steps, bound):
    """A skewed router (inputs leaning toward expert 0's row): DeepSeek-V3's bias step, applied
    to the observed load, evens it out; the weights stay the unbiased scores. (Softmax scores sum
    to 1, so they need smaller steps than sigmoid ones.)"""
    m = block(n_experts=8, top_k=2, bias_balancing=True, scoring=scoring)
    with torch.no_grad():
        m.score_bias.zero_()
        m.router.weight[0] += 0.5
    x = tokens(n=512) + 0.5
    ratio = lambda load: (load.max() / load.mean()).item()
    with torch.no_grad():
        start = m(x)[1]["load"]
        for _ in range(steps):
            m.update_bias(m(x)[1]["load"], rate)
        end = m(x)[1]["load"]
    assert ratio(start) > 3.0 and ratio(end) < bound, (start.tolist(), end.tolist())
    assert end.min() > 0.25 * end.mean()
    logits, weights, experts, _ = m.route(x)
    scores = logits.softmax(-1) if scoring == "softmax" else logits.sigmoid()
    scores = scores.gather(-1, experts)
    assert torch.allclose(weights, scores / scores.sum(-1, keepdim=True))


@pytest.mark.skipif(not hasattr(F, "grouped_mm"), reason="torch.nn.functional.grouped_mm needs torch >= 2.10")
def test_grouped_mm_support_table():
    cpu = CPU
    assert grouped_mm_supported(cpu, torch.float32) and grouped_mm_supported(cpu, torch.bfloat16)
    assert not grouped_mm_supported(cpu, torch.float32, compiling=True)
    assert grouped_mm_supported(cpu, torch.bfloat16, compiling=True)
    assert not grouped_mm_supported(torch.device("meta"), torch.bfloat16)


def test_jitter_matches_mixtral_in_training():
    """The block's jitter (train.moe_router_jitter) is Mixtral's router_jitter_noise: the same noise (same
    generator state) multiplies the input of the router and the experts, in training only."""
    import transformers.models.mixtral.modeling_mixtral as mixtral
    import transformers
    cfg = transformers.MixtralConfig(hidden_size=16, intermediate_size=24, num_local_experts=6,
                                     num_experts_per_tok=2, router_jitter_noise=0.3)
    cfg._experts_implementation = "eager"
    hf = mixtral.MixtralSparseMoeBlock(cfg)
    m = block(jitter=0.3)
    with torch.no_grad():
        hf.gate.weight.copy_(m.router.weight)
        hf.experts.gate_up_proj.copy_(m.gate_up)
        hf.experts.down_proj.copy_(m.down)
    x = tokens().view(4, 10, 16)
    for train in (True, False):
        hf.train(train)
        m.train(train)
        torch.manual_seed(3)
        ref = hf(x.clone())  # transformers scales its input in place
        torch.manual_seed(3)
        out, _ = m(x)
        assert (out - ref).abs().max() <= TOL
    torch.manual_seed(3)
    m.train()
    assert (m(x)[0] - m.eval()(x)[0]).abs().max() > 1e-3  # the noise is there in training


# ----------------------------------------------------------------------------------------
# MoE LLMs
# ----------------------------------------------------------------------------------------

def moe_llm(seed=0, moe=None, **kw):
    base = dict(vocab_size=97, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, max_seq_len=64,
                moe=dict(n_experts=4, top_k=2, expert_hidden=24, **(moe or {})))
    base.update(kw)
    torch.manual_seed(seed)
    return zoo.build(base)


def test_sparse_and_dense_layers():
    m = moe_llm(moe=dict(dense_layers=[0], sparse_every=1))
    assert [type(l.mlp).__name__ for l in m.layers] == ["SwiGLU", "MoE", "MoE"]
    m = moe_llm(moe=dict(sparse_every=2), n_layers=4)
    assert [type(l.mlp).__name__ for l in m.layers] == ["SwiGLU", "MoE", "SwiGLU", "MoE"]
    ids = torch.randint(0, 97, (2, 12))
    _, loss, aux = m(ids, ids, return_aux=True)
    assert aux["load"].shape == (2, 4) and aux["lb_loss"].shape == (2,)
    expected = 0.01 * aux["lb_loss"].mean() + 0.001 * aux["z_loss"].mean()
    assert abs(aux_loss(m, aux).item() - expected.item()) < 1e-7
    assert zoo.build(dict(vocab_size=97, d_model=32, n_layers=1, n_heads=4))(ids, ids, return_aux=True)[2] == {}


def test_active_parameters_and_flops():
    m = moe_llm(moe=dict(n_shared=1, shared_gate=True), tie_embeddings=False)
    cfg = m.config
    expert = 3 * 24 * 32
    assert m.num_params() - m.num_params(active=True) == 3 * (4 - 2) * expert
    n = m.num_params(active=True) - 97 * 32
    assert m.flops_per_token(16) == 6 * n + 12 * cfg.n_layers * cfg.d_model * 16


@pytest.mark.parametrize("moe", [{}, dict(n_shared=1, shared_gate=True, scoring="sigmoid")])
def test_generate_with_cache_equals_full_forward(moe):
    m = moe_llm(moe=moe).eval()
    ids = torch.randint(0, 97, (2, 5), generator=torch.Generator().manual_seed(2))
    out = m.generate(ids, 10)
    ref = ids
    with torch.no_grad():
        for _ in range(10):
            ref = torch.cat([ref, m(ref)[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, ref)


SHARED = {"gated": (dict(n_shared=1, shared_gate=True), {}),  # Qwen2-MoE's shared expert; Gemma 4's MLP beside
          "gemma4": (dict(n_shared=1, router_norm=True, branch_norms=True), {"mlp_act": "gelu_tanh"})}  # the experts


@pytest.mark.parametrize("shared", SHARED)
def test_compiled_training_step_equals_eager(shared):
    """torch.compile'd forward + backward (loss, aux losses) equals eager, every gradient."""
    moe, kw = SHARED[shared]
    model = moe_llm(moe=moe, n_layers=1, **kw)
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(1))
    assert_compiled_step_equals_eager(model, ids, MODEL_TOL)


def test_activation_checkpointing_same_gradients():
    model = moe_llm()
    for b in model.moe_blocks():
        b.jitter = 0.1
    ckpt = copy.deepcopy(model)
    checkpoint_units(ckpt.checkpoint_units(), True)
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(1))
    for m in (model, ckpt):
        torch.manual_seed(5)
        _, loss, aux = m(ids, ids, return_aux=True)
        (loss + aux_loss(m, aux)).backward()
    for (name, p), q in zip(model.named_parameters(), ckpt.parameters()):
        assert (p.grad - q.grad).abs().max() <= MODEL_TOL, name


@pytest.mark.parametrize("data,key", [
    ({"moe": {"n_experts": 4, "top_k": 5}}, "model.moe.top_k"),
    ({"moe": {"n_experts": 0}}, "model.moe.n_experts"),
    ({"moe": {"dense_layers": [7]}, "n_layers": 2}, "model.moe.dense_layers"),
    ({"moe": {"capacity_factor": 0}}, "model.moe.capacity_factor"),
    ({"moe": {"balance": "switch"}}, "model.moe.balance"),
    ({"moe": {"shared_gate": True}}, "model.moe.shared_gate"),
    ({"moe": {"branch_norms": True}}, "model.moe.branch_norms"),
    ({"moe": {"experts": 4}}, "model.moe.experts"),
])
def test_config_errors_name_the_key(data, key):
    with pytest.raises(ConfigError) as e:
        from_dict(LLMConfig, {"n_layers": 2, **data}, "run.yaml", "model.")
    assert "\n" not in str(e.value) and key in str(e.value) and "run.yaml" in str(e.value)


# ----------------------------------------------------------------------------------------
# training through the loop
# ----------------------------------------------------------------------------------------

def run(tmp_path, corpus, name, moe, **over):
    from train.config import load_run_config
    from train.loop import train
    base = {"family": "llm",
            "model": {"vocab_size": 256, "d_model": 32, "n_layers": 2, "n_heads": 4, "max_seq_len": 32,
                      "moe": {"n_experts": 4, "top_k": 2, "expert_hidden": 32, **moe}},
            "data": {"tokenizer": "bytes", "seq_len": 32, "path": str(corpus)},
            "train": {"max_steps": 6, "batch_size": 4, "log_every": 2, "eval_every": 0, "eval_batches": 2,
                      "checkpoint_every": 0, "progress": False, "samples": False, "plot": False,
                      "out_dir": str(tmp_path / name)},
            "optim": {"lr": 3e-3, "warmup_steps": 2}}
    lines = []
    cfg = load_run_config(None, [f"{k}={v}" for k, v in over.items()], base=base)
    train(cfg, log=lines.append)
    rows = read_rows(tmp_path / name)
    return rows, lines


@pytest.mark.parametrize("moe", [{}, SHARED["gemma4"][0]], ids=["plain", "gemma4"])
def test_training_logs_router_metrics(tmp_path, text_corpus, one_thread, moe):
    """The task adds the router losses (Gemma 4's router too) and logs the routing; the routers' scales train."""
    rows, lines = run(tmp_path, text_corpus, "aux", moe, **{"train.moe_capacity_factor": 0.5})
    row = [r for r in rows if "loss" in r][-1]
    for k in ("moe_aux_loss", "moe_lb_loss", "moe_z_loss", "moe_dropped", "lm_loss", "mfu"):
        assert math.isfinite(row[k]), k
    assert len(row["moe_load_max"]) == len(row["moe_load_min"]) == 2
    assert all(hi >= 1.0 >= lo >= 0.0 for hi, lo in zip(row["moe_load_max"], row["moe_load_min"]))
    assert 0.0 < row["moe_dropped"] < 1.0  # a capacity of half the choices drops some
    assert abs(row["loss"] - row["lm_loss"] - row["moe_aux_loss"]) < 1e-4  # the task added the aux losses
    assert sum("load max/min per layer" in l for l in lines) == 3  # steps 2, 4, 6
    scales = [v for k, v in load_file(tmp_path / "aux" / "model.safetensors").items() if k.endswith("_scale")]
    assert len(scales) == 4 * bool(moe) and all((v != 1).any() for v in scales)


def test_bias_balancing_through_the_loop_resumes_exactly(tmp_path, text_corpus, one_thread):
    over = {"model.moe.balance": "bias", "train.moe_bias_update_rate": 0.01, "train.checkpoint_every": 2,
            "train.keep_checkpoints": 5}
    full, _ = run(tmp_path, text_corpus, "full", {}, **over)
    weights = load_file(tmp_path / "full" / "model.safetensors")
    biases = [v for k, v in weights.items() if k.endswith("score_bias")]
    assert len(biases) == 2 and all(b.abs().sum() > 0 for b in biases)  # the bias moved
    for b in biases:  # whole steps of moe_bias_update_rate, at most one per optimizer step (after each of the 6)
        n = b / 0.01
        assert torch.allclose(n, n.round(), atol=1e-3) and n.abs().max() <= 6
    part = tmp_path / "part"
    shutil.copytree(tmp_path / "full", part)
    shutil.rmtree(part / "checkpoints" / "step_00000006")
    (part / "model.safetensors").unlink()
    resumed, _ = run(tmp_path, text_corpus, "part", {}, **over)
    loss = lambda rows: [(r["step"], r["loss"]) for r in rows if "loss" in r]
    assert loss(resumed) == loss(full)
    again = load_file(part / "model.safetensors")
    assert all(torch.equal(weights[k], again[k]) for k in weights)


def test_generate_compiled_equals_eager():
    """Compiled decoding at batch 1 (the experts as fused reductions) gives the eager greedy
    tokens in fp32; the compiled step holds no grouped_mm. (Larger batches compile the grouped
    matmuls, as in training: test_compiled_training_step_equals_eager.)"""
    import zoo.llm
    m = moe_llm(n_layers=1, moe=SHARED["gated"][0]).eval()
    with torch.no_grad():
        m.lm_head.weight.mul_(30)
    ids = torch.randint(0, 97, (1, 6), generator=torch.Generator().manual_seed(1))
    assert torch.equal(m.generate(ids, 10, compile=True), m.generate(ids, 10))
    with torch.no_grad():  # the step's logits, not only the argmax
        caches = [m.new_caches(1, 8) for _ in range(2)]
        for c in caches:
            m(ids, caches=c, start_pos=0)
        nxt = torch.tensor([[5]])
        out = zoo.llm.compiled_decode_step()(m, nxt, caches[0], 6)
        ref = zoo.llm.decode_step(m, nxt, caches[1], 6)
    assert (out - ref).abs().max() <= MODEL_TOL
    from conftest import traced_calls
    targets = traced_calls(zoo.llm.decode_step, m, torch.tensor([[1]]), m.new_caches(1, 8), 0)
    assert not any("grouped_mm" in str(t) for t in targets), targets
