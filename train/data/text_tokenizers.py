"""Tokenizers of the text data: bytes, sentencepiece (trained on a sample of the corpus, or a
tokenizer.model) and Hugging Face tokenizer.json (a file, or a byte-level BPE or SuperBPE trained on a
sample of the corpus), each with its BOS/EOS ids (None when it has none)."""
from __future__ import annotations

import contextlib
import heapq
import io
import itertools
import json
import os
import random
import re
from pathlib import Path
from typing import Iterable, Optional

from zoo.weights.files import atomic_write

from .sources import DataError, needs

# special tokens that end (or begin) a document in the tokenizer.json of common model families
EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>")
BOS_NAMES = ("<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>")
# Llama 3's (GPT-4's) pre-tokenizer: words with their leading space or punctuation, numbers of up to 3 digits
WORDS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
NUMBERS = r"\p{N}{1,3}"  # SuperBPE's second stage: only numbers split, so merges cross whitespace
TRAINED_SPECIALS = ("<|endoftext|>",)  # the special tokens of a BPE trained here: EOS, id 0


class ByteTokenizer:
    vocab_size = 256
    bos_id = eos_id = None
    pad_id = 0  # padding a text encoder's prompts (masked out)
    model_path, spec = None, ("bytes", None)

    def piece_bytes(self) -> list[int]:
        return [1] * 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_many(self, texts: list[str]) -> list:
        return [t.encode("utf-8") for t in texts]  # bytes: a buffer of the ids

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class SentencePieceTokenizer:
    def __init__(self, model_path, threads: Optional[int] = None):
        import sentencepiece as spm
        self.model_path = str(model_path)
        self.spec = ("sentencepiece", self.model_path)
        self.threads = threads or os.cpu_count() or 1
        try:
            self.sp = spm.SentencePieceProcessor(model_file=self.model_path)
        except Exception as e:
            raise DataError(f"{model_path}: not a readable sentencepiece model ({str(e).splitlines()[0] if str(e) else e})") from None
        self.vocab_size = self.sp.get_piece_size()
        self.bos_id = self.sp.bos_id() if self.sp.bos_id() >= 0 else None
        self.eos_id = self.sp.eos_id() if self.sp.eos_id() >= 0 else None

    def encode(self, text: str) -> list[int]:
        return self.sp.encode(text)

    def piece_bytes(self) -> list[int]:
        sp = self.sp
        return [0 if sp.is_control(i) or sp.is_unknown(i) else 1 if sp.is_byte(i) else
                len(sp.id_to_piece(i).replace("\u2581", " ").encode()) for i in range(self.vocab_size)]

    def encode_many(self, texts: list[str]) -> list[list[int]]:
        return self.sp.encode(texts, num_threads=self.threads)

    def decode(self, ids) -> str:
        return self.sp.decode([int(i) for i in ids])


class HFTokenizer:
    """A Hugging Face tokenizer.json (Llama 3, Qwen2, ... ship only this), via `tokenizers`. BOS/EOS:
    those named in a tokenizer_config.json beside it, else the first of the usual names it has."""

    def __init__(self, path):
        tokenizers = needs("tokenizers", f"{path}: reading tokenizer.json needs the 'tokenizers' package")
        self.model_path = str(path)
        self.spec = ("tokenizer.json", self.model_path)
        try:
            self.tok = tokenizers.Tokenizer.from_file(self.model_path)
        except Exception as e:
            raise DataError(f"{path}: not a readable tokenizer.json ({str(e).splitlines()[0] if str(e) else e})") from None
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        named, cfg = {}, Path(path).with_name("tokenizer_config.json")
        if cfg.is_file():
            with contextlib.suppress(ValueError, AttributeError):
                named = {k: (v.get("content") if isinstance(v, dict) else v)
                         for k, v in json.loads(cfg.read_text()).items() if k in ("bos_token", "eos_token", "pad_token")}
        self.bos_id = self._special(named.get("bos_token"), BOS_NAMES)
        self.eos_id = self._special(named.get("eos_token"), EOS_NAMES)
        self.pad_id = self._special(named.get("pad_token"), ())  # padding a text encoder's prompts

    def _special(self, name, usual) -> Optional[int]:
        ids = (self.tok.token_to_id(n) for n in ([name] if name else []) + list(usual))
        return next((i for i in ids if i is not None), None)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def piece_bytes(self) -> list[int]:
        """A byte-level BPE's pieces are one character per byte; others spell bytes <0xNN> and spaces U+2581; added
        tokens are their text (special ones: no bytes)."""
        added = {i: b"" if t.special else t.content.encode() for i, t in self.tok.get_added_tokens_decoder().items()}
        byte_level = '"ByteLevel"' in json.dumps(json.loads(self.tok.to_str()).get("decoder"))
        pieces = [self.tok.id_to_token(i) or "" for i in range(self.vocab_size)]
        return [len(added[i]) if i in added else len(p) if byte_level else 1 if re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", p)
                else len(p.replace("\u2581", " ").encode()) for i, p in enumerate(pieces)]

    def encode_many(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)


