"""Mixture-of-Depths: the block (zoo/blocks/mod.py) against a per-sequence reference written here
(forward and gradients, fp32 <= 1e-5), its capacity, its router's gradient; MoD LLMs in decoding
(the KV cache against recomputing the prefix with the same causal decisions, batch 1 and 2,
compiled), compiled training, accounting, config errors and training through the loop."""
import copy
import json
import math

import pytest
import torch

import zoo
from conftest import assert_compiled_step_equals_eager, aux_loss
from zoo.blocks.attention import set_backend
from zoo.blocks.checkpoint import checkpoint_units
from zoo.blocks.mod import MixtureOfDepths
from zoo.blocks.rope import RotaryEmbedding
from zoo.config import ConfigError, LLMConfig, MoEConfig, from_dict
from zoo.llm import Block
from train.metrics import read_rows

TOL = 1e-5
MODEL_TOL = 1e-4


def mod_block(capacity=0.25, router="aux_loss", seed=0, d=32):
    torch.manual_seed(seed)
    cfg = LLMConfig(vocab_size=64, d_model=d, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64)
    m = MixtureOfDepths(Block(cfg), d, capacity, router)
    set_backend(m, "math")
    with torch.no_grad():  # router logits of O(1): distinct selections, weights far from 1/2
        m.router.weight.normal_(0, 0.5)
        for p in m.block.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.1)
    return m, RotaryEmbedding(cfg.resolved_head_dim, 64)


def reference(m: MixtureOfDepths, x: torch.Tensor, rope: RotaryEmbedding, chosen=None) -> torch.Tensor:
    """Per sequence: pick the top-k tokens by router score (or the tokens `chosen` (B, T) bool), run
    the plain block on them alone with their own position ids (RoPE at those positions), scale its
    update by sigmoid(score), add it back at those positions; the other tokens are left as they are."""
    B, T, _ = x.shape
    k = max(1, int(m.capacity * T))
    rows = []
    for b in range(B):
        score = x[b] @ m.router.weight[0] + m.router.bias
        pos = torch.sort(torch.topk(score, k).indices).values if chosen is None else chosen[b].nonzero()[:, 0]
        cos, sin = rope.cos[pos], rope.sin[pos]
        xs = x[b, pos][None]
        y, _ = m.block(xs, cos, sin)
        upd = torch.sigmoid(score[pos])[:, None] * (y[0] - xs[0])
        row = [x[b, t] for t in range(T)]
        for j, t in enumerate(pos.tolist()):
            row[t] = x[b, t] + upd[j]
        rows.append(torch.stack(row))
    return torch.stack(rows)


