"""GGUF files in and out: the single-file format of llama.cpp, Ollama and LM Studio.

    model = zoo.from_pretrained("model.gguf")                  # float32 on the CPU; dtype=, device= as for HF
    tok = zoo.weights.gguf_llm.load_tokenizer("model.gguf")        # encode/decode, chat_template, special_tokens
    zoo.save_pretrained(model, "out.gguf", dtype="q8_0")       # "f32" | "f16" (default) | "bf16" | "q8_0"

The `gguf` package reads and writes the files; this module maps them through hf_llm.py's mapping (the metadata as a
config.json dict, the tensor names through gguf-py's TensorNameMap, a sparse layer in llama.cpp's own names) and undoes
what llama.cpp's converter does to a tensor (Llama's interleaved q/k rows, A_log stored as -exp(A_log), squeezed
convolutions, the record's `gguf_layout`). The architectures are those whose record (zoo/archs) names a GGUF
architecture (`gguf`, `gguf_writes`); the tokenizer is rebuilt as a `tokenizers.Tokenizer`. Anything else is refused in
one line naming the file.
"""
from __future__ import annotations

import json
import re
import tempfile
import warnings
from functools import partial
from pathlib import Path
from typing import Optional, Union

import torch

from ..archs import BY_GGUF, RECORDS, interleaved
from ..config import ConfigError, LLMConfig
from .files import atomic_write, mismatches
from .hf_llm import GGUF_TOKEN_IDS, _resolve_dtype, assemble, config_from_hf, file_tensors, inverse, key_map, record_for

ARCHITECTURES = {name: r.hf_class for name, r in BY_GGUF.items()}  # GGUF name -> Hugging Face class
WRITES = tuple(r.hf_class for r in RECORDS.values() if r.gguf_writes)  # the architectures `save` writes
READ_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
WRITE_TYPES = ("f32", "f16", "bf16", "q8_0")
MAGIC = b"GGUF"
# tensors llama.cpp's converter keeps in F32 whatever the file type: norms, convolutions, routers, non-weights
F32_NAMES = re.compile(r"(_norm|ssm_conv1d|shortconv\.conv|ffn_gate_inp)\.weight$|(?<!\.weight)$")


def _gguf():
    try:
        import gguf
    except ImportError:
        raise ImportError("reading or writing GGUF files needs the 'gguf' package: pip install -e \".[gguf]\"") from None
    return gguf


# -------------------------------------------------------------------------------- reading

