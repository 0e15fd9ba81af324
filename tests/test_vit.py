"""The vision transformers: timm's ViT, DeiT (distilled) and ViTs with registers at random init, saved by timm,
loaded into Zoo (by name and from the shapes alone) with timm's logits, exported back and loaded by timm strictly;
the position table resampled as timm does; every preset with timm's key layout."""
import math
from pathlib import Path

import pytest
import torch

import zoo
from conftest import TEST_DEVICE
from test_convnet_timm import random_timm
from zoo.config import VIT_ARCHS, ViTConfig
from zoo.vit import ViT
from zoo.weights import timm_vit

import timm

TINY = dict(embed_dim=128, depth=2, num_heads=2, patch_size=8, img_size=32, num_classes=5)  # head width 64
HELD_OUT = [("vit_small_patch16_224", {}, ".pth"), ("deit_tiny_distilled_patch16_224", {}, ".safetensors"),
            ("vit_small_patch14_reg4_dinov2", dict(patch_size=7, img_size=28), ".safetensors"),
            ("vit_base_patch16_reg4_gap_256", {}, ".pth"), ("vit_base_patch16_clip_224", {}, ".safetensors"),
            # a 3 x 3 grid and 4 registers: 9 table rows read either as that grid or as a 2 x 2 grid plus 5 prefix rows
            ("vit_small_patch14_reg4_dinov2", dict(patch_size=14, img_size=42, in_chans=1), ".safetensors"),
            # attention pooling (timm's global_pool=map: over the patch tokens only), without and with prefix tokens
            ("vit_small_patch16_224", dict(global_pool="map", class_token=False), ".safetensors"),
            ("vit_small_patch16_224", dict(global_pool="map", reg_tokens=2), ".pth")]


def timm_file(tmp_path, arch, suffix, **kw):
    """A random-init timm model and the file timm's state dict is saved to."""
    ref = random_timm(arch, **{**TINY, **kw})
    path = tmp_path / f"{arch}{suffix}"
    if suffix == ".safetensors":
        from safetensors.torch import save_file
        save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, path)
    else:
        torch.save(ref.state_dict(), path)
    return ref, path


def image(size, seed=1, chans=3):
    return torch.randn(2, chans, size, size, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch,kw,suffix", HELD_OUT, ids=[a + "".join(f"-{k}{v}" for k, v in kw.items())
                                                           for a, kw, _ in HELD_OUT])
def test_timm_weights_in_and_out(tmp_path, arch, kw, suffix):
    """timm's file -> Zoo, by name and from the shapes alone: max |logits diff| <= 1e-5 (fp32, eval); Zoo's export
    -> timm (load_state_dict strict): the same logits within 1e-5."""
    ref, path = timm_file(tmp_path, arch, suffix, **kw)
    x = image({**TINY, **kw}["img_size"], chans=kw.get("in_chans", 3))
    with torch.no_grad():
        want = ref(x)
        assert want.abs().max() > 0.1
        for model in (zoo.from_pretrained(path, arch=arch), zoo.from_pretrained(path)):
            assert isinstance(model, ViT) and model.config.num_classes == 5
            assert (model(x) - want).abs().max().item() <= 1e-5
    out = zoo.save_pretrained(model, tmp_path / "export.safetensors")
    back = timm.create_model(arch, pretrained=False, **{**TINY, **kw}).eval()
    from safetensors.torch import load_file
    back.load_state_dict(load_file(out), strict=True)
    with torch.no_grad():
        assert (back(x) - want).abs().max().item() <= 1e-5


def test_deit_distilled_training_gives_timms_two_heads(tmp_path):
    """timm's VisionTransformerDistilled with set_distilled_training(True), in training mode (no dropout): Zoo's
    model of its file returns the same (class head, distillation head) logits within 1e-4 (fp32); in eval mode both
    return the heads' mean; a ViT without the distillation token refuses the switch."""
    ref, path = timm_file(tmp_path, "deit_tiny_distilled_patch16_224", ".safetensors")
    model = zoo.from_pretrained(path)
    ref.set_distilled_training(True)
    model.set_distilled_training(True)
    x = image(32)
    with torch.no_grad():
        want, got = ref.train()(x), model.train()(x)
        assert isinstance(got, tuple) and len(got) == 2 and (want[0] - want[1]).abs().max() > 0.1
        assert all((a - b).abs().max().item() <= 1e-4 for a, b in zip(got, want))
        assert (model.eval()(x) - ref.eval()(x)).abs().max().item() <= 1e-4
    with pytest.raises(ValueError, match="no distillation token"):
        zoo.build({"family": "vit", "model": TINY}).set_distilled_training()


