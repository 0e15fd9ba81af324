"""Optimizers side by side: state memory and step time on the ~40M LLM bench shape, and the val
loss each reaches on the embedded default (configs/llm/tiny.yaml) with its own tuned LR.

    python train/bench.py optimizers                          # memory + step time, all optimizers
    python train/bench.py optimizers --optimizers adamw,lion  # a subset (adamw, the reference, always runs)
    python train/bench.py optimizers --quality --train-steps 300   # + the LR sweep of each on the embedded default

Memory and time: one model (d_model 512, 8 layers, 8 heads (MHA), vocab 32000, tied: 42M
parameters) with fixed random gradients; every optimizer is built on it and stepped in
alternating rounds (harness.run_rounds); the table gives each one's optimizer-step time, the
paired median of fused AdamW's time over its own, and the bytes its state holds after a step
(`train.optim.state_bytes`: tensors counted once, quantised states by their storage). The forward
and backward are the same for every optimizer and are left out. torchao's AdamW8bit compiles its
update per tensor shape in its untimed warm-up step (minutes on a CPU, once per process).

Quality (`--quality`): for each optimizer, `--train-steps` steps of the embedded default at each LR of
its grid (x1/3, x1, x3 around LR_START, or `--lrs`), the best final val loss and its LR (for
Muon the grid scales `optim.muon_lr` from 0.02 as it scales `optim.lr`); and Muon against AdamW: the first evaluation (every `--eval-every` steps) at which each
reaches `--target` val loss (default: AdamW's best final val loss).
"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from train.benches import harness  # noqa: E402
from train.metrics import read_rows

REFERENCE = "adamw"
# starting LRs on the embedded default (the grid multiplies them by 1/3, 1 and 3)
LR_START = {"adamw": 2e-3, "sgd": 0.1, "adafactor": 1e-2, "lion": 3e-4, "muon": 2e-3, "adamw8bit": 2e-3,
            "adamw_offload": 2e-3, "galore": 2e-3}
MUON_LR = 0.02


def build_model(args):
    from zoo.config import LLMConfig
    from zoo.llm import LLM
    torch.manual_seed(0)
    return LLM(LLMConfig(vocab_size=args.vocab, d_model=args.d_model, n_layers=args.n_layers, n_heads=args.n_heads,
                         n_kv_heads=args.n_heads, max_seq_len=256, tie_embeddings=True))


def time_optimizers(model, configs: dict, rounds: int, steps: int = 1, say=print) -> tuple:
    """Every optimizer of `configs` (name -> OptimConfig) built on `model` (whose parameters hold
    fixed gradients) and stepped in alternating rounds, the weights put back between rounds.
    Returns (harness.Rounds, {name: state bytes after a step (`train.optim.state_bytes`)}, {name: build notes})."""
    from train.optim import build_optimizer, state_bytes
    device = next(model.parameters()).device
    opts, notes = {}, {}
    for name, cfg in configs.items():
        msgs = []
        opts[name] = build_optimizer(model, cfg, device, log=msgs.append)
        notes[name] = "; ".join(msgs)
    for name, o in opts.items():  # warm-up: states allocated (and torchao's update compiled)
        o.step()
        say(f"  {name}: warmed up" + (f" ({notes[name]})" if notes[name] else ""))
    with torch.no_grad():
        weights = [p.detach().clone() for p in model.parameters()]

    def restore(_r):  # the optimizers move the shared weights by tiny steps; put them back between rounds
        with torch.no_grad():
            for p, w in zip(model.parameters(), weights):
                p.copy_(w)

    rounds = harness.run_rounds({k: o.step for k, o in opts.items()}, rounds, calls=steps, between=restore)
    return rounds, {name: state_bytes(o) for name, o in opts.items()}, notes


def with_gradients(model, seed: int = 0):
    """`model` with fixed random gradients (1e-3 scale) on every parameter."""
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = (torch.randn(p.shape, generator=g) * 1e-3).to(p.device)
    return model


def memory_and_time(args, names):
    from train.config import OptimConfig
    model = with_gradients(build_model(args))
    n = sum(p.numel() for p in model.parameters())
    print(f"optimizers: LLM {n / 1e6:.1f}M params (d_model {args.d_model}, {args.n_layers} layers, vocab "
          f"{args.vocab}), torch {torch.__version__}, {torch.get_num_threads()} threads; {args.rounds} alternating "
          f"rounds of {args.steps} optimizer step(s)", flush=True)
    rounds, nbytes, _ = time_optimizers(model, {name: OptimConfig(name=name, lr=1e-5, muon_lr=1e-5) for name in names},
                                        args.rounds, args.steps, say=lambda m: print(m, flush=True))
    ref_bytes = nbytes[REFERENCE]
    rows = []
    for name in names:
        b = nbytes[name]
        rows.append([name, f"{rounds.best(name) * 1e3:.1f}", str(rounds.paired(REFERENCE, name)) if name != REFERENCE
                     else "", f"{b / 2**20:.1f}", f"{b / n:.2f}", f"{100 * (1 - b / ref_bytes):.0f}%"])
    print()
    harness.print_table(["optimizer", "best step ms", "step time / adamw's, paired median (range)", "state MiB",
                         "state bytes / param", "state saved vs adamw"], rows)


def quality(args, names):
    from train.config import load_run_config
    from train.loop import train
    from train.run import DEFAULT_CONFIG
    results = {}
    for name in names:
        lrs = args.lrs or [LR_START[name] / 3, LR_START[name], LR_START[name] * 3]
        for lr in lrs:
            with tempfile.TemporaryDirectory() as tmp:
                over = [f"train.out_dir={tmp}", f"train.max_steps={args.train_steps}", f"train.eval_every={args.eval_every}",
                        f"train.precision={args.precision[0]}", "train.progress=false", "train.samples=false",
                        "train.plot=false", "train.export=false", f"train.checkpoint_every=0", "train.average_last=0",
                        f"optim.warmup_steps={max(1, args.train_steps // 10)}", f"optim.name={name}", f"optim.lr={lr}",
                        *([f"optim.muon_lr={MUON_LR * lr / LR_START[name]}"] if name == "muon" else []), *args.set]
                cfg = load_run_config(str(DEFAULT_CONFIG), over)
                final = train(cfg, log=lambda m: None)
                rows = read_rows(Path(tmp))
            curve = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
            results[name, lr] = (final["val_loss"], curve)
            print(f"  {name} lr {lr:.2g}: val loss {final['val_loss']:.4f}", flush=True)
    best = {}
    for name in names:
        lr = min((lr for n, lr in results if n == name), key=lambda lr: results[name, lr][0])
        best[name] = (lr, *results[name, lr])
    print()
    harness.print_table(["optimizer", "best LR", f"val loss after {args.train_steps} steps", "LRs tried"],
                        [[n, f"{lr:.2g}", f"{v:.4f}", ", ".join(f"{l:.2g}" for m, l in results if m == n)]
                         for n, (lr, v, _) in best.items()])
    if "muon" in best and REFERENCE in best:
        target = args.target or best[REFERENCE][1]
        print()
        rows = []
        for n in (REFERENCE, "muon"):
            hit = next((s for s, v in best[n][2] if v <= target), None)
            rows.append([n, f"{best[n][0]:.2g}", f"{target:.4f}", str(hit) if hit else f"not within {args.train_steps}"])
        harness.print_table(["optimizer", "LR", "target val loss", f"steps to reach it (evaluated every "
                                                                   f"{args.eval_every})"], rows)


def main(argv=None):
    from train.optim import OPTIMIZERS
    ap = harness.parser("optimizers", __doc__, precision="fp32")
    ap.add_argument("--optimizers", type=harness.name_list(OPTIMIZERS, "optimizer"), default=",".join(OPTIMIZERS))
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--n-layers", type=int, default=8)
    ap.add_argument("--n-heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--steps", type=harness.positive_int, default=1, help="optimizer steps per round")
    ap.add_argument("--train-steps", type=harness.positive_int, default=300,
                    help="--quality: training steps per run (the embedded default runs 600)")
    ap.add_argument("--quality", action="store_true", help="also sweep LRs on the embedded default")
    ap.add_argument("--lrs", type=lambda s: [float(x) for x in s.split(",")], default=None,
                    help="--quality: comma list of LRs for every optimizer (default: each one's grid)")
    ap.add_argument("--eval-every", type=harness.positive_int, default=50)
    ap.add_argument("--target", type=float, default=None, help="--quality: val loss for Muon vs AdamW")
    ap.add_argument("--skip-memory", action="store_true", help="--quality only")
    ap.add_argument("--set", nargs="*", default=[], help="--quality: key=value overrides of the config, every run")
    args = ap.parse_args(argv)
    harness.setup(args)
    names = [REFERENCE] + [n for n in args.optimizers if n != REFERENCE]
    if not args.skip_memory:
        memory_and_time(args, names)
    if args.quality:
        quality(args, names)
    return 0


if __name__ == "__main__":
    sys.exit(main())
