"""LLM training step: Zoo's LLM against transformers' LlamaForCausalLM of the same shape.

    python train/bench.py llm-train            # 37.5M deep-thin: d_model 384, 16 layers, 6 heads on 2 kv heads,
                                               # vocab 32000, batch 4 x 512 tokens
    python train/bench.py llm-train --d-model 512 --n-layers 8 --n-heads 8 --n-kv-heads 0 --seq 256 --batch 8
                                               # 42.1M, 8 layers, MHA (0: as many kv heads as heads), 8 x 256
    python train/bench.py llm-train --precision bf16 --modes compile --rounds 6

The default shape is a deep-thin one (MobileLLM, Liu et al. 2024; SmolLM-135M's proportions)
at 37.5M parameters with a 512-token context: the kind of small model this CPU trains.

One training step = forward + loss + backward + AdamW step (fused where the device supports
it, for both sides) + zero_grad(set_to_none). Zoo is used the way train/loop.py uses it
(`model(x, targets)` with the chunked loss, the loop's optimizer with its parameter groups);
transformers the way its users do (`model(input_ids, labels=input_ids).loss`, sdpa attention).
Both have the same weights shape (tied embeddings by default), batch, sequence length and
precision (fp32, or bf16 autocast with fp32 master weights, as the loop runs it).

Timing: after warm-up steps (which include compilation in 'compile' mode) the two sides are
timed in alternating order, `rounds` times `steps` steps each, and each side's best round is
reported (the machine may be shared: the best round is the least disturbed one). The progress
lines and the summary also give the median over rounds of the paired ratio (the two sides'
back-to-back times in the same round) with its range: the figure least moved by a slow spell.
MFU = achieved model FLOP/s / the FLOP/s of a 2048^3 matmul in the same dtype measured in this
run (the best of measurements taken between the rounds; on a busy machine that peak can still
be underestimated, which shows as an MFU that is too high). Model FLOPs per token: 6 * matmul parameters +
12 * layers * d_model * seq (PaLM's formula; the same count for both sides).
Peak memory: the process's resident set size is sampled every 2 ms by a thread while a side
runs one untimed step after its warm-up; the table shows the peak minus the RSS just before
(memory returned to the OS first with malloc_trim), i.e. what the step adds on top of weights
and optimizer state that are already resident: activations, gradients, logits, temporaries.

Allocator: like train/loop.py (`train.cpu_keep_memory`, on by default) the benchmark first keeps
freed memory in the process (glibc: no mmap, no trim), for both sides alike: otherwise every
step page-faults its large tensors in afresh (~150-220k faults a step at the default shape),
which costs both sides 15-40% and most of the run-to-run noise. `--no-keep-memory` turns it off.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def _rss() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096
    except OSError:  # not Linux: fall back to psutil when present
        import psutil
        return psutil.Process().memory_info().rss


def _trim():
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class PeakRSS:
    """Context manager: peak RSS above the level at entry, sampled by a background thread."""

    def __init__(self, every: float = 0.002):
        self.every, self.peak = every, 0

    def __enter__(self):
        _trim()
        self.base = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss() - self.base)
            time.sleep(self.every)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss() - self.base)


def build_pair(args):
    """The Zoo LLM and a LlamaForCausalLM of the same shape, both fp32 on CPU."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from zoo.config import LLMConfig
    from zoo.llm import LLM

    torch.manual_seed(0)
    zcfg = LLMConfig(vocab_size=args.vocab, d_model=args.d_model, n_layers=args.n_layers, n_heads=args.n_heads,
                     n_kv_heads=args.n_kv_heads or None, max_seq_len=args.seq, tie_embeddings=not args.untied,
                     chunked_loss=not args.no_chunked_loss, loss_chunk_size=args.loss_chunk)
    zoo_model = LLM(zcfg)
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

    def step(self, mode, dtype, ids):
        fwd = self.fn(mode)
        ctx = torch.autocast("cpu", dtype=dtype) if dtype is not None else torch.autocast("cpu", enabled=False)
        with ctx:
            loss = self.step_fn(fwd, ids)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()


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