def test_heads_need_the_name_or_num_heads_when_the_width_is_not_a_multiple_of_64(tmp_path):
    """embed_dim 48 (3 heads of 16): from the shapes alone a one-line error naming num_heads=; with it, timm's
    logits within 1e-5; saved to a folder and loaded back, the same config and logits."""
    ref, path = timm_file(tmp_path, "vit_tiny_patch16_224", ".pth", embed_dim=48, num_heads=3)
    with pytest.raises(ValueError, match="num_heads="):
        zoo.from_pretrained(path)
    model = zoo.from_pretrained(path, num_heads=3)
    fresh = zoo.build(model.config).eval()
    zoo.save_pretrained(fresh, tmp_path / "folder")  # a folder: config.json carries the Zoo config, heads included
    again = zoo.from_pretrained(tmp_path / "folder")
    with torch.no_grad():
        assert (model(image(32)) - ref(image(32))).abs().max().item() <= 1e-5
        assert again.config == fresh.config and torch.equal(again(image(32)), fresh(image(32)))


@pytest.mark.parametrize("arch", ["vit_small_patch16_224", "vit_small_patch14_reg4_dinov2"])
def test_position_table_resampled_as_timm(tmp_path, arch):
    """Loaded at img_size 48 (a 6x6 grid from 4x4): pos_embed equals timm's resample_abs_pos_embed; a 40x40 image
    through the 32-pixel model gives timm's dynamic_img_size logits within 1e-5."""
    from timm.layers import resample_abs_pos_embed
    ref, path = timm_file(tmp_path, arch, ".pth", patch_size=8)
    n_prefix = 0 if VIT_ARCHS[arch].get("no_embed_class") else ref.num_prefix_tokens
    big = zoo.from_pretrained(path, img_size=48)
    want = resample_abs_pos_embed(ref.pos_embed, (6, 6), (4, 4), num_prefix_tokens=n_prefix)
    assert big.pos_embed.shape == want.shape and (big.pos_embed - want).abs().max().item() <= 1e-6
    dynamic = timm.create_model(arch, pretrained=False, dynamic_img_size=True, **{**TINY, "patch_size": 8}).eval()
    dynamic.load_state_dict(ref.state_dict(), strict=True)
    with torch.no_grad():
        assert (zoo.from_pretrained(path)(image(40)) - dynamic(image(40))).abs().max().item() <= 1e-5


@pytest.mark.slow
def test_every_preset_has_timms_key_layout():
    """Each preset, built on the meta device, has timm's state-dict names and shapes (timm's model of that name), and
    timm's state dict of that name, read from its shapes alone, gives the preset's structure."""
    for arch in VIT_ARCHS:
        with torch.device("meta"):
            own = timm_vit.to_timm(ViT(ViTConfig(arch=arch)))
        ref = timm.create_model(arch, pretrained=False, device="meta", num_classes=1000).state_dict()
        assert {k: v.shape for k, v in own.items()} == {k: v.shape for k, v in ref.items()}, arch
        assert timm_vit.config_from_state_dict(timm_vit.from_timm(ref)).resolved == ViTConfig(arch=arch).resolved, arch


