"""Latent diffusion family: config errors, the denoiser, the model's loss and sampling, the task in the loop.

The sample-quality check of the embedded default (a digits classifier on generated samples) is the
slow benchmark `python train/bench.py min-snr`; here a tiny run checks the plumbing end to end.
"""
import math
from pathlib import Path

import pytest
import torch

import zoo
from train.config import load_run_config
from train.loop import train
from zoo.config import ConfigError, DiffusionConfig, from_dict
from zoo.diffusion.denoiser import UNet
from zoo.diffusion.latent import LatentDiffusion
from zoo.diffusion.taesd import TAESD

REPO = Path(__file__).resolve().parents[1]
TINY_MODEL = {"image_size": 16, "autoencoder": {"latent_channels": 4, "channels": 8}, "channels": [16, 32],
              "blocks_per_level": 1, "sample_steps": 4}


def tiny_run(tmp_path, *overrides):
    base = {"family": "diffusion", "model": TINY_MODEL,
            "data": {"dataset": "digits", "cache_dir": str(tmp_path / "cache"), "ae_steps": 3, "ae_batch_size": 8,
                     "samples_per_class": 1},
            "train": {"out_dir": str(tmp_path / "run"), "max_steps": 4, "batch_size": 8, "eval_every": 0,
                      "eval_batches": 1, "checkpoint_every": 0, "progress": False, "plot": False,
                      "ema_decay": 0.9},
            "optim": {"warmup_steps": 1}}
    return load_run_config(None, list(overrides), base=base)


def test_digits_config_builds_and_validates():
    model = zoo.build(REPO / "configs" / "diffusion" / "digits.yaml")
    assert isinstance(model, LatentDiffusion) and model.latent_channels == 4
    assert all(not p.requires_grad for p in model.autoencoder.parameters())
    assert model.num_params() == sum(p.numel() for p in model.denoiser.parameters())


@pytest.mark.parametrize("data,match", [
    ({"image_size": 36}, r"model\.image_size must be divisible by 8.*got 36"),
    ({"latent_channels": 16, "autoencoder": {"latent_channels": 4}},
     r"model\.latent_channels does not match model\.autoencoder\.latent_channels: 16 != 4"),
    ({"image_size": 16, "channels": [32, 64, 128]}, r"model\.channels .*latent size 2 must be divisible by 4"),
    ({"class_dropout": 1.0}, r"model\.class_dropout"),
    ({"min_snr_gamma": 0}, r"model\.min_snr_gamma"),
    ({"prediction": "epsilon"}, r"model\.prediction"),
])
def test_config_errors_are_one_line(data, match):
    with pytest.raises(ConfigError, match=match) as e:
        from_dict(DiffusionConfig, data, "cfg.yaml", "model.")
    assert "\n" not in str(e.value) and str(e.value).startswith("cfg.yaml: ")


def test_weights_of_another_variant_is_a_one_line_error(tmp_path):
    torch.manual_seed(0)
    enc = zoo.save_pretrained(TAESD(4, channels=8), tmp_path / "small_encoder.pth")
    cfg = tiny_run(tmp_path, f"model.autoencoder.weights={enc}", "model.autoencoder.latent_channels=16")
    with pytest.raises(ConfigError, match=r"autoencoder\.weights: .*small_encoder\.pth.*latent_channels=4") as e:
        train(cfg, log=lambda m: None)
    assert "\n" not in str(e.value)
    # the denoiser's latent channels against the weights' (the autoencoder's left to the weights)
    cfg = tiny_run(tmp_path, f"model.autoencoder.weights={enc}", "model.autoencoder.latent_channels=null",
                   "model.latent_channels=16")
    with pytest.raises(ConfigError, match=r"model\.latent_channels=16 does not match the autoencoder's 4"):
        train(cfg, log=lambda m: None)
    with pytest.raises(ConfigError, match=r"no_such_encoder\.pth: no such file"):
        tiny_run(tmp_path, f"model.autoencoder.weights={tmp_path / 'no_such_encoder.pth'}")


