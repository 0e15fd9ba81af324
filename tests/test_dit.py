"""DiT: diffusers DiTTransformer2DModel folders in and out, the config rules, DiT inside LatentDiffusion.

Parity: random-init diffusers models (weights N(0, 0.3) so that every path carries signal; the
diffusers init zeroes the adaLN and output layers), saved by diffusers, loaded by Zoo: fp32 outputs
max |diff| <= 1e-4 (what remains is summation order: SDPA against SDPA, fused against separate q/k/v).
"""
import json
import math

import pytest
import torch

import zoo
from zoo.config import ConfigError, DiffusionConfig, DiTConfig, from_dict
from zoo.diffusion.dit import DiT
from zoo.diffusion.latent import LatentDiffusion

import diffusers

SHAPES = {  # two shapes: (heads, head_dim, C, layers, sample, patch, classes), with and without learned sigma
    "p2-eps": dict(num_attention_heads=2, attention_head_dim=8, in_channels=4, num_layers=2, sample_size=8,
                   patch_size=2, num_embeds_ada_norm=5),
    "p1-sigma": dict(num_attention_heads=3, attention_head_dim=8, in_channels=3, out_channels=6, num_layers=3,
                     sample_size=4, patch_size=1, num_embeds_ada_norm=7, norm_eps=1e-6, attention_bias=False),
}


def reference(kw, seed=0, tie=False):
    torch.manual_seed(seed)
    ref = diffusers.DiTTransformer2DModel(**kw).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.3)
        if tie:  # as every published DiT: the same embedder weights in every block
            first = ref.transformer_blocks[0].norm1.emb.state_dict()
            for b in ref.transformer_blocks[1:]:
                b.norm1.emb.load_state_dict(first)
    return ref


def inputs(kw, B=3):
    S, C, n = kw["sample_size"], kw["in_channels"], kw["num_embeds_ada_norm"]
    g = torch.Generator().manual_seed(1)
    return torch.randn(B, C, S, S, generator=g), torch.tensor([0, 421, 999])[:B], torch.tensor([0, n - 1, n])[:B]


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("tie", [False, True], ids=["per-block", "shared"])
def test_diffusers_folder_loads_with_the_same_outputs_and_exports_back(name, tie, tmp_path):
    kw = SHAPES[name]
    ref = reference(kw, tie=tie)
    ref.save_pretrained(tmp_path / "ref")
    model = zoo.from_pretrained(tmp_path / "ref")
    assert isinstance(model, DiT) and len(model.cond) == (1 if tie else kw["num_layers"])
    assert model.config.learn_sigma == ("out_channels" in kw)
    x, t, y = inputs(kw)
    with torch.no_grad():
        want = ref(x, t, y).sample
        got = model(x, t, y)
    assert got.shape == want.shape and (got - want).abs().max() <= 1e-4, (got - want).abs().max()
    zoo.save_pretrained(model, tmp_path / "zoo")
    back = diffusers.DiTTransformer2DModel.from_pretrained(tmp_path / "zoo").eval()
    assert back.out_channels == ref.out_channels
    with torch.no_grad():
        assert (back(x, t, y).sample - want).abs().max() <= 1e-4
    # a scalar timestep and label broadcast over the batch, as in diffusers
    with torch.no_grad():
        assert torch.equal(model(x, torch.tensor(421), torch.tensor(1)), model(x, torch.full((3,), 421), torch.ones(3, dtype=torch.long)))


def test_a_sharded_folder_loads(tmp_path):
    """A folder diffusers wrote in shards (its index.json naming them) loads with the same outputs (1e-4)."""
    kw = SHAPES["p1-sigma"]
    ref = reference(kw)
    ref.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "diffusion_pytorch_model.safetensors.index.json").is_file()
    x, t, y = inputs(kw)
    with torch.no_grad():
        assert (zoo.from_pretrained(tmp_path)(x, t, y) - ref(x, t, y).sample).abs().max() <= 1e-4


