"""DeepSeek-V3.2's indexer training (train.index_loss_coef, train.index_warmup; zoo/blocks/mla.py): the indexers' KL
equals one computed from transformers' attention probabilities and index scores (1e-6, fp32), in the sparse stage
and the dense warm-up; the KL trains only the indexers and the LM loss only the rest; a warm-up run through the loop
lowers the KL and changes no other weight; with the keys off nothing changes; bad combinations name the key."""
import pytest
import safetensors.torch
import torch
from test_hf_arch import CASES, hf_model

import zoo
from train.config import TrainConfig, load_run_config
from train.loop import train
from train.metrics import read_rows
from train.model import apply_runtime
from zoo.config import ConfigError

TINY = dict(vocab_size=256, d_model=32, n_layers=2, n_heads=4, max_seq_len=32,
            mla=dict(kv_rank=16, q_rank=16, rope_dim=4, nope_dim=8, v_dim=8, index_heads=2, index_dim=8, index_topk=6),
            moe=dict(n_experts=4, top_k=2, expert_hidden=32, dense_layers=[0], scoring="sigmoid", balance="bias"))


def hf_kl(hf, x, monkeypatch) -> torch.Tensor:
    """transformers' side: per layer its attention probabilities (eager, output_attentions) summed over heads and
    L1-normalised, and its index scores (taken where its indexer asks for their top-k) over the keys attended ->
    the mean over layers of the mean over queries of KL(p || softmax(index scores))."""
    scores, topk = [], torch.Tensor.topk
    monkeypatch.setattr(torch.Tensor, "topk", lambda t, *a, **k: scores.append(t) or topk(t, *a, **k))
    with torch.no_grad():
        attns = hf(x, output_attentions=True).attentions
    kls = []
    for probs, s in zip(attns, [s for s in scores if s.shape == (*x.shape, x.shape[1])]):  # not the routers'
        p = probs.sum(1) / probs.sum(1).sum(-1, keepdim=True)
        kept = probs.sum(1) > 0
        log_q = s.masked_fill(~kept, float("-inf")).log_softmax(-1)
        kls.append(torch.where(kept, p * (p.log() - log_q), 0.0).sum(-1).mean())
    return torch.stack(kls).mean()


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("warmup", [False, True])
def test_kl_equals_one_from_transformers_attention(tmp_path, monkeypatch, warmup):
    hf = hf_model("DeepseekV32", **{**CASES["deepseek-v32"][1], "index_topk": 5}, attn_implementation="eager")
    hf.save_pretrained(tmp_path)
    z = apply_runtime(zoo.from_pretrained(tmp_path), TrainConfig(index_loss_coef=1.0, index_warmup=warmup)).train()
    x = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    if warmup:  # transformers has no dense stage: its indexer keeping every key is one
        for layer in hf.model.layers:
            layer.self_attn.indexer.index_topk = x.shape[1]
    ref = hf_kl(hf, x, monkeypatch)
    kl = z(x, x, return_aux=True)[2]["index_kl"]
    assert ref > 1e-2 and (kl - ref).abs() <= 1e-6, (kl.item(), ref.item())


def tiny(std=0.2):
    torch.manual_seed(0)
    m = zoo.build(TINY)
    m.reset_parameters(std)  # attention far from uniform: a KL to learn
    return m


def test_sparse_stage_separates_the_gradients():
    """The LM loss reaches every weight but the indexers' (theirs zero or none); the indexers' KL reaches theirs
    only; with the loss off the indexers get no gradient at all."""
    m = apply_runtime(tiny(), TrainConfig(index_loss_coef=1.0)).train()
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    _, loss, aux = m(x, x, return_aux=True)
    params = dict(m.named_parameters())
    own = {n for n in params if ".indexer." in n}
    loss.backward(retain_graph=True)
    assert all(params[n].grad is None or not params[n].grad.any() for n in own)
    assert all(params[n].grad is not None for n in ("embed.weight", "layers.0.attn.q_b.weight", "layers.1.mlp.down"))
    m.zero_grad(set_to_none=True)
    aux["index_kl"].backward()
    assert own and all(params[n].grad is not None and params[n].grad.abs().max() > 0 for n in own)
    assert all(p.grad is None for n, p in params.items() if n not in own)
    m.zero_grad(set_to_none=True)
    apply_runtime(m, TrainConfig())(x, x)[1].backward()
    assert all(params[n].grad is None for n in own)


