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
PRESETS = {"llm_speed": "llm-train llm-moe llm-mod doc-mask llm-generate gguf vlm",
           "llm_quality": "llm-moe-quality llm-mod-quality peft",
           "deploy": "quantized qat prune distill distill-quality convnet-ptq",
           "convnets": "resnet convnets drop-path convnet-recipe vit",
           "diffusion": "taesd dit flux2 latent-cache min-snr diffusion-quality prompt-adherence dreambooth",
           "optimizers": "optimizers lr-find",
           "sft": "sft-packing sft-quality vlm-quality", "gpu": "gpu float8 bf16-pure", "rollout": "rollout rl-quality rl-memory",
           "data": "data tokenizers", "mup": "mup-coord mup-transfer"}
BENCHES: dict[str, str] = {**{n: f"{m}, name" for m, names in PRESETS.items() for n in names.split()},
                           **{m: m for m in ("checkpointing", "distributed", "memory", "report", "gate",
                                             "speedrun", "superbpe")}}


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in BENCHES:
        if argv and argv[0] not in ("-h", "--help"):
            print(f"unknown benchmark '{argv[0]}'")
        print("benchmarks: " + ", ".join(sorted(BENCHES)))
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    from zoo.config import ConfigError
    from train.data import DataError
    module, _, preset = BENCHES[argv[0]].partition(", ")
    mod = importlib.import_module(f"train.benches.{module}")
    try:
        return (mod.main(argv[1:], argv[0]) if preset else mod.main(argv[1:])) or 0
    except (ConfigError, DataError, FileNotFoundError) as e:  # a bad config, data file or model folder: one line
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