def test_denoiser_shapes_init_and_label_dropout():
    net = UNet(4, num_classes=10, channels=(16, 32), blocks_per_level=1, heads=4)
    x, t, y = torch.randn(6, 4, 4, 4), torch.randint(1000, (6,)), torch.randint(10, (6,))
    assert torch.equal(net(x, t, y), torch.zeros_like(x))          # zero-initialised output conv
    with torch.no_grad():                                            # leave the identity start
        for p in net.parameters():
            p.add_(0.1 * torch.randn_like(p))
    out = net(x, t, y)
    assert out.shape == x.shape and not torch.allclose(out, net(x, t, (y + 1) % 10))   # the label matters
    assert not torch.allclose(out, net(x, (t + 500) % 1000, y))                        # the timestep matters
    labels = torch.zeros(20000, dtype=torch.long)
    dropped = (net.drop_labels(labels, 0.1, torch.Generator().manual_seed(0)) == net.null_label).float().mean()
    assert 0.09 < dropped < 0.11
    with pytest.raises(ValueError, match="divisible by 2"):
        net(torch.randn(1, 4, 3, 3), t[:1], y[:1])


def test_model_loss_weighting_and_sampling():
    torch.manual_seed(0)
    cfg = from_dict(DiffusionConfig, TINY_MODEL)
    model = LatentDiffusion(cfg)
    torch.nn.init.normal_(model.denoiser.conv_out.weight, std=0.1)
    z, y = torch.randn(4, 4, 2, 2), torch.arange(4)
    t, noise = torch.tensor([0, 10, 500, 999]), torch.randn(4, 4, 2, 2)
    weighted = model(z, y, t, noise)
    model.config.min_snr_gamma = None
    uniform = model(z, y, t, noise)
    w = model.schedule.min_snr_weight(t, 5.0, "eps")
    assert torch.allclose(weighted, w * uniform) and w[0] < 1 and w[-1] == 1
    images = model.sample(y, generator=torch.Generator().manual_seed(0))
    assert images.shape == (4, 3, 16, 16) and images.min() >= 0 and images.max() <= 1
    again = model.sample(y, generator=torch.Generator().manual_seed(0))
    assert torch.equal(images, again)                               # eta = 0: reproducible


def test_tiny_run_trains_caches_autoencoder_and_writes_samples(tmp_path):
    logs = []
    final = train(tiny_run(tmp_path), log=logs.append)
    assert "val_loss" in final and "ema_val_loss" in final
    assert (tmp_path / "run" / "samples.png").is_file()
    cached = list((tmp_path / "cache").glob("*_encoder.safetensors"))
    assert len(cached) == 1 and any("autoencoder: training" in m for m in logs)
    # the model's normalisation buffers hold the latent statistics
    from safetensors.torch import load_file
    sd = load_file(str(tmp_path / "run" / "model.safetensors"))
    assert not torch.equal(sd["latent_std"], torch.ones(4))
    logs.clear()
    train(tiny_run(tmp_path, f"train.out_dir={tmp_path / 'run2'}"), log=logs.append)
    assert any("autoencoder: reusing" in m for m in logs)


def test_each_model_the_task_builds_has_its_own_autoencoder(tmp_path, device):
    """Two models of one task share no autoencoder tensor: under torchrun with an adapter, FSDP2 shards the trained
    model's (frozen) autoencoder in place, and the model rebuilt for the gathered weights must hold plain tensors."""
    from train.tasks.diffusion import DiffusionTask
    task = DiffusionTask(tiny_run(tmp_path), device, lambda m: None)
    task.setup()
    a, b = task.build_model(), task.build_model()
    assert a.autoencoder is not b.autoencoder
    assert not {p.data_ptr() for p in a.autoencoder.parameters()} & {p.data_ptr() for p in b.autoencoder.parameters()}


