"""The one training loop. It knows nothing family-specific: a family plugs in through its task.

Per optimizer step: LR from the schedule -> `grad_accum` micro-batches (ramped up from 1 over
`batch_warmup_steps`) under autocast (bf16, or fp16 with a GradScaler) -> unscale, clip the global
grad norm -> optimizer step (skipped, counted and logged when the loss or grad norm is not finite)
-> zero_grad(set_to_none) -> weight clipping (`clip_weights`) -> EMA update. Every `log_every` steps a JSON line goes to <out_dir>/metrics.jsonl (loss, lr,
grad norm, items/s, MFU, peak memory) and to the progress bar; every `eval_every` steps the
task evaluates; every `checkpoint_every` steps and at the end an atomic checkpoint is written.
At the end `average_last` averages the last checkpoints' weights and evaluates them
too (train/averaging.py). `lr_find` runs the LR range test instead (train/lr_find.py).
A run whose out_dir holds a checkpoint resumes from it exactly.
Between building the model and the optimizer, the `adapter:` section freezes the model and adds
adapters (zoo/adapters.py; checkpoints then hold only what trains, and the adapter is exported
to <out_dir>/adapter/), and `train.unfreeze` sets up gradual unfreezing (train/unfreeze.py). SIGTERM/SIGINT finish the
current step, write a checkpoint and exit with code EXIT_PREEMPTED.
Under torchrun, `train.parallel` (ddp | fsdp) wraps the model after it is built, each rank trains
on its part of every global batch, one all-reduce per step makes the ranks agree on the loss, on
skipping a non-finite step and on stopping, checkpoints are sharded (DCP) and only rank 0 logs
and writes: train/distributed.py, docs/distributed.md.
"""
from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import yaml

from zoo.adapters import apply_adapters, count_params, merged_model, trainable_keys
from zoo.weights.files import atomic_write, save_safetensors

from . import checkpoint as ckpt
from .hardware import keep_freed_memory, measure_peak_flops, peak_memory_gb, release_freed_memory, sync
from .config import RunConfig
from .distributed import Launch, Parallel, launch_env, save_dcp, unsupported
from .optim import build_optimizer, lr_multiplier, micro_batches, resume_note, set_lr
from .tasks import task_class
from .unfreeze import GradualUnfreezing
from .tracking import open_tracker

EXIT_OK = 0
EXIT_CONFIG = 2            # bad config or data: a one-line error
EXIT_NONFINITE = 3         # too many non-finite losses in a row; the last good checkpoint is kept
EXIT_PREEMPTED = 75        # SIGTERM/SIGINT: checkpoint written, run again to resume

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class RunStopped(Exception):
    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


# ------------------------------------------------------------------------------ helpers
def resolve_device(name: str) -> torch.device:
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RunStopped(f"train.device={name}: CUDA is not available on this machine", EXIT_CONFIG)
    return dev


def setup_backends(cfg: RunConfig, device: torch.device, log, owns_process: bool = False) -> bool:
    """Device settings for the run. Returns whether glibc was told to keep freed memory (which
    the caller undoes at the end unless the run owns the process)."""
    t = cfg.train
    kept = False
    keep = t.cpu_keep_memory if t.cpu_keep_memory is not None else owns_process
    if device.type == "cpu" and keep:
        kept = keep_freed_memory()
        if kept:
            log("backends: cpu, freed memory kept for reuse (glibc: no mmap, no trim; train.cpu_keep_memory)"
                + ("" if owns_process else "; glibc's defaults are restored when train() returns"))
        else:
            log("backends: cpu_keep_memory skipped (needs Linux with glibc)")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = t.tf32
        torch.backends.cudnn.allow_tf32 = t.tf32
        torch.backends.cudnn.benchmark = t.cudnn_benchmark and not t.deterministic
        log(f"backends: cuda, tf32={t.tf32}, cudnn.benchmark={torch.backends.cudnn.benchmark}")
    else:
        skipped = [k for k in ("tf32", "cudnn_benchmark") if getattr(t, k)]
        if skipped:
            log(f"backends: {device.type}: {', '.join(skipped)} skipped (CUDA only)")
    if t.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
        if device.type == "cuda":
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    return kept


