"""EVA-02 (timm's eva02_* image models) in Zoo's ViT family: timm's random-init models saved by timm, loaded into Zoo
(by name and from the shapes alone) with timm's logits at the file's grid and at another (timm's dynamic_img_size),
exported back and loaded by timm strictly (every eva02 preset's key layout: test_vit's every-preset test); timm's RoPE
table; a short run that learns."""
import math
from pathlib import Path

import pytest
import torch

import zoo
from test_convnet_timm import random_timm
from test_vit import image
from zoo.vit import ViT

import timm

# the tiny one: fused qkv with q_bias, v_bias, packed SwiGLU; the base one: q_proj, k_proj, v_proj and SwiGLU with
# its LayerNorm (fc1_g, fc1_x, norm, fc2), another patch, image size and class count
SHAPES = [("eva02_tiny_patch14_224", dict(embed_dim=128, depth=2, num_heads=2, patch_size=8, img_size=32,
                                          num_classes=5), ".safetensors", (40, 48)),
          ("eva02_base_patch14_224", dict(embed_dim=128, depth=2, num_heads=2, patch_size=7, img_size=35,
                                          num_classes=7), ".pth", (49, 28))]


def timm_eva(tmp_path, arch, kw, suffix):
    """timm's EVA-02 with every tensor drawn at random (its RoPE tables and zero k bias rebuilt), saved as timm
    saves its state dict."""
    ref = random_timm(arch, **kw)
    for m in ref.modules():
        if hasattr(m, "init_non_persistent_buffers"):
            m.init_non_persistent_buffers()
    path = tmp_path / f"{arch}{suffix}"
    if suffix == ".safetensors":
        from safetensors.torch import save_file
        save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, path)
    else:
        torch.save(ref.state_dict(), path)
    return ref.eval(), path


def gap(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return (a - b).abs().max().item()


@pytest.mark.parametrize("arch,kw,suffix,hw", SHAPES, ids=["tiny-fused", "base-unfused-subln"])
def test_timm_eva02_in_and_out(tmp_path, arch, kw, suffix, hw):
    """timm's file -> Zoo, by name and from the shapes alone: max |logits diff| <= 1e-4 (fp32, eval), also at an
    image of another, non-square grid against timm's dynamic_img_size model (the table resampled, RoPE rebuilt);
    Zoo's export -> timm.create_model(arch).load_state_dict(strict=True): the same logits."""
    ref, path = timm_eva(tmp_path, arch, kw, suffix)
    x, other = image(kw["img_size"]), torch.randn(2, 3, *hw, generator=torch.Generator().manual_seed(2))
    dynamic = timm.create_model(arch, pretrained=False, dynamic_img_size=True, **kw).eval()
    dynamic.load_state_dict(ref.state_dict(), strict=True)
    with torch.no_grad():
        want, want_other = ref(x), dynamic(other)
        assert want.abs().max() > 0.1 and want_other.abs().max() > 0.1
        for model in (zoo.from_pretrained(path, arch=arch), zoo.from_pretrained(path)):
            assert isinstance(model, ViT) and model.config.num_classes == kw["num_classes"]
            assert model.spec["rope_ref_grid"] == 16 and not model.spec["k_bias"]
            assert gap(model(x), want) <= 1e-4 and gap(model(other), want_other) <= 1e-4
        model = zoo.from_pretrained(path, arch=arch)
    out = zoo.save_pretrained(model, tmp_path / "export.safetensors")
    back = timm.create_model(arch, pretrained=False, **kw).eval()
    from safetensors.torch import load_file
    back.load_state_dict(load_file(out), strict=True)
    with torch.no_grad():
        assert gap(back(x), want) <= 1e-4


def test_eva02_patch_dropout_draws_as_timm(tmp_path):
    """model.patch_drop_rate 0.5 in training: the same seed keeps the same patches, with their RoPE rows, as timm's
    EVA (logits within 1e-4)."""
    arch, kw, suffix, _ = SHAPES[0]
    ref, path = timm_eva(tmp_path, arch, {**kw, "patch_drop_rate": 0.5}, suffix)
    model = zoo.from_pretrained(path, patch_drop_rate=0.5)
    with torch.no_grad():
        torch.manual_seed(3)
        want = ref.train()(image(32))
        torch.manual_seed(3)
        assert gap(model.train()(image(32)), want) <= 1e-4 and gap(model.eval()(image(32)), want) > 1e-2


def test_a_zoo_built_eva02_exports_to_timm_and_back(tmp_path):
    """An EVA-02 trained a step in Zoo (its q and v biases, sub-LN and table moved off their initial values): the
    export loads into timm strictly with Zoo's logits (1e-4), and back into Zoo with the same tensors."""
    kw = SHAPES[1][1]
    model = zoo.build({"family": "vit", "model": {"arch": "eva02_base_patch14_224", **kw}})
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model(image(35)).square().mean().backward()
    opt.step()
    assert model.blocks[0].attn.q_bias.abs().max() > 0 and model.blocks[0].mlp.norm.bias.abs().max() > 0
    out = zoo.save_pretrained(model.eval(), tmp_path / "zoo.pth")
    back = timm.create_model("eva02_base_patch14_224", pretrained=False, **kw).eval()
    back.load_state_dict(torch.load(out), strict=True)
    again = zoo.from_pretrained(out)
    with torch.no_grad():
        assert gap(back(image(35)), model(image(35))) <= 1e-4
    assert again.config == model.config
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), model.state_dict().values()))


