"""Activation checkpointing policies (zoo/blocks/checkpoint.py), applied from outside to each of the
three families' units (train/builder.py): the same gradients (and BatchNorm statistics) as without
checkpointing, the config keys, and the memory each policy saves as the planner counts it."""
import copy

import pytest
import torch

import zoo
from train import planner
from train.config import TrainConfig, load_run_config
from train.model import apply_runtime
from zoo.config import ConfigError, ConvNetConfig, DiffusionConfig, LLMConfig

POLICIES = [(True, 1), ("full", 2), ("selective", 1), ("selective", 3)]


def with_runtime(model, **k):
    """The model with train: keys (activation_checkpointing, activation_checkpointing_every) applied."""
    return apply_runtime(model, TrainConfig(**k))


def llm(**k):
    return with_runtime(zoo.build(LLMConfig(vocab_size=64, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2,
                                            max_seq_len=16)), **k)


def resnet(**k):
    return with_runtime(zoo.build(ConvNetConfig(arch="resnet18", layers=[1, 1, 1, 1], width=8, stem="small",
                                                in_chans=1, num_classes=10, drop_path_rate=0.1)), **k)


def convnet(arch, **shape):
    """A tiny ConvNet of another kind (ConvNeXt, EfficientNet, MobileNetV3), stochastic depth on."""
    def make(**k):
        return with_runtime(zoo.build(ConvNetConfig(arch=arch, in_chans=1, num_classes=10, drop_path_rate=0.1,
                                                    **shape)), **k)
    return make


def unet(**k):
    return with_runtime(zoo.build(DiffusionConfig(image_size=32, channels=[16, 32], heads=4)), **k)


FAMILIES = {
    "llm": (llm, lambda m, g: m(torch.randint(0, 64, (2, 16), generator=g), torch.randint(0, 64, (2, 16), generator=g))[1]),
    "convnet": (resnet, lambda m, g: m(torch.randn(4, 1, 16, 16, generator=g)).square().mean()),
    "convnextv2": (convnet("convnextv2_tiny", layers=[2, 1], width=8, stem="small"),
                   lambda m, g: m(torch.randn(4, 1, 16, 16, generator=g)).square().mean()),
    "efficientnet": (convnet("efficientnet_b0", width_mult=0.25, depth_mult=0.3),
                     lambda m, g: m(torch.randn(4, 1, 32, 32, generator=g)).square().mean()),
    "mobilenetv3": (convnet("mobilenetv3_small_100", width_mult=0.25),
                    lambda m, g: m(torch.randn(4, 1, 32, 32, generator=g)).square().mean()),
    "diffusion": (unet, lambda m, g: m(torch.randn(3, 4, 4, 4, generator=g), torch.tensor([0, 1, 10]),
                                       torch.tensor([5, 500, 999]), torch.randn(3, 4, 4, 4, generator=g)).mean()),
}


def gradients_and_stats(model, loss_fn):
    torch.manual_seed(1)  # the same dropout / drop-path / label draws on both sides
    loss_fn(model, torch.Generator().manual_seed(0)).backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return grads, {n: b.clone() for n, b in model.named_buffers()}


# the ConvNet kinds beyond ResNet: the selective policy (which keeps conv outputs: an in-place op on one
# is an error) and every other block
CASES = [(f, p, e) for f in ("llm", "convnet", "diffusion") for p, e in POLICIES] + \
        [(f, p, e) for f in ("convnextv2", "efficientnet", "mobilenetv3") for p, e in [("selective", 1), ("full", 2)]]


@pytest.mark.parametrize("family, policy, every", CASES)
def test_each_policy_gives_the_gradients_of_no_checkpointing(family, policy, every):
    build, loss_fn = FAMILIES[family]
    torch.manual_seed(0)
    ref_model = build().train()
    state = copy.deepcopy(ref_model.state_dict())  # before the forward updates its statistics
    ref, ref_stats = gradients_and_stats(ref_model, loss_fn)
    model = build(activation_checkpointing=policy, activation_checkpointing_every=every).train()
    model.load_state_dict(state)
    got, stats = gradients_and_stats(model, loss_fn)
    assert got.keys() == ref.keys() and len(ref) > 0
    assert max((got[k] - ref[k]).abs().max().item() for k in ref) <= 1e-6
    assert all(torch.equal(stats[k], ref_stats[k]) for k in ref_stats)  # BatchNorm updated once


def test_checkpointing_is_off_in_eval_and_without_grad(monkeypatch):
    """torch.utils.checkpoint is entered only by a training block that records gradients: counted
    through the module's own reference to it, and the outputs equal the plain model's."""
    import zoo.blocks.checkpoint as ckpt
    calls = []
    real = ckpt.checkpoint
    monkeypatch.setattr(ckpt, "checkpoint", lambda *a, **k: calls.append(1) or real(*a, **k))
    torch.manual_seed(0)
    plain = llm()
    model = llm(activation_checkpointing="selective")
    model.load_state_dict(plain.state_dict())
    x = torch.randint(0, 64, (1, 8))
    for train, grad in ((False, True), (False, False), (True, False)):
        model.train(train), plain.train(train)
        with torch.set_grad_enabled(grad):
            assert torch.equal(model(x), plain(x))
        assert not calls, (train, grad)
    model.train()
    model(x).sum().backward()
    assert len(calls) == 3  # every block of the 3, in training with gradients


