"""Experiment tracking: the rows of <out_dir>/metrics.jsonl, also sent to TensorBoard or W&B.

`train.tracker`: none | tensorboard | wandb. The loop hands every row it writes to metrics.jsonl
(training, evaluation and non-finite rows) to `Tracker.log`, so the tracker holds the same
numbers at the same steps; the resolved run config is logged as the hyperparameters.

- tensorboard: `torch.utils.tensorboard.SummaryWriter`, event files in <out_dir>/tensorboard/,
  one scalar per metrics.jsonl key (the key is the tag), stored as float32. A resumed
  run drops the events from the checkpoint's step on (purge_step) and writes again the rows
  metrics.jsonl keeps at that step, the way metrics.jsonl drops the rows logged after the
  checkpoint: a curve is never doubled.
- wandb: files in <out_dir>/wandb/, offline unless `train.tracker_mode` (or $WANDB_MODE) says
  otherwise; offline, nothing goes to the network (`wandb sync` uploads the run later). W&B's
  step is the training step. The run id is kept in <out_dir>/wandb/run_id: a resumed run
  continues the same W&B run.

The packages are optional extras; `missing_package` is the config-time check.
"""
from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

from zoo.config import ConfigError
from zoo.weights.files import atomic_write

PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}  # tracker -> the package (and extra) it needs


def missing_package(tracker: str, key: str = "train.tracker"):
    """The one-line error for a tracker whose package is not installed, else None."""
    name = PACKAGES.get(tracker)
    if name is None:
        return None
    try:
        found = importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # blocked, or a half-imported module
        found = False
    return None if found else f"{key}={tracker} needs the {name} package: pip install -e '.[{name}]'"


class Tracker:
    """The tracker of train.tracker=none: `log` and `close` do nothing. A context manager whose
    exit closes it (with the exit code of the exception that ended the run, if one did)."""

    def log(self, row: dict):
        pass

    def close(self, exit_code: int = 0):
        pass

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.close(0 if exc is None else getattr(exc, "code", 1))


class TensorBoardTracker(Tracker):
    def __init__(self, cfg, out: Path, start: int, kept: list = ()):
        try:
            from torch.utils.tensorboard import SummaryWriter
            from torch.utils.tensorboard.summary import hparams
        except ImportError as e:
            raise ConfigError(f"{missing_package('tensorboard') or 'train.tracker=tensorboard'} ({e})") from None
        # purge_step: TensorBoard hides the events at steps >= start written before this one
        self.writer = SummaryWriter(str(out / "tensorboard"), purge_step=start)
        flat = _flatten(cfg.to_dict())
        _, session_start, _ = hparams({k: v if isinstance(v, (int, float, str)) else json.dumps(v)
                                       for k, v in flat.items()}, {})
        self.writer.file_writer.add_summary(session_start)
        self.writer.add_text("config", "\n".join(f"    {k}: {json.dumps(v)}" for k, v in flat.items()), start)
        for row in kept:  # the rows the run's files keep at the purged step
            self.log(row)

    def log(self, row: dict):
        for k, v in row.items():
            if k != "step" and isinstance(v, (int, float)):
                self.writer.add_scalar(k, float(v), row["step"])  # float32: TensorBoard's data server reads no float64
            elif isinstance(v, list):  # one number per layer (e.g. moe_load_max): a scalar each, k/0, k/1, ...
                for i, x in enumerate(v):
                    if isinstance(x, (int, float)):
                        self.writer.add_scalar(f"{k}/{i}", float(x), row["step"])
        self.writer.flush()  # a killed run loses no row that metrics.jsonl has

    def close(self, exit_code: int = 0):
        self.writer.close()


class WandbTracker(Tracker):
    def __init__(self, cfg, out: Path, start: int):
        try:
            import wandb
        except ImportError as e:
            raise ConfigError(f"{missing_package('wandb') or 'train.tracker=wandb'} ({e})") from None
        t = cfg.train
        mode = t.tracker_mode or os.environ.get("WANDB_MODE") or "offline"
        id_file = out / "wandb" / "run_id"
        run_id = id_file.read_text().strip() if start and id_file.is_file() else None  # fresh start: a new run
        # the process-wide settings too: wandb's own telemetry follows them, not the run's
        wandb.setup(wandb.Settings(mode=mode))
        try:
            self.run = wandb.init(project=t.tracker_project or "zoo", name=out.resolve().name, id=run_id,
                                  resume="allow", dir=str(out), mode=mode, config=cfg.to_dict())
        except wandb.errors.Error as e:  # e.g. online without an API key
            raise ConfigError(f"train.tracker=wandb ({mode}): {str(e).strip().splitlines()[0]}") from None
        if self.run.id != run_id:
            atomic_write(id_file, self.run.id + "\n")

    def log(self, row: dict):
        self.run.log({k: v for k, v in row.items() if k != "step"}, step=row["step"])

    def close(self, exit_code: int = 0):
        self.run.finish(exit_code=exit_code)


def open_tracker(cfg, out: Path, start: int, kept: list = ()) -> Tracker:
    """The tracker of cfg.train.tracker for a run in `out` that starts (or resumes) at `start`;
    kept: the metrics rows of step `start` already logged (a tracker that purges that step logs
    them again)."""
    kind = cfg.train.tracker
    if kind == "tensorboard":
        return TensorBoardTracker(cfg, out, start, kept)
    if kind == "wandb":
        return WandbTracker(cfg, out, start)
    return Tracker()


def _flatten(d: dict, prefix: str = "") -> dict:
    flat = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            flat.update(_flatten(v, f"{prefix}{k}."))
        else:
            flat[f"{prefix}{k}"] = v
    return flat
