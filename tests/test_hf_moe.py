"""Hugging Face Mixtral / Qwen2-MoE / Qwen3-MoE checkpoints in and out (zoo/weights/hf_llm.py),
the MoE presets, and fine-tuning a MoE checkpoint through train/run.py.

Reference: transformers models with random weights (std 0.1, gains around 1, as in
tests/test_hf_llm.py), saved to tmp_path. Parity: fp32 logits max abs diff <= 1e-4 on random
tokens and greedy generation of 20 new tokens equal to transformers' generate(do_sample=False).
"""
import json

import pytest
import torch
from test_hf_llm import assert_same_generation, assert_same_logits, randomize, tokens

import zoo
from zoo.config import ConfigError
from zoo.weights import hf_llm
from train.metrics import read_rows

import transformers
from conftest import TEST_DEVICE

SMALL = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5)
CLASSES = {"mixtral": ("MixtralConfig", "MixtralForCausalLM"), "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
           "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM")}
QWEN = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)


def hf_model(kind, seed=0, experts="eager", **kw):
    conf_cls, model_cls = (getattr(transformers, n) for n in CLASSES[kind])
    cfg = conf_cls(**{**SMALL, **kw})
    cfg.bos_token_id = cfg.eos_token_id = cfg.pad_token_id = None  # generate() must never stop early
    cfg._experts_implementation = experts
    return randomize(model_cls(cfg), seed).eval()


CASES = {
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
    "mixtral-tied-top1-window-head-dim": ("mixtral", dict(num_local_experts=3, num_experts_per_tok=1, head_dim=24,
                                                          tie_word_embeddings=True, sliding_window=8)),
    "qwen2-moe-shared-dense-layer": ("qwen2_moe", dict(QWEN, shared_expert_intermediate_size=48, mlp_only_layers=[1])),
    "qwen2-moe-every-2nd-norm-topk-no-bias": ("qwen2_moe", dict(QWEN, shared_expert_intermediate_size=40,
                                                                decoder_sparse_step=2, norm_topk_prob=True,
                                                                qkv_bias=False)),
    "qwen3-moe-head-dim": ("qwen3_moe", dict(QWEN, num_experts=8, num_experts_per_tok=3, head_dim=32,
                                             norm_topk_prob=True)),
    "qwen3-moe-window-dense-layer": ("qwen3_moe", dict(QWEN, use_sliding_window=True, sliding_window=8,
                                                       mlp_only_layers=[0], num_key_value_heads=1)),
    "qwen3-moe-bias-top1-odd-every-2nd-tied": ("qwen3_moe", dict(QWEN, num_experts=5, num_experts_per_tok=1,
                                                                 attention_bias=True, decoder_sparse_step=2,
                                                                 tie_word_embeddings=True)),
}


