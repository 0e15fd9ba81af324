"""Image classification task: digits default learns through the loop, image folders (errors,
unreadable files, deterministic batches across workers and resume), pretrained fine-tuning."""
import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import zoo
from train.config import load_run_config
from train.data import DataError
from train.data.images import digits_dataset, epoch_positions, random_shift
from train.loop import train
from train.tasks.classify import ClassifyTask
from zoo.config import ConfigError, ConvNetConfig
from train.metrics import read_rows
from conftest import TEST_DEVICE

TINY = {
    "family": "convnet",
    "model": {"arch": "resnet18", "layers": [1, 1, 1, 1], "width": 8, "stem": "small", "in_chans": 1, "num_classes": 10},
    "data": {"path": "digits", "image_size": 16, "val_fraction": 0.2, "shift": 1},
    "train": {"max_steps": 60, "batch_size": 32, "log_every": 10, "eval_every": 0, "checkpoint_every": 0,
              "progress": False, "samples": False, "plot": False, "clip_grad": None},
    "optim": {"lr": 0.005, "warmup_steps": 5, "weight_decay": 0.01, "min_lr_ratio": 0.01},
}


def config(tmp_path, base=TINY, **over):
    items = [f"train.out_dir={tmp_path / 'run'}"] + [f"{k}={v}" for k, v in over.items()]
    return load_run_config(None, items, base=base)


def make_task(cfg, logs=None):
    task = ClassifyTask(cfg, TEST_DEVICE, log=(logs.append if logs is not None else lambda m: None))
    task.setup()
    return task


def test_digits_dataset_is_a_fixed_stratified_split():
    x, y = digits_dataset("train", 16, channels=3, val_fraction=0.2, seed=0)
    xv, yv = digits_dataset("val", 16, channels=3, val_fraction=0.2, seed=0)
    assert x.shape[1:] == (3, 16, 16) and x.dtype == torch.float32 and 0 <= x.min() and x.max() <= 1
    assert len(y) + len(yv) == 1797 and abs(len(yv) - 0.2 * 1797) < 10
    assert torch.equal(torch.bincount(yv), torch.bincount(digits_dataset("val", 16, val_fraction=0.2)[1]))
    assert (torch.bincount(yv, minlength=10) > 30).all()  # every class held out
    # no image is in both splits (the split is by index; digits has a few duplicate images, so
    # compare the index sets through a per-image fingerprint with its multiplicity)
    allx = digits_dataset("all", 8)[0].flatten(1)
    tr, va = digits_dataset("train", 8, val_fraction=0.2)[0].flatten(1), digits_dataset("val", 8, val_fraction=0.2)[0].flatten(1)
    assert len(tr) + len(va) == len(allx)
    assert torch.equal(torch.cat([tr, va]).sum(0), allx.sum(0))
    a, _ = digits_dataset("all", 8)
    assert a.shape == (1797, 1, 8, 8)


def test_random_shift_moves_each_image_by_its_offset():
    x = torch.arange(2 * 25, dtype=torch.float32).view(2, 1, 5, 5) + 1
    out = random_shift(x, 2, torch.Generator().manual_seed(3))
    for i in range(2):  # each output is x translated (zero fill): find the offset and check it
        ok = False
        for dy in range(-2, 3):
            for dx in range(-2, 3):
                ref = torch.zeros(5, 5)
                src = x[i, 0]
                ys, xs = slice(max(dy, 0), 5 + min(dy, 0)), slice(max(dx, 0), 5 + min(dx, 0))
                yt, xt = slice(max(-dy, 0), 5 + min(-dy, 0)), slice(max(-dx, 0), 5 + min(-dx, 0))
                ref[ys, xs] = src[yt, xt]
                ok |= torch.equal(out[i, 0], ref)
        assert ok


def test_epoch_positions_cover_each_epoch_once():
    pos = epoch_positions(7, seed=1, start=0, count=21)
    for e in range(3):
        assert sorted(i for i, _ in pos[7 * e:7 * e + 7]) == list(range(7))
    assert epoch_positions(7, 1, 5, 10) == pos[5:15]  # any window is the same slice of the stream