def test_shared_indexer_layers_keep_their_choice_under_activation_checkpointing():
    """GLM-5's shared layers (mla.index_shared) keep the keys the indexer layer before them chose: recomputed in the
    backward (activation checkpointing), layer 1 still reads layer 0's choice, not the last one the forward made, so
    the gradients equal the plain step's."""
    cfg = dict(TINY, n_layers=4, mla=dict(TINY["mla"], index_topk=4, index_shared=[1, 3]))
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    grads = []
    for policy in ("none", "full"):
        torch.manual_seed(0)
        m = zoo.build(cfg)
        m.reset_parameters(0.2)
        apply_runtime(m, TrainConfig(activation_checkpointing=policy)).train()
        m(x, x)[1].backward()
        grads.append({n: p.grad for n, p in m.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and "layers.1.attn.kv_a.weight" in grads[0]
    assert all(torch.allclose(grads[0][n], grads[1][n], atol=1e-6) for n in grads[0])


def test_keys_off_change_nothing_and_the_loss_leaves_the_output():
    m, ref = tiny(), tiny()
    apply_runtime(m, TrainConfig())
    assert m.state_dict().keys() == ref.state_dict().keys()
    assert all(torch.equal(v, ref.state_dict()[k]) for k, v in m.state_dict().items())
    assert all(p.requires_grad for p in m.parameters())
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = m.train()(x)
        assert torch.equal(out, ref.train()(x))
        apply_runtime(m, TrainConfig(index_loss_coef=1.0))  # the KL is computed beside the same forward
        assert torch.equal(m(x), out)


@pytest.mark.usefixtures("one_thread")
def test_warmup_lowers_the_kl_and_trains_only_the_indexers(tmp_path, text_corpus):
    zoo.save_pretrained(tiny(), tmp_path / "init")
    base = {"family": "llm", "data": {"tokenizer": "bytes", "seq_len": 32, "path": str(text_corpus)},
            "train": {"init_from": str(tmp_path / "init"), "max_steps": 30, "batch_size": 4, "log_every": 5,
                      "eval_every": 0, "eval_batches": 1, "checkpoint_every": 0, "progress": False, "samples": False,
                      "plot": False, "export": False, "out_dir": str(tmp_path / "run"), "index_loss_coef": 1.0,
                      "index_warmup": True},
            "optim": {"lr": 1e-2, "warmup_steps": 2}}
    train(load_run_config(None, [], base=base), log=lambda s: None)
    kl = [r["index_kl"] for r in read_rows(tmp_path / "run") if "index_kl" in r]
    assert len(kl) == 6 and kl[-1] < 0.5 * kl[0], kl
    before = zoo.from_pretrained(tmp_path / "init").state_dict()  # (a Hugging Face folder: its names are others)
    after = safetensors.torch.load_file(tmp_path / "run" / "model.safetensors")
    assert set(after) <= set(before.keys())  # (a tied head: stored once)
    changed = [k for k in after if not torch.equal(before[k], after[k])]
    assert [k for k in changed if ".indexer." not in k] == ["router_load"]  # the choices counted: not a weight
    assert {k for k in after if ".indexer." in k} <= set(changed)


@pytest.mark.parametrize("over,key", [
    (["train.index_loss_coef=1", "model.mla=null"], "train.index_loss_coef"),
    (["train.index_warmup=true"], "train.index_warmup"),
    (["train.index_loss_coef=1", "train.index_warmup=true", "adapter.method=lora"], "train.index_warmup"),
])
def test_bad_combinations_name_the_key(tmp_path, over, key):
    base = {"family": "llm", "model": TINY, "data": {"seq_len": 32}, "train": {"out_dir": str(tmp_path)}}
    with pytest.raises(ConfigError) as e:
        cfg = load_run_config(None, over, base=base)
        apply_runtime(zoo.build(cfg.model), cfg.train, source=cfg.source)
    assert key in str(e.value) and "\n" not in str(e.value)
