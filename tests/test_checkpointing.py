"""Activation checkpointing policies (zoo/blocks/checkpoint.py) in the three families: the same
gradients (and BatchNorm statistics) as without checkpointing, the config keys, and the memory
each policy saves as the planner counts it."""
import copy

import pytest
import torch

import zoo
from train import plan as planner
from train.config import load_run_config
from zoo.config import ConfigError, ConvNetConfig, DiffusionConfig, LLMConfig

POLICIES = [(True, 1), ("full", 2), ("selective", 1), ("selective", 3)]


def llm(**k):
    return zoo.build(LLMConfig(vocab_size=64, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, max_seq_len=16, **k))


def resnet(**k):
    return zoo.build(ConvNetConfig(arch="resnet18", layers=[1, 1, 1, 1], width=8, stem="small", in_chans=1,
                                   num_classes=10, drop_path_rate=0.1, **k))


def unet(**k):
    return zoo.build(DiffusionConfig(image_size=32, channels=[16, 32], heads=4, **k))


FAMILIES = {
    "llm": (llm, lambda m, g: m(torch.randint(0, 64, (2, 16), generator=g), torch.randint(0, 64, (2, 16), generator=g))[1]),
    "convnet": (resnet, lambda m, g: m(torch.randn(4, 1, 16, 16, generator=g)).square().mean()),
    "diffusion": (unet, lambda m, g: m(torch.randn(3, 4, 4, 4, generator=g), torch.tensor([0, 1, 10]),
                                       torch.tensor([5, 500, 999]), torch.randn(3, 4, 4, 4, generator=g)).mean()),
}


def gradients_and_stats(model, loss_fn):
    torch.manual_seed(1)  # the same dropout / drop-path / label draws on both sides
    loss_fn(model, torch.Generator().manual_seed(0)).backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return grads, {n: b.clone() for n, b in model.named_buffers()}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("policy, every", POLICIES)
def test_each_policy_gives_the_gradients_of_no_checkpointing(family, policy, every):
    build, loss_fn = FAMILIES[family]
    torch.manual_seed(0)
    ref_model = build().train()
    state = copy.deepcopy(ref_model.state_dict())  # before the forward updates its statistics
    ref, ref_stats = gradients_and_stats(ref_model, loss_fn)
    model = build(activation_checkpointing=policy, checkpoint_every=every).train()
    model.load_state_dict(state)
    got, stats = gradients_and_stats(model, loss_fn)
    assert got.keys() == ref.keys() and len(ref) > 0
    assert max((got[k] - ref[k]).abs().max().item() for k in ref) <= 1e-6
    assert all(torch.equal(stats[k], ref_stats[k]) for k in ref_stats)  # BatchNorm updated once


def test_checkpointing_is_off_in_eval_and_without_grad():
    model = llm(activation_checkpointing="selective").eval()
    x = torch.randint(0, 64, (1, 8))
    with torch.no_grad():
        assert model(x).shape == (1, 8, 64)


@pytest.mark.parametrize("value, ok", [(True, True), (False, True), ("full", True), ("selective", True),
                                       ("none", True), ("every", False), (2, False)])
def test_config_keys(value, ok):
    base = {"family": "convnet", "model": {"arch": "resnet18", "activation_checkpointing": value}}
    if ok:
        assert load_run_config(None, [], base=base).model.activation_checkpointing == value
    else:
        with pytest.raises(ConfigError, match="model.activation_checkpointing"):
            load_run_config(None, [], base=base)
    with pytest.raises(ConfigError, match="model.checkpoint_every"):
        load_run_config(None, ["model.checkpoint_every=0"], base={"family": "llm"})


def test_planner_sees_what_each_policy_saves():
    base = {"family": "llm", "model": {"vocab_size": 256, "d_model": 64, "n_layers": 4, "n_heads": 4, "max_seq_len": 128},
            "data": {"tokenizer": "bytes", "seq_len": 128}, "train": {"batch_size": 4, "precision": "fp32"}}
    acts = {}
    for name, over in {"none": [], "selective": ["model.activation_checkpointing=selective"],
                       "every 2": ["model.activation_checkpointing=full", "model.checkpoint_every=2"],
                       "full": ["model.activation_checkpointing=true"]}.items():
        p = planner.plan(load_run_config(None, over, base=base))
        acts[name] = sum(p.per_layer_activations)
    assert acts["full"] < acts["every 2"] < acts["none"]
    assert acts["full"] < acts["selective"] < acts["none"]
