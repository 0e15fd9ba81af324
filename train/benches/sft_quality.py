"""What chat fine-tuning on the embedded conversations taught: held-out answers before and after.

    python train/bench.py sft-quality                              # runs/tiny against runs/tiny-sft
    python train/bench.py sft-quality --base runs/tiny --runs runs/a,runs/b --json sft_quality.json

For each model (the base, then each fine-tuned run folder), the greedy answer to the last turn of
`--conversations` validation conversations of the embedded set (train/data/chat_example.py: new
combinations of names and words, numbers whose tens training never saw), in the run's chat
template (the base: the built-in ChatML, as the fine-tuning used), compared with the reference
(exact match, whitespace at the ends aside): the fraction per kind of conversation and over all.
Chance: the parity word alone is right half the time, but the answer must also repeat the number.
With several runs (seeds), the mean and a 95% interval (Student's t) over them.
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

from train.benches import harness  # noqa: E402


def scores(model, tokenizer, template, conversations) -> dict:
    from train.chat import ChatSession
    from train.data.chat_example import KINDS
    chat = ChatSession(model, tokenizer, template, max_new_tokens=40)
    hits = {k: [] for k in KINDS}
    for i, c in enumerate(conversations):
        last = max(j for j, m in enumerate(c) if m["role"] == "assistant")
        hits[KINDS[i % len(KINDS)]].append(chat.respond(c[:last]).strip() == c[last]["content"].strip())
    out = {k: sum(v) / len(v) for k, v in hits.items()}
    out["all"] = sum(sum(v) for v in hits.values()) / len(conversations)
    return out


def main(argv=None):
    from train.chat import load
    from train.data.chat_example import conversations
    ap = harness.parser("sft-quality", __doc__, precision=None, rounds=False)
    ap.add_argument("--base", default=str(ROOT / "runs" / "tiny"), help="the model before fine-tuning")
    ap.add_argument("--runs", default=str(ROOT / "runs" / "tiny-sft"), help="comma list of fine-tuned run folders")
    ap.add_argument("--conversations", type=harness.positive_int, default=200)
    ap.add_argument("--precision", type=harness.precision_name, default="fp32", help="the models' dtype when answering")
    ap.add_argument("--json", default=None, help="write the numbers to this JSON file")
    args = ap.parse_args(argv)
    harness.setup(args)
    convs = conversations("val", args.conversations)
    dtype = str(harness.PRECISIONS[args.precision]).removeprefix("torch.")  # train.precision's name -> float32 ...
    results = {"base": scores(*load(args.base, dtype=dtype), convs)}  # a folder without a template: ChatML
    for run in args.runs.split(","):
        results[run] = scores(*load(run, dtype=dtype), convs)
    kinds = list(results["base"])
    print(f"sft-quality: exact match of the greedy answers to {args.conversations} held-out conversations of the "
          f"embedded set; torch {torch.__version__}")
    harness.print_table(["model"] + kinds, [[name] + [f"{100 * r[k]:.1f}%" for k in kinds] for name, r in results.items()])
    runs = [r for n, r in results.items() if n != "base"]
    if len(runs) >= 2:
        t = {2: 12.706, 3: 4.303, 4: 3.182, 5: 2.776, 6: 2.571}.get(len(runs), 2.0)  # Student's t, 97.5%
        row = []
        for k in kinds:
            v = [r[k] for r in runs]
            half = t * statistics.stdev(v) / len(v) ** 0.5
            row.append(f"{100 * statistics.mean(v):.1f}% +- {100 * half:.1f}")
        harness.print_table(["runs: mean, 95% interval"] + kinds, [[f"{len(runs)} runs"] + row])
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
