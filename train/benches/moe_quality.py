"""Mixture-of-Experts quality at equal compute, on the embedded corpus (the stdlib source).

    python train/bench.py llm-moe-quality                         # the four runs, the table, docs/moe_quality.png
    python train/bench.py llm-moe-quality --steps 200 --out runs/q   # shorter

Four runs of train/run.py, the same data, seed, steps, batch and tokens:
- dense:       configs/llm/tiny.yaml (SwiGLU of 704 in each of 4 layers);
- moe:         configs/llm/tiny-moe.yaml (8 experts of 352, top-2: the same active feed-forward
               parameters per token, 4x the total), the Switch load-balancing loss and z-loss;
- moe-bias:    the same with DeepSeek-V3's bias balancing instead of the loss (z-loss kept), at a
               bias step of 0.01 (the default 0.001 is too slow for a run this short: the routing
               collapses within 20 steps, long before the bias can move);
- moe-none:    the same with no balancing at all (no loss, no bias, no z-loss).
The table: the final validation loss (the loop's evaluation, cross-entropy only), the
parameters, the training tokens/s, and per MoE run the max and min expert load relative to
uniform (the mean over the last quarter of the logged steps, per layer; the worst layer shown),
and the experts that took under a tenth of a uniform share there ("starved"). The PNG: the
training cross-entropy (smoothed) and the validation loss of every run.
Runs that already finished in --out are read, not run again (delete the folder to redo them).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from ..plots import line_plot
from train.metrics import read_rows

ROOT = Path(__file__).resolve().parents[2]
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

RUNS = {
    "dense": ("tiny.yaml", []),
    "moe": ("tiny-moe.yaml", []),
    "moe-bias": ("tiny-moe.yaml", ["model.moe.balance=bias", "model.moe.bias_update_rate=0.01"]),
    "moe-none": ("tiny-moe.yaml", ["model.moe.balance=none", "model.moe.z_loss_coef=0"]),
}


def rows_of(out: Path) -> list:
    return read_rows(out)


def run(name: str, args, runs: dict = RUNS, steps: int = 0) -> list:
    """Run `name` of `runs` (config file, overrides) for `steps` (default args.steps) steps, or read
    its metrics from args.out when it finished there before."""
    cfg, extra = runs[name]
    steps = steps or args.steps
    out = Path(args.out) / name
    if (out / "model.safetensors").is_file():
        print(f"{name}: finished earlier in {out}, read from there", flush=True)
        return rows_of(out)
    cmd = [sys.executable, str(ROOT / "train" / "run.py"), str(ROOT / "configs" / "llm" / cfg),
           f"train.out_dir={out}", f"train.max_steps={steps}", f"train.batch_size={args.batch}",
           f"data.seq_len={args.seq}", f"train.eval_every={getattr(args, 'eval_every', 0) or max(1, steps // args.evals)}",
           f"train.eval_batches={args.eval_batches}", "train.checkpoint_every=0", "train.samples=false",
           "train.progress=false", "train.log_every=10", f"optim.warmup_steps={max(1, steps // 12)}", *extra]
    if args.precision:
        cmd.append(f"train.precision={args.precision}")
    print(f"{name}: {' '.join(cmd[1:])}", flush=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads)) if args.threads else None
    subprocess.run(cmd, check=True, cwd=ROOT, env=env)
    return rows_of(out)


def summary(name: str, rows: list) -> dict:
    train = [r for r in rows if "loss" in r]
    val = [r["val_loss"] for r in rows if "val_loss" in r]
    s = {"name": name, "val_loss": val[-1], "tok_s": sorted(r["tokens_per_s"] for r in train)[len(train) // 2]}
    if "moe_load_max" in train[-1]:
        tail = train[-max(1, len(train) // 4):]
        layers = len(tail[0]["moe_load_max"])
        hi = [sum(r["moe_load_max"][i] for r in tail) / len(tail) for i in range(layers)]
        lo = [sum(r["moe_load_min"][i] for r in tail) / len(tail) for i in range(layers)]
        s.update(load_max=max(hi), load_min=min(lo), lb_loss=sum(r["moe_lb_loss"] for r in tail) / len(tail))
    return s


def trained(out: Path):
    """The final model of the run in `out` (eval mode) and its data -> (model, TokenData)."""
    import yaml

    import zoo
    from train.data import TextDataConfig, TokenData
    from zoo.config import LLMConfig, from_dict
    from zoo.weights.files import load_tensors

    cfg = yaml.safe_load((out / "config.yaml").read_text())
    model = zoo.build(from_dict(LLMConfig, cfg["model"]))
    missing, unexpected = model.load_state_dict(load_tensors(out / "model.safetensors"), strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected, (missing, unexpected)  # tied: saved once
    return model.eval(), TokenData(from_dict(TextDataConfig, cfg["data"]), None, lambda *a: None)


def starved(out: Path, seq: int, batch: int) -> int:
    """Experts (over all layers) that receive under a tenth of a uniform share of a validation batch."""
    import torch

    model, data = trained(out)
    x, y = next(iter(data.val_batches(batch, 1)))
    with torch.no_grad():
        load = model(x, y, return_aux=True)[2]["load"]
    return int((load < 0.1 * load.mean(-1, keepdim=True)).sum())


def plot(results: dict, png: Path, title: str = "dense vs MoE (same active parameters, same tokens), embedded corpus",
         xlabel: str = "step"):
    """Each run's training loss (a moving mean over 5 logged rows) and its validation loss."""
    series, styles = {}, {}
    for i, (name, rows) in enumerate(results.items()):
        steps, losses = zip(*[(r["step"], r.get("lm_loss", r["loss"])) for r in rows if "loss" in r])
        k = 5
        series[f"{name} train"] = [(s, sum(losses[max(0, j - k + 1):j + 1]) / len(losses[max(0, j - k + 1):j + 1]))
                                   for j, s in enumerate(steps)]
        series[f"{name} val"] = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
        styles[f"{name} train"] = {"color": f"C{i}"}
        styles[f"{name} val"] = {"color": f"C{i}", "ls": "--"}
    return line_plot(series, png, xlabel, "cross-entropy (nats/token)", title=title,
                     markers={f"{n} val" for n in results}, styles=styles)


