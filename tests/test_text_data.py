"""Text sources, tokenizers and the token cache."""
import json

import numpy as np
import torch

from train.data import TextDataConfig, TokenData, read_corpus
from conftest import TEST_DEVICE


def test_sources_file_folder_jsonl(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("alpha beta")
    (tmp_path / "docs" / "b.txt").write_text("gamma")
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in ["one", "two"]) + "\n")
    assert read_corpus(str(tmp_path / "docs")) == "alpha beta\n\ngamma"
    assert read_corpus(str(tmp_path / "c.jsonl")) == "one\n\ntwo"
    assert read_corpus(str(tmp_path / "docs" / "a.txt")) == "alpha beta"


def test_bytes_tokens_match_the_text_and_split_is_a_tail(tmp_path):
    text = "".join(chr(97 + i % 26) for i in range(5000))
    (tmp_path / "t.txt").write_text(text)
    d = TokenData(TextDataConfig(path=str(tmp_path / "t.txt"), tokenizer="bytes", seq_len=16, val_fraction=0.1),
                  log=lambda m: None)
    allt = np.concatenate([np.asarray(d.train), np.asarray(d.val)])
    assert bytes(allt.astype(np.uint8)).decode() == text
    assert len(d.val) == 500
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    x1, y1 = d.batch("train", 4, g1, TEST_DEVICE)
    x2, _ = d.batch("train", 4, g2, TEST_DEVICE)
    assert torch.equal(x1, x2) and x1.shape == (4, 16)
    assert torch.equal(x1[:, 1:], y1[:, :-1])  # targets are inputs shifted by one


def test_sentencepiece_trained_cached_and_loaded_from_path(tmp_path, text_corpus):
    cfg = TextDataConfig(path=str(text_corpus), tokenizer="sentencepiece", vocab_size=512, seq_len=32,
                         cache_dir=str(tmp_path / "cache"))
    d = TokenData(cfg, log=lambda m: None)
    assert d.tokenizer.vocab_size == 512
    sample = "def f(x):\n    return x + 1\n"
    assert d.tokenizer.decode(d.tokenizer.encode(sample)) == sample  # byte fallback: lossless
    logs = []
    d2 = TokenData(cfg, log=logs.append)  # second time: from the cache, no retraining
    assert not any("training a sentencepiece" in m for m in logs)
    assert np.array_equal(np.asarray(d2.train), np.asarray(d.train))
    # the cached model used as an explicit tokenizer path gives the same tokens
    d3 = TokenData(TextDataConfig(path=str(text_corpus), tokenizer=d.tokenizer.model_path, seq_len=32,
                                  cache_dir=str(tmp_path / "cache2")), log=lambda m: None)
    assert np.array_equal(np.asarray(d3.train), np.asarray(d.train))
    assert d.unigram_entropy() > 0


def test_hf_tokenizer_json(tmp_path, text_corpus):
    """A Hugging Face tokenizer.json (what Llama 3 and Qwen2 ship) tokenises the corpus."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train([str(text_corpus)], trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "tokenizer.json"))
    d = TokenData(TextDataConfig(path=str(text_corpus), tokenizer=str(tmp_path / "tokenizer.json"), seq_len=32,
                                 cache_dir=str(tmp_path / "cache")), log=lambda m: None)
    assert d.tokenizer.vocab_size == tok.get_vocab_size()
    ids = np.concatenate([np.asarray(d.train), np.asarray(d.val)])
    assert np.array_equal(ids[:50], tok.encode(text_corpus.read_text()[:2000]).ids[:50])
    sample = "def f(x):\n    return x + 1\n"
    assert d.tokenizer.decode(d.tokenizer.encode(sample)) == sample
