"""Conversations for chat fine-tuning: jsonl rows (`data.format`: messages, prompt_completion, alpaca) ->
messages -> chat template -> token ids, and labels that train only the assistant's tokens.

`ChatTemplate` renders a model's Jinja `chat_template` as transformers' `apply_chat_template` does, or
`chatml`; assistant-only labels come from `{% generation %}` markers, else from rendering prefix by prefix."""
from __future__ import annotations

import datetime
import itertools
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

import yaml

from zoo.config import bounded, fail
from zoo.vlm_processor import IMAGE_TOKENS

from . import (ByteTokenizer, DataError, HFTokenizer, SentencePieceTokenizer, check_files, load_tokenizer_file,
               line_list, model_tokenizer, needs, tokenizer_folder)

FORMATS = ("messages", "prompt_completion", "alpaca")
ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# {% generation %} ... {% endgeneration %} renders its body between these two characters (from Unicode's
# private-use plane 16), which `_strip_marks` turns into spans; a message holding one is refused
_OPEN, _CLOSE = "\U0010fffa", "\U0010fffb"

CHATML = ("{%- macro text(content) -%}"  # a string, or a VLM's list of parts: text, and <image> for each image
          "{%- if content is string -%}{{- content -}}{%- else -%}{%- for part in content -%}"
          "{{- '<image>' if part['type'] == 'image' else part['text'] -}}{%- endfor -%}{%- endif -%}"
          "{%- endmacro -%}"
          "{%- for message in messages -%}"
          "{%- if message['role'] == 'assistant' -%}"
          "{{- '<|im_start|>assistant\\n' -}}{% generation %}{{- text(message['content']) + '<|im_end|>' -}}"
          "{% endgeneration %}{{- '\\n' -}}"
          "{%- else -%}"
          "{{- '<|im_start|>' + message['role'] + '\\n' + text(message['content']) + '<|im_end|>\\n' -}}"
          "{%- endif -%}"
          "{%- endfor -%}"
          "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")
BUILTIN = {"chatml": CHATML}
IMAGE = IMAGE_TOKENS[0]  # where a chat template puts an image


def expand_images(text: str, images: list[str], spans=()) -> tuple[str, list]:
    """text with its i-th <image> replaced by images[i] (the processor's text of image i), and the spans (start, end)
    in it moved along; a count that differs: a DataError."""
    pieces = text.split(IMAGE)
    if len(pieces) != len(images) + 1:
        raise DataError(f"{len(pieces) - 1} {IMAGE} places for {len(images)} images (images the template does not "
                        f"place, or {IMAGE} in the text)")
    ends = list(itertools.accumulate(len(p) + len(IMAGE) for p in pieces[:-1]))  # each place's end in text
    move = lambda i: i + sum(len(t) - len(IMAGE) for t, e in zip(images, ends) if e <= i)  # noqa: E731
    return pieces[0] + "".join(t + p for t, p in zip(images, pieces[1:])), [(move(a), move(b)) for a, b in spans]


