"""Full fine-tuning against LoRA, DoRA and QLoRA at one model shape, on tinyshakespeare.

    python train/bench.py peft                                   # SmolLM-135M shape, 20 steps each
    python train/bench.py peft --steps 4 --layers 2 --out runs/p # a quick check at a small size

A base model of the shape of --config (random init, seed 0; --layers overrides the depth) is
saved as a Hugging Face folder, then fine-tuned four times by train/run.py (one process each, so
that each peak resident memory is its own) with the same data (tinyshakespeare, bytes
tokenizer), seed, batch, steps, LR schedule and precision (--precision, default fp32):
- full:   every weight trains (AdamW);
- lora:   adapter.method=lora, r=8 on all seven projections (q, k, v, o, gate, up, down);
- dora:   the same with DoRA;
- qlora:  LoRA with the frozen base weights in NF4 (torchao).
The table: trainable parameters; the bytes of the model state that training keeps (weights, plus
gradients and AdamW's two moments of what trains), computed from the tensors; the process's peak
resident memory (from the loop's metrics: it includes loading the base, the data and the
activations); the median step time over the logged steps after the first; the validation loss
after the last step (the loop's evaluation). A LoRA learning rate is usually ~10x the full one:
--lr-full and --lr-adapter set them.
Runs that already finished in --out are read, not run again (delete the folder to redo them).
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from train.metrics import read_rows

ROOT = Path(__file__).resolve().parents[2]
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

TARGETS = "[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]"
RUNS = {
    "full": [],
    "lora": ["adapter.method=lora", "adapter.r=8", "adapter.alpha=16", f"adapter.targets={TARGETS}"],
    "dora": ["adapter.method=dora", "adapter.r=8", "adapter.alpha=16", f"adapter.targets={TARGETS}"],
    "qlora": ["adapter.method=lora", "adapter.r=8", "adapter.alpha=16", f"adapter.targets={TARGETS}",
              "adapter.quantize_base=nf4"],
}


def rows_of(out: Path) -> list:
    return read_rows(out)


def make_base(args) -> Path:
    import torch

    import zoo
    folder = Path(args.out) / "base"
    if (folder / "config.json").is_file():
        return folder
    torch.manual_seed(0)
    over = {"n_layers": args.layers} if args.layers else {}
    zoo.save_pretrained(zoo.build(ROOT / args.config, **over), folder)
    return folder


def state_bytes(base: Path, extra: list) -> tuple[int, int, int]:
    """(trainable parameters, total parameters, bytes of weights + gradients + AdamW moments)."""
    import torch

    import zoo
    from zoo.adapters import AdapterConfig, apply_adapters, count_params, param_bytes
    model = zoo.from_pretrained(base, dtype=torch.float32)
    if extra:
        kv = dict(e.split("=", 1) for e in extra)
        cfg = AdapterConfig(method=kv["adapter.method"], r=int(kv["adapter.r"]), alpha=float(kv["adapter.alpha"]),
                            targets=kv["adapter.targets"].strip("[]").split(","),
                            quantize_base=kv.get("adapter.quantize_base", "none"))
        apply_adapters(model, cfg)
    trainable, total = count_params(model)
    return trainable, total, param_bytes(model) + 3 * 4 * trainable


def run(name: str, base: Path, args) -> list:
    out = Path(args.out) / name
    if (out / "metrics.jsonl").is_file() and any("val_loss" in r and r["step"] == args.steps for r in rows_of(out)):
        print(f"{name}: finished earlier in {out}, read from there", flush=True)
        return rows_of(out)
    lr = args.lr_full if name == "full" else args.lr_adapter
    cmd = [sys.executable, str(ROOT / "train" / "run.py"), str(ROOT / "configs" / "llm" / "tiny.yaml"),
           f"train.init_from={base}", f"train.out_dir={out}", *([f"data.path={args.data}"] if args.data else []),
           "data.tokenizer=bytes",
           f"data.seq_len={args.seq}", f"train.max_steps={args.steps}", f"train.batch_size={args.batch}",
           "train.grad_accum=1", "train.eval_every=0", f"train.eval_batches={args.eval_batches}",
           "train.checkpoint_every=0", "train.average_last=0", "train.samples=false", "train.plot=false", "train.export=false",
           "train.progress=false", "train.log_every=1", "train.compile=false", f"train.precision={args.precision[0]}",
           "train.resume=false", f"optim.lr={lr}", f"optim.warmup_steps={max(1, args.steps // 10)}", *RUNS[name]]
    print(f"{name}: {' '.join(cmd[1:])}", flush=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads)) if args.threads else None
    subprocess.run(cmd, check=True, cwd=ROOT, env=env)
    return rows_of(out)


def main(argv=None):
    from train.benches.harness import parser, print_table
    p = parser("peft", __doc__, precision="fp32", rounds=False)
    p.add_argument("--config", default="configs/llm/smollm-135m.yaml", help="the model shape")
    p.add_argument("--layers", type=int, default=None, help="override the number of layers")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--lr-full", type=float, default=3e-4)
    p.add_argument("--lr-adapter", type=float, default=3e-3)
    p.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"))
    p.add_argument("--out", default="runs/bench-peft")
    p.add_argument("--only", nargs="*", default=list(RUNS), choices=list(RUNS))
    args = p.parse_args(argv)
    if len(args.precision) != 1:
        p.error("--precision: one precision per run of this benchmark")
    if not Path(args.data).is_file():
        p.error(f"--data {args.data}: no such file (tinyshakespeare.txt)")
    base = make_base(args)
    table = []
    for name in args.only:
        rows = run(name, base, args)
        trainable, total, nbytes = state_bytes(base, RUNS[name])
        steps = [r for r in rows if "loss" in r]
        times = [r["step_time_s"] for r in steps[1:]] or [steps[0]["step_time_s"]]
        val = [r["val_loss"] for r in rows if "val_loss" in r][-1]
        table.append([name, f"{trainable / 1e6:.2f}M ({100 * trainable / total:.2f}%)", f"{nbytes / 2**20:,.0f}",
                      f"{max(r['peak_mem_gb'] for r in steps):.2f}", f"{statistics.median(times):.2f}", f"{val:.3f}"])
    print_table(["method", "trainable params", "model state MiB", "peak RSS GiB", "step s", f"val loss @ {args.steps}"],
                table)
    return 0
