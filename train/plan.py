"""The memory planner's program: a training step's peak memory, from the config alone (train/planner.py).

    python train/plan.py CONFIG [key=value ...] [--device cuda] [--memory 24GB] [--devices N] [--sharding fsdp2]

`--memory` lists settings that fit; `--json` prints one object. docs/memory.md has the accuracy.
Exit codes: 0 done; 2 a bad config or option (one line).
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from train.config import load_run_config, parse_memory_size
from train.planner import Plan, fits, fmt_bytes, plan, run_device
from zoo.config import ConfigError


def report(cfg, p: Plan) -> str:
    lines = [f"plan: {cfg.source}: family={cfg.family} device={p.device} precision={p.precision} "
             f"batch={cfg.train.batch_size} x {cfg.train.grad_accum} optimizer={cfg.optim.name}"
             + (f", per device of {p.devices} ({p.sharding})" if p.devices > 1 else "")]
    lines += [f"  {k:<18}{fmt_bytes(v):>14}" for k, v in {**p.breakdown, "peak": p.peak_bytes}.items()]
    if acts := p.per_layer_activations:
        lines.append(f"  activations per block: {fmt_bytes(acts[0])} (block 0), {fmt_bytes(sum(acts))} for all {len(acts)}")
    if p.logits_bytes:
        lines.append(f"  loss (logits) peak over the last block's output: {fmt_bytes(p.logits_bytes)}")
    if p.kv_cache_bytes is not None:
        lines.append(f"  KV cache for generation (batch {cfg.train.batch_size}, {cfg.model.max_seq_len} tokens): "
                     f"{fmt_bytes(p.kv_cache_bytes)}")
    if p.host_bytes:
        lines.append(f"  host memory (offloaded): {fmt_bytes(p.host_bytes)}")
    if p.extrapolated_from:
        lines.append(f"  (the stack simulated at {p.extrapolated_from[0]} and {p.extrapolated_from[1]} blocks, "
                     f"extrapolated)")
    lines += [f"  note: {n}" for n in p.notes]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="train/plan.py", description=__doc__.split("\n")[0])
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*", help="key=value")
    ap.add_argument("--memory", help="the memory a device has, e.g. 24GB: print the settings that make it fit")
    ap.add_argument("--devices", type=int, default=1, help="data-parallel devices (default 1)")
    ap.add_argument("--sharding", choices=("ddp", "fsdp2"), default="ddp", help="with --devices > 1")
    ap.add_argument("--device", help="plan for this device (cpu, cuda, cuda:N, ...) from any machine; "
                                     "default: train.device")
    ap.add_argument("--json", action="store_true", help="one JSON object")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        try:
            budget = parse_memory_size(args.memory) if args.memory else None
        except ValueError as e:
            raise ValueError(f"--memory {e}") from None
        if args.devices < 1:
            raise ValueError(f"--devices must be >= 1, got {args.devices}")
        cfg = load_run_config(args.config, args.overrides, paths=False)  # a fine-tuning planned before its base exists
        target = torch.device(args.device) if args.device else run_device(cfg)
        p = plan(cfg, args.devices, args.sharding, device=target)
        found = fits(cfg, budget, args.devices, args.sharding, device=target) if budget is not None else None
    except (ConfigError, ValueError) as e:
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    if args.json:
        out = p.to_dict()
        if found is not None:
            out["budget_bytes"] = budget
            out["fits"] = [{"slowdown": s, "overrides": names, "peak_bytes": q.peak_bytes} for s, names, q in found]
        print(json.dumps(out))
        return 0
    print(report(cfg, p))
    if found is not None:
        print(f"settings that fit in {fmt_bytes(budget)}, cheapest in speed first (estimated step time; paste the "
              f"overrides after the command):")
        if not found:
            print("  none of the options is enough; more devices (--devices N --sharding fsdp2) or a smaller model")
        command = shlex.join(["python", "train/run.py", args.config, *args.overrides])
        for s, names, q in found:
            print(f"  {s:.2f}x  peak {fmt_bytes(q.peak_bytes):>11}  {command} {' '.join(names)}".rstrip()
                  + ("  (as configured)" if not names else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
