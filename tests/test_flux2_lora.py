"""LoRA on Zoo's FLUX.2 transformer in diffusers' LoRA file (zoo/weights/diffusers_lora.py), both directions.

Reference: diffusers' Flux2Transformer2DModel at random init (test_flux2.py's shapes), with LoRA through PEFT as
diffusers applies it (`add_adapter`, `Flux2KleinPipeline.load_lora_weights` / `save_lora_weights`). Zoo's adapter
(B non-zero, alpha != r) written by `save_lora` and read by the pipeline gives Zoo's output; a file the pipeline wrote
(with its header's LoRA config and without one, where diffusers takes alpha = r) read by `load_lora` gives what
diffusers computes with it. fp32, max abs diff <= 1e-4; the adapter moves the output by far more.
"""
import json

import pytest
import torch
from torch import nn

import zoo
from train.finish import export_adapter
from zoo.adapters import AdapterConfig, adapters_disabled, apply_adapters, default_targets, known_targets
from train.config import load_run_config
from train.model import build_model
from train.planner import simulate
from zoo.config import ConfigError
from zoo.weights.diffusers_lora import LORA_WEIGHTS, fill_adapter, load_lora, save_lora
from zoo.weights.files import save_safetensors
from zoo.weights.peft_lora import save_adapter

from test_flux2 import SHAPES, inputs, reference
from test_lora import randomize_adapters

import diffusers
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict

TOL = 1e-4


class Holder(nn.Module):
    """A model holding the transformer as its denoiser, as latent diffusion does."""

    def __init__(self, denoiser):
        super().__init__()
        self.denoiser = denoiser


def pipeline(transformer):
    return diffusers.Flux2KleinPipeline(scheduler=None, vae=None, text_encoder=None, tokenizer=None,
                                        transformer=transformer)


def zoo_and_reference(tmp_path, name):
    kw, shape = SHAPES[name]
    ref = reference(kw)
    ref.save_pretrained(tmp_path / "base")
    return zoo.from_pretrained(tmp_path / "base"), ref, inputs(kw, *shape)


@pytest.mark.parametrize("name, kw", [
    ("deeper", dict(method="lora", r=4, alpha=12)),  # the default targets: the attention's
    ("one-each", dict(method="dora", r=2, alpha=3, rslora=True))])  # every linear layer
def test_zoo_lora_loads_in_diffusers_with_zoos_output(tmp_path, name, kw):
    model, ref, args = zoo_and_reference(tmp_path, name)
    cfg = AdapterConfig(**kw, **{} if kw["method"] == "lora" else {"targets": known_targets(model)})
    holder = Holder(model)
    apply_adapters(holder, cfg)
    randomize_adapters(holder)
    f = save_lora(holder, tmp_path / "lora")
    assert f == tmp_path / "lora" / LORA_WEIGHTS
    pipeline(ref).load_lora_weights(tmp_path / "lora")
    with torch.no_grad():
        want, got = ref(**args).sample, model(**args)
        with adapters_disabled(model):
            base = model(**args)
    assert (got - want).abs().max() <= TOL, (got - want).abs().max()
    assert (got - base).abs().max() > 100 * TOL  # the adapter shows in the output
    # and it reads back into Zoo: the same adapter
    again = load_lora(zoo.from_pretrained(tmp_path / "base"), f)
    got_cfg = again.adapter_config
    assert got_cfg.targets == sorted(default_targets(model, cfg.targets)) and got_cfg.alpha == cfg.alpha
    with torch.no_grad():
        assert (again(**args) - got).abs().max() <= TOL


