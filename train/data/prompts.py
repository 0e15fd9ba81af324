"""Prompts with checkable answers (`data.format: prompts`) and the rewards that check them.

A row is `{"prompt": text, "answer": any JSON}` or `{"messages": [...], "answer": ...}` (rendered with
the chat template, the generation prompt added). `path: synthetic` is the embedded arithmetic task:
sums, differences, products and word problems in a few templates, made by code; its held-out split
uses numbers whose tens training never shows. A reward is `(completions, answers, prompts) -> floats`."""
from __future__ import annotations

import importlib
import importlib.util
import math
import random
import re
import sys
from pathlib import Path
from typing import Callable

from . import DataError
from .preference import prompt_messages, read_jsonl

NAMES = ("Ada", "Ben", "Chen", "Dana", "Emil", "Gina", "Hugo", "Ines", "Kai", "Lara", "Omar", "Rosa", "Sami", "Zoe")
THINGS = ("apples", "coins", "books", "shells", "stamps", "marbles")


def arithmetic_row(rng: random.Random, split: str) -> dict:
    """One problem of the embedded task: numbers whose tens are held out (one in three) exactly for 'val'."""
    def number():
        while True:
            n = rng.randint(2, 49)
            if ((n // 10) % 3 == 1) == (split != "train"):
                return n
    a, b = number(), number()
    a, b = max(a, b), min(a, b)
    who, what = rng.choice(NAMES), rng.choice(THINGS)
    kind = rng.randrange(5)
    prompt, answer = [(f"What is {a} + {b}?", a + b), (f"What is {a} - {b}?", a - b),
                      (f"What is {a} times {b % 4 + 2}?", a * (b % 4 + 2)),
                      (f"{who} has {a} {what} and gets {b} more. How many {what} does {who} have?", a + b),
                      (f"{who} had {a} {what} and gave {b} away. How many {what} are left?", a - b)][kind]
    return {"prompt": prompt, "answer": answer}


def arithmetic(split: str, n: int) -> list[dict]:
    """n rows of the embedded task's split ('train' or 'val'), the same every time."""
    rng = random.Random(f"zoo-arithmetic-{split}")
    return [arithmetic_row(rng, split) for _ in range(n)]


def prompt_row(row: dict) -> dict:
    """A prompts row: {'prompt': text or messages, 'answer'} (KeyError / TypeError when malformed)."""
    if "messages" in row:
        prompt = prompt_messages(row["messages"])
    elif isinstance(row["prompt"], str) and row["prompt"]:
        prompt = row["prompt"]
    else:
        raise TypeError("prompt must be a non-empty string (or give messages)")
    return {"prompt": prompt, "answer": row["answer"]}


def read_prompts(path, log=print) -> list[dict]:
    """The rows of a prompts jsonl file; malformed ones counted and skipped in one line, none at all an error."""
    return read_jsonl(path, prompt_row, log, "prompt rows (each needs prompt or messages, and answer)")


LAST_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _number(text: str):
    found = LAST_NUMBER.findall(text.replace(",", ""))
    return float(found[-1]) if found else None


def numeric(completions, answers, prompts):
    """1 when the completion's last number equals the answer, else 0."""
    out = []
    for c, a in zip(completions, answers):
        try:
            want = float(a)
        except (TypeError, ValueError):
            want = None
        got = _number(c)
        out.append(float(got is not None and want is not None and abs(got - want) < 1e-6))
    return out


def exact(completions, answers, prompts):
    """1 when the stripped completion equals the answer (as text), else 0."""
    return [float(c.strip() == str(a).strip()) for c, a in zip(completions, answers)]


def contains(completions, answers, prompts):
    """1 when the answer (as text) appears in the completion, else 0."""
    return [float(str(a) in c) for c, a in zip(completions, answers)]


def matches(pattern: str) -> Callable:
    """`format:REGEX`: 1 when the stripped completion matches REGEX whole, else 0."""
    rx = re.compile(pattern, re.S)
    return lambda completions, answers, prompts: [float(rx.fullmatch(c.strip()) is not None) for c in completions]


def length_penalty(limit: int) -> Callable:
    """`length:N`: minus the characters past N, over N (0 up to N)."""
    return lambda completions, answers, prompts: [-max(0, len(c) - limit) / limit for c in completions]


BUILTIN = {"numeric": numeric, "exact": exact, "contains": contains}


def reward_fn(name: str, source: str = "<config>") -> Callable:
    """A reward by name: numeric, exact, contains, format:REGEX, length[:N] (default 100), or module:function."""
    from zoo.config import ConfigError
    if name in BUILTIN:
        return BUILTIN[name]
    kind, _, arg = name.partition(":")
    try:
        if kind == "format" and arg:
            return matches(arg)
        if kind == "length":
            return length_penalty(int(arg) if arg else 100)
        if kind and arg and "." not in arg and callable(fn := getattr(_user_module(kind), arg)):
            return fn
    except (re.error, ValueError, ImportError, AttributeError) as e:
        raise ConfigError(f"{source}: rl.rewards: {name!r}: {e}") from None
    raise ConfigError(f"{source}: rl.rewards: {name!r} is none of numeric, exact, contains, format:REGEX, "
                      f"length[:N] or module:function")


def _user_module(name: str):
    """A module importable from sys.path, else the file name.py in the working directory (sys.path untouched)."""
    local = Path.cwd() / (name.replace(".", "/") + ".py")
    if name in sys.modules or not local.is_file():
        return importlib.import_module(name)
    spec = importlib.util.spec_from_file_location(name, local)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def reward_value(name: str, v) -> float:
    """A reward function's value as a finite float; anything else is refused in one line naming the reward."""
    try:
        x = float(v)
    except (TypeError, ValueError):
        x = math.nan
    if not math.isfinite(x):
        raise DataError(f"reward {name}: {v!r} is not a number (a reward function returns one finite number per "
                        f"completion)")
    return x


def score(rewards: list, completions, answers, prompts) -> list[list[float]]:
    """[(name, weight, fn)] -> each reward's values, one list per reward (unweighted)."""
    out = []
    for name, _, fn in rewards:
        values = [reward_value(name, v) for v in fn(completions, answers, prompts)]
        if len(values) != len(completions):
            raise DataError(f"reward {name}: {len(values)} values for {len(completions)} completions")
        out.append(values)
    return out
