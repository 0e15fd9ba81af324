"""Train or fine-tune any Zoo model from one config file.

    python train/run.py                                   # the embedded default (configs/llm/tiny.yaml)
    python train/run.py CONFIG.yaml [key=value ...]       # e.g. train.max_steps=200 model.n_layers=2

Exit codes: 0 done; 2 bad config or data (one-line error); 3 stopped after too many
non-finite losses in a row; 75 stopped by SIGTERM/SIGINT after writing a checkpoint
(run the same command again to resume); 130 a second Ctrl-C (stopped at once).
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

DEFAULT_CONFIG = ROOT / "configs" / "llm" / "tiny.yaml"
USAGE = "usage: python train/run.py [CONFIG.yaml] [key=value ...]"


def main(argv=None) -> int:
    from zoo.config import ConfigError

    from train.config import load_run_config
    from train.data import DataError
    from train.loop import train
    from train.step import EXIT_CONFIG, RunStopped

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0
    path = None
    if argv and "=" not in argv[0]:
        path = argv.pop(0)
    elif DEFAULT_CONFIG.is_file():
        path = str(DEFAULT_CONFIG)
    try:
        cfg = load_run_config(path, argv)
        train(cfg, owns_process=True)
    except (ConfigError, DataError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except RunStopped as e:
        print(f"{'error: ' if e.code != 75 else ''}{e}", file=sys.stderr)
        return e.code
    except KeyboardInterrupt:  # a second Ctrl-C, or one before the loop started
        print("interrupted: stopped at once, no checkpoint written (the last complete one is kept)",
              file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    code = main()
    from train.distributed import exit_process
    exit_process(code)  # under torchrun: without the interpreter's teardown (see its docstring)