@dataclass
class PostTrainingDataConfig:
    """The data keys of every post-training format (chat SFT, preference tuning, RL prompts)."""
    format: str = ""                        # the rows' shape, which selects the task for `family: llm`
    path: str = ""                          # a jsonl file of the format's rows (chat SFT: or a folder of them;
                                            # docs/post-training.md), or `synthetic`: the embedded set, made by code
    val_path: Optional[str] = None          # held-out rows (same format); null = `val_fraction` of `path`'s
    val_fraction: float = bounded(0.1, gt=0, lt=1)  # rows held out when there is no `val_path` (at least one)
    synthetic_rows: int = bounded(2000, ge=10)  # `path: synthetic`: how many rows are made (`val_fraction` of them
                                            # held out, from their own split)
    tokenizer: str = "sentencepiece"        # `sentencepiece`: the `train.init_from` checkpoint's own (chat SFT without
                                            # one: BPE trained on the rendered conversations); `bytes`; or a file's path
    template: Optional[str] = None          # the chat template: null = the `train.init_from` model's own, if any (chat
                                            # SFT: else `chatml`); a built-in name or a path (docs/post-training.md);
                                            # `none` (not for chat SFT): plain text, no template
    seq_len: int = bounded(256, ge=2)       # tokens per row; <= `model.max_seq_len`
    eval_tasks: Optional[list[str]] = None  # task files (train/eval.py) scored at every evaluation with the
                                            # template, logged as `eval_<file stem>_<metric>`

    def validate(self, source, prefix="data."):
        if not self.path:
            raise fail(source, prefix + "path", "must name a jsonl file of the format's rows, or be synthetic")
        check_files(self.eval_tasks, source, prefix + "eval_tasks")
        if self.path == "synthetic" and self.val_path is not None:
            raise fail(source, prefix + "val_path", "must be null with path: synthetic (it has its own held-out rows)")
        if self.template not in (None, "none", *BUILTIN) and not Path(self.template).expanduser().exists():
            raise fail(source, prefix + "template", f"={self.template}: neither a built-in template "
                                                    f"({', '.join(BUILTIN)}), none, nor an existing file or folder")


@dataclass
class ChatDataConfig(PostTrainingDataConfig):
    format: Literal["messages", "prompt_completion", "alpaca"] = "messages"  # the rows' shape: `messages`
                                            # (OpenAI / ShareGPT), `prompt_completion` or `alpaca`; `text`: docs/llm.md
    path: str = "synthetic"                 # a .jsonl file, a folder of .jsonl files, or `synthetic`: the embedded
                                            # conversation set (train/data/chat_example.py, made by code, no download)
    val_fraction: float = bounded(0.05, gt=0, lt=1)  # conversations held out for validation (assistant-token loss)
                                            # when there is no `val_path`
    synthetic_rows: int = bounded(4000, ge=10)  # `path: synthetic`: how many conversations are made
    seq_len: int = bounded(512, ge=2)       # tokens per conversation (<= `model.max_seq_len`); a longer one is cut
                                            # there (counted in the log), dropped when no assistant token is left
    vocab_size: int = bounded(2048, ge=16, le=2**31)  # vocabulary of a sentencepiece tokenizer trained here
    train_on_prompt: bool = False           # train on every token (system, user, template markup), not only the
                                            # assistant's turns and their end-of-turn tokens
    pack: bool = False                      # several conversations per row; false: one conversation per row, padded
                                            # to the longest in its batch, rows of similar length batched together
    bucket_batches: int = bounded(64, ge=1)  # length bucketing: the conversations of this many batches are sorted by
                                            # length and cut into batches (then shuffled); 1 = no bucketing
    eval_generate: int = bounded(32, ge=0)  # validation conversations whose last answer is generated (greedy) at
                                            # every evaluation and compared with the reference (`val_exact_match`)
    cache_dir: Optional[str] = None         # where a trained tokenizer is cached; null = `$ZOO_CACHE`, else the user
                                            # cache directory


# ----------------------------------------------------------------------------- rows -> messages
class BadRow(ValueError):
    """Why one row is unusable (collected by read_conversations, never raised to the user)."""


def _text(row: dict, key: str, optional: bool = False) -> Optional[str]:
    value = row.get(key)
    if not isinstance(value, str) and not (value is None and optional):
        raise BadRow(f"'{key}' is not a string")
    return value


def _parts(content) -> list[dict]:
    """A VLM message's content, a list of {"type": "text", "text": ...} and {"type": "image", "image" (or "path"):
    a file}, checked."""
    for p in content:
        kind = p.get("type") if isinstance(p, dict) else None
        if not (kind == "text" and isinstance(p.get("text"), str) or kind == "image" and image_path(p) is not None):
            raise BadRow(f"a content part is neither {{type: text, text}} nor {{type: image, image or path}}: {p!r:.60}")
    return content


def image_path(part: dict):
    """The file of an image part (its "image" or "path"), or None."""
    path = part.get("image", part.get("path"))
    return path if isinstance(path, str) else None


