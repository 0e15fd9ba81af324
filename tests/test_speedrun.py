"""The speedrun's ideas as LLM config fields (ReLU^2 MLP, value embeddings, U-net skips, zero-initialised output
projections, the head's own LR) and configs/llm/speedrun.yaml."""
import math
from pathlib import Path

import pytest
import torch
from conftest import TEST_DEVICE

import zoo
from train.config import OptimConfig, load_run_config
from train.loop import train
from train.model_parallel import refusal
from train.optim import build_optimizer, set_lr
from zoo.blocks.mlp import ReLU2MLP
from zoo.config import LLMConfig
from zoo.llm import LLM
from zoo.weights.hf_llm import record_for

ROOT = Path(__file__).resolve().parents[1]
BASE = dict(vocab_size=64, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=32)
ALL_ON = dict(mlp="relu2", value_embeds=1, unet_skips=True, zero_init_out=True, tie_embeddings=False)
IDS = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))


def build(**over) -> LLM:
    torch.manual_seed(0)
    return LLM(LLMConfig(**BASE, **over))


def test_defaults_leave_the_model_unchanged():
    """Naming the new fields at their defaults builds the same tensors and logits as not naming them (same seed)."""
    plain = build()
    named = build(mlp="swiglu", value_embeds=0, unet_skips=False, zero_init_out=False)
    a, b = plain.state_dict(), named.state_dict()
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert not any(k.startswith(("value_", "skip_")) or ".mlp.up." in k for k in a)
    assert torch.equal(plain(IDS), named(IDS))


def test_relu2_mlp_is_ungated_and_four_wide():
    m = build(mlp="relu2")
    mlp = m.layers[0].mlp
    assert isinstance(mlp, ReLU2MLP) and mlp.up.weight.shape == (4 * 32, 32) and mlp.down.weight.shape == (32, 4 * 32)
    x = torch.randn(3, 32)
    assert torch.allclose(mlp(x), torch.relu(x @ mlp.up.weight.t()) ** 2 @ mlp.down.weight.t(), atol=1e-6)


def test_zero_init_makes_every_block_the_identity_and_still_learns():
    m = build(zero_init_out=True)
    x = torch.randn(2, 12, 32)
    cos, sin = m.rope_tables(x, 12)[0]
    for block in m.layers:
        assert torch.equal(block(x, cos, sin)[0], x)
    assert torch.allclose(m(IDS), m.logits(m.final_norm(m.embed(IDS))))
    m(IDS, targets=IDS)[1].backward()
    assert all(b.attn.proj.weight.grad.abs().sum() > 0 for b in m.layers)  # a zero matrix still gets a gradient


def _reduces_to_plain(key: str, name: str, **over):
    """With parameter `name` at zero the model computes what the plain model with the same other tensors does;
    at its init it does not."""
    m, plain = build(**{key: over.pop("value", True)}, **over), build(**over)
    plain.load_state_dict({k: v for k, v in m.state_dict().items() if not k.startswith(("value_", "skip_"))})
    assert not torch.allclose(m(IDS), plain(IDS), atol=1e-4)
    with torch.no_grad():
        getattr(m, name).zero_()
    assert torch.allclose(m(IDS), plain(IDS), atol=1e-6)


def test_unet_skips_at_zero_are_the_plain_model():
    m = build(unet_skips=True)
    assert m.skip_weights.shape == (2,) and torch.equal(m.skip_weights, torch.ones(2))
    _reduces_to_plain("unet_skips", "skip_weights")


def test_value_embeddings_feed_the_first_and_last_layers():
    m = build(value_embeds=1)
    assert m.config.value_embed_layers() == [0, 3] and len(m.value_embeds) == 1
    assert m.value_embeds[0].weight.shape == (64, 2 * 8) and m.value_lambdas.shape == (2,)
    assert set(m.value_embeddings(IDS)) == {0, 3}
    _reduces_to_plain("value_embeds", "value_lambdas", value=1)
    with pytest.raises(Exception, match="value_embeds"):
        LLMConfig(**{**BASE, "n_layers": 1}, value_embeds=1).validate()


