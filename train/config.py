"""The run config: one YAML file fully describes a run.

    family: llm            # which model family / task
    model:  {...}          # the family's model config (zoo/config.py)
    data:   {...}          # the task's data config (train/tasks/<family>.py)
    train:  {...}          # TrainConfig below: the loop
    optim:  {...}          # OptimConfig below: optimizer and LR schedule
    adapter: {...}         # zoo.adapters.AdapterConfig: LoRA / DoRA / QLoRA / prefix tuning

`load_run_config(path, overrides)` reads the YAML, applies `key=value` overrides
(e.g. `train.max_steps=100 model.n_layers=2`) and validates every key.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
import re
from typing import Any, Literal, Optional, Union

from zoo.adapters import AdapterConfig
from zoo.config import (ConfigError, deep_merge, fail, from_dict, load_yaml, model_config_from,
                        parse_overrides, to_dict)


@dataclass
class TrainConfig:
    out_dir: str = "runs/default"
    max_steps: int = 1000
    batch_size: Union[int, Literal["auto"]] = 16  # per micro-batch; auto: the largest that fits (docs/memory.md)
    global_batch: Optional[int] = None      # with batch_size auto: items per optimizer step (grad_accum follows)
    memory_budget: Optional[Union[int, str]] = None  # batch_size auto: memory for the step, e.g. 8GB (or bytes); null: the
                                            # device's (CPU: available RAM; CUDA: free memory)
    activation_offload: bool = False        # CUDA: saved activations in pinned host memory (save_on_cpu)
    grad_accum: int = 1                     # micro-batches per optimizer step
    device: str = "auto"                    # auto | cpu | cuda | cuda:N | mps
    precision: Literal["fp32", "bf16", "fp16", "auto"] = "fp32"  # auto: bf16 where the device runs it fast
    tf32: bool = True                       # CUDA only
    cudnn_benchmark: bool = True            # CUDA only
    cpu_keep_memory: Optional[bool] = None  # CPU, Linux glibc: reuse freed memory instead of unmapping it
                                            # (process-wide); null: when run by train/run.py
    compile: bool = False                   # torch.compile the model
    clip_grad: Optional[float] = 1.0        # max global grad norm; null = off
    seed: int = 0
    deterministic: bool = False             # torch.use_deterministic_algorithms
    log_every: int = 10
    eval_every: int = 200                   # 0 = only at the end
    eval_batches: int = 20
    checkpoint_every: int = 500             # 0 = only at the end
    keep_checkpoints: int = 2               # how many recent checkpoints to keep
    resume: bool = True                     # resume from out_dir when it holds a checkpoint
    channels_last: bool = False             # memory format for 4-D models and batches
    ema_decay: Optional[float] = None       # keep an EMA of the weights (evaluated beside them)
    max_nonfinite: int = 5                  # non-finite losses in a row before the run stops
    peak_flops: Optional[float] = None      # for MFU; null = measured at start on this device
    init_from: Optional[str] = None         # pretrained weights to start (fine-tune) from
    export: bool = True                     # at the end, export in the pretrained format (if any)
    progress: bool = True                   # live progress bar
    samples: bool = True                    # print / write samples at the end
    plot: bool = True                       # loss-curve PNG at the end
    tracker: Literal["none", "tensorboard", "wandb"] = "none"  # also send the metrics rows there
    tracker_project: Optional[str] = None   # wandb: the project; null = "zoo"
    tracker_mode: Optional[Literal["offline", "online"]] = None  # wandb; null = $WANDB_MODE, else offline
    unfreeze: Optional[list[int]] = None    # gradual unfreezing: steps at which the next group (top down) trains
    batch_warmup_steps: int = 0             # ramp the micro-batches per step from 1 to grad_accum over these steps
    clip_weights: Optional[float] = None    # after each step clamp every weight to [-c, c]; null = off
    average_last: int = 0                   # average the weights of the last K checkpoints (0 = off)
    average_weighting: Literal["uniform", "linear"] = "uniform"  # linear: weights 1..K, the newest heaviest
    lr_find: bool = False                   # run the LR range test instead of training
    lr_find_min: float = 1e-6               # the range test's LRs, exponentially spaced
    lr_find_max: float = 1.0
    lr_find_steps: int = 100
    parallel: Literal["none", "ddp", "fsdp"] = "none"  # under torchrun: DDP or FSDP2 (docs/distributed.md)
    sync_bn: bool = False                   # parallel runs: BatchNorm statistics over the global batch

    def validate(self, source, prefix="train."):
        for k in ("max_steps", "batch_size", "grad_accum", "log_every", "eval_batches", "keep_checkpoints",
                  "max_nonfinite"):
            if getattr(self, k) != "auto" and getattr(self, k) <= 0:
                raise fail(source, prefix + k, f"must be > 0, got {getattr(self, k)}")
        if self.global_batch is not None and self.global_batch <= 0:
            raise fail(source, prefix + "global_batch", f"must be > 0 or null, got {self.global_batch}")
        if self.batch_size == "auto" and self.global_batch is None:
            raise fail(source, prefix + "batch_size", "=auto needs train.global_batch (the items per optimizer step "
                                                      "it keeps through gradient accumulation)")
        if self.memory_budget is not None:
            try:
                parse_memory_size(self.memory_budget)
            except ValueError as e:
                raise fail(source, prefix + "memory_budget", str(e)) from None
        for k in ("eval_every", "checkpoint_every"):
            if getattr(self, k) < 0:
                raise fail(source, prefix + k, f"must be >= 0, got {getattr(self, k)}")
        if self.clip_grad is not None and self.clip_grad <= 0:
            raise fail(source, prefix + "clip_grad", f"must be > 0 or null, got {self.clip_grad}")
        if self.ema_decay is not None and not 0.0 < self.ema_decay < 1.0:
            raise fail(source, prefix + "ema_decay", f"must be in (0, 1) or null, got {self.ema_decay}")
        for k in ("batch_warmup_steps", "average_last"):
            if getattr(self, k) < 0:
                raise fail(source, prefix + k, f"must be >= 0, got {getattr(self, k)}")
        if self.clip_weights is not None and self.clip_weights <= 0:
            raise fail(source, prefix + "clip_weights", f"must be > 0 or null, got {self.clip_weights}")
        if self.lr_find_steps < 2:
            raise fail(source, prefix + "lr_find_steps", f"must be >= 2, got {self.lr_find_steps}")
        if not 0 < self.lr_find_min < self.lr_find_max:
            raise fail(source, prefix + "lr_find_min", f"must be > 0 and < train.lr_find_max={self.lr_find_max}, "
                                                       f"got {self.lr_find_min}")
        if self.peak_flops is not None and self.peak_flops <= 0:
            raise fail(source, prefix + "peak_flops", f"must be > 0 or null, got {self.peak_flops}")
        dev, colon, index = self.device.partition(":")
        if dev not in ("auto", "cpu", "cuda", "mps", "xpu") or (colon and (dev == "auto" or not index.isdigit())):
            raise fail(source, prefix + "device", f"must be auto, cpu, cuda[:N], mps or xpu, got {self.device!r}")
        if not self.out_dir:
            raise fail(source, prefix + "out_dir", "must not be empty")
        if self.init_from is not None and not self.init_from:
            raise fail(source, prefix + "init_from", "must be a path or null, got ''")
        if self.tracker_project is not None and not self.tracker_project.strip():
            raise fail(source, prefix + "tracker_project", "must be a name or null, got ''")
        if self.unfreeze is not None and (not self.unfreeze or any(s <= 0 for s in self.unfreeze)
                                          or sorted(set(self.unfreeze)) != list(self.unfreeze)):
            raise fail(source, prefix + "unfreeze", f"must be increasing steps > 0 or null, got {self.unfreeze}")
        from .tracking import missing_package
        missing = missing_package(self.tracker, prefix + "tracker")
        if missing:
            raise ConfigError(f"{source}: {missing}")


def parse_memory_size(text) -> int:
    """'24GB', '24GiB', '512MB', '1.5T', 2e9 -> bytes (GB and GiB both mean 2^30: what people mean)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([kKmMgGtT]?)(i?[bB])?\s*", str(text))
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"must be a memory size such as 24GB or 512MB, got {text!r}")
    return int(float(m.group(1)) * 1024 ** " KMGT".index(m.group(2).upper() or " "))