def _message_list(items, key: str, parts: bool = False) -> list[dict]:
    """OpenAI-shaped ({role, content}) or ShareGPT-shaped ({from, value}) messages -> [{role, content}]; with parts,
    a content may be a list of text and image parts (_parts)."""
    if not isinstance(items, list) or not items:
        raise BadRow(f"'{key}' is not a non-empty list")
    out = []
    for m in items:
        if not isinstance(m, dict):
            raise BadRow(f"a message of '{key}' is not an object")
        role, content = (m.get("role"), m.get("content")) if "role" in m else (SHAREGPT_ROLES.get(m.get("from")), m.get("value"))
        if role not in ROLES:
            raise BadRow(f"a message of '{key}' has role {m.get('role', m.get('from'))!r} (known: system, user, "
                         f"assistant; ShareGPT: human, gpt)")
        if parts and isinstance(content, list):
            content = _parts(content)
        elif not isinstance(content, str):
            raise BadRow(f"a {role} message of '{key}' has no string content" + " or list of parts" * parts)
        out.append({"role": role, "content": content})
    return out


def _with_system(row: dict, messages: list[dict]) -> list[dict]:
    system = _text(row, "system", optional=True)
    return ([{"role": "system", "content": system}] if system else []) + messages


def row_messages(row, fmt: str, parts: bool = False) -> list[dict]:
    """One parsed jsonl row of format `fmt` -> its conversation [{role, content}, ...]; BadRow if unusable. parts:
    contents may be lists of text and image parts (`messages` only)."""
    if not isinstance(row, dict):
        raise BadRow("not a JSON object")
    if fmt == "messages":
        key = "messages" if "messages" in row else "conversations"
        messages = _message_list(row.get(key), key, parts)
    elif fmt == "prompt_completion":
        parts = []
        for key, role in (("prompt", "user"), ("completion", "assistant")):
            v = row.get(key)
            parts += _message_list(v, key) if isinstance(v, list) else [{"role": role, "content": _text(row, key)}]
        messages = _with_system(row, parts)
    elif fmt == "alpaca":
        instruction, extra = _text(row, "instruction"), _text(row, "input", optional=True)
        user = f"{instruction}\n\n{extra}" if extra else instruction
        messages = _with_system(row, [{"role": "user", "content": user}, {"role": "assistant", "content": _text(row, "output")}])
    else:
        raise ValueError(f"unknown format {fmt!r} (known: {', '.join(FORMATS)})")
    if not any(m["role"] == "assistant" for m in messages):
        raise BadRow("no assistant message")
    if any(_OPEN in t or _CLOSE in t for t in map(content_text, messages)):
        raise BadRow("a message holds U+10FFFA or U+10FFFB (reserved for marking the assistant's part)")
    return messages


def content_text(message: dict) -> str:
    """A message's text: its content, or its text parts joined."""
    c = message["content"]
    return c if isinstance(c, str) else "".join(p["text"] for p in c if p.get("type") == "text")


def read_conversations(path: str, fmt: str, log=print, parts: bool = False) -> list[tuple[list[dict], tuple[str, int]]]:
    """Every usable conversation of a .jsonl file (or a folder of them), with its (file, line); malformed
    rows skipped, with one log line per file (their count, line numbers and the first reason). parts: row_messages'."""
    p = Path(path).expanduser()
    files = sorted(p.rglob("*.jsonl")) if p.is_dir() else [p]
    if not files or not files[0].is_file():
        raise DataError(f"{path}: no such .jsonl file" + (" (or folder of .jsonl files)" if not files else ""))
    out, first_problem = [], None
    for f in files:
        bad, reason = [], None
        try:
            lines = f.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise DataError(f"{f}: cannot be read as UTF-8 text ({e})") from None
        for i, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                out.append((row_messages(json.loads(line), fmt, parts), (str(f), i)))
            except (ValueError, BadRow) as e:  # json.JSONDecodeError is a ValueError
                bad.append(i)
                reason = reason or (str(e) if isinstance(e, BadRow) else "not JSON")
        if bad:
            first_problem = first_problem or f"{f}: line {bad[0]}: {reason}"
            log(f"data: {f}: {len(bad)} malformed rows skipped (data.format={fmt}; lines {line_list(bad)}; "
                f"line {bad[0]}: {reason})")
    if not out:
        raise DataError(f"{path}: no usable conversation for data.format={fmt}"
                        + (f"; {first_problem}" if first_problem else ""))
    return out


