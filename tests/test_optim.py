"""The optimizer registry, schedules, batch-size warmup, the LR range test, checkpoint averaging and
weight clipping: each optimizer against an independent reference (torch's own class where Zoo wraps
one, the update written out here where Zoo has its own), killed-and-resumed runs against
uninterrupted ones, schedules against values computed here or by torch."""
import json
import re

import pytest
import torch
import yaml
from safetensors.torch import load_file

from test_loop import TINY, check_resume_is_exact, run
from test_numerics import tiny_llm
from train.config import OptimConfig, load_run_config
from train.metrics import read_rows
from train.optim import (OPTIMIZERS, build_optimizer, hidden_matrices, lr_multiplier, micro_batches, param_groups,
                         set_lr, state_bytes)
from zoo.config import ConfigError
from conftest import TEST_DEVICE

QUIET = dict(log=lambda m: None)
HIDDEN = r"layers\.\d+\.(attn\.qkv|attn\.proj|mlp\.gate_up|mlp\.down)\.weight"


@pytest.fixture
def eager_torchao(monkeypatch):
    """torchao's 8-bit AdamW compiles its update once per tensor shape (a slow C++ compilation on a
    CPU): the tests run the same update eagerly."""
    import torchao  # noqa: F401
    monkeypatch.setattr(torch, "compile", lambda fn=None, **kw: fn)


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (4, 17), generator=g)
    return ids[:, :-1], ids[:, 1:]


def steps(model, opt, n=4):
    for i in range(n):
        x, y = batch(i)
        opt.zero_grad(set_to_none=True)
        model(x, y)[1].backward()
        opt.step()


def same(a, b, atol=0.0):
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.allclose(p, q, rtol=0, atol=atol), (n, (p - q).abs().max().item())


# ------------------------------------------------------------------------------ against references
def test_hidden_matrices_are_the_layers_2d_weights_not_embedding_or_head():
    for tied in (True, False):
        model = tiny_llm(tied=tied, bias=True)
        names = {n for n, p in model.named_parameters() if id(p) in hidden_matrices(model)}
        assert names == {n for n, _ in model.named_parameters() if re.fullmatch(HIDDEN, n)} and names


def test_adafactor_equals_torch_adafactor():
    a, b = tiny_llm(), tiny_llm()
    cfg = OptimConfig(name="adafactor", lr=0.01, weight_decay=0.1, adafactor_beta2_decay=-0.7)
    steps(a, build_optimizer(a, cfg, TEST_DEVICE, **QUIET))
    steps(b, torch.optim.Adafactor(param_groups(b, 0.1), lr=0.01, beta2_decay=-0.7))
    same(a, b)


@pytest.mark.parametrize("name,keys,ref", [
    ("adagrad", {}, lambda g: torch.optim.Adagrad(g, lr=0.02, eps=1e-7)),
    ("rmsprop", {"rmsprop_alpha": 0.9, "rmsprop_momentum": 0.5, "rmsprop_centered": True},
     lambda g: torch.optim.RMSprop(g, lr=0.02, alpha=0.9, eps=1e-7, momentum=0.5, centered=True))])
def test_adagrad_and_rmsprop_equal_torch_optim(name, keys, ref):
    """Four steps on the tiny LLM, torch's L2 weight decay on the matrices alone: weights within 1e-6."""
    a, b = tiny_llm(bias=True), tiny_llm(bias=True)
    steps(a, build_optimizer(a, OptimConfig(name=name, lr=0.02, eps=1e-7, weight_decay=0.1, **keys), TEST_DEVICE,
                             **QUIET))
    steps(b, ref(param_groups(b, 0.1)))
    same(a, b, atol=1e-6)
    assert not torch.equal(a.embed.weight, tiny_llm(bias=True).embed.weight)  # the steps moved the weights


