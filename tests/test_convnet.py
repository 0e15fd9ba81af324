"""ResNet family: timm/torchvision parity and weight round trips, stochastic depth, no bias
before BatchNorm, channels-last, config errors."""
import pytest
from conftest import assert_channels_last_step_matches
import torch
from torch import nn

import zoo
from zoo.blocks.drop_path import DropPath, drop_path, linear_drop_rates
from zoo.config import RESNET_ARCHS, ConfigError, ConvNetConfig
from zoo.convnet import Bottleneck, ConvNetBase, ResNet
from zoo.weights import timm_convnet as rw

import timm


def randomize_bn(model, seed=0):
    """Non-trivial BatchNorm affine params and running stats, so a wrong BN mapping shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                n = m.num_features
                m.weight.copy_(1 + 0.2 * torch.randn(n, generator=g))
                m.bias.copy_(0.1 * torch.randn(n, generator=g))
                m.running_mean.copy_(0.1 * torch.randn(n, generator=g))
                m.running_var.copy_(0.5 + 1.5 * torch.rand(n, generator=g))
    return model


# ----------------------------------------------------------------------------- parity
@pytest.mark.parametrize("arch,suffix", [("resnet18", ".pth"), ("resnet50", ".safetensors")])
def test_timm_parity_contiguous_and_channels_last(tmp_path, arch, suffix):
    ref = randomize_bn(timm.create_model(arch, pretrained=False)).eval()
    path = tmp_path / f"{arch}{suffix}"
    if suffix == ".pth":
        torch.save(ref.state_dict(), path)
    else:
        from safetensors.torch import save_file
        save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(path))
    model = zoo.from_pretrained(path)  # arch inferred from the keys
    assert isinstance(model, ResNet) and model.config.arch == arch and not model.training
    x = torch.randn(2, 3, 128, 128, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref(x)
        got = model(x)
        assert (got - want).abs().max().item() <= 1e-4  # fp32 tolerance
        model = model.to(memory_format=torch.channels_last)
        assert model.conv1.weight.is_contiguous(memory_format=torch.channels_last)
        got_cl = model(x.contiguous(memory_format=torch.channels_last))
        assert (got_cl - want).abs().max().item() <= 1e-4
    assert want.abs().max() > 1.0  # the comparison is not between near-zero logits


def test_torchvision_layout_loads_and_arch_is_inferred(tmp_path):
    import torchvision as tv
    ref = randomize_bn(tv.models.resnet18(num_classes=10)).eval()
    torch.save({"model": ref.state_dict()}, tmp_path / "tv.pth")  # torchvision references' wrapper
    model = zoo.from_pretrained(tmp_path / "tv.pth")
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        assert (model(x) - ref(x)).abs().max().item() <= 1e-4
    # ResNeXt / wide variants: groups and width per group come from conv2's shape
    for name, arch in [("resnext50_32x4d", "resnext50_32x4d"), ("wide_resnet50_2", "wide_resnet50_2")]:
        with torch.device("meta"):
            sd = getattr(tv.models, name)().state_dict()
        assert rw.config_from_state_dict(sd).arch == arch


@pytest.mark.parametrize("arch", sorted(RESNET_ARCHS))
def test_every_preset_has_the_reference_key_layout(arch):
    import torchvision as tv
    with torch.device("meta"):
        ref = getattr(tv.models, arch)().state_dict()
        ours = ResNet(ConvNetConfig(arch=arch)).state_dict()
        inferred = rw.config_from_state_dict(ref)
    assert inferred.arch == arch
    assert list(ours) == list(ref)
    assert all(ours[k].shape == ref[k].shape for k in ref)


def test_export_round_trip_keeps_the_timm_layout(tmp_path):
    ref = randomize_bn(timm.create_model("resnet18", num_classes=5)).eval()
    model = ResNet(ConvNetConfig(arch="resnet18", num_classes=5))
    rw.load_into(model, ref.state_dict())
    for name in ("out.safetensors", "out.pth", "folder"):
        zoo.save_pretrained(model, tmp_path / name)
        back = rw.read_state_dict(tmp_path / name)
        assert sorted(back) == sorted(ref.state_dict())  # safetensors stores keys sorted
        assert all(torch.equal(back[k], v) for k, v in ref.state_dict().items())
        fresh = timm.create_model("resnet18", num_classes=5)
        fresh.load_state_dict(back, strict=True)  # timm takes the export as is
    assert (tmp_path / "folder" / "config.json").is_file()
    assert zoo.from_pretrained(tmp_path / "folder").config.num_classes == 5


def test_new_num_classes_replaces_the_head_with_a_warning(tmp_path):
    ref = timm.create_model("resnet18").eval()
    torch.save(ref.state_dict(), tmp_path / "r18.pth")
    with pytest.warns(UserWarning, match="replaced by a new 7-class head"):
        model = zoo.from_pretrained(tmp_path / "r18.pth", arch="resnet18", num_classes=7)
    assert model.fc.weight.shape == (7, 512)
    assert torch.equal(model.layer4[1].conv2.weight, ref.layer4[1].conv2.weight)
    # a headless checkpoint (timm num_classes=0) also gets a fresh head
    torch.save(timm.create_model("resnet18", num_classes=0).state_dict(), tmp_path / "headless.pth")
    with pytest.warns(UserWarning, match="no classifier"):
        assert zoo.from_pretrained(tmp_path / "headless.pth", num_classes=3).fc.out_features == 3


def test_bad_weights_are_one_error_listing_the_keys(tmp_path):
    sd = timm.create_model("resnet18").state_dict()
    torch.save(sd, tmp_path / "r18.pth")
    with pytest.raises(ValueError, match=r"missing: layer1\.2\.conv1\.weight") as e:
        zoo.from_pretrained(tmp_path / "r18.pth", arch="resnet34")
    assert "\n" not in str(e.value) and "r18.pth" in str(e.value)
    bad = dict(sd)
    bad["layer2.0.conv1.weight"] = torch.zeros(128, 64, 5, 5)
    bad["extra.weight"] = torch.zeros(3)
    torch.save(bad, tmp_path / "bad.pth")
    with pytest.raises(ValueError) as e:
        zoo.from_pretrained(tmp_path / "bad.pth")
    msg = str(e.value)
    assert "mis-shaped" in msg and "layer2.0.conv1.weight (128, 64, 5, 5)" in msg and "unexpected: extra.weight" in msg
    assert "\n" not in msg
    torch.save(timm.create_model("resnet50s").state_dict(), tmp_path / "r50s.pth")  # resnet*c/d/t load; s/e do not
    with pytest.raises(ValueError, match="r50s.pth: a deep stem of 128 channels"):
        zoo.from_pretrained(tmp_path / "r50s.pth")


def test_detect_claims_resnets_only(tmp_path):
    from safetensors.torch import save_file
    torch.save(timm.create_model("resnet18", num_classes=0).state_dict(), tmp_path / "r.pth")
    assert rw.detect(tmp_path / "r.pth")
    # TAESD: a flat nn.Sequential state dict
    taesd = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Sequential(nn.Conv2d(8, 8, 3), nn.BatchNorm2d(8)))
    torch.save(taesd.state_dict(), tmp_path / "taesd_encoder.pth")
    assert not rw.detect(tmp_path / "taesd_encoder.pth")
    # a Hugging Face LLM folder
    hf = tmp_path / "hf"
    hf.mkdir()
    save_file({"model.embed_tokens.weight": torch.zeros(4, 2), "model.layers.0.mlp.down_proj.weight": torch.zeros(2, 2)},
              str(hf / "model.safetensors"))
    (hf / "config.json").write_text('{"model_type": "llama"}')
    assert not rw.detect(hf)
    (tmp_path / "notes.txt").write_text("conv1.weight")
    assert not rw.detect(tmp_path / "notes.txt")
    shared = __import__("conftest").SHARED / "weights" / "taef2_encoder.pth"
    if shared.exists():
        assert not rw.detect(shared)


# ----------------------------------------------------------------------------- stochastic depth
def test_drop_path_rates_follow_the_linear_rule():
    cfg = ConvNetConfig(arch="resnet50", drop_path_rate=0.2)
    with torch.device("meta"):
        model = ResNet(cfg)
    rates = [blk.drop_path.drop_prob for stage in model.stages() for blk in stage]
    n = sum(cfg.resolved_layers)
    assert len(rates) == n == 16
    assert rates == pytest.approx([0.2 * i / (n - 1) for i in range(n)])
    assert rates[0] == 0.0 and rates[-1] == pytest.approx(0.2)
    assert linear_drop_rates(1, 0.3) == [0.0]


def test_drop_path_is_identity_at_eval_and_unbiased_in_training():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 16, generator=g)
    p = 0.3
    m = DropPath(p).eval()
    assert torch.equal(m(x), x)
    # each draw: a sample is either all zeros or x / keep, never a mix
    draws = torch.stack([drop_path(x, p, True, generator=g) for _ in range(4000)])  # (K, 8, 16)
    kept = (draws != 0).any(-1)  # (K, 8)
    assert torch.allclose(draws[kept], (x / (1 - p)).expand(4000, 8, 16)[kept], rtol=1e-6, atol=0)
    assert (draws[~kept] == 0).all()
    # the dropped fraction is p: binomial standard error sqrt(p(1-p)/n) = 0.0026 for n = 32000
    assert abs((~kept).float().mean().item() - p) < 5 * (p * (1 - p) / kept.numel()) ** 0.5
    # the mean over K draws is x: each element's draw has std |x| sqrt(p / (1 - p)), so the mean's
    # standard error is |x| sqrt(p / (1 - p) / K); 5 standard errors leave ~1e-6 false-alarm odds per element
    se = x.abs() * (p / (1 - p) / draws.shape[0]) ** 0.5
    assert ((draws.mean(0) - x).abs() <= 5 * se).all()
    # and a biased variant (no rescaling) would fail the same check
    assert not ((draws.mean(0) * (1 - p) - x).abs() <= 5 * se).all()


def test_resnet_block_drops_its_branch_per_sample():
    torch.manual_seed(0)
    blk = Bottleneck(64, 16, drop_path=0.5)  # identity shortcut (64 -> 64 channels)
    randomize_bn(blk)
    blk.eval()
    x = torch.randn(64, 64, 4, 4)
    with torch.no_grad():
        full = blk(x)
        ref = Bottleneck(64, 16)
        ref.load_state_dict(blk.state_dict())
        ref.eval()
        b = ref.bn3(ref.conv3(ref.act2(ref.bn2(ref.conv2(ref.act1(ref.bn1(ref.conv1(x))))))))
        assert torch.equal(full, ref(x))  # eval: deterministic, no drop
        blk.drop_path.train()  # only the DropPath in training mode: BN keeps its running stats
        out = blk(x)
    dropped = torch.relu(x)
    kept = torch.relu(b / 0.5 + x)
    is_drop = (out - dropped).flatten(1).abs().amax(1) < 1e-6
    is_kept = (out - kept).flatten(1).abs().amax(1) < 1e-5
    assert (is_drop ^ is_kept).all()
    assert 10 < is_drop.sum() < 54  # ~32 of 64 dropped; P(outside) < 1e-6


# ----------------------------------------------------------------------------- structure
def conv_bn_pairs(model: nn.Module):
    """(conv, bn) module pairs where the conv's output feeds the BatchNorm in the traced graph."""
    gm = torch.fx.symbolic_trace(model)
    mods = dict(gm.named_modules())
    pairs = []
    for node in gm.graph.nodes:
        if node.op == "call_module" and isinstance(mods[node.target], nn.BatchNorm2d):
            src = node.args[0]
            if src.op == "call_module" and isinstance(mods[src.target], nn.Conv2d):
                pairs.append((mods[src.target], mods[node.target]))
    return pairs