def test_eva02_rope_is_timms():
    """patch_rope with ref_grid: timm's RotaryEmbeddingCat (EVA-02's ref_feat_shape, interleaved pairs) at the
    reference grid and at another, and rope.apply_rope_pairs its apply_rot_embed_cat."""
    from timm.layers.pos_embed_sincos import RotaryEmbeddingCat, apply_rot_embed_cat
    from zoo.blocks.rope import apply_rope_pairs
    from zoo.blocks.vit import patch_rope
    rope = RotaryEmbeddingCat(32, temperature=10000, in_pixels=False, ref_feat_shape=(16, 16))
    x = torch.randn(2, 3, 7 * 9, 32)
    for h, w in ((16, 16), (7, 9)):
        cos, sin = patch_rope(32, h, w, 10000.0, 1, ref_grid=16)
        emb = rope.get_embed((h, w))
        assert gap(torch.cat([sin[1:], cos[1:]], -1), emb) <= 1e-6
        assert torch.equal(cos[0], torch.ones(32)) and torch.equal(sin[0], torch.zeros(32))
    assert gap(apply_rope_pairs(x, cos[1:], sin[1:]), apply_rot_embed_cat(x, emb)) <= 1e-6


def test_eva02_bad_config_is_one_line(tmp_path):
    """EVA-02's RoPE without rope_theta, a LayerNorm inside a GELU MLP, an EVA-02 written as a DINOv3ViTModel
    folder: each a one-line error naming the key."""
    from zoo.weights import hf_vit
    for model, key in (({"arch": "eva02_tiny_patch14_224", "rope_theta": 0}, "rope_ref_grid"),
                       ({"arch": "vit_tiny_patch16_224", "mlp_norm": True}, "mlp_norm")):
        with pytest.raises(Exception, match=key) as err:
            zoo.build({"family": "vit", "model": model})
        assert "\n" not in str(err.value)
    eva = zoo.build({"family": "vit", "model": {"arch": "eva02_tiny_patch14_224", "depth": 1, "num_classes": 0}})
    with pytest.raises(ValueError, match="rope_ref_grid=16 .*k_bias=False") as err:
        hf_vit.save(eva, tmp_path / "hf")
    assert "\n" not in str(err.value)


@pytest.mark.slow
@pytest.mark.parametrize("init", [None, "timm"], ids=["scratch", "timm"])
def test_an_eva02_trains_on_digits(tmp_path, init):
    """configs/vit/vit-tiny-digits.yaml as eva02_tiny_patch14_224 (two blocks, 8x8 patches of 32x32 grey digits)
    through train/run.py's loop, from scratch or from a timm EVA-02 base file (train.init_from: q_proj, k_proj,
    v_proj and sub-LN SwiGLU; its 2x2 grid's table resampled to the digits' 4x4, RoPE at 4x4): the training loss
    falls, the run's weights load back as that EVA-02, and the export of the timm one loads into timm strictly."""
    from train.config import load_run_config
    from train.loop import train
    from train.metrics import read_rows
    over = ["model.arch=eva02_tiny_patch14_224", "model.depth=2"]
    kw = dict(embed_dim=128, depth=2, num_heads=2, patch_size=8, img_size=16, num_classes=3)
    if init:
        _, path = timm_eva(tmp_path, "eva02_base_patch14_224", kw, ".safetensors")
        over = [f"train.init_from={path}"]
    cfg = load_run_config(str(Path(__file__).resolve().parents[1] / "configs/vit/vit-tiny-digits.yaml"),
                          [f"train.out_dir={tmp_path / 'r'}", "train.max_steps=30", "train.eval_every=0",
                           "train.progress=false", "train.samples=false", "train.plot=false", "train.ema_decay=null",
                           "train.log_every=1", "train.batch_size=32", "optim.warmup_steps=3", *over])
    final = train(cfg, log=lambda m: None)
    losses = [r["loss"] for r in read_rows(tmp_path / "r") if "loss" in r]
    assert len(losses) == 30 and math.isfinite(final["val_loss"])
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.1, losses
    model = zoo.from_pretrained(tmp_path / "r" / "model.safetensors")
    assert model.config.arch == ("eva02_base_patch14_224" if init else "eva02_tiny_patch14_224")
    assert model.spec["rope_ref_grid"] == 16 and model.spec["mlp_norm"] == bool(init)
    if init:
        from safetensors.torch import load_file
        back = timm.create_model("eva02_base_patch14_224", pretrained=False, **{**kw, "num_classes": 10})
        back.load_state_dict(load_file(tmp_path / "r" / "export" / path.name), strict=True)