def test_digits_run_learns(tmp_path):
    final = train(config(tmp_path), log=lambda m: None)
    assert final["val_acc1"] > 0.6, final  # chance is 0.1
    assert final["val_loss"] < 1.5
    assert final["val_acc5"] >= final["val_acc1"]
    rows = read_rows(tmp_path / "run")
    assert all("images_per_s" in r and "mfu" in r for r in rows if "loss" in r)


def test_ema_is_evaluated_beside_the_model(tmp_path):
    cfg = config(tmp_path, **{"train.max_steps": 30, "train.ema_decay": 0.9, "train.samples": True})
    final = train(cfg, log=lambda m: None)
    # without the BatchNorm recalibration the same run's EMA falls below this bound
    assert final["ema_val_acc1"] > 0.35, final
    assert "ema_val_acc5" in final and (tmp_path / "run" / "per_class.txt").is_file()


def test_bn_recalibration_computes_exact_statistics(tmp_path):
    cfg = config(tmp_path, **{"model.drop_path_rate": 0.5, "train.batch_size": 64})
    task = make_task(cfg)
    model = zoo.build(cfg.model)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.fill_(5.0)
                m.running_var.fill_(9.0)
    task.recalibrate_bn(model, n_batches=2)
    assert all(m.training for m in model.modules()) and model.bn1.momentum == 0.1  # all restored
    idx = torch.tensor([i for i, _ in epoch_positions(task.n_train, cfg.train.seed + 1, 0, 128)])
    with torch.no_grad():
        h = model.conv1(task.normalize(task.train_x[idx]))  # (128, C, H, W), the input of bn1
    per_batch = [h[:64].mean((0, 2, 3)), h[64:].mean((0, 2, 3))]
    assert torch.allclose(model.bn1.running_mean, (per_batch[0] + per_batch[1]) / 2, atol=1e-5)
    var = [h[:64].var((0, 2, 3)), h[64:].var((0, 2, 3))]  # unbiased, as BatchNorm's running_var
    assert torch.allclose(model.bn1.running_var, (var[0] + var[1]) / 2, rtol=1e-4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    task.recalibrate_bn(model, n_batches=2)  # DropPath stayed off: the same statistics again
    assert all(torch.allclose(before[k].float(), v.float(), atol=1e-6) for k, v in model.state_dict().items()
               if "num_batches" not in k)


def test_digits_batches_are_a_function_of_seed_step_micro(tmp_path):
    cfg = config(tmp_path, **{"train.grad_accum": 2})
    a, b = make_task(cfg), make_task(cfg)
    xa, ya, sa = a.train_batch(5, 1)
    b.train_batch(0, 0)
    xb, yb, sb = b.train_batch(5, 1)
    assert torch.equal(xa, xb) and torch.equal(ya, yb) and sa == sb  # sa: the erasing / mixing seed
    assert not torch.equal(a.train_batch(5, 0)[1], ya)


def test_label_smoothing_and_normalisation(tmp_path):
    task = make_task(config(tmp_path, **{"data.label_smoothing": 0.2}))
    x = torch.full((2, 1, 4, 4), 255, dtype=torch.uint8)
    assert torch.allclose(task.normalize(x), torch.ones(2, 1, 4, 4))  # (1 - 0.5) / 0.5
    logits = torch.randn(2, 10)

    class Fixed(torch.nn.Module):
        def forward(self, x):
            return logits

    y = torch.tensor([3, 7])
    loss, n = task.loss(Fixed(), (x, y))
    want = torch.nn.functional.cross_entropy(logits, y, label_smoothing=0.2)
    assert n == 2 and torch.allclose(loss, want)


def test_the_data_decides_the_class_count_and_says_so(tmp_path):
    logs = []
    task = make_task(config(tmp_path, **{"model.num_classes": 7}), logs)
    assert task.model_cfg.num_classes == 10
    assert any("model.num_classes=7 -> 10, as digits has them" in m for m in logs), logs


# ----------------------------------------------------------------------------- image folders
def write_images(root, classes=("cat", "dog", "eel"), per_class=4, size=(24, 20)):
    rng = np.random.default_rng(0)
    for c, name in enumerate(classes):
        d = root / name
        d.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            arr = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
            arr[..., c] = 255  # a learnable colour cue per class
            Image.fromarray(arr).save(d / f"{i}.{'png' if i % 2 else 'jpg'}")
    return root


def folder_cfg(tmp_path, root, **over):
    base = json.loads(json.dumps(TINY))
    base["model"].update(in_chans=3, num_classes=3)
    base["data"] = {"path": str(root), "image_size": 16, "num_workers": 0, "val_fraction": 0.25}
    base["train"]["batch_size"] = 4
    return config(tmp_path, base=base, **over)


def test_folder_errors_are_one_line(tmp_path):
    with pytest.raises(DataError, match="image folder not found"):
        make_task(folder_cfg(tmp_path, tmp_path / "nope"))
    one = write_images(tmp_path / "one", classes=("a",))
    with pytest.raises(DataError, match="at least two class folders"):
        make_task(folder_cfg(tmp_path, one))
    root = write_images(tmp_path / "data")
    (root / "empty").mkdir()
    with pytest.raises(DataError, match="empty: class folder has no images") as e:
        make_task(folder_cfg(tmp_path, root, **{"model.num_classes": 4}))
    assert "\n" not in str(e.value)



def test_predict_bad_arguments_are_one_line(tmp_path, capsys):
    """train/predict.py: a folder with no images and --top below 1 are one-line errors naming them, judged before
    any model loads."""
    from train.predict import image_files, main
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="empty: no images found"):
        image_files([tmp_path / "empty"])
    assert main([str(tmp_path), str(tmp_path / "empty"), "--top", "0"]) == 2
    err = capsys.readouterr().err
    assert err == "error: --top must be >= 1, got 0\n"