def _installed(module: str) -> bool:
    import importlib.util
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


@dataclass
class OptimConfig:
    name: Literal["adamw", "sgd", "adafactor", "lion", "muon", "adamw8bit", "adamw_offload", "galore"] = "adamw"
    lr: float = 3e-4
    weight_decay: float = 0.1               # not applied to norms, biases and embeddings
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    momentum: float = 0.9                   # sgd
    nesterov: bool = True                   # sgd
    fused: Optional[bool] = None            # null = fused where the device supports it
    schedule: Literal["cosine", "constant", "linear", "wsd", "onecycle", "inverse_sqrt"] = "cosine"
    warmup_steps: Optional[int] = None      # absolute warmup; null: warmup_fraction, else 10% of the run, at most 100
    warmup_fraction: Optional[float] = None  # warmup as a fraction of train.max_steps (floor), used when warmup_steps is null
    min_lr_ratio: float = 0.1               # final LR / peak LR (cosine, linear, wsd)
    decay_fraction: float = 0.2             # wsd: the last fraction of steps that decays
    onecycle_div: float = 25.0              # onecycle: the LR starts at peak / onecycle_div
    muon_lr: float = 0.02                   # muon: Muon's peak LR on the hidden matrices (optim.lr: AdamW's)
    muon_momentum: float = 0.95             # muon
    adafactor_beta2_decay: float = -0.8     # adafactor: beta2 at step t is 1 - t^beta2_decay
    galore_rank: int = 128                  # galore: rank of the projected gradient states
    galore_update_every: int = 200          # galore: steps between projections (an SVD of the gradient)
    galore_scale: float = 0.25              # galore: the projected-back update is multiplied by this

    def resolved_warmup_steps(self, max_steps: int) -> int:
        """warmup_steps when given (an absolute count wins, so that `optim.warmup_steps=N` on the
        command line overrides a config's fraction); else floor(warmup_fraction x max_steps), which
        stays below max_steps for any run length; else 10% of the run, at most 100 steps."""
        if self.warmup_steps is not None:
            return self.warmup_steps
        if self.warmup_fraction is not None:
            return int(self.warmup_fraction * max_steps + 1e-9)  # 0.29 x 100 is 28.999...: 29
        return min(100, max_steps // 10)

    def validate(self, source, prefix="optim."):
        if self.lr <= 0:
            raise fail(source, prefix + "lr", f"must be > 0, got {self.lr}")
        if self.weight_decay < 0:
            raise fail(source, prefix + "weight_decay", f"must be >= 0, got {self.weight_decay}")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise fail(source, prefix + "betas", f"must be two numbers in [0, 1), got {list(self.betas)}")
        if self.eps <= 0:
            raise fail(source, prefix + "eps", f"must be > 0, got {self.eps}")
        if not 0.0 <= self.momentum < 1.0:
            raise fail(source, prefix + "momentum", f"must be in [0, 1), got {self.momentum}")
        if self.warmup_steps is not None and self.warmup_steps < 0:
            raise fail(source, prefix + "warmup_steps", f"must be >= 0, got {self.warmup_steps}")
        if self.warmup_fraction is not None and not 0.0 <= self.warmup_fraction < 1.0:
            raise fail(source, prefix + "warmup_fraction", f"must be in [0, 1), got {self.warmup_fraction}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise fail(source, prefix + "min_lr_ratio", f"must be in [0, 1], got {self.min_lr_ratio}")
        if not 0.0 < self.decay_fraction <= 1.0:
            raise fail(source, prefix + "decay_fraction", f"must be in (0, 1], got {self.decay_fraction}")
        if self.name == "adamw8bit" and not _installed("torchao"):
            raise fail(source, prefix + "name", "=adamw8bit needs the torchao package: pip install -e '.[optim]'")
        if self.onecycle_div < 1.0:
            raise fail(source, prefix + "onecycle_div", f"must be >= 1, got {self.onecycle_div}")
        if self.muon_lr <= 0:
            raise fail(source, prefix + "muon_lr", f"must be > 0, got {self.muon_lr}")
        if not 0.0 <= self.muon_momentum < 1.0:
            raise fail(source, prefix + "muon_momentum", f"must be in [0, 1), got {self.muon_momentum}")
        if self.adafactor_beta2_decay >= 0:
            raise fail(source, prefix + "adafactor_beta2_decay", f"must be < 0, got {self.adafactor_beta2_decay}")
        for k in ("galore_rank", "galore_update_every"):
            if getattr(self, k) < 1:
                raise fail(source, prefix + k, f"must be >= 1, got {getattr(self, k)}")
        if self.galore_scale <= 0:
            raise fail(source, prefix + "galore_scale", f"must be > 0, got {self.galore_scale}")


@dataclass
class RunConfig:
    family: str
    model: Any
    data: Any
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    adapter: AdapterConfig = field(default_factory=AdapterConfig)
    source: str = "<config>"
    explicit: dict = field(default_factory=dict)  # the keys as written (file + overrides), before defaults

    def to_dict(self) -> dict:
        return {"family": self.family, "model": to_dict(self.model), "data": to_dict(self.data),
                "train": to_dict(self.train), "optim": to_dict(self.optim), "adapter": to_dict(self.adapter)}


SECTIONS = ("family", "model", "data", "train", "optim", "adapter")


def run_config_from_dict(data: dict, source: str = "<config>") -> RunConfig:
    from .tasks import task_class
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the config must be a mapping")
    for k in data:
        if k not in SECTIONS:
            raise ConfigError(f"{source}: unknown key {str(k)!r} (known: {', '.join(SECTIONS)})")
    family = data.get("family", "llm")
    if not isinstance(family, str):
        raise ConfigError(f"{source}: family must be a string, got {family!r}")
    task = task_class(family, source)
    model = model_config_from(data.get("model") or {}, family, source)
    dcfg = from_dict(task.DataConfig, data.get("data") or {}, source, "data.")
    train = from_dict(TrainConfig, data.get("train") or {}, source, "train.")
    optim = from_dict(OptimConfig, data.get("optim") or {}, source, "optim.")
    adapter = from_dict(AdapterConfig, data.get("adapter") or {}, source, "adapter.")
    cfg = RunConfig(family, model, dcfg, train, optim, adapter, source, data)
    check_across_sections(cfg)
    check = getattr(task, "validate_config", None)
    if check is not None:
        check(cfg)
    return cfg


def check_across_sections(cfg: RunConfig):
    """Keys that are each valid but make no sense together: one-line errors naming both."""
    t, o, src = cfg.train, cfg.optim, cfg.source
    warmup = o.resolved_warmup_steps(t.max_steps)
    wkey = "optim.warmup_steps" if o.warmup_steps is not None or o.warmup_fraction is None else "optim.warmup_fraction"
    if warmup >= t.max_steps:
        raise fail(src, "optim.warmup_steps", f"={warmup} must be < train.max_steps={t.max_steps} "
                                              f"(the whole run would be warmup; optim.warmup_fraction scales with the run)")
    if o.schedule == "wsd":
        decay = max(1, round(o.decay_fraction * t.max_steps))
        if warmup > t.max_steps - decay:
            what = f"={warmup}" if wkey == "optim.warmup_steps" else f"={o.warmup_fraction} ({warmup} steps)"
            raise fail(src, wkey, f"{what} runs into the decay of optim.schedule=wsd, "
                                                  f"which starts at step {t.max_steps - decay} (optim.decay_fraction="
                                                  f"{o.decay_fraction} of train.max_steps={t.max_steps})")
    a = cfg.adapter
    if a.enabled and t.unfreeze is not None:
        raise fail(src, "train.unfreeze", f"with adapter.method={a.method}: the base stays frozen, nothing to unfreeze")
    if a.quantize_base != "none" and t.ema_decay is not None:
        raise fail(src, "train.ema_decay", f"with adapter.quantize_base={a.quantize_base}: an EMA of a quantised "
                                           f"model is not supported")
    if a.export_merged and a.method == "prefix":
        raise fail(src, "adapter.export_merged", "prefix tuning has no merged form (its keys and values are not "
                                                 "weights of the base)")
    if t.average_last > t.keep_checkpoints:
        raise fail(src, "train.average_last", f"={t.average_last} needs as many checkpoints kept "
                                              f"(train.keep_checkpoints={t.keep_checkpoints})")
    if t.batch_warmup_steps and t.batch_warmup_steps >= t.max_steps:
        raise fail(src, "train.batch_warmup_steps", f"={t.batch_warmup_steps} must be < train.max_steps={t.max_steps}")
    if t.batch_warmup_steps and t.grad_accum == 1:
        raise fail(src, "train.batch_warmup_steps", "ramps the micro-batches up to train.grad_accum, which is 1")
    if t.batch_size == "auto" and t.lr_find:
        raise fail(src, "train.batch_size", "=auto does not combine with train.lr_find (give the batch size to test)")
    if t.batch_size == "auto" and t.batch_warmup_steps:
        raise fail(src, "train.batch_warmup_steps", "does not combine with train.batch_size=auto")
    if t.init_from is not None and not Path(t.init_from).expanduser().exists():
        raise fail(src, "train.init_from", f"={t.init_from}: no such file or folder")


def load_run_config(path: Optional[str], overrides=(), base: Optional[dict] = None) -> RunConfig:
    """Read a YAML run config (or start from `base`), apply key=value overrides, validate."""
    data = load_yaml(path) if path else dict(base or {})
    source = str(path) if path else "<config>"
    if overrides:
        data = deep_merge(data, parse_overrides(list(overrides)))
        source = f"{source} (with overrides)" if path else "command line"
    return run_config_from_dict(data, source)
