"""Train or fine-tune any Zoo model from one config file.

    python train/run.py                                   # the embedded default (configs/llm/tiny.yaml)
    python train/run.py CONFIG.yaml [key=value ...]       # e.g. train.max_steps=200 model.n_layers=2

Exit codes: 0 done; 2 bad config or data (one-line error); 3 stopped after too many
non-finite losses in a row; 75 stopped by SIGTERM/SIGINT after writing a checkpoint
(run the same command again to resume); 130 a second Ctrl-C (stopped at once).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

DEFAULT_CONFIG = ROOT / "configs" / "llm" / "tiny.yaml"


def main(argv=None) -> int:
    from zoo.config import ConfigError

    from train.config import load_run_config
    from train.data import DataError
    from train.loop import train
    from train.step import EXIT_CONFIG, RunStopped, stop_line

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        try:
            print(__doc__.strip() + "\n\nSections and keys (each key's meaning: docs/llm.md and the family's page):\n"
                  + keys_help())
            sys.stdout.flush()
        except BrokenPipeError:  # `... --help | head`: the reader left, nothing more to say
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    path = None
    if argv and "=" not in argv[0]:
        path = argv.pop(0)
    elif DEFAULT_CONFIG.is_file():
        path = str(DEFAULT_CONFIG)
    try:
        train(load_run_config(path, argv), owns_process=True)
    except (ConfigError, DataError, FileNotFoundError, RunStopped) as e:
        print(stop_line(e), file=sys.stderr)
        return getattr(e, "code", EXIT_CONFIG)
    except KeyboardInterrupt:  # a second Ctrl-C, or one before the loop started
        print("interrupted: stopped at once, no checkpoint written (the last complete one is kept)", file=sys.stderr)
        return 130
    return 0


def keys_help() -> str:
    """Every section of a run config with its keys, briefly."""
    import dataclasses
    import textwrap

    from zoo.adapters import AdapterConfig
    from zoo.config import FAMILIES

    from train.config import OptimConfig, TrainConfig, task_class

    def keys(section: str, cls) -> str:
        names = ", ".join(f.name for f in dataclasses.fields(cls) if f.init)
        return textwrap.fill(f"{section}: {names}", 100, initial_indent="  ", subsequent_indent="      ")
    lines = [f"  family: {' | '.join(FAMILIES)}"]
    for name, family in FAMILIES.items():
        lines += [keys(f"model ({name})", family.config), keys(f"data ({name})", task_class(name).DataConfig)]
    return "\n".join(lines + [keys("train", TrainConfig), keys("optim", OptimConfig), keys("adapter", AdapterConfig)])


if __name__ == "__main__":
    code = main()
    from train.distributed import exit_process
    exit_process(code)  # under torchrun: without the interpreter's teardown (see its docstring)
