"""Bits per byte, batch-scaled learning rates and the gradient noise scale."""
import json
import math

import pytest
import torch
import torch.nn.functional as F

from train.builder import build_run
from train.config import load_run_config
from train.step import noise_parts, optimizer_step
from zoo.config import ConfigError


def lm_config(tmp_path, corpus, tokenizer, vocab, *over):
    base = {"family": "llm", "model": {"vocab_size": vocab, "d_model": 32, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1,
                                       "max_seq_len": 32},
            "data": {"path": str(corpus), "tokenizer": tokenizer, "vocab_size": vocab, "seq_len": 32,
                     "val_fraction": 0.1, "cache_dir": str(tmp_path / "cache")},
            "train": {"max_steps": 1, "batch_size": 4, "eval_batches": 3, "progress": False, "samples": False,
                      "plot": False, "out_dir": str(tmp_path / "run"), "peak_flops": 1e12}}
    return load_run_config(None, list(over), base=base)


def byte_level_bpe(tmp_path, corpus):
    """A byte-level BPE tokenizer.json trained on the corpus, with an end-of-text special token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train([str(corpus)], trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                                 initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "tokenizer.json"))
    return str(tmp_path / "tokenizer.json")


@pytest.mark.parametrize("tokenizer", ["bytes", "sentencepiece", "tokenizer.json", "bpe", "superbpe"])
def test_val_bpb_is_the_loss_per_byte_of_the_decoded_validation_text(tmp_path, text_corpus, tokenizer):
    """Reference: per-token losses from full logits, special tokens (BOS/EOS) left out by id, over the UTF-8 length
    of the evaluated targets decoded as one text (after a plain token, so no leading space is dropped)."""
    text, corpus = text_corpus.read_text()[:100_000], tmp_path / "docs.jsonl"  # documents: BOS/EOS between them
    corpus.write_text("".join(json.dumps({"text": text[i:i + 700]}) + "\n" for i in range(0, len(text), 700)))
    tokenizer = byte_level_bpe(tmp_path, text_corpus) if tokenizer == "tokenizer.json" else tokenizer
    run = build_run(lm_config(tmp_path, corpus, tokenizer, 256 if tokenizer == "bytes" else 512))
    task, model = run.task, run.model
    got = task.evaluate(model)
    tok = task.data.tokenizer
    special = {i for i in (tok.bos_id, tok.eos_id) if i is not None}
    nats, targets = 0.0, []
    model.eval()
    with torch.no_grad():
        for x, y in task.data.val_batches(4, 3):
            keep = torch.tensor([int(t) not in special for t in y.flatten()])
            nats += F.cross_entropy(model(x).flatten(0, 1).double(), y.flatten(), reduction="none")[keep].sum().item()
            targets += y.flatten().tolist()
    plain = tok.encode("x")[-1]
    text = tok.decode([plain] + [t for t in targets if t not in special])
    nbytes = len(text.encode()) - len(tok.decode([plain]).encode())
    assert tokenizer == "bytes" or any(t in special for t in targets)  # the special tokens' exclusion is tested
    assert got["val_bpb"] == pytest.approx(nats / math.log(2) / nbytes, rel=1e-6)


@pytest.mark.parametrize("rule,power", [("sqrt", 0.5), ("linear", 1.0), ("none", 0.0)])
def test_lr_batch_scaling_resolves_the_lr_from_the_global_batch(tmp_path, text_corpus, rule, power):
    over = [f"optim.lr_batch_scaling={rule}", "optim.reference_batch=2", "train.grad_accum=3", "optim.lr=0.001"]
    logs = []
    run = build_run(lm_config(tmp_path, text_corpus, "bytes", 256, *over), say=logs.append)
    f = (4 * 3 / 2) ** power  # the global batch: 4 rows x 3 micro-batches, one rank
    assert (run.cfg.optim.lr, run.cfg.optim.muon_lr) == pytest.approx((0.001 * f, 0.02 * f), rel=1e-12)
    assert run.task.cfg.optim.lr == run.cfg.optim.lr and run.cfg.optim.lr_batch_scaling == "none"  # applied once
    assert any("optim.reference_batch 2" in m for m in logs) == (rule != "none")


def test_lr_batch_scaling_needs_a_reference_batch(tmp_path, text_corpus):
    with pytest.raises(ConfigError, match="optim.reference_batch"):
        lm_config(tmp_path, text_corpus, "bytes", 256, "optim.lr_batch_scaling=sqrt")


def test_noise_scale_of_a_linear_regression_matches_its_closed_form():
    """Loss (w.x - y)^2 / 2, x ~ N(0, I_d), y = w*.x + N(0, s^2), at w = w* + D: per-example gradients g = (D.x - e) x
    have mean G = D and covariance (|D|^2 + s^2) I + D D^T, so B_simple = (d (|D|^2 + s^2) + |D|^2) / |D|^2 exactly.
    The estimate from mean squared norms of micro-batch and step gradients over many steps: tolerance 3% (over seeds
    0-5 it lands within about 1%)."""
    torch.manual_seed(0)
    d, s, micro, rows, steps = 8, 1.0, 4, 16, 50_000
    delta = torch.randn(d, dtype=torch.float64)
    x = torch.randn(steps, micro, rows, d, dtype=torch.float64)
    g = (x @ delta - s * torch.randn(steps, micro, rows, dtype=torch.float64))[..., None] * x  # per example
    small, big = (g[:, 0].mean(1) ** 2).sum(-1).mean().item(), (g.mean((1, 2)) ** 2).sum(-1).mean().item()
    g2, trace = noise_parts(small, big, rows, rows * micro)
    D2 = float(delta @ delta)
    assert trace / g2 == pytest.approx((d * (D2 + s * s) + D2) / D2, rel=0.03)


def test_optimizer_step_probes_the_first_micro_batch_gradient():
    """micro_sq and grad_norm^2 are the squared norms of the first micro-batch's gradient and the step's mean
    gradient, computed here directly (1e-6: the norms are taken in float32)."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(5, dtype=torch.float64))
    xs = [torch.randn(3, 5, dtype=torch.float64) for _ in range(4)]
    loss = lambda b: ((b @ w) ** 2).mean()  # noqa: E731
    r = optimizer_step(lambda b: (loss(b), 3), iter(xs), 4, torch.optim.SGD([w], lr=0.0),
                       torch.amp.GradScaler("cpu", enabled=False), [w], None, probe=True)
    grads = [torch.autograd.grad(loss(b), w)[0] for b in xs]
    assert r.micro_sq == pytest.approx(float(grads[0] @ grads[0]), rel=1e-6)
    assert r.grad_norm ** 2 == pytest.approx(float(sum(grads).norm() ** 2 / 16), rel=1e-6)