def test_block_equals_reference_forward_and_gradients():
    m, rope = mod_block()
    ref = copy.deepcopy(m)
    x = torch.randn(3, 16, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
    xr = x.detach().clone().requires_grad_(True)
    cos, sin = rope(0, 16, torch.float32)
    out, s, stats = m(x, cos, sin)
    want = reference(ref, xr, rope)
    assert (out - want).abs().max() <= TOL
    # the rows chose different tokens (so per-row positions are exercised)
    sel = (out != x).any(-1)
    assert sel.sum(-1).tolist() == [4, 4, 4] and not torch.equal(sel[0], sel[1]) and not torch.equal(sel[1], sel[2])
    g = torch.randn_like(out)
    (out * g).sum().backward()
    (want * g).sum().backward()
    assert (x.grad - xr.grad).abs().max() <= TOL
    for (name, p), q in zip(m.named_parameters(), ref.parameters()):
        assert (p.grad - q.grad).abs().max() <= TOL, name
    assert stats["routed"].item() == 0.25


def test_causal_routing_equals_reference_on_the_decided_tokens():
    """Causal mode (every token through the block, attention masked to the routed keys) equals
    running the plain block on each row's routed tokens alone, at their positions."""
    m, rope = mod_block()
    x = torch.randn(3, 12, 32, generator=torch.Generator().manual_seed(1))
    route = (x @ m.router.weight[0] + m.router.bias) > 0
    assert not torch.equal(route[0], route[1]) and 0 < route.float().mean() < 1
    out, _, stats = m(x, *rope(0, 12, torch.float32), causal=True)
    assert (out - reference(m, x, rope, chosen=route)).abs().max() <= TOL
    assert stats["routed"].item() == route.float().mean().item()


def test_capacity_one_processes_every_token():
    m, rope = mod_block(capacity=1.0)
    x = torch.randn(2, 10, 32)
    cos, sin = rope(0, 10, torch.float32)
    out, _, stats = m(x, cos, sin)
    y, _ = m.block(x, cos, sin)
    w = torch.sigmoid(x @ m.router.weight[0] + m.router.bias)[..., None]
    assert (out - (x + w * (y - x))).abs().max() <= TOL and stats["routed"].item() == 1.0


@pytest.mark.parametrize("T,capacity,k", [(16, 0.125, 2), (40, 0.125, 5), (7, 0.5, 3), (5, 0.1, 1)])
def test_exactly_k_tokens_per_row(T, capacity, k):
    m, rope = mod_block(capacity=capacity)
    seen = []
    m.block.register_forward_hook(lambda mod, args, out: seen.append(args[0].shape))
    x = torch.randn(3, T, 32)
    out, _, _ = m(x, *rope(0, T, torch.float32))
    assert seen == [torch.Size([3, k, 32])]
    assert (out != x).any(-1).sum(-1).tolist() == [k] * 3


def test_router_learns_through_the_lm_loss():
    """The router's gradient from the block output alone (no decision loss) is non-zero, and is
    exactly what flows through the sigmoid weight (the top-k choice itself has no gradient)."""
    m, rope = mod_block()
    x = torch.randn(2, 16, 32)
    out, _, _ = m(x, *rope(0, 16, torch.float32))
    out.pow(2).sum().backward()
    assert m.router.weight.grad.abs().sum() > 0
    aux_only, _ = mod_block()
    _, _, stats = aux_only(x, *rope(0, 16, torch.float32))
    stats["aux_loss"].backward()
    assert aux_only.router.weight.grad.abs().sum() > 0  # 'aux_loss': the decision trains the router


def test_predictor_trains_on_stop_gradient_inputs():
    m, rope = mod_block(router="predictor")
    x = torch.randn(2, 16, 32, requires_grad=True)
    _, _, stats = m(x, *rope(0, 16, torch.float32))
    stats["aux_loss"].backward()
    assert m.router.weight.grad is None and x.grad is None  # only the predictor learns from it
    assert all(p.grad.abs().sum() > 0 for p in m.predictor.parameters())


def test_decision_accuracy_counts_agreement():
    m, rope = mod_block()
    x = torch.randn(2, 16, 32)
    _, _, stats = m(x, *rope(0, 16, torch.float32))
    logits = x @ m.router.weight[0] + m.router.bias
    topk = torch.zeros_like(logits).scatter_(1, logits.topk(4, -1).indices, 1.0)
    assert stats["accuracy"].item() == pytest.approx(((logits > 0).float() == topk).float().mean().item())
    assert stats["decided"].item() == pytest.approx((logits > 0).float().mean().item())


@pytest.mark.parametrize("router", ["aux_loss", "predictor"])
def test_threshold_at_the_boundary_decides_the_top_k(router):
    """One update at rate 1 puts the threshold at the row's top-k boundary: on that row the decision
    then routes exactly k tokens, and for 'aux_loss' (whose decision logit is the router's) exactly the top-k."""
    m, rope = mod_block(router=router)
    x = torch.randn(1, 16, 32)
    cs = rope(0, 16, torch.float32)
    _, _, stats = m(x, *cs)
    d = m.decision_logits(x, m.router(x).squeeze(-1).float())
    s = d[0].sort(descending=True).values
    boundary = m.boundary(stats["decide"], 4)
    assert boundary.item() == pytest.approx(((s[3] + s[4]) / 2).item())
    assert m.threshold.item() == 0.0
    m.update_threshold(boundary, 1.0)
    _, _, stats = m(x, *cs)
    assert stats["decided"].item() == pytest.approx(4 / 16)
    if router == "aux_loss":
        assert stats["accuracy"].item() == 1.0
    m.update_threshold(torch.tensor(10.0), 0.25)  # a moving average: a quarter of the way
    assert m.threshold.item() == pytest.approx(0.75 * boundary.item() + 2.5, rel=1e-6)
    assert "threshold" in m.state_dict()  # saved with the weights: decoding uses it


def test_threshold_boundary_of_a_batch_decides_its_top_k_share():
    """With several rows the boundary is the batch's: at it the decision routes exactly B x k
    tokens of the batch (the rows' k-th largest logits differ, so a per-row boundary would not)."""
    m, rope = mod_block(router="aux_loss")
    x = torch.randn(3, 16, 32)
    cs = rope(0, 16, torch.float32)
    _, _, stats = m(x, *cs)
    s = m.router(x).squeeze(-1).float().flatten().sort(descending=True).values
    boundary = m.boundary(stats["decide"], 4)
    assert boundary.item() == pytest.approx(((s[11] + s[12]) / 2).item())
    m.update_threshold(boundary, 1.0)
    _, _, stats = m(x, *cs)
    assert stats["decided"].item() == pytest.approx(12 / 48)


# ----------------------------------------------------------------------------------------
# MoD LLMs
# ----------------------------------------------------------------------------------------

def mod_llm(seed=0, attn_backend="math", **kw):
    """Weights of std 0.2, so that every block moves the logits well beyond the tolerance."""
    torch.manual_seed(seed)
    args = dict(vocab_size=97, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=64,
                mod_capacity=0.25, tie_embeddings=False)
    args.update(kw)
    model = zoo.build(LLMConfig(**args))
    model.reset_parameters(init_std=0.2)
    set_backend(model, attn_backend)
    return model


def cached_logits_equal_recomputed(m, ids, steps):
    """Decode with the KV cache token by token (greedy) and compare every step's logits with a
    full causal forward over the whole prefix; returns the tokens."""
    from zoo.llm import decode_step
    caches = m.new_caches(ids.shape[0], ids.shape[1] + steps)
    with torch.no_grad():
        logits = m(ids, caches=caches)[:, -1]
        out = ids
        for i in range(steps):
            want = m(out, mod_causal=True)[:, -1]
            assert (logits - want).abs().max() <= MODEL_TOL, i
            out = torch.cat([out, logits.argmax(-1, keepdim=True)], 1)
            logits = decode_step(m, out[:, -1:], caches, out.shape[1] - 1)
    return out


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("router", ["aux_loss", "predictor"])
def test_generate_with_cache_equals_recomputing_with_the_same_decisions(batch, router):
    m = mod_llm(mod_router=router, moe=None).eval()
    if router == "predictor":
        with torch.no_grad():
            for layer in m.layers:
                if isinstance(layer, MixtureOfDepths):
                    layer.predictor[2].bias.fill_(0.0)
                    layer.predictor[2].weight.mul_(40)
    ids = torch.randint(0, 97, (batch, 5), generator=torch.Generator().manual_seed(2))
    out = m.generate(ids, 12)
    assert torch.equal(cached_logits_equal_recomputed(m, ids, 12), out)
    ref = ids
    with torch.no_grad():
        for _ in range(12):
            ref = torch.cat([ref, m(ref, mod_causal=True)[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, ref)
    # the decisions were mixed: some tokens skipped and some processed by each MoD layer
    with torch.no_grad():
        x = m.embed(out)
        cos, sin = m.rope(0, out.shape[1], x.dtype)
        fracs = []
        for layer in m.layers:
            if isinstance(layer, MixtureOfDepths):
                d = layer.decision_logits(x, layer.router(x).squeeze(-1)) > 0
                fracs.append(d.float().mean().item())
                x, *_ = layer(x, cos, sin, causal=True)
            else:
                x, _ = layer(x, cos, sin)
    assert all(0.0 < f < 1.0 for f in fracs), fracs


def test_cached_decoding_skips_tokens_in_the_cache():
    """A token a MoD layer skips leaves its cache slot unmarked; the routed ones are marked."""
    m = mod_llm().eval()
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(3))
    caches = m.new_caches(2, 9)
    with torch.no_grad():
        m(ids, caches=caches)
        x = m.embed(ids)
        cos, sin = m.rope(0, 9, x.dtype)
        for layer, cache in zip(m.layers, caches):
            if isinstance(layer, MixtureOfDepths):
                route = layer.decision_logits(x, layer.router(x).squeeze(-1)) > 0
                assert torch.equal(cache.valid, route)
                x, *_ = layer(x, cos, sin, causal=True)
            else:
                assert not hasattr(cache, "valid")  # a dense layer's cache keeps no mask
                x, _ = layer(x, cos, sin)


def test_cached_decoding_with_moe_layers():
    m = mod_llm(moe=MoEConfig(n_experts=4, top_k=2, expert_hidden=32), mod_every=2).eval()
    ids = torch.randint(0, 97, (2, 5), generator=torch.Generator().manual_seed(4))
    out = m.generate(ids, 8)
    ref = ids
    with torch.no_grad():
        for _ in range(8):
            ref = torch.cat([ref, m(ref, mod_causal=True)[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, ref)
    _, loss, aux = m.train()(ids, ids, return_aux=True)
    assert aux["load"].shape == (4, 4) and aux["mod_routed"].shape == (2,)  # both kinds of stats
    (loss + aux_loss(m, aux)).backward()
    assert all(layer.block.mlp.router.weight.grad is not None for layer in m.layers if isinstance(layer, MixtureOfDepths))


def test_generate_compiled_equals_eager():
    m = mod_llm(n_layers=2).eval()
    for batch in (1, 2):
        ids = torch.randint(0, 97, (batch, 6), generator=torch.Generator().manual_seed(batch))
        out = m.generate(ids, 10, compile=True)
        assert torch.equal(out, m.generate(ids, 10))
        if batch == 1:  # the decoded steps both ran and skipped the MoD layer: both sides of its branch
            with torch.no_grad():
                routed = (m.layers[1].router(m.layers[0](m.embed(out), *m.rope(0, out.shape[1], torch.float32))[0])
                          .squeeze(-1) > 0)[0, 6:-1]
            assert 0 < int(routed.sum()) < routed.numel()
    m = mod_llm(moe=MoEConfig(n_experts=4, top_k=2, expert_hidden=32), mod_every=2).eval()  # MoE inside the branch
    ids = torch.randint(0, 97, (2, 5), generator=torch.Generator().manual_seed(4))
    assert torch.equal(m.generate(ids, 8, compile=True), m.generate(ids, 8))


def test_compiled_decoding_is_one_graph():
    """The "did any token route" branch of a MoD layer is a torch.cond inside the graph, not a break."""
    from zoo.llm import decode_step
    m = mod_llm(mod_every=1).eval()
    ids = torch.randint(0, 97, (1, 6), generator=torch.Generator().manual_seed(0))
    caches = m.new_caches(1, 8)
    with torch.inference_mode():
        m(ids, caches=caches)
        explained = torch._dynamo.explain(decode_step)(m, ids[:, -1:], caches, 6)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons


def test_compiled_training_step_equals_eager():
    model = mod_llm(attn_backend="auto", n_layers=2)
    ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(1))
    assert_compiled_step_equals_eager(model, ids, MODEL_TOL)


def test_activation_checkpointing_same_gradients():
    model = mod_llm()
    ckpt = copy.deepcopy(model)
    checkpoint_units(ckpt.checkpoint_units(), True)
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(1))
    for m in (model, ckpt):
        _, loss, aux = m(ids, ids, return_aux=True)
        (loss + aux_loss(m, aux)).backward()
    for (name, p), q in zip(model.named_parameters(), ckpt.parameters()):
        assert (p.grad - q.grad).abs().max() <= MODEL_TOL, name


def test_flops_per_token_counts_the_capacity():
    dense = mod_llm(mod_capacity=0.0)
    full = mod_llm(mod_capacity=1.0)
    assert full.flops_per_token(32) == dense.flops_per_token(32) + 6 * 2 * 33  # only the two routers
    half = mod_llm(mod_capacity=0.5)
    blk = sum(p.numel() for p in half.layers[1].block.parameters() if p.dim() > 1)
    attn = 12 * 4 * 8 * 32
    want = full.flops_per_token(32) - 2 * (6 * 0.5 * blk + attn * (1 - 0.25))
    assert half.flops_per_token(32) == pytest.approx(want)


@pytest.mark.parametrize("data,key", [
    ({"mod_capacity": 1.5}, "model.mod_capacity"),
    ({"mod_capacity": 0.5, "mod_every": 0}, "model.mod_every"),
    ({"mod_capacity": 0.5, "mod_every": 3}, "model.mod_every"),
    ({"mod_capacity": 0.5, "mod_router": "threshold"}, "model.mod_router"),
    ({"mod_capacity": 0.5, "sliding_window": 8}, "model.mod_capacity"),
    ({"mod_aux_loss_coef": -1}, "model.mod_aux_loss_coef"),
    ({"mod_threshold_rate": 1.5}, "model.mod_threshold_rate"),
])
def test_config_errors_name_the_key(data, key):
    with pytest.raises(ConfigError) as e:
        from_dict(LLMConfig, {"n_layers": 2, **data}, "run.yaml", "model.")
    assert "\n" not in str(e.value) and key in str(e.value) and "run.yaml" in str(e.value)


def test_hf_export_refuses_mod_and_save_pretrained_writes_a_zoo_folder(tmp_path):
    from zoo.weights import hf_llm
    with pytest.raises(ValueError, match="mod_capacity"):
        hf_llm.save(mod_llm(), tmp_path / "hf")
    out = zoo.save_pretrained(mod_llm(), tmp_path / "zoo")  # the format that holds routers and thresholds
    assert (out / "config.yaml").is_file() and not (out / "config.json").exists()


def test_training_through_the_loop_logs_routing(tmp_path, text_corpus, one_thread):
    from train.config import load_run_config
    from train.loop import train
    base = {"family": "llm",
            "model": {"vocab_size": 256, "d_model": 32, "n_layers": 2, "n_heads": 4, "max_seq_len": 32,
                      "mod_capacity": 0.25, "mod_router": "predictor"},
            "data": {"tokenizer": "bytes", "seq_len": 32, "path": str(text_corpus)},
            "train": {"max_steps": 4, "batch_size": 4, "log_every": 2, "eval_every": 0, "eval_batches": 2,
                      "checkpoint_every": 0, "progress": False, "samples": True, "plot": False,
                      "out_dir": str(tmp_path / "run")},
            "optim": {"lr": 3e-3, "warmup_steps": 2}}
    lines = []
    train(load_run_config(None, [], base=base), log=lines.append)
    rows = read_rows(tmp_path / "run")
    row = [r for r in rows if "loss" in r][-1]
    assert row["mod_routed"] == [0.25] and len(row["mod_decided"]) == len(row["mod_accuracy"]) == 1
    assert 0.0 <= row["mod_accuracy"][0] <= 1.0 and math.isfinite(row["mfu"])
    assert abs(row["loss"] - row["lm_loss"] - row["mod_aux_loss"]) < 1e-4  # the task added the decision loss
    final = [r for r in rows if "val_loss" in r][-1]
    assert 0.0 <= final["val_mod_accuracy"] == final["val_mod_accuracy_layer1"] <= 1.0
    assert math.isfinite(final["val_loss_causal"])
    assert sum("routed/decided/decision accuracy per MoD layer" in l for l in lines) == 2
    from zoo.weights.files import load_tensors
    assert load_tensors(tmp_path / "run" / "model.safetensors")["layers.1.threshold"].item() != 0.0  # the task moved it
    base["train"]["mod_threshold_rate"] = 0.0
    base["train"]["out_dir"] = str(tmp_path / "fixed")
    train(load_run_config(None, [], base=base), log=lines.append)
    assert load_tensors(tmp_path / "fixed" / "model.safetensors")["layers.1.threshold"].item() == 0.0


def test_best_threshold_accuracy_against_every_threshold():
    """The MoD quality bench's bound on a causal decision (train/benches/llm_quality.py) against a
    brute-force sweep of the thresholds."""
    from train.benches.llm_quality import best_threshold_accuracy
    g = torch.Generator().manual_seed(0)
    for n in (1, 7, 50):
        score = torch.randn(n, generator=g)
        target = torch.rand(n, generator=g) < 0.3
        ts = torch.cat([score, torch.tensor([float("inf")])])
        brute = max(((score > t) == target).float().mean().item() for t in ts.tolist() + [float("-inf")])
        assert abs(best_threshold_accuracy(score, target) - brute) < 1e-6
