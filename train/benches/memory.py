"""The memory planner against measured peaks: predicted and measured memory of a training step.

    python train/bench.py memory                     # every configuration below
    python train/bench.py memory --only llm          # the configurations whose name starts with llm
    python train/bench.py memory --precision fp32    # those in fp32 (the precision is in each name)
    python train/bench.py memory --planner-time      # + how long the planner takes on the large presets

For each configuration, `train.plan.plan` predicts the peak of a steady-state training step
(fake tensors, nothing allocated) and `train.plan.measure` measures it in a fresh process on the
CPU: two warm-up steps of the loop's own step function, freed memory returned to the OS, the
kernel's high-water mark reset (/proc/self/clear_refs), one step; measured = high-water mark -
RSS at rest + the bytes of the tensors alive at rest (parameters, buffers, optimizer state,
batch), i.e. the step's memory without what the process holds for torch itself. Both raw
figures are printed too. Linux only (/proc).
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from train.benches import harness  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
LLM = {"family": "llm",
       "model": {"vocab_size": 4096, "d_model": 256, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "max_seq_len": 256},
       "data": {"tokenizer": "bytes", "seq_len": 256}, "train": {"batch_size": 16, "precision": "fp32"}}

# name -> (base config: a dict or a path under configs/, overrides)
CONFIGS = {
    "llm fp32 adamw chunked": (LLM, []),
    "llm fp32 adamw full-loss": (LLM, ["train.chunked_loss=false"]),
    "llm fp32 adamw chunked ckpt": (LLM, ["train.activation_checkpointing=true"]),
    "llm bf16 adamw chunked": (LLM, ["train.precision=bf16"]),
    "llm bf16 adamw full-loss ckpt": (LLM, ["train.precision=bf16", "train.chunked_loss=false",
                                           "train.activation_checkpointing=true"]),
    "llm fp32 adamw8bit chunked": (LLM, ["optim.name=adamw8bit"]),
    "llm bf16 adamw8bit full-loss": (LLM, ["optim.name=adamw8bit", "train.precision=bf16", "train.chunked_loss=false"]),
    "diffusion fp32 adamw": ("diffusion/digits.yaml", ["train.batch_size=256"]),
    "diffusion bf16 adamw": ("diffusion/digits.yaml", ["train.batch_size=256", "train.precision=bf16"]),
    "diffusion fp32 adamw8bit": ("diffusion/digits.yaml", ["train.batch_size=256", "optim.name=adamw8bit"]),
    "diffusion fp32 adamw selective-ckpt": ("diffusion/digits.yaml", ["train.batch_size=256",
                                                                      "train.activation_checkpointing=selective"]),
    "convnet fp32 adamw (width 64)": ("convnet/resnet-digits.yaml", ["model.width=64"]),
    "convnet bf16 adamw (width 64)": ("convnet/resnet-digits.yaml", ["model.width=64", "train.precision=bf16"]),
    "convnet fp32 adamw ckpt (width 64)": ("convnet/resnet-digits.yaml", ["model.width=64",
                                                                          "train.activation_checkpointing=true"]),
    "convnet fp32 adamw (resnet-digits)": ("convnet/resnet-digits.yaml", []),
}
LARGE = ["llm/llama2-7b.yaml", "llm/mixtral-8x7b.yaml"]


def base_of(spec):
    from zoo.config import load_yaml
    return load_yaml(ROOT / "configs" / spec) if isinstance(spec, str) else spec


def main(argv=None):
    p = harness.parser("memory", __doc__, precision="fp32,bf16", rounds=False)
    p.add_argument("--only", default="", help="run the configurations whose name starts with this")
    p.add_argument("--planner-time", action="store_true", help="also time the planner on the large presets")
    args = p.parse_args(argv)
    from train.config import load_run_config
    from train.plan import GiB, MiB, measure_in_subprocess, plan
    names = [n for n in CONFIGS if n.startswith(args.only) and n.split()[1] in args.precision]
    if not names:
        p.error(f"no configuration starts with {args.only!r} (names: {', '.join(CONFIGS)})")
    rows = []
    for name in names:
        spec, over = CONFIGS[name]
        base = base_of(spec)
        predicted = plan(load_run_config(None, over, base=base)).peak_bytes
        m = measure_in_subprocess(base, over, threads=args.threads or 0)
        rows.append([name, f"{predicted / MiB:.1f}", f"{m['peak'] / MiB:.1f}", f"{predicted / m['peak']:.3f}",
                     f"{m['rest_rss'] / MiB:.0f}", f"{m['hwm'] / MiB:.0f}", f"{m['live'] / MiB:.1f}"])
        print(f"{name}: predicted {predicted / MiB:.1f} MiB, measured {m['peak'] / MiB:.1f} MiB", flush=True)
    harness.print_table(["configuration", "predicted MiB", "measured MiB", "predicted / measured", "RSS at rest MiB",
                         "high-water mark MiB", "tensors at rest MiB"], rows)
    if args.planner_time:
        rows = []
        for spec in LARGE:
            t0 = time.perf_counter()
            q = plan(load_run_config(str(ROOT / "configs" / spec)))
            rows.append([spec, f"{time.perf_counter() - t0:.1f}", f"{q.peak_bytes / GiB:.1f}",
                         f"{q.breakdown['params'] / GiB:.1f}"])
        harness.print_table(["preset", "planner seconds", "predicted peak GiB", "params GiB"], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
