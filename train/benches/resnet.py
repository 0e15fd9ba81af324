"""ResNet training step: Zoo's ResNet against timm's of the same architecture and weights.

    python train/bench.py resnet                               # resnet50, 16 x 3 x 224 x 224
    python train/bench.py resnet --batch 8 --size 160 --rounds 3 --arch resnet18

One training step = forward + cross-entropy + backward + SGD-momentum step (the loop's
optimizer and parameter groups, the same for both sides) + zero_grad(set_to_none), on the
same batch, in four settings: fp32 and bf16 autocast (fp32 master weights, as the loop runs
it), each with contiguous (NCHW) and channels-last (NHWC) model and batch.
Timing: after warm-up steps, the two sides are timed in alternating order, `rounds` times
`steps` steps each, and each side's best round is reported (the machine may be shared: the
best round is the least disturbed one). The table gives images/s, Zoo / timm of the best
rounds, the median over rounds of the ratio of the two back-to-back timings (less sensitive
to a disturbance that hits one side's best round), and what channels-last gives each side
against its own contiguous run.
Allocator: like train/loop.py (`train.cpu_keep_memory`, on by default) the process keeps freed
memory (glibc: no mmap, no trim), for both sides alike, so that a step's activations are not
page-faulted in afresh every step; `--no-keep-memory` leaves glibc's default.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def build_pair(arch: str, num_classes: int):
    """timm's model (random init) and Zoo's with the same weights, both fp32, training mode."""
    import timm

    from zoo.convnet import ResNet
    from zoo.weights.resnet import config_from_state_dict, load_into

    torch.manual_seed(0)
    ref = timm.create_model(arch, pretrained=False, num_classes=num_classes)
    sd = ref.state_dict()
    model = ResNet(config_from_state_dict(sd, arch))
    load_into(model, sd)
    return model.train(), ref.train()


class Side:
    def __init__(self, name, model):
        from train.config import OptimConfig
        from train.optim import build_optimizer
        self.name, self.model = name, model
        self.opt = build_optimizer(model, OptimConfig(name="sgd", lr=0.01, weight_decay=1e-4), torch.device("cpu"),
                                   log=lambda *a: None)

    def step(self, x, y, dtype):
        ctx = torch.autocast("cpu", dtype=dtype) if dtype is not None else torch.autocast("cpu", enabled=False)
        with ctx:
            loss = torch.nn.functional.cross_entropy(self.model(x).float(), y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.detach()


def main(argv=None):
    ap = argparse.ArgumentParser(prog="bench.py resnet", description=__doc__.split("\n")[0])
    ap.add_argument("--arch", default="resnet50", help="a timm/torchvision ResNet name (resnet18 ... resnet152)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--size", type=int, default=224, help="image height and width")
    ap.add_argument("--classes", type=int, default=1000)
    ap.add_argument("--precision", default="fp32,bf16", help="comma list of fp32, bf16")
    ap.add_argument("--formats", default="contiguous,channels_last", help="comma list of contiguous, channels_last")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps per side and setting")
    ap.add_argument("--steps", type=int, default=2, help="timed steps per round")
    ap.add_argument("--rounds", type=int, default=2, help="alternating zoo / timm rounds")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    ap.add_argument("--no-keep-memory", action="store_true",
                    help="leave glibc's default (mmap and unmap large blocks) instead of the loop's cpu_keep_memory")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from train.hardware import keep_freed_memory
    kept = False if args.no_keep_memory else keep_freed_memory()
    dtypes = {"fp32": None, "bf16": torch.bfloat16}
    precisions = [p.strip() for p in args.precision.split(",") if p.strip()]
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    for p in precisions:
        if p not in dtypes:
            ap.error(f"--precision: unknown {p!r} (choose from {', '.join(dtypes)})")
    for f in formats:
        if f not in ("contiguous", "channels_last"):
            ap.error(f"--formats: unknown {f!r} (choose from contiguous, channels_last)")

    zoo_model, timm_model = build_pair(args.arch, args.classes)
    sides = [Side("zoo", zoo_model), Side("timm", timm_model)]
    flops = zoo_model.flops_per_image(args.size)
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(args.batch, 3, args.size, args.size, generator=g)
    y = torch.randint(0, args.classes, (args.batch,), generator=g)
    print(f"resnet: {args.arch}, {zoo_model.num_params() / 1e6:.1f}M params, batch {args.batch} x 3 x {args.size} x "
          f"{args.size}, {flops / 1e9:.1f} GFLOP per training image, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, freed memory {'kept' if kept else 'returned to the OS'}; "
          f"best of {args.rounds} alternating rounds of {args.steps} steps")

    results = {}
    for p in precisions:
        for fmt in formats:
            mf = torch.channels_last if fmt == "channels_last" else torch.contiguous_format
            x = x0.contiguous(memory_format=mf)
            for s in sides:
                s.model.to(memory_format=mf)
                for _ in range(args.warmup):
                    s.step(x, y, dtypes[p])
            best = {s.name: float("inf") for s in sides}
            paired = []  # per round: timm's time / zoo's time, measured back to back
            for r in range(args.rounds):
                took = {}
                for s in (sides if r % 2 == 0 else sides[::-1]):
                    t0 = time.perf_counter()
                    for _ in range(args.steps):
                        s.step(x, y, dtypes[p])
                    took[s.name] = (time.perf_counter() - t0) / args.steps
                    best[s.name] = min(best[s.name], took[s.name])
                paired.append(took["timm"] / took["zoo"])
            results[p, fmt] = {k: args.batch / v for k, v in best.items()}
            results[p, fmt]["paired"] = statistics.median(paired)
            print(f"  {p:>4} {fmt:<13} zoo {results[p, fmt]['zoo']:7.2f} img/s   timm {results[p, fmt]['timm']:7.2f} img/s"
                  f"   zoo/timm {results[p, fmt]['zoo'] / results[p, fmt]['timm']:.3f}x (median of paired rounds "
                  f"{results[p, fmt]['paired']:.3f}x, rounds {min(paired):.3f}-{max(paired):.3f}x)", flush=True)
        for s in sides:
            s.model.to(memory_format=torch.contiguous_format)

    print()
    head = "| precision | memory format | zoo img/s | timm img/s | zoo / timm (best rounds) | median of paired rounds | zoo GFLOP/s |"
    print(head)
    print("|" + "|".join("---" for _ in range(7)) + "|")
    for (p, fmt), r in results.items():
        print(f"| {p} | {fmt} | {r['zoo']:.2f} | {r['timm']:.2f} | {r['zoo'] / r['timm']:.3f}x | {r['paired']:.3f}x | "
              f"{r['zoo'] * flops / 1e9:.1f} |")
    if "contiguous" in formats and "channels_last" in formats:
        print()
        for p in precisions:
            gains = {k: results[p, "channels_last"][k] / results[p, "contiguous"][k] for k in ("zoo", "timm")}
            verdict = "helps" if min(gains.values()) > 1.05 else "hurts" if max(gains.values()) < 0.95 else "is neutral"
            print(f"channels-last vs contiguous, {p}: zoo {gains['zoo']:.2f}x, timm {gains['timm']:.2f}x "
                  f"-> channels-last {verdict} on this CPU")
    return 0


if __name__ == "__main__":
    sys.exit(main())