def test_unreadable_images_are_reported_and_skipped(tmp_path):
    root = tmp_path / "data"
    write_images(root / "train", per_class=5)
    write_images(root / "val", per_class=1)
    broken = {str(root / "train" / "dog" / "broken.jpg"), str(root / "val" / "cat" / "truncated.png")}
    (root / "train" / "dog" / "broken.jpg").write_bytes(b"not a jpeg at all")
    (root / "val" / "cat" / "truncated.png").write_bytes((root / "val" / "cat" / "0.jpg").read_bytes()[:60])
    logs = []
    cfg = folder_cfg(tmp_path, root, **{"data.num_workers": 2})
    task = make_task(cfg, logs)
    assert task.n_train == 16
    seen = 0
    for step in range(6):  # 24 positions: one epoch of 16 images and 8 more
        x, y, _ = task.train_batch(step, 0)
        assert x.dtype == torch.uint8 and x.shape[1:] == (3, 16, 16) and len(x) == len(y)
        seen += len(y)
    paths = [p for p, _ in task.train_set.samples]
    drawn_broken = sum(paths[i] in broken for i, _ in epoch_positions(16, 0, 0, 24))
    assert drawn_broken >= 1 and seen == 24 - drawn_broken
    metrics = task.evaluate(zoo.build(cfg.model))  # the val folder's broken file is skipped too
    assert {b.split(" (")[0] for b in task.bad} == broken
    assert metrics["unreadable_images"] == 2
    assert sum("unreadable image skipped" in m for m in logs) == 2  # each path reported once


def test_folder_batches_do_not_depend_on_workers_or_resume(tmp_path):
    root = write_images(tmp_path / "data", per_class=5)
    t0 = make_task(folder_cfg(tmp_path, root, **{"data.num_workers": 0, "train.grad_accum": 2}))
    t2 = make_task(folder_cfg(tmp_path, root, **{"data.num_workers": 2, "train.grad_accum": 2}))
    seq0 = [t0.train_batch(s, m) for s in range(3) for m in range(2)]
    seq2 = [t2.train_batch(s, m) for s in range(3) for m in range(2)]
    for (a, ya, sa), (b, yb, sb) in zip(seq0, seq2):
        assert torch.equal(a, b) and torch.equal(ya, yb) and sa == sb
    resumed = make_task(folder_cfg(tmp_path, root, **{"data.num_workers": 2, "train.grad_accum": 2}))
    x, y, _ = resumed.train_batch(2, 1)  # a resume starts mid-stream
    assert torch.equal(x, seq0[5][0]) and torch.equal(y, seq0[5][1])
    assert not torch.equal(seq0[0][0], seq0[1][0])  # different crops / images per micro-batch


