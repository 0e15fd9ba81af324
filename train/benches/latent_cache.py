"""Latent cache: diffusion training images/s reading latents from the cache against encoding every step.

    python train/bench.py latent-cache                       # TAEF2, 64 px, DiT-tiny/1 and DiT-S/2, batch 8, fp32
    python train/bench.py latent-cache --size 128 --denoisers S/2 --weights PATH/taef2_encoder.pth

The autoencoder: the pretrained TAEF2 (FLUX.2's latent space, 32 channels; `--weights`, by default
../shared/weights/taef2_encoder.pth beside this checkout; when it is absent the bench says so and
stops, exit 0). The images: scikit-image's photographs cut into 48 px tiles
(train.data.images.write_photo_tiles, 354 of them), written as PNGs to a temporary image folder and
centre-cropped to --size by the diffusion task. For each denoiser (DiT preset/patch), the task's own
setup builds the latent cache once (the first denoiser's; the others reuse it: the table gives the
setup's time, the one-off cost), then two sides train
copies of the same denoiser (same initial weights, each its own AdamW):
  cache    a step is task.train_batch (the batch's rows read from the cache's memmap and standardised:
           the loop's path) + the training step;
  encode   a step draws the same rows as pixels, already decoded and cropped in memory (so PNG
           decoding is left out, which favours this side), encodes them with the frozen autoencoder
           under no_grad, standardises them + the same training step.
Training step: loss forward + backward + AdamW step + zero_grad(set_to_none), in each --precision
(autocast, fp32 master weights). Timing (train/benches/harness.py): one warm-up step per side, then
the sides alternate for --rounds rounds of --steps steps; images/s of each side's best round and
the median of the paired ratios (encode's time over cache's: the speed-up). JSON to --json.
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from train.benches import harness  # noqa: E402
from train.hardware import sync  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TAEF2 = ROOT.parent / "shared" / "weights" / "taef2_encoder.pth"


def denoiser_name(text: str) -> list[tuple[str, int]]:
    """An argparse type: a comma list of DiT preset/patch names, e.g. tiny/1,S/2."""
    from zoo.config import DIT_PRESETS
    out = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        preset, _, patch = item.partition("/")
        if preset not in DIT_PRESETS or not patch.isdigit() or int(patch) < 1:
            raise argparse.ArgumentTypeError(f"not a DiT preset/patch: {item!r} (e.g. tiny/1, S/2; presets "
                                             f"{', '.join(DIT_PRESETS)})")
        out.append((preset, int(patch)))
    return out


def run_config(folder: Path, weights: Path, size: int, preset: str, patch: int, batch: int, device: str):
    from train.config import load_run_config
    base = {"family": "diffusion",
            "model": {"image_size": size, "num_classes": 4, "denoiser": "dit", "dit": {"preset": preset, "patch_size": patch},
                      "autoencoder": {"weights": str(weights), "latent_channels": 32, "midblock_gn": True}},
            "data": {"dataset": str(folder / "tiles"), "cache_dir": str(folder / "cache")},
            "train": {"out_dir": str(folder / "run"), "batch_size": batch, "device": device, "progress": False}}
    return load_run_config(None, [], base=base)


def main(argv=None):
    ap = harness.parser("latent-cache", __doc__, precision="fp32", keep_memory=True)
    ap.add_argument("--weights", type=Path, default=TAEF2, help=f"the TAEF2 encoder (default {TAEF2})")
    ap.add_argument("--size", type=harness.positive_int, default=64, help="image size in pixels (default 64)")
    ap.add_argument("--denoisers", type=denoiser_name, default="tiny/1,S/2", help="DiT preset/patch list (default tiny/1,S/2)")
    ap.add_argument("--batch", type=harness.positive_int, default=8)
    ap.add_argument("--steps", type=harness.positive_int, default=2, help="timed steps per round")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", default="runs/bench/latent-cache.json", help="where the numbers are written")
    args = ap.parse_args(argv)
    if not args.weights.is_file():
        print(f"latent-cache: skipped: {args.weights} is absent (the TAEF2 weights; pass --weights)")
        return 0
    kept = harness.setup(args)
    from train.data.images import write_photo_tiles
    from train.tasks.diffusion import DiffusionTask, load_images

    device, B = torch.device(args.device), args.batch
    print(f"latent-cache: TAEF2 ({args.weights}), {args.size} px photo tiles, batch {B}, device {device}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, freed memory "
          f"{'kept' if kept else 'returned to the OS'}; {args.rounds} alternating rounds of {args.steps} steps", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        n_images = write_photo_tiles(tmp / "tiles")
        for preset, patch in args.denoisers:
            cfg = run_config(tmp, args.weights, args.size, preset, patch, B, args.device)
            logs = []
            task = DiffusionTask(cfg, device, log=logs.append)
            t0 = time.perf_counter()
            task.setup()                                   # the cache: built by the first denoiser, reused after
            setup_s = time.perf_counter() - t0
            cache = "reused" if any(m.startswith("latents: reusing") for m in logs) else "built"
            data = load_images(cfg.data, args.size, cfg.source)
            pixels = data.read("train", 0, len(data.labels["train"])).to(device)
            ae = task.autoencoder.to(device).eval()
            base = task.build_model().to(device)
            models = {s: copy.deepcopy(base).train() for s in ("cache", "encode")}
            opts = {s: torch.optim.AdamW(m.denoiser.parameters(), lr=1e-4) for s, m in models.items()}

            def encoded_batch(step):                       # train_batch's rows, as pixels, encoded now
                g = task.batch_generator(step, 0)
                idx = torch.randint(len(pixels), (B,), generator=g)
                with torch.no_grad():
                    z = task._normalised(ae.encode(pixels[idx.to(device)]))
                return task._noised(z, task.y_tr[idx.to(device)], g, cfg.model.class_dropout)

            batches = {"cache": lambda step: task.train_batch(step, 0), "encode": encoded_batch}
            counter = {"cache": 0, "encode": 0}
            for p in args.precision:
                def step(side, p=p):
                    counter[side] += 1
                    batch = batches[side](counter[side])
                    with harness.autocast(p, device.type):
                        loss, _ = task.loss(models[side], batch)
                    loss.backward()
                    opts[side].step()
                    opts[side].zero_grad(set_to_none=True)

                for side in models:                        # warm-up
                    step(side)
                sync(device)
                r = harness.run_rounds({s: (lambda s=s: step(s)) for s in models}, args.rounds, calls=args.steps,
                                       sync=lambda: sync(device))
                pm = r.paired("cache", "encode")
                rows.append({"denoiser": f"DiT-{preset}/{patch}", "params_M": base.num_params() / 1e6,
                             "precision": p, "setup_s": setup_s, "cache": cache, "cache_images_per_s": B / r.best("cache"),
                             "encode_images_per_s": B / r.best("encode"), "paired_median": pm.median,
                             "paired_low": pm.low, "paired_high": pm.high, "cache_s": r.wall["cache"],
                             "encode_s": r.wall["encode"]})
                print(f"  DiT-{preset}/{patch} {p}: cache {B / r.best('cache'):.2f} img/s, encode every step "
                      f"{B / r.best('encode'):.2f} img/s; {r.summary('cache', 'encode')}", flush=True)
    print(f"\n{n_images} images ({len(data.labels['train'])} train), latents {task.latents.shape} per image\n")
    harness.print_table(["denoiser", "precision", "cache img/s", "encode-every-step img/s", "speed-up, paired median (range)",
                         "setup: latent cache (s)"],
                        [[w["denoiser"], w["precision"], f"{w['cache_images_per_s']:.2f}", f"{w['encode_images_per_s']:.2f}",
                          f"{w['paired_median']:.2f}x ({w['paired_low']:.2f}-{w['paired_high']:.2f}x)",
                          f"{w['cache']} ({w['setup_s']:.1f})"] for w in rows])
    out = Path(args.json)
    from zoo.weights.files import atomic_write
    atomic_write(out, json.dumps({"bench": "latent-cache", "args": vars(args), "torch": torch.__version__,
                                  "threads": torch.get_num_threads(), "images": n_images, "rows": rows},
                                 indent=1, default=str))
    print(f"\nwritten: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
