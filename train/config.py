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
from zoo.config import (ConfigError, bounded, deep_merge, fail, from_dict, load_yaml, model_config_from,
                        parse_overrides, to_dict)


@dataclass
class TrainConfig:
    out_dir: str = "runs/default"
    max_steps: int = bounded(1000, gt=0)
    batch_size: Union[int, Literal["auto"]] = bounded(16, gt=0)  # per micro-batch; auto: the largest that fits (docs/memory.md)
    global_batch: Optional[int] = bounded(None, gt=0)  # with batch_size auto: items per optimizer step (grad_accum follows)
    memory_budget: Optional[Union[int, str]] = None  # batch_size auto: memory for the step, e.g. 8GB (or bytes); null: the
                                            # device's (CPU: available RAM; CUDA: free memory)
    activation_offload: bool = False        # CUDA: saved activations in pinned host memory (save_on_cpu)
    grad_accum: int = bounded(1, gt=0)      # micro-batches per optimizer step
    device: str = "auto"                    # auto | cpu | cuda | cuda:N | mps
    precision: Literal["fp32", "bf16", "fp16", "auto"] = "fp32"  # auto: bf16 where the device runs it fast
    tf32: bool = True                       # CUDA only
    cudnn_benchmark: bool = True            # CUDA only
    cpu_keep_memory: Optional[bool] = None  # CPU, Linux glibc: reuse freed memory instead of unmapping it
                                            # (process-wide); null: when run by train/run.py
    compile: bool = False                   # torch.compile the model
    attn_backend: Literal["auto", "sdpa", "flash", "bmm", "math"] = "auto"  # LLM attention (zoo/blocks/attention.py)
    activation_checkpointing: Union[bool, Literal["none", "full", "selective"]] = False  # zoo/blocks/checkpoint.py
    activation_checkpointing_every: int = bounded(1, ge=1)  # checkpointing applies to the model's units 0, n, 2n, ...
    chunked_loss: bool = True               # LLM: never materialise the full B*T*V fp32 logits
    loss_chunk_size: int = bounded(2048, gt=0)  # LLM: tokens per chunk of the chunked loss
    clip_grad: Optional[float] = bounded(1.0, gt=0)  # max global grad norm; null = off
    seed: int = 0
    deterministic: bool = False             # torch.use_deterministic_algorithms
    log_every: int = bounded(10, gt=0)
    eval_every: int = bounded(200, ge=0)    # 0 = only at the end
    eval_batches: int = bounded(20, gt=0)
    checkpoint_every: int = bounded(500, ge=0)  # 0 = only at the end
    keep_checkpoints: int = bounded(2, gt=0)  # how many recent checkpoints to keep
    resume: bool = True                     # resume from out_dir when it holds a checkpoint
    channels_last: bool = False             # memory format for 4-D models and batches
    ema_decay: Optional[float] = bounded(None, gt=0, lt=1)  # keep an EMA of the weights (evaluated beside them)
    max_nonfinite: int = bounded(5, gt=0)   # non-finite losses in a row before the run stops
    peak_flops: Optional[float] = bounded(None, gt=0)  # for MFU; null = measured at start on this device
    init_from: Optional[str] = None         # pretrained weights to start (fine-tune) from
    export: bool = True                     # at the end, export in the pretrained format (if any)
    progress: bool = True                   # live progress bar
    samples: bool = True                    # print / write samples at the end
    plot: bool = True                       # loss-curve PNG at the end
    tracker: Literal["none", "tensorboard", "wandb"] = "none"  # also send the metrics rows there
    tracker_project: Optional[str] = None   # wandb: the project; null = "zoo"
    tracker_mode: Optional[Literal["offline", "online"]] = None  # wandb; null = $WANDB_MODE, else offline
    unfreeze: Optional[list[int]] = None    # gradual unfreezing: steps at which the next group (top down) trains
    batch_warmup_steps: int = bounded(0, ge=0)  # ramp the micro-batches per step from 1 to grad_accum over these steps
    clip_weights: Optional[float] = bounded(None, gt=0)  # after each step clamp every weight to [-c, c]; null = off
    average_last: int = bounded(0, ge=0)    # average the weights of the last K checkpoints (0 = off)
    average_weighting: Literal["uniform", "linear"] = "uniform"  # linear: weights 1..K, the newest heaviest
    lr_find: bool = False                   # run the LR range test instead of training
    lr_find_min: float = bounded(1e-6, gt=0)  # the range test's LRs, exponentially spaced
    lr_find_max: float = bounded(1.0, gt=0)
    lr_find_steps: int = bounded(100, ge=2)
    parallel: Literal["none", "ddp", "fsdp"] = "none"  # under torchrun: DDP or FSDP2 (docs/distributed.md)
    sync_bn: bool = False                   # parallel runs: BatchNorm statistics over the global batch

    def validate(self, source, prefix="train."):
        if self.batch_size == "auto" and self.global_batch is None:
            raise fail(source, prefix + "batch_size", "=auto needs train.global_batch (the items per optimizer step "
                                                      "it keeps through gradient accumulation)")
        if self.memory_budget is not None:
            try:
                parse_memory_size(self.memory_budget)
            except ValueError as e:
                raise fail(source, prefix + "memory_budget", str(e)) from None
        if not self.lr_find_min < self.lr_find_max:
            raise fail(source, prefix + "lr_find_min", f"must be > 0 and < train.lr_find_max={self.lr_find_max}, "
                                                       f"got {self.lr_find_min}")
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
    lr: float = bounded(3e-4, gt=0)
    weight_decay: float = bounded(0.1, ge=0)  # not applied to norms, biases and embeddings
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = bounded(1e-8, gt=0)
    momentum: float = bounded(0.9, ge=0, lt=1)  # sgd
    nesterov: bool = True                   # sgd
    fused: Optional[bool] = None            # null = fused where the device supports it
    schedule: Literal["cosine", "constant", "linear", "wsd", "onecycle", "inverse_sqrt"] = "cosine"
    warmup_steps: Optional[int] = bounded(None, ge=0)  # null: 10% of train.max_steps, at most 100
    min_lr_ratio: float = bounded(0.1, ge=0, le=1)  # final LR / peak LR (cosine, linear, wsd)
    decay_fraction: float = bounded(0.2, gt=0, le=1)  # wsd: the last fraction of steps that decays
    onecycle_div: float = bounded(25.0, ge=1)  # onecycle: the LR starts at peak / onecycle_div
    muon_lr: float = bounded(0.02, gt=0)    # muon: Muon's peak LR on the hidden matrices (optim.lr: AdamW's)
    muon_momentum: float = bounded(0.95, ge=0, lt=1)  # muon
    adafactor_beta2_decay: float = bounded(-0.8, lt=0)  # adafactor: beta2 at step t is 1 - t^beta2_decay
    galore_rank: int = bounded(128, ge=1)   # galore: rank of the projected gradient states
    galore_update_every: int = bounded(200, ge=1)  # galore: steps between projections (an SVD of the gradient)
    galore_scale: float = bounded(0.25, gt=0)  # galore: the projected-back update is multiplied by this

    def resolved_warmup_steps(self, max_steps: int) -> int:
        """warmup_steps, or when it is null 10% of the run, at most 100 steps."""
        return self.warmup_steps if self.warmup_steps is not None else min(100, max_steps // 10)

    def validate(self, source, prefix="optim."):
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise fail(source, prefix + "betas", f"must be two numbers in [0, 1), got {list(self.betas)}")
        if self.name == "adamw8bit" and not _installed("torchao"):
            raise fail(source, prefix + "name", "=adamw8bit needs the torchao package: pip install -e '.[optim]'")


@dataclass
class RunConfig:
    family: str
    model: Any
    data: Any
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    adapter: AdapterConfig = field(default_factory=AdapterConfig)
    source: str = "<config>"

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
    cfg = RunConfig(family, model, dcfg, train, optim, adapter, source)
    check_across_sections(cfg)
    check = getattr(task, "validate_config", None)
    if check is not None:
        check(cfg)
    return cfg


def check_across_sections(cfg: RunConfig):
    """Keys that are each valid but make no sense together: one-line errors naming both."""
    t, o, src = cfg.train, cfg.optim, cfg.source
    warmup = o.resolved_warmup_steps(t.max_steps)
    if warmup >= t.max_steps:
        raise fail(src, "optim.warmup_steps", f"={warmup} must be < train.max_steps={t.max_steps} "
                                              f"(the whole run would be warmup)")
    if o.schedule == "wsd":
        decay = max(1, round(o.decay_fraction * t.max_steps))
        if warmup > t.max_steps - decay:
            raise fail(src, "optim.warmup_steps", f"={warmup} runs into the decay of optim.schedule=wsd, "
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
