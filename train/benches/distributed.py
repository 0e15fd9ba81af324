"""DDP against FSDP2 at 2 processes, and both against 1 process: per-rank memory and step time.

    python train/bench.py distributed                  # a 100M-parameter LLM, AdamW, 3 rounds
    python train/bench.py distributed --steps 3 --rounds 2 --nproc 2
    python train/bench.py distributed --tune full,lora,qlora --smollm   # fine-tuning the SmolLM-135M shape

One global batch per step split over the ranks; each side one launch (gloo), the same cores for
every side. Memory per rank: parameters, gradients, optimizer state, peak RSS.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import torch

import zoo
from train.benches import harness
from train.benches.harness import ROOT
from train.config import OptimConfig, TrainConfig, load_run_config
from train.distributed import Parallel, launch_env
from train.optim import build_optimizer
from train.step import optimizer_step
from zoo.adapters import AdapterConfig, apply_adapters

SIDES = ("1 process", "ddp", "fsdp")


def _local_bytes(t) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def worker(args, strategy: str) -> dict:
    """One side's run in this process (a rank under torchrun): its memory and seconds per step."""
    steps, warmup, batch, seq_len, precision = args.steps, args.warmup, args.batch, args.seq, args.precision[0]
    par, device = Parallel(strategy, launch_env()), torch.device("cpu")
    par.init(device)
    try:
        torch.manual_seed(0)
        model = zoo.build(harness.llm_config(args))
        if args.worker_tune != "full":
            apply_adapters(model, AdapterConfig("lora", quantize_base="nf4" if args.worker_tune == "qlora" else "none"))
        model, fwd = par.wrap(model, precision, TrainConfig(), device, lambda m: None)
        fwd = fwd or model
        optimizer, grads = build_optimizer(model, OptimConfig(lr=1e-4), device, log=lambda m: None), []
        optimizer.register_step_pre_hook(lambda opt, a, k: grads.append(
            sum(_local_bytes(p.grad) for g in opt.param_groups for p in g["params"] if p.grad is not None)))
        scaler, B = torch.amp.GradScaler("cpu", enabled=precision == "fp16"), batch // par.world
        params = [p for p in model.parameters() if p.requires_grad]

        def step(s):
            g = torch.Generator().manual_seed(s)
            x = torch.randint(args.vocab, (batch, seq_len + 1), generator=g)[par.rank * B:(par.rank + 1) * B]
            return optimizer_step(lambda b: (fwd(b[:, :-1], b[:, 1:])[1], B * seq_len), iter([x]), 1, optimizer,
                                  scaler, params, 1.0, lambda: harness.autocast(precision),
                                  no_sync=(lambda last: par.no_sync(fwd, last)) if par.active else None,
                                  agree=(lambda st: par.agree(st, False)[0]) if par.active else None)

        planned = planned_per_rank(args, strategy, par.world) if par.main else None
        for s in range(warmup + steps):
            if s == warmup:  # the timed steps start, every rank together
                par.barrier()
                t0 = time.perf_counter()
            step(s)
        par.barrier()
        dt = (time.perf_counter() - t0) / steps
        state = sum(_local_bytes(v) for st in optimizer.state.values() for v in st.values()
                    if isinstance(v, torch.Tensor) and v.dim() > 0)
        whole = not par.active or strategy == "ddp"  # this rank holds every parameter
        mine = {"params": sum(_local_bytes(p) for p in model.parameters()), "grads": grads[-1], "planned": planned,
                "optim": state, "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "step_s": dt,
                "n_params": sum(p.numel() for p in model.parameters()) if whole else None}
        return {"ranks": [mine]} if not par.active else {"ranks": par.gather(mine)}
    finally:
        par.close()