def test_decoding_with_caches_matches_the_full_forward():
    m = build(**ALL_ON).eval()
    with torch.no_grad():
        torch.nn.init.normal_(m.layers[0].attn.proj.weight, std=0.02)  # not the identity
        full = m(IDS)
        caches = m.new_caches(2, 12)
        steps = torch.cat([m(IDS[:, t:t + 1], caches=caches, start_pos=t) for t in range(12)], 1)
    assert (steps - full).abs().max() < 1e-5


def test_head_lr_is_its_own_group():
    m = build(tie_embeddings=False)
    for name in ("adamw", "muon"):
        opt = build_optimizer(m, OptimConfig(name=name, lr=1e-3, head_lr=4e-3), TEST_DEVICE, log=lambda s: None)
        head = [g for g in opt.param_groups if any(p is m.lm_head.weight for p in g["params"])]
        assert len(head) == 1 and len(head[0]["params"]) == 1 and head[0]["lr"] == 4e-3
        set_lr(opt, 5e-4)  # the schedule scales it as it scales lr
        assert head[0]["lr"] == pytest.approx(2e-3)
    with pytest.raises(ValueError, match="optim.head_lr needs an untied head"):
        build_optimizer(build(), OptimConfig(head_lr=4e-3), TEST_DEVICE)


@pytest.mark.slow
def test_compiled_step_equals_eager_with_everything_on():
    m = build(**ALL_ON)
    ref = build(**ALL_ON)
    loss = torch.compile(m, backend="aot_eager")(IDS, targets=IDS)[1]
    ref_loss = ref(IDS, targets=IDS)[1]
    loss.backward()
    ref_loss.backward()
    assert abs(loss.item() - ref_loss.item()) < 1e-5  # the same graph, run op by op
    for (name, p), q in zip(m.named_parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-5), name


def test_saves_to_a_zoo_folder_and_hugging_face_refuses(tmp_path):
    m = build(**ALL_ON)
    with torch.no_grad():
        m.skip_weights.fill_(0.25)
    back = zoo.from_pretrained(zoo.save_pretrained(m, tmp_path / "m"))
    assert (tmp_path / "m" / "config.yaml").is_file() and back.config == m.config
    assert torch.equal(back(IDS), m(IDS))
    for key, value in (("mlp", "relu2"), ("value_embeds", 1), ("unet_skips", True)):
        with pytest.raises(ValueError, match=f"^model.{key}={value}: no Hugging Face class holds"):
            record_for(LLMConfig(**BASE, **{key: value}))


def test_model_parallelism_refuses_the_ideas_across_blocks():
    speedrun = str(ROOT / "configs/llm/speedrun.yaml")
    for par, over in (("pp", ["model.value_embeds=0"]), ("tp", ["model.value_embeds=0", "model.unet_skips=false"])):
        cfg = load_run_config(speedrun, [f"train.parallel={par}", *over])
        key = "unet_skips" if par == "pp" else "mlp"
        assert refusal(cfg, 2).startswith(f"model.{key} does not combine with train.parallel={par}")


@pytest.mark.slow
def test_speedrun_yaml_trains_three_steps(tmp_path, text_corpus):
    cfg = load_run_config(str(ROOT / "configs/llm/speedrun.yaml"),
                          [f"train.out_dir={tmp_path / 'run'}", f"data.path={text_corpus}", "train.max_steps=3",
                           "train.eval_every=0", "train.checkpoint_every=0", "train.average_last=0",
                           "train.progress=false", "train.samples=false", "train.plot=false"])
    final = train(cfg, log=lambda m: None)
    assert final["val_loss"] < math.log(2048)  # below a uniform guess over the vocabulary
    model = zoo.from_pretrained(tmp_path / "run")
    assert model.config.value_embeds == 1 and not torch.equal(model.skip_weights, torch.ones(2))  # trained
