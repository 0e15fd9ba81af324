"""TAESD: parity with diffusers' AutoencoderTiny, original .pth pairs, export, detection, the real TAEF2.

Parity tolerance: max abs diff <= 1e-4 in fp32 (the same convs in the same order: expect ~0).
"""
import json
from pathlib import Path

import numpy as np
import pytest
import torch

import zoo
from zoo.diffusion.taesd import TAESD
from zoo.weights import taesd as taesd_weights

SHARED = Path(__file__).resolve().parents[2] / "shared"
TAEF2 = SHARED / "weights" / "taef2_encoder.pth"


def _reference(latent_channels, seed=0):
    import diffusers
    torch.manual_seed(seed)
    ref = diffusers.AutoencoderTiny(latent_channels=latent_channels).eval()
    with torch.no_grad():  # perturb every tensor so that a mis-mapped one changes the outputs
        for p in ref.parameters():
            p.mul_(1 + 0.1 * torch.randn_like(p)).add_(0.01 * torch.randn_like(p))
        ref.encoder.layers[-1].weight.mul_(30)   # latents of O(1), so that the decoder's clamp is exercised
    return ref


@pytest.mark.parametrize("latent_channels", [4, 16])
def test_diffusers_autoencoder_tiny_parity(tmp_path, latent_channels):
    ref = _reference(latent_channels)
    ref.save_pretrained(tmp_path / "ref")
    model = zoo.from_pretrained(tmp_path / "ref").eval()
    assert isinstance(model, TAESD) and model.variant == {"latent_channels": latent_channels, "midblock_gn": False,
                                                          "channels": 64}
    images = torch.rand(2, 3, 48, 40, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        z_ref = ref.encode(images * 2 - 1).latents           # diffusers: images in [-1, 1]
        z = model.encode(images)
        out_ref = ref.decode(z_ref).sample                   # diffusers: images out in [-1, 1]
        out = model.decode(z_ref) * 2 - 1
    assert z.shape == (2, latent_channels, 6, 5) and out.shape == images.shape
    assert z_ref.std() > 1e-2 and out_ref.std() > 1e-2       # the comparison is not between near-zeros
    assert (z - z_ref).abs().max() <= 1e-4
    assert (out - out_ref).abs().max() <= 1e-4


def test_a_sharded_diffusers_folder_loads(tmp_path):
    """An AutoencoderTiny folder diffusers wrote in shards (its index.json naming them) loads the same tensors."""
    ref = _reference(4)
    ref.save_pretrained(tmp_path, max_shard_size="200KB")
    assert (tmp_path / "diffusion_pytorch_model.safetensors.index.json").is_file()
    images = torch.rand(1, 3, 32, 24, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (zoo.from_pretrained(tmp_path).encode(images) - ref.encode(images * 2 - 1).latents).abs().max() <= 1e-4


def test_export_round_trips_both_formats(tmp_path):
    import diffusers
    ref = _reference(16, seed=3)
    ref.register_to_config(scaling_factor=0.75, shift_factor=0.1)
    ref.save_pretrained(tmp_path / "ref")
    model = zoo.from_pretrained(tmp_path / "ref")
    assert (model.scaling_factor, model.shift_factor) == (0.75, 0.1)
    # diffusers folder -> diffusers loads the very same tensors and config
    zoo.save_pretrained(model, tmp_path / "out")
    back = diffusers.AutoencoderTiny.from_pretrained(tmp_path / "out")
    assert back.config.scaling_factor == 0.75 and back.config.latent_channels == 16
    ref_sd, back_sd = ref.state_dict(), back.state_dict()
    assert ref_sd.keys() == back_sd.keys() and all(torch.equal(ref_sd[k], back_sd[k]) for k in ref_sd)
    # original pair, fp16 like the published files; either file of the pair loads it
    enc = zoo.save_pretrained(model, tmp_path / "pair" / "mine_encoder.pth", dtype=torch.float16)
    assert enc.name == "mine_encoder.pth" and (tmp_path / "pair" / "mine_decoder.pth").is_file()
    raw = torch.load(enc, weights_only=True)
    assert "0.weight" in raw and raw["0.weight"].dtype == torch.float16
    again = zoo.from_pretrained(tmp_path / "pair" / "mine_decoder.pth")
    for k, v in model.state_dict().items():
        assert torch.equal(again.state_dict()[k], v.half().float()), k
    # a folder holding one pair also loads
    assert zoo.from_pretrained(tmp_path / "pair").variant == model.variant


def test_flux2_variant_round_trip_and_variant_errors(tmp_path):
    torch.manual_seed(0)
    model = TAESD(32, midblock_gn=True, channels=16)
    assert any(".pool." in k for k in model.state_dict())
    path = zoo.save_pretrained(model, tmp_path / "f2_encoder.pth")
    loaded = zoo.from_pretrained(path)
    assert loaded.variant == {"latent_channels": 32, "midblock_gn": True, "channels": 16}
    x = torch.rand(1, 3, 16, 16)
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))
    with pytest.raises(ValueError, match=r"f2_encoder\.pth.*latent_channels=32.*latent_channels=4") as e:
        zoo.from_pretrained(path, latent_channels=4)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="midblock_gn"):
        zoo.from_pretrained(path, midblock_gn=False)
    with pytest.raises(ValueError, match="diffusers"):
        zoo.save_pretrained(model, tmp_path / "as_diffusers")
    (tmp_path / "lonely_encoder.pth").write_bytes(path.read_bytes())
    with pytest.raises(FileNotFoundError, match="lonely_decoder.pth"):
        zoo.from_pretrained(tmp_path / "lonely_encoder.pth")


