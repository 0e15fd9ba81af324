"""Bits per byte, batch-scaled learning rates and the gradient noise scale."""
import json
import math

import pytest
import torch
import torch.nn.functional as F

from train.builder import build_run
from train.config import load_run_config
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


@pytest.mark.parametrize("tokenizer", ["bytes", "sentencepiece", "bpe"])
def test_val_bpb_is_the_loss_per_byte_of_the_decoded_validation_text(tmp_path, text_corpus, tokenizer):
    """Reference: per-token losses from full logits, special tokens (BOS/EOS) left out by id, over the UTF-8 length
    of the evaluated targets decoded as one text (after a plain token, so no leading space is dropped)."""
    text, corpus = text_corpus.read_text()[:100_000], tmp_path / "docs.jsonl"  # documents: BOS/EOS between them
    corpus.write_text("".join(json.dumps({"text": text[i:i + 700]}) + "\n" for i in range(0, len(text), 700)))
    tokenizer = byte_level_bpe(tmp_path, text_corpus) if tokenizer == "bpe" else tokenizer
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
    assert run.task.cfg.optim.lr == run.cfg.optim.lr
    assert any("optim.reference_batch 2" in m for m in logs) == (rule != "none")


def test_lr_batch_scaling_needs_a_reference_batch(tmp_path, text_corpus):
    with pytest.raises(ConfigError, match="optim.reference_batch"):
        lm_config(tmp_path, text_corpus, "bytes", 256, "optim.lr_batch_scaling=sqrt")
