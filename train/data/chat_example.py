"""The embedded conversation set (`data.path: synthetic`): small chat tasks made by code, the same
every time, so chat fine-tuning has an example that needs no download.

Four kinds: introductions over two turns, parity, repetition, the last word of a list;
`conversations("val")` draws combinations training never showed, so answering takes the skill."""
from __future__ import annotations

import random

NAMES = ("Ada Alan Alice Amir Anna Ben Bruno Carla Chen Chloe Dana David Elena Emil Eva Felix Gina Grace Hana Hugo "
         "Ines Ivan Jack Jana Jonas Julia Kai Karl Lara Leo Lina Luca Maya Marco Mila Nadia Nico Nina Omar Oscar "
         "Paula Pedro Rosa Ruth Sami Sara Sofia Tara Theo Tom Uma Vera Victor Wen Yara Yusuf Zoe Zara Milo Iris").split()
WORDS = ("apple river stone green moon tiger cloud paper window garden silver orange bread candle forest music "
         "ocean pencil rabbit summer winter yellow bridge castle dragon engine flower guitar hammer island jacket "
         "kitten ladder marble needle pillow rocket saddle table violin wagon anchor basket copper desert feather "
         "glacier harbor jungle lemon meadow nickel planet quartz ribbon shadow thunder velvet walnut").split()
SYSTEMS = ("You are a helpful assistant.", "Answer briefly.", "You are a friendly chat bot.")
KINDS = ("introduction", "parity", "repeat", "last_word")


def _number(rng: random.Random, split: str) -> int:
    """A number from 10 to 999 whose tens are held out (one in five) exactly for the validation split."""
    while True:
        n = rng.randint(10, 999)
        if ((n // 10) % 5 == 2) == (split != "train"):
            return n


def conversation(kind: str, rng: random.Random, split: str) -> list[dict]:
    """One conversation of `kind` from the split's pools."""
    if kind == "introduction":
        name = rng.choice(NAMES)
        turns = [f"Hi, my name is {name}.", f"Nice to meet you, {name}!", "What is my name?", f"Your name is {name}."]
    elif kind == "parity":
        n = _number(rng, split)
        turns = [f"Is {n} even or odd?", f"{n} is {'odd' if n % 2 else 'even'}."]
    else:
        words = rng.sample(WORDS, 3)
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
