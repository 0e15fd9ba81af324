"""The run builder: a run config -> everything a training step needs (device, precision, task, model, adapters,
pruning, unfreezing, wrapping, EMA, optimizer, scaler), built one way for the loop, the LR finder and the
benchmarks; the model is train/model.py's, which the memory planner builds too. The config is never changed.
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
import yaml
from torch import nn

from zoo.adapters import apply_adapters, count_params, trainable_keys
from zoo.config import to_dict
from zoo.pruning import apply_masks
from zoo.weights.files import atomic_write

from .config import PARALLEL_ONLY, TrainConfig, task_class
from .distributed import Launch, Parallel, unsupported
from .features.distill import load_teacher
from .features.prune import prune_linears
from .features.unfreeze import GradualUnfreezing
from .model import apply_runtime, build_model
from .optim import build_optimizer
from .planner import auto_batch_size, refusal
from .step import EMA, EXIT_CONFIG, RunStopped, amp_dtype, autocast_for, resolve_device, resolve_precision


@dataclass
class Run:
    cfg: object                        # the run config with resolved values (batch size); the user's is untouched
    device: torch.device
    precision: str                     # as it runs: fp32 | bf16 | fp16
    task: object
    model: nn.Module                   # the module whose state is checkpointed (sharded in place by FSDP2)
    fwd: Callable                      # what the loss runs: the model, DDP(model) or torch.compile(...)
    optimizer: Optional[torch.optim.Optimizer] = None
    scaler: Optional[torch.amp.GradScaler] = None
    ema: Optional[EMA] = None
    keys: Optional[set] = None         # an adapter run: the state-dict names it checkpoints (what trains)
    unfreezer: Optional[GradualUnfreezing] = None
    par: Parallel = field(default_factory=lambda: Parallel("none", Launch()))
    quantized: Optional[nn.Module] = None  # train.qat / train.quantize: the deployed model, made at the end
    pruned: Optional[dict] = None      # train.prune: {linear's name: (weight, mask)}, held after every step
    auto_batch: bool = False           # train.batch_size: auto (the micro-batch halves on running out of memory)

    @property
    def amp_dtype(self) -> Optional[torch.dtype]:
        return amp_dtype(self.precision)

    def autocast(self):
        return autocast_for(self.device, self.precision)()

    def set_precision(self, precision: str):
        """A resumed run keeps the precision it was trained in (train.precision: auto)."""
        self.precision, self.task.autocast_dtype = precision, self.amp_dtype

    @contextlib.contextmanager
    def train_context(self):
        """A training forward and backward's context: autocast (and activation offload on CUDA)."""
        offload = self.cfg.train.activation_offload and self.device.type == "cuda"
        with self.autocast(), (torch.autograd.graph.save_on_cpu(pin_memory=True) if offload
                               else contextlib.nullcontext()):
            yield

    def write_config(self, out):
        """<out>/config.yaml: the run's config with its resolved values; the model: section is the
        architecture built (the one loaded with train.init_from; an image folder's channels and classes)."""
        data, built = self.cfg.to_dict(), getattr(self.model, "config", None)
        if type(built) is type(self.cfg.model):
            data["model"] = to_dict(built)
        atomic_write(Path(out) / "config.yaml", yaml.safe_dump(data, sort_keys=False))

    def params(self) -> list:
        return [p for p in self.model.parameters() if p.requires_grad]

    def plain_model(self) -> nn.Module:
        """A new unwrapped model of the run on its device (the runtime settings and adapters applied, as the trained
        model's), for gathered or averaged weights."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.cfg.train.seed)  # a base drawn at random: the run's own
            model = apply_runtime(self.task.build_model(), self.cfg.train, source=self.cfg.source)
            if self.cfg.adapter.enabled:
                apply_adapters(model, self.cfg.adapter, self.cfg.source)
        return model.to(self.device)

    def adapter_id(self) -> dict:
        """What an adapter checkpoint is only valid with: the adapter settings and the base weights."""
        if self.keys is None:
            return {}
        a = {k: v for k, v in self.cfg.to_dict()["adapter"].items() if k != "export_merged"}
        return {"adapter": a, "base": self.cfg.train.init_from}


def new_task(cfg, device: torch.device, precision: str, say, par: Optional[Parallel] = None):
    """The family's task with its data read (task.setup())."""
    task = task_class(cfg.family, cfg.source, cfg.data)(cfg, device, say)
    task.autocast_dtype = amp_dtype(precision)  # the run's autocast, for evaluation
    if par is not None and par.active:  # this rank's part of every global batch; sums across ranks
        task.rank, task.world, task.sum_across_ranks = par.dp_rank, par.dp_world, par.sum_
    task.setup()
    return task


def batch_scaled_lr(cfg, ranks: int, say):
    """cfg with optim.lr and optim.muon_lr scaled by optim.lr_batch_scaling of the global batch over
    optim.reference_batch, the scaling then marked done ('none': config.yaml holds the resolved LRs)."""
    o, t = cfg.optim, cfg.train
    batch = t.batch_size * t.grad_accum * ranks
    f = (batch / o.reference_batch) ** (0.5 if o.lr_batch_scaling == "sqrt" else 1.0)
    say(f"optim: lr {o.lr:g} -> {o.lr * f:g}, muon_lr {o.muon_lr:g} -> {o.muon_lr * f:g} ({o.lr_batch_scaling} of the "
        f"global batch {batch} / optim.reference_batch {o.reference_batch})")
    return dataclasses.replace(cfg, optim=dataclasses.replace(o, lr=o.lr * f, muon_lr=o.muon_lr * f,
                                                              lr_batch_scaling="none"))


