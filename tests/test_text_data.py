"""Text sources, tokenizers and the token cache."""
import json
import re

import numpy as np
import pytest
import torch

from train.config import load_run_config
from train.data import DataError, TextDataConfig, TokenData, read_corpus, stdlib_files, train_bpe
from zoo.config import ConfigError
from conftest import TEST_DEVICE
from tests.test_loop import TINY, check_resume_is_exact


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


@pytest.mark.parametrize("kind", ["bpe", "superbpe"])
def test_trained_bpe_is_a_tokenizer_json_transformers_reads_with_zoo_ids(tmp_path, text_corpus, kind):
    """Zoo's ids of held-out text (a standard-library file past the corpus) equal PreTrainedTokenizerFast's reading
    the saved tokenizer.json; only SuperBPE has tokens across whitespace (the pre-tokenizer forbids them in BPE)."""
    from transformers import PreTrainedTokenizerFast
    d = TokenData(TextDataConfig(path=str(text_corpus), tokenizer=kind, vocab_size=512, seq_len=32,
                                 cache_dir=str(tmp_path / "cache")), log=lambda m: None)
    tok = d.tokenizer
    assert tok.vocab_size == 512 and tok.eos_id == 0 and tok.model_path.endswith(".json")
    held = stdlib_files()[-1].read_text()[:20_000]
    ids = tok.encode(held)
    assert PreTrainedTokenizerFast(tokenizer_file=tok.model_path)(held, add_special_tokens=False).input_ids == ids
    assert tok.decode(ids) == held and len(ids) < len(held.encode())
    across = [p for p in map(tok.decode, ([i] for i in range(1, 512))) if re.search(r"\S\s+\S", p)]
    assert bool(across) == (kind == "superbpe"), across


def test_superbpe_extends_the_bpe_of_its_transition(tmp_path, text_corpus):
    """SuperBPE's first stage is the BPE of `transition` ids: its vocabulary and merges come first, unchanged."""
    docs = [text_corpus.read_text()]
    bpe, sup = (json.loads(train_bpe(docs, 512, tmp_path / f"{n}.json", t, log=lambda m: None).read_text())["model"]
                for n, t in (("bpe", None), ("superbpe", 400)))
    first = json.loads(train_bpe(docs, 400, tmp_path / "first.json", log=lambda m: None).read_text())["model"]
    assert sup["merges"][:len(first["merges"])] == first["merges"] and len(sup["vocab"]) == len(bpe["vocab"]) == 512
    assert {k: v for k, v in sup["vocab"].items() if v < 400} == first["vocab"] and sup["merges"] != bpe["merges"]


@pytest.mark.parametrize("kind", ["bpe", "superbpe"])
def test_a_run_trains_and_resumes_on_its_trained_tokenizer(tmp_path, text_corpus, kind, monkeypatch, one_thread):
    """Trained once: the resumed run reads the cached tokenizer.json, and the run folder holds it."""
    import train.data
    trained = []
    monkeypatch.setattr(train.data, "train_bpe", lambda *a, **k: trained.append(a) or train_bpe(*a, **k))
    over = {"data.tokenizer": kind, "data.vocab_size": 320, "model.vocab_size": 320, "data.cache_dir": tmp_path / "c",
            "train.checkpoint_every": 2, "train.max_steps": 4, "optim.warmup_steps": 1}
    part, _ = check_resume_is_exact(tmp_path, text_corpus, 4, **over)
    (cached,) = (tmp_path / "c").glob(f"{kind}-*.json")
    assert len(trained) == 1 and (part / "tokenizer.json").read_bytes() == cached.read_bytes()


@pytest.mark.parametrize("over,key", [("data.tokenizer=gpt2", "data.tokenizer"),
                                      ("data.vocab_size=256", "data.vocab_size")])
def test_unknown_tokenizer_or_too_small_a_vocabulary_is_a_one_line_error(over, key):
    with pytest.raises(ConfigError, match=key) as e:
        load_run_config(None, ["data.tokenizer=bpe", over], base=TINY)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("text,tokenizer,says", [("\n  \n", "sentencepiece", "no non-empty lines"),
                                                 ("", "bpe", "no text"),
                                                 ("hello world\n", "sentencepiece", "Vocabulary size too high")])
def test_a_tokenizer_that_cannot_be_trained_names_the_corpus_and_the_keys(tmp_path, text, tokenizer, says):
    """An empty corpus, or one too small for the vocabulary: the error names the file and the data keys."""
    (tmp_path / "t.txt").write_text(text)
    cfg = TextDataConfig(path=str(tmp_path / "t.txt"), tokenizer=tokenizer, vocab_size=2048, seq_len=16,
                         cache_dir=str(tmp_path / "cache"))
    with pytest.raises(DataError, match=says) as e:
        TokenData(cfg, log=lambda m: None)
    msg = str(e.value)
    assert str(tmp_path / "t.txt") in msg and f"data.tokenizer={tokenizer}" in msg and "data.vocab_size=2048" in msg
    assert "\n" not in msg
