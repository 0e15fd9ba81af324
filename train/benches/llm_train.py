"""LLM training step: Zoo's LLM against transformers' LlamaForCausalLM of the same shape.

    python train/bench.py llm-train            # deep-thin: d_model 384, 16 layers, 6 heads on 2 kv heads,
                                               # vocab 32000, batch 4 x 512 tokens
    python train/bench.py llm-train --d-model 512 --n-layers 8 --n-heads 8 --n-kv-heads 0 --seq 256 --batch 8
                                               # 8 layers, MHA (0: as many kv heads as heads), 8 x 256
    python train/bench.py llm-train --precision bf16 --modes compile --rounds 8

The default shape is a deep-thin one (MobileLLM, Liu et al. 2024; SmolLM-135M's proportions)
with a 512-token context: the kind of small model a CPU trains.

One training step = forward + loss + backward + AdamW step (fused where the device supports
it, for both sides) + zero_grad(set_to_none). Zoo is used the way train/loop.py uses it
(`model(x, targets)` with the chunked loss, the loop's optimizer with its parameter groups);
transformers the way its users do (`model(input_ids, labels=input_ids).loss`, sdpa attention).
Both have the same weights shape (tied embeddings by default), batch, sequence length and
precision (fp32, or bf16 / fp16 autocast with fp32 master weights, as the loop runs it).

Timing (train/benches/harness.py): after warm-up steps (which include compilation in 'compile'
mode) the two sides alternate, `--rounds` rounds of `--steps` steps each; the table gives each
side's best round and the median over rounds of the paired ratio with its range.
MFU = achieved model FLOP/s / `train.hardware.measure_peak_flops` in the same dtype, the loop's
own MFU denominator, here the best of the calls made between the rounds (on a busy machine the
peak can still be underestimated, which shows as an MFU that is too high). Model FLOPs per token:
6 * matmul parameters + 12 * layers * d_model * seq (PaLM's formula; the same count for both sides).
Peak memory (harness.PeakRSS): the process's resident set size sampled by a thread while a side
runs one untimed step after its warm-up; the table shows the peak minus the RSS just before
(memory returned to the OS first with malloc_trim), i.e. what the step adds on top of weights
and optimizer state that are already resident: activations, gradients, logits, temporaries.

Allocator: like train/loop.py (`train.cpu_keep_memory`, on by default) the benchmark first keeps
freed memory in the process (glibc: no mmap, no trim), for both sides alike: otherwise every
step page-faults its large tensors in afresh, which slows both sides and adds most of the
run-to-run noise (docs/llm.md, "Training speed", has the numbers). `--no-keep-memory` turns it off.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from train.benches import harness  # noqa: E402


def build_pair(args):
    """The Zoo LLM and a LlamaForCausalLM of the same shape, both fp32 on CPU."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from zoo.config import LLMConfig
    from zoo.llm import LLM

    torch.manual_seed(0)
    zcfg = LLMConfig(vocab_size=args.vocab, d_model=args.d_model, n_layers=args.n_layers, n_heads=args.n_heads,
                     n_kv_heads=args.n_kv_heads or None, max_seq_len=args.seq, tie_embeddings=not args.untied)
    zoo_model = LLM(zcfg)
    zoo_model.chunked_loss, zoo_model.loss_chunk_size = not args.no_chunked_loss, args.loss_chunk
    hcfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.d_model, intermediate_size=zcfg.resolved_ffn_hidden,
                       num_hidden_layers=args.n_layers, num_attention_heads=args.n_heads,
                       num_key_value_heads=zcfg.resolved_n_kv_heads, max_position_embeddings=args.seq,
                       rms_norm_eps=zcfg.norm_eps, tie_word_embeddings=not args.untied,
                       attn_implementation="sdpa")
    hf_model = LlamaForCausalLM(hcfg)
    n_zoo = zoo_model.num_params()
    n_hf = sum(p.numel() for p in hf_model.parameters())
    if n_zoo != n_hf:
        raise RuntimeError(f"parameter counts differ: zoo {n_zoo}, transformers {n_hf}")
    return zoo_model.train(), hf_model.train()


class Side:
    """One model, its optimizer and its train step (eager or compiled)."""

    def __init__(self, name, model, optimizer, step_fn):
        self.name, self.model, self.optimizer, self.step_fn = name, model, optimizer, step_fn
        self.compiled = None

    def fn(self, mode):
        if mode == "compile":
            if self.compiled is None:
                self.compiled = torch.compile(self.model)
            return self.compiled
        return self.model

    def step(self, mode, precision, ids):
        fwd = self.fn(mode)
        with harness.autocast(precision):
            loss = self.step_fn(fwd, ids)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.loss = loss.detach()


def make_sides(args):
    from train.config import OptimConfig
    from train.optim import build_optimizer

    zoo_model, hf_model = build_pair(args)
    cpu = torch.device("cpu")
    zoo_opt = build_optimizer(zoo_model, OptimConfig(), cpu, log=lambda *a: None)
    hf_opt = torch.optim.AdamW(hf_model.parameters(), lr=zoo_opt.defaults["lr"], fused=True)

    def zoo_step(fwd, ids):  # the LM task: inputs ids[:, :-1], targets ids[:, 1:]
        return fwd(ids[:, :-1], targets=ids[:, 1:])[1]

    def hf_step(fwd, ids):  # transformers shifts the labels itself
        return fwd(input_ids=ids[:, :-1], labels=ids[:, :-1]).loss

    return [Side("zoo", zoo_model, zoo_opt, zoo_step), Side("transformers", hf_model, hf_opt, hf_step)]