def test_lion_equals_the_papers_update():
    a, b = tiny_llm(bias=True), tiny_llm(bias=True)
    lr, (b1, b2), wd = 1e-3, (0.9, 0.99), 0.1
    steps(a, build_optimizer(a, OptimConfig(name="lion", lr=lr, betas=(b1, b2), weight_decay=wd), TEST_DEVICE, **QUIET))
    decayed = {id(p) for g in param_groups(b, wd) if g["weight_decay"] for p in g["params"]}
    mom = {}
    for i in range(4):
        x, y = batch(i)
        b.zero_grad(set_to_none=True)
        b(x, y)[1].backward()
        with torch.no_grad():
            for p in {id(p): p for p in b.parameters()}.values():
                m = mom.get(id(p), torch.zeros_like(p))
                c = b1 * m + (1 - b1) * p.grad
                p.copy_(p * (1 - lr * (wd if id(p) in decayed else 0.0)) - lr * torch.sign(c))
                mom[id(p)] = b2 * m + (1 - b2) * p.grad
    same(a, b, atol=1e-6)


def test_muon_equals_torch_muon_on_the_hidden_matrices_and_adamw_on_the_rest():
    a, b = tiny_llm(tied=False, bias=True), tiny_llm(tied=False, bias=True)
    cfg = OptimConfig(name="muon", lr=3e-3, muon_lr=0.02, muon_momentum=0.9, weight_decay=0.1, fused=False)
    opt = build_optimizer(a, cfg, TEST_DEVICE, **QUIET)
    steps(a, opt)
    hidden = [p for n, p in b.named_parameters() if re.fullmatch(HIDDEN, n)]
    rest = [g for g in param_groups(b, 0.1) for g in [dict(g, params=[p for p in g["params"]
                                                                        if not any(p is h for h in hidden)])]]
    ref = [torch.optim.Muon(hidden, lr=0.02, weight_decay=0.1, momentum=0.9),
           torch.optim.AdamW(rest, lr=3e-3, betas=(0.9, 0.95), eps=1e-8)]
    for i in range(4):
        x, y = batch(i)
        b.zero_grad(set_to_none=True)
        b(x, y)[1].backward()
        for o in ref:
            o.step()
    same(a, b)
    set_lr(opt, 1.5e-3)  # the schedule scales Muon's LR and AdamW's alike
    assert sorted({g["lr"] for g in opt.param_groups}) == [1.5e-3, pytest.approx(0.01)]


def test_galore_equals_the_papers_update():
    a, b = tiny_llm(tied=False), tiny_llm(tied=False)
    lr, (b1, b2), eps, wd, rank, every, scale = 2e-3, (0.9, 0.95), 1e-8, 0.1, 3, 2, 0.5
    cfg = OptimConfig(name="galore", lr=lr, weight_decay=wd, galore_rank=rank, galore_update_every=every,
                      galore_scale=scale)
    steps(a, build_optimizer(a, cfg, TEST_DEVICE, **QUIET), n=5)
    decayed = {id(p) for g in param_groups(b, wd) if g["weight_decay"] for p in g["params"]}
    st = {}
    for t in range(1, 6):
        x, y = batch(t - 1)
        b.zero_grad(set_to_none=True)
        b(x, y)[1].backward()
        with torch.no_grad():
            for n, p in b.named_parameters():
                G = p.grad
                low = re.fullmatch(HIDDEN, n) is not None
                s = st.setdefault(n, {})
                if low:  # project on the smaller side: P^T G with P = U[:, :r], or G Q^T with Q = V^T[:r]
                    if (t - 1) % every == 0:
                        U, S, Vh = torch.linalg.svd(G, full_matrices=False)
                        s["P"] = U[:, :rank] if G.shape[0] < G.shape[1] else Vh[:rank]
                    R = s["P"].T @ G if G.shape[0] < G.shape[1] else G @ s["P"].T
                else:
                    R = G
                s["m"] = b1 * s.get("m", 0) + (1 - b1) * R
                s["v"] = b2 * s.get("v", 0) + (1 - b2) * R * R
                N = (s["m"] / (1 - b1 ** t)) / ((s["v"] / (1 - b2 ** t)).sqrt() + eps)
                if low:
                    N = scale * (s["P"] @ N if G.shape[0] < G.shape[1] else N @ s["P"])
                p.mul_(1 - lr * (wd if id(p) in decayed else 0.0)).sub_(lr * N)
    same(a, b, atol=1e-6)
    # the states of the projected weights are low-rank: r x max(m, n) instead of m x n
    opt = build_optimizer(a, cfg, TEST_DEVICE, **QUIET)
    steps(a, opt, n=1)
    for n, p in a.named_parameters():
        if re.fullmatch(HIDDEN, n):
            assert opt.state[p]["exp_avg"].numel() == rank * max(p.shape), n