def test_bad_input_is_one_line(tmp_path):
    """A position table of the wrong length, heads that do not divide the width, an image size that is no
    multiple of the patch size (the model's or a run's data.image_size), RoPE's coordinate augmentation without RoPE
    or with a factor below 1: each a one-line error naming it."""
    from train.builder import new_task
    from train.config import load_run_config
    ref, path = timm_file(tmp_path, "vit_small_patch16_224", ".pth")
    sd = ref.state_dict()
    sd["pos_embed"] = sd["pos_embed"][:, :7]
    torch.save(sd, path)
    with pytest.raises(ValueError, match="pos_embed has 7 rows"):
        zoo.from_pretrained(path)
    with pytest.raises(zoo.ConfigError, match="num_heads"):
        zoo.build({"family": "vit", "model": {"arch": "vit_tiny_patch16_224", "num_heads": 5}})
    with pytest.raises(zoo.ConfigError, match="img_size=36 must be a multiple of patch_size=16"):
        zoo.build({"family": "vit", "model": {"arch": "vit_tiny_patch16_224", "img_size": 36}})
    with pytest.raises(ValueError, match="^model.pos_embed_shift=0.1 moves RoPE's patch centres: needs "
                                         "model.rope_theta > 0$"):
        zoo.build({"family": "vit", "model": {**TINY, "pos_embed_shift": 0.1}})
    with pytest.raises(zoo.ConfigError, match="pos_embed_jitter=0.5 must be 0 or null \\(off\\) or >= 1$"):
        zoo.build({"family": "vit", "model": {**TINY, "rope_theta": 100.0, "pos_embed_jitter": 0.5}})
    cfg = load_run_config(str(Path(__file__).resolve().parents[1] / "configs/vit/vit-tiny-digits.yaml"),
                          ["data.image_size=36"])
    with pytest.raises(zoo.ConfigError, match="data.image_size=36: not a multiple of the ViT's patch size 8, so its "
                                              "position table cannot be laid out on the image$"):
        new_task(cfg, TEST_DEVICE, "fp32", lambda m: None)



# timm ViTs with no Zoo preset, from their shapes alone: (name, its keys, the pooling and fc_norm read)
SHAPES_ONLY = [("vit_medium_patch16_gap_256", {}, "avg", False), ("vit_base_patch16_siglip_224", {}, "map", False),
               ("vit_so400m_patch14_siglip_224", dict(patch_size=7, img_size=28), "map", False),
               ("vit_base_patch16_clip_224", {}, "token", False)]


@pytest.mark.parametrize("arch,kw,pool,fc_norm", SHAPES_ONLY, ids=[a for a, *_ in SHAPES_ONLY])
def test_timm_vits_of_no_preset_load_from_their_shapes(tmp_path, arch, kw, pool, fc_norm):
    """Average pooling after the final norm (fc_norm=False, vit_*_gap_*) and SigLIP's attention pooling (map, the
    so400m's MLP of 4304 / 1152) read from the keys, never the first patch pooled: logits within 1e-5 of timm's (fp32,
    eval), and the export loads in timm strictly with the same."""
    ref, path = timm_file(tmp_path, arch, ".pth", **kw)
    model, x = zoo.from_pretrained(path), image({**TINY, **kw}["img_size"])
    assert (model.spec["global_pool"], model.spec["fc_norm"]) == (pool, fc_norm)
    back = timm.create_model(arch, pretrained=False, **{**TINY, **kw}).eval()
    from safetensors.torch import load_file
    back.load_state_dict(load_file(zoo.save_pretrained(model, tmp_path / "export.safetensors")), strict=True)
    with torch.no_grad():
        assert ref(x).abs().max() > 0.1 and all((m(x) - ref(x)).abs().max().item() <= 1e-5 for m in (model, back))


def test_openai_clip_quickgelu_loads_with_its_activation_named(tmp_path):
    """OpenAI CLIP's image tower (vit_*_clip_quickgelu_*: QuickGELU, x * sigmoid(1.702 x), in no tensor): from its file
    with mlp='quick_gelu' timm's logits within 1e-5 (fp32); without it, not."""
    ref, path = timm_file(tmp_path, "vit_base_patch16_clip_quickgelu_224", ".pth")
    x = image(32)
    with torch.no_grad():
        diffs = [(zoo.from_pretrained(path, **kw)(x) - ref(x)).abs().max().item() for kw in ({"mlp": "quick_gelu"}, {})]
    assert diffs[0] <= 1e-5 < diffs[1], diffs


def test_a_built_vit_without_a_class_token_pools_otherwise():
    """timm refuses global_pool='token' without a class token: so does a Zoo config with a head."""
    with pytest.raises(zoo.ConfigError, match="global_pool.*needs class_token"):
        zoo.build({"family": "vit", "model": {**TINY, "class_token": False}})
    assert zoo.build({"family": "vit", "model": {**TINY, "class_token": False, "num_classes": 0,
                                                 "global_pool": "avg"}}).spec["class_token"] is False