CONFIGS = [ConvNetConfig(arch=a, stem=s) for a in ("resnet18", "resnet34", "resnet50", "resnet101", "resnet152")
           for s in ("imagenet", "small")] + [ConvNetConfig(arch="resnext50_32x4d"), ConvNetConfig(arch="wide_resnet50_2")] \
    + [ConvNetConfig(arch="resnet50", stem="deep", avg_down=True), ConvNetConfig(arch="resnet18", stem="deep_tiered")]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.arch}-{c.stem}")
def test_no_conv_feeding_batchnorm_has_a_bias(cfg):
    with torch.device("meta"):
        model = ResNet(cfg)
    pairs = conv_bn_pairs(model)
    n_convs = sum(isinstance(m, nn.Conv2d) for m in model.modules())
    assert len(pairs) == n_convs > 0  # every conv of a ResNet feeds a BN: the walk found them all
    assert all(conv.bias is None for conv, _ in pairs)


def test_the_bias_check_catches_a_biased_conv():
    with torch.device("meta"):
        model = ResNet(ConvNetConfig(arch="resnet18", num_classes=4))
        model.layer2[0].conv2 = nn.Conv2d(128, 128, 3, padding=1, bias=True)
    assert any(conv.bias is not None for conv, _ in conv_bn_pairs(model))