def main(argv=None):
    ap = harness.parser("llm-train", __doc__, precision="bf16,fp32", keep_memory=True)
    ap.add_argument("--d-model", type=int, default=384)
    ap.add_argument("--n-layers", type=int, default=16)
    ap.add_argument("--n-heads", type=int, default=6)
    ap.add_argument("--n-kv-heads", type=int, default=2, help="0: n_heads (MHA)")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--untied", action="store_true", help="separate lm_head (default: tied embeddings)")
    ap.add_argument("--no-chunked-loss", action="store_true", help="Zoo: plain cross-entropy on full logits")
    ap.add_argument("--loss-chunk", type=int, default=2048, help="Zoo: tokens per loss chunk")
    ap.add_argument("--modes", type=harness.name_list(("eager", "compile"), "mode"), default="eager,compile",
                    help="comma list of eager, compile")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps per side and setting (+2 when compiled)")
    ap.add_argument("--steps", type=harness.positive_int, default=1, help="timed steps per round")
    args = ap.parse_args(argv)
    kept = harness.setup(args)

    sides = make_sides(args)
    zoo_model = sides[0].model
    cpu = torch.device("cpu")
    tokens = args.batch * args.seq
    flops_tok = zoo_model.flops_per_token(args.seq)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
    print(f"llm-train: {zoo_model.num_params() / 1e6:.1f}M params (d_model {args.d_model}, {args.n_layers} layers, "
          f"{args.n_heads} heads, kv {zoo_model.config.resolved_n_kv_heads}, ffn {zoo_model.config.resolved_ffn_hidden}, "
          f"vocab {args.vocab}, {'untied' if args.untied else 'tied'}), batch {args.batch} x seq {args.seq}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"freed memory {'kept (cpu_keep_memory)' if kept else 'returned to the OS'}; "
          f"{args.rounds} alternating rounds of {args.steps} step(s)")

    results = {}  # (precision, mode) -> harness.Rounds, with the setting's warm-up, memory and loss
    peaks = {}
    for prec in args.precision:
        peaks[prec] = harness.best_peak_flops(cpu, prec)
        for mode in args.modes:
            warmup, mem = {}, {}
            for s in sides:  # warm-up (compilation happens here)
                t0 = time.perf_counter()
                for _ in range(args.warmup + (2 if mode == "compile" else 0)):
                    s.step(mode, prec, ids)
                warmup[s.name] = time.perf_counter() - t0
                with harness.PeakRSS() as m:  # an untimed step: the trim before it would page-fault a timed one
                    s.step(mode, prec, ids)
                mem[s.name] = m.peak

            def between(r, prec=prec):
                peaks[prec] = harness.best_peak_flops(cpu, prec, peaks[prec])

            rounds = harness.run_rounds({s.name: (lambda s=s: s.step(mode, prec, ids)) for s in sides},
                                        args.rounds, calls=args.steps, between=between)
            results[prec, mode] = (rounds, warmup, mem, {s.name: float(s.loss) for s in sides})
            z, h = (tokens / rounds.best(n) for n in ("zoo", "transformers"))
            print(f"  {prec} {mode}: zoo {z:.0f} tok/s, transformers {h:.0f} tok/s; "
                  f"{rounds.summary('zoo', 'transformers')}", flush=True)

    print()
    rows = []
    for (prec, mode), (rounds, warmup, mem, loss) in results.items():
        ref_eager = results.get((prec, "eager"), (None,))[0]
        for name in ("zoo", "transformers"):
            tok_s = tokens / rounds.best(name)
            vs_eager = f"{ref_eager.best('transformers') / rounds.best(name):.2f}x" if ref_eager else ""
            zoo_row = name == "zoo"
            rows.append([prec, mode, name, f"{rounds.best(name):.3f}", f"{tok_s:.0f}", vs_eager,
                         f"{rounds.ratio('zoo', 'transformers'):.2f}x" if zoo_row else "",
                         str(rounds.paired("zoo", "transformers")) if zoo_row else "",
                         f"{100 * tok_s * flops_tok / peaks[prec]:.1f}%", f"{peaks[prec] / 1e12:.3f}",
                         harness.gib(mem[name]), f"{warmup[name]:.1f}", f"{loss[name]:.2f}"])
    harness.print_table(["precision", "mode", "model", "best step s", "tokens/s", "vs transformers eager",
                         "zoo / transformers, best rounds", "paired median (range)", "MFU", "peak TFLOP/s", "+RSS GiB",
                         "warm-up s", "loss"], rows)
    print()
    for prec in args.precision:
        best = {name: min(((results[prec, m][0].best(name), m) for m in args.modes)) for name in ("zoo", "transformers")}
        (tz, mz), (th, mh) = best["zoo"], best["transformers"]
        print(f"{prec}: best zoo ({mz}) / best transformers ({mh}) = {th / tz:.2f}x; paired rounds in {mh} mode: "
              f"median {results[prec, mh][0].paired('zoo', 'transformers')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
