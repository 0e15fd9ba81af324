"""The run's checkpoints as one component: resume at the start, save at `train.checkpoint_every`
steps and at the end (keeping `train.keep_checkpoints`), one-process or sharded (DCP) format by
the run, and the average of the last `train.average_last` checkpoints evaluated at the end.
The file format (atomic writes, manifest, verification, DCP) is train/checkpoint.py's.
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Optional

from . import checkpoint as ckpt
from .averaging import average_last
from .optim import resume_note
from .step import EXIT_CONFIG, RunStopped


class Checkpointer:
    def __init__(self, run, out: Path, say):
        self.run, self.out, self.say, self.t = run, out, say, run.cfg.train
        self.start = 0          # the step the run starts (or resumed) at
        self.resumed: Optional[dict] = None
        self.metrics = None     # the Metrics whose rows a checkpoint seals (set by the loop)

    # ------------------------------------------------------------------ resume
    def resume(self) -> int:
        """Load the newest usable checkpoint of out_dir into the run (train.resume) or set the old
        ones aside (train.resume=false). Returns the step to start from."""
        run, t, par = self.run, self.t, self.run.par
        if not t.resume and par.broadcast(bool(ckpt.list_checkpoints(self.out)) if par.main else None):
            if par.main:
                self.say(f"train.resume=false: the previous checkpoints were moved to {ckpt.set_aside(self.out)}")
            par.barrier()
        if not t.resume:
            return 0
        unfreezer = run.unfreezer
        try:
            state = ckpt.resume_latest(self.out, run.model, run.optimizer, run.scaler,
                                       run.ema.model if run.ema else None, self.say, run.keys,
                                       (lambda st: unfreezer.restore(run.optimizer, st["step"])) if unfreezer else None,
                                       par, t.seed)
        except ckpt.CheckpointError as e:
            raise RunStopped(str(e), EXIT_CONFIG) from None
        if state is None:
            return 0
        self.resumed, self.start = state, state["step"]
        extra = state["extra"]
        if note := resume_note(self.start, extra.get("max_steps"), t.max_steps, run.cfg.optim):
            self.say(note)  # train.max_steps changed since the checkpoint: the schedule is recomputed
        was_id = {k: extra.get(k) for k in run.adapter_id()}
        if was_id != run.adapter_id():  # an adapter checkpoint only makes sense on the base it was trained on
            raise RunStopped(f"{state['path']}: trained with adapter/base {was_id}, this run has {run.adapter_id()}; "
                             f"use another train.out_dir or train.resume=false", EXIT_CONFIG)
        if state.get("ema_started"):
            self.say(f"ema: the checkpoint has none; train.ema_decay={t.ema_decay} starts it from the resumed "
                     f"weights (step {self.start})")
        was = extra.get("precision")
        if t.precision == "auto" and was in ("fp32", "bf16") and was != run.precision:
            self.say(f"precision: auto -> {was}, as in the run being resumed (measured now: {run.precision})")
            run.set_precision(was)
        return self.start

    def metrics_state(self) -> Optional[dict]:
        """The logging window the checkpoint sealed (None: an older checkpoint, or none)."""
        return (self.resumed or {}).get("extra", {}).get("metrics")

    # ------------------------------------------------------------------ save
    def due(self, step: int) -> bool:
        every = self.t.checkpoint_every
        return bool(every) and step % every == 0 and step != self.t.max_steps

    def save(self, step: int):
        run = self.run
        extra = {"precision": run.precision, "max_steps": self.t.max_steps, **run.adapter_id()}  # see resume_note
        if self.metrics is not None:  # the rows up to this step are durable before the checkpoint is
            self.metrics.sync()
            extra["metrics"] = self.metrics.state_dict()
        scaler = run.scaler if run.scaler is not None and run.scaler.is_enabled() else None
        ema = run.ema.model if run.ema is not None else None
        if run.par.active:
            path = ckpt.save_dcp(run.par, self.out, step, run.model, run.optimizer, scaler, ema, extra=extra,
                                 keep=self.t.keep_checkpoints)
        else:
            path = ckpt.save_checkpoint(self.out, step, run.model, run.optimizer, scaler, ema, extra=extra,
                                        keep=self.t.keep_checkpoints, keys=run.keys)
        self.say(f"checkpoint: {path}")

    # ------------------------------------------------------------------ averaging
    def evaluate_average(self) -> dict:
        """train.average_last: the last checkpoints' weights averaged, saved and evaluated (avg_*).
        An adapter run's checkpoints hold only what trains (`keys`): those are averaged, the rest is
        the model's. Under torchrun rank 0 alone reads the (DCP) checkpoints back whole and evaluates
        the average in a plain model, as one process would; the other ranks return {} (no collective)."""
        run, t = self.run, self.t
        if run.par.active and not run.par.main:
            return {}
        path, used = average_last(self.out, t.average_last, t.average_weighting)
        if run.par.active:  # the trained model is wrapped or sharded: a plain one on its device
            avg = run.task.build_model().to(run.device)
        else:
            avg = copy.deepcopy(run.model)
        avg.load_state_dict(ckpt.read_weights(path, avg, run.keys), strict=False)
        self.say(f"average: {t.average_weighting} over the last {len(used)} checkpoints "
                 f"({', '.join(p.name for p in used)}) -> {path}"
                 + (f" (train.average_last={t.average_last}, fewer were written)" if len(used) < t.average_last
                    else ""))
        with run.autocast():
            ev = run.task.evaluate(avg)
        return {f"avg_{k}": v for k, v in ev.items()}
