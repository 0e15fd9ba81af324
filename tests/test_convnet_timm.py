"""ConvNeXt (V1, V2), EfficientNet and MobileNetV3: timm weights in and out (random-init timm models
saved by timm, loaded into Zoo, logits compared; Zoo's export loaded back into timm), the presets'
key layouts, stochastic depth, no bias before BatchNorm, channels-last, repeated units."""
import pytest
import torch
from torch import nn

from conftest import CPU, TEST_DEVICE, assert_channels_last_step_matches
import zoo
from zoo.config import CONVNEXT_ARCHS, EFFICIENTNET_ARCHS, MOBILENETV3_ARCHS, ConfigError, ConvNetConfig
from zoo.convnet import ConvNeXt, EfficientNet, MobileNetV3, build
from zoo.weights import timm_convnet as tw

import timm

PARITY = [("convnext_tiny", ConvNeXt), ("convnextv2_tiny", ConvNeXt), ("efficientnet_b0", EfficientNet),
          ("mobilenetv3_large_100", MobileNetV3)]


def random_timm(arch, seed=0, **kw):
    """timm's model with every tensor drawn at random: conv / linear weights ~ N(0, 1 / fan_in), norms'
    affine params, running statistics, ConvNeXt's layer scale and GRN too (timm starts those at 1 / 0 /
    1e-6 / 0, where a wrong mapping would not show). Built on the meta device: timm's own init is skipped."""
    model = timm.create_model(arch, pretrained=False, device="meta", **kw).to_empty(device=TEST_DEVICE)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            last = name.rsplit(".", 1)[-1]
            if not t.is_floating_point():
                t.zero_()
            elif t.ndim > 1:
                t.copy_(torch.randn(t.shape, generator=g) / (t[0].numel() ** 0.5))
            elif last == "running_var":
                t.copy_(0.5 + torch.rand(t.shape, generator=g))
            else:
                base = 1.0 if last == "weight" and ".grn." not in name else 0.0
                t.copy_(base + 0.2 * torch.randn(t.shape, generator=g))
    return model.eval()


@pytest.mark.parametrize("arch,cls", PARITY, ids=[a for a, _ in PARITY])
def test_timm_weights_in_and_out(tmp_path, arch, cls):
    """timm's file -> Zoo: max |logits diff| <= 1e-5 (fp32, eval, contiguous and channels-last);
    Zoo's export -> timm (strict): the same logits."""
    torch.manual_seed(0)
    ref = random_timm(arch, num_classes=7)
    path = tmp_path / f"{arch}.pth"
    torch.save(ref.state_dict(), path)
    model = zoo.from_pretrained(path)  # arch inferred from the keys and shapes
    assert type(model) is cls and model.config.arch == arch and model.config.num_classes == 7
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(x)
        assert want.abs().max() > 0.1  # not near-zero logits
        assert (model(x) - want).abs().max().item() <= 1e-5
        # channels-last runs other conv kernels (another summation order): 1e-6 of the logits' scale
        cl = model.to(memory_format=torch.channels_last)
        got = cl(x.contiguous(memory_format=torch.channels_last))
        assert (got - want).abs().max().item() <= 1e-6 * max(10.0, want.abs().max().item())
    out = zoo.save_pretrained(model, tmp_path / "export.safetensors")
    back = timm.create_model(arch, pretrained=False, num_classes=7, device="meta").eval()
    back.load_state_dict(tw.read_state_dict(out), strict=True, assign=True)
    with torch.no_grad():
        assert (back(x) - want).abs().max().item() <= 1e-5


# timm's ResNet-C / -D / -T: (name, the Zoo arch it loads as, stem, avg_down)
# and SE / ECA ResNets (channel_attn), ResNeXt among them: (name, the Zoo arch it loads as, stem, avg_down, channel_attn)
RESNET_VARIANTS = [("resnet10t", "resnet18", "deep_tiered", True, "none"), ("resnet18d", "resnet18", "deep", True, "none"),
                   ("resnet26d", "resnet50", "deep", True, "none"), ("resnet50c", "resnet50", "deep", False, "none"),
                   ("resnet50d", "resnet50", "deep", True, "none"), ("seresnet18", "resnet18", "imagenet", False, "se"),
                   ("seresnext26d_32x4d", "resnet50", "deep", True, "se"),
                   ("ecaresnet26t", "resnet50", "deep_tiered", True, "eca")]