def test_patch_dropout_draws_as_timm(tmp_path):
    """model.patch_drop_rate: in training, the same seed keeps the same patches as timm's PatchDropout (logits within
    1e-5, fp32); in eval nothing is dropped."""
    ref, path = timm_file(tmp_path, "vit_small_patch16_224", ".safetensors", patch_drop_rate=0.5)
    model, x = zoo.from_pretrained(path, patch_drop_rate=0.5), image(32)
    with torch.no_grad():
        assert (model(x) - ref(x)).abs().max().item() <= 1e-5  # eval: every patch
        outs = []
        for m in (ref.train(), model.train()):
            torch.manual_seed(3)
            outs.append(m(x))
        assert (outs[0] - outs[1]).abs().max().item() <= 1e-5 and (outs[1] - ref.eval()(x)).abs().max() > 1e-3


def test_patch_dropout_moves_rope_rows_with_their_patches():
    """With RoPE (DINOv3), each kept patch takes its own rotation: a rate too small to drop a patch still shuffles
    them, and the class token's output is the unshuffled one (1e-5)."""
    model = ViT(ViTConfig("vit_small_patch16_224", embed_dim=64, depth=2, num_heads=2, patch_size=8, img_size=32,
                          rope_theta=100.0, num_classes=3, patch_drop_rate=1e-17))
    x = image(32)
    with torch.no_grad():
        want = model.eval()(x)
        torch.manual_seed(0)
        assert (model.train()(x) - want).abs().max().item() <= 1e-5


def test_layer_decay_and_weight_decay_groups_as_timm():
    """optim.layer_decay on a ViT gives each parameter timm's param_groups_layer_decay LR scale and weight decay
    (no decay on biases, norms, position table and tokens)."""
    from timm.optim._param_groups import param_groups_layer_decay
    from train.optim import param_groups
    ref = random_timm("vit_small_patch16_224", **{**TINY, "depth": 3})
    model = ViT(ViTConfig("vit_small_patch16_224", **{**TINY, "depth": 3}))

    def by_name(m, groups):
        names = {id(p): n for n, p in m.named_parameters()}
        return {names[id(p)]: (g.get("lr_scale", 1.0), g["weight_decay"]) for g in groups for p in g["params"]}
    want = by_name(ref, param_groups_layer_decay(ref, 0.05, ref.no_weight_decay(), layer_decay=0.6))
    assert by_name(model, param_groups(model, 0.05, layer_decay=0.6)) == pytest.approx(want)
    assert len({v for v in want.values()}) > 5


@pytest.mark.parametrize("init", [None, pytest.param("timm", marks=pytest.mark.slow),
                                  pytest.param("dinov3", marks=pytest.mark.slow)], ids=["scratch", "timm", "dinov3"])
