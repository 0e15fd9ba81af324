"""The embedded conversation set (`data.path: synthetic`): small chat tasks made by code, the same
every time, so chat fine-tuning has an example that needs no download.

Four kinds of conversation, some with a system message:
- introductions over two turns: "Hi, my name is Kalemi." -> "Nice to meet you, Kalemi!", then
  "What is my name?" -> "Your name is Kalemi." (the second answer needs the first turn);
- parity: "Is 417 even or odd?" -> "417 is odd.";
- repetition: "Repeat after me: bodi sare kite" -> "bodi sare kite";
- the last word: "What is the last word of: bodi sare kite?" -> "kite".

Names and words are made of syllables (65,600 possible names, 1,600 words), split by a hash
into two disjoint pools: `conversations("train")` draws from the first, `conversations("val")`
from the held-out one (numbers likewise, by their tens), so the validation conversations ask about
names, numbers and words that training never showed: answering them needs the skill (copying from
the context, the parity of the last digit), not memory. Chance on them: 1/2 for parity (given the
format), about zero for the others.
"""
from __future__ import annotations

import random
import zlib

SYLLABLES = ("ba be bi bo da de di do fa fe fi ka ke ki ko la le li lo ma me mi mo na ne ni no ra re ri ro sa "
             "se si so ta te ti to va ve vi").split()
SYSTEMS = ("You are a helpful assistant.", "Answer briefly.", "You are a friendly chat bot.")
KINDS = ("introduction", "parity", "repeat", "last_word")


def _held_out(text: str) -> bool:
    """One name, word or number in five is held out for validation (a hash: the same on every machine)."""
    return zlib.crc32(text.encode()) % 5 == 2


def _draw(rng: random.Random, make, split: str) -> str:
    """make(rng) until the result belongs to the split's pool."""
    while True:
        x = make(rng)
        if _held_out(x.lower()) == (split != "train"):
            return x


def _name(rng: random.Random) -> str:
    return "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 3))).capitalize()


def _word(rng: random.Random) -> str:
    return rng.choice(SYLLABLES) + rng.choice(SYLLABLES)


def _number(rng: random.Random) -> str:
    return str(rng.randint(10, 999))


def conversation(kind: str, rng: random.Random, split: str) -> list[dict]:
    """One conversation of `kind` from the split's pools."""
    if kind == "introduction":
        name = _draw(rng, _name, split)
        turns = [f"Hi, my name is {name}.", f"Nice to meet you, {name}!", "What is my name?", f"Your name is {name}."]
    elif kind == "parity":
        n = int(_draw(rng, lambda r: _number(r)[:-1], split) + str(rng.randint(0, 9)))  # held out by its tens
        turns = [f"Is {n} even or odd?", f"{n} is {'odd' if n % 2 else 'even'}."]
    else:
        words = [_draw(rng, _word, split) for _ in range(3)]
        text = " ".join(words)
        turns = ([f"Repeat after me: {text}", text] if kind == "repeat"
                 else [f"What is the last word of: {text}?", words[-1]])
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]
    if rng.random() < 0.3:
        messages.insert(0, {"role": "system", "content": rng.choice(SYSTEMS)})
    return messages


def conversations(split: str, n: int, seed: int = 0) -> list[list[dict]]:
    """n conversations of the split ('train' or 'val'), the kinds in turn; the same for the same arguments."""
    rng = random.Random(f"{seed}:{split}")
    return [conversation(KINDS[i % len(KINDS)], rng, split) for i in range(n)]
