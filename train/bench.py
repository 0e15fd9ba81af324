"""Benchmarks that print tables and write their numbers (never timed tests).

    python train/bench.py                # list the benchmarks
    python train/bench.py NAME [args]    # run one; `NAME --help` for its options

Each benchmark runs its sides in one process, alternating round by round (train/benches/harness.py),
and writes docs/results/NAME.json, which the tables in docs/ are rendered from (train/docs.py).
"""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# name -> the module under train/benches/ whose main(argv[, name]) runs it (", name": a preset of a merged module)
BENCHES: dict[str, str] = {
    "llm-train": "llm_speed, name", "llm-moe": "llm_speed, name", "llm-mod": "llm_speed, name",
    "doc-mask": "llm_speed, name", "llm-generate": "llm_speed, name", "gguf": "llm_speed, name",
    "llm-moe-quality": "llm_quality, name", "llm-mod-quality": "llm_quality, name", "peft": "llm_quality, name",
    "quantized": "deploy, name", "qat": "deploy, name", "prune": "deploy, name", "distill": "deploy, name",
    "distill-quality": "deploy, name", "convnet-ptq": "deploy, name",
    "resnet": "convnets, name", "convnets": "convnets, name", "drop-path": "convnets, name",
    "convnet-recipe": "convnets, name",
    "taesd": "diffusion, name", "dit": "diffusion, name", "latent-cache": "diffusion, name",
    "min-snr": "diffusion, name", "diffusion-quality": "diffusion, name",
    "optimizers": "optimizers, name", "lr-find": "optimizers, name",
    "sft-packing": "sft, name", "sft-quality": "sft, name",
    "checkpointing": "checkpointing", "distributed": "distributed", "data": "data", "memory": "memory",
    "gpu": "gpu, name", "float8": "gpu, name", "report": "report", "rollout": "rollout, name",
    "rl-quality": "rollout, name", "rl-memory": "rollout, name", "gate": "gate",
}


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in BENCHES:
        if argv and argv[0] not in ("-h", "--help"):
            print(f"unknown benchmark '{argv[0]}'")
        print("benchmarks: " + ", ".join(sorted(BENCHES)))
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    module, _, preset = BENCHES[argv[0]].partition(", ")
    mod = importlib.import_module(f"train.benches.{module}")
    return (mod.main(argv[1:], argv[0]) if preset else mod.main(argv[1:])) or 0


if __name__ == "__main__":
    sys.exit(main())