def planned_per_rank(args, strategy: str, world: int) -> int:
    """train/plan.py's peak per rank for the same step (model, adapter, AdamW, this rank's batch)."""
    from train.planner import plan
    base = harness.llm_base(args.vocab, args.d_model, args.n_layers, args.n_heads, args.n_kv_heads or None,
                            args.batch // world, args.seq)
    over = ["optim.lr=1e-4", f"train.precision={args.precision[0]}"]
    if args.worker_tune != "full":
        over += ["adapter.method=lora", f"adapter.quantize_base={'nf4' if args.worker_tune == 'qlora' else 'none'}"]
    cfg = load_run_config(None, over, base=base)
    return plan(cfg, devices=world, sharding="fsdp2" if strategy == "fsdp" else "ddp").peak_bytes


def launch(side: str, args, precision: str) -> dict:
    """Run one side in fresh processes (bench.py distributed --worker); the JSON rank 0 prints."""
    env = {**os.environ, "OMP_NUM_THREADS": str(args.nproc) if side == "1 process" else "1"}
    at = {i for i, a in enumerate(args.argv) if a == "--nproc"}  # torchrun's parser would read it as its own
    argv = [a for i, a in enumerate(args.argv) if not (at & {i, i - 1} or a.startswith("--nproc="))]
    flags = [*argv, "--worker", "none" if side == "1 process" else side, "--precision", precision,
             "--worker-tune", args.worker_tune]
    run = [] if side == "1 process" else ["-m", "torch.distributed.run", "--standalone",
                                          f"--nproc-per-node={args.nproc}"]
    res = subprocess.run([sys.executable, *run, str(ROOT / "train" / "bench.py"), "distributed", *flags], env=env,
                         cwd=ROOT, capture_output=True, text=True)
    lines = [line for line in res.stdout.splitlines() if line.startswith("{")]
    if res.returncode != 0 or not lines:
        raise SystemExit(f"{side}: failed (exit {res.returncode}): {res.stderr.strip().splitlines()[-1:]}")
    return json.loads(lines[-1])


def table(args, precision: str) -> tuple[dict, dict]:
    """Every side, round by round, then the table for one precision and way of training (--tune)."""
    rounds, results = harness.Rounds.empty(SIDES), {}
    for r, side in harness.schedule(SIDES, args.rounds):
        results[side] = launch(side, args, precision)
        rounds.wall[side].append(max(rk["step_s"] for rk in results[side]["ranks"]))
        rounds.cpu[side].append(rounds.wall[side][-1])
        print(f"round {r + 1}/{args.rounds} {side}: {rounds.wall[side][-1]:.2f} s/step", file=sys.stderr)
    n, rows = results["1 process"]["ranks"][0]["n_params"], []
    for side in SIDES:
        ranks = results[side]["ranks"]
        worst = max(ranks, key=lambda rk: rk["params"] + rk["grads"] + rk["optim"])
        total = worst["params"] + worst["grads"] + worst["optim"]
        rows.append([side, len(ranks), *(f"{worst[k] / 2**20:.0f}" for k in ("params", "grads", "optim")),
                     f"{total / 2**20:.0f}", f"{total / n:.1f}", " / ".join(f"{rk['rss'] / 2**30:.2f}" for rk in ranks),
                     f"{ranks[0]['planned'] / 2**30:.2f}", f"{rounds.median(side):.2f}",
                     "1.00x" if side == "1 process" else str(rounds.paired(side, "1 process"))])
    how = {"full": "full training", "lora": "LoRA", "qlora": "QLoRA (NF4 base)"}[args.worker_tune]
    return harness.table(["side", "processes", "params MiB/rank", "grads MiB/rank", "optimizer MiB/rank",
                          "P+G+O MiB/rank", "bytes/param/rank", "peak RSS GiB per rank", "planned peak GiB/rank",
                          "s/step (median)", "speed vs 1 process (paired median, range)"], rows,
                         f"{n / 1e6:.1f}M-parameter LLM, {how}, AdamW, global batch {args.batch} x {args.seq} tokens, "
                         f"{args.nproc} processes (gloo, CPU), {args.rounds} rounds of {args.steps} steps after "
                         f"{args.warmup}"), results


def main(argv=None):
    p = harness.parser("distributed", __doc__, precision="fp32")
    harness.llm_args(p, d_model=768, n_layers=12, n_heads=12, n_kv_heads=4, vocab=32000, seq=128, batch=4)
    p.set_defaults(rounds=3)
    harness.counts(p, nproc=(2, "processes of the DDP and FSDP2 sides"), steps=(2, "timed optimizer steps per launch"),
                   warmup=(1, "untimed steps first"))
    p.add_argument("--tune", type=harness.name_list(("full", "lora", "qlora"), "way of training"), default="full",
                   help="comma list: full training, LoRA, QLoRA (one table each)")
    p.add_argument("--smollm", action="store_true", help="the SmolLM-135M shape (configs/llm/smollm-135m.yaml)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker-tune", default="full", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.smollm:
        args.d_model, args.n_layers, args.n_heads, args.n_kv_heads, args.vocab = 576, 30, 9, 3, 49152
    if args.worker is not None:
        out = worker(args, args.worker)
        if int(os.environ.get("RANK", 0)) == 0:
            print(json.dumps(out), flush=True)
        return
    if args.batch % args.nproc:
        p.error(f"--batch {args.batch} must be divisible by --nproc {args.nproc}")
    got = {}
    for tune in args.tune:
        args.worker_tune = tune
        got |= {(prec if args.tune == ["full"] else f"{tune} {prec}"): table(args, prec) for prec in args.precision}
    harness.save(args, {k: t for k, (t, _) in got.items()}, {k: d for k, (_, d) in got.items()})
