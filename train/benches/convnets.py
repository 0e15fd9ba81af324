"""ConvNet training steps: Zoo's ConvNeXt, ConvNeXt V2, EfficientNet-B0 and MobileNetV3-Large
against timm's, same weights, batch and precision, eager and compiled, contiguous and channels-last.

    python train/bench.py convnets                                  # the four models, 64 x 3 x 224 x 224 on CUDA
    python train/bench.py convnets --batch 8 --size 64 --modes eager --rounds 8    # a CPU-sized run
    python train/bench.py convnets --archs convnext_tiny --json out.json
    python train/bench.py convnets --device cpu --batch 8 --size 64 --docs   # also docs/convnets_bench.json and docs/convnet.md's table

A training step is the resnet bench's (train/benches/resnet.py: forward, cross-entropy, backward,
SGD-momentum step, zero_grad), the models built by its build_pair (timm's random init, loaded into
Zoo). For each model, mode (eager, or torch.compile of each side's model) and memory format, the
two sides alternate `--rounds` rounds of `--steps` steps (train/benches/harness.py); the table
gives images/s of each side's best round and the median of the paired ratios (Zoo / timm speed,
> 1: Zoo faster) with their range. The numbers are written as JSON beside the table (`--json`),
after every setting, so an interrupted run keeps what it measured; `--docs` also writes them to
docs/convnets_bench.json, over the rows of the same settings already there (`merged`: a run of
some models or modes updates only their rows), and renders docs/convnet.md's table from it.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from train.benches import harness  # noqa: E402
from train.benches.resnet import Side, build_pair  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DOCS_JSON, PAGE = ROOT / "docs" / "convnets_bench.json", ROOT / "docs" / "convnet.md"
HEADER = ["model", "mode", "memory format", "precision", "zoo img/s", "timm img/s",
          "zoo speed / timm, paired median (range)", "the same on CPU time"]
ARCHS = ["convnext_tiny", "convnextv2_tiny", "efficientnet_b0", "mobilenetv3_large_100"]
MODES = ("eager", "compiled")


def table(data: dict) -> str:
    return harness.table_text(HEADER, [
        [r["arch"], r["mode"], r["format"], r["precision"], f"{r['zoo_img_s']:.1f}", f"{r['timm_img_s']:.1f}",
         f"{r['zoo_speed_over_timm_paired_median']:.2f}x ({r['range'][0]:.2f}-{r['range'][1]:.2f}x)",
         f"{r['cpu_time_paired_median']:.2f}x ({r['cpu_time_range'][0]:.2f}-{r['cpu_time_range'][1]:.2f}x)"]
        for r in data["results"]])


SETTING = ("device", "batch", "size", "threads", "torch")


def merged(old: dict, new: dict) -> dict:
    """The docs JSON after a run of some settings (e.g. `--archs convnextv2_tiny --modes compiled`):
    new's rows replace old's of the same model, mode, memory format and precision, old's other rows
    stay, when both ran at the same shape, device, threads and torch; otherwise new alone. Each row
    keeps its own date (paired ratios are measured back to back, so rows stand on their own)."""
    if any(old.get(k) != new.get(k) for k in SETTING):
        return new
    key = lambda r: (r["arch"], r["mode"], r["format"], r["precision"])  # noqa: E731
    fresh = {key(r): r for r in new["results"]}
    rows = [fresh.pop(key(r), r) for r in old["results"]] + list(fresh.values())
    return {**new, "results": rows}


def render(data: dict, page: Path = PAGE, write: bool = True) -> list[str]:
    return ["convnets"] if harness.update_docs_table(page, "convnets", table(data), write) else []


def main(argv=None):
    ap = harness.parser("convnets", __doc__, precision="bf16", keep_memory=True)
    ap.add_argument("--archs", type=harness.name_list(ARCHS, "arch"), default=",".join(ARCHS))
    ap.add_argument("--modes", type=harness.name_list(MODES, "mode"), default="eager,compiled")
    ap.add_argument("--formats", type=harness.name_list(harness.FORMATS, "memory format"),
                    default="contiguous,channels_last")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--size", type=int, default=224, help="image height and width")
    ap.add_argument("--classes", type=int, default=1000)
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per side and setting (compilation included)")
    ap.add_argument("--steps", type=harness.positive_int, default=5, help="timed steps per round")
    ap.add_argument("--json", default="runs/bench/convnets.json", help="where the numbers are written")
    ap.add_argument("--docs", action="store_true", help="also write docs/convnets_bench.json and docs/convnet.md's table")
    args = ap.parse_args(argv)
    kept = harness.setup(args)
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    print(f"convnets: batch {args.batch} x 3 x {args.size} x {args.size} on {device} "
          f"({torch.cuda.get_device_name(device) if device.type == 'cuda' else f'{torch.get_num_threads()} threads'}), "
          f"torch {torch.__version__}, freed memory {'kept' if kept else 'returned to the OS'}; "
          f"{args.rounds} alternating rounds of {args.steps} steps", flush=True)
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(args.batch, 3, args.size, args.size, generator=g).to(device)
    y = torch.randint(0, args.classes, (args.batch,), generator=g).to(device)
    out = []
    data = {"device": str(device), "batch": args.batch, "size": args.size, "torch": torch.__version__,
            "threads": torch.get_num_threads(), "results": out}
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    for mode in args.modes:  # every eager setting first: the compiled ones take far longer (compilation)
        for arch in args.archs:
            zoo_model, timm_model = (m.to(device) for m in build_pair(arch, args.classes))
            for fmt in args.formats:
                mf = harness.FORMATS[fmt]
                x = x0.contiguous(memory_format=mf)
                for m in (zoo_model, timm_model):
                    m.to(memory_format=mf)
                sides = [Side("zoo", zoo_model, device), Side("timm", timm_model, device)]
                if mode == "compiled":
                    for s in sides:
                        s.model = torch.compile(s.model)
                for p in args.precision:
                    for s in sides:
                        for _ in range(args.warmup):
                            s.step(x, y, p)
                    sync()
                    r = harness.run_rounds({s.name: (lambda s=s: s.step(x, y, p)) for s in sides}, args.rounds,
                                           calls=args.steps, sync=sync)
                    zoo_ips, timm_ips = args.batch / r.best("zoo"), args.batch / r.best("timm")
                    paired = r.paired("zoo", "timm")  # how many times faster Zoo is, round by round
                    cpu = r.paired("zoo", "timm", clock="cpu")  # the same on each side's CPU time (waits for a core left out)
                    print(f"  {arch} {mode} {fmt} {p}: zoo {zoo_ips:.1f} img/s, timm {timm_ips:.1f} img/s, "
                          f"zoo speed / timm {paired}, on CPU time {cpu}", flush=True)
                    out.append({"arch": arch, "mode": mode, "format": fmt, "precision": p, "zoo_img_s": zoo_ips,
                                "timm_img_s": timm_ips, "zoo_speed_over_timm_paired_median": paired.median,
                                "range": [paired.low, paired.high], "cpu_time_paired_median": cpu.median,
                                "cpu_time_range": [cpu.low, cpu.high], "rounds": args.rounds,
                                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                "load_average": os.getloadavg()[0]})
                    path.write_text(json.dumps(data, indent=1))
                torch._dynamo.reset()
            del zoo_model, timm_model
    print()
    print(table(data), end="")
    harness.write_results(data, path)
    if args.docs:
        docs = merged(json.loads(DOCS_JSON.read_text()), data) if DOCS_JSON.is_file() else data
        DOCS_JSON.write_text(json.dumps(docs, indent=1))
        print(f"json: {DOCS_JSON}; docs tables rewritten: {', '.join(render(docs)) or 'none (up to date)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
