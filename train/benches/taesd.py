"""TAESD encode + decode throughput: Zoo against diffusers' AutoencoderTiny, same weights.

    python train/bench.py taesd [--size 512] [--batch 1] [--rounds 8] [--latent-channels 4]
    python train/bench.py taesd --precision bf16 --formats channels_last

Both models hold the same random weights (diffusers' saved and loaded into Zoo). Each timed call
is one encode plus one decode of a batch, through each library's own API (diffusers takes and
returns [-1, 1] images, Zoo [0, 1]). Settings: each precision (the weights and inputs in fp32,
bf16 or fp16) with contiguous and channels-last memory formats. Timing (train/benches/harness.py):
after one warm-up call each (which also gives the largest difference of the two outputs), the
two sides alternate for `--rounds` rounds; the table gives images/s of each side's best round,
the ratio of the best rounds and the median of the paired ratios with its range.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from train.benches import harness  # noqa: E402
from train.hardware import sync  # noqa: E402


def main(argv=None):
    ap = harness.parser("taesd", __doc__, precision="fp32,bf16")
    ap.add_argument("--iters", dest="rounds", type=harness.positive_int, default=argparse.SUPPRESS,
                    help=argparse.SUPPRESS)  # the earlier name of --rounds
    ap.add_argument("--size", type=int, default=512)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--latent-channels", type=int, default=4)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--formats", type=harness.name_list(harness.FORMATS, "memory format"),
                    default="contiguous,channels_last", help="comma list of contiguous, channels_last")
    args = ap.parse_args(argv)
    harness.setup(args)
    from diffusers import AutoencoderTiny

    import zoo

    device = torch.device(args.device)
    torch.manual_seed(0)
    ref = AutoencoderTiny(latent_channels=args.latent_channels).eval()
    with tempfile.TemporaryDirectory() as d:
        ref.save_pretrained(d)
        ours = zoo.from_pretrained(d).eval()

    print(f"TAESD encode+decode, {args.batch}x3x{args.size}x{args.size}, latent channels {args.latent_channels}, "
          f"device {device}, {torch.get_num_threads()} threads, {args.rounds} alternating rounds")
    rows, worst = [], float("inf")
    for prec in args.precision:
        dtype = harness.PRECISIONS[prec]
        for fmt in args.formats:
            mf = harness.FORMATS[fmt]
            a = ours.to(device, dtype, memory_format=mf)
            b = ref.to(device, dtype, memory_format=mf)
            x = torch.rand(args.batch, 3, args.size, args.size, generator=torch.Generator().manual_seed(1))
            x = x.to(device, dtype).contiguous(memory_format=mf)
            sides = {"zoo": lambda: a.decode(a.encode(x)),
                     "diffusers": lambda: b.decode(b.encode(x * 2 - 1).latents).sample}
            with torch.inference_mode():
                diff = (sides["zoo"]().float() * 2 - 1 - sides["diffusers"]().float()).abs().max().item()  # warm-up
                rounds = harness.run_rounds(sides, args.rounds, sync=lambda: sync(device))
            worst = min(worst, rounds.paired("zoo", "diffusers").median)
            rows.append([prec, fmt, f"{args.batch / rounds.best('zoo'):.3f}", f"{args.batch / rounds.best('diffusers'):.3f}",
                         f"{rounds.ratio('zoo', 'diffusers'):.2f}x", str(rounds.paired("zoo", "diffusers")), f"{diff:.2e}"])
            print(f"  {prec} {fmt}: {rounds.summary('zoo', 'diffusers')}", flush=True)
    print()
    harness.print_table(["precision", "memory format", "zoo img/s", "diffusers img/s", "zoo / diffusers (best rounds)",
                         "median of paired rounds (range)", "max abs diff"], rows)
    print(f"\nlowest paired median: {worst:.2f}x (target >= 1.0x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
