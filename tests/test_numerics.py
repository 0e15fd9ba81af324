"""The loop's numerics, each against an independent computation: LR schedules, weight-decay
groups, gradient accumulation and clipping (through the loop's own `optimizer_step`), the EMA,
the SGD step of the ImageNet presets, fp16 overflow handling, and EMA / precision on resume."""
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from train.config import OptimConfig, load_run_config
from train.loop import train
from train.metrics import read_rows
from train.step import EMA, optimizer_step
from train.optim import build_optimizer, lr_multiplier, param_groups
from zoo.config import ConfigError, ConvNetConfig, LLMConfig
from zoo.convnet import ResNet
from zoo.llm import LLM
from conftest import TEST_DEVICE

ROOT = Path(__file__).resolve().parents[1]
import transformers


# ------------------------------------------------------------------------------ LR schedules
def reference(schedule, step, n, warm, lo, decay_fraction=0.2):
    """The schedules written out: linear warmup to the peak over `warm` steps (step s, 0-based,
    gets (s + 1) / (warm + 1)), then over the remaining steps up to the last one (n - 1):
    constant 1; linear 1 -> lo; cosine 1 -> lo; WSD: 1 until the last decay_fraction of the run,
    then linear 1 -> lo."""
    if step < warm:
        return (step + 1) / (warm + 1)
    if schedule == "constant":
        return 1.0
    if schedule == "wsd":
        start = max(n - max(1, round(decay_fraction * n)), warm)
        if step < start:
            return 1.0
        return 1.0 - (1.0 - lo) * (step - start) / (n - 1 - start)
    t = (step - warm) / (n - 1 - warm)
    if schedule == "linear":
        return 1.0 - (1.0 - lo) * t
    return lo + (1.0 - lo) * (1.0 + math.cos(math.pi * t)) / 2


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant", "wsd"])
@pytest.mark.parametrize("n,warm,lo", [(50, 5, 0.1), (37, 0, 0.0), (200, 20, 0.05)])
def test_schedule_matches_its_formula(schedule, n, warm, lo):
    cfg = OptimConfig(schedule=schedule, warmup_steps=warm, min_lr_ratio=lo, decay_fraction=0.2)
    got = [lr_multiplier(s, n, cfg) for s in range(n)]
    want = [reference(schedule, s, n, warm, lo) for s in range(n)]
    assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-12
    if schedule != "constant":
        assert abs(got[-1] - lo) <= 1e-12  # the last step reaches the floor


def _hf_lambda(kind, **kw):
    """transformers' schedule as a function of the step, through a LambdaLR on a dummy optimizer."""
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    sched = getattr(transformers, kind)(opt, **kw)
    return sched.lr_lambdas[0]


@pytest.mark.parametrize("n,warm", [(50, 5), (120, 0), (64, 50)])
def test_schedules_match_transformers(n, warm):
    """Zoo's schedule at step s is transformers' at s + 1 with warm + 1 warmup steps: Zoo starts the
    warmup above 0 (its first step is not wasted) and reaches the floor at its last step."""
    W = warm + 1
    cases = {
        "cosine": ("get_cosine_with_min_lr_schedule_with_warmup",
                   dict(num_warmup_steps=W, num_training_steps=n, min_lr_rate=0.1), 0.1),
        "linear": ("get_linear_schedule_with_warmup", dict(num_warmup_steps=W, num_training_steps=n), 0.0),
        "constant": ("get_constant_schedule_with_warmup", dict(num_warmup_steps=W), 0.0),
    }
    for schedule, (kind, kw, lo) in cases.items():
        ref = _hf_lambda(kind, **kw)
        cfg = OptimConfig(schedule=schedule, warmup_steps=warm, min_lr_ratio=lo)
        diff = max(abs(lr_multiplier(s, n, cfg) - ref(s + 1)) for s in range(n))
        assert diff <= 1e-12, (schedule, diff)
    # WSD: transformers' warmup starts at min_lr_ratio; with a floor of 0 the two are the same schedule
    if warm < n - 10:
        decay = max(1, round(0.2 * n))
        start = max(n - decay, warm)
        ref = _hf_lambda("get_wsd_schedule", num_warmup_steps=W, num_stable_steps=start - W + 1,
                         num_decay_steps=n - 1 - start, decay_type="linear", min_lr_ratio=0.0)
        cfg = OptimConfig(schedule="wsd", warmup_steps=warm, min_lr_ratio=0.0)
        assert max(abs(lr_multiplier(s, n, cfg) - ref(s + 1)) for s in range(n)) <= 1e-12


