"""Packed against padded rows for chat fine-tuning: padding waste and training tokens/s on the
embedded conversation set.

    python train/bench.py sft-packing                       # 256 conversations, batch 16, rows of 256 tokens
    python train/bench.py sft-packing --conversations 64 --rounds 2 --json sft_packing.json

The data: the first `--conversations` training conversations of the embedded set
(train/data/chat_example.py) in the built-in ChatML template, tokenised with the embedded
default's tokenizer when runs/tiny exists (`--tokenizer`), else bytes. Sides, each one pass over
those conversations (forward, loss on the assistant's tokens, backward, AdamW) with its own copy
of a random LLM of configs/llm/tiny.yaml's shape:
- `packed`: `--batch` rows of `--seq` tokens holding several conversations each (best-fit
  decreasing), attention within each conversation and positions restarting (doc_ids,
  position_ids); fewer rows than conversations;
- `padded-bucketed`: one conversation per row, `--batch` rows padded to their longest, rows of
  similar length together (data.bucket_batches, the default);
- `padded-random`: the same in random batches (data.bucket_batches=1).
The table: rows and padding per pass, the best and median seconds per pass, real (unpadded)
tokens per second, and each side's real tokens/s against `padded-bucketed`'s (the paired median
over rounds, train/benches/harness.py). A pass's last batch is filled from its start, so the
sides' passes may hold slightly different numbers of tokens; the speeds count them. `--json PATH`
writes the numbers.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

from train.benches import harness  # noqa: E402

SIDES = {"packed": dict(pack=True), "padded-bucketed": dict(pack=False), "padded-random": dict(pack=False,
                                                                                              bucket_batches=1)}


def main(argv=None):
    from train.config import OptimConfig
    from train.data import ByteTokenizer, load_tokenizer_file
    from train.data.chat_data import ChatData
    from train.data.chat_example import conversations
    from train.data.conversations import ChatDataConfig, ChatTemplate
    from train.optim import build_optimizer
    from zoo.config import LLMConfig
    from zoo.llm import LLM
    ap = harness.parser("sft-packing", __doc__, precision="fp32", keep_memory=True)
    ap.add_argument("--conversations", type=harness.positive_int, default=256)
    ap.add_argument("--batch", type=harness.positive_int, default=16, help="rows per micro-batch")
    ap.add_argument("--seq", type=harness.positive_int, default=256, help="tokens per packed row (data.seq_len)")
    ap.add_argument("--tokenizer", default=str(ROOT / "runs" / "tiny" / "tokenizer.model"),
                    help="a tokenizer file (bytes when it does not exist)")
    ap.add_argument("--json", default=None, help="write the numbers to this JSON file")
    args = ap.parse_args(argv)
    kept = harness.setup(args)
    tok = load_tokenizer_file(args.tokenizer) if Path(args.tokenizer).is_file() else ByteTokenizer()
    rows = [(m, ("synthetic", i + 1)) for i, m in enumerate(conversations("train", args.conversations))]
    base_cfg = ChatDataConfig(seq_len=args.seq)
    torch.manual_seed(0)
    base = LLM(LLMConfig(vocab_size=max(2048, tok.vocab_size), d_model=256, n_layers=4, n_heads=4, n_kv_heads=2,
                         max_seq_len=args.seq, tie_embeddings=True))
    template = ChatTemplate.builtin("chatml")
    sides, info = {}, {}
    for name, keys in SIDES.items():
        data = ChatData(rows, rows[:1], tok, template, dataclasses.replace(base_cfg, **keys), log=lambda m: None)
        per_epoch = len(data._epoch_batches(0, args.batch))
        batches = [data.batch(i, args.batch) for i in range(per_epoch)]
        cells = sum(x.numel() for x, *_ in batches)
        real = sum(n for _, _, n, _ in batches)
        info[name] = {"rows": sum(x.shape[0] for x, *_ in batches), "padding": 1 - real / cells, "tokens": real}
        model = copy.deepcopy(base).train()
        opt = build_optimizer(model, OptimConfig(), torch.device("cpu"), log=lambda *a: None)

        def one_pass(model=model, opt=opt, batches=batches):
            for x, y, _, docs in batches:
                with harness.autocast(args.precision[0]):
                    loss = model(x, y, **docs)[1]
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        sides[name] = one_pass
    print(f"sft-packing: {args.conversations} conversations of the embedded set, tokenizer "
          f"{getattr(tok, 'model_path', None) or 'bytes'}, batch {args.batch}, rows of {args.seq} tokens when packed; "
          f"model of configs/llm/tiny.yaml's shape; {args.precision[0]}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, freed memory {'kept' if kept else 'returned to the OS'}", flush=True)
    for fn in sides.values():  # warm-up
        fn()
    rounds = harness.run_rounds(sides, args.rounds)
    table, out = [], {}
    ref = info["padded-bucketed"]["tokens"]
    for name in sides:  # tokens/s against tokens/s: a pass may hold more tokens (a last batch filled from the start)
        p = rounds.paired(name, "padded-bucketed")
        paired = harness.Paired(*(v * info[name]["tokens"] / ref for v in p))
        med = statistics.median(rounds.times(name))
        i = info[name]
        table.append([name, str(i["rows"]), f"{100 * i['padding']:.1f}%", f"{rounds.best(name):.2f}", f"{med:.2f}",
                      f"{i['tokens'] / rounds.best(name):.0f}", "-" if name == "padded-bucketed" else str(paired)])
        out[name] = {**i, "best_s": rounds.best(name), "median_s": med, "times_s": rounds.times(name),
                     "speed_vs_padded_bucketed_paired_median": paired.median}
    print(f"\nOne pass over {args.conversations} conversations: forward, loss, backward, AdamW")
    harness.print_table(["side", "rows", "padding", "best s", "median s", "real tokens/s (best)",
                         "tokens/s vs padded-bucketed (paired median, range)"], table)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "sides": out}, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