@pytest.mark.parametrize("name,arch,stem,avg_down,attn", RESNET_VARIANTS, ids=[v[0] for v in RESNET_VARIANTS])
def test_timm_resnet_deep_stem_and_avg_down_in_and_out(tmp_path, name, arch, stem, avg_down, attn):
    """timm's resnet*c/d/t, seresnet* and ecaresnet* file -> Zoo (stem, shortcut and channel attention read from the
    keys): max |logits diff| <= 1e-5 on an odd size (65: the shortcut's ceil-mode pooling has a partial window);
    Zoo's export -> timm (strict): the same."""
    ref = random_timm(name, num_classes=7)
    path = tmp_path / f"{name}.pth"
    torch.save(ref.state_dict(), path)
    model = zoo.from_pretrained(path)
    c = model.config
    assert (c.arch, c.stem, c.avg_down, c.channel_attn, c.num_classes) == (arch, stem, avg_down, attn, 7)
    x = torch.randn(2, 3, 65, 65, generator=torch.Generator().manual_seed(1))
    back = timm.create_model(name, pretrained=False, num_classes=7, device="meta").eval()
    back.load_state_dict(tw.read_state_dict(zoo.save_pretrained(model, tmp_path / "export.safetensors")),
                         strict=True, assign=True)
    with torch.no_grad():
        want = ref(x)
        assert want.abs().max() > 0.1
        for ours in (model, back):
            assert (ours(x) - want).abs().max().item() <= 1e-5


def test_timm_resnet_s_is_a_one_line_error():
    """resnet50s: a 128-channel deep stem before 64-plane stages, which Zoo's width (stem = stage width) cannot build."""
    with torch.device("meta"):
        sd = timm.create_model("resnet50s", pretrained=False).state_dict()
    with pytest.raises(ValueError, match=r"^r50s: a deep stem of 128 channels before a first stage of 256: timm's "
                                         r"resnet\*s/e .* do not load") as e:
        tw.config_from_state_dict(sd, source="r50s")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("attn", ["none", "se", "eca"])
def test_deep_stem_avg_down_resnet_trains_from_scratch(attn):
    """A digits-sized ResNet-T (deep-tiered stem, average-pool shortcuts; SE or ECA channel attention) built from a
    config takes a training step, channels-last as contiguous (conftest's check)."""
    torch.manual_seed(0)
    cfg = ConvNetConfig(arch="resnet18", layers=[1, 1], width=16, stem="deep_tiered", avg_down=True, in_chans=1,
                        num_classes=10, zero_init_last=False, channel_attn=attn)
    model = build(cfg)
    assert [m.out_channels for m in model.conv1 if isinstance(m, nn.Conv2d)] == [6, 8, 16]
    assert isinstance(model.layer2[0].downsample[0], nn.AvgPool2d)
    x, y = torch.randn(4, 1, 17, 17), torch.tensor([0, 1, 2, 3])
    with torch.no_grad():
        before = nn.functional.cross_entropy(model(x), y).item()
    assert_channels_last_step_matches(model, x, y, 1e-4)  # leaves the contiguous model's gradients
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())  # every tensor learns
    torch.optim.SGD(model.parameters(), lr=0.05).step()
    with torch.no_grad():
        assert nn.functional.cross_entropy(model(x), y).item() < before


def test_timm_folder_names_the_arch_and_safetensors_load(tmp_path):
    from safetensors.torch import save_file
    import json
    ref = random_timm("mobilenetv3_small_075")
    folder = tmp_path / "hub"
    folder.mkdir()
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"architecture": "mobilenetv3_small_075", "num_classes": 1000}))
    model = zoo.from_pretrained(folder)
    assert model.config.arch == "mobilenetv3_small_075"
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        assert (model(x) - ref(x)).abs().max().item() <= 1e-5
    with pytest.warns(UserWarning, match="replaced by a new 4-class head"):
        assert zoo.from_pretrained(folder, num_classes=4).classifier.out_features == 4
    # a model read from a single file, saved to a folder: timm's folder (config.json beside the file's type)
    single = zoo.from_pretrained(zoo.save_pretrained(model, tmp_path / "one.pth"))
    written = zoo.save_pretrained(single, tmp_path / "again")
    assert written.name == "pytorch_model.bin" and (tmp_path / "again" / "config.json").is_file()
    with torch.no_grad():
        assert (zoo.from_pretrained(tmp_path / "again")(x) - ref(x)).abs().max().item() <= 1e-5



