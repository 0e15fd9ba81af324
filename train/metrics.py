"""The run's metrics: two JSON-lines files, the tracker, the progress bar and the throughput window.

    <out_dir>/metrics.jsonl   what the run computed (loss, LR, grad norm, task numbers, evaluations);
                              a resumed run writes the same bytes as an uninterrupted one
    <out_dir>/speed.jsonl     what the machine measured: items/s, step time, data wait, MFU, peak memory

`read_rows(out_dir)` merges both by step. Trackers (`train.tracker`: tensorboard in
<out_dir>/tensorboard/, wandb offline in <out_dir>/wandb/, mlflow in <out_dir>/mlruns/) get the same rows; a
resumed run drops the rows from the checkpoint's step on (MLflow: keeps them, logs the steps it lacks), so a curve
is never doubled. Only rank 0 writes.
"""
from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys
import time
from pathlib import Path

import torch

from zoo.config import ConfigError
from zoo.weights.files import atomic_write

from .config import missing_package
from .hardware import measure_peak_flops, peak_memory_gb, vendor_peak_flops
from .optim import micro_batches
from .step import noise_parts

METRICS, SPEED = "metrics.jsonl", "speed.jsonl"


def read_rows(out_dir) -> list[dict]:
    """metrics.jsonl's rows, each training row merged with speed.jsonl's row of the same step."""
    out = Path(out_dir)
    rows = [json.loads(l) for l in (out / METRICS).read_text().splitlines() if l.strip()]
    speed = {r["step"]: r for r in map(json.loads, (out / SPEED).read_text().splitlines()) if r} \
        if (out / SPEED).is_file() else {}
    return [{**r, **speed.get(r["step"], {})} if "loss" in r else r for r in rows]


def truncate(path: Path, step: int, finished: bool = False):
    """On resume, drop the rows logged after the checkpoint (logged again) and a killed writer's torn last line;
    resuming a finished run (checkpoint at the last step), its final evaluation rows too; starting over, all."""
    if not path.exists():
        return
    keep = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
            s = row.get("step", 0)
        except (ValueError, AttributeError):
            continue
        if s < step or (s == step and step and not (finished and "loss" not in row and "nonfinite" not in row
                                           and "step_time_s" not in row)):
            keep.append(line)
    atomic_write(path, "".join(l + "\n" for l in keep))


