"""Bad data never hangs or dumps a traceback: a one-line error naming the file (exit 2 from
train/run.py), or a counted skip that the log reports."""
import json

import pytest
import yaml

from train.run import main as run_main
from conftest import TEST_DEVICE

TINY = {
    "family": "llm",
    "model": {"vocab_size": 256, "d_model": 32, "n_layers": 1, "n_heads": 2, "max_seq_len": 64},
    "data": {"tokenizer": "bytes", "seq_len": 64},
    "train": {"max_steps": 2, "batch_size": 2, "log_every": 1, "eval_every": 0, "eval_batches": 1, "device": str(TEST_DEVICE),
              "peak_flops": 1e12, "progress": False, "samples": False, "plot": False, "export": False},
}


pytestmark = pytest.mark.usefixtures("one_thread")


def run(tmp_path, capsys, data_path, base=TINY, *overrides):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump(base))
    out = tmp_path / "out"
    data = [f"data.path={data_path}"] if data_path is not None else []
    code = run_main([str(cfg), *data, f"train.out_dir={out}", *overrides])
    err = capsys.readouterr().err.strip()
    log = (out / "log.txt").read_text() if (out / "log.txt").exists() else ""
    return code, err, log


def assert_one_line_error(code, err, *fragments):
    assert code == 2, err
    assert len(err.splitlines()) == 1, err
    assert "Traceback" not in err
    for f in fragments:
        assert f in err, (f, err)


TEXT = "".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(200))


@pytest.mark.parametrize("name,content,fragment", [
    ("empty.txt", b"", "empty"),
    ("blank.txt", b"  \n\n\t\n", "empty"),
    ("short.txt", b"too short for one window of 64 tokens", "too short"),
    ("bad.jsonl", b'not json\n{"no_text": 1}\n{"text": 3}\n', "empty"),
])
def test_unusable_corpus_is_a_one_line_error(tmp_path, capsys, name, content, fragment):
    f = tmp_path / name
    f.write_bytes(content)
    code, err, log = run(tmp_path, capsys, f)
    assert_one_line_error(code, err, str(f), fragment)
    assert log.splitlines()[-1] == err  # the run's log ends with the line it ended with


def test_missing_path_and_empty_folder(tmp_path, capsys):
    code, err, _ = run(tmp_path, capsys, tmp_path / "nope.txt")
    assert_one_line_error(code, err, "nope.txt")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "image.png").write_bytes(b"\x89PNG")
    code, err, _ = run(tmp_path, capsys, tmp_path / "docs")
    assert_one_line_error(code, err, str(tmp_path / "docs"))


def test_missing_or_corrupt_tokenizer_file(tmp_path, capsys):
    f = tmp_path / "c.txt"
    f.write_text(TEXT)
    code, err, _ = run(tmp_path, capsys, f, TINY, f"data.tokenizer={tmp_path / 'tok.model'}")
    assert_one_line_error(code, err, "tok.model")
    (tmp_path / "tok.model").write_bytes(b"\x00garbage" * 10)
    code, err, _ = run(tmp_path, capsys, f, TINY, f"data.tokenizer={tmp_path / 'tok.model'}")
    assert_one_line_error(code, err, "tok.model")


def test_undecodable_bytes_are_replaced_and_counted(tmp_path, capsys):
    f = tmp_path / "mixed.txt"
    f.write_bytes(TEXT.encode() + b"\xff\xfe bad \xc3" + TEXT.encode())
    code, err, log = run(tmp_path, capsys, f)
    assert code == 0, err
    assert f"{f}: 3 undecodable bytes replaced with U+FFFD" in log, log
    # the replacement character is in the token stream: 3 x U+FFFD (3 bytes each in UTF-8)
    from train.data import read_corpus
    assert read_corpus(str(f), log=lambda m: None).count("\ufffd") == 3


def test_bad_jsonl_lines_are_skipped_and_counted(tmp_path, capsys):
    f = tmp_path / "docs.jsonl"
    good = [json.dumps({"text": TEXT[i * 2000:(i + 1) * 2000]}) for i in range(4)]
    f.write_text("\n".join([good[0], "{broken", good[1], '{"text": null}', good[2], "[1, 2]", good[3], ""]))
    code, err, log = run(tmp_path, capsys, f)
    assert code == 0, err
    assert f"{f} (lines 2, 4, 6): 3 bad jsonl lines (not JSON, or no string data.column field; skipped)" in log, log  # named by number


