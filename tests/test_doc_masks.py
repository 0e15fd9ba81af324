"""Document masking (zoo/blocks/attention_docs.py, zoo/llm.py), document ids from boundary tokens
(train/data's document_ids) and packing (train/data/packing.py): documents run together in one
row with doc_ids give what each gives run alone (fp32: logits and gradients <= 1e-5)."""
import pytest
import torch

from zoo.blocks.attention import attend_math, flash_available, set_backend
from zoo.blocks.attention_docs import Documents, attend_documents, document_mask, document_positions, document_runs
from zoo.config import LLMConfig, MoEConfig
from zoo.llm import LLM
from conftest import TEST_DEVICE, CPU, CUDA

TOL = 1e-5
SMALL = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32)
# two rows of 13 tokens: three documents, then two (the first one's id coming back after another)
LAYOUT = [[5, 4, 4], [6, 7]]
ROW_IDS = [[0] * 5 + [1] * 4 + [2] * 4, [3] * 6 + [1] * 7]


def _model(seed=0, **over):
    torch.manual_seed(seed)
    return LLM(LLMConfig(**{**SMALL, **over}))


def _rows(seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, SMALL["vocab_size"], (2, 13), generator=g)
    return x, torch.tensor(ROW_IDS), torch.randn(2, 13, SMALL["vocab_size"], generator=g)


def _grads(model, loss):
    model.zero_grad()
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _separate(model, x, w):
    """Each document of each row run on its own: logits (2, 13, V) and the gradients of sum(logits * w)."""
    outs = []
    for r, lens in enumerate(LAYOUT):
        at = 0
        for n in lens:
            outs.append((r, at, model(x[r:r + 1, at:at + n])))
            at += n
    logits = torch.zeros(2, 13, SMALL["vocab_size"])
    for r, at, out in outs:
        logits[r, at:at + out.shape[1]] = out[0]
    loss = sum((out[0] * w[r, at:at + out.shape[1]]).sum() for r, at, out in outs)
    return logits.detach(), _grads(model, loss)


def _assert_close(a, b, what):
    assert (a - b).abs().max() <= TOL, (what, (a - b).abs().max().item())


@pytest.mark.parametrize("backend,positions,over", [  # SMALL has grouped kv heads (GQA, 4 on 2)
    ("sdpa", True, {}),
    ("bmm", True, {}),
    ("auto", False, {"n_kv_heads": 1}),                    # MQA; global positions: RoPE is relative, so the
                                                           # same up to rounding
    ("bmm", True, {"sliding_window": 3}),                  # a window inside the documents
    ("auto", True, {"moe": MoEConfig(n_experts=4, top_k=2)}),  # dropless MoE routes token by token
])
def test_document_masking_equals_separate_documents(backend, positions, over):
    model = _model(**over)
    set_backend(model, backend)
    x, doc, w = _rows()
    ref_logits, ref_grads = _separate(model, x, w)
    kw = {"doc_ids": doc, "position_ids": document_positions(doc) if positions else None}
    logits = model(x, **kw)
    _assert_close(logits, ref_logits, "logits")
    grads = _grads(model, (logits * w).sum())
    assert grads.keys() == ref_grads.keys()
    for n in grads:
        _assert_close(grads[n], ref_grads[n], n)
    _, loss = model(x, x, **kw)  # the chunked loss path takes them too
    assert torch.isfinite(loss)


def test_document_masking_compiled_equals_separate_documents():
    """torch.compile (inductor, the CPU's 'auto' backend under compile) of an attention block with
    doc_ids and restarting positions, forward and backward, against each document run alone
    eagerly (kept to one block: compiling a whole model is slow on a CPU)."""
    from zoo.blocks.attention import CausalSelfAttention
    from zoo.blocks.rope import RotaryEmbedding
    torch.manual_seed(0)
    attn, rope = CausalSelfAttention(32, n_heads=4, n_kv_heads=2), RotaryEmbedding(8, 32)
    x = torch.randn(2, 13, 32)
    doc = torch.tensor(ROW_IDS)
    w = torch.randn(2, 13, 32)
    refs = []
    for r, lens in enumerate(LAYOUT):
        at = 0
        for n in lens:
            refs.append((r, at, attn(x[r:r + 1, at:at + n], *rope(0, n, torch.float32))))
            at += n
    ref = torch.zeros(2, 13, 32)
    for r, at, out in refs:
        ref[r, at:at + out.shape[1]] = out[0]
    ref_grads = _grads(attn, sum((out[0] * w[r, at:at + out.shape[1]]).sum() for r, at, out in refs))
    out = torch.compile(attn)(x, *rope.at(document_positions(doc), torch.float32), mask=Documents(doc))
    _assert_close(out, ref.detach(), "output")
    grads = _grads(attn, (out * w).sum())
    for n in grads:
        _assert_close(grads[n], ref_grads[n], n)