def test_a_timm_folder_of_a_tensorflow_port_is_refused(tmp_path):
    """timm's tf_* ports (TensorFlow's SAME padding, BatchNorm eps 1e-3) hold the tensors of the plain model under
    the same names, so they would load and compute something else: a hub folder naming one is a one-line error."""
    import json
    from safetensors.torch import save_file
    ref = random_timm("tf_mobilenetv3_small_100")
    folder = tmp_path / "tf_mobilenetv3_small_100.in1k"
    folder.mkdir()
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"architecture": "tf_mobilenetv3_small_100"}))
    with pytest.raises(ValueError, match=f"^{folder}: tf_mobilenetv3_small_100 is a TensorFlow port") as e:
        zoo.from_pretrained(folder)
    assert "\n" not in str(e.value)

def test_another_architectures_file_is_one_line_error(tmp_path):
    with torch.device("meta"):
        sd = {k: torch.zeros(v.shape, dtype=v.dtype, device=CPU) for k, v in
              build(ConvNetConfig(arch="efficientnet_b0")).state_dict().items()}
    torch.save(sd, tmp_path / "b0.pth")
    for arch, match in [("convnext_tiny", "holds efficientnet weights, which do not load as arch=convnext_tiny"),
                        ("efficientnet_b1", r"do not fit efficientnet_b1 .* missing: blocks\.0\.1\.conv_dw\.weight"), ("resnet9", "unknown arch")]:
        with pytest.raises(ValueError, match=match) as e:
            zoo.from_pretrained(tmp_path / "b0.pth", arch=arch)
        assert "\n" not in str(e.value) and "b0.pth" in str(e.value)


@pytest.mark.parametrize("arch", ["resnet18", "convnext_atto", "efficientnet_b0", "mobilenetv3_small_050"])
def test_a_bad_key_given_with_a_headless_file_is_named(tmp_path, arch):
    """A headless timm file (num_classes=0) loaded with num_classes=0, which a Zoo ConvNet cannot take, is the one-line
    error naming that key, whichever way the file's shape is found (EfficientNet / MobileNetV3: by trying presets)."""
    torch.save(timm.create_model(arch, num_classes=0).state_dict(), tmp_path / "m.pth")
    with pytest.raises(ConfigError, match="num_classes must be > 0, got 0") as e:
        zoo.from_pretrained(tmp_path / "m.pth", num_classes=0)
    assert "\n" not in str(e.value)


def test_reshaped_export_loads_back_as_it_is(tmp_path):
    """A digits-sized model (stride-1 stem, width multiplier no preset has, a ResNet-T's stem) saved by Zoo comes back
    the same."""
    for cfg in [ConvNetConfig(arch="efficientnet_b0", width_mult=0.25, depth_mult=0.3, stem="small", in_chans=1,
                              num_classes=10),
                ConvNetConfig(arch="convnextv2_tiny", layers=[1, 1], width=8, stem="small", num_classes=3),
                ConvNetConfig(arch="resnet18", layers=[1, 1], width=16, stem="deep_tiered", avg_down=True,
                              num_classes=3)]:
        model = build(cfg).eval()
        zoo.save_pretrained(model, tmp_path / "m.safetensors")
        back = zoo.from_pretrained(tmp_path / "m.safetensors")
        assert back.config == model.config
        x = torch.randn(2, cfg.in_chans, 16, 16)
        with torch.no_grad():
            assert torch.equal(back(x), model(x))


HELD_OUT = ["convnext_atto", "convnextv2_pico", "efficientnet_b3", "mobilenetv3_large_075", "mobilenetv3_small_050"]


