"""The LLM: causality, KV-cache generation, sampling, tying, the chunked loss, activation
checkpointing, autocast and compile paths, config validation (fp32 tolerance 1e-4)."""
import copy
import re

import pytest
import torch
import torch.nn.functional as F

import zoo
from zoo.blocks.checkpoint import checkpoint_units
from zoo.config import ConfigError, LLMConfig, from_dict
from zoo.llm import LLM, document_positions, sample_next

TOL = 1e-4
# every kind of layer, small: short convolution, Gated DeltaNet, Mamba-2 (chunks of 4 tokens), gated attention
HYBRID = dict(n_layers=4, layer_types=["conv", "linear_attention", "mamba", "full_attention"], attn_gate=True,
              recurrent=dict(n_heads=2, head_dim=8, n_v_heads=4, v_head_dim=6, state_size=6, n_groups=2, conv_kernel=3,
                             chunk=4))


def tiny(**kw) -> LLM:
    base = dict(vocab_size=97, d_model=32, n_layers=2, n_heads=4, max_seq_len=64)
    base.update(kw)
    torch.manual_seed(0)
    return LLM(from_dict(LLMConfig, base))


def full_forward_greedy(model, ids, n):
    """Greedy decoding by re-running the whole sequence each step (no cache)."""
    with torch.no_grad():
        for _ in range(n):
            nxt = model(ids)[:, -1].argmax(-1)
            ids = torch.cat([ids, nxt[:, None]], dim=1)
    return ids


# ---------------------------------------------------------------------------- forward

def test_forward_shapes_and_api():
    model = tiny()
    ids = torch.randint(0, 97, (3, 10))
    logits = model(ids)
    assert logits.shape == (3, 10, 97)
    tgt = torch.randint(0, 97, (3, 10))
    none, loss = model(ids, targets=tgt)
    assert none is None and loss.shape == () and torch.isfinite(loss)
    model.chunked_loss = False
    logits2, loss2 = model(ids, targets=tgt)
    assert (logits2 - logits).abs().max() <= TOL and abs(loss2.item() - loss.item()) <= TOL
    # a fresh model predicts nearly uniformly: loss ~ log V
    assert abs(loss.item() - torch.log(torch.tensor(97.0)).item()) < 0.1


@pytest.mark.parametrize("kw", [{}, {"n_kv_heads": 2, "sliding_window": 4}])
def test_causality(kw):
    model = tiny(**kw).eval()
    ids = torch.randint(0, 97, (2, 12))
    ref = model(ids)
    for t in (0, 5, 10):
        changed = ids.clone()
        changed[:, t + 1] = (changed[:, t + 1] + 1) % 97
        out = model(changed)
        assert (out[:, :t + 1] - ref[:, :t + 1]).abs().max() <= TOL, t
        assert (out[:, t + 1] - ref[:, t + 1]).abs().max() > 1e-4  # the change is seen from t+1 on


# ---------------------------------------------------------------------------- generation

@pytest.mark.parametrize("kw,batch", [
    ({}, 1),
    ({"n_kv_heads": 2}, 3),                          # GQA, batch > 1
    ({"n_kv_heads": 1, "sliding_window": 5}, 2),     # MQA with a window shorter than the text
    ({"tie_embeddings": False, "qkv_bias": True}, 2),
    (HYBRID, 2),                                     # recurrent layers: prefill over chunks, then one-token steps
])
def test_generate_with_cache_equals_full_forward_greedy(kw, batch):
    model = tiny(**kw).eval()
    with torch.no_grad():  # sharpen the random model so that argmax ties are impossible in practice
        model.lm_head.weight.mul_(30)
    ids = torch.randint(0, 97, (batch, 6), generator=torch.Generator().manual_seed(1))
    out = model.generate(ids, max_new_tokens=12)
    assert out.shape == (batch, 18) and torch.equal(out[:, :6], ids)
    assert torch.equal(out, full_forward_greedy(model, ids, 12))