def test_document_mask_runs_and_positions():
    doc = torch.tensor([[7, 7, 2, 2, 2, 7], [0, 1, 1, 1, 1, 1]])
    assert document_runs(doc).tolist() == [[0, 0, 1, 1, 1, 2], [0, 1, 1, 1, 1, 1]]
    assert document_positions(doc).tolist() == [[0, 1, 0, 1, 2, 0], [0, 0, 1, 2, 3, 4]]
    m = document_mask(doc[:1])[0]
    assert m[5].tolist() == [False] * 5 + [True]            # 7 again: a new document
    assert m[4].tolist() == [False, False, True, True, True, False]
    with_prefix = document_mask(doc[:1], k_len=8)[0]        # two learned keys in front: seen by all
    assert with_prefix[:, :2].all() and torch.equal(with_prefix[:, 2:], m)


def test_every_document_backend_equals_the_reference_mask():
    """attend_documents, every CPU backend, against the fp32 reference with document_mask;
    a learned prefix (more keys than queries) too."""
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 4, 13, 8, generator=g), torch.randn(2, 2, 15, 8, generator=g), torch.randn(2, 2, 15, 8, generator=g)
    doc = torch.tensor(ROW_IDS)
    ref = attend_math(q, k[:, :, 2:], v[:, :, 2:], document_mask(doc)[:, None])
    ref_prefix = attend_math(q, k, v, document_mask(doc, 15)[:, None])
    for backend in ("math", "sdpa", "bmm", "auto"):
        _assert_close(attend_documents(q, k[:, :, 2:], v[:, :, 2:], doc, backend), ref, backend)
        _assert_close(attend_documents(q, k, v, doc, backend), ref_prefix, backend + " prefix")
    with torch.no_grad():  # FlexAttention's mask function, through torch's eager reference (no CPU backward)
        _assert_close(attend_documents(q, k[:, :, 2:], v[:, :, 2:], doc, "flex"), ref, "flex")
    with pytest.raises(RuntimeError, match="'flex' has no backward on a CPU"):
        attend_documents(q.requires_grad_(), k[:, :, 2:], v[:, :, 2:], doc, "flex")
    plain = attend_math(q, k[:, :, 2:], v[:, :, 2:], torch.ones(13, 13, dtype=torch.bool).tril())
    assert (plain - ref).abs().max() > 1e-2  # the mask changes the result
    with pytest.raises(ValueError, match="without keys in front"):
        attend_documents(q, k, v, doc, "flex")


def test_auto_picks_the_document_backend_measured_fastest():
    """'auto' with documents: SDPA's boolean mask on a CPU (bench doc-mask: faster than 'bmm' with the
    mask, eager and compiled), FlexAttention on CUDA under torch.compile."""
    import zoo.blocks.attention as A
    import zoo.blocks.attention_docs as D
    cpu, cuda = CPU, CUDA
    assert D.resolve_backend("auto", cpu, torch.float32) == "sdpa"
    assert D.resolve_backend("auto", cpu, torch.float32, compiling=True) == "sdpa"
    assert D.resolve_backend("auto", cuda, torch.float32, compiling=True) == "flex"
    assert A.resolve_backend("auto", cpu, torch.float32, 128, compiling=True) == "bmm"  # plain causal: unchanged


def test_kv_cache_decoding_refuses_doc_ids():
    model = _model().eval()
    x, doc, _ = _rows()
    with pytest.raises(ValueError, match="doc_ids"):
        model(x, caches=model.new_caches(2, 16), doc_ids=doc)