def test_another_grid_size_interpolates_the_position_table_as_diffusers(tmp_path):
    kw = SHAPES["p2-eps"]
    ref = reference(kw, tie=True)
    ref.save_pretrained(tmp_path)
    model = zoo.from_pretrained(tmp_path)
    x = torch.randn(2, 4, 12, 12)
    t, y = torch.tensor([3, 700]), torch.tensor([1, 5])
    with torch.no_grad():
        assert (model(x, t, y) - ref(x, t, y).sample).abs().max() <= 1e-4


@pytest.mark.parametrize("key,value,match", [("norm_type", "ada_norm", "norm_type"),
                                             ("dropout", 0.1, "dropout"),
                                             ("norm_elementwise_affine", True, "norm_elementwise_affine"),
                                             ("upcast_attention", True, "upcast_attention"),
                                             ("activation_fn", "geglu", "activation_fn"),
                                             ("out_channels", 5, "out_channels")])
def test_unsupported_config_is_refused_in_one_line(key, value, match, tmp_path):
    reference(SHAPES["p2-eps"]).save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg[key] = value
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=match) as e:
        zoo.from_pretrained(tmp_path)
    assert "\n" not in str(e.value) and str(tmp_path) in str(e.value)


def test_export_refuses_what_diffusers_cannot_express(tmp_path):
    for opt in ({"qk_norm": True}, {"rope": True}, {"mlp_ratio": 2.0}, {"freq_shift": 0.0}):
        with pytest.raises(ValueError, match=next(iter(opt))):
            zoo.save_pretrained(DiT(DiTConfig(depth=1, width=16, heads=2, **opt), 4, 3, 4), tmp_path)