def read(path):
    """(reader, metadata {key: value}) of a GGUF file, checked to be one with every tensor inside it."""
    gguf = _gguf()
    path = Path(path)
    with open(path, "rb") as f:
        if f.read(4) != MAGIC:
            raise ValueError(f"{path}: not a GGUF file (it does not start with 'GGUF')")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # noqa: BLE001 - the reader's errors (numpy reshape, struct): one line naming the file
        why = (str(e).splitlines() or [type(e).__name__])[0][:160]
        raise ValueError(f"{path}: corrupt or truncated GGUF file ({why})") from None
    size = path.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise ValueError(f"{path}: corrupt or truncated GGUF file (tensor '{t.name}' ends at byte "
                             f"{t.data_offset + t.n_bytes} of {size})")
    return reader, {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def tokenizer_fields(reader, meta: dict) -> dict:
    """{key: (value, GGUF value types)} of a file's tokenizer.* metadata: what a GGUFTokenizer is
    built from and what an export writes back."""
    return {k: (v, reader.fields[k].types) for k, v in meta.items() if k.startswith("tokenizer.")}


def config_from_gguf(meta: dict, tensor_names, source: str) -> tuple[LLMConfig, str]:
    """(LLMConfig, Hugging Face architecture) from a GGUF file's metadata, through the config.json
    dict Hugging Face would have (hf_llm.config_from_hf does the rest and its checks)."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ConfigError(f"{source}: unsupported GGUF architecture '{arch}' (supported: {', '.join(ARCHITECTURES)})")
    get = lambda key, default=None: meta.get(f"{arch}.{key}", default)  # noqa: E731
    rec = BY_GGUF[arch]
    if get("expert_count") and "moe" not in rec.needs | rec.may:
        raise ConfigError(f"{source}: {arch}.expert_count={get('expert_count')}: mixture-of-experts GGUF files "
                          f"are not supported for {arch}")
    if "rope_freqs.weight" in tensor_names and "rope_proportional" not in rec.may:
        raise ConfigError(f"{source}: RoPE frequency factors (rope_freqs.weight, Llama 3.1-style scaling) are "
                          f"not supported")
    own = rec.gguf_config(get, tensor_names)
    scaling = get("rope.scaling.type", "none")
    if scaling not in ("none", "linear") and "rope_scaling" not in own:
        raise ConfigError(f"{source}: {arch}.rope.scaling.type='{scaling}' is not supported (none, linear)")
    n_heads, d = get("attention.head_count"), get("embedding_length")
    head_dim = own.pop("head_dim", get("attention.key_length"))
    rot = get("rope.dimension_count")
    tokens = meta.get("tokenizer.ggml.tokens")
    hf = {"architectures": [rec.hf_class], "hidden_size": d, "num_attention_heads": n_heads,
          "num_hidden_layers": get("block_count"), "intermediate_size": get("feed_forward_length"),
          "num_key_value_heads": get("attention.head_count_kv", n_heads),
          "vocab_size": get("vocab_size", len(tokens) if tokens else None),
          "max_position_embeddings": get("context_length", 2048),
          "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-5),
          "rope_theta": get("rope.freq_base", 10000.0), "tie_word_embeddings": "output.weight" not in tensor_names}
    if get("expert_count"):
        hf["num_experts_per_tok"] = get("expert_used_count")
    if head_dim is not None:
        hf["head_dim"] = head_dim
    if get("attention.sliding_window"):
        hf.update(sliding_window=get("attention.sliding_window"), use_sliding_window=True)
    if rot is not None and "rope_parameters" not in own:
        if "partial_rotary" not in rec.may and rot != (head_dim or d // n_heads):
            raise ConfigError(f"{source}: {arch}.rope.dimension_count={rot} < head dimension {head_dim}: partial "
                              f"RoPE is not supported for {arch}")
        hf["partial_rotary_factor"] = rot / (head_dim or d // n_heads)
    if scaling == "linear":
        hf["rope_scaling"] = {"rope_type": "linear", "factor": get("rope.scaling.factor", 1.0)}
    hf.update(own)
    if missing := [k for k, v in hf.items() if v is None and k not in own]:  # the record's None: the default
        raise ConfigError(f"{source}: GGUF metadata lacks what gives {', '.join(missing)} ({arch}.* keys)")
    return config_from_hf(hf, source)


def gguf_names(cfg: LLMConfig, arch: str, found=()) -> dict[str, list[tuple]]:
    """key_map in a GGUF file's names and shapes: Zoo name -> [(GGUF name, shape, *rows), ...]. Names through
    gguf-py's TensorNameMap of the record's architecture (after the record's `gguf_renames`); shapes as llama.cpp's
    converter writes them (a Conv1d weight (C, 1, K) squeezed to (C, K); the record's `gguf_layout`). found: the names
    a file being read holds (an older converter's layout)."""
    gguf, rec = _gguf(), RECORDS[arch]
    table = gguf.get_tensor_name_map(next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == rec.gguf), cfg.n_layers)
    layout = rec.gguf_layout(cfg)

    def moe(zoo):  # a sparse layer's tensors in llama.cpp's names, alike in every architecture (else None)
        parts = zoo.split(".", 2)
        if not (cfg.moe and parts[0] == "layers" and cfg.is_sparse(int(parts[1]))):
            return None
        m, F, d, b = cfg.moe, cfg.resolved_expert_hidden, cfg.d_model, f"blk.{parts[1]}."
        E, Fs = m.n_experts, m.n_shared * (m.shared_hidden or F)
        return {"mlp.gate_up": [(f"{b}ffn_{w}_exps.weight", (E, F, d), [e]) for e in range(E) for w in ("gate", "up")],
                "mlp.down": [(b + "ffn_down_exps.weight", (E, d, F))],
                "mlp.router.weight": [(b + "ffn_gate_inp.weight", (E, d))],
                "mlp.shared.gate_up.weight": [(b + "ffn_gate_shexp.weight", (Fs, d)), (b + "ffn_up_shexp.weight", (Fs, d))],
                "mlp.shared.down.weight": [(b + "ffn_down_shexp.weight", (d, Fs))],
                "mlp.shared_gate.weight": [(b + "ffn_gate_inp_shexp.weight", (1, d))]}.get(parts[2])

    def entry(hf, shape, *rows):
        name = table.get_name(rec.renamed(hf, rec.gguf_renames), try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ValueError(f"gguf-py names no {rec.gguf} tensor for {hf}")
        squeezed = shape[:1] + shape[2:] if len(shape) == 3 and shape[1] == 1 else shape
        return (name, (layout.get(_own(hf), (None,))[0] or squeezed), *rows)
    return {zoo: moe(zoo) or [entry(*part) for part in parts] for zoo, parts in hf_names(cfg, arch, found).items()}


def hf_names(cfg: LLMConfig, arch: str, found=()) -> dict:
    """key_map with the fused and split tensors of llama.cpp's converter (the record's gguf_fused, gguf_split_rows)."""
    rec = RECORDS[arch]
    return key_map(cfg, arch, rec.gguf_split_rows(cfg, found), rec.gguf_fused)


def _own(name: str) -> str:
    """A layer tensor's name within its layer, without .weight / .bias ('linear_attn.A_log')."""
    return name.split(".", 3)[-1].removesuffix(".weight").removesuffix(".bias")


def tensor_orders(cfg: LLMConfig, arch: str, found=()) -> dict[str, tuple]:
    """GGUF tensor name -> (its rows' order, its columns' order; zoo = file[order], None: kept): the q/k rows
    llama.cpp stores with RoPE pairs interleaved (Llama), the record's `gguf_layout` orders."""
    rec, D = RECORDS[arch], cfg.resolved_head_dim
    layout = rec.gguf_layout(cfg)
    heads = {".attn_q.": cfg.n_heads, ".attn_k.": cfg.resolved_n_kv_heads} if rec.gguf_interleaved else {}
    out = {}
    for (zoo, parts), hf_parts in zip(gguf_names(cfg, arch, found).items(), hf_names(cfg, arch, found).values()):
        for (name, *_), (hf, *_) in zip(parts, hf_parts):
            own = layout.get(_own(hf), (None, None, None))[1:]
            rows = next((interleaved(n, D, 0, D) for part, n in heads.items() if part in name), own[0])
            if rows is not None or own[1] is not None:
                out[name] = (rows, own[1])
    return out


def to_zoo(name: str, w: torch.Tensor, order: Optional[tuple]) -> torch.Tensor:
    """A GGUF tensor (in its file shape) in Zoo's layout: A_log from llama.cpp's ssm_a = -exp(A_log), rows and
    columns in Zoo's order."""
    w = torch.log(-w) if name.endswith(".ssm_a") else w
    rows, cols = order or (None, None)
    w = w if rows is None else w.reshape(len(rows), -1)[rows].reshape(w.shape)
    return w if cols is None else w[:, cols]


def to_file(name: str, t: torch.Tensor, order: Optional[tuple]) -> torch.Tensor:
    """to_zoo undone."""
    rows, cols = order or (None, None)
    t = t if cols is None else t[:, inverse(cols)]
    t = t if rows is None else t.reshape(len(rows), -1)[inverse(rows)].reshape(t.shape)
    return -torch.exp(t) if name.endswith(".ssm_a") else t


def detect(path) -> bool:
    p = Path(path)
    if not p.is_file():
        return False
    with open(p, "rb") as f:
        return f.read(4) == MAGIC


def load(path, dtype: Union[torch.dtype, str, None] = None, device: Union[torch.device, str, None] = None):
    """Load a GGUF file into a Zoo LLM (eval mode), dequantized to `dtype` (default float32) on `device`
    (default CPU); the tokenizer metadata stays on the model (`model.gguf_tokenizer`) for a later save."""
    gguf = _gguf()
    path = Path(path)
    reader, meta = read(path)
    tensors = {t.name: t for t in reader.tensors}
    cfg, arch = config_from_gguf(meta, tensors, str(path))
    dtype = _resolve_dtype(dtype, {}, str(path))  # None: float32
    device = torch.device(device or "cpu")

    kmap = gguf_names(cfg, arch, tensors)
    expected = {name: shape for parts in kmap.values() for name, shape, *_ in parts}
    found = {name: tuple(int(s) for s in reversed(t.shape)) for name, t in tensors.items()}
    if problems := mismatches(found, expected, lambda n: n.startswith(("rope_factors_", "rope_freqs."))):
        raise ValueError(f"{path}: tensors do not match the metadata ({meta['general.architecture']}, "
                         f"{cfg.n_layers} layers): {problems}")
    if bad := [f"{n} ({t.tensor_type.name})" for n, t in tensors.items() if t.tensor_type.name not in READ_TYPES]:
        raise ValueError(f"{path}: unsupported tensor type: {', '.join(bad[:4])}"
                         f"{f' (+{len(bad) - 4} more)' if len(bad) > 4 else ''} (supported: {', '.join(READ_TYPES)})")

    orders = tensor_orders(cfg, arch, tensors)

    def fill(name, dest):
        t = tensors[name]
        w = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).astype("float32", copy=True))
        dest.copy_(to_zoo(name, w.reshape(expected[name]), orders.get(name)).reshape(dest.shape))

    model = assemble(cfg, kmap, dtype, device, ((n, partial(fill, n)) for n in expected))
    model.hf_architecture = arch
    model.gguf_path = str(path)
    model.gguf_tokenizer = tokenizer_fields(reader, meta)
    return model.eval()


# -------------------------------------------------------------------------- the tokenizer

# How text is split before byte-level BPE, by `tokenizer.ggml.pre` (the model's own tokenizer.json
# has the same split); anything else gets GPT-2's.
_LETTERS_DIGITS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}" \
                  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
PRE_SPLITS = {"llama-bpe": _LETTERS_DIGITS, "llama3": _LETTERS_DIGITS,
              "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                       r"|\s*[\r\n]+|\s+(?!\S)|\s+"}


class GGUFTokenizer:
    """The tokenizer a GGUF file describes, with Zoo's tokenizer interface (encode, encode_many, decode,
    vocab_size, bos_id, eos_id; encode adds no special tokens) and what a chat needs: `chat_template`,
    `special_tokens`, `add_bos` / `add_eos`. `backend` is the `tokenizers.Tokenizer`."""

    def __init__(self, fields: dict, source: str):
        self.model_path = source
        self.fields = fields  # {key: (value, GGUF types)}: written again by save(..., tokenizer=this)
        meta = {k: v for k, (v, _) in fields.items()}
        self.backend = _build_backend(meta, source)
        tokens = meta["tokenizer.ggml.tokens"]
        ids = {f"{name}_token": meta.get(f"tokenizer.ggml.{key}") for name, key in GGUF_TOKEN_IDS.items()}
        self.special_tokens = {name: tokens[i] if i is not None and 0 <= i < len(tokens) else None
                               for name, i in ids.items()}
        self.bos_id, self.eos_id = ids["bos_token"], ids["eos_token"]
        self.pad_id, self.unk_id = ids["pad_token"], ids["unk_token"]
        self.chat_template = meta.get("tokenizer.chat_template")
        self.add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", meta["tokenizer.ggml.model"] == "llama"))
        self.add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
        self.vocab_size = self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_many(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def save(self, folder) -> Path:
        """Write the tokenizer as a Hugging Face folder holds it: tokenizer.json, and tokenizer_config.json
        with the special tokens and the chat template (what transformers' AutoTokenizer reads)."""
        out = Path(folder)
        out.mkdir(parents=True, exist_ok=True)
        atomic_write(out / "tokenizer.json", lambda tmp: self.backend.save(str(tmp)))
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": self.add_bos,
                  "add_eos_token": self.add_eos, **{k: v for k, v in self.special_tokens.items() if v is not None}}
        if self.chat_template:
            config["chat_template"] = self.chat_template
        atomic_write(out / "tokenizer_config.json", json.dumps(config, indent=2, ensure_ascii=False) + "\n")
        return out


def load_tokenizer(source) -> GGUFTokenizer:
    """The tokenizer, chat template and special tokens of a GGUF file (see GGUFTokenizer). `source`:
    the file, or a model loaded from one (its metadata is kept on it: the file is not read again)."""
    if isinstance(getattr(source, "gguf_tokenizer", None), dict):
        fields, where = source.gguf_tokenizer, source.gguf_path
    else:
        where = Path(source)
        if not where.is_file():
            raise FileNotFoundError(f"{where}: no such file")
        fields = tokenizer_fields(*read(where))
    if "tokenizer.ggml.tokens" not in fields:
        raise ValueError(f"{where}: the GGUF file holds no tokenizer (no tokenizer.ggml.tokens)")
    return GGUFTokenizer(fields, str(where))


def _build_backend(meta: dict, source: str):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    kind = meta.get("tokenizer.ggml.model")
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    vocab = {t: i for i, t in enumerate(tokens)}
    if kind == "gpt2":
        merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
        pre = meta.get("tokenizer.ggml.pre", "default")
        if pre == "smollm":  # SmolLM's own tokenizer.json: every digit alone, then GPT-2's split
            tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                         pre_tokenizers.ByteLevel(add_prefix_space=False)])
        elif pre in PRE_SPLITS:
            tok.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(PRE_SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        else:
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
    elif kind == "llama":
        scores = list(meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens))
        unk = meta.get("tokenizer.ggml.unknown_token_id")
        tok = Tokenizer(models.BPE(vocab=vocab, merges=_merges_from_scores(tokens, scores, types),
                                   unk_token=tokens[unk] if unk is not None else None, fuse_unk=True,
                                   byte_fallback=True))
        # sentencepiece (and llama.cpp) put a space before the text, and after each special token,
        # even when the text starts with one: a normalizer per segment, not Metaspace's prepend
        prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
        spaces = [normalizers.Replace(" ", "\u2581")]
        tok.normalizer = normalizers.Sequence(([normalizers.Prepend("\u2581")] if prefix else []) + spaces)
        steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
        tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    else:
        raise ValueError(f"{source}: unsupported GGUF tokenizer model '{kind}' (supported: gpt2, llama)")
    # control (3) and unknown (2) tokens are special; user-defined ones (4) are matched whole too
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k in (2, 3)])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == 4])
    return tok