def build_run(cfg, say=lambda m: None, par: Optional[Parallel] = None) -> Run:
    """Build the run `cfg` describes. par: the data-parallel side (train/distributed.py; one process
    when None). train.batch_size: auto is resolved by the planner (train/planner.py's auto_batch_size)."""
    t, par = cfg.train, par or Parallel("none", Launch())
    if par.active and (why := unsupported(cfg, par.world)):
        raise RunStopped(f"{cfg.source}: {why}", EXIT_CONFIG)
    device = par.device(resolve_device(t.device))
    par.init(device, host=t.fsdp_offload)
    if par.active:
        say(par.describe())
    elif t.parallel != "none":
        idle = [f"train.{k}" for k in PARALLEL_ONLY if getattr(t, k) != getattr(TrainConfig, k)]
        say(f"parallel: train.parallel={t.parallel} skipped: not launched by torchrun (one process)"
            + (f"; so are {', '.join(idle)}" if idle else ""))
    torch.manual_seed(t.seed)
    precision = par.broadcast(resolve_precision(t.precision, device, say))  # auto: rank 0's measurement decides
    say(f"run: family={cfg.family} device={device} precision={precision} compile={t.compile} out_dir={t.out_dir}")
    planned = dataclasses.replace(cfg, train=dataclasses.replace(t, precision=precision))
    if why := par.broadcast(refusal(planned, device, par.world if par.active else 1,
                                    "fsdp2" if par.active and t.parallel == "fsdp" else "ddp")):
        raise RunStopped(why, EXIT_CONFIG)
    task = new_task(cfg, device, precision, say, par)
    model = build_model(cfg, task, device, say, fsdp=par.active and t.parallel == "fsdp")
    pruned = prune_linears(model, cfg, say)
    task.teacher = load_teacher(cfg, task, model, device, say)
    keys = trainable_keys(model) if cfg.adapter.enabled else None
    if t.batch_size == "auto":  # resolved in a copy of the config (the user's is untouched)
        b, accum = auto_batch_size(cfg, model, task, device, Path(t.out_dir), say, par)
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(t, batch_size=b, grad_accum=accum))
        task.cfg = cfg
    if cfg.optim.lr_batch_scaling != "none":
        cfg = task.cfg = batch_scaled_lr(cfg, par.dp_world, say)
    n_train, n_params = count_params(model)
    say(f"model: {type(model).__name__}, {n_params / 1e6:.2f}M parameters"
        + (f", {n_train / 1e6:.3f}M trainable ({100 * n_train / n_params:.2f}%)" if n_train < n_params else ""))
    ema = EMA(model, t.ema_decay) if t.ema_decay else None
    unused = bool(t.unfreeze) or getattr(cfg.model, "drop_path_mode", None) == "batch"
    model, fwd = par.wrap(model, precision, t, device, say, unused=unused)
    par.shard_masks(model, pruned)
    # after wrapping: DDP and FSDP2 take in every parameter, the stages unfreeze them later
    unfreezer = GradualUnfreezing(model, task.unfreeze_groups(model), t.unfreeze, cfg.optim.weight_decay, say,
                                  cfg.optim.layer_decay) if t.unfreeze else None
    if ema is not None:
        par.shard_like(ema.model)
    par.seed_rank(t.seed)
    if fwd is None and t.compile:
        say("compile: torch.compile(model); the first steps include compilation")
        fwd = torch.compile(model)
    if t.activation_offload:
        say("activation offload: saved activations go to pinned host memory (torch.autograd.graph.save_on_cpu)"
            if device.type == "cuda" else
            f"activation offload: skipped on {device.type} (CUDA only: activations already live in host memory)")
    run = Run(cfg, device, precision, task, model, fwd if fwd is not None else model, ema=ema, keys=keys,
              unfreezer=unfreezer, par=par, pruned=pruned, auto_batch=t.batch_size == "auto")
    try:
        run.optimizer = build_optimizer(model, cfg.optim, device, say)
    except ValueError as e:  # e.g. optim.name=muon on a model without hidden matrices
        raise RunStopped(str(e), EXIT_CONFIG) from None
    run.scaler = torch.amp.GradScaler(device.type, t.loss_scale, enabled=precision == "fp16")
    if pruned:
        after_step(run.optimizer, lambda: apply_masks(pruned))
    if (hook := task.step_hook(model)) is not None:
        after_step(run.optimizer, hook)
    return run


def after_step(optimizer, fn):
    """Call fn() after every step the optimizer takes (a skipped step takes none)."""
    if hasattr(optimizer, "register_step_post_hook"):
        optimizer.register_step_post_hook(lambda opt, args, kwargs: fn())
        return
    step = optimizer.step  # an optimizer wrapper that is no torch.optim.Optimizer (torchao's CPU offload)

    def stepped(*args, **kwargs):
        out = step(*args, **kwargs)
        fn()
        return out
    optimizer.step = stepped