def test_adamw8bit_within_its_quantisation_of_fp32_adamw(eager_torchao):
    """100 AdamW steps on a least-squares problem: 8-bit states (torchao) against fp32 states."""
    g = torch.Generator().manual_seed(0)
    X, Wt = torch.randn(256, 64, generator=g), 0.1 * torch.randn(64, 64, generator=g)  # 4096 entries: quantised
    Y = X @ Wt.T + 0.01 * torch.randn(256, 64, generator=g)
    cfg = OptimConfig(lr=1e-2, weight_decay=0.0, fused=False)
    out = {}
    for name in ("adamw", "adamw8bit"):
        torch.manual_seed(1)
        lin = torch.nn.Linear(64, 64, bias=False)
        w0 = lin.weight.detach().clone()
        opt = build_optimizer(lin, OptimConfig(**{**cfg.__dict__, "name": name}), TEST_DEVICE, **QUIET)
        for _ in range(100):
            loss = ((lin(X) - Y) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        out[name] = (lin.weight.detach().clone(), loss.item(), state_bytes(opt))
    (w32, l32, s32), (w8, l8, s8) = out["adamw"], out["adamw8bit"]
    l0 = ((X @ w0.T - Y) ** 2).mean().item()
    # the weights' paths differ by <2% of their length, the final losses by <1% of the loss drop
    assert (w8 - w32).norm() / (w32 - w0).norm() < 0.02
    assert abs(l8 - l32) / (l0 - l32) < 0.01
    assert s8 < 0.35 * s32  # 8-bit moments (+ a scale per 256 entries, the code books) against two fp32 ones


# ------------------------------------------------------------------------------ resume
@pytest.mark.parametrize("name, precision", [(n, "fp32") for n in OPTIMIZERS] + [("adamw", "bf16-pure")])
def test_killed_and_resumed_run_equals_an_uninterrupted_one(tmp_path, text_corpus, name, precision, one_thread,
                                                            request):
    if name == "adamw8bit" or precision == "bf16-pure":
        request.getfixturevalue("eager_torchao")
    over = {"train.checkpoint_every": 5, "train.keep_checkpoints": 3, "train.max_steps": 10, "optim.name": name,
            "optim.warmup_steps": 2, "optim.lr": {"sgd": 0.05, "lion": 3e-4, "adafactor": 1e-2}.get(name, 3e-3),
            "train.precision": precision}
    if name == "galore":
        over.update({"optim.galore_rank": 8, "optim.galore_update_every": 3})
    part, a = check_resume_is_exact(tmp_path, text_corpus, 10, **over)
    state = torch.load(part / "checkpoints" / "step_00000010" / "state.pt", weights_only=True)
    assert state["optimizer"]  # every state loads with weights_only=True
    # the run did move away from the resumed checkpoint's weights (a no-op optimizer would pass the above)
    c = load_file(part / "checkpoints" / "step_00000005" / "model.safetensors")
    assert any(not torch.equal(a[k], c[k]) for k in a)


@pytest.mark.parametrize("name,lr", [("adagrad", 1e-2), ("rmsprop", 1e-3)])
def test_adagrad_and_rmsprop_train_the_tiny_llm_through_run_py(tmp_path, text_corpus, name, lr, one_thread):
    from train.run import main as run_main
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump(TINY))
    assert run_main([str(cfg), f"train.out_dir={tmp_path / 'run'}", f"data.path={text_corpus}", f"optim.name={name}",
                     f"optim.lr={lr}", "train.max_steps=30", "train.export=false"]) == 0
    ls = [r["loss"] for r in read_rows(tmp_path / "run") if "loss" in r]
    assert len(ls) == 30 and sum(ls[-5:]) / 5 < sum(ls[:5]) / 5 - 1.0, ls