# ----------------------------------------------------------------------------- Jinja, as transformers renders it
def _environment():
    """The sandboxed Jinja environment chat templates are written for (module docstring)."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationMarks(Extension):
        """`{% generation %}...{% endgeneration %}`: the body, between the private marks."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

        def _mark(self, caller):
            return _OPEN + caller() + _CLOSE

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):  # transformers' own
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class Namespace(jinja2.utils.Namespace):
        """`namespace(...)` without underscore-named attributes (no way to reach Python internals)."""

        def __init__(*args, **kwargs):  # each attribute set through __setitem__, checked
            jinja2.utils.Namespace.__init__(args[0])
            for name, value in dict(*args[1:], **kwargs).items():
                args[0][name] = value

        def __setitem__(self, name, value):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a namespace attribute may not start with '_': {name!r}")
            jinja2.utils.Namespace.__setitem__(self, name, value)

    class Dict:
        """`dict(...)` and `dict.fromkeys(...)`, and nothing else of the type."""
        __call__, fromkeys = staticmethod(dict), staticmethod(dict.fromkeys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationMarks, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.datetime.now().strftime(fmt),
                       dict=Dict(), namespace=Namespace)
    return env


def _strip_marks(text: str) -> tuple[str, list[tuple[int, int]]]:
    """Rendered text with generation marks -> (the text without them, the marked character spans)."""
    parts, spans, pos, start = [], [], 0, None
    for piece in re.split(f"([{_OPEN}{_CLOSE}])", text):
        if piece == _OPEN:
            start = pos
        elif piece == _CLOSE:
            if start is not None and pos > start:
                spans.append((start, pos))
            start = None
        else:
            parts.append(piece)
            pos += len(piece)
    return "".join(parts), spans


def _token_text(value) -> Optional[str]:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken object."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