@pytest.mark.parametrize("value, ok", [(True, True), (False, True), ("full", True), ("selective", True),
                                       ("none", True), ("every", False), (2, False)])
def test_config_keys(value, ok):
    base = {"family": "convnet", "model": {"arch": "resnet18"}, "train": {"activation_checkpointing": value}}
    if ok:
        assert load_run_config(None, [], base=base).train.activation_checkpointing == value
    else:
        with pytest.raises(ConfigError, match="train.activation_checkpointing"):
            load_run_config(None, [], base=base)
    with pytest.raises(ConfigError, match="train.activation_checkpointing_every"):
        load_run_config(None, ["train.activation_checkpointing_every=0"], base={"family": "llm"})


@pytest.mark.parametrize("family, key, new", [
    ("llm", "attn_backend", "train.attn_backend"), ("llm", "activation_checkpointing", "train.activation_checkpointing"),
    ("llm", "checkpoint_every", "train.activation_checkpointing_every"), ("llm", "chunked_loss", "train.chunked_loss"),
    ("llm", "loss_chunk_size", "train.loss_chunk_size"), ("convnet", "checkpoint_every", "train.activation_checkpointing_every"),
    ("diffusion", "activation_checkpointing", "train.activation_checkpointing")])
def test_a_key_that_moved_to_train_is_a_one_line_error_naming_its_new_place(tmp_path, family, key, new):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"family: {family}\nmodel:\n  {key}: true\n")
    with pytest.raises(ConfigError) as e:
        load_run_config(str(cfg))
    assert str(e.value) == f"{cfg}: model.{key} moved to {new}"


def test_runtime_choices_apply_to_a_built_model_and_can_be_undone():
    """apply_runtime sets the attention backend, checkpointing every n-th unit and the chunked loss;
    the state dict keeps its names; policy none gives every unit its plain forward back."""
    from zoo.blocks.attention import CausalSelfAttention
    model = zoo.build(LLMConfig(vocab_size=64, d_model=32, n_layers=4, n_heads=4, max_seq_len=16))
    keys = list(model.state_dict())
    t = TrainConfig(attn_backend="math", activation_checkpointing="selective", activation_checkpointing_every=2,
                    chunked_loss=False, loss_chunk_size=7)
    apply_runtime(model, t)
    assert {m.backend for m in model.modules() if isinstance(m, CausalSelfAttention)} == {"math"}
    assert ["forward" in u.__dict__ for u in model.checkpoint_units()] == [True, False, True, False]
    assert (model.chunked_loss, model.loss_chunk_size) == (False, 7) and list(model.state_dict()) == keys
    apply_runtime(model, TrainConfig())
    assert not any("forward" in u.__dict__ for u in model.checkpoint_units())
    with pytest.raises(ConfigError, match="train.attn_backend"):
        load_run_config(None, ["train.attn_backend=xformers"], base={"family": "llm"})


@pytest.mark.parametrize("config", ["convnext-digits", "efficientnet-digits", "mobilenetv3-digits"])
def test_planner_plans_the_new_convnets_through_their_units(config):
    """The planner builds each new ConvNet from its config on fake tensors, finds its repeated units
    (the blocks) and counts less activation memory with every block checkpointed."""
    from pathlib import Path
    path = str(Path(__file__).resolve().parents[1] / "configs" / "convnet" / f"{config}.yaml")
    none = planner.plan(load_run_config(path, ["train.batch_size=8"]))
    full = planner.plan(load_run_config(path, ["train.batch_size=8", "train.activation_checkpointing=full"]))
    with torch.device("meta"):
        units = zoo.build(path).checkpoint_units()
    assert len(none.per_layer_activations) == len(units) > 2
    assert sum(full.per_layer_activations) < sum(none.per_layer_activations)


def test_planner_sees_what_each_policy_saves():
    base = {"family": "llm", "model": {"vocab_size": 256, "d_model": 64, "n_layers": 4, "n_heads": 4, "max_seq_len": 128},
            "data": {"tokenizer": "bytes", "seq_len": 128}, "train": {"batch_size": 4, "precision": "fp32"}}
    acts = {}
    for name, over in {"none": [], "selective": ["train.activation_checkpointing=selective"],
                       "every 2": ["train.activation_checkpointing=full", "train.activation_checkpointing_every=2"],
                       "full": ["train.activation_checkpointing=true"]}.items():
        p = planner.plan(load_run_config(None, over, base=base))
        acts[name] = sum(p.per_layer_activations)
    assert acts["full"] < acts["every 2"] < acts["none"]
    assert acts["full"] < acts["selective"] < acts["none"]
