"""The memory planner against measured peaks: predicted and measured peak memory of a training step.

    python train/bench.py memory                   # every configuration below: table, JSON, docs table
    python train/bench.py memory --only "llm 28M"  # the configurations whose name starts with that

Measured: `train.planner.measure` in --repeat fresh CPU processes, the largest kept. Predicted:
`train.planner.plan`. Target: ratio >= 1, median <= 1.25, worst <= 1.6. Linux only (/proc).
"""
from __future__ import annotations

import statistics

from train.benches import harness
from train.benches.harness import ROOT, llm_base

LLM4, LLM28 = llm_base(4096, 256, 4, 4, 2, 16), llm_base(8192, 512, 8, 8, 4, 8)  # 4.0M, 27.8M parameters
CONFIGS = {  # name -> (base config: a dict or a path under configs/, overrides)
    "llm 0.4M fp32 full-loss": (llm_base(4096, 64, 2, 4, 2, 8, seq=64), ["train.chunked_loss=false"]),
    "llm 4M fp32": (LLM4, []),
    "llm 4M bf16": (LLM4, ["train.precision=bf16"]),
    "llm 28M fp32": (LLM28, []),
    "llm 28M bf16 ckpt": (LLM28, ["train.precision=bf16", "train.activation_checkpointing=true"]),
    "llm 47M bf16 selective": (llm_base(16384, 640, 8, 10, 5, 4),
                               ["train.precision=bf16", "train.activation_checkpointing=selective"]),
    "llm 76M fp32": (llm_base(16384, 768, 10, 12, 4, 4), []),
    "llm 100M fp32 ckpt": (llm_base(32000, 768, 12, 12, 4, 2), ["train.activation_checkpointing=true"]),  # tied
    "convnet fp32 (resnet-digits)": ("convnet/resnet-digits.yaml", []),
    "convnet bf16 (width 64)": ("convnet/resnet-digits.yaml", ["model.width=64", "train.precision=bf16"]),
    "diffusion fp32 (batch 256)": ("diffusion/digits.yaml", ["train.batch_size=256"]),
    "diffusion bf16 (batch 64)": ("diffusion/digits.yaml", ["train.batch_size=64", "train.precision=bf16"]),
}


def base_of(spec):
    from zoo.config import load_yaml
    return load_yaml(ROOT / "configs" / spec) if isinstance(spec, str) else spec


def measure_row(name: str, repeat: int, threads: int) -> dict:
    """Plan `name` and measure it in `repeat` fresh processes (the largest peak kept)."""
    from train.config import load_run_config
    from train.planner import measure_in_subprocess, plan
    spec, over = CONFIGS[name]
    base = base_of(spec)
    cfg = load_run_config(None, over, base=base)
    p, runs = plan(cfg), [measure_in_subprocess(base, over, threads=threads)["peak"] for _ in range(repeat)]
    return {"name": name, "family": cfg.family, "params": p.breakdown["params"] // 4,
            "tensors": p.peak_bytes - p.breakdown["allocator"], "allocator": p.breakdown["allocator"],
            "predicted": p.peak_bytes, "measured": max(runs), "runs": runs, "ratio": p.peak_bytes / max(runs)}


def table(rows) -> dict:
    mib, ratios = 2 ** 20, [r["ratio"] for r in rows]
    return harness.table(
        ["configuration", "params", "tensors MiB", "+ margin MiB", "predicted MiB", "measured MiB (processes)",
         "predicted / measured"],
        [[r["name"], f"{r['params'] / 1e6:.1f}M", f"{r['tensors'] / mib:.1f}", f"{r['allocator'] / mib:.1f}",
          f"{r['predicted'] / mib:.1f}",
          f"{r['measured'] / mib:.1f} ({min(r['runs']) / mib:.1f}-{max(r['runs']) / mib:.1f}, {len(r['runs'])})",
          f"{r['ratio']:.3f}"] for r in rows],
        f"predicted / measured over {len(ratios)} configurations: lowest {min(ratios):.3f}, median "
        f"{statistics.median(ratios):.3f}, highest {max(ratios):.3f} (target: >= 1.0, median <= 1.25, highest <= 1.6)")


def main(argv=None):
    p = harness.parser("memory", __doc__, precision="fp32,bf16", rounds=False)
    p.add_argument("--only", default="", help="run the configurations whose name starts with this")
    p.add_argument("--repeat", type=int, default=3, help="fresh processes per configuration (the largest kept)")
    args = p.parse_args(argv)
    names = [n for n in CONFIGS if n.startswith(args.only) and any(f" {pr}" in n for pr in args.precision)]
    if not names:
        p.error(f"no configuration starts with {args.only!r} (names: {', '.join(CONFIGS)})")
    rows = []
    for name in names:
        rows.append(measure_row(name, args.repeat, args.threads or 0))
        print(f"{name}: {rows[-1]['ratio']:.3f}", flush=True)
    old = {r["name"]: r for r in harness.load_result(args.json).get("data", {}).get("rows", [])}
    rows += [old[n] for n in CONFIGS if n not in names and n in old]  # --only: the others as measured before
    rows.sort(key=lambda r: list(CONFIGS).index(r["name"]))
    harness.save(args, {"": table(rows)}, {"rows": rows})