def test_caches_go_to_the_cache_dir_never_beside_the_data(tmp_path, capsys, monkeypatch):
    """A corpus in a writable folder: the folder gets nothing; the tokens go to $ZOO_CACHE (the
    user cache directory's stand-in), or to data.cache_dir when it is set."""
    data = tmp_path / "data"
    data.mkdir()
    f = data / "c.txt"
    f.write_text(TEXT)
    monkeypatch.setenv("ZOO_CACHE", str(tmp_path / "user_cache"))
    sp = ["data.tokenizer=sentencepiece", "data.vocab_size=300", "data.seq_len=32", "model.vocab_size=300"]
    assert run(tmp_path, capsys, f, TINY, *sp)[0] == 0
    assert sorted(p.name for p in data.iterdir()) == ["c.txt"]
    assert list((tmp_path / "user_cache").glob("tokens-*/shard-*.bin")) and list((tmp_path / "user_cache").glob("sp-*.model"))
    assert run(tmp_path, capsys, f, TINY, *sp, "train.resume=false", f"data.cache_dir={tmp_path / 'mine'}")[0] == 0
    assert list((tmp_path / "mine").glob("tokens-*/shard-*.bin")) and list((tmp_path / "mine").glob("sp-*.model"))
    assert sorted(p.name for p in data.iterdir()) == ["c.txt"]
    monkeypatch.delenv("ZOO_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    from train.data import cache_dir
    assert cache_dir(None) == tmp_path / "xdg" / "zoo"


def test_truncated_token_cache_is_rebuilt(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("ZOO_CACHE", str(tmp_path / ".zoo_cache"))
    f = tmp_path / "c.txt"
    f.write_text(TEXT)
    assert run(tmp_path, capsys, f)[0] == 0
    (cache,) = (tmp_path / ".zoo_cache").glob("tokens-*/shard-*.bin")
    good = cache.read_bytes()
    cache.write_bytes(good[:-1])  # an odd number of bytes: not a whole number of uint16 tokens
    code, err, log = run(tmp_path, capsys, f, TINY, "train.resume=false")
    assert code == 0, err
    assert f"{cache}: truncated token cache" in log, log
    assert cache.read_bytes() == good


# ------------------------------------------------------------------------------ image folders
def image_folder(root, n_per_class=3, size=16, corrupt=()):
    """root/<class>/<i>.png, with the given relative paths overwritten by garbage."""
    from PIL import Image
    import numpy as np
    rng = np.random.default_rng(0)
    for c in ("cat", "dog"):
        (root / c).mkdir(parents=True, exist_ok=True)
        for i in range(n_per_class):
            Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)).save(root / c / f"{i}.png")
    for rel in corrupt:
        (root / rel).write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 20)  # a PNG signature, then nothing usable
    return root


CONVNET = {
    "family": "convnet",
    "model": {"arch": "resnet18", "layers": [1, 1], "width": 8, "stem": "small", "num_classes": 2},
    "data": {"image_size": 16, "num_workers": 0},
    "train": {**TINY["train"], "batch_size": 4},
}
DIFFUSION = {
    "family": "diffusion",
    "model": {"image_size": 16, "num_classes": 2, "channels": [16], "blocks_per_level": 1, "heads": 2,
              "autoencoder": {"latent_channels": 4, "channels": 8}, "sample_steps": 2},
    "data": {"ae_steps": 2, "ae_batch_size": 4, "encode_batch_size": 4, "samples_per_class": 1},
    "train": {**TINY["train"], "batch_size": 4, "samples": False},
}


def test_convnet_missing_or_unusable_image_folder(tmp_path, capsys):
    code, err, _ = run(tmp_path, capsys, tmp_path / "nope", CONVNET)
    assert_one_line_error(code, err, "nope")
    (tmp_path / "one" / "cat").mkdir(parents=True)
    code, err, _ = run(tmp_path, capsys, tmp_path / "one", CONVNET)  # one class, no images
    assert_one_line_error(code, err, str(tmp_path / "one"))


def test_convnet_unreadable_images_are_skipped_and_counted(tmp_path, capsys):
    root = image_folder(tmp_path / "imgs", n_per_class=6, corrupt=["cat/0.png", "dog/1.png"])
    code, err, log = run(tmp_path, capsys, root, CONVNET, "data.val_fraction=0.4")
    assert code == 0, err
    skipped = [l for l in log.splitlines() if "unreadable image skipped" in l]
    assert skipped and all(("cat/0.png" in l) or ("dog/1.png" in l) for l in skipped), log


def diffusion_run(tmp_path, capsys, dataset, *overrides):
    return run(tmp_path, capsys, None, DIFFUSION, f"data.dataset={dataset}",
               f"data.cache_dir={tmp_path / 'cache'}", *overrides)


def test_diffusion_missing_folder_and_unreadable_image_are_one_line_errors(tmp_path, capsys):
    code, err, _ = diffusion_run(tmp_path, capsys, tmp_path / "nope")
    assert_one_line_error(code, err, "nope")
    root = image_folder(tmp_path / "imgs", corrupt=["dog/2.png"])
    code, err, _ = diffusion_run(tmp_path, capsys, root)
    assert_one_line_error(code, err, "dog/2.png", "unreadable")


def test_diffusion_corrupt_cached_autoencoder_is_retrained(tmp_path, capsys):
    root = image_folder(tmp_path / "imgs")
    code, err, _ = diffusion_run(tmp_path, capsys, root)
    assert code == 0, err
    (enc,) = (tmp_path / "cache").glob("taesd-*_encoder.*")
    enc.write_bytes(enc.read_bytes()[:100])  # a half-written cache file
    code, err, log = diffusion_run(tmp_path, capsys, root, "train.resume=false")
    assert code == 0, err
    assert f"cached file unusable ({enc}" in log and "training it again" in log, log


def test_corrupt_cached_tokenizer_is_retrained(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("ZOO_CACHE", str(tmp_path / ".zoo_cache"))
    f = tmp_path / "c.txt"
    f.write_text(TEXT * 3)
    sp = ["data.tokenizer=sentencepiece", "data.vocab_size=300", "data.seq_len=32", "model.vocab_size=300"]
    code, err, _ = run(tmp_path, capsys, f, TINY, *sp)
    assert code == 0, err
    (model,) = (tmp_path / ".zoo_cache").glob("sp-*.model")
    model.write_bytes(model.read_bytes()[:50])
    code, err, log = run(tmp_path, capsys, f, TINY, *sp, "train.resume=false")
    assert code == 0, err
    assert f"{model}: not a readable sentencepiece model" in log and "training it again" in log, log