@pytest.mark.parametrize("arch", HELD_OUT)
def test_a_size_without_a_preset_loads_from_its_shapes(tmp_path, arch):
    """timm's file of a size whose preset is removed here loads from its shapes alone (another preset
    reshaped) with timm's logits (<= 1e-5) and exports back to timm; by name it is that preset."""
    ref = random_timm(arch, num_classes=7)
    path = tmp_path / f"{arch}.pth"
    torch.save(ref.state_dict(), path)
    named = zoo.from_pretrained(path, arch=arch)
    assert named.config.arch == arch
    table = next(t for t in (CONVNEXT_ARCHS, EFFICIENTNET_ARCHS, MOBILENETV3_ARCHS) if arch in t)
    saved = dict(table)
    del table[arch]
    try:
        model = zoo.from_pretrained(path)
    finally:  # put back in its own order: the docs list the table in that order
        table.clear()
        table.update(saved)
    assert model.config.arch != arch
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    back = timm.create_model(arch, pretrained=False, num_classes=7, device="meta").eval()
    back.load_state_dict(tw.read_state_dict(zoo.save_pretrained(model, tmp_path / "export.safetensors")), strict=True,
                         assign=True)
    with torch.no_grad():
        want = ref(x)
        assert want.abs().max() > 0.1
        for ours in (named, model, back):
            assert (ours(x) - want).abs().max().item() <= 1e-5


@pytest.mark.parametrize("arch", sorted(CONVNEXT_ARCHS) + sorted(EFFICIENTNET_ARCHS) + sorted(MOBILENETV3_ARCHS))
def test_every_preset_has_timms_key_layout(arch):
    """Every size (xxlarge too) by its structure on the meta device: timm's names and shapes, its LayerNorm
    epsilons, and the preset inferred back from the shapes."""
    with torch.device("meta"):
        timm_model, model = timm.create_model(arch, pretrained=False), build(ConvNetConfig(arch=arch))
        ref, ours = timm_model.state_dict(), model.state_dict()
        sd = {k: torch.empty(v.shape, device="meta") for k, v in ref.items()}
        assert tw.config_from_state_dict(sd).arch == arch  # inferred from the keys and shapes
    assert list(ours) == list(ref)
    assert all(ours[k].shape == ref[k].shape for k in ref)
    eps = [sorted(n.eps for n in m.modules() if isinstance(n, nn.LayerNorm)) for m in (timm_model, model)]
    assert eps[0] == eps[1]


# ----------------------------------------------------------------------------- structure
SMALL = {"convnext": ConvNetConfig(arch="convnext_tiny", layers=[2, 2], width=8, stem="small", num_classes=3),
         "convnextv2": ConvNetConfig(arch="convnextv2_tiny", layers=[2, 2], width=8, stem="small", num_classes=3),
         "efficientnet": ConvNetConfig(arch="efficientnet_b0", width_mult=0.25, depth_mult=0.5, num_classes=3),
         "mobilenetv3": ConvNetConfig(arch="mobilenetv3_small_100", width_mult=0.25, num_classes=3)}


@pytest.mark.parametrize("name", sorted(SMALL))
def test_drop_path_rises_linearly_and_units_are_the_blocks(name):
    model = build(ConvNetConfig(**{**SMALL[name].__dict__, "drop_path_rate": 0.3}))
    units = model.checkpoint_units()
    rates = [u.drop_path.drop_prob for u in units if hasattr(u, "drop_path") and getattr(u, "has_skip", True)]
    assert rates and max(rates) <= 0.3 and rates == sorted(rates) and len(set(rates)) > 1
    assert model.repeated_units() == units
    blocks = [m for m in model.modules() if type(m).__name__ in ("ConvNeXtBlock", "MBConv", "DepthwiseSeparable",
                                                                  "ConvBnAct")]
    assert units == blocks  # every block, in the order the forward runs them


@pytest.mark.parametrize("name", ["efficientnet", "mobilenetv3"])
def test_no_conv_feeding_batchnorm_has_a_bias(name):
    from test_convnet import conv_bn_pairs
    model = build(SMALL[name])
    pairs = conv_bn_pairs(model)
    assert len(pairs) > 5 and all(conv.bias is None for conv, _ in pairs)
    assert len(pairs) == sum(isinstance(m, nn.BatchNorm2d) for m in model.modules())