def test_matvec_routes_equal_linear(monkeypatch):
    """The decoding step's routes for F.linear (zoo.blocks.matvec_cpu) equal it (fp32, <= 1e-5: another
    summation order), with and without bias, at 1, 2 and 8 rows; the mode takes the weight-on-the-left
    route in eager fp32 up to 8 rows for a weight of EAGER_NUMEL elements, and leaves 9 rows, a smaller weight and
    autocast's bf16 to F.linear (bit-identical)."""
    from zoo.blocks.matvec_cpu import MatvecCPU, as_reduction, weight_on_the_left
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(300, 64, generator=g), torch.randn(300, generator=g)
    x = torch.randn(1, 64, generator=g)
    ref = F.linear(x, w, b)
    with MatvecCPU():
        assert torch.equal(F.linear(x, w, b), ref)
    monkeypatch.setattr(MatvecCPU, "EAGER_NUMEL", w.numel())
    for shape in ((1, 64), (1, 1, 64), (2, 1, 64), (8, 1, 64)):
        x = torch.randn(*shape, generator=g)
        for route in (as_reduction, weight_on_the_left):
            y, yb = route(x, w), route(x, w, b)
            assert y.shape == shape[:-1] + (300,)
            assert (y - F.linear(x, w)).abs().max() <= 1e-5 and (yb - F.linear(x, w, b)).abs().max() <= 1e-5
        with MatvecCPU():
            assert torch.equal(F.linear(x, w, b), weight_on_the_left(x, w, b))
    x = torch.randn(9, 1, 64, generator=g)
    ref = F.linear(x, w, b)
    with MatvecCPU():
        assert torch.equal(F.linear(x, w, b), ref)
    x = torch.randn(1, 64, generator=g)
    with torch.autocast("cpu", torch.bfloat16):
        ref = F.linear(x, w)
        with MatvecCPU():
            assert torch.equal(F.linear(x, w), ref)
        y = as_reduction(x, w)  # follows autocast: bf16 operands, bf16 result
    assert y.dtype == ref.dtype == torch.bfloat16 and (y.float() - ref.float()).abs().max() <= 0.02 * ref.abs().max()