class IdsTokenizer:
    """Stand-in for pre-tokenized data without a tokenizer: decodes ids as numbers, cannot encode."""
    bos_id = eos_id = None
    model_path, spec = None, ("ids", None)

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def encode(self, text: str):
        raise DataError("pre-tokenized data without a tokenizer cannot encode text (set data.tokenizer to a "
                        "tokenizer.model or tokenizer.json)")

    def decode(self, ids) -> str:
        return " ".join(str(int(i)) for i in ids)

    def piece_bytes(self):
        return None  # unknown without a tokenizer


def token_bytes(tokenizer, vocab_size: int):
    """The UTF-8 bytes each of vocab_size ids decodes to (special tokens and ids past the tokenizer's: 0), or None
    for ids without a tokenizer."""
    table = tokenizer.piece_bytes()
    return None if table is None else (table + [0] * vocab_size)[:vocab_size]


def load_tokenizer_file(path, threads: Optional[int] = None):
    """tokenizer.json -> HFTokenizer; 'bytes' -> ByteTokenizer; anything else is read as a sentencepiece model
    (encoding on `threads`; None: one per core). A tokenizer's `.spec` is (kind, this path; None for bytes)."""
    if str(path) == "bytes":
        return ByteTokenizer()
    return HFTokenizer(path) if Path(path).suffix == ".json" else SentencePieceTokenizer(path, threads)


def byte_level(pattern: str = WORDS):
    """An untrained byte-level BPE tokenizer (`tokenizers`) whose pre-tokenizer splits by `pattern`."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pattern), "isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok


def bpe_trainer(vocab_size: int, specials=TRAINED_SPECIALS):
    from tokenizers import pre_tokenizers, trainers
    alphabet = pre_tokenizers.ByteLevel.alphabet() if specials else []
    return trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(specials), initial_alphabet=alphabet,
                               show_progress=False)


def train_bpe(docs: list[str], vocab_size: int, out_path: Path, transition: Optional[int] = None, log=print) -> Path:
    """A byte-level BPE tokenizer.json of vocab_size ids (256 bytes, `<|endoftext|>`, merges) trained on the
    documents, written atomically to out_path. With `transition` < vocab_size: SuperBPE (Liu et al., 2025), whose
    first `transition` ids are this BPE's and whose later merges cross whitespace (`superword_merges`)."""
    needs("tokenizers", "data.tokenizer=bpe needs the 'tokenizers' package")
    if not any(d.strip() for d in docs):
        raise DataError("cannot train a tokenizer: the corpus has no text")
    kind = f"SuperBPE (subwords up to {transition})" if transition else "byte-level BPE"
    log(f"data: training a {kind} tokenizer (vocab {vocab_size}) on {sum(map(len, docs)):,} chars sampled from "
        f"{len(docs):,} documents")
    tok = byte_level()
    tok.train_from_iterator(docs, bpe_trainer(transition or vocab_size))
    if transition:
        tok = superword_merges(tok, docs, vocab_size)
    atomic_write(out_path, tok.to_str())
    return out_path