def resolve_precision(cfg: RunConfig, device: torch.device, log) -> str:
    """train.precision as it will run. 'auto': bf16 on a GPU that supports it; on a CPU bf16 only
    when its matmul is clearly faster than fp32's there (measured: many CPUs without native bf16
    instructions emulate it 10-1000x slower); fp32 otherwise. An explicit bf16 on a CPU that
    emulates it is kept, with a warning in the log."""
    p = cfg.train.precision
    if p == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise RunStopped("train.precision=bf16: this GPU does not support bf16; use fp16 or auto", EXIT_CONFIG)
    if p not in ("auto", "bf16") or device.type not in ("cpu", "cuda"):
        return "fp32" if p == "auto" else p
    if device.type == "cuda":
        return "bf16" if p == "bf16" or torch.cuda.is_bf16_supported() else "fp32"
    with torch.random.fork_rng(devices=[]):
        bf16, fp32 = measure_peak_flops(device, torch.bfloat16), measure_peak_flops(device, None)
    speeds = f"matmul on this CPU: bf16 {bf16 / 1e9:.1f}, fp32 {fp32 / 1e9:.1f} GFLOP/s"
    if p == "auto":
        choice = "bf16" if bf16 >= 1.5 * fp32 else "fp32"
        log(f"precision: auto -> {choice} ({speeds})")
        return choice
    if bf16 < 0.5 * fp32:
        log(f"precision: warning: train.precision=bf16 on a CPU that emulates bf16 ({speeds}); "
            f"fp32 or auto would be faster")
    return p


def to_device(batch, device, channels_last: bool):
    if isinstance(batch, torch.Tensor):
        batch = batch.to(device, non_blocking=True)
        if channels_last and batch.dim() == 4:
            batch = batch.contiguous(memory_format=torch.channels_last)
        return batch
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(b, device, channels_last) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device, channels_last) for k, v in batch.items()}
    return batch


class EMA:
    """Exponential moving average of a model's weights (floating-point params and buffers;
    integer buffers are copied)."""

    def __init__(self, model: torch.nn.Module, decay: float):
        self.decay = decay
        self.model = copy.deepcopy(model).eval().requires_grad_(False)

    @torch.no_grad()
    def update(self, model: torch.nn.Module):
        src = dict(model.state_dict(keep_vars=True))
        done = set()
        for k, v in self.model.state_dict(keep_vars=True).items():
            if id(v) in done:  # a tied tensor (embedding = LM head) is updated once
                continue
            done.add(id(v))
            s = src[k].detach()
            if v.is_floating_point():
                v.lerp_(s, 1.0 - self.decay)
            else:
                v.copy_(s)


class _Preemption:
    """SIGTERM/SIGINT set a flag; the loop checkpoints after the current step and exits.
    hold: once a signal has been received, further SIGTERMs stay ignored after the loop (the
    process is on its way out with EXIT_PREEMPTED; under torchrun, the launcher sends one more
    to the ranks still running when the first exits). For a program that owns its process."""

    def __init__(self, hold: bool = False):
        self.signal: Optional[int] = None
        self.hold = hold
        self._old = {}

    def __enter__(self):
        if threading_main():
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


def threading_main() -> bool:
    import threading
    return threading.current_thread() is threading.main_thread()