def test_logits_take_the_head_route_without_gradients(monkeypatch):
    """LLM.logits without gradients, at few rows and a head of EAGER_NUMEL elements, runs the weight-on-the-left route
    (fp32, <= 1e-5 from F.linear: another summation order) and decoding keeps its greedy tokens; with gradients, the
    head module itself."""
    import zoo.llm
    from zoo.blocks.matvec_cpu import MatvecCPU
    model = tiny().eval()
    monkeypatch.setattr(MatvecCPU, "EAGER_NUMEL", model.lm_head.weight.numel())
    calls = []
    route = zoo.llm.weight_on_the_left
    monkeypatch.setattr(zoo.llm, "weight_on_the_left", lambda *a: calls.append(1) or route(*a))
    h = torch.randn(1, 1, model.config.d_model, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (model.logits(h) - F.linear(h, model.lm_head.weight)).abs().max() <= 1e-5 and calls
        ids = torch.randint(0, 97, (1, 6), generator=torch.Generator().manual_seed(1))
        assert torch.equal(model.generate(ids, 8), full_forward_greedy(model, ids, 8))
    calls.clear()
    assert torch.equal(model.logits(h), model.lm_head(h)) and not calls


def test_generate_compiled_equals_eager():
    """generate(compile=True) decodes through torch.compile: the same greedy tokens as eager in
    fp32, at batch 1 and 2 (matvec reductions) and 3 (GEMM), across prompt lengths (recompiles
    once with dynamic sizes) and with a window shorter than the text."""
    for kw, batch, prompts in (({"n_kv_heads": 2}, 1, (6, 3, 9)), ({"n_kv_heads": 1, "sliding_window": 5}, 2, (6,)),
                               ({"qkv_bias": True}, 3, (6,))):
        model = tiny(**kw).eval()
        with torch.no_grad():
            model.lm_head.weight.mul_(30)
        for t in prompts:
            ids = torch.randint(0, 97, (batch, t), generator=torch.Generator().manual_seed(t))
            assert torch.equal(model.generate(ids, 12, compile=True), model.generate(ids, 12)), (kw, batch, t)


def test_compiled_decode_step_has_no_linear_at_batch_1():
    """torch.compile traces through the mode: the compiled decoding step at batch 1 holds no
    F.linear (all of them became reductions); the model's forward without the mode holds them."""
    import zoo.llm
    from conftest import traced_calls
    model = tiny().eval()
    forward = lambda m, ids, caches, pos: m(ids, caches=caches, start_pos=pos)  # noqa: E731
    for fn, want_linear in ((zoo.llm.decode_step, False), (forward, True)):
        targets = traced_calls(fn, model, torch.tensor([[1]]), model.new_caches(1, 8), 0)
        assert (F.linear in targets) == want_linear


def test_generate_keeps_training_mode_and_eos():
    model = tiny().train()
    ids = torch.randint(0, 97, (2, 4))
    greedy = model.generate(ids, 6)
    assert model.training
    eos = int(greedy[0, 5])  # the token row 0 emits second: after it, row 0 must repeat it
    out = model.generate(ids, 6, eos_token_id=eos)
    first = (out[0, 4:] == eos).nonzero()[0, 0].item()
    assert (out[0, 4 + first:] == eos).all()


@pytest.mark.parametrize("prompt,says", [(torch.tensor([1, 2, 3]), "(B, T)"), (torch.zeros(1, 0, dtype=torch.long), "(B, T)"),
                                         (torch.rand(1, 3), "integer"), (torch.tensor([[1, 97]]), "97"),
                                         (torch.tensor([[-1, 2]]), "-1")])
def test_generate_refuses_a_prompt_that_is_not_token_ids_of_the_vocabulary(prompt, says):
    """A 1-D prompt, an empty one, floats, an id past vocab_size or below 0: one line saying so."""
    with pytest.raises(ValueError, match=re.escape(says)) as e:
        tiny().generate(prompt, 2)
    assert "\n" not in str(e.value)


def test_sampling_picks_only_allowed_tokens():
    torch.manual_seed(0)
    logits = torch.randn(4, 50) * 3
    g = torch.Generator().manual_seed(0)
    top5 = logits.topk(5, dim=-1).indices
    probs = logits.softmax(-1)
    sorted_p, order = probs.sort(-1, descending=True)
    # the nucleus for top_p=0.6: the smallest prefix whose mass reaches 0.6
    n_keep = (sorted_p.cumsum(-1) < 0.6).sum(-1) + 1
    for _ in range(200):
        tok = sample_next(logits, temperature=1.5, top_k=5, generator=g)
        assert (top5 == tok[:, None]).any(-1).all()
        tok = sample_next(logits, temperature=1.0, top_p=0.6, generator=g)
        for b in range(4):
            assert tok[b] in order[b, :n_keep[b]]
        tok = sample_next(logits, temperature=1.0, top_k=1, top_p=0.9, generator=g)
        assert torch.equal(tok, logits.argmax(-1))
    # top_p draws the renormalised nucleus's distribution (drawing again outside it): frequencies of 20000
    # draws within 0.01 of it (over four standard deviations)
    flat = logits[:1] / 3
    probs = flat.softmax(-1)[0]
    sorted_p, order = probs.sort(descending=True)
    keep = order[:int((sorted_p.cumsum(0) < 0.7).sum()) + 1]
    want = torch.zeros(50).index_put_((keep,), probs[keep] / probs[keep].sum())
    draws = torch.cat([sample_next(flat.expand(1000, 50), 1.0, top_p=0.7, generator=g) for _ in range(20)])
    assert len(keep) > 5 and (torch.bincount(draws, minlength=50) / len(draws) - want).abs().max() < 0.01
    # temperature 0 is greedy
    assert torch.equal(sample_next(logits), logits.argmax(-1))
    # sampling without restrictions does reach beyond the top-5
    seen = torch.stack([sample_next(logits, 1.0, generator=g) for _ in range(200)])
    assert not (top5[None] == seen[..., None]).any(-1).all()


def test_generate_with_sampling_reproducible():
    model = tiny()
    ids = torch.randint(0, 97, (2, 4))
    a = model.generate(ids, 8, temperature=0.8, top_k=10, top_p=0.9, generator=torch.Generator().manual_seed(3))
    b = model.generate(ids, 8, temperature=0.8, top_k=10, top_p=0.9, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, b) and a.shape == (2, 12)


def _left_padded(prompts, pad=0):
    T = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (T - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def padded_greedy_equals_alone(model):
    """Four prompts of different lengths, left-padded: the greedy rows equal each prompt decoded alone (the logits
    sharpened first) -> (prompts, ids, mask, greedy)."""
    with torch.no_grad():
        model.lm_head.weight.mul_(10)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, 97, (n,), generator=g).tolist() for n in (3, 7, 5, 1)]
    ids, mask = _left_padded(prompts)
    greedy = model.generate(ids, 10, attention_mask=mask)
    alone = [model.generate(torch.tensor([p]), 10)[0, len(p):] for p in prompts]
    assert torch.equal(greedy[:, ids.shape[1]:], torch.stack(alone))
    return prompts, ids, mask, greedy