def test_bf16_pure_rounds_updates_stochastically_and_keeps_everything_in_bf16(tmp_path, text_corpus, eager_torchao,
                                                                            one_thread):
    """An update far under half a bf16 step: round-to-nearest (torch's AdamW) leaves the weights as they were,
    stochastic rounding moves them by the update on average (within 10% of it); then a bf16-pure run learns,
    its weights, gradients and AdamW moments all bf16."""
    torch.manual_seed(0)
    moved = {}
    for name, make in (("stochastic", lambda w: build_optimizer(w, OptimConfig(lr=1e-4, weight_decay=0.0), TEST_DEVICE,
                                                                **QUIET)),
                       ("nearest", lambda w: torch.optim.AdamW(w.parameters(), lr=1e-4, weight_decay=0.0))):
        w = torch.nn.Linear(1, 50_000, bias=False).to(torch.bfloat16)
        w.weight.data.fill_(1.0)
        w.weight.grad = torch.ones_like(w.weight)
        make(w).step()  # Adam's first step moves every weight by lr (the normalised gradient is 1)
        moved[name] = 1.0 - w.weight.float().mean().item()
    assert moved["nearest"] == 0.0 and moved["stochastic"] == pytest.approx(1e-4, rel=0.1), moved
    _, rows = run(tmp_path, text_corpus, **{"train.precision": "bf16-pure", "train.max_steps": 30,
                                            "train.checkpoint_every": 30})
    ls = [r["loss"] for r in rows if "loss" in r]
    assert sum(ls[-5:]) / 5 < sum(ls[:5]) / 5 - 0.5, ls
    state = torch.load(tmp_path / "run" / "checkpoints" / "step_00000030" / "state.pt", weights_only=True)
    moments = [v for s in state["optimizer"]["state"].values() for k, v in s.items() if k.startswith("exp_avg")]
    weights = load_file(tmp_path / "run" / "model.safetensors")
    assert moments and {m.dtype for m in moments} == {v.dtype for v in weights.values()} == {torch.bfloat16}


# ------------------------------------------------------------------------------ schedules
@pytest.mark.parametrize("n,warm,lo,div", [(100, 10, 0.1, 25.0), (57, 6, 0.04, 10.0), (30, 1, 0.2, 5.0)])
def test_onecycle_equals_torch_onecycle(n, warm, lo, div):
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)
    ref = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1.0, total_steps=n, pct_start=(warm + 1) / n,
                                              anneal_strategy="cos", cycle_momentum=False, div_factor=div,
                                              final_div_factor=1 / (lo * div), three_phase=False)
    cfg = OptimConfig(schedule="onecycle", warmup_steps=warm, min_lr_ratio=lo, onecycle_div=div)
    for s in range(n):
        assert lr_multiplier(s, n, cfg) == pytest.approx(opt.param_groups[0]["lr"], rel=1e-9, abs=1e-12), s
        opt.step()
        ref.step()


@pytest.mark.parametrize("schedule,keys,ref", [
    ("exponential", {"exponential_gamma": 0.93}, lambda o: torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.93)),
    ("step", {"step_every": 7, "step_gamma": 0.3}, lambda o: torch.optim.lr_scheduler.StepLR(o, 7, gamma=0.3))])
@pytest.mark.parametrize("n,warm", [(60, 10), (40, 0)])
def test_exponential_and_step_equal_torch_after_the_warmup(schedule, keys, ref, n, warm):
    """The warmup of every schedule ((step + 1) / (warm + 1)), then torch's scheduler stepped once per step (rel 1e-9)."""
    cfg = OptimConfig(schedule=schedule, warmup_steps=warm, **keys)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = ref(opt)
    for s in range(n):
        want = (s + 1) / (warm + 1) if s < warm else opt.param_groups[0]["lr"]
        assert lr_multiplier(s, n, cfg) == pytest.approx(want, rel=1e-9, abs=1e-15), s
        if s >= warm:
            opt.step()
            sched.step()
    assert lr_multiplier(n - 1, n, cfg) < 0.1  # it did decay