# ----------------------------------------------------------------------------- the template
class ChatTemplate:
    """A Jinja chat template with the special tokens it may use.

        t = ChatTemplate.from_pretrained("path/to/hf_folder")      # or a tokenizer_config.json, .jinja, .gguf
        t = ChatTemplate.builtin("chatml")
        ids, labels = t.encode(tokenizer, messages)                  # labels: -100 but on the assistant's tokens
    """

    def __init__(self, source: str, special_tokens: Optional[dict] = None, name: str = "<chat template>"):
        import jinja2
        self.source, self.name = source, name
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if k in SPECIAL_TOKENS and v is not None}
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise DataError(f"{name}: not a valid Jinja chat template (line {e.lineno}: {e.message})") from None
        self.has_generation_marks = re.search(r"\{%-?\s*generation\s*-?%\}", source) is not None

    @classmethod
    def builtin(cls, name: str = "chatml") -> "ChatTemplate":
        if name not in BUILTIN:
            raise DataError(f"unknown built-in chat template {name!r} (known: {', '.join(BUILTIN)})")
        return cls(BUILTIN[name], name=f"built-in {name}")

    @classmethod
    def from_pretrained(cls, path) -> "ChatTemplate":
        """The template of a Hugging Face folder (tokenizer_config.json's `chat_template`, else
        chat_template.jinja), of one of those files, of a .jinja file, or of a GGUF file."""
        p = Path(path).expanduser()
        if p.is_dir():
            for name in ("tokenizer_config.json", "chat_template.jinja"):
                if (p / name).is_file() and (name != "tokenizer_config.json" or _config_template(p / name)):
                    return cls.from_pretrained(p / name)
            raise DataError(f"{path}: no chat template (tokenizer_config.json with a chat_template, or chat_template.jinja)")
        if not p.is_file():
            raise DataError(f"{path}: no such file or folder")
        if p.suffix == ".gguf":
            return _from_gguf(p)
        config = p if p.suffix == ".json" else p.parent / "tokenizer_config.json"  # a .jinja: its tokenizer's
        special = {k: _token_text(_read_json(config).get(k)) for k in SPECIAL_TOKENS} if config.is_file() else {}
        template = _config_template(p) if p.suffix == ".json" else p.read_text(encoding="utf-8")
        if template is None:
            raise DataError(f"{p}: no chat_template")
        return cls(template, special, str(p))

    def _render_marked(self, messages: list[dict], add_generation_prompt: bool = False, **variables) -> str:
        import jinja2
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        try:
            return self._template.render(messages=messages, tools=None, documents=None,
                                         add_generation_prompt=add_generation_prompt, **self.special_tokens, **variables)
        except jinja2.TemplateError as e:
            raise DataError(f"{self.name}: {type(e).__name__}: {e}") from None

    def render(self, messages: list[dict], add_generation_prompt: bool = False, **variables) -> str:
        """The conversation as text, exactly as transformers' apply_chat_template(tokenize=False, **variables)."""
        return _strip_marks(self._render_marked(messages, add_generation_prompt, **variables))[0]

    def assistant_spans(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """(rendered text, each assistant turn's span with its end of turn), by generation marks, else by prefixes."""
        text, marked = _strip_marks(self._render_marked(messages))
        if self.has_generation_marks:
            return text, marked
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = self.render(messages[:i], add_generation_prompt=True)
            upto = self.render(messages[:i + 1])
            if not (upto.startswith(before) and text.startswith(upto)):
                raise DataError(f"{self.name}: cannot mark the assistant's part: the rendering of the conversation up "
                                f"to assistant message {i} is not a prefix of the whole (the template renders earlier "
                                f"turns differently once later ones follow); use a template with "
                                f"{{% generation %}} markers")
            start, end = len(before), len(upto.rstrip())
            content = content_text(m)
            lead = len(upto[start:]) - len(upto[start:].lstrip())  # whitespace after the header, not the content's
            start += max(0, lead - (len(content) - len(content.lstrip())))
            if content.strip() and content.strip() not in text[start:end]:
                raise DataError(f"{self.name}: cannot mark the assistant's part: assistant message {i}'s content "
                                f"does not appear where the template renders it")
            spans.append((start, end))
        return text, spans

    @property
    def end_of_turn(self) -> str:
        """The text closing an assistant turn (`<|im_end|>`, `<|eot_id|>`, ...): what follows a rendered reply."""
        probe = "Zoo probe 7"
        try:
            text, spans = self.assistant_spans([{"role": "user", "content": "Hi"},
                                                {"role": "assistant", "content": probe}])
            turn = text[spans[-1][0]:spans[-1][1]] if spans else ""
        except DataError:
            turn = ""
        if probe not in turn:  # a template reading each message as a list of parts (a VLM's): what follows the reply
            turn = self.render([{"role": role, "content": [{"type": "text", "text": t}]}
                                for role, t in (("user", "Hi"), ("assistant", probe))])
        if probe not in turn:
            raise DataError(f"{self.name}: cannot find the assistant's end-of-turn text")
        return turn[turn.index(probe) + len(probe):].strip()

    def encode(self, tokenizer, messages: list[dict], train_on_prompt: bool = False,
               images: Optional[list[str]] = None) -> tuple[list[int], list[int]]:
        """(ids of the rendered conversation, as apply_chat_template(tokenize=True) gives them, labels): the ids
        on the assistant's turns and their end-of-turn tokens (every id with train_on_prompt), -100 elsewhere;
        images: the text each <image> place becomes (expand_images)."""
        text, spans = self.assistant_spans(messages)
        if images is not None:
            text, spans = expand_images(text, images, spans)
        ids, offsets = token_offsets(tokenizer, text)
        return ids, list(ids) if train_on_prompt else [t if any(_overlaps(o, s) for s in spans) else -100
                                                       for t, o in zip(ids, offsets)]

    def to_config(self) -> dict:  # as a tokenizer_config.json holds them
        return {"chat_template": self.source, **self.special_tokens}


def find_template(folder) -> Optional[ChatTemplate]:
    """The chat template of a model folder or GGUF file (tokenizer_folder), or None."""
    p = tokenizer_folder(folder)
    if not p.is_dir():
        return None
    has = (p / "chat_template.jinja").is_file() or (
        (p / "tokenizer_config.json").is_file() and _config_template(p / "tokenizer_config.json") is not None)
    return ChatTemplate.from_pretrained(p) if has else None


def choose_template(name: Optional[str], own: Optional[ChatTemplate] = None) -> Optional[ChatTemplate]:
    """The template `name` names (data.template, --template): `none`, a built-in name or a path; null: `own`."""
    if name in BUILTIN:
        return ChatTemplate.builtin(name)
    return None if name == "none" else ChatTemplate.from_pretrained(name) if name is not None else own


def _overlaps(token: tuple[int, int], span: tuple[int, int]) -> bool:
    (a, b), (s, e) = token, span
    return a < e and b > s if b > a else s <= a < e


def _read_json(p: Path) -> dict:
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise DataError(f"{p}: not readable JSON ({e})") from None
    if not isinstance(data, dict):
        raise DataError(f"{p}: not a JSON object")
    return data


def _config_template(p: Path) -> Optional[str]:
    """tokenizer_config.json's chat_template: a string, or a list of named templates (the `default` one)."""
    t = _read_json(p).get("chat_template")
    if isinstance(t, list):
        t = next((x.get("template") for x in t if isinstance(x, dict) and x.get("name") == "default"), None)
    return t if isinstance(t, str) else None


def _from_gguf(p: Path) -> ChatTemplate:
    gguf = needs("gguf", f"{p}: reading a GGUF file's chat template needs the gguf package (pip install -e '.[gguf]')")
    try:
        reader = gguf.GGUFReader(str(p))
    except Exception as e:  # noqa: BLE001 (any failure to parse is a bad file)
        raise DataError(f"{p}: not a readable GGUF file ({e})") from None
    field = reader.get_field("tokenizer.chat_template")
    if field is None:
        raise DataError(f"{p}: no tokenizer.chat_template")
    tokens = reader.get_field("tokenizer.ggml.tokens")
    ids = {k: reader.get_field(f"tokenizer.ggml.{k[:-6]}_token_id") for k in ("bos_token", "eos_token", "unk_token",
                                                                             "pad_token")}
    special = {k: tokens.contents(int(f.contents())) for k, f in ids.items() if f is not None and tokens is not None}
    return ChatTemplate(field.contents(), special, str(p))


# ----------------------------------------------------------------------------- tokens with their characters
def _byte_to_char(text: str) -> list[int]:
    """For each UTF-8 byte of text (and one past the end), the index of the character it belongs to."""
    return [i for i, ch in enumerate(text) for _ in ch.encode("utf-8")] + [len(text)]


def prompt_tokens(tokenizer, template: ChatTemplate, prompts: list[str], max_length: int):
    """Each prompt as a user turn with the generation prompt (thinking off), truncated and right-padded with the
    tokenizer's pad token (none: its end of text, as a Zoo LLM's sentencepiece has) to max_length: (ids, attention
    mask), (B, max_length) int64 each, as diffusers' FLUX.2 pipelines feed their Qwen3."""
    import torch
    pad = next((i for i in (getattr(tokenizer, "pad_id", None), getattr(tokenizer, "eos_id", None)) if i is not None),
               None)
    if pad is None:
        raise DataError(f"{getattr(tokenizer, 'model_path', None) or 'the tokenizer'}: no pad_token nor an end-of-text "
                        f"token to pad the prompts with (tokenizer_config.json)")
    texts = [template.render([{"role": "user", "content": p}], True, enable_thinking=False) for p in prompts]
    rows = [token_offsets(tokenizer, t)[0][:max_length] for t in texts]
    ids = torch.tensor([r + [pad] * (max_length - len(r)) for r in rows])
    return ids, torch.tensor([[1] * len(r) + [0] * (max_length - len(r)) for r in rows])


def token_offsets(tokenizer, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """Token ids of `text` (no special tokens added) and each token's character span [start, end)."""
    if isinstance(tokenizer, HFTokenizer):
        enc = tokenizer.tok.encode(text, add_special_tokens=False)
        return list(enc.ids), [tuple(o) for o in enc.offsets]
    if isinstance(tokenizer, ByteTokenizer):
        b2c = _byte_to_char(text)
        return tokenizer.encode(text), [(b2c[i], b2c[i + 1] if b2c[i + 1] > b2c[i] else b2c[i] + 1)
                                        for i in range(len(b2c) - 1)]
    if isinstance(tokenizer, SentencePieceTokenizer):
        return _sentencepiece_offsets(tokenizer.sp, text)
    raise TypeError(f"no token offsets for a {type(tokenizer).__name__}")


def _sentencepiece_offsets(sp, text: str):
    """sentencepiece, control pieces (<s>, </s>) written in the text read as those tokens, as transformers does."""
    controls = {sp.id_to_piece(i): i for i in (sp.bos_id(), sp.eos_id()) if i >= 0}
    pieces = re.split("(" + "|".join(map(re.escape, controls)) + ")", text) if controls else [text]
    ids, offsets, pos = [], [], 0
    for piece in pieces:
        if piece in controls:
            ids.append(controls[piece])
            offsets.append((pos, pos + len(piece)))
        elif piece:
            b2c = _byte_to_char(piece)
            for p in sp.encode(piece, out_type="proto").pieces:
                ids.append(p.id)
                offsets.append((pos + b2c[p.begin], pos + b2c[p.end]))
        pos += len(piece)
    return ids, offsets


def model_sources(path) -> list[Path]:
    """Where a model's tokenizer and chat template are: the path itself (a .gguf file's tokenizer_folder),
    then the base it was fine-tuned from (an adapter run's train.init_from, an adapter folder's base)."""
    from zoo.weights import peft_lora
    p, base = Path(path).expanduser(), None
    if peft_lora.detect(p) and p.is_dir():
        base = peft_lora.base_of(p)
    elif (p / "config.yaml").is_file():
        base = ((yaml.safe_load((p / "config.yaml").read_text()) or {}).get("train") or {}).get("init_from")
    return [tokenizer_folder(p)] + (model_sources(base) if base and Path(base).expanduser().exists() else [])


def run_family(path) -> Optional[str]:
    """The family a run folder's config.yaml names (llm when it names none), else None."""
    f = Path(path).expanduser() / "config.yaml"
    return (yaml.safe_load(f.read_text()) or {}).get("family", "llm") if f.is_file() else None


def tokenizer_and_template(path, tokenizer: Optional[str] = None):
    """(tokenizer, chat template or None) of a run, adapter or Hugging Face folder or a GGUF file, each its
    own or else its base's; `tokenizer` (a file or 'bytes') wins."""
    if not Path(path).expanduser().exists():
        raise DataError(f"{path}: no such file or folder")
    if run_family(path) not in (None, "llm", "vlm"):
        raise DataError(f"{path}: a {run_family(path)} run, not a language model")
    template = None
    tok = None if tokenizer is None else load_tokenizer_file(
        tokenizer if tokenizer == "bytes" else Path(tokenizer).expanduser())
    for src in model_sources(path):
        if tok is None and (name := model_tokenizer(src, ("tokenizer.json", "tokenizer.model"))):
            tok = load_tokenizer_file(name)
        template = template or find_template(src)
    if tok is None:
        raise DataError(f"{path}: no tokenizer.json or tokenizer.model beside the model or its base (pass --tokenizer)")
    return tok, template