def superword_merges(tok, docs: list[str], vocab_size: int):
    """SuperBPE's second stage: the documents encoded by `tok`'s merges with only numbers split, each id a character,
    and BPE trained on those sequences; its merges, spelled in bytes, appended to `tok`'s until vocab_size ids."""
    from tokenizers import Tokenizer, models
    tok.pre_tokenizer = byte_level(NUMBERS).pre_tokenizer
    model = json.loads(tok.to_str())["model"]
    vocab, merges = model["vocab"], [tuple(m) for m in model["merges"]]
    pieces, base = {i: p for p, i in vocab.items()}, 0x10000  # id i as chr(base + i): a code point of its own
    words = ["".join(chr(base + i) for _, i in group) for e in tok.encode_batch(docs, add_special_tokens=False)
             for _, group in itertools.groupby(zip(e.word_ids, e.ids), key=lambda w: w[0])]
    alphabet = len(set(itertools.chain.from_iterable(words)))
    second = Tokenizer(models.BPE())  # no pre-tokenizer: a pre-tokenized word is one sequence
    want = vocab_size - len(vocab)  # and spare merges: one that spells a token already there adds no id
    second.train_from_iterator(words, bpe_trainer(alphabet + want + want // 8 + 8, specials=()))
    spell = lambda s: "".join(pieces[ord(c) - base] for c in s)  # noqa: E731
    known = set(merges)
    for a, b in json.loads(second.to_str())["model"]["merges"]:
        if len(vocab) >= vocab_size:
            break
        pair = (spell(a), spell(b))
        if pair not in known:
            known.add(pair)
            merges.append(pair)
            vocab.setdefault(pair[0] + pair[1], len(vocab))
    tok.model = models.BPE(vocab=vocab, merges=merges)
    return tok


def sample_documents(docs: Iterable[str], budget_chars: int, seed: int = 0) -> list[str]:
    """A uniform random sample of the documents totalling at most `budget_chars`, in one pass and bounded
    memory (the smallest random keys kept in a heap; a longer document cut); deterministic for a seed."""
    rng = random.Random(seed)
    heap, total = [], 0  # heap: (-key, n, text), the largest key on top, evicted first
    for n, text in enumerate(docs):
        text, key = text[:budget_chars], rng.random()
        if total + len(text) <= budget_chars or (heap and -heap[0][0] > key):  # fits, or evicts larger keys
            heapq.heappush(heap, (-key, n, text))
            total += len(text)
            while total > budget_chars:
                total -= len(heapq.heappop(heap)[2])
    return [t for _, _, t in sorted(heap, key=lambda e: e[1])]  # corpus order


def train_sentencepiece(docs: list[str], vocab_size: int, out_path: Path, log=print, symbols=()) -> Path:
    """A BPE sentencepiece model trained on the documents (a sample of the corpus), written atomically to
    out_path: byte fallback, so any text round-trips; BOS (id 1) and EOS (id 2) for document boundaries; each of
    `symbols` one token wherever it appears (ids 3, 4, ... in order; no space then put before the text, so that a
    symbol alone encodes as its one token)."""
    import sentencepiece as spm
    lines = [ln for d in docs for ln in d.splitlines() if ln.strip()]
    if not lines:
        raise DataError("cannot train a tokenizer: the corpus has no non-empty lines")
    log(f"data: training a sentencepiece tokenizer (vocab {vocab_size}) on {sum(map(len, docs)):,} chars "
        f"sampled from {len(docs):,} documents")
    buf = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(lines), model_writer=buf, vocab_size=vocab_size, model_type="bpe",
            byte_fallback=True, character_coverage=0.9995, split_digits=True, allow_whitespace_only_pieces=True,
            remove_extra_whitespaces=False, normalization_rule_name="identity", max_sentence_length=1 << 16,
            num_threads=os.cpu_count() or 1, minloglevel=2, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
            user_defined_symbols=list(symbols), add_dummy_prefix=not symbols)
    except RuntimeError as e:
        raise DataError(f"cannot train a sentencepiece tokenizer with vocab_size={vocab_size}: "
                        f"{str(e).splitlines()[0]}") from None
    atomic_write(out_path, buf.getvalue())
    return out_path
