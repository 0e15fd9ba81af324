"""Prompt/response rows: reading jsonl, tokenising a prompt and its response (`encode_response`), and
preference pairs: `{"prompt", "chosen", "rejected"}` lines, or `synthetic`."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from . import DataError, TokenizedRows, chat_example, line_list

IGNORE = -100


def read_jsonl(path, parse: Callable[[dict], object], log=print, what: str = "rows") -> list:
    """parse(row) of every line of the jsonl file `path`; lines that are not JSON objects or that parse refuses
    (ValueError, KeyError, TypeError) skipped, in one log line naming them; no usable line at all, or a DataError
    of parse: a DataError naming the file (and the line)."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise DataError(f"{path}: no such file")
    out, bad, why = [], [], ""
    for i, line in enumerate(p.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not isinstance(row, dict):
                raise TypeError("not a JSON object")
            out.append(parse(row))
        except DataError as e:  # a row the parser refuses outright
            raise DataError(f"{path}: line {i}: {e}") from None
        except (ValueError, KeyError, TypeError) as e:
            bad.append(i)
            why = why or (f"missing key {e}" if isinstance(e, KeyError) else str(e))
    if bad:
        log(f"data: {path}: {len(bad)} malformed lines skipped (line {line_list(bad)}; first: {why})")
    if not out:
        raise DataError(f"{path}: no usable {what}" + (f" ({len(bad)} malformed lines; first: {why})" if bad else ""))
    return out


def prompt_messages(prompt) -> list[dict]:
    """A prompt as chat messages: a string is one user message; a list must hold role/content dicts."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, list) and prompt and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                   and isinstance(m.get("content"), str) for m in prompt):
        return prompt
    raise TypeError("prompt must be a string or a list of {role, content} messages")


def response_text(response) -> str:
    """A response: a string, or a list of one assistant message (the conversational preference shape)."""
    if isinstance(response, list) and len(response) == 1 and isinstance(response[0], dict):
        response = response[0].get("content")
    if not isinstance(response, str):
        raise TypeError("a response must be a string or one {role: assistant, content} message")
    return response


def encode_prompt(tokenizer, prompt) -> list[int]:
    """The tokens of a plain prompt (a chat prompt is rendered by its template: train/chat.py)."""
    if not isinstance(prompt, str):
        raise TypeError("a prompt of chat messages needs a chat template (the model has none)")
    return tokenizer.encode(prompt)


def encode_response(tokenizer, prompt, response: str, template=None) -> tuple[list[int], list[int]]:
    """(ids, labels) of `prompt` answered by `response`: labels are the ids on the response's tokens
    (with a template: the final assistant message's tokens, its end of turn included), -100 elsewhere."""
    if template is not None:
        messages = prompt_messages(prompt) + [{"role": "assistant", "content": response}]
        ids, labels = template.encode(tokenizer, messages)
        return list(ids), last_span(list(labels))
    p = encode_prompt(tokenizer, prompt)
    r = tokenizer.encode(response) + ([tokenizer.eos_id] if tokenizer.eos_id is not None else [])
    return p + r, [IGNORE] * len(p) + r


def last_span(labels: list[int]) -> list[int]:
    """Only the last run of trained labels kept (the final answer, not earlier assistant turns)."""
    end = max((i for i, t in enumerate(labels) if t != IGNORE), default=-1) + 1
    start = end
    while start > 0 and labels[start - 1] != IGNORE:
        start -= 1
    return [IGNORE] * start + labels[start:end] + [IGNORE] * (len(labels) - end)


def fit(ids: list[int], labels: list[int], max_len: int) -> tuple[list[int], list[int], bool]:
    """At most max_len tokens, at least one trained one kept: the prompt loses its start when it
    alone fills the window, then the response loses its end. Returns (ids, labels, truncated)."""
    if len(ids) <= max_len:
        return ids, labels, False
    first = next((i for i, t in enumerate(labels) if t != IGNORE), len(labels))
    cut = max(0, min(first - max_len // 2, len(ids) - max_len))  # keep at least half the window for the response
    return ids[cut:cut + max_len], labels[cut:cut + max_len], True


def synthetic_pairs(split: str, n: int) -> list[dict]:
    """n preference rows from the embedded conversations of `split` ('train' or 'val')."""
    k = len(chat_example.KINDS)  # the kinds come in turn: conversation i + k is of the same kind as i
    convs = chat_example.conversations(split, n + k)
    return [{"prompt": c[:-1], "chosen": c[-1]["content"], "rejected": other[-1]["content"]}
            for c, other in zip(convs[:n], convs[k:]) if other[-1]["content"] != c[-1]["content"]]


class PreferenceData(TokenizedRows):
    """Tokenised preference pairs (chosen ids, labels, rejected ids, labels) of at most `seq_len` tokens."""

    def __init__(self, rows: list[dict], val: list[dict], cfg, tokenizer, template=None, log=print):
        self.tokenizer, self.template, self.truncated = tokenizer, template, 0
        try:
            self.train = [self.encode(r, cfg.seq_len) for r in rows]
            self.val = [self.encode(r, cfg.seq_len) for r in val]
        except TypeError as e:  # a prompt of messages without a template
            raise DataError(f"{cfg.path}: {e}: set data.template (e.g. chatml)") from None
        log(f"data: {cfg.path}: {len(self.train)} train + {len(self.val)} held-out preference pairs"
            + (f"; {self.truncated} responses truncated to data.seq_len={cfg.seq_len}" if self.truncated else ""))

    def encode(self, row: dict, seq_len: int) -> tuple:
        out = []
        for key in ("chosen", "rejected"):
            ids, labels, cut = fit(*encode_response(self.tokenizer, row["prompt"], row[key], self.template), seq_len + 1)
            self.truncated += cut
            out += [ids, labels]
        return tuple(out)


def preference_row(row: dict) -> dict:
    """A preference row: {'prompt', 'chosen', 'rejected'} (KeyError / TypeError when malformed)."""
    prompt_messages(row["prompt"])
    return {"prompt": row["prompt"], "chosen": response_text(row["chosen"]), "rejected": response_text(row["rejected"])}