class Metrics(contextlib.AbstractContextManager):
    """Owns metrics.jsonl, speed.jsonl, the tracker, the progress bar and the logging window; a context manager."""

    def __init__(self, run, out: Path, start: int, say):
        t = run.cfg.train
        self.run, self.out, self.say, self.t = run, out, say, t
        self.main, self.unit, self.last = run.par.main, run.task.unit, {}
        self.window = {"loss": 0.0, "n": 0, "items": 0, "time": 0.0, "wait": 0.0}
        self.nonfinite_streak, self.nonfinite_total, self.overflow_total = 0, 0, 0
        if self.main:
            for name in (METRICS, SPEED):
                truncate(out / name, start, finished=start >= t.max_steps)
        vendor = None if t.peak_flops else vendor_peak_flops(run.device, run.amp_dtype)
        self.peak = t.peak_flops or (vendor[1] if vendor else self._measure_peak())
        self.remeasured = vendor is not None  # a vendor's peak is never measured again
        with torch.random.fork_rng(devices=[]):
            self.fpi = run.task.flops_per_item(run.model)
        say(f"mfu: peak {_flops(self.peak)} ("
            + ("configured" if t.peak_flops else f"{vendor[0]}, the vendor's dense figure; a matmul measured "
               f"{_flops(self._measure_peak())}" if vendor else "measured matmul") + ")")
        self._stack, self.files, self.tracker = contextlib.ExitStack(), {}, None
        if self.main:
            self.files = {n: self._stack.enter_context(open(out / n, "a")) for n in (METRICS, SPEED)}
            kept = [r for r in read_rows(out) if r["step"] == start] if start and (out / METRICS).exists() else []
            self.tracker = self._stack.enter_context(open_tracker(run.cfg, out, start, kept))
        from tqdm import tqdm
        self.bar = tqdm(total=t.max_steps, initial=start, disable=not (t.progress and self.main),
                        dynamic_ncols=True, unit="step", file=sys.stderr)

    def record(self, row: dict, speed: dict | None = None):
        """A row of metrics.jsonl (and, for a training row, its measured part in speed.jsonl)."""
        self.last.update({**row, **(speed or {})})
        if not self.main:
            return
        self.files[METRICS].write(json.dumps(row) + "\n")
        self.files[METRICS].flush()
        if speed:
            self.files[SPEED].write(json.dumps({"step": row["step"], **speed}) + "\n")
            self.files[SPEED].flush()
        self.tracker.log({**row, **(speed or {})})

    def evaluation(self, step: int, ev: dict, say: bool = True):
        self.record({"step": step, **ev})
        if say:
            self.say(f"step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in ev.items()))

    def step(self, done: int, lr: float, r, seconds: float, data_wait: float = 0.0):
        """Account one optimizer step (a StepResult, its seconds, data_wait of them for batches); log the window."""
        t, w = self.t, self.window
        if r.overflow:  # fp16: the GradScaler skipped the step and lowered its scale; not a failure
            self.overflow_total += 1
        if r.finite:
            self.nonfinite_streak = 0
            w["loss"] += r.loss
            w["n"] += 1
        else:
            self.nonfinite_streak += 1
            self.nonfinite_total += 1
            self.say(f"step {done}: non-finite loss/grad norm ({r.loss}, {r.grad_norm}); step skipped "
                     f"({self.nonfinite_streak} in a row, {self.nonfinite_total} in all)")
            self.record({"step": done, "nonfinite": True, "skipped_steps": self.nonfinite_total})
        w["items"] += r.items
        if r.micro_sq is not None and r.finite:  # train.log_noise_scale
            b = t.batch_size  # examples per micro-batch and rank
            g2, trace = noise_parts(r.micro_sq, r.grad_norm ** 2, b, b * self.run.par.dp_world *
                                    micro_batches(done - 1, t.grad_accum, t.batch_warmup_steps))
            w["g2"], w["trace"] = w.get("g2", 0.0) + g2, w.get("trace", 0.0) + trace
        w["time"] += seconds
        w["wait"] += data_wait
        self.bar.update(1)
        if done % t.log_every == 0 or done == t.max_steps:
            self._log(done, lr, r)

    def _log(self, done, lr, r):
        w, par = self.window, self.run.par
        rate = w["items"] * par.dp_world / max(w["time"], 1e-9)  # global: every data-parallel rank covers as many
        row = {"step": done, "loss": w["loss"] / w["n"] if w["n"] else float("nan"), "lr": lr,
               "grad_norm": r.grad_norm, **self.run.task.train_metrics()}
        if self.nonfinite_total:
            row["skipped_steps"] = self.nonfinite_total
        if "g2" in w:  # B_simple in examples, over the window's steps
            row["noise_scale"] = w["trace"] / w["g2"]
        if (scaler := self.run.scaler) is not None and scaler.is_enabled():
            row["loss_scale"] = scaler.get_scale()
            row["overflow_steps"] = self.overflow_total
        steps = max(1, w["n"] + (0 if r.finite else 1))
        speed = {f"{self.unit}_per_s": rate, "step_time_s": w["time"] / steps, "data_wait_s": w["wait"] / steps,
                 "peak_mem_gb": peak_memory_gb(self.run.device)}
        if par.active:
            speed["peak_mem_gb_ranks"] = par.gather(speed["peak_mem_gb"])
        if self.fpi:
            speed["mfu"] = self._mfu(self.fpi * rate / par.world)
        self.record(row, speed)
        self.bar.set_postfix({"loss": f"{row['loss']:.3f}", "lr": f"{lr:.1e}", f"{self.unit[:3]}/s": f"{rate:,.0f}",
                              **({"mfu": f"{speed['mfu']:.1%}"} if self.fpi else {})}, refresh=False)
        self.window = {"loss": 0.0, "n": 0, "items": 0, "time": 0.0, "wait": 0.0}

    def _measure_peak(self) -> float:
        """The peak FLOP/s measured now, from a forked generator: the run's RNG stream stays untouched."""
        device = self.run.device
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            return measure_peak_flops(device, self.run.amp_dtype)

    def _mfu(self, flops: float) -> float:
        """Achieved FLOP/s per process over the peak, never above 1: a peak measured low (a busy machine) is measured
        again once, the higher kept, and what is still above is capped, both said in the log."""
        if flops > self.peak and not self.t.peak_flops and not self.remeasured:
            self.remeasured = True
            was, self.peak = self.peak, max(self.peak, self._measure_peak())
            self.say(f"mfu above 100%: {_flops(flops)} achieved, over the peak measured at the start "
                     f"({_flops(was)}); the peak measured again: {_flops(self.peak)}")
        if flops > self.peak:
            self.say(f"mfu above 100%: {_flops(flops)} achieved, over the peak {_flops(self.peak)}; MFU capped at 100%")
            self.peak = flops
        return flops / self.peak

    def state_dict(self) -> dict:
        """What a resumed run needs to log the same numbers: the window (its time excepted) and counts."""
        return {"window_loss": self.window["loss"], "window_n": self.window["n"], "window_items": self.window["items"],
                "nonfinite_total": self.nonfinite_total, "overflow_total": self.overflow_total}

    def load_state_dict(self, s: dict):
        self.window.update(loss=s["window_loss"], n=s["window_n"], items=s["window_items"])
        self.nonfinite_total, self.overflow_total = s["nonfinite_total"], s["overflow_total"]

    def sync(self):
        """The rows so far durable on disk (before a checkpoint that says they were logged)."""
        for f in self.files.values():
            f.flush()
            os.fsync(f.fileno())

    def __exit__(self, *exc):  # the tracker is closed with the exit code of the exception that ended the run
        self.bar.close()
        return self._stack.__exit__(*exc)

    def plot(self) -> Path | None:
        """<out_dir>/loss.png: the training and validation loss against the step."""
        from .plots import line_plot
        rows = read_rows(self.out)
        series = {"train loss": [(r["step"], r["loss"]) for r in rows if "loss" in r],
                  "val loss": [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]}
        return line_plot(series, self.out / "loss.png", xlabel="step", ylabel="loss", markers={"val loss"}) \
            if any(series.values()) else None


def _flops(rate: float) -> str:
    return f"{rate / 1e12:.2f} TFLOP/s" if rate >= 1e12 else f"{rate / 1e9:.1f} GFLOP/s"


# ------------------------------------------------------------------------------ trackers
def _tracker_module(name: str, module: str):
    """train.tracker=name's package, imported; a one-line ConfigError naming its extra when it is missing."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(f"{missing_package(name) or f'train.tracker={name}'} ({e})") from None


def _points(row: dict) -> list:
    """A row's numbers but its step, each list's (one number per layer, e.g. moe_load_max) as k/0, k/1, ..."""
    num = (int, float)
    return [(k, v) for k, v in row.items() if k != "step" and isinstance(v, num)] + [
        (f"{k}/{i}", x) for k, v in row.items() if isinstance(v, list) for i, x in enumerate(v) if isinstance(x, num)]


class Tracker(contextlib.AbstractContextManager):
    """train.tracker=none: `log` and `close` do nothing; a context manager closed with the ending exception's code."""

    def log(self, row: dict):
        pass

    def close(self, exit_code: int = 0):
        pass

    def __exit__(self, exc_type, exc, tb):
        self.close(0 if exc is None else getattr(exc, "code", 1))


class TensorBoardTracker(Tracker):
    def __init__(self, cfg, out: Path, start: int, kept: list = ()):
        hparams = _tracker_module("tensorboard", "torch.utils.tensorboard.summary").hparams
        from torch.utils.tensorboard import SummaryWriter
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
        for k, v in _points(row):
            self.writer.add_scalar(k, float(v), row["step"])  # float32: TensorBoard's data server reads no float64
        self.writer.flush()  # a killed run loses no row that metrics.jsonl has

    def close(self, exit_code: int = 0):
        self.writer.close()


class WandbTracker(Tracker):
    def __init__(self, cfg, out: Path, start: int):
        wandb = _tracker_module("wandb", "wandb")
        t = cfg.train
        mode, id_file = t.tracker_mode or os.environ.get("WANDB_MODE") or "offline", out / "wandb" / "run_id"
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


@contextlib.contextmanager
def _no_mlflow_telemetry():
    """MLflow's client calls made with its usage telemetry off (it would send their records out), then back as it was."""
    from mlflow.telemetry import client
    was = client.get_telemetry_client()
    client._set_telemetry_client(None)
    try:
        yield
    finally:
        client._set_telemetry_client(was)


class MLflowTracker(Tracker):
    """An MLflow run (a SQLite store in <out_dir>/mlruns/ unless train.tracker_uri), resumed with the run. MLflow keeps
    every point logged, so a resumed run logs only the steps the store lacks: a row logged before a kill stays (the
    computed numbers are the same bitwise; the speed numbers are those its own process measured)."""

    def __init__(self, cfg, out: Path, start: int):
        mlflow = _tracker_module("mlflow", "mlflow")
        with _no_mlflow_telemetry():
            self._open(mlflow, cfg, out, start)

    def _open(self, mlflow, cfg, out: Path, start: int):
        from mlflow.entities import Param
        t, store, id_file = cfg.train, out.resolve() / "mlruns", out / "mlruns" / "run_id"
        store.mkdir(parents=True, exist_ok=True)
        try:
            self.client = mlflow.MlflowClient(tracking_uri=t.tracker_uri or f"sqlite:///{store / 'mlflow.db'}")
            name = t.tracker_project or "zoo"
            exp = self.client.get_experiment_by_name(name)
            eid = exp.experiment_id if exp else self.client.create_experiment(name, (store / "artifacts").as_uri())
        except (mlflow.exceptions.MlflowException, ImportError) as e:  # e.g. SQLAlchemy missing
            raise ConfigError(f"train.tracker=mlflow: {str(e).strip().splitlines()[0]}") from None
        self.run_id = id_file.read_text().strip() if start and id_file.is_file() else None  # fresh start: a new run
        if self.run_id is None:
            self.run_id = self.client.create_run(eid, run_name=out.resolve().name).info.run_id
            params = [Param(k, (v if isinstance(v, str) else json.dumps(v))[:6000])
                      for k, v in _flatten(cfg.to_dict()).items()]
            for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
                self.client.log_batch(self.run_id, params=params[i:i + 100])
            atomic_write(id_file, self.run_id + "\n")
        else:
            self.client.update_run(self.run_id, status="RUNNING")
        run = self.client.get_run(self.run_id)
        self.held = {k: max(m.step for m in self.client.get_metric_history(self.run_id, k)) for k in run.data.metrics}

    def log(self, row: dict):
        from mlflow.entities import Metric
        now, step = int(time.time() * 1000), row["step"]
        metrics = [Metric(k, float(v), now, step) for k, v in _points(row) if step > self.held.get(k, -1)]
        if metrics:
            with _no_mlflow_telemetry():
                self.client.log_batch(self.run_id, metrics=metrics)

    def close(self, exit_code: int = 0):
        with _no_mlflow_telemetry():
            self.client.set_terminated(self.run_id, "FINISHED" if exit_code == 0 else "FAILED")


def open_tracker(cfg, out: Path, start: int, kept: list = ()) -> Tracker:
    """cfg.train.tracker's tracker for a run in `out` starting (or resuming) at `start`; kept: the rows of
    step `start` already logged (a tracker that purges that step logs them again)."""
    if cfg.train.tracker == "tensorboard":
        return TensorBoardTracker(cfg, out, start, kept)
    trackers = {"wandb": WandbTracker, "mlflow": MLflowTracker}
    return trackers[cfg.train.tracker](cfg, out, start) if cfg.train.tracker in trackers else Tracker()


def _flatten(d: dict, prefix: str = "") -> dict:
    flat = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            flat.update(_flatten(v, f"{prefix}{k}."))
        else:
            flat[f"{prefix}{k}"] = v
    return flat
