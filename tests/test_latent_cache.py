"""The latent cache (train/data/latents.py) and image folders in the diffusion task.

An image folder of real-photo tiles (train.data.images.write_photo_tiles: scikit-image's photos cut into
squares, written on the spot) trains end to end; the cached latents equal the autoencoder's own
encoding of the images; a build killed mid-way resumes and ends with the same bytes.
"""
import json

import numpy as np
import pytest
import torch

from train.config import load_run_config
from train.data import DataError
from train.data.latents import latent_cache, weights_fingerprint
from train.loop import train
from train.tasks.diffusion import DiffusionDataConfig, load_images
from zoo.config import ConfigError
from zoo.diffusion.taesd import TAESD


def folder_run(tmp_path, dataset, *overrides):
    base = {"family": "diffusion",
            "model": {"image_size": 16, "num_classes": 4, "autoencoder": {"latent_channels": 4, "channels": 8},
                      "denoiser": "dit", "dit": {"preset": "tiny", "patch_size": 1}, "sample_steps": 2},
            "data": {"dataset": str(dataset), "cache_dir": str(tmp_path / "cache"), "hflip": True, "ae_steps": 2,
                     "ae_batch_size": 8, "samples_per_class": 1},
            "train": {"out_dir": str(tmp_path / "run"), "max_steps": 2, "batch_size": 8, "eval_every": 0,
                      "eval_batches": 1, "checkpoint_every": 0, "progress": False, "plot": False},
            "optim": {"warmup_steps": 1}}
    return load_run_config(None, list(overrides), base=base)


def test_photo_folder_trains_with_the_latent_cache_built_once(tmp_path, photo_tiles):
    logs = []
    final = train(folder_run(tmp_path, photo_tiles), log=logs.append)
    assert "val_loss" in final and (tmp_path / "run" / "samples.png").is_file()
    assert any(m.startswith("data: ") and "319 train / 35 val" in m for m in logs)
    built = [m for m in logs if m.startswith("latents: encoded 673 images")]   # 319 train images + mirrors, 35 val
    assert len(built) == 1, logs
    (cache,) = (tmp_path / "cache").glob("latents-*")
    meta = json.loads((cache / "meta.json").read_text())
    assert meta["train"] == [319, 2, 4, 2, 2] and meta["val"] == [35, 1, 4, 2, 2] and meta["key"]["hflip"]
    stamp = {f.name: f.stat().st_mtime_ns for f in cache.iterdir()}

    logs.clear()
    train(folder_run(tmp_path, photo_tiles, f"train.out_dir={tmp_path / 'run2'}"), log=logs.append)
    assert any(m == f"latents: reusing {cache}" for m in logs) and not any("latents: encoded" in m for m in logs)
    assert {f.name: f.stat().st_mtime_ns for f in cache.iterdir()} == stamp        # read, not written again
    assert (tmp_path / "run2" / "samples.png").is_file()


def test_cached_latents_equal_encoding_and_a_killed_build_resumes(tmp_path, photo_tiles):
    d = DiffusionDataConfig(dataset=str(photo_tiles / "chelsea"), val_fraction=0.2)    # a folder of images: one class
    data = load_images(d, 16, "cfg.yaml")
    assert data.classes == 1 and len(data.labels["train"]) == 43 and len(data.labels["val"]) == 11
    torch.manual_seed(0)
    ae = TAESD(4, channels=8).eval()
    key = {**data.key, "autoencoder": weights_fingerprint(ae)}
    splits = {s: (data.labels[s], lambda i, j, s=s: data.read(s, i, j)) for s in ("train", "val")}
    calls = []

    def dying(x):                  # the third batch never comes back: a kill mid-way through train
        calls.append(len(x))
        if len(calls) == 5:
            raise KeyboardInterrupt
        return ae.encode(x)

    folder = tmp_path / "latents"
    with pytest.raises(KeyboardInterrupt):
        latent_cache(folder, key, splits, dying, views=2, batch_size=8, commit_every=16, log=lambda m: None)
    assert not folder.exists()
    done = json.loads((tmp_path / ".latents.partial" / "progress.json").read_text())["done"]
    assert done == {"train": 16}
    logs = []
    cache = latent_cache(folder, key, splits, ae.encode, views=2, batch_size=8, commit_every=16, log=logs.append)
    assert logs[0] == "latents: resuming latents after {'train': 16} images"
    assert not (tmp_path / ".latents.partial").exists()

    with torch.no_grad():
        images = data.read("train", 0, 43)
        direct = ae.encode(images)
        mirrored = ae.encode(images.flip(-1))
        val = ae.encode(data.read("val", 0, 11))
    assert torch.equal(cache.latents("train", range(43)), direct)
    assert torch.equal(cache.latents("train", range(43), [1] * 43), mirrored)
    assert torch.equal(cache.latents("val", slice(None)), val)
    both = torch.cat([direct, mirrored]).double().transpose(0, 1).flatten(1)
    assert torch.allclose(cache.mean.double(), both.mean(1), atol=1e-5)
    assert torch.allclose(cache.std.double(), both.std(1), atol=1e-5)
    assert torch.equal(cache.labels["train"], data.labels["train"])
    # reused as it is: no encoding at all
    again = latent_cache(folder, key, splits, None, views=2, log=logs.append)
    assert logs[-1] == f"latents: reusing {folder}" and np.array_equal(again.arrays["train"], cache.arrays["train"])


def test_bad_folders_are_one_line_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "x.png").write_bytes(b"not a png")
    (tmp_path / "one" / "y.png").write_bytes(b"not a png")
    for name, match in [("missing", r"missing: image folder not found"),
                        ("empty", r"empty: no images and no class folders")]:
        with pytest.raises(ConfigError, match=rf"^cfg\.yaml: data\.dataset: .*{match}") as e:
            load_images(DiffusionDataConfig(dataset=str(tmp_path / name)), 16, "cfg.yaml")
        assert "\n" not in str(e.value)
    data = load_images(DiffusionDataConfig(dataset=str(tmp_path / "one")), 16, "cfg.yaml")
    with pytest.raises(DataError, match=r"one/[xy]\.png .*: unreadable image \(in data\.dataset=") as e:
        data.read("train", 0, 1)
    assert "\n" not in str(e.value)
