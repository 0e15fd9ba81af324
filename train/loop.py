"""The one training loop. It knows nothing family-specific: a family plugs in through its task.

    train(cfg) -> builds the run (train/builder.py), resumes it (train/checkpoint.py), then per
    optimizer step: LR -> micro-batches under autocast -> clip -> optimizer step -> EMA; logging,
    evaluation and checkpoints at their intervals; train/finish.py writes the end.

SIGTERM/SIGINT finish the step, checkpoint and exit with EXIT_PREEMPTED; docs/architecture.md maps train/.
"""
from __future__ import annotations

import dataclasses
import signal
import threading
import time
from pathlib import Path
from typing import Optional

import torch
from tqdm import tqdm

from zoo.pruning import sparsity_of

from .builder import build_run
from .checkpoint import CKPT_DIR, Checkpointer, list_checkpoints, rng_state, set_rng_state
from .config import RunConfig
from .distributed import Parallel, launch_env
from .features.lr_find import lr_find
from .features.quantize import quantized_evaluation
from .finish import finish
from .hardware import sync
from .metrics import Metrics
from .optim import lr_multiplier, micro_batches, set_lr
from .step import (EXIT_CONFIG, EXIT_NONFINITE, EXIT_PREEMPTED, MicroBatchOOM, RunStopped, clip_weights_,
                   optimizer_step, resolve_device, setup_backends, stop_line, to_device)


def train(cfg: RunConfig, log=None, owns_process: bool = False) -> dict:
    """Run (or resume) the training described by cfg; returns the final metrics. owns_process: the caller does
    nothing but this run (train/run.py), so process-wide settings (train.cpu_keep_memory) apply and stay."""
    t = cfg.train
    out, launch = Path(t.out_dir), launch_env()
    if launch.world > 1 and t.parallel == "none":
        raise RunStopped(f"{cfg.source}: launched by torchrun with {launch.world} processes but train.parallel=none; "
                         f"set train.parallel=ddp or fsdp", EXIT_CONFIG)
    par = Parallel(t.parallel, launch, t.tp_size, t.pp_microbatches)
    out.mkdir(parents=True, exist_ok=True)
    log_file = open(out / "log.txt", "a") if par.main else None  # only rank 0 logs

    def say(msg: str):
        if log_file is not None:
            (log or tqdm.write)(msg)
            log_file.write(msg + "\n")
            log_file.flush()

    restore = None
    try:
        restore = setup_backends(t, par.device(resolve_device(t.device)), say, owns_process)
        if t.lr_find:
            try:
                return lr_find(build_run(cfg, say, par), say)
            except ValueError as e:
                raise RunStopped(str(e), EXIT_CONFIG) from None
        return _train(cfg, out, say, par, owns_process)
    except Exception as e:
        if log_file is not None:  # the run's last line, kept with the rest of what it said
            log_file.write(stop_line(e) + "\n")
        raise
    finally:
        par.close()
        if restore is not None and not owns_process:
            restore()
        if log_file is not None:
            log_file.close()


def _train(cfg, out: Path, say, par: Parallel, owns_process: bool) -> dict:
    run = build_run(cfg, say, par)
    if par.main:
        run.write_config(out)
    ckpt = Checkpointer(run, out, say)
    start = ckpt.resume()
    with Preemption(hold=owns_process) as pre, Metrics(run, out, start, say) as metrics:
        ckpt.metrics = metrics
        if ckpt.metrics_state() is not None:
            metrics.load_state_dict(ckpt.metrics_state())
        if start == 0 and run.par.comm is not None:  # PowerSGD's compression, once
            full, sent, _, _ = run.par.comm.counts()
            metrics.record({"step": 0, "grad_compression_ratio": full / sent})
        step, final = _loop(run, ckpt, metrics, pre)
    say(f"final (step {step}): " + ", ".join(f"{k} {v:.4f}" for k, v in final.items()))
    finish(run, out, metrics, say)
    return metrics.last


def _loop(run, ckpt: Checkpointer, metrics: Metrics, pre: "Preemption") -> tuple[int, dict]:
    """The loop body: evaluation, checkpoints and the end are its own (last_step), as is stopping on
    a signal or on too many non-finite steps. Returns the last step and its evaluation."""
    t, step = run.cfg.train, ckpt.start
    while True:
        last_step = step >= t.max_steps
        ran = step > ckpt.start  # this process trained up to `step` (a resumed step was done before)
        ev = {}
        if last_step or (ran and t.eval_every and step % t.eval_every == 0):
            ev = evaluate(run)
            metrics.evaluation(step, ev, say=not last_step)
        if ran and pre.stopping(run.par):
            ckpt.save(step)
            raise RunStopped(f"received {pre.name()} at step {step}: checkpoint written to {ckpt.out / CKPT_DIR}; "
                             f"run the same command again to resume", EXIT_PREEMPTED)
        if last_step and (ran or ckpt.resumed is None):
            ckpt.save(step)
        elif ran and ckpt.due(step) and metrics.nonfinite_streak:  # keep the older, good checkpoints
            ckpt.say(f"step {step}: checkpoint postponed ({metrics.nonfinite_streak} non-finite steps in a row)")
        elif ran and ckpt.due(step):
            ckpt.save(step)
        if last_step:  # the averaged checkpoints, train.qat / train.quantize (rank 0)
            for more in (ckpt.evaluate_average() if t.average_last else {}, quantized_evaluation(run)):
                if more:
                    metrics.evaluation(step, more, say=False)
                    ev.update(more)
            return step, ev
        t0 = time.perf_counter()
        r, lr, waited = train_step_backing_off(run, step, pre, ckpt)
        sync(run.device)
        step += 1
        metrics.step(step, lr, r, time.perf_counter() - t0, waited)
        if metrics.nonfinite_streak >= t.max_nonfinite:
            good = list_checkpoints(ckpt.out)
            raise RunStopped(f"stopped at step {step}: {metrics.nonfinite_streak} non-finite losses in a row "
                             f"(train.max_nonfinite={t.max_nonfinite}); " + (f"the last good checkpoint, {good[0]}, "
                             f"is kept" if good else "no checkpoint was written before them"), EXIT_NONFINITE)