def plot_losses(metrics_path: Path, out_png: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [json.loads(l) for l in metrics_path.read_text().splitlines() if l.strip()]
    tr = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    va = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    if tr:
        ax.plot(*zip(*tr), label="train loss")
    if va:
        ax.plot(*zip(*va), "o-", label="val loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_png, dpi=100)
    plt.close(fig)


# ------------------------------------------------------------------------------ the loop
def train(cfg: RunConfig, log=None, owns_process: bool = False) -> dict:
    """Run (or resume) the training described by cfg. Returns the final metrics.
    owns_process: the caller is a program that does nothing but this run (train/run.py); then
    process-wide settings (train.cpu_keep_memory) apply by default and are not undone."""
    t = cfg.train
    out = Path(t.out_dir)
    launch = launch_env()
    if launch.world > 1 and t.parallel == "none":
        raise RunStopped(f"{cfg.source}: launched by torchrun with {launch.world} processes but train.parallel=none; "
                         f"set train.parallel=ddp or fsdp", EXIT_CONFIG)
    par = Parallel(t.parallel, launch)
    why = unsupported(cfg) if par.active else None
    if why:
        raise RunStopped(f"{cfg.source}: {why}", EXIT_CONFIG)
    out.mkdir(parents=True, exist_ok=True)
    log_file = open(out / "log.txt", "a") if par.main else None  # only rank 0 logs

    def say(msg: str):
        if log_file is None:
            return
        (log or _print)(msg)
        log_file.write(msg + "\n")
        log_file.flush()

    kept = False

    def backends(device):
        nonlocal kept
        kept = setup_backends(cfg, device, say, owns_process)

    try:
        if t.lr_find:
            from .lr_find import lr_find
            try:
                return lr_find(cfg, say)
            except ValueError as e:
                raise RunStopped(str(e), EXIT_CONFIG) from None
        return _train(cfg, out, say, backends, par, owns_process)
    finally:
        par.close()
        if kept and not owns_process:
            release_freed_memory()
        if log_file is not None:
            log_file.close()


def _print(msg):
    from tqdm import tqdm
    tqdm.write(msg)


def _train(cfg: RunConfig, out: Path, say, backends, par: Optional[Parallel] = None, owns_process=False) -> dict:
    t = cfg.train
    par = par or Parallel("none", Launch())
    device = par.device(resolve_device(t.device))
    par.init(device)
    if par.active:
        say(par.describe())
    elif t.parallel != "none":
        say(f"parallel: train.parallel={t.parallel} skipped: not launched by torchrun (one process)")
    backends(device)
    torch.manual_seed(t.seed)
    precision = par.broadcast(resolve_precision(cfg, device, say))  # auto: rank 0's measurement decides for all
    amp_dtype = None if precision == "fp32" else DTYPES[precision]
    say(f"run: family={cfg.family} device={device} precision={precision} compile={t.compile} out_dir={out}")

    task = task_class(cfg.family)(cfg, device, say)
    task.autocast_dtype = amp_dtype
    if par.active:  # this rank's part of every global batch; sums across ranks
        task.rank, task.world, task.sum_across_ranks = par.rank, par.world, par.sum_
    task.setup()
    torch.manual_seed(t.seed)
    model = task.build_model().to(device).train()  # from_pretrained returns eval mode
    if t.channels_last:
        model = model.to(memory_format=torch.channels_last)
    # ---- parameter-efficient fine-tuning (adapter:) and gradual unfreezing (train.unfreeze): what trains
    keys = unfreezer = None  # keys: the state-dict names an adapter run checkpoints (what it changes)
    if cfg.adapter.enabled:
        apply_adapters(model, cfg.adapter, cfg.source, say)
        keys = trainable_keys(model)
    if t.unfreeze:
        unfreezer = GradualUnfreezing(model, task.unfreeze_groups(model), t.unfreeze, cfg.optim.weight_decay, say)
    if t.batch_size == "auto":
        t.batch_size, t.grad_accum = _auto_batch_size(cfg, model, task, device, out, say)
    n_train, n_params = count_params(model)
    say(f"model: {type(model).__name__}, {n_params / 1e6:.2f}M parameters"
        + (f", {n_train / 1e6:.3f}M trainable ({100 * n_train / n_params:.2f}%)" if n_train < n_params else ""))
    adapter_id = {"adapter": {k: v for k, v in cfg.to_dict()["adapter"].items() if k != "export_merged"},
                  "base": t.init_from} if keys is not None else {}
    # ---- data parallelism (train.parallel under torchrun): the EMA is sharded as the model is
    ema = EMA(model, t.ema_decay) if t.ema_decay else None
    model, fwd_par = par.wrap(model, precision, t.compile, t.sync_bn, device, say)
    if ema is not None:
        par.shard_like(ema.model)
    par.seed_rank(t.seed)
    try:
        optimizer = build_optimizer(model, cfg.optim, device, say)
    except ValueError as e:  # e.g. optim.name=muon on a model without hidden matrices
        raise RunStopped(str(e), EXIT_CONFIG) from None
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    if par.main:
        atomic_write(out / "config.yaml", yaml.safe_dump(cfg.to_dict(), sort_keys=False))

    start = 0
    if not t.resume and par.broadcast(bool(ckpt.list_checkpoints(out)) if par.main else None):
        if par.main:
            say(f"train.resume=false: the previous checkpoints were moved to {ckpt.set_aside(out)}")
        par.barrier()
    try:
        state = ckpt.resume_latest(out, model, optimizer, scaler, ema.model if ema else None, say, keys,
                                   (lambda st: unfreezer.restore(optimizer, st["step"])) if unfreezer else None,
                                   par, t.seed) \
            if t.resume else None
    except ckpt.CheckpointError as e:
        raise RunStopped(str(e), EXIT_CONFIG) from None
    if state is not None:
        start = state["step"]
        if note := resume_note(start, state["extra"].get("max_steps"), t.max_steps, cfg.optim):
            say(note)  # train.max_steps changed since the checkpoint: the schedule is recomputed
        was_id = {k: state["extra"].get(k) for k in adapter_id}
        if was_id != adapter_id:  # an adapter checkpoint only makes sense on the base it was trained on
            raise RunStopped(f"{state['path']}: trained with adapter/base {was_id}, this run has {adapter_id}; "
                             f"use another train.out_dir or train.resume=false", EXIT_CONFIG)
        if state.get("ema_started"):
            say(f"ema: the checkpoint has none; train.ema_decay={t.ema_decay} starts it from the resumed weights "
                f"(step {start})")
        was = state["extra"].get("precision")
        if t.precision == "auto" and was in ("fp32", "bf16") and was != precision:
            say(f"precision: auto -> {was}, as in the run being resumed (measured now: {precision})")
            precision = was
            amp_dtype = task.autocast_dtype = None if precision == "fp32" else DTYPES[precision]
    metrics_path = out / "metrics.jsonl"
    if par.main:
        _truncate_metrics(metrics_path, start, finished=start >= t.max_steps)

    fwd = model
    if fwd_par is not None:
        fwd = fwd_par
    elif t.compile:
        say("compile: torch.compile(model); the first steps include compilation")
        fwd = torch.compile(model)
    # measurements draw from a forked generator: the (resumed) RNG stream of the run stays untouched
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        peak = t.peak_flops or measure_peak_flops(device, amp_dtype)
        fpi = task.flops_per_item(model)
    rate = f"{peak / 1e12:.2f} TFLOP/s" if peak >= 1e12 else f"{peak / 1e9:.1f} GFLOP/s"
    say(f"mfu: peak {rate} ({'configured' if t.peak_flops else 'measured matmul'})")
    autocast = (lambda: torch.autocast(device.type, dtype=amp_dtype)) if amp_dtype else contextlib.nullcontext
    train_context = autocast
    if t.activation_offload and device.type == "cuda":
        say("activation offload: saved activations go to pinned host memory (torch.autograd.graph.save_on_cpu)")
        train_context = lambda: _both(autocast(), torch.autograd.graph.save_on_cpu(pin_memory=True))  # noqa: E731
    elif t.activation_offload:
        say(f"activation offload: skipped on {device.type} (CUDA only: activations already live in host memory)")
    params = [p for p in model.parameters() if p.requires_grad]

    from tqdm import tqdm
    bar = tqdm(total=t.max_steps, initial=start, disable=not (t.progress and par.main), dynamic_ncols=True,
               unit="step", file=sys.stderr)
    last = {}
    nonfinite_streak, nonfinite_total, overflow_total = 0, 0, 0
    win_loss, win_n, win_items, win_time = 0.0, 0, 0, 0.0
    step = start
    stop = False  # every rank agrees on it (train/distributed.py): a preemption signal seen by any rank
    with _Preemption(hold=owns_process) as pre, (open(metrics_path, "a") if par.main else contextlib.nullcontext()) as mf, \
            (open_tracker(cfg, out, start) if par.main else contextlib.nullcontext()) as tracker:
        def record(row: dict):  # metrics.jsonl and the tracker (train.tracker) get the same rows (rank 0)
            if mf is None:
                return
            mf.write(json.dumps(row) + "\n")
            mf.flush()
            tracker.log(row)

        def agree(stats):
            nonlocal stop
            stats, stop = par.agree(stats, pre.signal is not None)
            return stats

        for step in range(start, t.max_steps):
            t0 = time.perf_counter()
            lr = cfg.optim.lr * lr_multiplier(step, t.max_steps, cfg.optim)
            set_lr(optimizer, lr)
            if unfreezer is not None and unfreezer.advance(step, optimizer):
                params = [p for p in model.parameters() if p.requires_grad]
            n_micro = micro_batches(step, t.grad_accum, t.batch_warmup_steps)
            batches = (to_device(task.train_batch(step, m), device, t.channels_last) for m in range(n_micro))
            r = optimizer_step(lambda b: task.loss(fwd, b), batches, n_micro, optimizer, scaler, params,
                               t.clip_grad, train_context, no_sync=(lambda last: par.no_sync(fwd, last))
                               if par.active else None, agree=agree if par.active else None)
            if t.clip_weights is not None and r.applied:
                clip_weights_(params, t.clip_weights)
            loss_val, gnorm_val, items, finite = r.loss, r.grad_norm, r.items, r.finite
            if r.overflow:  # fp16: the GradScaler skipped the step and lowered its scale; not a failure
                overflow_total += 1
            if finite:
                nonfinite_streak = 0
                if ema is not None and r.applied:
                    ema.update(model)
            else:
                nonfinite_streak += 1
                nonfinite_total += 1
                say(f"step {step + 1}: non-finite loss/grad norm ({loss_val}, {gnorm_val}); step skipped "
                    f"({nonfinite_streak} in a row, {nonfinite_total} in all)")
                record({"step": step + 1, "nonfinite": True, "skipped_steps": nonfinite_total})
            sync(device)
            dt = time.perf_counter() - t0
            if finite:
                win_loss += loss_val
                win_n += 1
            win_items += items
            win_time += dt
            done = step + 1
            bar.update(1)

            if nonfinite_streak >= t.max_nonfinite:
                bar.close()
                raise RunStopped(f"stopped at step {done}: {nonfinite_streak} non-finite losses in a row "
                                 f"(train.max_nonfinite={t.max_nonfinite}); the last good checkpoint is kept "
                                 f"in {out / ckpt.CKPT_DIR}", EXIT_NONFINITE)

            if done % t.log_every == 0 or done == t.max_steps:
                rate = win_items * par.world / max(win_time, 1e-9)  # global: every rank covers as many items
                row = {"step": done, "loss": win_loss / win_n if win_n else float("nan"), "lr": lr,
                       "grad_norm": gnorm_val, f"{task.unit}_per_s": rate,
                       "step_time_s": win_time / max(1, win_n + (0 if finite else 1)),
                       "peak_mem_gb": peak_memory_gb(device)}
                if par.active:
                    row["peak_mem_gb_ranks"] = par.gather(row["peak_mem_gb"])
                if fpi:
                    row["mfu"] = fpi * rate / (peak * par.world)
                row.update(task.train_metrics())
                if nonfinite_total:
                    row["skipped_steps"] = nonfinite_total
                if scaler.is_enabled():
                    row["loss_scale"] = scaler.get_scale()
                    row["overflow_steps"] = overflow_total
                record(row)
                last.update(row)
                bar.set_postfix({"loss": f"{row['loss']:.3f}", "lr": f"{lr:.1e}",
                                 f"{task.unit[:3]}/s": f"{rate:,.0f}",
                                 **({"mfu": f"{row['mfu']:.1%}"} if fpi else {})}, refresh=False)
                win_loss, win_n, win_items, win_time = 0.0, 0, 0, 0.0

            if t.eval_every and done % t.eval_every == 0 and done != t.max_steps:
                ev = _evaluate(task, model, ema, autocast)
                record({"step": done, **ev})
                last.update(ev)
                say(f"step {done}: " + ", ".join(f"{k} {v:.4f}" for k, v in ev.items()))

            if stop or (not par.active and pre.signal is not None):
                _save(out, done, model, optimizer, scaler, ema, t, say, mf, precision, keys, adapter_id, par)
                bar.close()
                name = signal.Signals(pre.signal).name if pre.signal is not None else "SIGTERM (on another rank)"
                raise RunStopped(f"received {name} at step {done}: checkpoint written "
                                 f"to {out / ckpt.CKPT_DIR}; run the same command again to resume", EXIT_PREEMPTED)
            if t.checkpoint_every and done % t.checkpoint_every == 0 and done != t.max_steps:
                if nonfinite_streak:  # keep the older, good checkpoints from being rotated away
                    say(f"step {done}: checkpoint postponed ({nonfinite_streak} non-finite steps in a row)")
                else:
                    _save(out, done, model, optimizer, scaler, ema, t, say, mf, precision, keys, adapter_id, par)
        bar.close()

        done = max(step + 1, start) if t.max_steps > start else start
        if state is None or done > start:
            _save(out, done, model, optimizer, scaler, ema, t, say, mf, precision, keys, adapter_id, par)
        ev = _evaluate(task, model, ema, autocast)
        record({"step": done, **ev})
        last.update(ev)
        if t.average_last:
            ev_avg = _evaluate_average(task, model, out, t, autocast, say, keys, par)
            record({"step": done, **ev_avg})
            last.update(ev_avg)
            ev.update(ev_avg)
    say(f"final (step {done}): " + ", ".join(f"{k} {v:.4f}" for k, v in ev.items()))
    ema_model = ema.model if ema is not None else None
    if par.active:  # the whole model on rank 0, as one process would have it; the other ranks are done
        model, ema_model = _consolidated(par, task, model, ema, device, t.channels_last)
        if not par.main:
            return last
    if keys is None:
        save_safetensors(model, out / "model.safetensors")
        task.save_files(out)
        if ema_model is not None:
            save_safetensors(ema_model, out / "model_ema.safetensors")
        say(f"weights: {out / 'model.safetensors'}")
    else:
        say(f"adapter: {export_adapter(model, out, t.init_from)}")
    if t.plot and metrics_path.stat().st_size:
        plot_losses(metrics_path, out / "loss.png")
        say(f"loss curve: {out / 'loss.png'}")
    if t.samples:
        text = task.samples(ema_model if ema_model is not None else model, out)
        if text:
            say("samples:\n" + text)
    if t.export and keys is not None and not cfg.adapter.export_merged:
        say("export: adapter run; set adapter.export_merged=true for the merged weights in the base's format")
    elif t.export:
        path = task.export(merged_model(model) if keys is not None else model, out)
        if path:
            say(f"exported: {path}")
    return last


@dataclass
class StepResult:
    loss: float         # mean of the micro-batches' losses
    grad_norm: float    # global norm of the accumulated (unscaled) gradients, before clipping
    items: int          # tokens / images the step covered
    finite: bool        # False: a non-finite loss (or gradient, without a GradScaler): step skipped
    applied: bool       # the optimizer changed the weights
    overflow: bool      # fp16: the GradScaler found inf/nan gradients, skipped the step, lowered its scale


def optimizer_step(loss_fn, batches, n_micro: int, optimizer, scaler, params, clip: Optional[float],
                   autocast=contextlib.nullcontext, no_sync=None, agree=None) -> StepResult:
    """One optimizer step over `n_micro` micro-batches. loss_fn(batch) -> (mean loss, items).

    Each micro-batch's mean loss is divided by n_micro before backward, so the accumulated
    gradients of k equal micro-batches are those of one k-times larger batch. Then the GradScaler
    (fp16) unscales them, the global norm is clipped to `clip` (None: measured, not clipped), and
    the optimizer steps, unless the loss or the norm is not finite: without a scaler the step is
    skipped and reported; with one, an overflowing gradient is the scaler's business (it skips
    the step and lowers its scale). Gradients are then freed (zero_grad(set_to_none=True)).
    Data-parallel runs (train/distributed.py) pass no_sync(last) -> the context of a micro-batch's
    backward (DDP: no all-reduce but on the last), and agree([loss sum, grad norm]) -> the same on
    every rank, so that all ranks take or skip the step together."""
    loss_sum, items = None, 0
    for i, batch in enumerate(batches):
        with no_sync(i == n_micro - 1) if no_sync is not None else contextlib.nullcontext():
            with autocast():
                loss, n = loss_fn(batch)
            scaler.scale(loss / n_micro).backward()
        loss_sum = loss.detach().float() if loss_sum is None else loss_sum + loss.detach().float()
        items += n
    scaler.unscale_(optimizer)
    gnorm = torch.nn.utils.clip_grad_norm_(params, clip if clip else float("inf"))
    if hasattr(gnorm, "full_tensor"):  # FSDP2: a DTensor; its value is already the global norm
        gnorm = gnorm.full_tensor()
    stats = torch.stack([loss_sum, gnorm.float().to(loss_sum.device)])
    if agree is not None:
        stats = agree(stats)
    loss_val, gnorm_val = stats.tolist()  # one sync
    loss_val /= n_micro
    grads_ok = math.isfinite(gnorm_val)
    finite = math.isfinite(loss_val) and (grads_ok or scaler.is_enabled())
    if scaler.is_enabled():
        scaler.step(optimizer)  # skips the step itself on inf/nan gradients
        scaler.update()
    elif finite:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    overflow = scaler.is_enabled() and not grads_ok
    return StepResult(loss_val, gnorm_val, items, finite, finite and grads_ok, overflow)


@contextlib.contextmanager
def _both(first, second):
    with first, second:
        yield


def _auto_batch_size(cfg, model, task, device, out: Path, say) -> tuple[int, int]:
    """train.batch_size=auto: the micro-batch of the run being resumed (its config.yaml), else the
    largest that fits (train/plan.py, find_batch_size); train.global_batch kept by accumulation."""
    t = cfg.train
    if t.resume and ckpt.list_checkpoints(out) and (out / "config.yaml").is_file():
        was = (yaml.safe_load((out / "config.yaml").read_text()) or {}).get("train", {})
        if isinstance(was.get("batch_size"), int) and was.get("global_batch") == t.global_batch:
            say(f"batch size: auto -> micro-batch {was['batch_size']} x {was['grad_accum']}, as in the run being resumed")
            return was["batch_size"], was["grad_accum"]
    from .plan import find_batch_size
    try:
        return find_batch_size(cfg, device, say, model, task)
    except ValueError as e:
        raise RunStopped(str(e), EXIT_CONFIG) from None


def _evaluate(task, model, ema, autocast) -> dict:
    with autocast():
        ev = task.evaluate(model)
        if ema is not None:
            ev.update({f"ema_{k}": v for k, v in task.evaluate(ema.model).items()})
    return ev


@torch.no_grad()
def clip_weights_(params, c: float):
    """train.clip_weights: every weight clamped to [-c, c] after the step."""
    for p in params:
        p.clamp_(-c, c)


def _evaluate_average(task, model, out, t, autocast, say, keys=None, par: Optional[Parallel] = None) -> dict:
    """train.average_last: the last checkpoints' weights averaged, saved and evaluated (avg_*).
    An adapter run's checkpoints hold only what trains (`keys`): those are averaged, the rest is the model's.
    Under torchrun rank 0 alone reads the (DCP) checkpoints back whole and evaluates the average in a
    plain model, as one process would; the other ranks return {} (no collective)."""
    from .averaging import average_last
    if par is not None and par.active and not par.main:
        return {}
    path, used = average_last(out, t.average_last, t.average_weighting)
    if par is not None and par.active:  # the trained model is wrapped or sharded: a plain one on its device
        avg = task.build_model().to(next(model.parameters()).device)
    else:
        avg = copy.deepcopy(model)
    avg.load_state_dict(ckpt.read_weights(path, avg, keys), strict=False)
    say(f"average: {t.average_weighting} over the last {len(used)} checkpoints "
        f"({', '.join(p.name for p in used)}) -> {path}"
        + (f" (train.average_last={t.average_last}, fewer were written)" if len(used) < t.average_last else ""))
    with autocast():
        ev = task.evaluate(avg)
    return {f"avg_{k}": v for k, v in ev.items()}


def _consolidated(par: Parallel, task, model, ema, device, channels_last: bool):
    """(model, EMA model) as one process would hold them, on rank 0 (None, None on the others).
    DDP: the module itself (replicated); FSDP: a model built anew and given the gathered weights."""
    if par.strategy == "ddp":
        return model, ema.model if ema is not None else None
    full = par.full_state(model)
    full_ema = par.full_state(ema.model) if ema is not None else None
    if not par.main:
        return None, None

    def plain(sd):
        m = task.build_model()
        m.load_state_dict(sd)
        m = m.to(device)
        return m.to(memory_format=torch.channels_last) if channels_last else m

    return plain(full), plain(full_ema).eval().requires_grad_(False) if full_ema is not None else None


def _save(out, step, model, optimizer, scaler, ema, t, say, metrics_file=None, precision=None, keys=None,
          extra=None, par: Optional[Parallel] = None):
    if metrics_file is not None:  # the metrics up to this step are durable before the checkpoint is
        metrics_file.flush()
        os.fsync(metrics_file.fileno())
    extra = {"precision": precision, "max_steps": t.max_steps, **(extra or {})}  # max_steps: see resume_note
    if par is not None and par.active:
        path = save_dcp(par, out, step, model, optimizer, scaler if scaler.is_enabled() else None,
                        ema.model if ema is not None else None, extra=extra,
                        keep=t.keep_checkpoints)
        say(f"checkpoint: {path}")
        return
    path = ckpt.save_checkpoint(out, step, model, optimizer, scaler if scaler.is_enabled() else None,
                                ema.model if ema is not None else None, extra=extra,
                                keep=t.keep_checkpoints, keys=keys)
    say(f"checkpoint: {path}")


def export_adapter(model, out: Path, base: Optional[str]) -> Path:
    """The trained adapter in <out>/adapter/: LoRA / DoRA in PEFT's format; prefixes (which PEFT
    lays out per model class) as Zoo's tensors in adapter/prefix.safetensors."""
    from zoo.weights.peft_lora import save_adapter
    if model.adapter_config.method in ("lora", "dora"):
        return save_adapter(model, out / "adapter", base=base)
    (out / "adapter").mkdir(exist_ok=True)
    return save_safetensors({k: v for k, v in model.state_dict().items() if k in trainable_keys(model)},
                            out / "adapter" / "prefix.safetensors")


def _truncate_metrics(path: Path, step: int, finished: bool = False):
    """On resume, drop metric lines logged after the checkpoint (they will be logged again), and
    any torn last line of a killed writer. When resuming a finished run (the checkpoint is the
    last step), its final evaluation rows are logged again too, so drop them."""
    if not path.exists():
        return
    keep = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
            s = row.get("step", 0)
        except (ValueError, AttributeError):
            continue
        if s < step or (s == step and not (finished and "loss" not in row and "nonfinite" not in row)):
            keep.append(line)
    atomic_write(path, "".join(l + "\n" for l in keep))