@pytest.mark.parametrize("n,warm", [(100, 10), (50, 0), (20, 3)])
def test_inverse_sqrt_is_warmup_then_one_over_sqrt_step(n, warm):
    cfg = OptimConfig(schedule="inverse_sqrt", warmup_steps=warm)
    for s in range(n):  # 1-based t = s + 1: t / (warm + 1) in the warmup, then sqrt(warm + 1) / sqrt(t)
        t = s + 1
        want = t / (warm + 1) if t <= warm else (warm + 1) ** 0.5 / t ** 0.5
        assert lr_multiplier(s, n, cfg) == pytest.approx(want, rel=1e-12), s


def test_batch_size_warmup_ramps_the_micro_batches(tmp_path, text_corpus, monkeypatch, one_thread):
    assert [micro_batches(s, 4, 6) for s in range(9)] == [1, 1, 2, 2, 3, 3, 4, 4, 4]
    assert [micro_batches(s, 3, 0) for s in range(3)] == [3, 3, 3]
    import train.loop as loop
    seen, real = [], loop.optimizer_step

    def spy(loss_fn, batches, n_micro, *a, **kw):
        batches = list(batches)
        seen.append((n_micro, len(batches)))
        return real(loss_fn, iter(batches), n_micro, *a, **kw)

    monkeypatch.setattr(loop, "optimizer_step", spy)
    run(tmp_path, text_corpus, **{"train.max_steps": 8, "train.grad_accum": 4, "train.batch_warmup_steps": 6,
                                  "train.batch_size": 2})
    assert seen == [(m, m) for m in (1, 1, 2, 2, 3, 3, 4, 4)]


# ------------------------------------------------------------------------------ averaging, clipping, LR finder
@pytest.mark.parametrize("weighting", ["uniform", "linear"])
def test_average_last_equals_an_average_of_the_saved_checkpoints(tmp_path, text_corpus, weighting, one_thread):
    final, rows = run(tmp_path, text_corpus, **{"train.max_steps": 12, "train.checkpoint_every": 3,
                                                "train.keep_checkpoints": 4, "train.average_last": 3,
                                                "train.average_weighting": weighting})
    out = tmp_path / "run"
    sds = [load_file(out / "checkpoints" / f"step_{s:08d}" / "model.safetensors") for s in (6, 9, 12)]
    w = [1, 1, 1] if weighting == "uniform" else [1, 2, 3]
    avg = load_file(out / "model_avg.safetensors")
    assert avg.keys() == sds[0].keys()
    for k in avg:
        want = sum(wi * sd[k].double() for wi, sd in zip(w, sds)) / sum(w)
        assert torch.allclose(avg[k].double(), want, rtol=0, atol=1e-6), k
    assert not torch.equal(avg["embed.weight"], sds[-1]["embed.weight"])
    assert "avg_val_loss" in final and "val_loss" in final and final["avg_val_loss"] != final["val_loss"]
    assert any("avg_val_loss" in r for r in rows)


@pytest.mark.parametrize("dcp_first", [True, False])
def test_tied_weights_average_across_one_process_and_dcp_checkpoints(tmp_path, dcp_first):
    """A run resumed with another process count averages a DCP checkpoint (a tie under both names)
    with a one-process one (the tie stored once), in either order."""
    import torch.distributed.checkpoint as dcp

    from train.features.averaging import average_last, tied_names
    from zoo.weights.files import save_safetensors
    old, new = tiny_llm(seed=0), tiny_llm(seed=1)
    (a, b), dirs = (old, new), [tmp_path / "a", tmp_path / "b"]
    for model, d, as_dcp in zip((a, b), dirs, (dcp_first, not dcp_first)):
        if as_dcp:
            dcp.save({"model": model.state_dict()}, storage_writer=dcp.FileSystemWriter(str(d)), no_dist=True)
        else:
            save_safetensors(model, d / "model.safetensors")
    avg = load_file(average_last(tmp_path, dirs, "uniform", tied_names(a)))
    want = {k: (v + b.state_dict()[k]) / 2 for k, v in a.state_dict().items()}
    assert len(avg) == len(want) - 1 and set(avg) < set(want)  # the tie once
    for k, v in avg.items():
        assert torch.allclose(v, want[k], rtol=0, atol=1e-7), k


