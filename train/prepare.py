"""Prepare a run's text data ahead of training: tokenise every source into the cache.

    python train/prepare.py CONFIG.yaml [key=value ...]     # e.g. data.path=corpus.jsonl data.workers=2

Then `train/run.py` with the same config starts at once. Killed midway, the same command resumes.
Exit codes: 0 done; 2 bad config or data (one-line error).
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    from zoo.config import ConfigError

    from train.config import load_run_config
    from train.data import DataError, TextDataConfig, TokenData

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    path = argv.pop(0) if "=" not in argv[0] else None
    try:
        cfg = load_run_config(path, argv)
        if not isinstance(cfg.data, TextDataConfig):
            what = f"data.format={cfg.data.format} (its rows are tokenised as the run starts)" \
                if cfg.family == "llm" else f"family {cfg.family}"
            raise ConfigError(f"{cfg.source}: {what}: no text to prepare ahead")
        tokenizer = None
        if cfg.train.init_from and cfg.data.tokenizer == "sentencepiece":
            from train.tasks.lm import LMTask
            import torch
            tokenizer = LMTask(cfg, torch.device("cpu"), print)._pretrained_tokenizer()
        TokenData(cfg.data, tokenizer, print, progress=True)
    except (ConfigError, DataError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
