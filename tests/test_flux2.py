"""FLUX.2 transformer: diffusers Flux2Transformer2DModel folders in and out, FLUX.2's position ids, the config rules.

Parity: random-init diffusers models (weights N(0, 0.2) so that every path carries signal), saved by diffusers,
loaded by Zoo, and Zoo's export loaded back by diffusers: fp32 outputs max |diff| <= 1e-4 (what remains is
summation order).
"""
import json

import pytest
import torch

import zoo
from zoo.blocks.mmdit import positions
from zoo.config import ConfigError, Flux2Config
from zoo.diffusion.flux2 import Flux2

import diffusers
from diffusers.pipelines.flux2.pipeline_flux2 import Flux2Pipeline

SHAPES = {  # (double, single blocks, heads x head_dim, rope axes, text width, guidance), (text tokens, latent h x w)
    "one-each": (dict(num_layers=1, num_single_layers=1, num_attention_heads=2, attention_head_dim=16,
                      axes_dims_rope=(4, 4, 4, 4), in_channels=8, joint_attention_dim=12, guidance_embeds=False),
                 (1, 3, 3)),
    "deeper": (dict(num_layers=3, num_single_layers=4, num_attention_heads=3, attention_head_dim=16,
                    axes_dims_rope=(2, 6, 4, 4), in_channels=12, out_channels=8, joint_attention_dim=20,
                    guidance_embeds=True, mlp_ratio=2.0, rope_theta=100), (7, 4, 6)),
}


def reference(kw, seed=0):
    torch.manual_seed(seed)
    ref = diffusers.Flux2Transformer2DModel(**kw).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.2)
    return ref


def inputs(kw, L, h, w, B=2):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(B, h * w, kw["in_channels"], generator=g)
    c = torch.randn(B, L, kw["joint_attention_dim"], generator=g)
    img_ids = Flux2Pipeline._prepare_latent_ids(torch.zeros(B, 1, h, w))
    txt_ids = Flux2Pipeline._prepare_text_ids(c)
    guidance = torch.tensor([3.5, 1.0]) if kw["guidance_embeds"] else None
    return dict(hidden_states=x, encoder_hidden_states=c, timestep=torch.tensor([0.25, 0.9]), img_ids=img_ids,
                txt_ids=txt_ids, guidance=guidance)


@pytest.mark.parametrize("name", list(SHAPES))
def test_diffusers_folder_loads_with_the_same_outputs_and_exports_back(name, tmp_path):
    kw, (L, h, w) = SHAPES[name]
    ref = reference(kw)
    ref.save_pretrained(tmp_path / "ref")
    model = zoo.from_pretrained(tmp_path / "ref")
    assert isinstance(model, Flux2) and len(model.double_blocks) == kw["num_layers"]
    assert model.config.guidance == kw["guidance_embeds"]
    args = inputs(kw, L, h, w)
    with torch.no_grad():
        want = ref(**args).sample
        got = model(**args)
    assert got.shape == want.shape and (got - want).abs().max() <= 1e-4, (got - want).abs().max()
    zoo.save_pretrained(model, tmp_path / "zoo")
    back = diffusers.Flux2Transformer2DModel.from_pretrained(tmp_path / "zoo").eval()
    with torch.no_grad():
        assert (back(**args).sample - want).abs().max() <= 1e-4
    # Zoo's own position ids are FLUX.2's: unbatched, the same output
    txt, img = positions(L, h, w)
    assert torch.equal(txt, args["txt_ids"][0]) and torch.equal(img, args["img_ids"][0])
    with torch.no_grad():
        assert torch.equal(model(**{**args, "img_ids": img, "txt_ids": txt}), got)


def test_guidance_changes_the_output_only_when_embedded(tmp_path):
    kw, (L, h, w) = SHAPES["deeper"]
    model = Flux2(Flux2Config(double_depth=1, single_depth=1, heads=2, head_dim=16, rope_axes=(4, 4, 4, 4),
                              in_channels=12, text_dim=20, guidance=True))
    args = inputs(kw, L, h, w)
    with torch.no_grad():
        a, b = model(**args), model(**{**args, "guidance": args["guidance"] * 2})
    assert (a - b).abs().max() > 1e-3


def test_a_sharded_folder_loads(tmp_path):
    """A transformer folder diffusers wrote in shards (diffusion_pytorch_model.safetensors.index.json, as FLUX.2's
    larger checkpoints come) is recognised, loads with the same outputs (1e-4), and a listed shard missing is named."""
    kw, (L, h, w) = SHAPES["one-each"]
    ref = reference(kw)
    ref.save_pretrained(tmp_path, max_shard_size="50KB")
    assert (tmp_path / "diffusion_pytorch_model.safetensors.index.json").is_file()
    args = inputs(kw, L, h, w)
    with torch.no_grad():
        assert (zoo.from_pretrained(tmp_path)(**args) - ref(**args).sample).abs().max() <= 1e-4
    next(tmp_path.glob("diffusion_pytorch_model-*.safetensors")).unlink()
    with pytest.raises(FileNotFoundError, match="shard listed in diffusion_pytorch_model.safetensors.index.json"):
        zoo.from_pretrained(tmp_path)


def test_bad_folders_and_configs_are_one_line_errors(tmp_path):
    kw, _ = SHAPES["one-each"]
    reference(kw).save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "patch_size": 2}))
    with pytest.raises(ValueError, match="patch_size=2"):
        zoo.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "num_single_layers": 2}))
    with pytest.raises(ValueError, match="do not match config.json"):
        zoo.from_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="rope_axes"):
        Flux2(Flux2Config(head_dim=16, rope_axes=(4, 4, 4, 2)))
