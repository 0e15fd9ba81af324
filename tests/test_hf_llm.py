"""Hugging Face Llama / Mistral / Qwen2 checkpoints in and out (zoo/weights/hf_llm.py).

Reference: transformers models with random weights, saved to tmp_path. Parity: fp32 logits max
abs diff <= 1e-4 on random tokens, and greedy generation of 20 new tokens equal to transformers'
generate(do_sample=False). Weights are redrawn at std 0.1 (norm gains around 1, biases non-zero)
so that the logits are O(1) and every tensor, bias and gain mapping shows in them.
"""
import json
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

import zoo
from zoo.config import ConfigError
from zoo.weights import hf_llm

import transformers
from conftest import TEST_DEVICE

TOL = 1e-4  # fp32 logits
SMALL = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=128, rms_norm_eps=1e-5)
CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "mistral": ("MistralConfig", "MistralForCausalLM"),
           "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}
LLAMA3 = {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 32}


def randomize(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.1 * noise if "norm" in name else 0.1 * noise)
    return model


def hf_model(kind="llama", seed=0, **kw):
    conf_cls, model_cls = (getattr(transformers, n) for n in CLASSES[kind])
    cfg = conf_cls(**{**SMALL, **kw})
    cfg.bos_token_id = cfg.eos_token_id = cfg.pad_token_id = None  # generate() must never stop early
    return randomize(model_cls(cfg), seed).eval()


def hf_save(model, folder, **kw):
    model.save_pretrained(folder, **kw)
    return folder


def tokens(seed=1, shape=(2, 48)):
    return torch.randint(0, SMALL["vocab_size"], shape, generator=torch.Generator().manual_seed(seed))


def assert_same_logits(hf, z, x=None):
    x = tokens() if x is None else x
    with torch.no_grad():
        ref, out = hf(x).logits, z(x)
    assert ref.abs().max() > 1.0  # the weights are large enough for a wrong mapping to show
    diff = (ref - out).abs().max().item()
    assert diff <= TOL, f"max abs diff {diff:.2e} > {TOL}"


def assert_same_generation(hf, z, n=20):
    prompt = tokens(seed=2, shape=(1, 12))
    with torch.no_grad():
        ref = hf.generate(prompt, max_new_tokens=n, do_sample=False, pad_token_id=0)
    out = z.generate(prompt, n)
    assert ref.shape == out.shape == (1, 12 + n)
    assert torch.equal(ref, out), f"\n{ref.tolist()}\n{out.tolist()}"


# ----------------------------------------------------------------------------------------
# parity: transformers -> save -> zoo.from_pretrained
# ----------------------------------------------------------------------------------------

CASES = {
    "llama-tied-gqa": ("llama", dict(num_key_value_heads=2, tie_word_embeddings=True)),
    "llama-untied-mha-linear-rope": ("llama", dict(num_key_value_heads=4, rope_parameters={
        "rope_type": "linear", "rope_theta": 20000.0, "factor": 4.0})),
    "llama-llama3-rope-head-dim": ("llama", dict(num_key_value_heads=2, head_dim=24, rope_parameters=LLAMA3)),
    "qwen2-qkv-bias": ("qwen2", dict(num_key_value_heads=2, tie_word_embeddings=True)),
    "mistral-sliding-window": ("mistral", dict(num_key_value_heads=1, sliding_window=8)),
    "qwen2-sliding-window-all-layers": ("qwen2", dict(num_key_value_heads=2, use_sliding_window=True,
                                                      sliding_window=8, max_window_layers=0)),
}


@pytest.mark.parametrize("case", CASES)
def test_parity_with_transformers(tmp_path, case):
    kind, kw = CASES[case]
    hf = hf_model(kind, **kw)
    z = zoo.from_pretrained(hf_save(hf, tmp_path))
    assert z.hf_architecture == CLASSES[kind][1]
    assert z.config.tie_embeddings == bool(kw.get("tie_word_embeddings", False))
    assert (z.lm_head.weight is z.embed.weight) == z.config.tie_embeddings
    assert z.config.sliding_window == (8 if "sliding" in case else None)
    assert_same_logits(hf, z)
    assert_same_generation(hf, z)


