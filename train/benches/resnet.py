"""ResNet training step: Zoo's ResNet against timm's of the same architecture and weights.

    python train/bench.py resnet                               # resnet50, 16 x 3 x 224 x 224
    python train/bench.py resnet --batch 8 --size 160 --rounds 8 --arch resnet18

One training step = forward + cross-entropy + backward + SGD-momentum step (the loop's
optimizer and parameter groups, the same for both sides) + zero_grad(set_to_none), on the
same batch, in each precision (fp32, or bf16 / fp16 autocast with fp32 master weights, as the
loop runs it) with contiguous (NCHW) and channels-last (NHWC) model and batch.
Timing (train/benches/harness.py): after warm-up steps, the two sides alternate, `--rounds`
rounds of `--steps` steps each. The table gives images/s of each side's best round, Zoo / timm
of the best rounds, the median over rounds of the paired ratio (the two back-to-back timings of
a round) with its range, and what channels-last gives each side against its own contiguous run.
Allocator: like train/loop.py (`train.cpu_keep_memory`, on by default) the process keeps freed
memory (glibc: no mmap, no trim), for both sides alike, so that a step's activations are not
page-faulted in afresh every step; `--no-keep-memory` leaves glibc's default.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from train.benches import harness  # noqa: E402


def build_pair(arch: str, num_classes: int):
    """timm's model (random init) and Zoo's with the same weights, both fp32, training mode: any timm
    name Zoo's ConvNet family has (resnet*, convnext*, efficientnet_b*, mobilenetv3_*)."""
    import timm

    from zoo.convnet import build
    from zoo.weights.timm_convnet import config_from_state_dict, load_into

    torch.manual_seed(0)
    ref = timm.create_model(arch, pretrained=False, num_classes=num_classes)
    sd = ref.state_dict()
    model = build(config_from_state_dict(sd, arch))
    load_into(model, sd)
    return model.train(), ref.train()


class Side:
    def __init__(self, name, model, device=torch.device("cpu")):
        from train.config import OptimConfig
        from train.optim import build_optimizer
        self.name, self.model, self.device = name, model, device
        self.opt = build_optimizer(model, OptimConfig(name="sgd", lr=0.01, weight_decay=1e-4), device,
                                   log=lambda *a: None)

    def step(self, x, y, precision):
        with harness.autocast(precision, self.device.type):
            loss = torch.nn.functional.cross_entropy(self.model(x).float(), y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.detach()


def main(argv=None):
    ap = harness.parser("resnet", __doc__, precision="fp32,bf16", keep_memory=True)
    ap.add_argument("--arch", default="resnet50", help="a timm/torchvision ResNet name (resnet18 ... resnet152)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--size", type=int, default=224, help="image height and width")
    ap.add_argument("--classes", type=int, default=1000)
    ap.add_argument("--formats", type=harness.name_list(harness.FORMATS, "memory format"),
                    default="contiguous,channels_last", help="comma list of contiguous, channels_last")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps per side and setting")
    ap.add_argument("--steps", type=harness.positive_int, default=2, help="timed steps per round")
    args = ap.parse_args(argv)
    kept = harness.setup(args)

    zoo_model, timm_model = build_pair(args.arch, args.classes)
    sides = [Side("zoo", zoo_model), Side("timm", timm_model)]
    flops = zoo_model.flops_per_image(args.size)
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(args.batch, 3, args.size, args.size, generator=g)
    y = torch.randint(0, args.classes, (args.batch,), generator=g)
    print(f"resnet: {args.arch}, {zoo_model.num_params() / 1e6:.1f}M params, batch {args.batch} x 3 x {args.size} x "
          f"{args.size}, {flops / 1e9:.1f} GFLOP per training image, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, freed memory {'kept' if kept else 'returned to the OS'}; "
          f"{args.rounds} alternating rounds of {args.steps} steps")

    results = {}  # (precision, format) -> harness.Rounds
    for p in args.precision:
        for fmt in args.formats:
            mf = harness.FORMATS[fmt]
            x = x0.contiguous(memory_format=mf)
            for s in sides:
                s.model.to(memory_format=mf)
                for _ in range(args.warmup):
                    s.step(x, y, p)
            rounds = results[p, fmt] = harness.run_rounds(
                {s.name: (lambda s=s: s.step(x, y, p)) for s in sides}, args.rounds, calls=args.steps)
            print(f"  {p:>4} {fmt:<13} zoo {args.batch / rounds.best('zoo'):7.2f} img/s   "
                  f"timm {args.batch / rounds.best('timm'):7.2f} img/s   {rounds.summary('zoo', 'timm')}", flush=True)
        for s in sides:
            s.model.to(memory_format=torch.contiguous_format)

    print()
    harness.print_table(
        ["precision", "memory format", "zoo img/s", "timm img/s", "zoo / timm (best rounds)",
         "median of paired rounds (range)", "zoo GFLOP/s"],
        [[p, fmt, f"{args.batch / r.best('zoo'):.2f}", f"{args.batch / r.best('timm'):.2f}",
          f"{r.ratio('zoo', 'timm'):.3f}x", str(r.paired("zoo", "timm")), f"{args.batch * flops / r.best('zoo') / 1e9:.1f}"]
         for (p, fmt), r in results.items()])
    if "contiguous" in args.formats and "channels_last" in args.formats:
        print()
        for p in args.precision:
            gains = {k: results[p, "contiguous"].best(k) / results[p, "channels_last"].best(k) for k in ("zoo", "timm")}
            verdict = "helps" if min(gains.values()) > 1.05 else "hurts" if max(gains.values()) < 0.95 else "is neutral"
            print(f"channels-last vs contiguous, {p}: zoo {gains['zoo']:.2f}x, timm {gains['timm']:.2f}x "
                  f"-> channels-last {verdict} on this CPU")
    return 0


if __name__ == "__main__":
    sys.exit(main())