def train_step(run, step: int, pre: Optional["Preemption"] = None):
    """Optimizer step `step` (from 0), its LR, micro-batches, weight clipping, EMA -> (result, LR, seconds waited)."""
    t, task, par = run.cfg.train, run.task, run.par
    lr = run.cfg.optim.lr * lr_multiplier(step, t.max_steps, run.cfg.optim)
    set_lr(run.optimizer, lr)
    if run.unfreezer is not None:
        run.unfreezer.advance(step, run.optimizer)
    params, n_micro = run.params(), micro_batches(step, t.grad_accum, t.batch_warmup_steps)
    waited = 0.0

    def batch(m):
        nonlocal waited
        t0 = time.perf_counter()
        b = to_device(task.train_batch(step, m), run.device, t.channels_last)
        waited += time.perf_counter() - t0
        return b
    batches = (batch(m) for m in range(n_micro))
    agree = (lambda stats: pre.agree(par, stats)) if par.active and pre is not None else None
    r = optimizer_step(lambda b: task.loss(run.fwd, b), batches, n_micro, run.optimizer, run.scaler, params,
                       t.clip_grad, run.train_context, no_sync=(lambda last: par.no_sync(run.fwd, last))
                       if par.active else None, agree=agree, pipeline=par.pipeline, probe=t.log_noise_scale)
    if t.clip_weights is not None and r.applied:
        clip_weights_(params, t.clip_weights)
    if run.ema is not None and r.finite and r.applied:
        run.ema.update(run.model)
    return r, lr, waited


def train_step_backing_off(run, step: int, pre: "Preemption", ckpt: Checkpointer):
    """train_step; with train.batch_size: auto in one process, a micro-batch that runs out of memory halves the
    micro-batch (to a divisor of the global batch), keeps the global batch by accumulation, writes config.yaml
    (a resume keeps it) and redoes the step from its start, the RNG as it was."""
    while True:
        rng = rng_state() if run.auto_batch else None
        try:
            return train_step(run, step, pre)
        except MicroBatchOOM as e:
            t = run.cfg.train
            items = t.batch_size * t.grad_accum
            if not run.auto_batch or run.par.active or t.batch_size == 1:
                raise e.__cause__
            b = max(d for d in range(1, t.batch_size // 2 + 1) if items % d == 0)
            run.cfg = dataclasses.replace(run.cfg, train=dataclasses.replace(t, batch_size=b, grad_accum=items // b))
            run.task.cfg = run.cfg
            run.write_config(ckpt.out)
            set_rng_state(rng)
            if run.device.type == "cuda":
                torch.cuda.empty_cache()
            ckpt.say(f"step {step + 1}: a micro-batch of {t.batch_size} ran out of memory: now {b} x {items // b} "
                     f"accumulated (the global batch of {items} kept; train.batch_size: auto); the step is redone")


def evaluate(run) -> dict:
    """The task's evaluation of the model (and of the EMA as ema_*; with train.prune the sparsity)."""
    run.par.sync(run.model)
    with run.autocast():
        ev = run.task.evaluate(run.model)
        if run.ema is not None:
            ev.update({f"ema_{k}": v for k, v in run.task.evaluate(run.ema.model).items()})
    if run.pruned:
        ev["sparsity"] = sparsity_of(run.pruned)
    return ev


class Preemption:
    """SIGTERM/SIGINT set a flag; the loop checkpoints after the current step and exits (under torchrun
    all ranks together, through `agree`). hold: once signalled, later SIGTERMs stay ignored after the
    loop (torchrun sends more on the way out). For a program that owns its process."""

    def __init__(self, hold: bool = False):
        self.signal: Optional[int] = None
        self.agreed = False  # some rank received a signal (known after the step's all-reduce)
        self.hold, self._old = hold, {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGTERM, signal.SIGINT):
                self._old[s] = signal.signal(s, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.signal is not None and signum == signal.SIGINT:  # a second Ctrl-C: stop now
            raise KeyboardInterrupt
        self.signal = signum

    def __exit__(self, *exc):
        for s, h in self._old.items():
            signal.signal(s, signal.SIG_IGN if self.hold and self.signal is not None and s == signal.SIGTERM else h)

    def agree(self, par, stats):
        stats, self.agreed = par.agree(stats, self.signal is not None)
        return stats

    def stopping(self, par) -> bool:
        return self.agreed if par.active else self.signal is not None

    def name(self) -> str:
        return signal.Signals(self.signal).name if self.signal is not None else "SIGTERM (on another rank)"