def test_sliding_window_is_applied():
    """The window changes transformers' Mistral on a sequence longer than it, and Zoo follows."""
    hf = hf_model("mistral", num_key_value_heads=2, sliding_window=8)
    full = hf_model("mistral", num_key_value_heads=2, sliding_window=None)
    x = tokens(shape=(1, 32))
    with torch.no_grad():
        assert (hf(x).logits - full(x).logits).abs().max() > 1e-2


def test_sharded_checkpoint(tmp_path):
    hf = hf_model("llama", num_key_value_heads=2)
    hf_save(hf, tmp_path, max_shard_size="40KB")
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 2 and (tmp_path / "model.safetensors.index.json").is_file()
    z = zoo.from_pretrained(tmp_path)
    assert_same_logits(hf, z)
    assert_same_generation(hf, z)


@pytest.mark.parametrize("rope", ["llama3", "linear"])
def test_transformers_4x_config_dialect(tmp_path, rope):
    """A 4.x config.json (top-level rope_theta, rope_scaling with 'rope_type' or 'type',
    torch_dtype) written by hand from the 5.x one."""
    params = LLAMA3 if rope == "llama3" else {"rope_type": "linear", "rope_theta": 30000.0, "factor": 2.0}
    hf = hf_model("llama", num_key_value_heads=2, rope_parameters=dict(params))
    hf_save(hf, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    new = cfg.pop("rope_parameters")
    assert new["rope_type"] == rope
    cfg["rope_theta"] = new.pop("rope_theta")
    kind = new.pop("rope_type")
    new["rope_type" if rope == "llama3" else "type"] = kind
    cfg["rope_scaling"] = new
    cfg["torch_dtype"] = cfg.pop("dtype")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    z = zoo.from_pretrained(tmp_path)
    assert z.config.rope_scaling.type == rope and z.config.rope_theta == params["rope_theta"]
    assert_same_logits(hf, z)
    assert_same_generation(hf, z)


def test_dtype_and_device_arguments(tmp_path):
    hf = hf_model("llama", num_key_value_heads=2)
    hf_save(hf, tmp_path)
    z = zoo.from_pretrained(tmp_path, dtype=torch.bfloat16, device=TEST_DEVICE)
    assert {p.dtype for p in z.parameters()} == {torch.bfloat16}
    assert z.rope.inv_freq.dtype == torch.float32 and not z.rope.cos.is_meta
    with torch.no_grad():
        ref, out = hf(tokens()).logits, z(tokens()).float()
    assert (ref - out).abs().max() < 0.25 * ref.abs().max()  # bf16 weights: close, not exact
    # a bfloat16 checkpoint loads in its own dtype by default ("dtype" in config.json) and, asked
    # for float32, holds exactly the bf16 values
    hf16 = hf_save(hf.to(torch.bfloat16), tmp_path / "bf16")
    assert json.loads((hf16 / "config.json").read_text())["dtype"] == "bfloat16"
    assert zoo.from_pretrained(hf16).embed.weight.dtype == torch.bfloat16
    ref = transformers.AutoModelForCausalLM.from_pretrained(hf16, dtype=torch.float32).eval()
    assert_same_logits(ref, zoo.from_pretrained(hf16, dtype=torch.float32))


# ----------------------------------------------------------------------------------------
# round trip: zoo -> save_pretrained -> transformers
# ----------------------------------------------------------------------------------------

ZOO_CASES = {
    "llama": (dict(n_kv_heads=2, tie_embeddings=True), "LlamaForCausalLM"),
    "llama-untied-llama3-head-dim": (dict(n_kv_heads=4, head_dim=24, tie_embeddings=False, rope_theta=5e4,
                                          rope_scaling={"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                        "high_freq_factor": 4.0,
                                                        "original_max_position_embeddings": 32}),
                                     "LlamaForCausalLM"),
    "qkv-bias": (dict(n_kv_heads=2, qkv_bias=True, rope_scaling={"type": "linear", "factor": 2.0}),
                 "Qwen2ForCausalLM"),
    "sliding-window": (dict(n_kv_heads=2, sliding_window=8, tie_embeddings=False), "MistralForCausalLM"),
    "qkv-bias-sliding-window": (dict(n_kv_heads=2, qkv_bias=True, sliding_window=8), "Qwen2ForCausalLM"),
}


def zoo_model(**kw):
    cfg = dict(vocab_size=300, d_model=64, n_layers=2, n_heads=4, ffn_hidden=96, max_seq_len=128, norm_eps=1e-5)
    return randomize(zoo.build({**cfg, **kw})).eval()


@pytest.mark.parametrize("case", ZOO_CASES)
def test_round_trip_through_transformers(tmp_path, case):
    kw, arch = ZOO_CASES[case]
    z = zoo_model(**kw)
    zoo.save_pretrained(z, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == [arch]
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(hf).__name__ == arch
    assert_same_logits(hf, z)
    again = zoo.from_pretrained(tmp_path)
    x = tokens()
    with torch.no_grad():
        assert torch.equal(again(x), z(x))


def test_round_trip_sharded_keeps_architecture_and_tokenizer(tmp_path):
    hf = hf_model("mistral", num_key_value_heads=2, sliding_window=None)  # Llama-shaped, but a Mistral
    hf.config.eos_token_id = 7
    z = zoo.from_pretrained(hf_save(hf, tmp_path / "in"))
    tok = tmp_path / "tokenizer.model"
    tok.write_bytes(b"not parsed, only copied")
    out = tmp_path / "out"
    zoo.save_pretrained(z, out, tokenizer=tok, max_shard_size=30_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(out.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2 and set(index["weight_map"].values()) == {s.name for s in shards}
    for s in shards:  # a shard exceeds the limit only when it is a single bigger tensor
        n = sum(1 for v in index["weight_map"].values() if v == s.name)
        assert n == 1 or s.stat().st_size <= 30_000 + 2_000  # tensors + header
    assert (out / "tokenizer.model").read_bytes() == tok.read_bytes()
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["MistralForCausalLM"] and cfg["eos_token_id"] == 7
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(back).__name__ == "MistralForCausalLM"
    assert_same_logits(back, z)
    # saving again unsharded into the same folder leaves no stale shards behind
    zoo.save_pretrained(z, out)
    assert not list(out.glob("model-*")) and not (out / "model.safetensors.index.json").exists()
    assert_same_logits(transformers.AutoModelForCausalLM.from_pretrained(out).eval(), z)


# ----------------------------------------------------------------------------------------
# errors: one line, naming what is wrong
# ----------------------------------------------------------------------------------------

@pytest.fixture
def saved(tmp_path):
    return hf_save(hf_model("llama", num_key_value_heads=2), tmp_path)


def raises_one_line(exc, *needles, path):
    with pytest.raises(exc) as e:
        zoo.from_pretrained(path)
    msg = str(e.value)
    assert "\n" not in msg, msg
    for s in needles:
        assert str(s) in msg, msg
    return msg


def edit_config(folder, **changes):
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


def edit_weights(folder, fn):
    f = folder / "model.safetensors"
    sd = load_file(f)
    fn(sd)
    save_file(sd, f, metadata={"format": "pt"})


def test_unsupported_architecture(saved):
    edit_config(saved, architectures=["GPTNeoXForCausalLM"], model_type="gpt_neox")
    raises_one_line(ConfigError, "GPTNeoXForCausalLM", "config.json", path=saved)


@pytest.mark.parametrize("where", ["rope_parameters", "rope_scaling"])
def test_unsupported_rope_type(saved, where):
    edit_config(saved, **{where: {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e4}})
    raises_one_line(ConfigError, "'dynamic'", "config.json", path=saved)


def test_qwen2_sliding_window_on_some_layers_only(tmp_path):
    hf = hf_model("qwen2", num_key_value_heads=2, use_sliding_window=True, sliding_window=8, max_window_layers=1)
    z = zoo.from_pretrained(hf_save(hf, tmp_path))
    assert z.config.attn_pattern == ["global", "local"] and z.config.sliding_window == 8
    assert_same_logits(hf, z)
    edit_config(tmp_path, use_sliding_window=False)  # the usual Qwen2 config: no window at all
    z = zoo.from_pretrained(tmp_path)
    assert z.config.sliding_window is None


def test_missing_tensor(saved):
    edit_weights(saved, lambda sd: sd.pop("model.layers.1.self_attn.k_proj.weight"))
    raises_one_line(ValueError, "missing", "model.layers.1.self_attn.k_proj.weight", path=saved)


def test_unexpected_tensor(saved):
    edit_weights(saved, lambda sd: sd.update({"model.layers.0.self_attn.extra.weight": torch.zeros(3)}))
    raises_one_line(ValueError, "unexpected", "model.layers.0.self_attn.extra.weight", path=saved)


def test_wrong_shape(saved):
    edit_weights(saved, lambda sd: sd.update({"model.layers.0.mlp.up_proj.weight": torch.zeros(95, 64)}))
    raises_one_line(ValueError, "wrong shape", "model.layers.0.mlp.up_proj.weight", "[95, 64]", "[96, 64]",
                    path=saved)


def test_problems_are_listed_together(saved):
    def damage(sd):
        sd.pop("model.norm.weight")
        sd["lm_head.bias"] = torch.zeros(300)
    edit_weights(saved, damage)
    raises_one_line(ValueError, "missing: model.norm.weight", "unexpected: lm_head.bias", path=saved)


@pytest.mark.parametrize("damage", ["truncated", "header"])
def test_corrupt_file(saved, damage):
    f = saved / "model.safetensors"
    data = f.read_bytes()
    if damage == "truncated":
        f.write_bytes(data[: len(data) // 2])
    else:
        f.write_bytes(struct.pack("<Q", 10**12) + data[8:])
    raises_one_line(ValueError, str(f), "corrupt or truncated", path=saved)


def test_missing_shard_and_missing_weights(tmp_path):
    hf = hf_model("llama", num_key_value_heads=2)
    hf_save(hf, tmp_path, max_shard_size="40KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[1]
    shard.unlink()
    raises_one_line(FileNotFoundError, shard.name, path=tmp_path)
    for f in tmp_path.glob("model*"):
        f.unlink()
    raises_one_line(FileNotFoundError, "model.safetensors", path=tmp_path)


def test_an_unknown_dtype_argument_is_named_as_the_argument(saved):
    """dtype='bf17' is the caller's typo, not config.json's: the error says so."""
    with pytest.raises(ValueError) as e:
        zoo.from_pretrained(saved, dtype="bf17")
    assert "dtype='bf17'" in str(e.value) and "config.json" not in str(e.value)


def test_a_save_that_cannot_finish_writes_nothing(tmp_path, saved):
    """A missing tokenizer or a bad max_shard_size fails before any file is written (an earlier save into the folder
    stays whole, no empty folder is left); dtype may be a name, as from_pretrained's."""
    z = zoo.from_pretrained(saved)
    out = zoo.save_pretrained(z, tmp_path / "out")
    before = {f.name: f.read_bytes() for f in out.iterdir()}
    with torch.no_grad():
        z.norm.weight.add_(1.0)  # what a failed save must not write
    with pytest.raises(FileNotFoundError, match="nothere.model"):
        zoo.save_pretrained(z, out, tokenizer=tmp_path / "nothere.model")
    with pytest.raises(ValueError, match="max_shard_size"):
        zoo.save_pretrained(z, tmp_path / "new", max_shard_size="lots")
    assert {f.name: f.read_bytes() for f in out.iterdir()} == before and not (tmp_path / "new").exists()
    half = zoo.save_pretrained(z, tmp_path / "half", dtype="bfloat16")
    assert zoo.from_pretrained(half).embed.weight.dtype == torch.bfloat16


def test_config_json_that_is_not_json(saved):
    (saved / "config.json").write_text("{not json")
    raises_one_line(ValueError, saved / "config.json", "not valid JSON", path=saved)


def test_detect_claims_only_causal_lm_folders(tmp_path, saved):
    assert hf_llm.detect(saved) and hf_llm.detect(saved / "config.json")
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"architecture": "resnet50", "num_classes": 10}))
    assert not hf_llm.detect(other)
    (other / "config.json").write_text("{not json")
    assert not hf_llm.detect(other)
    assert not hf_llm.detect(tmp_path / "nowhere")


# ----------------------------------------------------------------------------------------
# fine-tuning through train/run.py
# ----------------------------------------------------------------------------------------

def test_finetune_through_run_py(tmp_path, capsys):
    import sentencepiece as spm
    from train.run import ROOT, main

    data = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"
    if not data.is_file():
        pytest.skip(f"{data} is absent (../shared is not beside this checkout)")
    text = data.read_text()
    corpus = tmp_path / "shakespeare.txt"
    corpus.write_text(text[:300_000])
    init = tmp_path / "init"
    init.mkdir()
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(init / "tokenizer"), vocab_size=300,
                                   model_type="bpe", character_coverage=1.0, num_threads=2,
                                   minloglevel=2)
    sp = spm.SentencePieceProcessor(model_file=str(init / "tokenizer.model"))
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **{**SMALL, "vocab_size": sp.vocab_size()}, num_key_value_heads=2, tie_word_embeddings=True)).eval()
    hf.save_pretrained(init)

    out = tmp_path / "run"
    code = main([str(ROOT / "configs/llm/tiny.yaml"), f"train.init_from={init}", f"data.path={corpus}",
                 f"train.out_dir={out}", f"data.cache_dir={tmp_path / 'cache'}", "data.seq_len=64",
                 "train.max_steps=40", "train.batch_size=8", "train.precision=fp32", f"train.device={TEST_DEVICE}",
                 "train.eval_every=0", "train.eval_batches=4", "train.checkpoint_every=0",
                 "train.progress=false", "train.samples=false", "train.plot=false",
                 "optim.lr=0.01", "optim.warmup_steps=5"])
    assert code == 0
    exported = out / "hf"
    assert (exported / "tokenizer.model").read_bytes() == (init / "tokenizer.model").read_bytes()
    tuned = transformers.AutoModelForCausalLM.from_pretrained(exported).eval()
    assert type(tuned).__name__ == "LlamaForCausalLM"

    held_out = torch.tensor([sp.encode(text[300_000:320_000])[:4 * 64]]).view(4, 64)  # right after the corpus
    with torch.no_grad():
        before = hf(held_out, labels=held_out).loss.item()
        after = tuned(held_out, labels=held_out).loss.item()
    assert after < before - 0.25, (before, after)  # from ln(300) = 5.7 towards the unigram 5.25

    # a damaged init_from checkpoint stops the run with a one-line error (exit code 2)
    weights = init / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    capsys.readouterr()
    code = main([str(ROOT / "configs/llm/tiny.yaml"), f"train.init_from={init}", f"data.path={corpus}",
                 f"train.out_dir={tmp_path / 'bad'}", f"data.cache_dir={tmp_path / 'cache'}", "data.seq_len=64",
                 f"train.device={TEST_DEVICE}", "train.progress=false"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and str(weights) in err[0] and "truncated" in err[0], err