@pytest.mark.parametrize("case", CASES)
def test_parity_with_transformers(tmp_path, case):
    kind, kw = CASES[case]
    hf = hf_model(kind, **kw)
    hf.save_pretrained(tmp_path)
    z = zoo.from_pretrained(tmp_path)
    assert z.hf_architecture == CLASSES[kind][1]
    sparse = [type(l.mlp).__name__ == "MoE" for l in z.layers]
    assert sparse == [type(l.mlp).__name__.endswith("SparseMoeBlock") for l in hf.model.layers]
    assert z.config.sliding_window == kw.get("sliding_window")
    assert_same_logits(hf, z, tokens(shape=(2, 24)))
    assert_same_generation(hf, z)
    # the export loads back into transformers with the same logits
    zoo.save_pretrained(z, tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(back).__name__ == CLASSES[kind][1]
    assert_same_logits(back, z, tokens(shape=(2, 24)))


def test_grouped_mm_experts_reference(tmp_path):
    """transformers' grouped_mm experts implementation gives the same logits as its eager one
    here, and Zoo matches both."""
    hf = hf_model("mixtral", num_local_experts=4, experts="grouped_mm")
    hf.save_pretrained(tmp_path)
    assert_same_logits(hf, zoo.from_pretrained(tmp_path), tokens(shape=(2, 24)))


ZOO_CASES = {
    "mixtral": (dict(moe=dict(n_experts=4, top_k=2)), "MixtralForCausalLM"),
    "qwen2-moe": (dict(qkv_bias=True, ffn_hidden=80, moe=dict(n_experts=4, top_k=2, expert_hidden=32, n_shared=2,
                                                             shared_hidden=16, shared_gate=True, dense_layers=[2],
                                                             norm_topk_prob=False)), "Qwen2MoeForCausalLM"),
    "qwen3-moe": (dict(qk_norm=True, head_dim=24, moe=dict(n_experts=6, top_k=2, expert_hidden=32, sparse_every=2)),
                  "Qwen3MoeForCausalLM"),
}


@pytest.mark.parametrize("case", ZOO_CASES)
def test_round_trip_through_transformers(tmp_path, case):
    kw, arch = ZOO_CASES[case]
    base = dict(vocab_size=300, d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn_hidden=96, max_seq_len=128,
                norm_eps=1e-5)
    torch.manual_seed(0)
    z = randomize(zoo.build({**base, **kw})).eval()
    zoo.save_pretrained(z, tmp_path, max_shard_size="200KB")
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == [arch]
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(hf).__name__ == arch
    assert_same_logits(hf, z, tokens(shape=(2, 24)))
    again = zoo.from_pretrained(tmp_path)
    x = tokens()
    with torch.no_grad():
        assert torch.equal(again(x), z(x))


def test_transformers_4x_config_dialect(tmp_path):
    """4.x-style config.json files: Mixtral with a top-level rope_theta and torch_dtype, Qwen2-MoE
    without the `qkv_bias` key (its attention always had a bias) nor layer_types, Qwen3-MoE with
    `num_experts` (the hub's spelling) instead of num_local_experts."""
    for kind, kw in (("mixtral", dict(num_local_experts=4)), ("qwen2_moe", dict(QWEN, shared_expert_intermediate_size=48)),
                     ("qwen3_moe", dict(QWEN, head_dim=32))):
        hf = hf_model(kind, **kw, rope_parameters={"rope_type": "default", "rope_theta": 30000.0})
        folder = tmp_path / kind
        hf.save_pretrained(folder)
        cfg = json.loads((folder / "config.json").read_text())
        cfg["rope_theta"] = cfg.pop("rope_parameters")["rope_theta"]
        cfg["torch_dtype"] = cfg.pop("dtype")
        for k in ("qkv_bias", "layer_types"):
            cfg.pop(k, None)
        if "num_local_experts" in cfg and kind != "mixtral":
            cfg["num_experts"] = cfg.pop("num_local_experts")
        (folder / "config.json").write_text(json.dumps(cfg))
        z = zoo.from_pretrained(folder)
        assert z.config.rope_theta == 30000.0
        assert_same_logits(hf, z, tokens(shape=(2, 24)))


def test_balancing_keys_are_read():
    from zoo.weights.hf_llm import config_from_hf
    hf = {"architectures": ["MixtralForCausalLM"], "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
          "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2}
    cfg, _ = config_from_hf(hf)
    assert (cfg.moe.n_experts, cfg.moe.top_k, cfg.moe.balance) == (8, 2, "none")
    assert cfg.rope_theta == 1e6  # Mixtral's default
    cfg, _ = config_from_hf({**hf, "output_router_logits": True, "router_aux_loss_coef": 0.02,
                             "router_jitter_noise": 0.1})  # how it trains: train.moe_aux_loss_coef, ...
    assert cfg.moe.balance == "aux_loss"


def edit_config(folder, **changes):
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("kind,changes,needle", [
    ("mixtral", dict(attention_dropout=0.1), "attention_dropout"),
    ("qwen2_moe", dict(num_experts=0), "num_experts"),
    ("qwen2_moe", dict(decoder_sparse_step=0), "decoder_sparse_step"),
    ("mixtral", dict(hidden_act="gelu"), "hidden_act"),
])
def test_unsupported_options_are_refused(tmp_path, kind, changes, needle):
    kw = dict(num_local_experts=4) if kind == "mixtral" else dict(QWEN, shared_expert_intermediate_size=48)
    hf_model(kind, **kw).save_pretrained(tmp_path)
    edit_config(tmp_path, **changes)
    with pytest.raises(ConfigError) as e:
        zoo.from_pretrained(tmp_path)
    msg = str(e.value)
    assert "\n" not in msg and needle in msg and "config.json" in msg, msg


def test_missing_expert_tensor_is_named(tmp_path):
    from safetensors.torch import load_file, save_file
    hf_model("mixtral", num_local_experts=4).save_pretrained(tmp_path)
    f = tmp_path / "model.safetensors"
    sd = load_file(f)
    sd.pop("model.layers.2.block_sparse_moe.experts.3.w3.weight")
    save_file(sd, f, metadata={"format": "pt"})
    with pytest.raises(ValueError) as e:
        zoo.from_pretrained(tmp_path)
    assert "\n" not in str(e.value) and "missing: model.layers.2.block_sparse_moe.experts.3.w3.weight" in str(e.value)


@pytest.mark.parametrize("moe,needle", [(dict(scoring="sigmoid"), "model.moe.scoring"),
                                        (dict(balance="bias"), "model.moe.balance=bias")])
def test_export_refuses_what_no_architecture_holds(tmp_path, moe, needle):
    z = zoo.build(dict(vocab_size=300, d_model=32, n_layers=1, n_heads=4, moe=dict(n_experts=4, **moe)))
    if moe.get("balance") == "bias":
        z.moe_blocks()[0].update_bias(torch.tensor([9.0, 1.0, 1.0, 1.0]), 0.01)
    with pytest.raises(ValueError) as e:
        hf_llm.save(z, tmp_path / "hf")
    assert "\n" not in str(e.value) and needle in str(e.value)
    out = zoo.save_pretrained(z, tmp_path / "zoo")  # what holds it: a Zoo folder, loaded back unchanged
    back = zoo.from_pretrained(out)
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), z.state_dict().values()))


