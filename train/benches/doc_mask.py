"""Document masking against plain causal attention: the training step's cost on a CPU.

    python train/bench.py doc-mask                 # the tiny preset's shape: batch 16 x 128, fp32, eager and compiled
    python train/bench.py doc-mask --precision bf16 --doc-len 32 --json doc_mask.json
    python train/bench.py doc-mask --seq 32 --batch 2 --rounds 2 --modes eager   # a smoke run

The model: Zoo's LLM with random weights at configs/llm/tiny.yaml's shape (d_model 256, 4 layers,
4 heads / 2 kv heads, vocab 2048). Sides, in each mode (eager, torch.compile): `causal` (the
plain causal step, backend auto), `doc-bmm` and `doc-sdpa` (doc_ids and restarting positions, the
document mask through the batched-matmul path or through torch's SDPA with a boolean mask). The
documents: lengths drawn from a geometric distribution of mean `--doc-len` tokens, laid end to end
along each row. Training step = forward + loss + backward + AdamW + zero_grad (train/benches/llm_moe.py's
TrainSide). FlexAttention is not a side: torch has no CPU backward for it.

Timing (train/benches/harness.py): a warm-up per side (compilation included), then `--rounds` rounds in
which the sides alternate; the figure is the paired median of how many times faster each document side runs than `causal` of
its mode. `--json PATH` writes the numbers.
"""
from __future__ import annotations

import copy
import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

from train.benches import harness  # noqa: E402
from train.benches.llm_moe import TrainSide, time_training  # noqa: E402

MODES = ("eager", "compile")
SIDES = {"causal": "auto", "doc-bmm": "bmm", "doc-sdpa": "sdpa"}  # side -> attention backend


def random_documents(batch: int, seq: int, mean_len: float, seed: int = 0) -> torch.Tensor:
    """doc_ids (batch, seq): documents of geometric lengths (mean `mean_len`) end to end along each row."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.rand(batch, seq, generator=g) < 1.0 / mean_len
    return starts.long().cumsum(1)


def main(argv=None):
    from zoo.blocks.attention import set_backend
    from zoo.blocks.attention_docs import document_positions
    from zoo.config import LLMConfig
    from zoo.llm import LLM
    ap = harness.parser("doc-mask", __doc__, precision="fp32", keep_memory=True)
    ap.add_argument("--seq", type=harness.positive_int, default=128)
    ap.add_argument("--batch", type=harness.positive_int, default=16)
    ap.add_argument("--doc-len", type=float, default=64.0, help="mean document length in tokens")
    ap.add_argument("--modes", type=harness.name_list(MODES, "mode"), default=",".join(MODES),
                    help="comma list of " + ", ".join(MODES))
    ap.add_argument("--warmup", type=int, default=1, help="untimed training steps per side (+2 when compiled)")
    ap.add_argument("--steps", type=harness.positive_int, default=2, help="timed training steps per side and round")
    ap.add_argument("--json", default=None, help="write the numbers to this JSON file")
    args = ap.parse_args(argv)
    kept = harness.setup(args)
    torch.manual_seed(0)
    base = LLM(LLMConfig(vocab_size=2048, d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=args.seq,
                         tie_embeddings=True))
    ids = torch.randint(0, 2048, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(0))
    doc = random_documents(args.batch, args.seq, args.doc_len)
    docs = {"doc_ids": doc, "position_ids": document_positions(doc)}
    n_docs = int((doc[:, -1] + 1).sum())
    print(f"doc-mask: d_model 256, 4 layers, 4 heads / 2 kv, vocab 2048; batch {args.batch} x seq {args.seq}, "
          f"{n_docs} documents (mean length {args.batch * args.seq / n_docs:.1f}); torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, freed memory {'kept' if kept else 'returned to the OS'}", flush=True)

    def causal_step(fwd, ids):
        return fwd(ids[:, :-1], targets=ids[:, 1:])[1]

    def doc_step(fwd, ids):
        return fwd(ids[:, :-1], targets=ids[:, 1:], **docs)[1]

    results = {"args": vars(args), "documents": n_docs, "tables": {}}
    tokens = args.batch * args.seq
    for prec in args.precision:
        sides = {}
        for mode in args.modes:
            for name, backend in SIDES.items():
                model = copy.deepcopy(base)
                set_backend(model, backend)
                sides[f"{name}-{mode}"] = TrainSide(model, causal_step if name == "causal" else doc_step,
                                                    mode == "compile")
        rounds, _ = time_training(sides, prec, ids, args, torch.device("cpu"))
        print(f"\nTraining step ({args.batch} x {args.seq} tokens; forward, loss, backward, AdamW), {prec}")
        rows, table = [], {}
        for n in rounds.wall:
            med = statistics.median(rounds.times(n))
            mode = n.rsplit("-", 1)[1]
            vs = "" if n.startswith("causal") else str(rounds.paired(n, f"causal-{mode}"))
            rows.append([n, f"{rounds.best(n):.3f}", f"{med:.3f}", f"{tokens / rounds.best(n):.0f}", vs])
            table[n] = {"best_s": rounds.best(n), "median_s": med, "times_s": rounds.times(n),
                        "speed_vs_causal_paired_median": None if not vs else rounds.paired(n, f"causal-{mode}").median}
        harness.print_table(["side", "best round s", "median s", "tokens/s (best)", "speed vs causal (paired median, range)"],
                            rows)
        for mode in args.modes:  # the two masks head to head
            print(f"{prec} {mode}: {rounds.summary(f'doc-sdpa-{mode}', f'doc-bmm-{mode}')}")
            table[f"sdpa_vs_bmm_{mode}_paired_median"] = rounds.paired(f"doc-sdpa-{mode}", f"doc-bmm-{mode}").median
        results["tables"][prec] = table
        del sides
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