def test_clip_weights_bounds_every_weight(tmp_path, text_corpus, one_thread):
    run(tmp_path, text_corpus, "free", **{"train.max_steps": 6})
    run(tmp_path, text_corpus, "clipped", **{"train.max_steps": 6, "train.clip_weights": 0.05})
    free, clipped = (load_file(tmp_path / n / "model.safetensors") for n in ("free", "clipped"))
    assert max(v.abs().max().item() for v in free.values()) > 0.05  # the bound does something here
    assert max(v.abs().max().item() for v in clipped.values()) == pytest.approx(0.05)


def test_lr_find_writes_its_plot_and_suggests_a_tenth_of_the_best_lr(tmp_path, text_corpus, one_thread):
    overrides = [f"train.out_dir={tmp_path / 'run'}", f"data.path={text_corpus}", "train.lr_find=true",
                 "train.lr_find_steps=40", "train.lr_find_min=1e-5", "train.lr_find_max=10", "train.plot=true"]
    from train.loop import train
    res = train(load_run_config(None, overrides, base=TINY), log=lambda m: None)
    out = tmp_path / "run"
    assert (out / "lr_find.png").is_file() and not (out / "checkpoints").exists()
    assert not (out / "model.safetensors").exists()
    saved = json.loads((out / "lr_find.json").read_text())
    lrs, ls = saved["lr"], saved["loss"]
    assert lrs[0] == pytest.approx(1e-5) and all(b > a for a, b in zip(lrs, lrs[1:]))
    assert lrs[1] / lrs[0] == pytest.approx(10 ** (6 / 39))
    sm, avg = [], 0.0
    for i, l in enumerate(ls):
        avg = 0.9 * avg + 0.1 * l
        sm.append(avg / (1 - 0.9 ** (i + 1)))
    assert res["suggested_lr"] == pytest.approx(lrs[sm.index(min(sm))] / 10)
    assert len(lrs) < 40  # the loss blew up at the top of the range and the test stopped


def test_optimizer_and_schedule_keys_are_checked():
    base = {**TINY, "data": {"tokenizer": "bytes", "seq_len": 64, "path": "x"}}
    for over, match in [(["optim.name=adam"], "optim.name"), (["optim.galore_rank=0"], "optim.galore_rank"),
                        (["optim.muon_lr=0"], "optim.muon_lr"), (["optim.schedule=noam"], "optim.schedule"),
                        (["optim.adafactor_beta2_decay=0.5"], "optim.adafactor_beta2_decay"),
                        (["optim.onecycle_div=0.5"], "optim.onecycle_div"),
                        (["optim.step_every=0"], "optim.step_every"), (["optim.step_gamma=0"], "optim.step_gamma"),
                        (["optim.exponential_gamma=1.5"], "optim.exponential_gamma"),
                        (["optim.rmsprop_alpha=1"], "optim.rmsprop_alpha"),
                        (["train.average_last=3", "train.keep_checkpoints=2"], "train.average_last=3 needs"),
                        (["train.batch_warmup_steps=5"], "train.batch_warmup_steps"),
                        (["train.grad_accum=2", "train.batch_warmup_steps=40"], "must be < train.max_steps"),
                        (["train.clip_weights=0"], "train.clip_weights"),
                        (["train.lr_find_min=2", "train.lr_find_max=1"], "train.lr_find_min")]:
        with pytest.raises(ConfigError, match=re.escape(match)):
            load_run_config(None, over, base=base)


def test_muon_on_a_torch_without_it_is_a_config_error(monkeypatch):
    """torch.optim.Muon came with torch 2.9 (Zoo installs with 2.5): optim.name=muon on an older torch is a one-line
    error naming the key, not an AttributeError mid-build."""
    monkeypatch.delattr(torch.optim, "Muon")
    base = {**TINY, "data": {"tokenizer": "bytes", "seq_len": 64, "path": "x"}}
    with pytest.raises(ConfigError, match=re.escape("optim.name=muon needs torch.optim.Muon (torch >= 2.9")):
        load_run_config(None, ["optim.name=muon"], base=base)


