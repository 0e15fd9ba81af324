"""Streaming preparation (train/data/shards.py), sources, document boundaries, pre-tokenized
inputs, mixtures and batches made ahead (train/data/)."""
import gzip
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from train.data import (ByteTokenizer, DataError, Problems, SentencePieceTokenizer, TextDataConfig, TokenData,
                        documents, document_ids, sample_documents, train_sentencepiece)
from train.data.loader import Prefetcher
from train.data.shards import prepare
from train.data.tokens import LLMC_MAGIC
from conftest import TEST_DEVICE

ROOT = Path(__file__).resolve().parents[1]
QUIET = lambda m: None  # noqa: E731
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex zebras".split()


def make_docs(n=300, seed=0):
    rng = np.random.default_rng(seed)
    return [f"doc {i}: " + " ".join(rng.choice(WORDS, int(rng.integers(3, 60)))) for i in range(n)]


def write_jsonl(path, docs, opener=open):
    with opener(path, "wt") as f:
        for d in docs:
            f.write(json.dumps({"text": d, "id": 0}) + "\n")
    return path


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("sp") / "sp.model"
    train_sentencepiece(make_docs(400, seed=1), 300, path, QUIET)
    return SentencePieceTokenizer(path)


def shard_bytes(folder: Path) -> dict:
    return {f.name: f.read_bytes() for f in sorted(folder.iterdir()) if f.name != "manifest.json"}


def prep(src, tok, out, **kw):
    kw = {"chunk_chars": 2000, "shard_tokens": 3000, "boundary": (None, tok.eos_id), "log": QUIET, **kw}
    return prepare(str(src), tok, out, **kw)


# ------------------------------------------------------------------------------ preparation
def test_one_and_two_workers_give_identical_shards(tmp_path, sp_model):
    src = write_jsonl(tmp_path / "c.jsonl", make_docs())
    one = prep(src, sp_model, tmp_path / "one", workers=1)
    import gc
    two = prep(src, sp_model, tmp_path / "two", workers=2)
    assert gc.get_freeze_count() == 0  # the GC freeze around the workers' fork is undone
    assert len(one.files) >= 3
    assert shard_bytes(tmp_path / "one") == shard_bytes(tmp_path / "two")
    # the shards hold each document's ids followed by EOS, and the index points at each document
    ids = np.concatenate([np.asarray(t) for t in one.tokens])
    want = np.concatenate([np.r_[sp_model.encode(d), sp_model.eos_id] for d in make_docs()])
    assert np.array_equal(ids, want)
    starts = np.concatenate([s + sum(len(t) for t in one.tokens[:k]) for k, s in enumerate(one.doc_starts)])
    assert np.array_equal(starts, np.r_[0, np.flatnonzero(want == sp_model.eos_id)[:-1] + 1])


KILLER = """
import os, signal, sys
sys.path.insert(0, {root!r})
from train.data import shards as P
from train.data.text_tokenizers import SentencePieceTokenizer
calls = [0]
add = P._Writer.add
def add_then_die(self, tokens, starts):
    calls[0] += 1
    if calls[0] == 4:  # half of this chunk in the shard being written, then SIGKILL
        self.fh.write(memoryview(tokens[:len(tokens) // 2]).cast("B"))
        self.fh.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    add(self, tokens, starts)
P._Writer.add = add_then_die
tok = SentencePieceTokenizer({model!r})
P.prepare({src!r}, tok, P.Path({out!r}), chunk_chars=2000, shard_tokens=3000, boundary=(None, tok.eos_id),
          workers=2, log=print)
"""


def test_killed_preparation_reruns_to_the_same_shards(tmp_path, sp_model):
    src = write_jsonl(tmp_path / "c.jsonl", make_docs())
    whole = prep(src, sp_model, tmp_path / "whole", workers=1)
    out = tmp_path / "killed"
    script = KILLER.format(root=str(ROOT), model=sp_model.model_path, src=str(src), out=str(out))
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert p.returncode == -9, p.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert not manifest["complete"] and manifest["shards"]  # killed after a shard, in the middle of the next
    assert (out / f"shard-{len(manifest['shards']):05d}.bin.tmp").stat().st_size > 0
    for f in out.glob("shard-*.bin"):  # a shard under its final name is whole; only the .tmp one is partial
        assert f.read_bytes() == (tmp_path / "whole" / f.name).read_bytes()
    with pytest.raises(DataError, match="not complete"):
        from train.data.shards import Shards
        Shards(out)
    logs = []
    again = prep(src, sp_model, out, workers=2, log=logs.append)
    assert any("resuming the preparation" in m for m in logs), logs
    assert shard_bytes(out) == shard_bytes(tmp_path / "whole")
    assert again.manifest["tokens"] == whole.manifest["tokens"]


