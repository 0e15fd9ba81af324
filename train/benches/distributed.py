"""DDP against FSDP2 at 2 processes, and both against 1 process: per-rank memory and step time.

    python train/bench.py distributed                  # the 100M-parameter LLM below, 3 rounds
    python train/bench.py distributed --steps 3 --rounds 2 --nproc 2

A ~100M-parameter LLM (d_model 768, 12 layers, vocab 32000, tied embeddings) trains with AdamW
(fp32 weights; `--precision bf16`: autocast, and FSDP2 gathers bf16 parameters) on one global batch per step (`--batch` sequences of `--seq-len` tokens: one process
takes all of it, each of the N processes 1/N, drawn as the loop draws them). Each side is one
launch: `python -m torch.distributed.run --standalone --nproc-per-node N` for DDP and FSDP2
(train/distributed.py's wrapping, gloo on the CPU, the loop's optimizer_step with its no_sync
and cross-rank agreement), a plain process for 1 process; the sides alternate round by round,
their order reversed every other round.

Memory, per rank, counted from the tensors themselves (a rank's own part of a sharded tensor):
parameters, gradients (at the optimizer step, before they are freed) and optimizer state
(after the step); plus the peak resident set size of the rank's process (torch's own runtime,
activations, DDP's gradient buckets and FSDP2's gathered units included). Step time: seconds
per optimizer step after `--warmup` steps, median of the side's rounds, and the paired ratio
against 1 process (median over rounds, with the range). The 1-process side runs with N
threads, each rank of the N-process sides with one: the same cores for every side.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from train.benches import harness  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MODEL = {"vocab_size": 32000, "d_model": 768, "n_layers": 12, "n_heads": 12, "n_kv_heads": 4, "max_seq_len": 128}
SIDES = ("1 process", "ddp", "fsdp")


def _local_bytes(t) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def worker(strategy: str, steps: int, warmup: int, batch: int, seq_len: int, precision: str) -> dict:
    """One side's run in this process (a rank under torchrun): its memory and seconds per step."""
    import resource

    import torch

    import zoo
    from train.config import OptimConfig
    from train.distributed import Parallel, launch_env
    from train.step import optimizer_step
    from train.optim import build_optimizer
    from zoo.config import model_config_from

    par = Parallel(strategy, launch_env())
    device = torch.device("cpu")
    par.init(device)
    try:
        torch.manual_seed(0)
        model = zoo.build(model_config_from(dict(MODEL, max_seq_len=seq_len), "llm", "bench"))
        model, fwd = par.wrap(model, precision, False, False, device, lambda m: None)
        fwd = fwd or model
        optimizer = build_optimizer(model, OptimConfig(lr=1e-4), device, log=lambda m: None)
        grads = []
        optimizer.register_step_pre_hook(lambda opt, a, k: grads.append(
            sum(_local_bytes(p.grad) for g in opt.param_groups for p in g["params"] if p.grad is not None)))
        scaler = torch.amp.GradScaler("cpu", enabled=False)
        params = [p for p in model.parameters() if p.requires_grad]
        B = batch // par.world

        def step(s):
            g = torch.Generator().manual_seed(s)
            x = torch.randint(MODEL["vocab_size"], (batch, seq_len + 1), generator=g)[par.rank * B:(par.rank + 1) * B]
            return optimizer_step(lambda b: (fwd(b[:, :-1], b[:, 1:])[1], B * seq_len), iter([x]), 1, optimizer,
                                  scaler, params, 1.0, lambda: harness.autocast(precision), no_sync=(lambda last: par.no_sync(fwd, last)) if par.active
                                  else None, agree=(lambda st: par.agree(st, False)[0]) if par.active else None)

        for s in range(warmup):
            step(s)
        par.barrier()
        t0 = time.perf_counter()
        for s in range(warmup, warmup + steps):
            step(s)
        par.barrier()
        dt = (time.perf_counter() - t0) / steps
        state = sum(_local_bytes(v) for st in optimizer.state.values() for v in st.values()
                    if isinstance(v, torch.Tensor) and v.dim() > 0)
        mine = {"params": sum(_local_bytes(p) for p in model.parameters()), "grads": grads[-1],
                "optim": state, "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "step_s": dt,
                "n_params": sum(p.numel() for p in model.parameters()) if not par.active or strategy == "ddp"
                else None}
        return {"ranks": [mine]} if not par.active else {"ranks": par.gather(mine)}
    finally:
        par.close()


