"""Stochastic depth that skips the dropped rows (zoo/blocks/drop_path.py residual_drop_path and the
ResNet's drop_path_mode): exactly the masked form for a fixed mask, the same in expectation over
draws (forward and gradients), the paper's whole-batch variant, and the ResNet blocks in each mode."""
import copy

import pytest
import torch
from torch import nn

import zoo
from zoo.blocks.drop_path import DropPath, drop_path, residual_drop_path
from zoo.config import ConvNetConfig

P = 0.4


def branch_and_input(seed=0, conv=True):
    """A per-sample branch (no batch statistics) and its input: convolutions on (B=16, C=4, H=W=3),
    channels-last, or an MLP on (B=16, D=4)."""
    torch.manual_seed(seed)
    if not conv:
        return nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 4)), torch.randn(16, 4)
    branch = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.GELU(), nn.Conv2d(4, 4, 1))
    x = torch.randn(16, 4, 3, 3).contiguous(memory_format=torch.channels_last)
    return branch, x


def run(form, branch, x, seed):
    """Output and gradients (input and parameters) of one draw of `form` (mask or skip)."""
    x = x.detach().clone().requires_grad_()
    g = torch.Generator().manual_seed(seed)
    shortcut = 2 * x
    if form == "mask":
        out = shortcut + drop_path(branch(x), P, True, generator=g)
    else:
        out = residual_drop_path(shortcut, branch, x, P, True, generator=g)
    weights = torch.linspace(-1, 1, out.numel()).view_as(out)
    grads = torch.autograd.grad((out * weights).sum(), [x, *branch.parameters()])
    return out.detach(), grads


def test_skip_equals_the_masked_form_for_a_fixed_mask():
    """In float64: the two forms sum the weights' gradients over 16 rows or over the kept ones only,
    so in float32 they differ by rounding (up to ~1e-6 of the gradients' scale, depending on the
    kernels' summation order and thread count); in float64 that rounding is ~1e-15."""
    branch, x = branch_and_input()
    branch, x = branch.double(), x.double()
    for seed in range(5):
        (a, ga), (b, gb) = run("mask", branch, x, seed), run("skip", branch, x, seed)
        assert (a - b).abs().max() <= 1e-12 and not torch.equal(a, 2 * x + branch(x).detach())  # rows were dropped
        assert all((u - v).abs().max() <= 1e-12 * max(1.0, u.abs().max().item()) for u, v in zip(ga, gb))
    g = torch.Generator().manual_seed(0)
    assert residual_drop_path(2 * x, branch, x, P, True, generator=g).is_contiguous(memory_format=torch.channels_last)


def test_skip_is_unbiased_over_draws_forward_and_gradients():
    """The mean over K draws of the output and of the gradients is the undropped block's: within
    5 standard errors of the draws' own spread (the mean's standard error is the draws' std / sqrt(K))."""
    branch, x = branch_and_input(1, conv=False)
    K = 400
    outs, grads = zip(*(run("skip", branch, x, 1000 + k) for k in range(K)))
    with torch.no_grad():
        full_out = 2 * x + branch(x)
    xx = x.detach().clone().requires_grad_()
    o = 2 * xx + branch(xx)
    full_grads = torch.autograd.grad((o * torch.linspace(-1, 1, o.numel()).view_as(o)).sum(), [xx, *branch.parameters()])
    for draws, want in [(torch.stack(outs), full_out)] + [(torch.stack(gs), w) for gs, w in zip(zip(*grads), full_grads)]:
        se = draws.std(0) / K ** 0.5
        assert ((draws.mean(0) - want).abs() <= 5 * se + 1e-6).all()


def test_whole_batch_skipping():
    branch, x = branch_and_input(2, conv=False)
    shortcut = 2 * x.detach()
    with torch.no_grad():
        full = branch(x)
        outs = [residual_drop_path(shortcut, branch, x, P, True, per="batch") for _ in range(400)]
    dropped = [torch.equal(o, shortcut) for o in outs]
    kept = [(o - (shortcut + full / (1 - P))).abs().max() <= 1e-5 for o in outs]
    assert all(d != k for d, k in zip(dropped, kept))
    assert abs(sum(dropped) / len(outs) - P) < 5 * (P * (1 - P) / len(outs)) ** 0.5
    assert all(o is not shortcut for o in outs)  # never the shortcut itself (an in-place op may follow)
    model = DropPath(P, "batch").eval()
    with torch.no_grad():
        assert torch.equal(model.residual(shortcut, branch, x), shortcut + full)
    # generators seeded alike (as data-parallel ranks seed theirs) draw the same blocks, whatever the global RNG
    a, b = DropPath(P, "batch"), DropPath(P, "batch")
    a.generator, b.generator = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    with torch.no_grad():
        for seed, m in ((0, a), (1, b)):
            torch.manual_seed(seed)
            m.draws = [torch.equal(m.residual(shortcut, branch, x), shortcut) for _ in range(50)]
    assert a.draws == b.draws and 0 < sum(a.draws) < 50


@pytest.mark.parametrize("mode", ["skip", "batch"])
def test_resnet_modes_train_and_match_mask_in_eval(mode):
    """A ResNet in each mode: identical to `mask` in eval; in training (BatchNorm frozen in eval, drop
    path on) skip equals mask for the same draws; every mode runs a training step."""
    torch.manual_seed(0)
    cfg = ConvNetConfig(arch="resnet18", layers=[1, 1, 1, 1], width=8, stem="small", in_chans=1, num_classes=10,
                        drop_path_rate=0.5)
    ref = zoo.build(cfg)
    model = zoo.build(ConvNetConfig(**{**cfg.__dict__, "drop_path_mode": mode}))
    model.load_state_dict(ref.state_dict())
    x = torch.randn(8, 1, 16, 16)
    with torch.no_grad():
        assert torch.equal(ref.eval()(x), model.eval()(x))
    if mode == "skip":
        for m in (ref, model):
            for dp in m.modules():
                if isinstance(dp, DropPath):
                    dp.train()
        torch.manual_seed(3)
        a = ref(x)
        torch.manual_seed(3)
        b = model(x)
        assert (a - b).abs().max() <= 1e-5
    model.train()(x).sum().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad) or mode == "batch"


def test_bench_crossover_and_the_docs_table_from_its_json():
    """The drop-path bench's crossover (the lowest rate from which on a mode beats mask's paired
    median) on made-up rows, and docs/convnet.md's table equal to what the committed JSON renders."""
    import json

    from train.benches import convnets as bench
    from train.docs import RESULTS, ROOT, render_result

    def rows(skip):
        return {"results": [{"precision": "fp32", "rate": r, "skip_over_mask": {"median": m},
                             "batch_over_mask": {"median": 1.5}} for r, m in zip([0.1, 0.3, 0.5], skip)]}
    assert bench.crossover(rows([0.9, 1.1, 1.2]), "skip") == 0.3
    assert bench.crossover(rows([1.1, 0.9, 1.2]), "skip") == 0.5      # above 1 at every higher rate too
    assert bench.crossover(rows([0.9, 0.95, 0.99]), "skip") is None
    assert bench.crossover(rows([0.9, 0.95, 0.99]), "batch") == 0.1
    data = json.loads((RESULTS / "drop-path.json").read_text())["data"]
    assert sorted(r["rate"] for r in data["results"]) == [0.1, 0.2, 0.3, 0.4, 0.5] and data["arch"] == "resnet50"
    assert render_result("drop-path") in (ROOT / "docs" / "convnet.md").read_text()