def test_default_warmup_and_config_checks():
    assert OptimConfig().resolved_warmup_steps(1000) == 100
    assert OptimConfig().resolved_warmup_steps(40) == 4
    base = {"family": "llm", "data": {"tokenizer": "bytes"}}
    with pytest.raises(ConfigError, match=r"optim.warmup_steps=2000 must be < train.max_steps=1000"):
        load_run_config(None, ["optim.warmup_steps=2000"], base=base)
    with pytest.raises(ConfigError, match=r"runs into the decay of optim.schedule=wsd"):
        load_run_config(None, ["optim.schedule=wsd", "optim.warmup_steps=900"], base=base)
    with pytest.raises(ConfigError, match=r"train.init_from=/no/such/dir: no such file or folder"):
        load_run_config(None, ["train.init_from=/no/such/dir"], base=base)


# ------------------------------------------------------------------------------ weight decay
def tiny_llm(tied=True, bias=False, seed=0):
    torch.manual_seed(seed)
    return LLM(LLMConfig(vocab_size=64, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1, max_seq_len=32,
                         tie_embeddings=tied, qkv_bias=bias, ffn_hidden=24))


DECAYED = {
    "llm": r"layers\.\d+\.(attn\.qkv|attn\.proj|mlp\.gate_up|mlp\.down)\.weight|lm_head\.weight",
    "resnet": r"(conv1|layer\d\.\d+\.conv\d|layer\d\.\d+\.downsample\.0|fc)\.weight",
}


@pytest.mark.parametrize("kind", ["llm-tied", "llm-untied-bias", "resnet"])
def test_weight_decay_goes_to_matrices_only(kind):
    """Decayed: linear / conv weights (and an untied LM head). Not decayed: embeddings (a tied head
    is the embedding), norms, BatchNorm scales and shifts, biases. Checked by name, and by what one
    AdamW step from build_optimizer does to zero-gradient weights."""
    if kind == "resnet":
        model, pattern = ResNet(ConvNetConfig(arch="resnet18", layers=[1, 1, 1, 1], width=8, num_classes=5)), "resnet"
    else:
        model, pattern = tiny_llm(tied=kind == "llm-tied", bias="bias" in kind), "llm"
    names = {id(p): n for n, p in model.named_parameters()}
    groups = param_groups(model, 0.1)
    decayed = {names[id(p)] for g in groups if g["weight_decay"] > 0 for p in g["params"]}
    want = {n for n, _ in model.named_parameters() if re.fullmatch(DECAYED[pattern], n)}
    assert decayed == want and want
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))  # each once (tied too)
    opt = build_optimizer(model, OptimConfig(lr=0.5, weight_decay=0.1, fused=False), TEST_DEVICE, log=lambda m: None)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    for n, p in model.named_parameters():
        expect = before[n] * (1 - 0.5 * 0.1) if n in want else before[n]
        assert torch.allclose(p, expect, rtol=0, atol=1e-7), n


# ------------------------------------------------------------------------------ accumulation, clipping
class Spy(torch.optim.SGD):
    """Records the gradients the optimizer is given."""

    def step(self, closure=None):
        self.seen = [p.grad.detach().clone() for g in self.param_groups for p in g["params"]]
        return super().step(closure)


def lm_loss(model):
    def loss_fn(batch):
        x, y = batch
        return model(x, y)[1], y.numel()
    return loss_fn