@pytest.mark.parametrize("name", sorted(SMALL))
def test_channels_last_training_step_matches_contiguous(name):
    torch.manual_seed(0)
    cfg = ConvNetConfig(**{**SMALL[name].__dict__, "zero_init_last": False})
    # the last stages batch-normalise 4 values (batch 4 at 1x1): summation-order differences of the two
    # layouts' kernels grow there well past round-off (hence 2e-3); a layout bug moves them by O(1)
    assert_channels_last_step_matches(build(cfg), torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 2, 0]), 2e-3)


def test_config_errors_name_the_key():
    with pytest.raises(ConfigError, match=r"model.width_mult applies to efficientnet and mobilenetv3 archs, not resnet18"):
        zoo.build({"family": "convnet", "model": {"arch": "resnet18", "width_mult": 0.5}})
    with pytest.raises(ConfigError, match=r"model.groups applies to resnet archs, not convnext_tiny"):
        zoo.build({"family": "convnet", "model": {"arch": "convnext_tiny", "groups": 2}})
    with pytest.raises(ConfigError, match="arch must be one of"):
        zoo.build({"family": "convnet", "model": {"arch": "efficientnet_b9"}})
    with pytest.raises(ConfigError, match=r"model.stem='deep' applies to resnet archs, not convnext_tiny"):
        zoo.build({"family": "convnet", "model": {"arch": "convnext_tiny", "stem": "deep"}})
    with pytest.raises(ConfigError, match=r"model.avg_down applies to resnet archs, not efficientnet_b0"):
        zoo.build({"family": "convnet", "model": {"arch": "efficientnet_b0", "avg_down": True}})
    with pytest.raises(ConfigError, match=r"model.channel_attn applies to resnet archs, not mobilenetv3_small_100"):
        zoo.build({"family": "convnet", "model": {"arch": "mobilenetv3_small_100", "channel_attn": "se"}})
    with pytest.raises(ConfigError, match=r"model.stem='deep_tiered' needs a width divisible by 8 .*got 12"):
        zoo.build({"family": "convnet", "model": {"arch": "resnet18", "stem": "deep_tiered", "width": 12}})


def test_flops_match_the_papers_figures():
    """Forward multiply-adds at the papers' resolutions: ConvNeXt-T 4.5 G (224), EfficientNet-B0 0.39 G
    (224), MobileNetV3-Large 0.22 G (224), as published."""
    for arch, gmacs, tol in [("convnext_tiny", 4.5, 0.1), ("efficientnet_b0", 0.39, 0.02),
                             ("mobilenetv3_large_100", 0.22, 0.015)]:
        with torch.device("meta"):
            model = build(ConvNetConfig(arch=arch))
        assert abs(model.flops_per_image(224) / 6 / 1e9 - gmacs) < tol, arch


def test_torchvision_convnext_in_and_out(tmp_path):
    """torchvision's ConvNeXt-T file (features.* / classifier.*, layer scales (C, 1, 1); random init, every tensor
    drawn) -> Zoo as convnext_tiny: max |logits diff| <= 1e-5 (fp32, eval); Zoo's export is torchvision's layout again
    (loads strictly, the same logits), and the classification task's init_from reads it too."""
    import torchvision
    ref = torchvision.models.convnext_tiny(num_classes=7).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for t in ref.state_dict().values():
            t.copy_(torch.randn(t.shape, generator=g) * (0.5 if t.dim() < 2 else t[0].numel() ** -0.5))
    torch.save(ref.state_dict(), tmp_path / "convnext_tiny.pth")
    model = zoo.from_pretrained(tmp_path / "convnext_tiny.pth")
    assert (model.config.arch, model.config.num_classes) == ("convnext_tiny", 7)
    back = torchvision.models.convnext_tiny(num_classes=7).eval()
    back.load_state_dict(torch.load(zoo.save_pretrained(model, tmp_path / "export.pth")), strict=True)
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(x)
        assert want.abs().max() > 0.1 and all((m(x) - want).abs().max().item() <= 1e-5 for m in (model, back))
    assert tw.kind_of(tw.read_state_dict(tmp_path / "convnext_tiny.pth")) == "convnext"  # what init_from reads