def test_sources_read_the_same_documents(tmp_path):
    docs = make_docs(50) + ["caf\u00e9 \u2603 unicode"]
    want = [d for d in docs]
    write_jsonl(tmp_path / "a.jsonl", docs)
    write_jsonl(tmp_path / "a.jsonl.gz", docs, opener=gzip.open)
    read = lambda p: [d.text for d in documents(str(p))]  # noqa: E731
    assert read(tmp_path / "a.jsonl") == want
    assert read(tmp_path / "a.jsonl.gz") == want
    import zstandard as zstd
    (tmp_path / "a.jsonl.zst").write_bytes(zstd.ZstdCompressor().compress((tmp_path / "a.jsonl").read_bytes()))
    assert read(tmp_path / "a.jsonl.zst") == want
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"body": docs, "n": list(range(len(docs)))}), tmp_path / "a.parquet", row_group_size=7)
    assert [d.text for d in documents(str(tmp_path / "a.parquet"), column="body")] == want
    with pytest.raises(DataError, match="no column 'text'"):
        list(documents(str(tmp_path / "a.parquet")))
    import datasets
    datasets.Dataset.from_dict({"body": docs}).save_to_disk(str(tmp_path / "saved"))
    assert [d.text for d in documents(str(tmp_path / "saved"), column="body")] == want
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"body": docs})}).save_to_disk(str(tmp_path / "dd"))
    assert [d.text for d in documents(str(tmp_path / "dd"), column="body")] == want