def test_zero_init_last_makes_blocks_start_as_identity():
    torch.manual_seed(0)
    model = ResNet(ConvNetConfig(arch="resnet18", layers=[2, 1], width=8, stem="small", num_classes=3))
    blk = model.layer1[1]  # identity shortcut
    assert (blk.bn2.weight == 0).all() and (blk.bn1.weight == 1).all()
    x = torch.relu(torch.randn(2, 8, 6, 6))
    assert torch.equal(blk.eval()(x), x)
    off = ResNet(ConvNetConfig(arch="resnet18", layers=[2, 1], width=8, zero_init_last=False))
    assert (off.layer1[1].bn2.weight == 1).all()


def test_channels_last_training_step_matches_contiguous():
    torch.manual_seed(0)
    cfg = ConvNetConfig(arch="resnet50", layers=[1, 1], width=8, stem="small", num_classes=5, zero_init_last=False)
    assert_channels_last_step_matches(ResNet(cfg), torch.randn(4, 3, 16, 16), torch.tensor([0, 1, 2, 3]), 1e-4)


def test_config_errors_are_one_line():
    with pytest.raises(ConfigError, match="arch must be one of"):
        zoo.build({"family": "convnet", "model": {"arch": "resnet17"}})
    with pytest.raises(ConfigError, match="needs groups=1"):
        zoo.build({"family": "convnet", "model": {"arch": "resnet18", "groups": 32}})
    with pytest.raises(ConfigError, match="drop_path_rate"):
        zoo.build({"family": "convnet", "model": {"drop_path_rate": 1.5}})
    with pytest.raises(ConfigError, match="layers"):
        zoo.build({"family": "convnet", "model": {"layers": [2, 0]}})


def test_build_from_config_files():
    from pathlib import Path
    root = Path(__file__).resolve().parents[1] / "configs" / "convnet"
    files = sorted(root.glob("*.yaml"))
    assert files
    for f in files:
        with torch.device("meta"):
            model = zoo.build(f)
        assert isinstance(model, ConvNetBase)


def test_flops_count_matches_the_known_resnet50_figure():
    with torch.device("meta"):
        model = ResNet(ConvNetConfig(arch="resnet50"))
    # ResNet-50 at 224x224 is 4.1 GMACs forward (He et al. 2015 report 3.8e9 FLOPs counting MACs,
    # without the v1.5 stride move); training is 3 x forward, 2 FLOPs per MAC
    macs = model.flops_per_image(224) / 6
    assert 4.0e9 < macs < 4.2e9