def test_sample_program_on_a_class_conditional_run(tmp_path, capsys):
    """train/sample.py RUN 3 7 on a class-conditional run (the U-Net, random init, no training): each prompt a class
    number, the same images as the model's own sample of those labels with the seed's generator; a prompt that is no
    class number is a one-line error naming it and the classes."""
    import numpy as np
    import yaml
    from PIL import Image
    from safetensors.torch import save_model

    from parallel_runs import DIFFUSION
    from train.sample import main
    cfg = load_run_config(None, [], base=DIFFUSION)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict()))
    torch.manual_seed(0)
    model = LatentDiffusion(cfg.model).eval()
    with torch.no_grad():  # a non-zero output layer, so that the classes' samples differ
        for p in model.denoiser.parameters():
            p.add_(0.05 * torch.randn_like(p))
    save_model(model, str(run / "model.safetensors"))
    assert main([str(run), "3", "7", "--n", "2", "--seed", "5", "--out", str(tmp_path / "png")]) == 0
    want = model.sample(torch.tensor([3, 3, 7, 7]), generator=torch.Generator().manual_seed(5))
    got = [torch.tensor(np.array(Image.open(tmp_path / "png" / f"{c}-5-{k}.png")), dtype=torch.float32)
           for c in (3, 7) for k in (0, 1)]
    assert all((g.permute(2, 0, 1) / 255 - w).abs().max() <= 1 / 255 + 1e-6 for g, w in zip(got, want))
    capsys.readouterr()
    assert main([str(run), "cat", "--out", str(tmp_path / "png")]) == 2
    assert capsys.readouterr().err == f"error: {run}: a class-conditional run samples class numbers 0-9, got 'cat'\n"


def test_sample_program_on_a_class_conditional_adapter_run(tmp_path):
    """train/sample.py on a class-conditional run with a LoRA (saved in PEFT's format in adapter/, its base the
    run's train.init_from): the images of the base with the adapter on."""
    import numpy as np
    import yaml
    from PIL import Image
    from safetensors.torch import save_model

    from parallel_runs import DIFFUSION
    from train.sample import main
    from zoo.adapters import AdapterConfig, apply_adapters
    from zoo.weights.peft_lora import save_adapter
    base, run = tmp_path / "base", tmp_path / "run"
    base.mkdir()
    torch.manual_seed(0)
    model = LatentDiffusion(load_run_config(None, [], base=DIFFUSION).model).eval()
    with torch.no_grad():  # a non-zero output layer, so that the samples depend on the class embedding
        for p in model.denoiser.parameters():
            p.add_(0.05 * torch.randn_like(p))
    save_model(model, str(base / "model.safetensors"))
    plain = model.sample(torch.tensor([3]), generator=torch.Generator().manual_seed(5))[0]
    apply_adapters(model, AdapterConfig(method="lora", targets=["emb"]))
    with torch.no_grad():  # a non-zero LoRA B: the adapter changes the samples
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 1.0)
    save_adapter(model, run / "adapter", base=str(base))
    cfg = load_run_config(None, [f"train.init_from={base}", "adapter.method=lora", "adapter.targets=[emb]"],
                          base=DIFFUSION)
    (run / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict()))
    assert main([str(run), "3", "--seed", "5", "--out", str(tmp_path / "png")]) == 0
    want = model.sample(torch.tensor([3]), generator=torch.Generator().manual_seed(5))[0]
    got = torch.tensor(np.array(Image.open(tmp_path / "png" / "3-5-0.png")), dtype=torch.float32)
    assert (got.permute(2, 0, 1) / 255 - want).abs().max() <= 1 / 255 + 1e-6 < (want - plain).abs().max()


def test_bf16_channels_last_run(tmp_path):
    final = train(tiny_run(tmp_path, "train.precision=bf16", "train.channels_last=true", "train.ema_decay=null"),
                  log=lambda m: None)
    assert math.isfinite(final["val_loss"]) and (tmp_path / "run" / "samples.png").is_file()