def _merges_from_scores(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """A sentencepiece BPE vocabulary's merges: every split of a normal piece into two normal pieces,
    best first. Sentencepiece merges the pair whose joined piece scores highest, so a merge ranks by
    the score of the piece it makes (ties by the ids of its parts)."""
    normal = {t: i for i, t in enumerate(tokens) if types[i] == 1}
    found = sorted((-scores[i], normal[piece[:cut]], normal[piece[cut:]], piece[:cut], piece[cut:])
                   for piece, i in normal.items() for cut in range(1, len(piece))
                   if piece[:cut] in normal and piece[cut:] in normal)
    return [(left, right) for *_, left, right in found]


# -------------------------------------------------------------------------------- writing

def save(model, path, dtype: Union[str, torch.dtype] = "f16", tokenizer=None) -> Path:
    """Write `model` as one GGUF file (an architecture of `WRITES`); dtype: the 2-D weights'
    type (under "q8_0" a row length not a multiple of 32 is written F16, as llama.cpp's converter does);
    norms and biases F32. tokenizer: a GGUF file or GGUFTokenizer to write (default: the loaded file's)."""
    gguf = _gguf()
    model = getattr(model, "_orig_mod", model)
    out = Path(path)
    if getattr(model, "family", None) != "llm":
        raise ValueError(f"{out}: GGUF holds LLMs; a {type(model).__name__} cannot be written to it")
    cfg: LLMConfig = model.config
    kind = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}.get(dtype, dtype)
    if kind not in WRITE_TYPES:
        raise ValueError(f"GGUF dtype {dtype!r} is not supported (supported: {', '.join(WRITE_TYPES)})")
    rec = record_for(cfg, getattr(model, "hf_architecture", None))
    arch = rec.hf_class
    if not rec.gguf_writes:
        raise ValueError(f"{out}: no GGUF architecture here writes this model ({arch}; supported: "
                         f"{', '.join(WRITES)})")
    if cfg.rope_scaling is not None and cfg.rope_scaling.type not in ("linear", "longrope", "proportional"):
        raise ValueError(f"{out}: RoPE scaling '{cfg.rope_scaling.type}' is not written to GGUF (linear, longrope, "
                         f"proportional)")
    if why := rec.gguf_refuses(cfg):
        raise ValueError(f"{out}: llama.cpp's {arch} has no {why}")
    meta = _fields_to_write(tokenizer, model, cfg.vocab_size)
    n_tokens = len(meta.get("tokenizer.ggml.tokens", ([None] * cfg.vocab_size, None))[0])
    if n_tokens != cfg.vocab_size:
        raise ValueError(f"{out}: the tokenizer has {n_tokens} tokens and the model a vocabulary of {cfg.vocab_size} "
                         f"(llama.cpp needs them equal)")
    file_type = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                 "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[kind]

    def write(tmp: Path):
        w = gguf.GGUFWriter(str(tmp), rec.gguf)
        w.add_name(getattr(model, "gguf_name", "zoo"))
        D, m = cfg.resolved_head_dim, cfg.moe
        experts = dict(expert_count=m.n_experts, expert_used_count=m.top_k, expert_feed_forward_length=cfg.resolved_expert_hidden,
                       expert_shared_feed_forward_length=m.n_shared * (m.shared_hidden or cfg.resolved_expert_hidden)
                       or None) if m else {}
        keys = {**dict(context_length=cfg.max_seq_len, embedding_length=cfg.d_model, block_count=cfg.n_layers,
                       feed_forward_length=cfg.resolved_ffn_hidden, head_count=cfg.n_heads,
                       head_count_kv=cfg.resolved_n_kv_heads, rope_freq_base=cfg.rope_theta,
                       layer_norm_rms_eps=cfg.norm_eps, rope_dimension_count=cfg.rotary_dim, key_length=D,
                       value_length=D, sliding_window=cfg.sliding_window, vocab_size=cfg.vocab_size), **experts,
                **rec.gguf_metadata(cfg)}  # the record's None: a key not written
        for key, value in keys.items():
            if value is not None:
                getattr(w, "add_" + key)(value)  # GGUFWriter.add_context_length, ...
        s = cfg.rope_scaling
        if s is not None and s.type == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(s.factor)
        if s is not None and s.type == "longrope":  # Phi-3: the factors as tensors
            w.add_rope_scaling_orig_ctx_len(s.original_max_position_embeddings)
            w.add_rope_scaling_attn_factors(model.rope.attention_factor)
            for which in ("long", "short"):
                w.add_tensor(f"rope_factors_{which}.weight", torch.tensor(getattr(s, which + "_factor")).float().numpy())
        if s is not None and s.type == "proportional":  # Gemma 4's global layers: the still angles' divisors huge
            half = (cfg.global_head_dim or D) // 2
            turned = round(s.rotated * half)
            w.add_tensor("rope_freqs.weight", torch.tensor([1.0] * turned + [1e30] * (half - turned)).numpy())
        w.add_file_type(file_type)
        if kind == "q8_0":
            w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        for key, (value, types) in meta.items():
            w.add_key_value(key, value, types[0], sub_type=types[1] if len(types) > 1 else None)
        state = {k: t.detach().to("cpu", torch.float32) for k, t in model.state_dict().items()}
        orders = tensor_orders(cfg, arch)
        for name, t in list(file_tensors(cfg, rec, state, gguf_names(cfg, arch), {})):
            x = to_file(name, t, orders.get(name)).contiguous().numpy()
            if x.ndim == 1 or kind == "f32" or F32_NAMES.search(name):
                w.add_tensor(name, x)
            elif kind == "f16" or (kind == "q8_0" and x.shape[-1] % 32):
                w.add_tensor(name, x.astype("float16"))
            else:
                q = gguf.GGMLQuantizationType.BF16 if kind == "bf16" else gguf.GGMLQuantizationType.Q8_0
                w.add_tensor(name, gguf.quants.quantize(x, q), raw_dtype=q)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()

    return atomic_write(out, write)