def test_accumulated_gradients_equal_one_larger_batch():
    """k micro-batches of B sequences, each loss a mean, give the gradients of one k*B batch
    (fp32, <= 1e-6 relative), through the loop's optimizer_step."""
    g = torch.Generator().manual_seed(0)
    xy = torch.randint(0, 64, (8, 17), generator=g)
    x, y = xy[:, :-1], xy[:, 1:]
    seen = []
    for k in (1, 2, 4):
        model = tiny_llm()
        opt = Spy(model.parameters(), lr=0.0)
        scaler = torch.amp.GradScaler("cpu", enabled=False)
        batches = [(x[i:i + 8 // k], y[i:i + 8 // k]) for i in range(0, 8, 8 // k)]
        r = optimizer_step(lm_loss(model), batches, k, opt, scaler, list(model.parameters()), None)
        assert r.applied and r.items == 8 * 16
        seen.append(opt.seen)
        assert all(p.grad is None for p in model.parameters())  # freed after the step
    for other in seen[1:]:
        for a, b in zip(seen[0], other):
            assert (a - b).norm() <= 1e-6 * a.norm() + 1e-12


def test_clipping_scales_to_the_max_norm_like_clip_grad_norm():
    g = torch.Generator().manual_seed(1)
    xy = torch.randint(0, 64, (4, 17), generator=g)
    model = tiny_llm()
    params = list(model.parameters())
    loss, _ = lm_loss(model)((xy[:, :-1], xy[:, 1:]))
    raw = torch.autograd.grad(loss, params)
    norm = torch.sqrt(sum((t.double() ** 2).sum() for t in raw)).item()
    clip = norm / 7
    copies = [t.clone() for t in raw]
    ref_params = [torch.nn.Parameter(t.clone()) for t in params]
    for p, c in zip(ref_params, copies):
        p.grad = c
    torch.nn.utils.clip_grad_norm_(ref_params, clip)
    opt = Spy(params, lr=0.0)
    r = optimizer_step(lm_loss(model), [(xy[:, :-1], xy[:, 1:])], 1, opt, torch.amp.GradScaler("cpu", enabled=False),
                       params, clip)
    assert abs(r.grad_norm - norm) <= 1e-5 * norm  # the norm before clipping is what is logged
    for got, t, ref in zip(opt.seen, raw, ref_params):
        assert torch.allclose(got, t * (clip / (norm + 1e-6)), rtol=1e-5, atol=1e-9)  # the formula
        assert torch.allclose(got, ref.grad, rtol=1e-6, atol=1e-10)  # torch's own clip
    # under the max norm nothing changes
    opt = Spy(params, lr=0.0)
    optimizer_step(lm_loss(model), [(xy[:, :-1], xy[:, 1:])], 1, opt, torch.amp.GradScaler("cpu", enabled=False),
                   params, norm * 2)
    for got, t in zip(opt.seen, raw):
        assert torch.allclose(got, t, rtol=1e-6, atol=1e-10)


# ------------------------------------------------------------------------------ SGD (ImageNet presets)
def test_sgd_nesterov_steps_equal_torch_sgd_and_the_formula():
    """Two steps of the loop's SGD (momentum 0.9, Nesterov, decay 1e-4 on conv/fc weights only)
    against torch.optim.SGD built here with the same groups, and the update written out."""
    cfg = ConvNetConfig(arch="resnet18", layers=[1, 1, 1, 1], width=8, num_classes=5)
    torch.manual_seed(0)
    a, b = ResNet(cfg), ResNet(cfg)
    b.load_state_dict(a.state_dict())
    lr, mom, wd = 0.1, 0.9, 1e-4
    decayed = lambda n: re.fullmatch(DECAYED["resnet"], n) is not None  # noqa: E731
    opt_a = build_optimizer(a, OptimConfig(name="sgd", lr=lr, momentum=mom, nesterov=True, weight_decay=wd), TEST_DEVICE)
    opt_b = torch.optim.SGD([{"params": [p for n, p in b.named_parameters() if decayed(n)], "weight_decay": wd},
                             {"params": [p for n, p in b.named_parameters() if not decayed(n)], "weight_decay": 0.0}],
                            lr=lr, momentum=mom, nesterov=True)
    w = {n: p.detach().clone() for n, p in a.named_parameters()}
    buf = {}
    g = torch.Generator().manual_seed(0)
    for step in range(2):
        x, y = torch.randn(4, 3, 32, 32, generator=g), torch.randint(0, 5, (4,), generator=g)
        loss_b = torch.nn.functional.cross_entropy(b(x), y)
        loss_b.backward()
        grads = {n: p.grad.clone() for n, p in b.named_parameters()}
        opt_b.step()
        opt_b.zero_grad()
        optimizer_step(lambda batch: (torch.nn.functional.cross_entropy(a(batch[0]), batch[1]), 4), [(x, y)], 1,
                       opt_a, torch.amp.GradScaler("cpu", enabled=False), list(a.parameters()), None)
        # the update written out: d = g + wd * w (decayed weights only); buf = mom * buf + d
        # (= d at the first step); w -= lr * (d + mom * buf)
        for n in w:
            d = grads[n] + (wd * w[n] if decayed(n) else 0)
            buf[n] = d if step == 0 else mom * buf[n] + d
            w[n] = w[n] - lr * (d + mom * buf[n])
    for n, p in a.named_parameters():
        assert torch.allclose(p, dict(b.named_parameters())[n], rtol=0, atol=1e-6), n
        assert torch.allclose(p, w[n], rtol=0, atol=1e-6), n
    assert max((p - w0).abs().max().item() for p, w0 in zip(a.parameters(), b.parameters())) <= 1e-6


# ------------------------------------------------------------------------------ EMA
def test_ema_equals_swa_utils_averaged_model():
    """The loop's EMA against torch.optim.swa_utils.AveragedModel with an EMA averaging function,
    over a few SGD steps (AveragedModel's first update copies the weights: it is given the start)."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
    model = tiny_llm()
    decay = 0.9
    ema = EMA(model, decay)
    ref = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(decay))
    ref.update_parameters(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        xy = torch.randint(0, 64, (2, 9), generator=g)
        model(xy[:, :-1], xy[:, 1:])[1].backward()
        opt.step()
        opt.zero_grad()
        ema.update(model)
        ref.update_parameters(model)
    mine = dict(ema.model.named_parameters())
    moved = 0.0
    for n, p in ref.module.named_parameters():
        assert torch.allclose(mine[n], p, rtol=0, atol=1e-6), n
        moved = max(moved, (p - dict(model.named_parameters())[n]).abs().max().item())
    assert moved > 1e-3  # the average differs from the weights: a copy would fail


def test_ema_of_batchnorm_buffers_and_counters():
    """Float buffers (BatchNorm running statistics) are averaged like weights; integer counters
    (num_batches_tracked) are copied."""
    model = ResNet(ConvNetConfig(arch="resnet18", layers=[1, 1, 1, 1], width=8, num_classes=5))
    ema = EMA(model, 0.5)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    model.train()
    model(torch.randn(4, 3, 32, 32))
    ema.update(model)
    now = model.state_dict()
    for k, v in ema.model.state_dict().items():
        if v.is_floating_point():
            assert torch.allclose(v, 0.5 * start[k] + 0.5 * now[k], atol=1e-6), k
        else:
            assert torch.equal(v, now[k]), k
    assert not torch.equal(start["bn1.running_mean"], now["bn1.running_mean"])


# ------------------------------------------------------------------------------ fp16 overflow
def test_fp16_overflow_is_skipped_by_the_scaler_not_counted_as_a_failure():
    model = tiny_llm()
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    calls = {"n": 0}

    def poison(grad):  # the second step's gradients overflow
        calls["n"] += 1
        return grad * float("inf") if calls["n"] == 2 else grad

    model.norm.weight.register_hook(poison)
    xy = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    autocast = lambda: torch.autocast("cpu", dtype=torch.float16)  # noqa: E731
    r1 = optimizer_step(lm_loss(model), [(xy[:, :-1], xy[:, 1:])], 1, opt, scaler, params, 1.0, autocast)
    assert r1.applied and not r1.overflow and scaler.get_scale() == 2.0 ** 10
    before = [p.detach().clone() for p in params]
    r2 = optimizer_step(lm_loss(model), [(xy[:, :-1], xy[:, 1:])], 1, opt, scaler, params, 1.0, autocast)
    assert r2.overflow and r2.finite and not r2.applied  # not a failure
    assert all(torch.equal(a, b) for a, b in zip(before, params))  # the step was skipped
    assert scaler.get_scale() == 2.0 ** 9  # and the scale lowered
    r3 = optimizer_step(lm_loss(model), [(xy[:, :-1], xy[:, 1:])], 1, opt, scaler, params, 1.0, autocast)
    assert r3.applied and not all(torch.equal(a, b) for a, b in zip(before, params))


TINY = {
    "family": "llm",
    "model": {"vocab_size": 256, "d_model": 32, "n_layers": 2, "n_heads": 2, "n_kv_heads": 1, "max_seq_len": 32},
    "data": {"tokenizer": "bytes", "seq_len": 32},
    "train": {"max_steps": 6, "batch_size": 4, "log_every": 1, "eval_every": 0, "eval_batches": 2,
              "checkpoint_every": 0, "progress": False, "samples": False, "plot": False, "device": str(TEST_DEVICE)},
    "optim": {"lr": 3e-3, "warmup_steps": 1},
}


def test_fp16_run_logs_overflow_steps_and_the_loss_scale(tmp_path, text_corpus, monkeypatch, one_thread):
    """A whole fp16 run in which one step's gradients overflow: the run goes on, the step is logged
    as an overflow (with the lowered loss scale), and nothing counts it as a non-finite failure."""
    from train.tasks.lm import LMTask
    build = LMTask.build_model

    def build_with_overflow(self):
        model = build(self)
        calls = {"n": 0}

        def poison(grad):
            calls["n"] += 1
            return grad * float("inf") if calls["n"] == 3 else grad
        model.norm.weight.register_hook(poison)
        return model

    monkeypatch.setattr(LMTask, "build_model", build_with_overflow)
    cfg = load_run_config(None, [f"train.out_dir={tmp_path}", f"data.path={text_corpus}", "train.precision=fp16"],
                          base=TINY)
    train(cfg, log=lambda m: None)
    rows = read_rows(tmp_path)
    steps = [r for r in rows if "loss" in r]
    assert [r["overflow_steps"] for r in steps] == [0, 0, 1, 1, 1, 1]
    assert steps[2]["loss_scale"] == steps[1]["loss_scale"] / 2
    assert not any(r.get("nonfinite") or r.get("skipped_steps") for r in rows)


# ------------------------------------------------------------------------------ resume
def test_ema_switched_on_at_resume_starts_from_the_resumed_weights(tmp_path, text_corpus, one_thread):
    over = [f"train.out_dir={tmp_path}", f"data.path={text_corpus}"]
    train(load_run_config(None, over, base=TINY), log=lambda m: None)
    resumed = load_file(tmp_path / "checkpoints" / "step_00000006" / "model.safetensors")
    logs = []
    cfg = load_run_config(None, over + ["train.max_steps=7", "train.ema_decay=0.999999"], base=TINY)
    train(cfg, log=logs.append)
    assert any("starts it from the resumed weights" in m for m in logs), logs
    ema = load_file(tmp_path / "model_ema.safetensors")
    init = tiny_from_config(cfg)
    for k, v in ema.items():
        assert (v - resumed[k]).abs().max() <= 1e-4, k  # one update at decay ~1 from the resumed weights
    assert max((ema[k] - init[k]).abs().max().item() for k in ema) > 5e-3  # not the initial weights


def tiny_from_config(cfg):
    torch.manual_seed(cfg.train.seed)
    return LLM(cfg.model).state_dict()


# ------------------------------------------------------------------------------ cpu_keep_memory scope
def test_train_called_from_code_leaves_malloc_alone_unless_asked(tmp_path, text_corpus):
    """train() from a user's code: cpu_keep_memory null does not touch glibc; true applies it for the
    run and restores glibc's defaults when train() returns (a freed 64 MiB block is unmapped again)."""
    import platform
    if sys.platform != "linux" or platform.libc_ver()[0] != "glibc":
        pytest.skip("needs Linux with glibc")
    code = f"""
import json, torch
from train.config import load_run_config
from train.loop import train
def returned_by_free():
    rss = lambda: int(open('/proc/self/statm').read().split()[1]) * 4096
    x = torch.ones(64 * 2**20 // 4); before = rss(); del x
    return before - rss()
base = json.loads({json.dumps(json.dumps(TINY))})
base["train"]["max_steps"] = 2
logs = []
for keep in ("null", "true"):
    cfg = load_run_config(None, ["train.out_dir={tmp_path}/" + keep, "data.path={text_corpus}",
                                 "train.cpu_keep_memory=" + keep], base=base)
    train(cfg, log=logs.append)
    print(keep, returned_by_free(), any("freed memory kept" in m for m in logs))
"""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = dict((l.split()[0], l.split()[1:]) for l in out.stdout.strip().splitlines())
    assert lines["null"][1] == "False" and int(lines["null"][0]) >= 60 * 2**20
    assert lines["true"][1] == "True" and int(lines["true"][0]) >= 60 * 2**20