def test_a_vit_trains_on_digits_through_the_classification_task(tmp_path, init):
    """configs/vit/vit-tiny-digits.yaml (one block) runs a few steps, from scratch, from a timm ViT's file
    (train.init_from: its structure and 3 channels kept, its 4x4 position grid resampled to the digits' 8x8) or
    from a Hugging Face DINOv3 folder (a fresh head, patch dropout, layer-wise LR decay and RoPE jitter on, the
    folder's RoPE rescale kept): finite losses, and the run's weights load back as that ViT through
    zoo.from_pretrained."""
    from train.config import load_run_config
    from train.loop import train
    over = ["model.depth=1"]
    if init == "timm":
        _, path = timm_file(tmp_path, "vit_small_patch16_224", ".safetensors", patch_size=4, img_size=16)
        over = [f"train.init_from={path}"]
    if init == "dinov3":
        from transformers import DINOv3ViTConfig, DINOv3ViTModel
        DINOv3ViTModel(DINOv3ViTConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, patch_size=8,
                                       num_attention_heads=2, image_size=32)).save_pretrained(tmp_path / "hf")
        over = [f"train.init_from={tmp_path / 'hf'}", "model.patch_drop_rate=0.25", "optim.layer_decay=0.7",
                "model.pos_embed_jitter=1.2"]  # the run's RoPE jitter, the folder's rescale (transformers' 2)
    cfg = load_run_config(str(Path(__file__).resolve().parents[1] / "configs/vit/vit-tiny-digits.yaml"),
                          [f"train.out_dir={tmp_path / 'r'}", "train.max_steps=3", "train.eval_every=0",
                           "train.progress=false", "train.samples=false", "train.plot=false", "train.ema_decay=null",
                           "train.log_every=1", "train.batch_size=16", "optim.warmup_steps=1", *over])
    final = train(cfg, log=lambda m: None)
    assert math.isfinite(final["val_loss"]), final
    model = zoo.from_pretrained(tmp_path / "r" / "model.safetensors")
    assert isinstance(model, ViT) and model.config.num_classes == 10
    assert (model.config.in_chans, model.spec["embed_dim"]) == ((3, 128) if init else (1, 192))
    assert bool(model.spec["rope_theta"]) == (init == "dinov3")
    augment = (model.config.pos_embed_jitter, model.config.pos_embed_rescale)
    assert augment == ((1.2, 2.0) if init == "dinov3" else (None, None))
    if init == "dinov3":  # the export: timm's layout with the Zoo config, the same weights
        back = zoo.from_pretrained(tmp_path / "r" / "export" / "hf-timm")
        assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), model.state_dict().values()))


# ------------------------------------------------------------------ Hugging Face DINOv3 ViT and SigLIP 2 vision