def _fields_to_write(tokenizer, model, n_vocab: int) -> dict:
    """{key: (value, GGUF value types)} of the tokenizer.* metadata to write: `tokenizer`'s (a GGUFTokenizer, a GGUF
    file, a Hugging Face folder or its tokenizer.json), else the model's own (its GGUF file's, or the tokenizer.json
    of the folder it was loaded from: one llama.cpp's converter would not write is left out with a warning)."""
    if tokenizer is None:
        remembered, folder = getattr(model, "gguf_tokenizer", None), getattr(model, "hf_folder", None)
        if remembered is not None or folder is None or not (Path(folder) / "tokenizer.json").is_file():
            return remembered or {}
        try:
            return hf_tokenizer_fields(folder, n_vocab)
        except ValueError as e:
            warnings.warn(f"{e}; the GGUF file is written without a tokenizer", stacklevel=3)
            return {}
    if isinstance(tokenizer, GGUFTokenizer):
        return tokenizer.fields
    if Path(tokenizer).is_dir() or Path(tokenizer).name == "tokenizer.json":
        return hf_tokenizer_fields(tokenizer, n_vocab)
    fields = tokenizer_fields(*read(tokenizer))
    if not fields:
        raise ValueError(f"{tokenizer}: the GGUF file holds no tokenizer metadata")
    return fields