def matmul_peak(dtype, n=2048, seconds=0.5) -> float:
    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)
    a @ b
    reps, t0 = 0, time.perf_counter()
    while reps < 3 or time.perf_counter() - t0 < seconds:
        a @ b
        reps += 1
    return 2 * n ** 3 * reps / (time.perf_counter() - t0)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="bench.py llm-train", description=__doc__.split("\n")[0])
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
    ap.add_argument("--precision", default="bf16,fp32", help="comma list of bf16, fp16, fp32")
    ap.add_argument("--modes", default="eager,compile", help="comma list of eager, compile")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps per side and setting (+2 when compiled)")
    ap.add_argument("--steps", type=int, default=1, help="timed steps per round")
    ap.add_argument("--rounds", type=int, default=5, help="alternating zoo / transformers rounds")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    ap.add_argument("--no-keep-memory", action="store_true",
                    help="leave glibc's default (mmap and unmap large blocks) instead of the loop's cpu_keep_memory")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from train.hardware import keep_freed_memory
    kept = False if args.no_keep_memory else keep_freed_memory()
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}
    precisions = [p.strip() for p in args.precision.split(",") if p.strip()]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for p in precisions:
        if p not in dtypes:
            ap.error(f"--precision: unknown {p!r} (choose from {', '.join(dtypes)})")
    for m in modes:
        if m not in ("eager", "compile"):
            ap.error(f"--modes: unknown {m!r} (choose from eager, compile)")

    sides = make_sides(args)
    zoo_model = sides[0].model
    n_params = zoo_model.num_params()
    tokens = args.batch * args.seq
    flops_tok = zoo_model.flops_per_token(args.seq)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
    print(f"llm-train: {n_params / 1e6:.1f}M params (d_model {args.d_model}, {args.n_layers} layers, "
          f"{args.n_heads} heads, kv {zoo_model.config.resolved_n_kv_heads}, ffn {zoo_model.config.resolved_ffn_hidden}, vocab {args.vocab}, "
          f"{'untied' if args.untied else 'tied'}), batch {args.batch} x seq {args.seq}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"freed memory {'kept (cpu_keep_memory)' if kept else 'returned to the OS'}")

    rows = []
    for prec in precisions:
        dtype = dtypes[prec]
        peak = matmul_peak(dtype or torch.float32)
        for mode in modes:
            res = {s.name: {"times": [], "mem": 0, "loss": None} for s in sides}
            for s in sides:  # warm-up (compilation happens here)
                t0 = time.perf_counter()
                for _ in range(args.warmup + (2 if mode == "compile" else 0)):
                    s.step(mode, dtype, ids)
                res[s.name]["warmup_s"] = time.perf_counter() - t0
                with PeakRSS() as mem:  # an untimed step: the trim before it would page-fault a timed one
                    s.step(mode, dtype, ids)
                res[s.name]["mem"] = mem.peak
            for r in range(args.rounds):
                order = sides if r % 2 == 0 else sides[::-1]
                for s in order:
                    t0 = time.perf_counter()
                    for _ in range(args.steps):
                        loss = s.step(mode, dtype, ids)
                    float(loss)
                    res[s.name]["times"].append((time.perf_counter() - t0) / args.steps)
                    res[s.name]["loss"] = float(loss)
                peak = max(peak, matmul_peak(dtype or torch.float32))  # best of many: the least disturbed
            for s in sides:
                best = min(res[s.name]["times"])
                rows.append(dict(prec=prec, mode=mode, side=s.name, step_s=best, tok_s=tokens / best,
                                 median_s=sorted(res[s.name]["times"])[len(res[s.name]["times"]) // 2],
                                 mem=res[s.name]["mem"], warmup=res[s.name]["warmup_s"], loss=res[s.name]["loss"]))
            z, h = rows[-2], rows[-1]
            paired = sorted(b / a for a, b in zip(res["zoo"]["times"], res["transformers"]["times"]))
            z["paired"] = (statistics.median(paired), paired[0], paired[-1])
            print(f"  {prec} {mode}: zoo {z['tok_s']:.0f} tok/s, transformers {h['tok_s']:.0f} tok/s, "
                  f"ratio {z['tok_s'] / h['tok_s']:.2f} (paired rounds: median {z['paired'][0]:.2f}, "
                  f"range {paired[0]:.2f}-{paired[-1]:.2f})", flush=True)
        for r in rows:
            if r["prec"] == prec:
                r["mfu"] = r["tok_s"] * flops_tok / peak
                r["peak"] = peak

    print()
    print(f"{'precision':<9} {'mode':<8} {'model':<13} {'step s':>7} {'tokens/s':>9} {'vs tf eager':>11} "
          f"{'zoo/tf':>7} {'MFU':>6} {'peak TF/s':>9} {'+RSS GiB':>8} {'warm-up s':>9} {'loss':>6}")
    for r in rows:
        ref_eager = next((x for x in rows if x["prec"] == r["prec"] and x["mode"] == "eager"
                          and x["side"] == "transformers"), None)
        same = next(x for x in rows if x["prec"] == r["prec"] and x["mode"] == r["mode"] and x["side"] == "transformers")
        print(f"{r['prec']:<9} {r['mode']:<8} {r['side']:<13} {r['step_s']:>7.3f} {r['tok_s']:>9.0f} "
              f"{(r['tok_s'] / ref_eager['tok_s'] if ref_eager else float('nan')):>10.2f}x "
              f"{r['tok_s'] / same['tok_s']:>6.2f}x {100 * r['mfu']:>5.1f}% {r['peak'] / 1e12:>9.3f} "
              f"{r['mem'] / 2**30:>8.2f} {r['warmup']:>9.1f} {r['loss']:>6.2f}")
    print()
    for prec in precisions:
        z = max((r for r in rows if r["prec"] == prec and r["side"] == "zoo"), key=lambda r: r["tok_s"])
        h = max((r for r in rows if r["prec"] == prec and r["side"] == "transformers"), key=lambda r: r["tok_s"])
        same = [r for r in rows if r["prec"] == prec and r["side"] == "zoo" and r["mode"] == h["mode"]]
        paired = f"; paired rounds in {h['mode']} mode: median {same[0]['paired'][0]:.2f}x" if same else ""
        print(f"{prec}: best zoo ({z['mode']}) / best transformers ({h['mode']}) = {z['tok_s'] / h['tok_s']:.2f}x{paired}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