# ------------------------------------------------------------------------------ warmup as a fraction, longer runs
def test_warmup_fraction_scales_with_the_run_and_absolute_steps_win():
    """optim.warmup_fraction (the shipped configs' warmup) scales with train.max_steps, so the first
    override people type composes with them; an absolute optim.warmup_steps, when given, wins (and
    one as long as the run stays an error)."""
    tiny = "configs/llm/tiny.yaml"
    for steps, warm in ((400, 40), (40, 4), (20, 2), (5, 0)):
        cfg = load_run_config(tiny, [f"train.max_steps={steps}"])
        assert cfg.optim.resolved_warmup_steps(steps) == warm
    assert OptimConfig(warmup_fraction=0.29).resolved_warmup_steps(100) == 29  # not 28 (0.29 x 100 = 28.999...)
    assert OptimConfig(warmup_fraction=0.29, warmup_steps=3).resolved_warmup_steps(100) == 3
    assert load_run_config(tiny, ["train.max_steps=40", "optim.warmup_steps=3"]).optim.resolved_warmup_steps(40) == 3
    with pytest.raises(ConfigError, match=re.escape("optim.warmup_steps=40 must be < train.max_steps=40")):
        load_run_config(tiny, ["train.max_steps=40", "optim.warmup_steps=40"])
    with pytest.raises(ConfigError, match=re.escape("optim.warmup_fraction must be in [0, 1) or null, got 1.0")):
        load_run_config(tiny, ["optim.warmup_fraction=1.0"])
    with pytest.raises(ConfigError, match=re.escape("optim.warmup_fraction=0.9 (90 steps) runs into the decay")):
        load_run_config(tiny, ["train.max_steps=100", "optim.schedule=wsd", "optim.warmup_fraction=0.9"])


def test_resume_at_or_past_max_steps_says_nothing_is_left_to_train():
    """A checkpoint at step 5 resumed with train.max_steps=3 (or 5) trains no step: the log says so, and how to go
    on, instead of only 'resumed from step 5'."""
    from train.optim import resume_note
    cfg = OptimConfig(lr=3e-3)
    for was, now in ((5, 3), (5, 5), (None, 3)):
        assert resume_note(5, was, now, cfg) == (f"resume: the checkpoint's step 5 is not below train.max_steps={now}:"
                                                 f" nothing left to train (raise train.max_steps to train on)")
    assert resume_note(0, 5, 3, cfg) == "" and resume_note(2, 4, 4, cfg) == ""


def test_resume_with_a_larger_max_steps_continues_on_the_recomputed_schedule(tmp_path, text_corpus, one_thread):
    """The same out_dir run again with a larger train.max_steps resumes from the checkpoint's step on
    the schedule recomputed over the new length (warmup and decay scale with it): steps 1-6 ran on
    the 6-step schedule, steps 7-12 run on the 12-step one, and the log says where the LR jumps
    (from the end of the 6-step cosine to the peak that ends the 12-step warmup)."""
    over = {"train.eval_batches": 1, "optim.warmup_steps": "null", "optim.warmup_fraction": 0.5}
    run(tmp_path, text_corpus, **over, **{"train.max_steps": 6})
    ckpt_state = torch.load(tmp_path / "run" / "checkpoints" / "step_00000006" / "state.pt", weights_only=True)
    assert ckpt_state["extra"]["max_steps"] == 6
    _, rows = run(tmp_path, text_corpus, **over, **{"train.max_steps": 12})
    cfg = OptimConfig(lr=3e-3, warmup_fraction=0.5)
    lrs = {r["step"]: r["lr"] for r in rows if "lr" in r}
    assert sorted(lrs) == list(range(1, 13))
    for s in range(1, 13):
        assert lrs[s] == pytest.approx(3e-3 * lr_multiplier(s - 1, 6 if s <= 6 else 12, cfg), rel=1e-12), s
    old, new = 3e-3 * lr_multiplier(5, 6, cfg), 3e-3 * lr_multiplier(6, 12, cfg)
    assert (old, new) == (pytest.approx(3e-4), pytest.approx(3e-3))
    log = (tmp_path / "run" / "log.txt").read_text()
    assert (f"resume: train.max_steps 6 -> 12: the LR schedule is recomputed over 12 steps and continues from "
            f"step 6; the LR goes from {old:.4g} (step 6, the last of the checkpoint, on the schedule over 6) "
            f"to {new:.4g} (step 7)") in log
    assert log.count("resume: train.max_steps") == 1  # the first run (nothing to resume) says nothing
