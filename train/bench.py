"""Benchmarks that print tables (never timed tests).

    python train/bench.py                # list the benchmarks
    python train/bench.py NAME [args]    # run one; `NAME --help` for its options

Each benchmark runs Zoo and the reference implementation side by side in one process and
reports their ratio, so the numbers compare like with like on the machine at hand.
"""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# name -> module (with a main(argv) function) under train/benches/
BENCHES: dict[str, str] = {
    "llm-train": "train.benches.llm_train",
    "llm-generate": "train.benches.llm_generate",
    "llm-moe": "train.benches.llm_moe",
    "llm-moe-quality": "train.benches.moe_quality",
    "llm-mod": "train.benches.llm_mod",
    "llm-mod-quality": "train.benches.mod_quality",
    "doc-mask": "train.benches.doc_mask",
    "taesd": "train.benches.taesd",
    "dit": "train.benches.dit",
    "min-snr": "train.benches.min_snr",
    "latent-cache": "train.benches.latent_cache",
    "diffusion-quality": "train.benches.diffusion_quality",
    "resnet": "train.benches.resnet",
    "drop-path": "train.benches.drop_path",
    "convnets": "train.benches.convnets",
    "convnet-recipe": "train.benches.convnet_recipe",
    "peft": "train.benches.finetune",
    "optimizers": "train.benches.optimizers",
    "lr-find": "train.benches.lr_find",
    "memory": "train.benches.memory",
    "checkpointing": "train.benches.checkpointing",
    "distributed": "train.benches.distributed",
    "report": "train.benches.report",
    "gguf": "train.benches.llm_gguf",
    "sft-packing": "train.benches.sft_packing",
    "quantized": "train.benches.quantized",
    "qat": "train.benches.qat",
    "prune": "train.benches.prune",
    "distill": "train.benches.distill",
    "convnet-ptq": "train.benches.convnet_ptq",
    "distill-quality": "train.benches.distill_quality",
    "data": "train.benches.data",
    "sft-quality": "train.benches.sft_quality",
}


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in BENCHES:
        if argv and argv[0] not in ("-h", "--help"):
            print(f"unknown benchmark '{argv[0]}'")
        print("benchmarks: " + (", ".join(sorted(BENCHES)) or "(none)"))
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    mod = importlib.import_module(BENCHES[argv[0]])
    return mod.main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
