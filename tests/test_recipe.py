"""The classification recipe (timm's): Mixup / CutMix targets against a hand computation, the
soft-target loss, RandAugment / TrivialAugment / erasing / mixing drawn from (seed, step, micro) only
(so a resumed run draws the same), the extra named when torchvision is missing, and the EMA of the
weights treating BatchNorm statistics as timm's ModelEmaV3 does; and a run with the recipe on, SIGKILLed and
resumed, ends bitwise equal to an uninterrupted one."""
import random
import signal

import pytest
import torch
import torch.nn.functional as F
import yaml
from safetensors.torch import load_file

from conftest import killed_at_checkpoint
from test_classify import TINY, config, make_task
from test_reliability import assert_bitwise_equal, finish, launch
from train.checkpoint import list_checkpoints
from train.config import load_run_config
from train.data.images import auto_augment_op, mix_batch, smooth_one_hot
from train.loop import train
from train.metrics import read_rows
from train.step import EMA
from zoo.config import ConfigError
from conftest import CPU

K, S = 5, 0.1  # classes, label smoothing


def hand_targets(y, lam):
    """lam * smoothed one-hot of y + (1 - lam) * that of y reversed, written out element by element."""
    B = len(y)
    t = torch.zeros(B, K)
    for i in range(B):
        for c in range(K):
            own = (1 - S + S / K) if c == y[i] else S / K
            other = (1 - S + S / K) if c == y[B - 1 - i] else S / K
            t[i, c] = lam[i] * own + (1 - lam[i]) * other
    return t


def batch(B=6, size=12):
    g = torch.Generator().manual_seed(0)
    return torch.rand(B, 3, size, size, generator=g), torch.randint(0, K, (B,), generator=g)


def test_mixup_targets_match_the_mixing_measured_on_the_pixels():
    x, y = batch()
    out, t, lam = mix_batch(x, y, K, random.Random(3), mixup_alpha=0.8, smoothing=S)
    partner = x.flip(0)
    measured = ((out - partner) / (x - partner)).flatten(1).median(1).values  # out = lam x + (1 - lam) partner
    assert 0 < lam < 1 and torch.allclose(measured, torch.full((6,), lam), atol=1e-4)
    assert torch.allclose(t, hand_targets(y, measured), atol=1e-4)
    assert torch.allclose(t.sum(1), torch.ones(6))


def test_cutmix_targets_match_the_share_of_pixels_kept():
    x, y = batch(size=16)
    for seed in range(5):
        out, t, lam = mix_batch(x, y, K, random.Random(seed), cutmix_alpha=1.0, smoothing=S)
        pasted = ((out == x.flip(0)) & (out != x)).all(1)  # (B, H, W): pixels taken from the partner
        kept = 1 - pasted.float().flatten(1).mean(1)
        assert torch.equal(kept, torch.full((6,), kept[0].item())), "one box for the whole batch"
        assert abs(kept[0].item() - lam) < 1e-6
        assert torch.allclose(t, hand_targets(y, kept), atol=1e-6)
    # prob 0: no mixing, the smoothed labels
    out, t, lam = mix_batch(x, y, K, random.Random(0), cutmix_alpha=1.0, prob=0.0, smoothing=S)
    assert lam == 1.0 and torch.equal(out, x) and torch.allclose(t, hand_targets(y, [1.0] * 6))


def test_soft_target_loss_of_smoothed_labels_is_label_smoothed_cross_entropy(tmp_path):
    task = make_task(config(tmp_path, **{"data.label_smoothing": S, "model.num_classes": 10}))
    logits = torch.randn(8, 10)
    y = torch.randint(0, 10, (8,))
    soft = -(smooth_one_hot(y, 10, S) * logits.log_softmax(-1)).sum(-1).mean()
    assert torch.allclose(soft, F.cross_entropy(logits, y, label_smoothing=S), atol=1e-6)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.LazyLinear(10))
    x = task.train_x[:8]
    plain, _ = task.loss(model, (x, task.train_y[:8]))
    assert torch.allclose(plain, F.cross_entropy(model(task.normalize(x)), task.train_y[:8], label_smoothing=S))


RECIPE = {"data.auto_augment": "randaugment", "data.random_erasing": 0.5, "data.mixup_alpha": 0.8,
          "data.cutmix_alpha": 1.0, "train.batch_size": 8}


def test_augmentation_draws_are_a_function_of_seed_step_and_micro(tmp_path):
    """What a resumed run needs: step 3's batch (RandAugment'd images, then erased and mixed in the loss)
    is the same whether it comes after steps 0..6 or first in a fresh process-like task, and whatever
    torch's global generator holds; and the recipe does change the images."""
    import torchvision  # noqa: F401
    cfg = config(tmp_path, **RECIPE)
    first, second = make_task(cfg), make_task(cfg)
    for step in range(3):
        first.train_batch(step, 0)
    torch.manual_seed(1234)
    a = first.train_batch(3, 0)
    torch.manual_seed(99)
    random.seed(99)
    b = second.train_batch(3, 0)
    assert all(torch.equal(u, v) for u, v in zip(a[:2], b[:2])) and a[2] == b[2]
    ra, rb = first.recipe(first.normalize(a[0]), a[1], a[2]), second.recipe(second.normalize(b[0]), b[1], b[2])
    assert torch.equal(ra[0], rb[0]) and torch.equal(ra[1], rb[1]) and ra[1].shape == (8, 10)
    plain = make_task(config(tmp_path, **{"train.batch_size": 8})).train_batch(3, 0)
    assert torch.equal(plain[1], a[1]) and not torch.equal(plain[0], a[0])  # same images, augmented
    assert not torch.equal(first.train_batch(4, 0)[0], a[0])
    # TrivialAugment draws the same way
    t1, t2 = (make_task(config(tmp_path, **{"data.auto_augment": "trivialaugment", "train.batch_size": 8}))
              for _ in range(2))
    t1.train_batch(3, 0)
    assert torch.equal(t1.train_batch(4, 1)[0], t2.train_batch(4, 1)[0])