def test_mixture_of_depths_gathers_doc_ids_and_positions():
    """A MoD block hands its routed tokens' doc ids and per-row RoPE rows to the block it wraps,
    gathered with the tokens; routed by the causal decision it equals separate documents."""
    from zoo.blocks.mod import MixtureOfDepths
    seen = {}

    class Probe(torch.nn.Module):
        def forward(self, x, cos, doc_ids=None):
            seen.update(x=x, cos=cos, doc_ids=doc_ids)
            return x

    mod = MixtureOfDepths(Probe(), 8, capacity=0.5)
    x = torch.randn(2, 6, 8)
    cos = torch.randn(2, 6, 3)
    doc = torch.tensor([[0, 0, 0, 1, 1, 1], [0, 1, 1, 2, 2, 2]])
    mod(x, cos, doc_ids=doc)
    idx = mod.router(x).squeeze(-1).topk(3, dim=-1).indices.sort(-1).values
    assert torch.equal(seen["doc_ids"], doc.gather(1, idx))
    assert torch.equal(seen["cos"], torch.stack([cos[b, idx[b]] for b in range(2)]))
    model = _model(mod_capacity=0.5, mod_every=1)
    x, doc, w = _rows()
    with torch.no_grad():
        for layer in model.mod_layers():
            layer.threshold.fill_(-1e9)  # route every token: the causal decision, all routed
        ref = torch.cat([model(x[r:r + 1, a:a + n], mod_causal=True)[0]
                         for r, lens in enumerate(LAYOUT) for a, n in zip([0, *torch.tensor(lens).cumsum(0)[:-1].tolist()], lens)])
        out = model(x, doc_ids=doc, position_ids=document_positions(doc), mod_causal=True)
    _assert_close(out.reshape(-1, SMALL["vocab_size"]), ref.reshape(-1, SMALL["vocab_size"]), "mod causal")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (flash-attn varlen and FlexAttention kernels)")
