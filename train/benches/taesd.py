"""TAESD encode + decode throughput: Zoo against diffusers' AutoencoderTiny, same weights.

    python train/bench.py taesd [--size 512] [--batch 1] [--iters 3] [--latent-channels 4]

Both models hold the same random weights (diffusers' saved and loaded into Zoo). Each timed call
is one encode plus one decode of a batch, through each library's own API (diffusers takes and
returns [-1, 1] images, Zoo [0, 1]). Zoo and the reference alternate call by call and the median
of each is reported, so load from other processes hits both alike. Settings: fp32 and bf16
weights and inputs, contiguous and channels-last memory formats.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch


def _time(fn, x) -> float:
    t0 = time.perf_counter()
    with torch.inference_mode():
        fn(x)
    return time.perf_counter() - t0


def main(argv=None):
    ap = argparse.ArgumentParser(prog="bench.py taesd", description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=int, default=512)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--iters", type=int, default=3, help="timed calls per implementation and setting")
    ap.add_argument("--latent-channels", type=int, default=4)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--settings", default="fp32,bf16:contiguous,channels_last",
                    help="dtypes:memory formats, comma-separated lists")
    args = ap.parse_args(argv)
    from diffusers import AutoencoderTiny

    import zoo

    device = torch.device(args.device)
    torch.manual_seed(0)
    ref = AutoencoderTiny(latent_channels=args.latent_channels).eval()
    with tempfile.TemporaryDirectory() as d:
        ref.save_pretrained(d)
        ours = zoo.from_pretrained(d).eval()

    dtypes, formats = (s.split(",") for s in args.settings.split(":"))
    print(f"TAESD encode+decode, {args.batch}x3x{args.size}x{args.size}, latent channels {args.latent_channels}, "
          f"device {device}, {torch.get_num_threads()} threads, median of {args.iters} interleaved calls")
    print(f"{'dtype':6} {'memory format':14} {'zoo img/s':>10} {'diffusers img/s':>16} {'ratio':>7} {'max |diff|':>11}")
    rows = []
    for dt_name in dtypes:
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dt_name]
        for fmt_name in formats:
            fmt = {"contiguous": torch.contiguous_format, "channels_last": torch.channels_last}[fmt_name]
            a = ours.to(device, dtype, memory_format=fmt)
            b = ref.to(device, dtype, memory_format=fmt)
            x = torch.rand(args.batch, 3, args.size, args.size, generator=torch.Generator().manual_seed(1))
            x = x.to(device, dtype).contiguous(memory_format=fmt)
            run_zoo = lambda im: a.decode(a.encode(im))  # noqa: E731
            run_ref = lambda im: b.decode(b.encode(im * 2 - 1).latents).sample  # noqa: E731
            with torch.inference_mode():
                diff = (run_zoo(x).float() * 2 - 1 - run_ref(x).float()).abs().max().item()  # also the warm-up
            tz, tr = [], []
            for _ in range(args.iters):
                tz.append(_time(run_zoo, x))
                tr.append(_time(run_ref, x))
            z_ips, r_ips = args.batch / statistics.median(tz), args.batch / statistics.median(tr)
            rows.append((dt_name, fmt_name, z_ips, r_ips))
            print(f"{dt_name:6} {fmt_name:14} {z_ips:10.3f} {r_ips:16.3f} {z_ips / r_ips:6.2f}x {diff:11.2e}", flush=True)
    worst = min(z / r for *_, z, r in rows)
    print(f"worst ratio: {worst:.2f}x (target >= 1.0x)")
    return 0
