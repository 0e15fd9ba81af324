"""The training step and what it runs on (device, precision, backends, EMA, exit codes): a leaf module."""
from __future__ import annotations

import contextlib
import copy
import math
import os
import re
from dataclasses import dataclass
from typing import Optional

import torch
from torch.distributed.tensor.experimental import implicit_replication
from torch.utils._pytree import tree_map_only

from .hardware import keep_freed_memory, measure_peak_flops, release_freed_memory

EXIT_CONFIG = 2            # bad config or data: a one-line error
EXIT_NONFINITE = 3         # too many non-finite losses in a row; the last good checkpoint is kept
EXIT_PREEMPTED = 75        # SIGTERM/SIGINT: checkpoint written, run again to resume

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def amp_dtype(precision: str) -> Optional[torch.dtype]:
    """The autocast dtype of a resolved train.precision (None: fp32); bf16-pure computes in bf16 as bf16 does."""
    return None if precision == "fp32" else DTYPES[precision.removesuffix("-pure")]


class RunStopped(Exception):
    """The run ends early with `code` (one of the EXIT_* above) and a one-line message."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


def stop_line(e: BaseException) -> str:
    """The line a run ends with, on stderr and in its log.txt: 'error: ...' unless a signal's stop (exit 75)."""
    return str(e) if getattr(e, "code", None) == EXIT_PREEMPTED else f"error: {e}"


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        mps = getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()
        return torch.device("cuda" if torch.cuda.is_available() else "mps" if mps else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RunStopped(f"train.device={name}: CUDA is not available on this machine", EXIT_CONFIG)
    return dev


def cpu_has_bf16() -> Optional[bool]:
    """Whether /proc/cpuinfo's flags show bf16 instructions (avx512_bf16, amx_bf16, bf16); None without it."""
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return None
    flags = set(" ".join(re.findall(r"^(?:flags|Features)\s*:(.*)$", text, re.M)).split())
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"}) if flags else None


def matmul_speeds(device: torch.device, rounds: int = 6) -> tuple[float, float]:
    """(bf16, fp32) matmul FLOP/s, the best of alternating timings, repeated until the ratio moves by
    less than 5% from one round to the next (at least 2 rounds): the same answer under other load."""
    best, ratio = {torch.bfloat16: 0.0, None: 0.0}, None
    with torch.random.fork_rng(devices=[]):
        for i in range(rounds):
            for dtype in best:
                best[dtype] = max(best[dtype], measure_peak_flops(device, dtype))
            was, ratio = ratio, best[torch.bfloat16] / best[None]
            if was is not None and abs(ratio - was) < 0.05 * was:
                break
    return best[torch.bfloat16], best[None]


def resolve_precision(precision: str, device: torch.device, log=lambda m: None) -> str:
    """train.precision as it will run: 'auto' is bf16 on a GPU that supports it, on a CPU with bf16 instructions
    unless it times under half fp32's speed, else fp32; an explicit bf16 a CPU emulates is kept, with a warning."""
    p = precision
    if p in ("bf16", "bf16-pure") and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise RunStopped(f"train.precision={p}: this GPU does not support bf16; use fp16 or auto", EXIT_CONFIG)
    if p not in ("auto", "bf16") or device.type not in ("cpu", "cuda"):
        return "fp32" if p == "auto" else p
    if device.type == "cuda":
        return "bf16" if p == "bf16" or torch.cuda.is_bf16_supported() else "fp32"
    native = cpu_has_bf16()
    if p == "auto" and native is False:
        log("precision: auto -> fp32 (this CPU has no bf16 instructions)")
        return "fp32"
    bf16, fp32 = matmul_speeds(device)
    speeds = f"matmul on this CPU: bf16 {bf16 / 1e9:.1f}, fp32 {fp32 / 1e9:.1f} GFLOP/s"
    if p == "auto":
        choice = "bf16" if bf16 >= (0.5 if native else 1.5) * fp32 else "fp32"
        why = "this CPU has bf16 instructions" if native else "no instruction flags to read"
        log(f"precision: auto -> {choice} ({why}; {speeds})")
        return choice
    if bf16 < 0.5 * fp32:
        log(f"precision: warning: train.precision=bf16 on a CPU that emulates bf16 ({speeds}); "
            f"fp32 or auto would be faster")
    return p


def precision_of(dtype: Optional[torch.dtype]) -> str:
    """The precision name of a compute dtype (None: fp32)."""
    return "fp32" if dtype is None else next(k for k, v in DTYPES.items() if v == dtype)


def autocast_for(device: torch.device, precision: str):
    """A factory of the run's autocast context (a no-op context in fp32)."""
    return contextlib.nullcontext if precision == "fp32" else \
        lambda: torch.autocast(device.type, dtype=amp_dtype(precision))


def setup_backends(t, device: torch.device, log, owns_process: bool = False):
    """Apply `t`'s device settings (the train: section); returns what undoes them (glibc's freed memory,
    TF32, cudnn.benchmark, deterministic algorithms), run at the end unless the run owns the process."""
    undo = []
    keep = t.cpu_keep_memory if t.cpu_keep_memory is not None else owns_process
    if device.type == "cpu" and keep:
        if keep_freed_memory():
            undo.append(release_freed_memory)
            log("backends: cpu, freed memory kept for reuse (glibc: no mmap, no trim; train.cpu_keep_memory)"
                + ("" if owns_process else "; glibc's defaults are restored when train() returns"))
        else:
            log("backends: cpu_keep_memory skipped (needs Linux with glibc)")
    flags = [(torch.backends.cuda.matmul, "allow_tf32"), (torch.backends.cudnn, "allow_tf32"),
             (torch.backends.cudnn, "benchmark")]
    before = [getattr(m, k) for m, k in flags] + [torch.are_deterministic_algorithms_enabled(),
                                                  os.environ.get("CUBLAS_WORKSPACE_CONFIG")]

    def restore():
        for (m, k), v in zip(flags, before):
            setattr(m, k, v)
        torch.use_deterministic_algorithms(before[3])
        if before[4] is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    undo.append(restore)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = t.tf32, t.tf32
        torch.backends.cudnn.benchmark = t.cudnn_benchmark and not t.deterministic
        log(f"backends: cuda, tf32={t.tf32}, cudnn.benchmark={torch.backends.cudnn.benchmark}")
    elif skipped := [k for k in ("tf32", "cudnn_benchmark") if getattr(t, k)]:
        log(f"backends: {device.type}: {', '.join(skipped)} skipped (CUDA only)")
    if t.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
        if device.type == "cuda":
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    return lambda: [f() for f in undo]


def to_device(batch, device, channels_last: bool):
    """Every tensor of a batch (nested tuples, lists, dicts) on `device`, 4-D ones channels-last when asked."""
    def move(t):
        t = t.to(device, non_blocking=True)
        return t.contiguous(memory_format=torch.channels_last) if channels_last and t.dim() == 4 else t
    return tree_map_only(torch.Tensor, move, batch)


class EMA:
    """Exponential moving average of a model's floating-point weights and buffers (others copied)."""

    def __init__(self, model: torch.nn.Module, decay: float):
        self.decay, self.model = decay, copy.deepcopy(model).eval().requires_grad_(False)

    @torch.no_grad()
    def update(self, model: torch.nn.Module):
        src, done = dict(model.state_dict(keep_vars=True)), set()
        for k, v in self.model.state_dict(keep_vars=True).items():
            if id(v) in done:  # a tied tensor (embedding = LM head) is updated once
                continue
            done.add(id(v))
            s = src[k].detach()
            if v.is_floating_point():
                v.lerp_(s, 1.0 - self.decay)
            else:
                v.copy_(s)


class MicroBatchOOM(RuntimeError):
    """A micro-batch's forward or backward ran out of memory: its gradients are cleared, no weight has changed."""


@dataclass
class StepResult:
    loss: float         # mean of the micro-batches' losses
    grad_norm: float    # global norm of the accumulated (unscaled) gradients, before clipping
    items: int          # tokens / images the step covered
    finite: bool        # False: a non-finite loss (or gradient, without a GradScaler): step skipped
    applied: bool       # the optimizer changed the weights
    overflow: bool      # fp16: the GradScaler found inf/nan gradients, skipped the step, lowered its scale
    micro_sq: Optional[float] = None  # with probe: the squared norm of the first micro-batch's own (unscaled) gradient


def optimizer_step(loss_fn, batches, n_micro: int, optimizer, scaler, params, clip: Optional[float],
                   autocast=contextlib.nullcontext, no_sync=None, agree=None, pipeline=None, probe=False) -> StepResult:
    """One optimizer step over `n_micro` micro-batches; loss_fn(batch) -> (mean loss, items), each loss
    divided by n_micro. Unscale (fp16), clip (None: measure only), step unless the loss or norm is not
    finite; data-parallel runs pass no_sync(last) and agree([loss sum, grad norm]) to agree on it. pipeline:
    pipeline(batch, scale) runs forward and backward itself, then finishes the gradients (train/model_parallel.py).
    probe: the first micro-batch's gradient norm measured too (StepResult.micro_sq), with more than one."""
    loss_sum, items, micro = None, 0, None
    try:
        for i, batch in enumerate(batches):
            with no_sync(i == n_micro - 1) if no_sync is not None else contextlib.nullcontext():
                with autocast():
                    loss, n = loss_fn(batch) if pipeline is None else pipeline(batch, 1 / n_micro)
                if pipeline is None:
                    scaler.scale(loss / n_micro).backward()
            loss_sum = loss.detach().float() if loss_sum is None else loss_sum + loss.detach().float()
            if probe and i == 0 and n_micro > 1 and pipeline is None:
                micro = clip_grads(params, None) * n_micro / (scaler.get_scale() if scaler.is_enabled() else 1)
            items += n
    except torch.OutOfMemoryError as e:
        optimizer.zero_grad(set_to_none=True)
        raise MicroBatchOOM(str(e)) from e
    scaler.unscale_(optimizer)
    gnorm = (pipeline.finish_grads if pipeline is not None else clip_grads)(params, clip)
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
    return StepResult(loss_val, gnorm_val, items, finite, finite and grads_ok, scaler.is_enabled() and not grads_ok,
                      None if micro is None else micro.item() ** 2)


def noise_parts(small_sq: float, big_sq: float, b_small: int, b_big: int) -> tuple[float, float]:
    """Unbiased estimates (|G|^2, tr(Sigma)) of the true gradient's squared norm and the per-example gradient
    covariance's trace from squared gradient norms at batches of b_small and b_big examples (McCandlish et al.
    2018, appendix A); the simple noise scale B_simple is tr(Sigma) / |G|^2, each part averaged over steps first."""
    return ((b_big * big_sq - b_small * small_sq) / (b_big - b_small),
            (small_sq - big_sq) / (1 / b_small - 1 / b_big))


def clip_grads(params, clip: Optional[float]) -> torch.Tensor:
    """The global norm of the parameters' gradients, which are plain tensors or DTensors on any meshes (FSDP2,
    tensor parallelism: each mesh's norm made whole), the gradients clipped to `clip` when set (mesh by mesh; the
    scale, a plain tensor, multiplies DTensors as a replica)."""
    groups = {}
    for p in params:
        if p.grad is not None:
            groups.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    norms = [torch.nn.utils.get_total_norm([p.grad for p in g]) for g in groups.values()]
    norms = [(n.full_tensor() if hasattr(n, "full_tensor") else n).float() for n in norms]
    norm = torch.linalg.vector_norm(torch.stack(norms)) if len(norms) > 1 else norms[0] if norms else torch.zeros(())
    for mesh, group in groups.items() if clip else ():
        with contextlib.nullcontext() if mesh is None else implicit_replication():
            torch.nn.utils.clip_grads_with_norm_(group, clip, norm)
    return norm


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module):
    """model.eval() inside, the mode it had restored after."""
    was = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was)


@torch.no_grad()
def clip_weights_(params, c: float):
    """train.clip_weights: every weight clamped to [-c, c] after the step."""
    for p in params:
        p.clamp_(-c, c)