def launch(side: str, nproc: int, args, precision: str) -> dict:
    """Run one side in fresh processes; the JSON rank 0 prints."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    flags = ["--worker", "none" if side == "1 process" else side, "--steps", str(args.steps), "--warmup",
             str(args.warmup), "--batch", str(args.batch), "--seq-len", str(args.seq_len), "--precision", precision]
    if side == "1 process":
        env["OMP_NUM_THREADS"] = str(nproc)
        cmd = [sys.executable, __file__, *flags]
    else:
        env["OMP_NUM_THREADS"] = "1"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", __file__,
               *flags]
    res = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    lines = [l for l in res.stdout.splitlines() if l.startswith("{")]
    if res.returncode != 0 or not lines:
        raise SystemExit(f"{side}: failed (exit {res.returncode}): {res.stderr.strip().splitlines()[-1:]}")
    return json.loads(lines[-1])


def main(argv=None) -> int:
    p = harness.parser("distributed", __doc__, precision="fp32")
    p.set_defaults(rounds=3)
    p.add_argument("--nproc", type=harness.positive_int, default=2, help="processes of the DDP and FSDP2 sides")
    p.add_argument("--steps", type=harness.positive_int, default=2, help="timed optimizer steps per launch")
    p.add_argument("--warmup", type=harness.positive_int, default=1, help="untimed steps first")
    p.add_argument("--batch", type=harness.positive_int, default=4, help="global batch (sequences)")
    p.add_argument("--seq-len", type=harness.positive_int, default=128)
    p.add_argument("--worker", default=None, help=argparse_hidden())
    args = p.parse_args(argv)
    if args.worker is not None:
        out = worker(args.worker, args.steps, args.warmup, args.batch, args.seq_len, args.precision[0])
        if int(os.environ.get("RANK", 0)) == 0:
            print(json.dumps(out), flush=True)
        return 0
    if args.batch % args.nproc:
        p.error(f"--batch {args.batch} must be divisible by --nproc {args.nproc}")
    if "fp16" in args.precision:
        p.error("--precision fp16: FSDP2 does not run with fp16's GradScaler here (train.parallel); use fp32 or bf16")
    for precision in args.precision:
        table(args, precision)
    return 0


def table(args, precision: str):
    """Every side, round by round, then the table for one precision."""
    rounds = harness.Rounds({s: [] for s in SIDES}, {s: [] for s in SIDES})
    results = {}
    for r in range(args.rounds):
        for side in harness.round_order(SIDES, r):
            res = launch(side, args.nproc, args, precision)
            results[side] = res
            rounds.wall[side].append(max(rk["step_s"] for rk in res["ranks"]))
            rounds.cpu[side].append(rounds.wall[side][-1])
            print(f"round {r + 1}/{args.rounds} {side}: {rounds.wall[side][-1]:.2f} s/step", file=sys.stderr)
    n = results["1 process"]["ranks"][0]["n_params"]
    print(f"\n{n / 1e6:.1f}M-parameter LLM, AdamW, {precision}, global batch {args.batch} x {args.seq_len} tokens, "
          f"{args.nproc} processes (gloo, CPU), {args.rounds} rounds of {args.steps} steps after {args.warmup}\n")
    rows = []
    for side in SIDES:
        ranks = results[side]["ranks"]
        worst = max(ranks, key=lambda rk: rk["params"] + rk["grads"] + rk["optim"])
        total = worst["params"] + worst["grads"] + worst["optim"]
        per_param = total / n
        speed = "1.00x" if side == "1 process" else str(rounds.paired(side, "1 process"))
        rows.append([side, len(ranks), f"{worst['params'] / 2**20:.0f}", f"{worst['grads'] / 2**20:.0f}",
                     f"{worst['optim'] / 2**20:.0f}", f"{total / 2**20:.0f}", f"{per_param:.1f}",
                     " / ".join(f"{rk['rss'] / 2**30:.2f}" for rk in ranks),
                     f"{statistics.median(rounds.wall[side]):.2f}", speed])
    harness.print_table(["side", "processes", "params MiB/rank", "grads MiB/rank", "optimizer MiB/rank",
                         "P+G+O MiB/rank", "bytes/param/rank", "peak RSS GiB per rank", "s/step (median)",
                         "speed vs 1 process (paired median, range)"], rows)


def argparse_hidden():
    import argparse
    return argparse.SUPPRESS


if __name__ == "__main__":
    sys.exit(main())