def hf_tokenizer_fields(source, n_vocab: int) -> dict:
    """The tokenizer.* fields llama.cpp's converter writes for a Hugging Face folder (or its tokenizer.json): a
    byte-level BPE tokenizer.json (GPT-2, Llama 3, Qwen, SmolLM: tokens, the split's GGUF name, merges) or the
    sentencepiece tokenizer.model beside one (Llama 2, Mistral, Gemma: pieces, scores, types, the space prefix);
    the added tokens, the vocabulary padded as [PADi] (unused) to the model's, and gguf-py's SpecialVocab (special
    ids, add_bos / add_eos, chat template) from the folder's files."""
    gguf, file = _gguf(), Path(source) / "tokenizer.json" if Path(source).is_dir() else Path(source)
    spec = json.loads(file.read_text(encoding="utf-8")) if file.is_file() else {}
    model, spm_file = spec.get("model") or {}, file.parent / "tokenizer.model"
    added = {t["id"]: (t["content"], 3 if t.get("special") else 4) for t in spec.get("added_tokens", [])}
    keys = {}
    if model.get("type") == "BPE" and not model.get("byte_fallback") and '"ByteLevel"' in json.dumps(spec.get("decoder")):
        keys["pre"] = _pre_name(spec.get("pre_tokenizer"), file)
        tokens, scores = {i: (t, 1) for t, i in model["vocab"].items()}, None  # id: (text, GGUF type: normal)
    elif spm_file.is_file():
        tokens, scores = _sentencepiece(spm_file)
        keys["space_prefix"] = not spec or '"Prepend"' in json.dumps(spec.get("normalizer")) or \
            '"first"' in json.dumps(spec.get("pre_tokenizer")) or '"always"' in json.dumps(spec.get("pre_tokenizer"))
    else:
        raise ValueError(f"{file.parent}: no tokenizer GGUF holds here (a byte-level BPE tokenizer.json or a "
                         f"sentencepiece tokenizer.model); pass the model's .gguf as tokenizer=")
    # sentencepiece's own types stand (llama.cpp's converter takes an added token only where the piece is unused)
    tokens.update({i: t for i, t in added.items() if not scores or i not in tokens or tokens[i][1] == 5})
    if max(tokens) >= n_vocab:
        raise ValueError(f"{file.parent}: token id {max(tokens)} is past the model's vocabulary of {n_vocab}")
    with tempfile.TemporaryDirectory() as tmp:  # gguf-py writes the fields; they are read back with their types
        w = gguf.GGUFWriter(str(Path(tmp) / "t.gguf"), "llama")
        w.add_tokenizer_model("llama" if scores else "gpt2")
        if "pre" in keys:
            w.add_tokenizer_pre(keys["pre"])
        w.add_token_list([tokens.get(i, (f"[PAD{i}]",))[0] for i in range(n_vocab)])
        w.add_token_types([tokens.get(i, (None, 5))[1] for i in range(n_vocab)])
        if scores:
            w.add_token_scores([scores.get(i, -1000.0) for i in range(n_vocab)])
            w.add_add_space_prefix(keys["space_prefix"])
        special = gguf.SpecialVocab(file.parent, load_merges=not scores, n_vocab=n_vocab)
        special.add_to_gguf(w, quiet=True)
        if "bos" not in special.add_special_token:  # stated: llama.cpp's default differs by tokenizer
            w.add_add_bos_token(bool(scores))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.close()
        return tokenizer_fields(*read(Path(tmp) / "t.gguf"))