def test_parquet_reading_holds_one_row_group_not_the_file(tmp_path):
    """Arrow memory while reading a file of 60 row groups stays within a few row groups' bytes; a reader over the
    whole file kept its buffers as it went (memory grew with the file)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    docs = [f"{i} " + "x" * 2000 for i in range(60 * 64)]
    pq.write_table(pa.table({"text": docs}), tmp_path / "big.parquet", row_group_size=64)
    group_bytes, peak = 64 * 2000, 0
    for i, d in enumerate(documents(str(tmp_path / "big.parquet"))):
        peak = max(peak, pa.total_allocated_bytes())
        assert d.text == docs[i]
    assert i == len(docs) - 1 and peak < 8 * group_bytes, (peak, group_bytes)


def test_large_text_file_streams_in_pieces_of_one_document(tmp_path, monkeypatch, sp_model):
    from train.data import sources
    monkeypatch.setattr(sources, "PIECE_BYTES", 1000)
    text = "\n\n".join(make_docs(60))
    (tmp_path / "big.txt").write_text(text)
    pieces = list(documents(str(tmp_path / "big.txt")))
    assert len(pieces) > 3 and "".join(p.text for p in pieces) == text
    assert [(p.first, p.last) for p in pieces] == [(True, False)] + [(False, False)] * (len(pieces) - 2) + [(False, True)]
    out = prep(tmp_path / "big.txt", ByteTokenizer(), tmp_path / "out", workers=1)
    assert bytes(np.concatenate([np.asarray(t) for t in out.tokens]).astype(np.uint8)).decode() == text
    assert out.manifest["documents"] == 1
    for workers in (1, 2):  # its pieces tokenised in parallel, in order
        prep(tmp_path / "big.txt", sp_model, tmp_path / f"sp{workers}", workers=workers)
    assert shard_bytes(tmp_path / "sp1") == shard_bytes(tmp_path / "sp2") and len(shard_bytes(tmp_path / "sp1")) > 2


def test_bad_rows_are_counted_in_one_line(tmp_path):
    f = tmp_path / "c.jsonl"
    good = [json.dumps({"text": d}) for d in make_docs(5)]
    f.write_bytes("\n".join([good[0], "{broken", good[1], '{"text": null}', json.dumps({"text": "  "}), good[2],
                             "[1]", good[3], good[4]]).encode() + b'\n{"text": "bad \xff\xfe byte"}\n')
    logs = []
    out = prep(f, ByteTokenizer(), tmp_path / "out", workers=1, boundary=(None, None), log=logs.append)
    (line,) = [m for m in logs if "bad documents" in m]
    assert f"{f} (lines 2, 4, 7): 3 bad jsonl lines (not JSON, or no string data.column field; skipped)" in line and "1 empty documents" in line
    assert "2 undecodable bytes replaced with U+FFFD" in line
    assert out.manifest["documents"] == 6 and out.manifest["problems"] == {"bad_json": 3, "empty": 1, "undecodable": 2}
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"text": ["one", None, "", "two"]}), tmp_path / "p.parquet")
    problems = Problems()
    assert [d.text for d in documents(str(tmp_path / "p.parquet"), problems=problems)] == ["one", "two"]
    assert problems.counts == {"empty": 2}


def _bad_inputs(d: Path) -> dict:
    """{case: (source, the words its one-line error must hold)}."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard
    docs = make_docs(400)
    pq.write_table(pa.table({"body": docs, "n": list(range(len(docs)))}), d / "nocol.parquet")
    (d / "shards").mkdir()
    for i in range(2):
        pq.write_table(pa.table({"text": docs}), d / "shards" / f"part-{i}.parquet", row_group_size=50)
    cut = d / "shards" / "part-1.parquet"
    cut.write_bytes(cut.read_bytes()[:cut.stat().st_size // 2])
    whole = write_jsonl(d / "c.jsonl", docs).read_bytes()
    (d / "c.jsonl.gz").write_bytes(gzip.compress(whole)[:-40])
    (d / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(whole)[:-40])
    (d / "small.txt").write_text("a corpus of a few words")
    return {"parquet without the column": (d / "nocol.parquet", ["no column 'text'", "columns: body, n"]),
            "truncated Parquet shard": (d / "shards", [str(cut), "not a readable Parquet file"]),
            "truncated .jsonl.gz": (d / "c.jsonl.gz", ["truncated"]),
            "truncated .jsonl.zst": (d / "c.jsonl.zst", ["truncated"]),
            "smaller than one window": (d / "small.txt", ["23 tokens", "too short for data.seq_len=32"])}


@pytest.mark.parametrize("case", ["parquet without the column", "truncated Parquet shard", "truncated .jsonl.gz",
                                  "truncated .jsonl.zst", "smaller than one window"])
def test_bad_input_is_a_one_line_error_naming_the_file(tmp_path, case):
    src, words = _bad_inputs(tmp_path)[case]
    with pytest.raises(DataError) as e:
        TokenData(TextDataConfig(path=str(src), tokenizer="bytes", seq_len=32, cache_dir=str(tmp_path / "cache"),
                                 workers=1), log=QUIET)
    msg = str(e.value)
    assert len(msg.splitlines()) == 1 and str(src) in msg and all(w in msg for w in words), msg


# ------------------------------------------------------------------------------ tokenizer sample
def test_sentencepiece_sample_is_drawn_across_the_corpus():
    docs = [f"{i:05d}" + "x" * 95 for i in range(2000)]  # 100 chars each
    picked = sample_documents(iter(docs), 20_000, seed=0)
    assert sum(map(len, picked)) <= 20_000 and len(picked) >= 150
    idx = [int(d[:5]) for d in picked]
    assert idx == sorted(idx) and max(idx) > 1800 and min(idx) < 200  # spread across, in corpus order
    assert sample_documents(iter(docs), 20_000, seed=0) == picked


# ------------------------------------------------------------------------------ boundaries
def test_document_boundaries_and_held_out_whole_documents(tmp_path, sp_model):
    docs = make_docs(200)
    write_jsonl(tmp_path / "c.jsonl", docs)
    cfg = TextDataConfig(path=str(tmp_path / "c.jsonl"), tokenizer=sp_model.model_path, seq_len=32,
                         cache_dir=str(tmp_path / "cache"), val_fraction=0.1, shard_tokens=2000, workers=1)
    d = TokenData(cfg, log=QUIET)
    assert (d.boundary, d.bos_id, d.eos_id) == ("eos", None, sp_model.eos_id)
    # validation starts at a document: the training part ends with an EOS
    assert np.asarray(d.train)[-1] == sp_model.eos_id
    x = torch.from_numpy(np.asarray(d.val[:400], dtype=np.int64))
    ids = d.document_ids(x)
    ends = np.flatnonzero(x.numpy() == sp_model.eos_id)
    assert ids[0] == 0 and ids[ends[0]] == 0 and ids[ends[0] + 1] == 1  # EOS closes its document
    assert len(np.unique(ids.numpy())) == len(ends) + (ends[-1] != len(x) - 1)
    text = sp_model.decode(x[:ends[0]].tolist())
    assert text in docs
    d2 = TokenData(TextDataConfig(**{**cfg.__dict__, "boundary": "both"}), log=QUIET)
    assert (d2.boundary, d2.bos_id) == ("both", sp_model.bos_id)
    y = torch.tensor([[5, 1, 7, 8, 2, 1, 9, 2]])
    assert document_ids(y, "both", 1, 2).tolist() == [[0, 1, 1, 1, 1, 2, 2, 2]]
    assert document_ids(y, "eos", None, 2).tolist() == [[0, 0, 0, 0, 0, 1, 1, 1]]
    with pytest.raises(DataError, match="has no BOS token"):
        TokenData(TextDataConfig(path=cfg.path, tokenizer="bytes", boundary="bos", seq_len=32,
                                 cache_dir=cfg.cache_dir), log=QUIET)


# ------------------------------------------------------------------------------ pre-tokenized
def test_nanogpt_bin_and_llmc_shards_read_the_ids_written(tmp_path):
    rng = np.random.default_rng(0)
    train, val = rng.integers(0, 300, 5000).astype(np.uint16), rng.integers(0, 300, 700).astype(np.uint16)
    (tmp_path / "nano").mkdir()
    train.tofile(tmp_path / "nano" / "train.bin")
    val.tofile(tmp_path / "nano" / "val.bin")
    d = TokenData(TextDataConfig(path=str(tmp_path / "nano" / "train.bin"), seq_len=16), log=QUIET)
    assert np.array_equal(np.asarray(d.train), train) and np.array_equal(np.asarray(d.val), val)
    assert d.vocab_size == int(max(train.max(), val.max())) + 1
    big = rng.integers(0, 100_000, 3000).astype(np.uint32)
    big.tofile(tmp_path / "big.bin")
    d = TokenData(TextDataConfig(path=str(tmp_path / "big.bin"), seq_len=16, token_dtype="uint32"), log=QUIET)
    assert np.array_equal(np.r_[np.asarray(d.train), np.asarray(d.val)], big)

    def llmc(path, ids):
        head = np.zeros(256, dtype=np.int32)
        head[:3] = [LLMC_MAGIC, 1, len(ids)]
        path.write_bytes(head.tobytes() + ids.astype(np.uint16).tobytes())
    (tmp_path / "fw").mkdir()
    parts = [rng.integers(0, 50257, n) for n in (3000, 2500)]
    llmc(tmp_path / "fw" / "fineweb_train_000001.bin", parts[0])
    llmc(tmp_path / "fw" / "fineweb_train_000002.bin", parts[1])
    llmc(tmp_path / "fw" / "fineweb_val_000000.bin", val)
    for path in (tmp_path / "fw", str(tmp_path / "fw" / "fineweb_*.bin")):
        d = TokenData(TextDataConfig(path=str(path), seq_len=16), log=QUIET)
        assert np.array_equal(np.asarray(d.train), np.concatenate(parts)) and np.array_equal(np.asarray(d.val), val)
    assert np.array_equal(np.asarray(d.train[2990:3010]), np.concatenate(parts)[2990:3010])  # across two files
    llmc(tmp_path / "fw" / "fineweb_train_000003.bin", np.arange(10))
    with open(tmp_path / "fw" / "fineweb_train_000003.bin", "r+b") as f:
        f.truncate(1024 + 10)
    with pytest.raises(DataError, match="truncated"):
        TokenData(TextDataConfig(path=str(tmp_path / "fw"), seq_len=16), log=QUIET)


def test_a_prepared_shard_folder_reads_in_place(tmp_path):
    """data.path at a folder prepare() wrote (shards, their .docs.npy index, manifest.json) reads its ids as
    pre-tokenized shards, in the dtype the manifest records."""
    write_jsonl(tmp_path / "c.jsonl", make_docs(60))
    out = prep(tmp_path / "c.jsonl", ByteTokenizer(), tmp_path / "tokens", workers=1)
    d = TokenData(TextDataConfig(path=str(tmp_path / "tokens"), seq_len=16, token_dtype="uint32"), log=QUIET)
    ids = np.concatenate([np.asarray(t) for t in out.tokens])
    assert len(out.files) >= 2 and np.array_equal(np.r_[np.asarray(d.train), np.asarray(d.val)], ids)


def test_model_vocab_must_cover_the_largest_id(tmp_path):
    from zoo.config import ConfigError
    from train.config import load_run_config
    from train.tasks.lm import LMTask
    np.r_[np.zeros(2000), 300].astype(np.uint16).tofile(tmp_path / "train.bin")
    cfg = load_run_config(None, [], base={
        "family": "llm", "model": {"vocab_size": 256, "d_model": 16, "n_layers": 1, "n_heads": 2, "max_seq_len": 16},
        "data": {"path": str(tmp_path / "train.bin"), "seq_len": 16}})
    task = LMTask(cfg, TEST_DEVICE, QUIET)
    task.setup()
    with pytest.raises(ConfigError, match=r"vocab_size=256 is smaller than the data's \(largest id 300\) 301"):
        task.build_model()


# ------------------------------------------------------------------------------ mixtures
def mixture_cfg(tmp_path, **kw):
    for name, ch in (("a", "a"), ("b", "b")):
        write_jsonl(tmp_path / f"{name}.jsonl", [ch * 200] * 40)
    return TextDataConfig(sources=[{"path": str(tmp_path / "a.jsonl"), "weight": 3.0},
                                   {"path": str(tmp_path / "b.jsonl"), "weight": 1.0}],
                          tokenizer="bytes", seq_len=16, cache_dir=str(tmp_path / "cache"), **kw)


def test_mixture_proportions_within_sampling_error(tmp_path):
    d = TokenData(mixture_cfg(tmp_path), log=QUIET)
    assert [len(m) for m in d.mixture] == [len(d.mixture[0])] * 2
    n = 4000
    x = d.windows("train", n, torch.Generator().manual_seed(0))
    frac_a = (x[:, 0] == ord("a")).float().mean().item()
    sigma = (0.75 * 0.25 / n) ** 0.5
    assert abs(frac_a - 0.75) < 4 * sigma, frac_a
    assert set(np.unique(x.numpy())) <= {ord("a"), ord("b")}


MIX_RUN = {"family": "llm", "model": {"vocab_size": 256, "d_model": 16, "n_layers": 1, "n_heads": 2, "max_seq_len": 16},
           "train": {"batch_size": 4, "log_every": 1, "eval_every": 0, "eval_batches": 1, "device": str(TEST_DEVICE),
                     "checkpoint_every": 2, "peak_flops": 1e12, "progress": False, "samples": False, "plot": False,
                     "export": False}}


@pytest.mark.usefixtures("one_thread")
def test_mixture_resume_is_exact(tmp_path):
    from safetensors.torch import load_file
    from train.config import load_run_config
    from train.loop import train
    data = {k: v for k, v in mixture_cfg(tmp_path).__dict__.items() if k != "sources"}
    data["sources"] = [{"path": str(tmp_path / "a.jsonl"), "weight": 3.0}, {"path": str(tmp_path / "b.jsonl")}]
    base = {**MIX_RUN, "data": data}

    def run(out):
        return train(load_run_config(None, [f"train.out_dir={out}", "train.max_steps=4"], base=base), log=logs.append)
    logs = []
    run(tmp_path / "whole")
    shutil.copytree(tmp_path / "whole", tmp_path / "resumed")  # as a run killed after the checkpoint of step 2
    shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "step_00000004")
    (tmp_path / "resumed" / "model.safetensors").unlink()
    logs.clear()
    run(tmp_path / "resumed")
    assert any(m.startswith("resumed from") and "(step 2)" in m for m in logs), logs
    a, b = load_file(tmp_path / "whole" / "model.safetensors"), load_file(tmp_path / "resumed" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    speed = [json.loads(l) for l in (tmp_path / "whole" / "speed.jsonl").read_text().splitlines()]
    assert all(r["data_wait_s"] >= 0 for r in speed) and len(speed) == 4


def test_separate_validation_source(tmp_path):
    cfg = mixture_cfg(tmp_path)
    write_jsonl(tmp_path / "v.jsonl", ["v" * 100] * 3)
    d = TokenData(TextDataConfig(**{**cfg.__dict__, "val_path": str(tmp_path / "v.jsonl")}), log=QUIET)
    assert set(np.unique(np.asarray(d.val))) == {ord("v")}
    assert len(d.train) == 2 * 40 * 200  # every training token kept


# ------------------------------------------------------------------------------ batches made ahead
def test_prefetcher_gives_the_batches_asked_for_in_any_order():
    made = []

    def make(k):
        made.append(k)
        return torch.full((2,), k)
    p = Prefetcher(make, lambda k: k + 1, depth=2)
    assert [p.get(k).tolist() for k in (0, 1, 2, 7, 8, 3)] == [[0, 0], [1, 1], [2, 2], [7, 7], [8, 8], [3, 3]]
    assert made[:3] == [0, 1, 2]  # made ahead in order
    p.close()
    bad = Prefetcher(lambda k: 1 / 0 if k == 2 else k, lambda k: k + 1)
    assert bad.get(0) == 0 and bad.get(1) == 1
    with pytest.raises(ZeroDivisionError):
        bad.get(2)


def test_prepare_cli_prepares_what_the_run_reads(tmp_path, capsys):
    from train.prepare import main
    src = write_jsonl(tmp_path / "c.jsonl", make_docs(100))
    over = [f"data.path={src}", "data.tokenizer=bytes", f"data.cache_dir={tmp_path / 'cache'}", "data.seq_len=32"]
    assert main([str(ROOT / "configs" / "llm" / "tiny.yaml"), *over]) == 0
    (manifest,) = (tmp_path / "cache").glob("tokens-*/manifest.json")
    assert json.loads(manifest.read_text())["complete"]
    logs = []
    from train.config import load_run_config
    TokenData(load_run_config(str(ROOT / "configs" / "llm" / "tiny.yaml"), over).data, log=logs.append)
    assert not any("prepared" in m for m in logs), logs  # the run finds the cache complete
    capsys.readouterr()
    assert main([str(ROOT / "configs" / "llm" / "tiny.yaml"), f"data.path={tmp_path / 'nope.jsonl'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "nope.jsonl" in err
    assert main([str(ROOT / "configs" / "llm" / "tiny-sft.yaml"), "train.init_from=null"]) == 2  # chat rows
    assert capsys.readouterr().err.strip().endswith("data.format=messages (its rows are tokenised as the run starts): "
                                                    "no text to prepare ahead")


def test_unigram_entropy_of_a_large_corpus_is_counted_on_spread_blocks(tmp_path):
    (tmp_path / "t.txt").write_text("abcdefghijklmnopqrstuvwxyz" * 2000)
    d = TokenData(TextDataConfig(path=str(tmp_path / "t.txt"), tokenizer="bytes", seq_len=16,
                                 cache_dir=str(tmp_path / "cache")), log=QUIET)
    assert abs(d.unigram_entropy() - np.log(26)) < 1e-9
    assert abs(d.unigram_entropy(sample_tokens=64 * 26) - np.log(26)) < 1e-9  # each block: every letter once
    (tmp_path / "ab.txt").write_text("a" * 30000 + "b" * 30000)  # a sample of the head alone would see only "a"
    d = TokenData(TextDataConfig(path=str(tmp_path / "ab.txt"), tokenizer="bytes", seq_len=16,
                                 cache_dir=str(tmp_path / "cache")), log=QUIET)
    exact = d.unigram_entropy()
    assert exact > 0.6 and abs(d.unigram_entropy(sample_tokens=64 * 100) - exact) < 0.01