def test_noise_scale_and_val_bpb_are_logged(tmp_path, text_corpus):
    from train.loop import train
    from train.metrics import read_rows
    cfg = lm_config(tmp_path, text_corpus, "bytes", 256, "train.log_noise_scale=true", "train.grad_accum=2",
                    "train.max_steps=2", "train.log_every=1", "train.eval_every=0", "train.checkpoint_every=0")
    train(cfg)
    rows = read_rows(tmp_path / "run")
    assert [r["step"] for r in rows if "noise_scale" in r] == [1, 2]
    assert all(math.isfinite(r["noise_scale"]) for r in rows if "noise_scale" in r)
    assert [r["step"] for r in rows if "val_bpb" in r] == [2]  # the final evaluation's row
    with pytest.raises(ConfigError, match="train.log_noise_scale"):
        lm_config(tmp_path, text_corpus, "bytes", 256, "train.log_noise_scale=true")


def test_superbpe_table_has_each_seed_and_the_per_seed_difference_with_its_interval():
    from train.benches import harness, superbpe
    bpb, per_byte = {"bpe": [2.0, 2.1, 2.3], "superbpe": [1.9, 2.05, 2.1]}, {"bpe": 0.3, "superbpe": 0.25}
    rows = superbpe.compare(bpb, per_byte, [0, 1, 2], "notes")["rows"]
    assert [r[0] for r in rows] == ["bpe", "superbpe", "superbpe - bpe"]
    assert rows[0][1:4] == ["0.3000", "2.0000", "2.1000"] and rows[2][1] == "-0.0500"
    m, h = harness.mean_interval([-0.1, -0.05, -0.2])
    assert rows[2][2:] == ["-0.1000", "-0.0500", "-0.2000", f"{m:+.4f} ± {h:.4f} {harness.verdict(m, h)}"]
    assert rows[1][5] == "{:.4f} ± {:.4f}".format(*harness.mean_interval(bpb["superbpe"]))


@pytest.mark.slow
def test_superbpe_bench_compares_both_tokenizers_on_the_same_held_out_text(tmp_path, monkeypatch):
    """The bench at toy size (four standard library files, vocab 300, two steps, runs in this process): the tokens
    per byte of the held-out file counted here, each run's own val_bpb in the table, the difference row seed by
    seed, and the docs region rendered from the JSON."""
    import functools

    from train.benches import harness, superbpe
    from train.data import HFTokenizer, stdlib_files
    from train.docs import render_result
    from train.metrics import read_rows
    monkeypatch.setattr(harness, "run_loop", functools.partial(harness.run_loop, inproc=True))
    superbpe.main(["--files", "4", "--vocab", "300", "--steps", "2", "--seeds", "0,1", "--out", str(tmp_path / "runs"),
                   "--json", str(tmp_path / "superbpe.json"), "model.d_model=32", "model.n_layers=1", "model.n_heads=2",
                   "model.n_kv_heads=1", "data.seq_len=16", "train.batch_size=2", "train.peak_flops=1e12",
                   f"data.cache_dir={tmp_path / 'cache'}"])
    result, out = json.loads((tmp_path / "superbpe.json").read_text()), tmp_path / "runs" / "vocab300-files4"
    held = stdlib_files()[0].read_text(errors="replace")  # every tenth of the first four: the first
    rows, bpb = result["tables"]["val_bpb"]["rows"], result["data"]["val_bpb"]
    for row, kind in zip(rows, ("bpe", "superbpe")):
        per_byte = len(HFTokenizer(out / f"{kind}.json").encode(held)) / len(held.encode())
        runs = [harness.final(read_rows(out / f"{kind}-2steps-seed{s}")) for s in (0, 1)]
        assert row[:4] == [kind, f"{per_byte:.4f}", *(f"{r['val_bpb']:.4f}" for r in runs)]
        assert bpb[kind] == [r["val_bpb"] for r in runs]
    assert rows[2][2:4] == [f"{s - b:+.4f}" for s, b in zip(bpb["superbpe"], bpb["bpe"])]
    assert rows[2][0] == "superbpe - bpe" and "±" in rows[2][4]
    text = render_result("superbpe", results=tmp_path)
    assert "| superbpe - bpe |" in text and "`python train/bench.py superbpe --files 4" in text