def test_batched_generation_equals_each_row_alone(monkeypatch):
    """Left-padded rows of different lengths decode as each row alone: greedy, the same tokens;
    sampled with a generator per row, the same draws (also with each prompt repeated, whose forward runs
    once, through the step of fixed shapes); a row stops at its own EOS (or any of several stop ids) and
    keeps emitting it, while the others go on."""
    model = tiny(n_kv_heads=2).eval()
    prompts, ids, mask, greedy = padded_greedy_equals_alone(model)
    assert torch.equal(model.generate(ids, 10, attention_mask=mask, compile=True), greedy)
    sampled = model.generate(ids, 10, temperature=1.0, top_p=0.95, attention_mask=mask,
                             generator=[torch.Generator().manual_seed(i) for i in range(4)])
    alone = [model.generate(torch.tensor([p]), 10, temperature=1.0, top_p=0.95, generator=[torch.Generator().manual_seed(i)])
             for i, p in enumerate(prompts)]
    assert torch.equal(sampled[:, ids.shape[1]:], torch.stack([a[0, len(p):] for a, p in zip(alone, prompts)]))
    assert len({tuple(r) for r in sampled[:, ids.shape[1]:].tolist()}) > 1
    eos = [int(greedy[0, ids.shape[1] + 2]), int(greedy[2, ids.shape[1] + 4])]  # row 0 stops at step 3, row 2 by 5
    stopped = model.generate(ids, 10, attention_mask=mask, eos_token_id=eos)[:, ids.shape[1]:]
    for row, p in zip(stopped, prompts):
        want = model.generate(torch.tensor([p]), 10, eos_token_id=eos)[0, len(p):]
        assert torch.equal(row, want)
        hit = torch.isin(row, torch.tensor(eos)).nonzero()
        if len(hit):
            assert (row[hit[0, 0]:] == row[hit[0, 0]]).all()
    assert torch.isin(stopped[0, 2], torch.tensor(eos)) and (stopped[0, 2:] == stopped[0, 2]).all()
    import zoo.llm as L
    monkeypatch.setattr(L, "static_decode_step", lambda: L.decode_step)  # its logic; compiled graphs: tests/test_cuda.py
    model = tiny(n_kv_heads=2).eval()  # unscaled: draws that depend on the context
    twice = model.generate(ids.repeat_interleave(2, 0), 10, temperature=1.0, top_p=0.95, compile="reduce-overhead",
                           attention_mask=mask.repeat_interleave(2, 0),
                           generator=[torch.Generator().manual_seed(i) for i in range(8)])
    alone = [model.generate(torch.tensor([prompts[i // 2]]), 10, temperature=1.0, top_p=0.95,
                            generator=[torch.Generator().manual_seed(i)])[0, -10:] for i in range(8)]
    assert torch.equal(twice[:, ids.shape[1]:], torch.stack(alone))
    assert not torch.equal(twice[0::2, ids.shape[1]:], twice[1::2, ids.shape[1]:])


def test_hybrid_padded_rows_and_packed_documents():
    """Recurrent layers: left-padded rows decode as each row alone (greedy; the padding is a document of its own, so
    each prompt's state starts fresh at its first token), also through the step of fixed shapes; packed documents in
    one row give each document's logits alone (1e-4)."""
    model = tiny(**HYBRID).eval()
    prompts = padded_greedy_equals_alone(model)[0]
    docs = torch.cat([torch.tensor(p) for p in prompts])[None]
    doc_ids = torch.repeat_interleave(torch.arange(4), torch.tensor([len(p) for p in prompts]))[None]
    with torch.no_grad():
        packed = model(docs, doc_ids=doc_ids, position_ids=document_positions(doc_ids))
        for p, part in zip(prompts, packed[0].split([len(p) for p in prompts])):
            assert (model(torch.tensor([p]))[0] - part).abs().max() <= TOL


# ---------------------------------------------------------------------------- parameters

def test_tied_and_untied_embeddings():
    tied = tiny(tie_embeddings=True)
    assert tied.lm_head.weight is tied.embed.weight
    assert tied.lm_head.weight.data_ptr() == tied.embed.weight.data_ptr()
    names = [n for n, _ in tied.named_parameters()]
    assert "lm_head.weight" not in names and "embed.weight" in names  # one tensor, counted once
    untied = tiny(tie_embeddings=False)
    assert untied.lm_head.weight.data_ptr() != untied.embed.weight.data_ptr()
    assert untied.num_params() == tied.num_params() + 97 * 32
    # a tied model keeps sharing after a deep copy and a state-dict round trip
    clone = copy.deepcopy(tied)
    assert clone.lm_head.weight is clone.embed.weight
    sd = tied.state_dict()
    assert sd["lm_head.weight"].data_ptr() == sd["embed.weight"].data_ptr()


def test_parameter_names():
    model = tiny(n_kv_heads=2, qkv_bias=True, tie_embeddings=False)
    names = set(model.state_dict())
    for n in ("embed.weight", "layers.0.attn_norm.weight", "layers.0.attn.qkv.weight", "layers.0.attn.qkv.bias",
              "layers.0.attn.proj.weight", "layers.0.mlp_norm.weight", "layers.0.mlp.gate_up.weight",
              "layers.0.mlp.down.weight", "layers.1.attn.qkv.weight", "norm.weight", "lm_head.weight"):
        assert n in names, n
    assert model.layers[0].attn.qkv.weight.shape == ((4 + 2 * 2) * 8, 32)
    assert not any("rope" in n for n in names)  # rope tables are not weights


def test_init_scales_residual_projections():
    model = tiny(d_model=256, n_layers=8, n_heads=4)
    std = 0.02  # reset_parameters' default
    assert abs(model.layers[0].attn.qkv.weight.std().item() - std) < 0.1 * std
    assert abs(model.layers[0].mlp.down.weight.std().item() - std / 4) < 0.1 * std / 4  # sqrt(2 * 8) = 4
    assert (model.norm.weight == 1).all()


# ---------------------------------------------------------------------------- loss

@pytest.mark.parametrize("chunk", [7, 64, 4096])
def test_chunked_loss_equals_cross_entropy_in_model(chunk):
    """Loss and every parameter's gradient equal those of F.cross_entropy over full logits,
    with ignored targets and a chunk size that does not divide B*T (2*15 = 30 tokens)."""
    a = tiny(tie_embeddings=False)
    a.loss_chunk_size = chunk
    b = copy.deepcopy(a)
    ids = torch.randint(0, 97, (2, 15))
    tgt = torch.randint(0, 97, (2, 15))
    tgt[:, :3] = -100
    _, la = a(ids, targets=tgt)
    logits = b(ids)
    lb = F.cross_entropy(logits.view(-1, 97), tgt.view(-1), ignore_index=-100)
    la.backward()
    lb.backward()
    assert abs(la.item() - lb.item()) <= TOL
    for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert (pa.grad - pb.grad).abs().max() <= TOL, n


def test_chunked_loss_tied_gradient():
    """With tied embeddings the shared tensor gets both the embedding's and the head's gradient."""
    a = tiny()
    a.loss_chunk_size = 9
    b = copy.deepcopy(a)
    b.chunked_loss = False
    ids = torch.randint(0, 97, (2, 10))
    a(ids, targets=ids.roll(-1, 1))[1].backward()
    b(ids, targets=ids.roll(-1, 1))[1].backward()
    assert (a.embed.weight.grad - b.embed.weight.grad).abs().max() <= TOL


def test_activation_checkpointing_same_gradients():
    a = tiny(n_kv_heads=2)
    b = copy.deepcopy(a)
    checkpoint_units(b.checkpoint_units(), True)
    ids = torch.randint(0, 97, (2, 12))
    la = a(ids, targets=ids)[1]
    lb = b(ids, targets=ids)[1]
    la.backward()
    lb.backward()
    assert abs(la.item() - lb.item()) <= TOL
    for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert (pa.grad - pb.grad).abs().max() <= TOL, n


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_paths_train(dtype):
    model = tiny(n_kv_heads=2)
    ids = torch.randint(0, 97, (2, 16))
    with torch.no_grad():
        ref = model(ids, targets=ids)[1].item()
    with torch.autocast("cpu", dtype=dtype):
        _, loss = model(ids, targets=ids)
        logits = model(ids)
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    assert abs(loss.item() - ref) < 0.05  # low-precision matmuls, fp32 loss
    assert logits.dtype == dtype
    loss.backward()
    for n, p in model.named_parameters():
        assert p.grad is not None and p.grad.dtype == torch.float32 and torch.isfinite(p.grad).all(), n
    with torch.autocast("cpu", dtype=dtype):
        out = model.generate(ids[:, :4], 3)
    assert out.shape == (2, 7)


def test_bf16_model_weights_train():
    """A model cast to bf16 (no autocast) runs forward and backward."""
    model = tiny().to(torch.bfloat16)
    ids = torch.randint(0, 97, (2, 8))
    _, loss = model(ids, targets=ids)
    loss.backward()
    assert torch.isfinite(loss) and model.embed.weight.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("kw", [dict(n_layers=1, d_model=16, n_heads=2),
                                dict(n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, sliding_window=5)])
def test_compile_path_equals_eager(kw):
    """The compiled training step (its own RoPE, mask and loss formulations) gives the eager
    loss and gradients, for every parameter: MHA, and grouped heads with a sliding window."""
    model = tiny(**kw)
    ref = copy.deepcopy(model)
    compiled = torch.compile(model)
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(1))
    _, loss = compiled(ids, targets=ids)
    loss.backward()
    _, ref_loss = ref(ids, targets=ids)
    ref_loss.backward()
    assert torch.isfinite(loss) and abs(loss.item() - ref_loss.item()) <= TOL
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert (p.grad - q.grad).abs().max() <= TOL, name


def test_loss_goes_down():
    model = tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = torch.randint(0, 97, (4, 16), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(30):
        _, loss = model(ids[:, :-1], targets=ids[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_flops_per_token():
    model = tiny(tie_embeddings=False)
    cfg = model.config
    n = model.num_params() - 97 * 32  # the embedding lookup is not a matmul; the head is
    assert model.flops_per_token(16) == 6 * n + 12 * cfg.n_layers * cfg.d_model * 16


# ---------------------------------------------------------------------------- config

@pytest.mark.parametrize("data,key", [
    ({"d_model": 64, "n_heads": 5}, "n_heads"),
    ({"d_model": 64, "n_heads": 8, "n_kv_heads": 3}, "n_kv_heads"),
    ({"d_model": 64, "n_heads": 4, "head_dim": 15}, "head_dim"),
    ({"d_model": 60, "n_heads": 4}, "head_dim"),  # 60 / 4 = 15: odd
    ({"n_layers": 0}, "n_layers"),
    ({"sliding_window": 0}, "sliding_window"),
    ({"n_heads": "8"}, "n_heads"),
    ({"colour": 1}, "colour"),
    ({"attn_backend": "xformers"}, "attn_backend"),
    ({"rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0}},
     "rope_scaling.high_freq_factor"),
    ({"layer_types": ["full_attention", "rwkv"]}, "layer_types[1]"),
    ({"layer_types": ["conv", "full_attention"], "mod_capacity": 0.5}, "mod_capacity"),
    ({"layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
    ({"layer_types": ["mamba"], "recurrent": {"n_heads": 4, "n_groups": 3}}, "recurrent.n_groups"),
    ({"layer_types": ["linear_attention"], "recurrent": {"n_heads": 4, "n_v_heads": 6}}, "recurrent.n_v_heads"),
])
def test_config_errors_are_one_line_and_name_the_key(data, key):
    with pytest.raises(ConfigError) as e:
        from_dict(LLMConfig, data, "configs/llm/x.yaml", "model.")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("configs/llm/x.yaml: ") and f"model.{key}" in msg, msg


def test_build_error_names_the_key():
    with pytest.raises(ConfigError, match="n_kv_heads"):
        zoo.build({"family": "llm", "model": {"d_model": 64, "n_heads": 4, "n_kv_heads": 3}})
    model = zoo.build({"family": "llm", "model": {"vocab_size": 50, "d_model": 32, "n_layers": 1, "n_heads": 2}})
    assert isinstance(model, LLM) and model(torch.zeros(1, 3, dtype=torch.long)).shape == (1, 3, 50)


@pytest.mark.parametrize("kw", [{}, {"sliding_window": 5}, {"attn_softcap": 5.0}, {"attn_sinks": True}, HYBRID])
def test_static_decoding_gives_the_tokens_of_eager_decoding(monkeypatch, kw):
    """generate(compile="reduce-overhead"): steps of fixed shapes (the position a tensor, every cache slot
    attended with those past it masked), what CUDA graphs replay; run here uncompiled (the compiled graphs:
    tests/test_cuda.py). Greedy tokens equal the dynamic decoding's, twice on the kept caches, and with
    left-padded rows."""
    import zoo.llm as L
    torch.manual_seed(0)
    model = tiny(max_seq_len=64, **kw).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 7))
    want = model.generate(ids, 12)
    monkeypatch.setattr(L, "static_decode_step", lambda: L.decode_step)
    assert torch.equal(model.generate(ids, 12, compile="reduce-overhead"), want)
    assert torch.equal(model.generate(ids, 12, compile="reduce-overhead"), want)
    if "attn_softcap" in kw or "attn_sinks" in kw:  # padded rows are not run with these at all
        return
    mask = torch.tensor([[0] * 2 + [1] * 5, [1] * 7])  # left-padded rows: each row's keys masked in every step

    def sampled(**kw):
        gens = [torch.Generator().manual_seed(i) for i in range(2)]
        return model.generate(ids, 12, temperature=1.0, top_p=0.9, generator=gens, **kw)[:, 7:]
    want = sampled(attention_mask=mask)
    assert torch.equal(sampled(attention_mask=mask, compile="reduce-overhead"), want)
    if not kw:  # the padding attended: other draws (a window soon leaves it behind)
        assert not torch.equal(sampled(compile="reduce-overhead"), want)