def perturbed(ref, seed=0):
    """ref (eval) with seeded noise added to every parameter: biases, LayerScale and tokens leave their constant
    initial values, so each one's mapping shows in the outputs."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    return ref.eval()


def close(a, b, tol=1e-4) -> bool:
    return a.shape == b.shape and (a - b).abs().max().item() <= tol


DINOV3 = [(dict(), (32, 32)),
          (dict(num_register_tokens=3, use_gated_mlp=True, hidden_act="silu", layerscale_value=0.5, image_size=48,
                key_bias=True), (40, 24)),
          (dict(proj_bias=False, mlp_bias=False, use_gated_mlp=True, hidden_act="silu"), (32, 32))]


@pytest.mark.parametrize("kw,hw", DINOV3, ids=["plain", "registers-swiglu-nonsquare", "no-proj-mlp-biases"])
def test_hf_dinov3_in_and_out(tmp_path, kw, hw):
    """A DINOv3ViTModel folder (random init, perturbed) -> zoo.from_pretrained: last_hidden_state (forward_features)
    and pooler_output (the model's output) within 1e-4 (fp32, eval); Zoo's export -> DINOv3ViTModel.from_pretrained:
    the same outputs within 1e-4; a key bias that became non-zero is written with key_bias set."""
    from transformers import DINOv3ViTConfig, DINOv3ViTModel
    cfg = DINOv3ViTConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                          patch_size=8, **{"image_size": 32, **kw})
    perturbed(DINOv3ViTModel(cfg)).save_pretrained(tmp_path / "hf")
    ref = DINOv3ViTModel.from_pretrained(tmp_path / "hf").eval()
    model, x = zoo.from_pretrained(tmp_path / "hf"), torch.randn(2, 3, *hw, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(pixel_values=x)
        assert want.last_hidden_state.shape[1] == 1 + cfg.num_register_tokens + hw[0] * hw[1] // 64
        assert close(model.forward_features(x), want.last_hidden_state) and close(model(x), want.pooler_output)
        model.blocks[0].attn.qkv.bias[64:128] += 0.5  # the key bias, as training could leave it
        ours = model.forward_features(x)
    zoo.save_pretrained(model, tmp_path / "out")
    back = DINOv3ViTModel.from_pretrained(tmp_path / "out").eval()
    assert back.config.key_bias and back.config.num_register_tokens == cfg.num_register_tokens
    assert (back.config.proj_bias, back.config.mlp_bias) == (cfg.proj_bias, cfg.mlp_bias)  # zeros stay unwritten
    with torch.no_grad():
        assert close(back(pixel_values=x).last_hidden_state, ours)
        assert not close(ours, want.last_hidden_state)  # the changed bias reached the export


AUGMENT = dict(pos_embed_shift=0.2, pos_embed_jitter=1.5, pos_embed_rescale=3.0)  # transformers' defaults: -, -, 2


def test_hf_dinov3_rope_augmentation_draws_as_transformers(tmp_path):
    """A DINOv3ViTModel folder with its RoPE coordinate augmentation set -> Zoo carries the three values; in training
    (no dropout or drop path), the same seed draws the same shift, jitter and rescale (one per batch, in that order):
    last_hidden_state within 1e-4 (fp32) and away from the eval output; Zoo's export -> DINOv3ViTModel and Zoo again:
    the same values."""
    from transformers import DINOv3ViTConfig, DINOv3ViTModel
    cfg = DINOv3ViTConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                          patch_size=8, image_size=32, num_register_tokens=2, **AUGMENT)
    perturbed(DINOv3ViTModel(cfg)).save_pretrained(tmp_path / "hf")
    ref = DINOv3ViTModel.from_pretrained(tmp_path / "hf").train()
    model, x = zoo.from_pretrained(tmp_path / "hf").train(), image(24)[..., :16]  # a 3x2 grid
    assert {k: getattr(model.config, k) for k in AUGMENT} == AUGMENT
    with torch.no_grad():
        for seed in (0, 1):
            outs = []
            for m in (ref, model):
                torch.manual_seed(seed)
                outs.append(m(pixel_values=x).last_hidden_state if m is ref else m.forward_features(x))
            assert close(*outs)
        assert not close(outs[1], model.eval().forward_features(x), 1e-3)
    back = DINOv3ViTModel.from_pretrained(zoo.save_pretrained(model, tmp_path / "out"))
    assert {k: getattr(back.config, k) for k in AUGMENT} == AUGMENT
    assert {k: getattr(zoo.from_pretrained(tmp_path / "out").config, k) for k in AUGMENT} == AUGMENT
    DINOv3ViTModel(DINOv3ViTConfig(**{**cfg.to_dict(), **dict.fromkeys(AUGMENT)})).save_pretrained(tmp_path / "off")
    off = zoo.from_pretrained(tmp_path / "off").train()
    with torch.no_grad():
        assert torch.equal(off.forward_features(x), off.eval().forward_features(x))


def test_rope_augmentation_moves_the_centres_in_training_only():
    """model.pos_embed_*: two training forwards differ, eval forwards equal the unaugmented model's; off (null or
    0), training equals eval. The centres: a shift within +-shift per axis, a jitter within [1/j, j] per axis, one
    rescale within [1/r, r] for both, each log-uniform (the mean log factor near 0)."""
    from zoo.blocks.vit import augment_coords
    rope = dict(TINY, rope_theta=100.0, init_values=0.1, num_classes=3)
    x = image(32)
    with torch.no_grad():
        model = ViT(ViTConfig(**rope, **AUGMENT)).train()
        assert not torch.equal(model(x), model(x))
        plain = ViT(ViTConfig(**rope, pos_embed_shift=0.0, pos_embed_jitter=0.0))
        plain.load_state_dict(model.state_dict())
        assert torch.equal(model.eval()(x), plain.eval()(x)) and torch.equal(plain.train()(x), plain.eval()(x))
    grid = torch.tensor([[-0.5, -0.75], [0.5, 0.25]])
    torch.manual_seed(0)
    moved = torch.stack([augment_coords(grid, shift=0.2) - grid for _ in range(500)])
    assert torch.allclose(moved[:, 0], moved[:, 1], atol=1e-6) and not torch.allclose(moved[:, 0, 0], moved[:, 0, 1])
    assert 0.19 < moved.abs().max() <= 0.2 + 1e-6
    for kw, bound in ((dict(jitter=1.5), 1.5), (dict(rescale=3.0), 3.0)):
        log = torch.stack([augment_coords(grid, **kw) / grid for _ in range(2000)]).log()
        assert torch.allclose(log[:, 0], log[:, 1], atol=1e-5) and log.abs().max() <= math.log(bound) + 1e-5
        assert log.abs().max() > 0.99 * math.log(bound) and log.mean().abs() < 0.05
        same_axes = torch.allclose(log[:, 0, 0], log[:, 0, 1], atol=1e-5)
        assert same_axes == ("rescale" in kw), kw


def patchify(img, p):
    """(C, H, W) -> (H/p * W/p, p*p*C): SigLIP 2's processor's patches, row-major, each (p, p, C) flattened."""
    C, H, W = img.shape
    return img.reshape(C, H // p, p, W // p, p).permute(1, 3, 2, 4, 0).reshape(-1, p * p * C)


@pytest.mark.parametrize("num_patches,act,whole", [(16, "gelu_pytorch_tanh", False), (36, "gelu", True)],
                         ids=["4x4-table", "6x6-table-whole-siglip2"])
def test_hf_siglip2_naflex_in_and_out(tmp_path, num_patches, act, whole):
    """A Siglip2VisionModel folder (random init, perturbed; or a whole Siglip2Model's vision tower) -> Zoo: a NaFlex
    batch of two non-square grids (3x5 and 6x2 patches, padded to 16 and masked), the table resized up and down:
    last_hidden_state (padding included) and the attention-pooled output within 1e-4 (fp32, eval); an image fed
    whole gives the outputs of its patches; Zoo's export -> Siglip2VisionModel.from_pretrained: the same within 1e-4."""
    from transformers import Siglip2Config, Siglip2Model, Siglip2VisionConfig, Siglip2VisionModel
    vision = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4, patch_size=8,
                  num_patches=num_patches, hidden_act=act)
    if whole:
        text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, vocab_size=100,
                    bos_token_id=None, eos_token_id=None, pad_token_id=None)
        perturbed(Siglip2Model(Siglip2Config(text_config=text, vision_config=vision))).save_pretrained(tmp_path / "hf")
    else:
        perturbed(Siglip2VisionModel(Siglip2VisionConfig(**vision))).save_pretrained(tmp_path / "hf")
    ref = Siglip2VisionModel.from_pretrained(tmp_path / "hf").eval()
    model, g, shapes = zoo.from_pretrained(tmp_path / "hf"), torch.Generator().manual_seed(1), [(3, 5), (6, 2)]
    imgs = [torch.randn(3, h * 8, w * 8, generator=g) for h, w in shapes]
    pixels, mask = torch.zeros(2, 16, 192), torch.zeros(2, 16, dtype=torch.long)
    for i, img in enumerate(imgs):
        pixels[i, :len(patchify(img, 8))], mask[i, :len(patchify(img, 8))] = patchify(img, 8), 1
    spatial = torch.tensor(shapes)
    with torch.no_grad():
        want = ref(pixel_values=pixels, pixel_attention_mask=mask, spatial_shapes=spatial)
        assert close(model.forward_features(pixels, spatial, mask), want.last_hidden_state)
        assert close(model(pixels, spatial, mask), want.pooler_output)
        one = ref(pixel_values=patchify(imgs[0], 8)[None], pixel_attention_mask=torch.ones(1, 15, dtype=torch.long),
                  spatial_shapes=spatial[:1])
        assert close(model.forward_features(imgs[0][None]), one.last_hidden_state)
        assert close(model(imgs[0][None]), one.pooler_output)
    zoo.save_pretrained(model, tmp_path / "out")
    back = Siglip2VisionModel.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        again = back(pixel_values=pixels, pixel_attention_mask=mask, spatial_shapes=spatial)
    assert close(again.last_hidden_state, want.last_hidden_state) and close(again.pooler_output, want.pooler_output)


