"""Aspect-ratio buckets (data.buckets): the automatic set, each image to the bucket of the nearest ratio and centre-
cropped to it, batches of one bucket drawn reproducibly from the step, a short FLUX.2 run on a folder of two aspect
ratios sampled at a bucket's size, and the config's refusals."""
import json

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import CPU
from parallel_runs import DIFFUSION, TEXT
from train.config import load_run_config
from train.data import DataError
from train.data.images import FolderImages, auto_buckets, bucketed
from zoo.config import ConfigError


@pytest.mark.parametrize("size,multiple", [(32, 16), (512, 64), (1024, 16)])
def test_auto_buckets_are_the_longest_sides_within_the_area(size, multiple):
    """Against an enumeration: every (H, W) of multiples from half to twice `size` within size^2 pixels, for each H
    its longest W, both ways round."""
    sides = range(-(-size // 2 // multiple) * multiple, 2 * size + 1, multiple)
    longest = {(h, max(w for w in sides if h * w <= size * size)) for h in sides if h * sides[0] <= size * size}
    assert auto_buckets(size, multiple) == sorted(longest | {(w, h) for h, w in longest})
    assert (size, size) in longest


def ramp(path, w, h):
    """An image whose red rises along x and green along y (so a wrong box or orientation shows)."""
    x, y = np.meshgrid(np.linspace(0, 255, w), np.linspace(0, 255, h))
    Image.fromarray(np.stack([x, y, np.zeros_like(x)], -1).astype(np.uint8)).save(path)
    return str(path)


def test_each_image_goes_to_the_nearest_ratio_centre_cropped_to_it(tmp_path):
    buckets = [(32, 32), (16, 48), (48, 16)]
    sizes = {"wide": (90, 30), "tall": (30, 90), "square": (40, 40), "wider": (200, 40), "taller": (40, 200),
             "three-two": (60, 40)}  # (width, height)
    samples = [(ramp(tmp_path / f"{n}.png", w, h), i) for i, (n, (w, h)) in enumerate(sizes.items())]
    got = {b: [label for _, label in s] for b, s in bucketed(samples, buckets).items()}
    assert got == {1: [0, 3], 2: [1, 4], 0: [2, 5]}   # 3:2 is nearer 1:1 than 3:1 (in log ratio)
    for name, box, bucket in (("wider", (40, 0, 160, 40), (16, 48)), ("taller", (0, 40, 40, 160), (48, 16))):
        got = FolderImages([(str(tmp_path / f"{name}.png"), 0)], bucket, train=False, crop_pct=1.0)[0][0]
        want = np.array(Image.open(tmp_path / f"{name}.png").crop(box).resize(bucket[::-1], Image.BILINEAR))
        # the box is the largest centred one of the bucket's shape; resizing inside the whole image or the cut-out
        # box differs only where the filter reaches past the box's edge: a level or two of the ramp
        assert got.shape == (3, *bucket)
        assert (got.permute(1, 2, 0).int() - torch.from_numpy(want).int()).abs().max() <= 3
    with pytest.raises(DataError, match="nothing.png: unreadable image"):
        bucketed([(str(tmp_path / "nothing.png"), 0)], buckets)


@pytest.fixture(scope="module")
def two_ratios(tmp_path_factory):
    """A captioned folder of wide (3:1) and square images of a few colours, and its cache folder."""
    root = tmp_path_factory.mktemp("two_ratios")
    rng = np.random.default_rng(0)
    for i in range(16):
        w = 96 if i % 2 else 32
        Image.fromarray(rng.integers(0, 256, (32, w, 3), dtype=np.uint8)).save(root / f"{i}.png")
        (root / f"{i}.txt").write_text(f"a {'wide' if i % 2 else 'square'} picture {i % 4}")
    return root


def config(root, *over):
    return load_run_config(None, [*TEXT, "model.image_size=32", f"data.dataset={root}", "data.buckets=auto",
                                  f"data.cache_dir={root / 'cache'}", "data.val_fraction=0.25",
                                  f"train.out_dir={root / 'run'}", f"train.device={CPU}", *over], base=DIFFUSION)


def test_batches_come_from_one_bucket_drawn_by_the_step(two_ratios):
    from train.builder import new_task
    logs = []
    task = new_task(config(two_ratios), CPU, "fp32", logs.append)
    assert task.splits == ["train-16x48", "train-32x32"]
    assert any(m.startswith("buckets (H x W: training images): 16x48: ") for m in logs), logs
    meta = json.loads((task.latents.folder / "meta.json").read_text())
    assert {k: meta[k][2:] for k in ("train-16x48", "train-32x32", "val")} == \
        {"train-16x48": [4, 2, 6], "train-32x32": [4, 4, 4], "val": [4, 4, 4]} and meta["key"]["buckets"]
    model, shapes = task.build_model(), set()
    for step in range(12):
        b, again = task.train_batch(step, 0), task.train_batch(step, 0)   # what a resumed run draws at that step
        assert torch.equal(b["z"], again["z"]) and torch.equal(b["labels"], again["labels"])
        shapes.add(tuple(b["z"].shape[2:]))
        assert torch.isfinite(task.loss(model, b)[0])
    assert shapes == {(2, 6), (4, 4)}


def test_a_flux2_run_on_two_aspect_ratios_trains_and_samples_a_bucket(two_ratios, tmp_path):
    from train.loop import train
    from train.sample import main
    logs = []
    final = train(config(two_ratios, "train.max_steps=4", "train.eval_every=4", f"train.out_dir={tmp_path / 'run'}"),
                  log=logs.append)
    assert np.isfinite(final["val_loss"]) and (tmp_path / "run" / "samples.png").is_file()
    assert main([str(tmp_path / "run"), "a wide picture 1", "--size", "16", "48", "--steps", "2",
                 "--out", str(tmp_path / "png")]) == 0
    assert Image.open(tmp_path / "png" / "a_wide_picture_1-0-0.png").size == (48, 16)


@pytest.mark.parametrize("over,message", [
    (["data.buckets=[[32,32],[32,40]]"], r"data.buckets\[1\]=\[32, 40\]: each side must be a positive multiple of 16 "
                                        r"\(the autoencoder's 8 x the latent patch 2\)"),
    (["data.buckets=[]"], "data.buckets: an empty list"),
])
def test_bad_buckets_are_one_line_errors(two_ratios, over, message):
    with pytest.raises(ConfigError, match=message):
        config(two_ratios, *over)


@pytest.mark.parametrize("over,message", [
    (["model.denoiser=dit", "data.buckets=auto"], "data.buckets: model.denoiser=dit denoises one latent size"),
    (["data.buckets=auto"], "data.buckets: the digits are square"),
])
def test_buckets_need_a_denoiser_of_any_size_and_an_image_folder(over, message):
    with pytest.raises(ConfigError, match=message):
        load_run_config(None, over, base=DIFFUSION)