def _sentencepiece(path: Path) -> tuple[dict, dict]:
    """({id: (piece, GGUF type)}, {id: score}) of a sentencepiece model: unknown 2, control 3, unused 5, byte 6."""
    import sentencepiece as spm
    sp = spm.SentencePieceProcessor(model_file=str(path))
    kind = lambda i: 2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 5 if sp.is_unused(i) else \
        6 if sp.is_byte(i) else 1  # noqa: E731
    n = sp.get_piece_size()
    return {i: (sp.id_to_piece(i), kind(i)) for i in range(n)}, {i: sp.get_score(i) for i in range(n)}


def _pre_name(pre: Optional[dict], file: Path) -> str:
    """The `tokenizer.ggml.pre` of a tokenizer.json's pre-tokenizer: a split of PRE_SPLITS, SmolLM's digits, or
    GPT-2's own regex; anything else is refused (llama.cpp would split the text differently)."""
    steps = (pre or {}).get("pretokenizers", [pre] if pre else [])
    kinds = [s.get("type") for s in steps]
    gpt2_split = kinds[-1:] == ["ByteLevel"] and steps[-1].get("use_regex", True)  # GPT-2's regex inside ByteLevel
    if kinds == ["ByteLevel"] and gpt2_split:
        return "gpt-2"
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits") and gpt2_split:
        return "smollm"
    if kinds == ["Split", "ByteLevel"] and not gpt2_split:
        pattern = steps[0].get("pattern", {}).get("Regex")
        if name := next((n for n, r in PRE_SPLITS.items() if r == pattern), None):
            return name
    raise ValueError(f"{file}: its pre-tokenizer ({' + '.join(map(str, kinds)) or 'none'}{', GPT-2 regex' * gpt2_split})"
                     f" has no GGUF name here "
                     f"(known: GPT-2's, SmolLM's digits, and the splits of {', '.join(PRE_SPLITS)})")