def test_hf_vit_bad_input_is_one_line(tmp_path):
    """An activation Zoo has no MLP for, a NaFlex image of more patches than the batch holds, a classifier the HF
    class cannot hold: each a one-line error naming it."""
    from transformers import DINOv3ViTConfig, DINOv3ViTModel
    cfg = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, patch_size=8)
    DINOv3ViTModel(DINOv3ViTConfig(**cfg, hidden_act="relu")).save_pretrained(tmp_path / "relu")
    with pytest.raises(ValueError, match="hidden_act='relu'"):
        zoo.from_pretrained(tmp_path / "relu")
    DINOv3ViTModel(DINOv3ViTConfig(**cfg)).save_pretrained(tmp_path / "hf")
    with pytest.warns(UserWarning, match="10-class head"):
        model = zoo.from_pretrained(tmp_path / "hf", num_classes=10)
    with pytest.raises(ValueError, match="num_classes=10"):
        zoo.save_pretrained(model, tmp_path / "out")
    siglip = ViT(ViTConfig(**{**TINY, "num_classes": 0}, class_token=False, no_embed_class=True, global_pool="map"))
    with pytest.raises(ValueError, match="4x5 patches does not fit in 16"):
        siglip(torch.zeros(1, 16, 192), torch.tensor([[4, 5]]), torch.ones(1, 16))