def test_cuda_document_backends_equal_the_reference():
    """flash-attn's varlen kernel (bf16; when installed) and compiled FlexAttention (fp32, forward and
    backward) against the fp32 reference mask."""
    dev = CUDA
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 13, 64, generator=g).to(dev) for h in (4, 2, 2))
    doc = torch.tensor(ROW_IDS, device=dev)
    ref = attend_math(q, k, v, document_mask(doc)[:, None])
    if flash_available() is None:
        pytest.skip("flash-attn is not installed: FlexAttention checked below only")
    out = attend_documents(q.bfloat16(), k.bfloat16(), v.bfloat16(), doc, "flash")
    assert (out.float() - ref).abs().max() <= 2e-2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (FlexAttention's backward)")
def test_cuda_flex_document_masking_gradients():
    from zoo.blocks.attention import attend_flex
    dev = CUDA
    g = torch.Generator().manual_seed(0)
    leaves = [torch.randn(2, h, 13, 64, generator=g).to(dev).requires_grad_() for h in (4, 2, 2)]
    ref_leaves = [t.detach().clone().requires_grad_() for t in leaves]
    doc = torch.tensor(ROW_IDS, device=dev)
    go = torch.randn(2, 4, 13, 64, generator=g).to(dev)
    torch.compile(attend_flex)(*leaves, runs=document_runs(doc)).backward(go)
    attend_math(*ref_leaves, document_mask(doc)[:, None]).backward(go)
    for a, b in zip(leaves, ref_leaves):
        assert (a.grad - b.grad).abs().max() <= 1e-4


# ----------------------------------------------------------------------------- document ids, the LM task
def test_document_ids_from_boundary_tokens():
    from train.data import document_ids
    t = torch.tensor([[9, 1, 2, 9, 3, 9], [4, 5, 9, 9, 6, 7]])
    assert document_ids(t, "bos", bos_id=9).tolist() == [[0, 0, 0, 1, 1, 2], [0, 0, 1, 2, 2, 2]]
    assert document_ids(t, "eos", eos_id=9).tolist() == [[0, 1, 1, 1, 2, 2], [0, 0, 0, 1, 2, 2]]
    with pytest.raises(ValueError, match="document boundary"):
        document_ids(t, "sep", 9)


def test_lm_task_trains_within_documents(tmp_path, text_corpus, monkeypatch):
    """data.attention: document: the task's loss on a batch equals the documents' losses run one by
    one (a line of the byte stream as the document, its newline as BOS); without boundary tokens in the stream
    it is a one-line error; positions: document alone is one too."""
    from train.config import load_run_config
    from train.data import ByteTokenizer
    from train.tasks.lm import LMTask
    from zoo.config import ConfigError
    base = {"family": "llm", "model": {**SMALL, "vocab_size": 256, "max_seq_len": 96},
            "data": {"tokenizer": "bytes", "seq_len": 96, "attention": "document", "positions": "document"},
            "train": {"batch_size": 2, "out_dir": str(tmp_path)}}
    cfg = load_run_config(None, [f"data.path={text_corpus}"], base=base)
    with pytest.raises(ConfigError, match="this stream has none"):
        LMTask(cfg, TEST_DEVICE, lambda s: None).setup()
    with pytest.raises(ConfigError, match="data.positions"):
        load_run_config(None, [f"data.path={text_corpus}", "data.attention=causal"], base=base)
    monkeypatch.setattr(ByteTokenizer, "bos_id", 10)
    task = LMTask(cfg, TEST_DEVICE, lambda s: None)
    task.setup()
    model = task.build_model()
    x, y = task.train_batch(0, 0)
    loss, n = task.loss(model, (x, y))
    total, count, docs = 0.0, 0, 0
    for r in range(x.shape[0]):
        starts = [0] + [i for i in range(1, x.shape[1]) if x[r, i] == 10] + [x.shape[1]]
        for a, b in zip(starts, starts[1:]):
            logits = model(x[r:r + 1, a:b])
            total = total + torch.nn.functional.cross_entropy(logits[0], y[r, a:b], reduction="sum")
            count += b - a
            docs += 1
    assert docs > x.shape[0]  # the batch holds several documents
    assert abs(loss.item() - total.item() / count) <= TOL


# ----------------------------------------------------------------------------- packing
def test_pack_rows_best_fit_decreasing():
    from train.data.packing import pack_rows
    assert pack_rows([5, 3, 8, 2, 7, 1, 4], 10) == [[2, 3], [1, 4], [0, 5, 6]]
    lengths = torch.randint(1, 33, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    rows = pack_rows(lengths, 32)
    assert sorted(i for r in rows for i in r) == list(range(200))
    assert all(sum(lengths[i] for i in r) <= 32 for r in rows)
    assert len(rows) <= 1.1 * sum(lengths) / 32 + 1  # near the lower bound
    assert rows == pack_rows(lengths, 32)  # deterministic
    with pytest.raises(ValueError, match="sequence 1 has 40 tokens"):
        pack_rows([3, 40], 32)


def test_packed_batch_loss_and_gradients_equal_per_sequence_forwards():
    """Issue 28's acceptance: conversations packed into rows (attention within each, positions
    restarting, padding) give the loss and gradients of one forward per conversation (fp32, <= 1e-5):
    the mean over all trained tokens."""
    from train.data.packing import pack
    g = torch.Generator().manual_seed(0)
    seqs = []
    for n in (9, 4, 7, 3, 12, 5):
        ids = torch.randint(0, SMALL["vocab_size"], (n,), generator=g)
        labels = torch.randint(0, SMALL["vocab_size"], (n,), generator=g)
        labels[: n // 3] = -100  # the prompt: not trained
        seqs.append((ids, labels))
    packed = pack(seqs, 16, pad_id=0)
    assert packed.input_ids.shape == (3, 16) and (packed.labels != -100).sum() == sum((l != -100).sum() for _, l in seqs)
    model = _model()
    model.chunked_loss = False  # the plain cross-entropy path; the chunked one below
    _, loss = model(packed.input_ids, packed.labels, doc_ids=packed.doc_ids, position_ids=packed.position_ids)
    grads = _grads(model, loss)
    total = sum(torch.nn.functional.cross_entropy(model(ids[None])[0], labels, reduction="sum") for ids, labels in seqs)
    ref = total / sum((l != -100).sum() for _, l in seqs)
    ref_grads = _grads(model, ref)
    _assert_close(loss, ref, "loss")
    for n in grads:
        _assert_close(grads[n], ref_grads[n], n)
    model.chunked_loss = True
    _, chunked = model(packed.input_ids, packed.labels, doc_ids=packed.doc_ids, position_ids=packed.position_ids)
    _assert_close(chunked, ref, "chunked loss")