# ----------------------------------------------------------------------------------------
# presets: built on the meta device, counted against the published sizes and transformers
# ----------------------------------------------------------------------------------------

PRESETS = {  # file: (published total, published active, transformers config)
    "mixtral-8x7b": (46.7e9, 12.9e9, ("MixtralConfig", "MixtralForCausalLM", dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2))),
    "qwen3-30b-a3b": (30.5e9, 3.3e9, ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8))),
    "gemma4-26b-a4b": (25.2e9, 3.8e9, ("Gemma4TextConfig", "Gemma4ForCausalLM", dict(
        vocab_size=262144, hidden_size=2816, intermediate_size=2112, num_hidden_layers=30, num_attention_heads=16,
        num_key_value_heads=8, head_dim=256, global_head_dim=512, num_global_key_value_heads=2, attention_k_eq_v=True,
        hidden_size_per_layer_input=0, enable_moe_block=True, num_experts=128, top_k_experts=8,
        moe_intermediate_size=704))),
}


@pytest.mark.parametrize("name", PRESETS)
def test_preset_parameter_counts(name):
    from train.run import ROOT
    total, active, (conf, cls, kw) = PRESETS[name]
    with torch.device("meta"):
        z = zoo.build(ROOT / "configs" / "llm" / f"{name}.yaml")
        hf = getattr(transformers, cls)(getattr(transformers, conf)(**kw))
    assert z.num_params() == sum(p.numel() for p in hf.parameters())
    # published to one decimal, rounded (Mixtral) or cut (Qwen3-30B-A3B: 3.35B active is "3.3B")
    assert abs(z.num_params() - total) < 0.06e9 and abs(z.num_params(active=True) - active) < 0.06e9
    assert zoo.weights.hf_llm.architecture_for(z.config) == cls


# ----------------------------------------------------------------------------------------
# fine-tuning through train/run.py
# ----------------------------------------------------------------------------------------

def test_finetune_moe_through_run_py(tmp_path, text_corpus, one_thread):
    from train.run import ROOT, main
    hf = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
        **{**SMALL, "num_hidden_layers": 2}, **QWEN, shared_expert_intermediate_size=48, output_router_logits=True,
        router_aux_loss_coef=0.05)).eval()
    init = tmp_path / "init"
    hf.save_pretrained(init)
    out = tmp_path / "run"
    code = main([str(ROOT / "configs/llm/tiny.yaml"), f"train.init_from={init}", f"data.path={text_corpus}",
                 "data.tokenizer=bytes", f"train.out_dir={out}", f"data.cache_dir={tmp_path / 'cache'}",
                 "data.seq_len=32", "train.max_steps=30", "train.batch_size=8", "train.precision=fp32",
                 f"train.device={TEST_DEVICE}", "train.eval_every=0", "train.eval_batches=4", "train.checkpoint_every=0",
                 "train.progress=false", "train.samples=false", "train.plot=false", "train.log_every=10",
                 "optim.lr=0.01", "optim.warmup_steps=5"])
    assert code == 0
    rows = read_rows(out)
    logged = [r for r in rows if "loss" in r]
    assert logged[-1]["lm_loss"] < logged[0]["lm_loss"] - 0.5  # from ln(300) = 5.7 towards the byte unigram
    assert all(r["moe_aux_loss"] > 0 and len(r["moe_load_max"]) == 2 for r in logged)  # output_router_logits
    tuned = transformers.AutoModelForCausalLM.from_pretrained(out / "hf").eval()
    assert type(tuned).__name__ == "Qwen2MoeForCausalLM"
    z = zoo.from_pretrained(out / "hf")
    assert_same_logits(tuned, z, tokens(shape=(2, 24)))
    with torch.no_grad():  # the weights moved
        assert (tuned.model.layers[0].mlp.experts.gate_up_proj - hf.model.layers[0].mlp.experts.gate_up_proj).abs().max() > 1e-3