def test_zoo_built_dinov3_and_siglip2_shapes_save_and_load(tmp_path):
    """Built in Zoo (RoPE + registers + SwiGLU with a head; attention pooling + bilinear table): zoo.save_pretrained
    writes timm's layout with the config, which loads back with the same logits; hf_vit.save writes the headless
    RoPE model as a folder DINOv3ViTModel loads, its last_hidden_state Zoo's within 1e-4."""
    from transformers import DINOv3ViTModel
    from zoo.weights import hf_vit
    dino = dict(rope_theta=100.0, reg_tokens=2, mlp="swiglu", init_values=0.1, no_embed_class=True, norm_eps=1e-5,
                pos_embed_shift=0.1, pos_embed_rescale=0.0)  # rescale off: null in the HF config
    siglip = dict(class_token=False, no_embed_class=True, global_pool="map", mlp="gelu_tanh", pos_interp="bilinear")
    x = torch.randn(2, 3, 32, 24, generator=torch.Generator().manual_seed(1))
    for i, kw in enumerate((dino, siglip)):
        model = zoo.build({"family": "vit", "model": {**TINY, **kw}}).eval()
        again = zoo.from_pretrained(zoo.save_pretrained(model, tmp_path / f"m{i}.safetensors"))
        assert again.config == model.config
        with torch.no_grad():
            assert torch.equal(again(x), model(x))
    encoder = zoo.build({"family": "vit", "model": {**TINY, **dino, "num_classes": 0}}).eval()
    back = DINOv3ViTModel.from_pretrained(hf_vit.save(encoder, tmp_path / "hf")).eval()
    assert (back.config.pos_embed_shift, back.config.pos_embed_jitter, back.config.pos_embed_rescale) == (0.1, None,
                                                                                                           None)
    with torch.no_grad():
        assert close(back(pixel_values=x).last_hidden_state, encoder.forward_features(x))


@pytest.mark.slow
def test_a_vit_run_resumes_bitwise_after_sigkill(tmp_path, one_thread):
    """vit-tiny-digits.yaml with patch dropout, stochastic depth and layer-wise LR decay, SIGKILLed in a fresh
    process while it writes its step-4 checkpoint, then resumed from step 2 here: the loss curve and the final
    weights of an uninterrupted run, bitwise."""
    import signal
    from safetensors.torch import load_file
    from conftest import killed_at_checkpoint
    from test_reliability import finish, launch
    from train.config import load_run_config
    from train.loop import train
    from train.metrics import read_rows
    over = ["model.depth=2", "model.patch_drop_rate=0.3", "model.drop_path_rate=0.2", "optim.layer_decay=0.7",
            "train.max_steps=4", "train.checkpoint_every=2", "train.keep_checkpoints=3", "train.eval_every=0",
            "train.progress=false", "train.samples=false", "train.plot=false", "train.log_every=1",
            "train.batch_size=16", "optim.warmup_steps=1"]
    config = Path(__file__).resolve().parents[1] / "configs/vit/vit-tiny-digits.yaml"
    killed = tmp_path / "killed"
    assert finish(launch(config, killed, *over, env=killed_at_checkpoint(tmp_path, 4))) == -signal.SIGKILL, \
        (killed / "stderr-0.txt").read_text()
    for out in (killed, tmp_path / "whole"):
        train(load_run_config(str(config), [f"train.out_dir={out}", *over]), log=lambda m: None)
    losses = [[(r["step"], r["loss"]) for r in read_rows(d) if "loss" in r] for d in (tmp_path / "whole", killed)]
    assert losses[0] == losses[1] and [s for s, _ in losses[0]] == [1, 2, 3, 4]
    a, b = (load_file(d / "model.safetensors") for d in (tmp_path / "whole", killed))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
