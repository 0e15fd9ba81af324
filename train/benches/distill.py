"""Peak memory of LLM knowledge distillation: the chunked loss against the full-logits form.

    python train/bench.py distill                        # vocab 32000, 4 x 256 tokens
    python train/bench.py distill --vocab 49152 --tokens 2048 --docs

One training step's loss and backward of a student (d_model --d-model) against a teacher (d_model
--teacher-d-model; its final hidden states computed without gradients first, as the LM task
does), both with --vocab tokens, on --tokens tokens: `chunked_distillation_loss` (the model's
train.chunked_loss, chunks of --chunk tokens) against `distillation_loss` on both models' full
logits (train.chunked_loss: false). Only the loss head is run (the part whose memory differs):
the student's hidden states are a leaf that requires gradients. Memory: the peak resident set
size each adds (harness.PeakRSS, a fresh allocation high-water mark per side, best of --rounds
alternating rounds), against the full (tokens, vocab) fp32 logits' size. The two losses agree
(printed).
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

from train.benches import harness  # noqa: E402
from train.benches.quantized import PAGE  # noqa: E402

DOCS_JSON = ROOT / "docs" / "deploy" / "distill.json"


def step(chunked: bool, h, w, y, th, tw, chunk: int) -> float:
    from zoo.blocks.chunked_ce import chunked_distillation_loss, distillation_loss
    if chunked:
        loss = chunked_distillation_loss(h, w, y, th, tw, 0.5, 2.0, chunk)
    else:
        loss = distillation_loss(h @ w.t(), th @ tw.t(), y, 0.5, 2.0)
    loss.backward()
    h.grad = w.grad = None
    return loss.item()


def table(data: dict) -> str:
    full = data["tokens"] * data["vocab"] * 4 / 2**20
    return harness.table_text(
        ["loss", "peak memory MiB (best round)", "against the full logits' size"],
        [[r["side"], f"{r['peak_mib']:.0f}", f"{r['peak_mib'] / full:.1f}x of {full:.0f} MiB"] for r in data["rows"]])


def render(data: dict, page: Path = PAGE, write: bool = True) -> list[str]:
    return ["distill-memory"] if harness.update_docs_table(page, "distill-memory", table(data), write) else []


def main(argv=None):
    p = harness.parser("distill", __doc__, precision="fp32")
    p.add_argument("--vocab", type=harness.positive_int, default=32000)
    p.add_argument("--tokens", type=harness.positive_int, default=1024)
    p.add_argument("--d-model", type=harness.positive_int, default=256)
    p.add_argument("--teacher-d-model", type=harness.positive_int, default=512)
    p.add_argument("--chunk", type=harness.positive_int, default=256)
    p.add_argument("--docs", action="store_true")
    p.set_defaults(rounds=3)
    args = p.parse_args(argv)
    harness.setup(args)
    g = torch.Generator().manual_seed(0)
    N, V = args.tokens, args.vocab
    h = torch.randn(N, args.d_model, generator=g).requires_grad_()
    w = (torch.randn(V, args.d_model, generator=g) * 0.02).requires_grad_()
    th, tw = torch.randn(N, args.teacher_d_model, generator=g), torch.randn(V, args.teacher_d_model, generator=g) * 0.02
    y = torch.randint(0, V, (N,), generator=g)
    peaks, losses = {"chunked": [], "full logits": []}, {}
    with harness.autocast(args.precision[0]):
        for _, side in harness.schedule(peaks, args.rounds):
            with harness.PeakRSS() as m:
                losses[side] = step(side == "chunked", h, w, y, th, tw, args.chunk)
            peaks[side].append(m.peak)
    if any(v is None for vs in peaks.values() for v in vs):
        print("peak RSS is unavailable on this platform")
        return 1
    print(f"losses: chunked {losses['chunked']:.6f}, full logits {losses['full logits']:.6f}")
    data = {"vocab": V, "tokens": N, "d_model": args.d_model, "teacher_d_model": args.teacher_d_model,
            "chunk": args.chunk, "precision": args.precision[0], "rounds": args.rounds, "losses": losses,
            "rows": [{"side": s, "peak_mib": min(v) / 2**20} for s, v in peaks.items()]}
    print(table(data))
    harness.write_results(data, Path("runs/bench-distill/distill.json"), DOCS_JSON if args.docs else None, render)
    return 0


if __name__ == "__main__":
    sys.exit(main())