def test_train_and_val_subfolders_and_centre_crops(tmp_path):
    write_images(tmp_path / "data" / "train", per_class=3)
    write_images(tmp_path / "data" / "val", per_class=2, size=(40, 20))
    task = make_task(folder_cfg(tmp_path, tmp_path / "data", **{"data.crop_pct": 1.0}))
    assert task.n_train == 9 and task.n_val == 6 and task.classes == ["cat", "dog", "eel"]
    img, label, bad = task.val_set[0]
    assert img.shape == (3, 16, 16) and bad is None and label == 0
    # the eval crop of a 40x20 image is its centre 20x20 square resized to 16x16
    src = Image.open(task.val_set.samples[0][0]).convert("RGB")
    want = np.asarray(src.resize((16, 16), Image.BILINEAR, box=(10, 0, 30, 20)))
    assert np.abs(img.permute(1, 2, 0).numpy().astype(int) - want.astype(int)).max() <= 1


def test_finetune_from_timm_weights_and_export(tmp_path):
    import timm
    root = write_images(tmp_path / "data", per_class=4)
    from timm.models.resnet import BasicBlock, ResNet
    ref = ResNet(BasicBlock, [1, 1, 1, 1], num_classes=1000)  # timm's class and key layout, ResNet-10 depth
    torch.save(ref.state_dict(), tmp_path / "r18.pth")
    logs = []
    cfg = folder_cfg(tmp_path, root, **{"train.init_from": str(tmp_path / "r18.pth"), "train.max_steps": 2, "optim.warmup_steps": 1,
                                        "model.in_chans": 3})
    train(cfg, log=logs.append)
    assert any("replaced by a new 3-class head" in m for m in logs)
    # the run's shape keys the weights overrule are named, not dropped in silence (the width 8 of folder_cfg)
    assert any(m.startswith("model: model.width=8") and m.endswith("not used: the architecture is train.init_from's")
               for m in logs), logs
    out = tmp_path / "run" / "export" / "r18.pth"
    assert out.is_file()
    sd = torch.load(out, weights_only=True)
    assert sd["fc.weight"].shape == (3, 512)
    model = ResNet(BasicBlock, [1, 1, 1, 1], num_classes=3)
    model.load_state_dict(sd)  # timm reads the fine-tuned export as is
    assert not torch.equal(sd["layer1.0.conv1.weight"], ref.state_dict()["layer1.0.conv1.weight"])


def test_resume_is_exact_with_stochastic_depth_channels_last_and_bf16(tmp_path, one_thread):
    import shutil
    over = {"train.max_steps": 8, "train.checkpoint_every": 4, "train.keep_checkpoints": 3, "train.log_every": 1,
            "model.drop_path_rate": 0.3, "train.channels_last": True, "train.precision": "bf16",
            "data.ema_bn_batches": 1, "train.ema_decay": 0.9}
    full_cfg = config(tmp_path, **over)
    final = train(full_cfg, log=lambda m: None)
    assert 0.0 <= final["val_acc1"] <= 1.0 and "ema_val_acc1" in final
    part = tmp_path / "part"
    shutil.copytree(tmp_path / "run", part)
    shutil.rmtree(part / "checkpoints" / "step_00000008")  # as if killed after the step-4 checkpoint
    (part / "model.safetensors").unlink()
    train(load_run_config(None, [f"train.out_dir={part}"] + [f"{k}={v}" for k, v in over.items()], base=TINY),
          log=lambda m: None)

    def losses(run):
        return [(r["step"], r["loss"]) for r in read_rows(run)
                if "loss" in r]
    assert losses(part) == losses(tmp_path / "run")  # bitwise-equal, step for step
    from safetensors.torch import load_file
    a, b = load_file(tmp_path / "run" / "model.safetensors"), load_file(part / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_digits_preset_reaches_95_percent(tmp_path):
    """configs/convnet/resnet-digits.yaml exactly as shipped (200 steps), through train/run.py:
    the held-out accuracy at the end is at least 95%."""
    import subprocess
    import sys
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, str(root / "train" / "run.py"), str(root / "configs/convnet/resnet-digits.yaml"),
                           f"train.out_dir={out}", "train.progress=false"], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = read_rows(out)
    final = [r for r in rows if "val_acc1" in r][-1]
    assert final["step"] == 200 and final["val_acc1"] >= 0.95, final