def test_missing_torchvision_names_the_extra(tmp_path, monkeypatch):
    import importlib.util
    import sys
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchvision" else real(name, *a))
    with pytest.raises(ConfigError, match=r"data.auto_augment=randaugment needs torchvision: pip install -e '\.\[convnet\]'"):
        config(tmp_path, **{"data.auto_augment": "randaugment"})
    for name in ("torchvision", "torchvision.transforms", "torchvision.transforms.v2"):
        monkeypatch.setitem(sys.modules, name, None)  # import fails, as when it is not installed
    with pytest.raises(ImportError, match=r"trivialaugment needs torchvision"):
        auto_augment_op("trivialaugment")


def test_ema_averages_batchnorm_statistics_as_timm():
    """train/step.py's EMA against timm's ModelEmaV3 (no warmup): parameters and BatchNorm running
    statistics averaged the same, the batch count copied: the same state after three updates."""
    import timm.utils as timm_utils
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, bias=False), torch.nn.BatchNorm2d(4), torch.nn.ReLU())
    ours, ref = EMA(model, 0.9), timm_utils.ModelEmaV3(model, decay=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        model(torch.randn(4, 3, 8, 8)).square().mean().backward()  # training mode: BN statistics move
        opt.step()
        opt.zero_grad()
        ours.update(model)
        ref.update(model)
    a, b = ours.model.state_dict(), ref.module.state_dict()
    assert all(torch.allclose(a[k].float(), b[k].float(), atol=1e-7) for k in b), [k for k in b if not torch.equal(a[k], b[k])]
    assert not torch.allclose(a["1.running_mean"], model[1].running_mean)  # averaged, not copied


def test_recipe_draws_survive_a_sigkill_and_resume(tmp_path, one_thread):
    """A run with the whole recipe on (TrivialAugment, random erasing, Mixup and CutMix) SIGKILLed
    in a fresh process while it writes its step-8 checkpoint, then resumed from step 4 in this one
    (whose generators hold other states): the final weights and every logged loss equal those of an
    uninterrupted run, bit for bit, which they cannot if a redone step drew other augmentations."""
    import torchvision  # noqa: F401
    over = {**RECIPE, "data.auto_augment": "trivialaugment", "train.max_steps": 8, "train.checkpoint_every": 4,
            "train.keep_checkpoints": 3, "train.log_every": 1, "train.export": False}
    cfg_file = tmp_path / "recipe.yaml"
    cfg_file.write_text(yaml.safe_dump(TINY))
    killed = tmp_path / "killed"
    p = launch(cfg_file, killed, *(f"{k}={v}" for k, v in over.items()), env=killed_at_checkpoint(tmp_path, 8))
    assert finish(p) == -signal.SIGKILL, (killed / "stderr-0.txt").read_text()
    assert [c.name for c in list_checkpoints(killed)] == ["step_00000004"]

    def run(out):
        torch.manual_seed(1234)
        random.seed(99)
        train(load_run_config(None, [f"train.out_dir={out}"] + [f"{k}={v}" for k, v in over.items()], base=TINY),
              log=lambda m: None)
        return [(r["step"], r["loss"]) for r in read_rows(out) if "loss" in r], load_file(out / "model.safetensors")

    resumed, whole = run(killed), run(tmp_path / "whole")
    assert resumed[0] == whole[0] and [s for s, _ in resumed[0]] == list(range(1, 9))
    assert_bitwise_equal(resumed[1], whole[1])


def test_convnet_docs_tables_are_rendered_from_the_benchmarks_json():
    """docs/convnet.md's tables of the convnets and convnet-recipe benchmarks equal what the
    benchmarks render from their committed JSON (tables in docs/ are never typed in)."""
    from train.docs import ROOT, render_result
    page = (ROOT / "docs" / "convnet.md").read_text()
    for name in ("convnets", "convnet-recipe"):
        assert f"<!-- table:{name} -->\n" + render_result(name) in page, name


def test_convnets_bench_run_of_some_settings_updates_only_their_docs_rows():
    from train.benches.convnets import merged

    def row(arch, mode, ratio):
        return {"arch": arch, "mode": mode, "format": "contiguous", "precision": "fp32",
                "zoo_speed_over_timm_paired_median": ratio}
    setting = {"device": str(CPU), "batch": 8, "size": 64, "threads": 1, "torch": "2.14.1"}
    old = {**setting, "results": [row("a", "eager", 1.0), row("b", "eager", 1.1), row("b", "compiled", 0.9)]}
    new = {**setting, "results": [row("b", "compiled", 1.2), row("c", "compiled", 1.3)]}
    got = [(r["arch"], r["mode"], r["zoo_speed_over_timm_paired_median"]) for r in merged(old, new)["results"]]
    assert got == [("a", "eager", 1.0), ("b", "eager", 1.1), ("b", "compiled", 1.2), ("c", "compiled", 1.3)]
    other = {**new, "size": 224}  # another shape: its rows replace the table
    assert merged(old, other) == other