def main(argv=None):
    from train.benches import harness
    ap = harness.parser("llm-moe-quality", __doc__, precision=None, rounds=False)
    ap.add_argument("--precision", type=harness.precision_name, default=None,
                    help="the runs' train.precision: fp32, bf16 or fp16 (default: the configs' auto)")
    ap.add_argument("--steps", type=harness.positive_int, default=600)
    ap.add_argument("--batch", type=harness.positive_int, default=16)
    ap.add_argument("--seq", type=harness.positive_int, default=256)
    ap.add_argument("--eval-every", type=harness.positive_int, default=100)
    ap.add_argument("--eval-batches", type=harness.positive_int, default=20)
    ap.add_argument("--runs", type=harness.name_list(RUNS, "run"), default=",".join(RUNS),
                    help=f"comma list of {', '.join(RUNS)}")
    ap.add_argument("--out", default="runs/moe-quality")
    ap.add_argument("--png", default=str(ROOT / "docs" / "moe_quality.png"))
    args = ap.parse_args(argv)
    names = args.runs
    results = {n: run(n, args) for n in names}
    print(f"\n{args.steps} steps x {args.batch} x {args.seq} tokens, precision {args.precision or 'auto'}")
    print(f"{'run':<10} {'val loss':>8} {'tokens/s':>8} {'load max':>8} {'load min':>8} {'lb loss':>7} {'starved':>7}")
    for n, rows in results.items():
        s = summary(n, rows)
        moe = "load_max" in s
        hungry = starved(Path(args.out) / n, args.seq, args.batch) if moe else None
        print(f"{n:<10} {s['val_loss']:>8.4f} {s['tok_s']:>8.0f} "
              + (f"{s['load_max']:>8.2f} {s['load_min']:>8.2f} {s['lb_loss']:>7.3f} {hungry:>7d}" if moe else
                 f"{'-':>8} {'-':>8} {'-':>7} {'-':>7}"))
    plot(results, Path(args.png))
    print(f"\nloss curves: {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