def test_exact_dit_export_keeps_gelu_variant_and_pipeline_subfolder_loads(tmp_path):
    kw = dict(SHAPES["p2-eps"], activation_fn="gelu")
    ref = reference(kw, tie=True)
    ref.save_pretrained(tmp_path / "pipe" / "transformer")
    (tmp_path / "pipe" / "model_index.json").write_text("{}")
    model = zoo.from_pretrained(tmp_path / "pipe")
    x, t, y = inputs(kw)
    with torch.no_grad():
        assert (model(x, t, y) - ref(x, t, y).sample).abs().max() <= 1e-4
    zoo.save_pretrained(model, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["activation_fn"] == "gelu"


def test_presets_and_config_errors():
    for preset, (depth, width) in {"S": (12, 384), "B": (12, 768), "L": (24, 1024), "XL": (28, 1152)}.items():
        c = DiTConfig(preset=preset)
        assert (c.resolved_depth, c.resolved_width) == (depth, width)
    with torch.device("meta"):  # DiT-XL/2 at 256 px: 675M parameters (the paper's 675M)
        n = DiT(DiTConfig(preset="XL", patch_size=2, learn_sigma=True), 4, 1000, 32).num_params()
    assert abs(n / 1e6 - 675) < 1, n
    for data, match in [({"denoiser": "dit", "dit": {"preset": "M"}}, "dit.preset"),
                        ({"denoiser": "dit", "dit": {"patch_size": 3}},
                         r"model\.dit\.patch_size=3: the latent side 4 \(model\.image_size 32 / 8\) must be divisible by it$"),
                        ({"denoiser": "dit", "dit": {"width": 30, "heads": 4}}, "dit.heads"),
                        ({"denoiser": "dit", "dit": {"learn_sigma": True}, "prediction": "flow",
                          "sampler": "flow_euler"}, "learn_sigma"),
                        ({"prediction": "flow"}, "sampler"), ({"sampler": "flow_euler"}, "sampler")]:
        with pytest.raises(ConfigError, match=match) as e:
            from_dict(DiffusionConfig, data, "x.yaml", "model.")
        assert "\n" not in str(e.value)


def test_dit_in_latent_diffusion_learned_sigma_loss_and_checkpoint_units():
    cfg = from_dict(DiffusionConfig, {"image_size": 16, "autoencoder": {"latent_channels": 4, "channels": 8},
                                      "denoiser": "dit", "dit": {"depth": 2, "width": 32, "heads": 2, "patch_size": 1,
                                                                 "learn_sigma": True}, "sample_steps": 3})
    model = LatentDiffusion(cfg)
    assert model.checkpoint_units() == list(model.denoiser.blocks) == model.repeated_units()
    torch.manual_seed(0)
    for p in model.denoiser.parameters():
        torch.nn.init.normal_(p, std=0.05)
    z, noise = torch.randn(4, 4, 2, 2), torch.randn(4, 4, 2, 2)
    y, t = torch.tensor([0, 1, 2, 10]), torch.tensor([0, 10, 500, 999])
    loss = model(z, y, t, noise)
    mse = model(z, y, t, noise, weighted=False)
    # the learned-sigma part adds a (non-negative at t > 0) VLB term; the MSE is of the eps channels only
    extra = loss - model.schedule.min_snr_weight(t, 5.0, "eps") * mse
    assert (extra[1:] >= 0).all() and extra.abs().sum() > 0
    loss.mean().backward()
    var_w = model.denoiser.final.linear.weight.grad.view(-1, 8, 32)  # (p*p*out_channels, D): rows 4..7 = sigma
    assert var_w[:, 4:].abs().sum() > 0
    images = model.sample(y, generator=torch.Generator().manual_seed(0))
    assert images.shape == (4, 3, 16, 16)


def test_vlb_term_by_hand():
    """KL(q || p) with p's mean exact: 0 when p's variance is the posterior's (v = -1); with v = +1
    (variance beta_t) the closed form 0.5 (-1 + log(beta / beta~) + beta~ / beta), in bits."""
    from zoo.diffusion.schedule import NoiseSchedule, vlb_term
    sched = NoiseSchedule("linear", 1000)
    x0, x_t = torch.randn(2, 4, 2, 2), torch.randn(2, 4, 2, 2)
    t = torch.tensor([10, 700])
    assert vlb_term(sched, -torch.ones_like(x0), x0, x0, x_t, t).abs().max() < 1e-5
    a, a_prev = sched.alphas_cumprod[t], sched.alphas_cumprod[t - 1]
    beta = 1 - a / a_prev
    post = beta * (1 - a_prev) / (1 - a)
    want = 0.5 * (-1 + torch.log(beta / post) + post / beta) / math.log(2)
    assert torch.allclose(vlb_term(sched, torch.ones_like(x0), x0, x0, x_t, t).double(), want, rtol=1e-3)


def test_init_from_a_diffusers_dit_folder_loads_the_denoiser_or_names_the_key(tmp_path):
    """train.init_from=<diffusers DiT folder> (train/tasks/diffusion.py's load_dit_into)."""
    from train.tasks.diffusion import load_dit_into
    src = DiT(DiTConfig(depth=2, width=32, heads=2, patch_size=1), 4, 10, 2)
    with torch.no_grad():
        for p in src.parameters():
            p.normal_(0, 0.05)
    zoo.save_pretrained(src, tmp_path)
    data = {"image_size": 16, "autoencoder": {"latent_channels": 4, "channels": 8}, "denoiser": "dit",
            "dit": {"depth": 2, "width": 32, "heads": 2, "patch_size": 1}}
    model = LatentDiffusion(from_dict(DiffusionConfig, data))
    load_dit_into(model, tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(model.denoiser.state_dict().values(), src.state_dict().values()))
    other = LatentDiffusion(from_dict(DiffusionConfig, {**data, "dit": {**data["dit"], "norm_eps": 1e-5}}))
    with pytest.raises(ValueError, match=r"norm_eps=1e-06; set model.dit.norm_eps=1e-06"):
        load_dit_into(other, tmp_path)