@pytest.mark.parametrize("metadata", [True, False])
def test_diffusers_lora_loads_into_zoo(tmp_path, metadata):
    model, ref, args = zoo_and_reference(tmp_path, "deeper")
    single = [f"single_transformer_blocks.{i}.attn.to_out" for i in range(len(ref.single_transformer_blocks))]
    targets = ["to_k", "to_q", "to_v", "to_out.0", "to_qkv_mlp_proj", *single] if metadata else \
        ["transformer_blocks.1.attn.to_q", "to_out.0", "linear_in", single[2]]  # some blocks only
    ref.add_adapter(LoraConfig(r=4, lora_alpha=2, target_modules=targets))
    randomize_adapters(ref)
    meta = {"transformer_lora_adapter_metadata": ref.peft_config["default"].to_dict()} if metadata else {}
    diffusers.Flux2KleinPipeline.save_lora_weights(tmp_path / "d", get_peft_model_state_dict(ref), **meta)
    if not metadata:  # what diffusers computes with the file: alpha = r
        ref = reference(SHAPES["deeper"][0])
        pipeline(ref).load_lora_weights(tmp_path / "d")
    holder = load_lora(Holder(model), tmp_path / "d")
    with torch.no_grad():
        want, got = ref(**args).sample, model(**args)
        with adapters_disabled(model):
            base = model(**args)
    assert (got - want).abs().max() <= TOL, (got - want).abs().max()
    assert (got - base).abs().max() > 100 * TOL
    cfg = holder.adapter_config
    assert (cfg.r, cfg.alpha) == (4, 2.0 if metadata else 4.0)
    # a run's adapter starts from the file (adapter.init_from), and its export is diffusers' file again
    fresh = zoo.from_pretrained(tmp_path / "base")
    apply_adapters(fresh, AdapterConfig(method="lora", r=4, alpha=cfg.alpha, targets=cfg.targets))
    fill_adapter(fresh, tmp_path / "d" / LORA_WEIGHTS)
    with torch.no_grad():
        assert torch.equal(fresh(**args), got)
    exported = export_adapter(fresh, tmp_path / "run", None)
    assert exported == tmp_path / "run" / "adapter" / LORA_WEIGHTS
    with torch.no_grad():
        assert torch.equal(load_lora(zoo.from_pretrained(tmp_path / "base"), exported)(**args), got)
    other = apply_adapters(zoo.from_pretrained(tmp_path / "base"),
                           AdapterConfig(method="lora", r=4, targets=cfg.targets))  # alpha: the default
    with pytest.raises(ValueError, match=rf"differs from adapter 'default': alpha={cfg.alpha} \(the adapter's: 16.0\)"):
        fill_adapter(other, tmp_path / "d")


def test_adapter_init_from_a_peft_folder(tmp_path, device):
    over = ["model.n_layers=1", "model.d_model=32", "train.batch_size=2", "data.seq_len=16", "adapter.method=lora",
            "adapter.r=2", "adapter.alpha=5"]
    llm = build_model(load_run_config("configs/llm/tiny.yaml", over))
    randomize_adapters(llm)
    save_adapter(llm, tmp_path / "a")
    cfg = load_run_config("configs/llm/tiny.yaml", [*over, f"adapter.init_from={tmp_path / 'a'}"])
    fresh = build_model(cfg)
    simulate(cfg, device)  # the planner builds it on fake tensors
    ids = torch.randint(0, 2048, (2, 8))
    with torch.no_grad():
        assert torch.equal(fresh(ids), llm(ids))
    with pytest.raises(ConfigError, match=r"adapter.init_from: .*adapter_config.json: .*alpha=5.0 \(the adapter's: 6"):
        build_model(load_run_config("configs/llm/tiny.yaml", [*over, "adapter.alpha=6",
                                                             f"adapter.init_from={tmp_path}/a"]))


def test_foreign_and_inconsistent_files_are_one_line_errors(tmp_path):
    model, _, _ = zoo_and_reference(tmp_path, "one-each")
    kohya = {"lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight": torch.zeros(2, 32)}
    save_safetensors(kohya, tmp_path / "k.safetensors")
    with pytest.raises(ValueError, match="k.safetensors: lora_unet_double.*not diffusers' LoRA file"):
        load_lora(model, tmp_path / "k.safetensors")
    a = "transformer.transformer_blocks.0.attn."
    ranks = {a + "to_q.lora_A.weight": torch.zeros(2, 32), a + "to_q.lora_B.weight": torch.zeros(32, 2),
             a + "to_k.lora_A.weight": torch.zeros(3, 32), a + "to_k.lora_B.weight": torch.zeros(32, 3)}
    save_safetensors(ranks, tmp_path / "r.safetensors")
    with pytest.raises(ValueError, match=r"r.safetensors: LoRA ranks \[2, 3\]"):
        load_lora(model, tmp_path / "r.safetensors")
    bad = {a + "to_q.lora_A.weight": torch.zeros(2, 32), a + "to_q.lora_B.weight": torch.zeros(31, 2)}
    save_safetensors(bad, tmp_path / "b.safetensors", {"lora_adapter_metadata": json.dumps({"transformer.r": 2})})
    with pytest.raises(ValueError, match=r"b.safetensors: does not match .*wrong shape"):
        load_lora(model, tmp_path / "b.safetensors")
