"""The run's metrics: two JSON-lines files, the tracker, the progress bar and the throughput window.

    <out_dir>/metrics.jsonl   what the run computed: every `log_every` steps the window's mean loss,
                              the LR, the grad norm and the task's numbers (MoE load, ...); every
                              evaluation. Deterministic: a resumed run writes the same bytes as an
                              uninterrupted one (the window is checkpointed and restored on resume).
    <out_dir>/speed.jsonl     what the machine measured, per logged step: items/s, the step time,
                              MFU, peak memory (per rank under torchrun).

`read_rows(out_dir)` gives both merged by step (the rows a reader wants); the tracker
(`train.tracker`) and the progress bar get the merged rows live. Only rank 0 writes.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

import torch

from zoo.weights.files import atomic_write

from .hardware import measure_peak_flops, peak_memory_gb
from .tracking import open_tracker

METRICS, SPEED = "metrics.jsonl", "speed.jsonl"


def read_rows(out_dir) -> list[dict]:
    """metrics.jsonl's rows, each training row merged with speed.jsonl's row of the same step."""
    out = Path(out_dir)
    rows = [json.loads(l) for l in (out / METRICS).read_text().splitlines() if l.strip()]
    speed = {}
    if (out / SPEED).is_file():
        speed = {r["step"]: r for r in map(json.loads, (out / SPEED).read_text().splitlines()) if r}
    return [{**r, **speed.get(r["step"], {})} if "loss" in r else r for r in rows]


def truncate(path: Path, step: int, finished: bool = False):
    """On resume, drop rows logged after the checkpoint (they will be logged again) and a torn last
    line of a killed writer. When resuming a finished run (the checkpoint is the last step), its
    final evaluation rows are logged again too, so drop them."""
    if not path.exists():
        return
    keep = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
            s = row.get("step", 0)
        except (ValueError, AttributeError):
            continue
        if s < step or (s == step and not (finished and "loss" not in row and "nonfinite" not in row
                                           and "step_time_s" not in row)):
            keep.append(line)
    atomic_write(path, "".join(l + "\n" for l in keep))


class Metrics:
    """Owns metrics.jsonl, speed.jsonl, the tracker, the progress bar and the logging window.
    A context manager: `with Metrics(run, out, start, say) as metrics: ...`."""

    def __init__(self, run, out: Path, start: int, say):
        t = run.cfg.train
        self.run, self.out, self.say, self.t = run, out, say, t
        self.main = run.par.main
        self.unit = run.task.unit
        self.last: dict = {}
        self.window = {"loss": 0.0, "n": 0, "items": 0, "time": 0.0}
        self.nonfinite_streak, self.nonfinite_total, self.overflow_total = 0, 0, 0
        if self.main:
            for name in (METRICS, SPEED):
                truncate(out / name, start, finished=start >= t.max_steps)
        # measurements draw from a forked generator: the (resumed) RNG stream of the run stays untouched
        with torch.random.fork_rng(devices=[run.device] if run.device.type == "cuda" else []):
            self.peak = t.peak_flops or measure_peak_flops(run.device, run.amp_dtype)
            self.fpi = run.task.flops_per_item(run.model)
        rate = f"{self.peak / 1e12:.2f} TFLOP/s" if self.peak >= 1e12 else f"{self.peak / 1e9:.1f} GFLOP/s"
        say(f"mfu: peak {rate} ({'configured' if t.peak_flops else 'measured matmul'})")
        self._stack = contextlib.ExitStack()
        self.files = {}
        self.tracker = None
        if self.main:
            self.files = {n: self._stack.enter_context(open(out / n, "a")) for n in (METRICS, SPEED)}
            kept = [r for r in read_rows(out) if r["step"] == start] if start and (out / METRICS).exists() else []
            self.tracker = self._stack.enter_context(open_tracker(run.cfg, out, start, kept))
        from tqdm import tqdm
        self.bar = tqdm(total=t.max_steps, initial=start, disable=not (t.progress and self.main),
                        dynamic_ncols=True, unit="step", file=sys.stderr)

    # ------------------------------------------------------------------ rows
    def record(self, row: dict, speed: dict | None = None):
        """A row of metrics.jsonl (and, for a training row, its measured part in speed.jsonl)."""
        self.last.update(row)
        if speed:
            self.last.update(speed)
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

    def step(self, done: int, lr: float, r, seconds: float):
        """Account one optimizer step (a StepResult) and log the window every train.log_every steps."""
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
        w["time"] += seconds
        self.bar.update(1)
        if done % t.log_every == 0 or done == t.max_steps:
            self._log(done, lr, r)

    def _log(self, done, lr, r):
        w, par = self.window, self.run.par
        rate = w["items"] * par.world / max(w["time"], 1e-9)  # global: every rank covers as many items
        row = {"step": done, "loss": w["loss"] / w["n"] if w["n"] else float("nan"), "lr": lr,
               "grad_norm": r.grad_norm, **self.run.task.train_metrics()}
        if self.nonfinite_total:
            row["skipped_steps"] = self.nonfinite_total
        scaler = self.run.scaler
        if scaler is not None and scaler.is_enabled():
            row["loss_scale"] = scaler.get_scale()
            row["overflow_steps"] = self.overflow_total
        speed = {f"{self.unit}_per_s": rate, "step_time_s": w["time"] / max(1, w["n"] + (0 if r.finite else 1)),
                 "peak_mem_gb": peak_memory_gb(self.run.device)}
        if par.active:
            speed["peak_mem_gb_ranks"] = par.gather(speed["peak_mem_gb"])
        if self.fpi:
            speed["mfu"] = self.fpi * rate / (self.peak * par.world)
        self.record(row, speed)
        self.bar.set_postfix({"loss": f"{row['loss']:.3f}", "lr": f"{lr:.1e}",
                              f"{self.unit[:3]}/s": f"{rate:,.0f}",
                              **({"mfu": f"{speed['mfu']:.1%}"} if self.fpi else {})}, refresh=False)
        self.window = {"loss": 0.0, "n": 0, "items": 0, "time": 0.0}

    # ------------------------------------------------------------------ checkpointed state
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

    def __enter__(self):
        return self

    def __exit__(self, *exc):  # the tracker is closed with the exit code of the exception that ended the run
        self.bar.close()
        return self._stack.__exit__(*exc)

    def plot(self) -> Path | None:
        """<out_dir>/loss.png: the training and validation loss against the step."""
        from .plots import line_plot
        rows = read_rows(self.out)
        series = {"train loss": [(r["step"], r["loss"]) for r in rows if "loss" in r],
                  "val loss": [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]}
        if not any(series.values()):
            return None
        return line_plot(series, self.out / "loss.png", xlabel="step", ylabel="loss", markers={"val loss"})