def test_detect_does_not_claim_other_families(tmp_path):
    import torchvision
    import transformers
    resnet = torchvision.models.resnet18(num_classes=10).state_dict()
    for name in ("resnet18.pth", "resnet18_encoder.pth"):
        torch.save(resnet, tmp_path / name)
        assert not taesd_weights.detect(tmp_path / name)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "llm")
    assert not taesd_weights.detect(tmp_path / "llm")
    (tmp_path / "junk_encoder.pth").write_bytes(b"not a pickle")
    assert not taesd_weights.detect(tmp_path / "junk_encoder.pth")
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"_class_name": "AutoencoderKL"}))
    (other / "diffusion_pytorch_model.safetensors").write_bytes(b"")
    assert not taesd_weights.detect(other)


def test_encode_decode_shapes_and_bad_input():
    model = TAESD(4, channels=8)
    z = model.encode(torch.rand(2, 3, 24, 16))
    assert z.shape == (2, 4, 3, 2) and model.decode(z).shape == (2, 3, 24, 16)
    with pytest.raises(ValueError, match="divisible by 8"):
        model.encode(torch.rand(1, 3, 20, 16))
    with pytest.raises(ValueError, match=r"\(B, 4, h, w\)"):
        model.decode(torch.rand(1, 16, 2, 2))


def _photos():
    from skimage import data
    for name in ("astronaut", "coffee", "chelsea"):
        im = getattr(data, name)()
        h, w = min(im.shape[0], 256), min(im.shape[1], 256)                      # centre crop, a multiple of 8
        y, x = (im.shape[0] - h) // 2, (im.shape[1] - w) // 2
        yield name, torch.from_numpy(np.ascontiguousarray(im[y:y + h, x:x + w])).permute(2, 0, 1)[None].float() / 255


@pytest.mark.skipif(not TAEF2.is_file(), reason=f"{TAEF2} absent (the shared weights folder is not beside the checkout)")
def test_real_taef2_weights_reconstruct_photographs():
    model = zoo.from_pretrained(TAEF2).eval()          # finds taef2_decoder.pth beside it
    assert model.variant == {"latent_channels": 32, "midblock_gn": True, "channels": 64}
    assert next(model.parameters()).dtype == torch.float32
    for name, x in _photos():
        with torch.no_grad():
            z = model.encode(x)
            y = model.decode(z).clamp(0, 1)
        assert z.shape[1:] == (32, x.shape[2] // 8, x.shape[3] // 8)
        psnr = 10 * torch.log10(1 / (y - x).pow(2).mean()).item()
        assert psnr >= 29.0, f"{name}: {psnr:.2f} dB"
    with pytest.raises(ValueError, match="latent_channels=32"):
        zoo.from_pretrained(TAEF2, latent_channels=16)


@pytest.mark.skipif(not TAEF2.is_file(), reason=f"{TAEF2} absent (the shared weights folder is not beside the checkout)")
def test_save_pretrained_to_a_folder_writes_the_pair_it_came_from(tmp_path):
    """The README's round trip: from_pretrained(taef2_encoder.pth), then save_pretrained(model,
    "out/") writes the same pair (names, file type, fp16 dtype) into the folder, loadable again."""
    model = zoo.from_pretrained(TAEF2)
    out = zoo.save_pretrained(model, tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["taef2_decoder.pth", "taef2_encoder.pth"]
    assert out == tmp_path / "out" / "taef2_encoder.pth"
    for part in ("encoder", "decoder"):
        src = torch.load(TAEF2.with_name(f"taef2_{part}.pth"), weights_only=True)
        mine = torch.load(tmp_path / "out" / f"taef2_{part}.pth", weights_only=True)
        assert src.keys() == mine.keys()
        assert all(mine[k].dtype == src[k].dtype and torch.equal(mine[k], src[k]) for k in src)
    again = zoo.from_pretrained(tmp_path / "out")
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), model.state_dict().values()))
