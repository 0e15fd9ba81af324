"""The run config: one YAML file fully describes a run.

    family: llm            # which model family / task
    model:  {...}          # the family's model config (zoo/config.py)
    data:   {...}          # the task's data config (train/tasks/<family>.py)
    train:  {...}          # TrainConfig below: the loop
    optim:  {...}          # OptimConfig below: optimizer and LR schedule
    adapter: {...}         # zoo.adapters.AdapterConfig: LoRA / DoRA / QLoRA / prefix / prompt / bottleneck
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
import re
from typing import Any, Literal, Optional, Union

import torch

from zoo.adapters import AdapterConfig
from zoo.config import (ConfigError, bounded, deep_merge, did_you_mean, fail, from_dict, load_yaml, model_config_from,
                        parse_overrides, to_dict)
from zoo.pruning import parse_pattern

from .optim import OPTIMIZERS


PARALLEL_ONLY = {"grad_compression": "a DDP communication hook; FSDP2 reduces in its reduce dtype",
                 "fsdp_reshard": "FSDP2's reshard_after_forward", "fsdp_offload": "FSDP2's CPUOffloadPolicy"}
QAT_SCHEMES = {"int8": "int8wo", "int4": "int4wo", "8da4w": "8da4w"}  # train.qat -> the scheme it converts to


@dataclass
class TrainConfig:
    # -- the run and its length
    out_dir: str = "runs/default"           # where metrics, checkpoints and the final weights go
    max_steps: int = bounded(1000, gt=0)    # optimizer steps
    device: str = "auto"                    # `auto` (cuda, then mps, then cpu), `cpu`, `cuda`, `cuda:N`, `mps`
    seed: int = 0                           # seeds init and data order
    deterministic: bool = False             # `torch.use_deterministic_algorithms`
    # -- batch
    batch_size: Union[int, Literal["auto"]] = bounded(16, gt=0)  # sequences per micro-batch; `auto`: the largest
                                            # divisor of `global_batch` (under torchrun: of `global_batch` / processes)
                                            # whose planned peak fits `memory_budget`
    global_batch: Optional[int] = bounded(None, gt=0)  # with `batch_size: auto`: items per optimizer step, all
                                            # processes together (required there)
    memory_budget: Optional[Union[int, str]] = None  # with `batch_size: auto`: the memory a training step may use
                                            # (`8GB`, `512MB` or bytes); null = the device's free memory; also what
                                            # a run is checked against before it starts (`ignore_plan`)
    ignore_plan: bool = False               # start even when the planner finds the weights, gradients and optimizer
                                            # states far over the memory (docs/memory.md); else a one-line refusal
    grad_accum: int = bounded(1, gt=0)      # micro-batches per optimizer step
    batch_warmup_steps: int = bounded(0, ge=0)  # batch-size warmup: the micro-batches per step grow linearly from 1
                                            # to `grad_accum` at this step; needs `grad_accum` > 1, < `max_steps`
    # -- the optimizer step
    clip_grad: Optional[float] = bounded(1.0, gt=0)  # max global gradient norm; null = no clipping (still logged)
    clip_weights: Optional[float] = bounded(None, gt=0)  # weight clipping: after every applied step each trainable
                                            # weight is clamped to [-c, c] (off by default)
    max_nonfinite: int = bounded(5, gt=0)   # non-finite losses in a row before the run stops (each skips its step)
    # -- precision and speed
    precision: Literal["fp32", "bf16", "fp16", "auto", "bf16-pure"] = "fp32"  # `fp32`, `bf16` (autocast), `fp16`
                                            # (autocast + GradScaler), `auto` (bf16 where the device runs it fast, else
                                            # fp32) or `bf16-pure` (bf16 weights, gradients and AdamW states; the update
                                            # stochastically rounded)
    loss_scale: float = bounded(65536.0, gt=0)  # fp16: the GradScaler's initial loss scale (halved at each step
                                            # whose gradients overflow, which is skipped)
    tf32: bool = True                       # TF32 matmuls on CUDA (logged as skipped elsewhere)
    cudnn_benchmark: bool = True            # cudnn autotuning on CUDA (logged as skipped elsewhere)
    compile: bool = False                   # `torch.compile` the model (the first steps include compilation)
    attn_backend: Literal["auto", "sdpa", "flash", "bmm", "math", "flex"] = "auto"  # LLM attention: `sdpa`,
                                            # `flash` (flash-attn), `bmm` (CPU), `math`, `flex` or `auto` (logged)
    float8: bool = False                    # float8 matmuls in the linears (torchao; emulated without a GPU of
                                            # compute capability 8.9+), weights and optimizer in high precision
    float8_recipe: Literal["tensorwise", "rowwise"] = "tensorwise"  # with `float8`: one scale per tensor, or per row
    float8_keep: list[str] = field(default_factory=lambda: ["lm_head"])  # with `float8`: the linears kept in high
                                            # precision (a qualified name, or a name's last part)
    float8_skip_small: bool = False         # with `float8`: also keep the linears too small to gain (torchao's rule)
    channels_last: bool = False             # channels-last memory format for 4-D models and batches (ConvNets)
    cpu_keep_memory: Optional[bool] = None  # CPU, Linux with glibc: keep freed memory for reuse instead of unmapping
                                            # it; null = on under `train/run.py`, off when your code calls `train()`
    # -- memory
    activation_checkpointing: Union[bool, Literal["none", "full", "selective"]] = False  # recompute the model's
                                            # repeated units in the backward: `false`/`none`, `true`/`full`, `selective`
    activation_checkpointing_every: int = bounded(1, ge=1)  # with `activation_checkpointing`: units 0, n, 2n, ...
                                            # are checkpointed, in the order they run (2: every other unit)
    chunked_loss: bool = True               # LLM: compute the loss chunk by chunk without the full logits (the
                                            # model's forward returns `(None, loss)`)
    loss_chunk_size: int = bounded(2048, gt=0)  # LLM: tokens per chunk of the chunked loss
    activation_offload: bool = False        # CUDA: the activations saved for the backward go to pinned host memory;
                                            # elsewhere skipped with one log line
    # -- checkpoints and resume
    checkpoint_every: int = bounded(500, ge=0)  # steps between checkpoints (0 = only at the end)
    keep_checkpoints: int = bounded(2, gt=0)  # how many recent checkpoints are kept
    resume: bool = True                     # continue from the newest complete checkpoint in `out_dir`
    # -- logging and tracking
    log_every: int = bounded(10, gt=0)      # steps between metrics lines
    log_noise_scale: bool = False           # log noise_scale: the gradient noise scale B_simple in sequences, from
                                            # the micro-batch's and the global batch's gradient norms (grad_accum > 1)
    progress: bool = True                   # live progress bar (loss, lr, tokens/s, MFU)
    plot: bool = True                       # write `loss.png` at the end
    peak_flops: Optional[float] = bounded(None, gt=0)  # the MFU denominator in FLOP/s; null = the vendor's dense
                                            # figure on known GPUs in bf16/fp16, else a matmul measured at start
                                            # in the run's dtype (`train.hardware.measure_peak_flops`)
    tracker: Literal["none", "tensorboard", "wandb", "mlflow"] = "none"  # also send every row of `metrics.jsonl`
                                            # to `tensorboard`, `wandb` or `mlflow` (files under `out_dir`; needs the
                                            # extra)
    tracker_project: Optional[str] = None   # the W&B project or MLflow experiment; null = `zoo` (W&B entity:
                                            # `$WANDB_ENTITY`, else your default)
    tracker_uri: Optional[str] = None       # MLflow's tracking URI; null = a SQLite file in `out_dir/mlruns/` (nothing
                                            # sent anywhere)
    tracker_mode: Optional[Literal["offline", "online"]] = None  # W&B: `offline` (nothing sent; `wandb sync` later)
                                            # or `online` (needs `wandb login`); null = `$WANDB_MODE`, else `offline`
    # -- evaluation and samples
    eval_every: int = bounded(200, ge=0)    # steps between evaluations (0 = only at the end)
    eval_batches: int = bounded(20, gt=0)   # validation batches per evaluation
    samples: bool = True                    # generate samples at the end (printed and written to `samples.txt`)
    # -- fine-tuning from weights
    init_from: Optional[str] = None         # the weights to fine-tune from (an LLM: a Hugging Face or Zoo folder, or a
                                            # GGUF file); their architecture replaces `model:` (how it runs still comes
                                            # from `train:`)
    export: bool = True                     # with `init_from`, at the end: write the model back in its pretrained
                                            # format (an LLM: `out_dir/hf`, else `out_dir/zoo`; an adapter run only with
                                            # `adapter.export_merged`)
    # -- optional: weight averaging
    ema_decay: Optional[float] = bounded(None, gt=0, lt=1)  # keep an exponential moving average of the weights;
                                            # evaluated beside them (`ema_*` metrics)
    average_last: int = bounded(0, ge=0)    # at the end, average the last K checkpoints' weights and evaluate them
                                            # (`avg_*`); at most `keep_checkpoints`; 0 = off
    average_weighting: Literal["uniform", "linear"] = "uniform"  # `uniform` (1/K each) or `linear` (weights 1..K,
                                            # oldest to newest, normalised)
    # -- LLM: init and routing (MoE, Mixture-of-Depths, sparse attention)
    init_std: float = bounded(0.02, gt=0)   # std of the normal init; the residual projections' / sqrt(2 n_layers)
    moe_aux_loss_coef: float = bounded(0.01, ge=0)  # weight of the load-balancing loss (`model.moe.balance: aux_loss`)
    moe_z_loss_coef: float = bounded(0.001, ge=0)  # weight of the ST-MoE router z-loss (whatever the balance); 0 = off
    moe_bias_update_rate: float = bounded(0.001, ge=0)  # `model.moe.balance: bias`: the bias step per optimizer step
    moe_capacity_factor: Optional[float] = bounded(None, gt=0)  # in training an expert takes at most ceil(factor *
                                            # tokens * top_k / n_experts) choices, the rest dropped; null = dropless
    moe_router_jitter: float = bounded(0.0, ge=0, lt=1)  # training: sparse layers' input times U(1 - j, 1 + j) noise
    moe_dispatch: Literal["auto", "grouped", "loop"] = "auto"  # experts by `grouped` (F.grouped_mm), `loop` (a matmul
                                            # each) or `auto` (grouped where the device and dtype allow)
    mod_aux_loss_coef: float = bounded(0.01, ge=0)  # weight of the MoD decision cross-entropy (`model.mod_router`'s)
    mod_threshold_rate: float = bounded(0.02, ge=0, le=1)  # how fast the MoD decision threshold follows the top-k
                                            # boundary in training (a moving average; 0 keeps it at logit 0)
    index_loss_coef: float = bounded(0.0, ge=0)  # weight of the lightning indexers' KL to the attention they select
                                            # for (`model.mla.index_heads`, DeepSeek-V3.2); 0 = off, the indexers kept
    index_warmup: bool = False              # with `index_loss_coef`: attend to every key and train only the indexers
                                            # (DeepSeek-V3.2's dense warm-up)
    # -- optional: gradual unfreezing
    unfreeze: Optional[list[int]] = None    # increasing steps: only the head trains before the first, the next group
                                            # from the top joins at each (not with an adapter)
    # -- optional: LR range test
    lr_find: bool = False                   # run the LR range test instead of training: `out_dir/lr_find.png`, `.json`
                                            # and the suggested LR; checkpoints neither read nor written
    lr_find_min: float = bounded(1e-6, gt=0)  # the range test's first LR
    lr_find_max: float = bounded(1.0, gt=0)  # the range test's last LR (the LRs between exponentially spaced)
    lr_find_steps: int = bounded(100, ge=2)  # range test steps (it stops once the smoothed loss exceeds 4x its best)
    # -- optional: knowledge distillation
    teacher: Optional[str] = None           # distil from a model `zoo.from_pretrained` loads, with the student's
                                            # vocabulary or classes; evaluation stays the student's cross-entropy
    kd_alpha: float = bounded(0.5, ge=0, le=1)  # with `teacher`: the weight of the distillation term
    kd_temperature: float = bounded(2.0, gt=0)  # with `teacher`: the softmax temperature T of both models
    kd_kind: Literal["soft", "hard"] = "soft"  # with `teacher`: `soft` (KL at kd_temperature) or `hard`
                                            # (cross-entropy on the teacher's top class, DeiT's); a distilled ViT
                                            # learns it on its distillation head, the labels on its class head
    # -- optional: quantization
    qat: Optional[Literal["int8", "int4", "8da4w"]] = None  # quantization-aware training (LLM): fake-quantized
                                            # linears, converted at the end to the matching `quantize` scheme
    quantize: Optional[Literal["int8wo", "int4wo", "8da4w"]] = None  # post-training quantization (LLM): at the
                                            # end a bf16 copy is quantized, evaluated, written to `out_dir/quantized/`
    quant_group_size: int = bounded(32, gt=0)  # with `qat` / `quantize`: weights per int4 group (int4 schemes;
                                            # on a CPU int4wo packs 32, 64 or 128)
    quant_keep: list[str] = field(default_factory=lambda: ["embed", "lm_head"])  # with `qat` / `quantize`: the
                                            # modules kept in 16-bit (a qualified name, or a name's last part)
    # -- optional: pruning
    prune: Optional[str] = None             # magnitude pruning of the linears outside `prune_keep`, once:
                                            # `unstructured` or `N:M` (e.g. `2:4`); the run is the recovery fine-tune
    prune_sparsity: float = bounded(0.5, gt=0, lt=1)  # with `prune: unstructured`: the share of each linear pruned
    prune_keep: list[str] = field(default_factory=lambda: ["embed", "lm_head"])  # with `prune`: the modules that
                                            # stay dense (as `quant_keep` names them)
    # -- several processes (torchrun)
    parallel: Literal["none", "ddp", "fsdp", "tp", "fsdp+tp", "pp"] = "none"  # under `torchrun`: `ddp`, `fsdp`
                                            # (FSDP2), `tp` (tensor), `fsdp+tp` (both, 2-D), `pp` (pipeline);
                                            # `batch_size` is per data-parallel rank; ignored by a plain
                                            # `python train/run.py`
    tp_size: int = bounded(2, gt=0)         # with `parallel: fsdp+tp`: processes per tensor-parallel group (`tp`: all)
    pp_microbatches: int = bounded(2, gt=0)  # with `parallel: pp`: each micro-batch's pieces in the 1F1B schedule
    sync_bn: bool = False                   # with `parallel`: BatchNorm normalises with the global batch's statistics
    grad_compression: Literal["none", "fp16", "bf16", "powersgd"] = "none"  # with `parallel: ddp`: what DDP
                                            # all-reduces (torch's communication hooks): the gradients cast to fp16 or
                                            # bf16, or PowerSGD's low-rank factors of each matrix (with error feedback)
    powersgd_rank: int = bounded(1, gt=0)   # with `grad_compression: powersgd`: the rank of each matrix's factors
    powersgd_start: int = bounded(100, ge=2)  # with `grad_compression: powersgd`: the optimizer steps all-reduced
                                            # in full before compression starts (about a tenth of the run, past warmup)
    fsdp_reshard: bool = True               # with `parallel: fsdp`: free a unit's gathered parameters after its forward
                                            # (ZeRO-3); false keeps them until its backward (ZeRO-2: more memory, one
                                            # all-gather per micro-batch instead of two)
    fsdp_offload: bool = False              # with `parallel: fsdp` on CUDA: the sharded parameters, gradients and
                                            # optimizer states live in host memory (CPUOffloadPolicy); skipped on a CPU

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
        for key in ("tracker_project", "tracker_uri"):
            if getattr(self, key) is not None and not getattr(self, key).strip():
                raise fail(source, prefix + key, "must be a name or null, got ''")
        if self.unfreeze is not None and (not self.unfreeze or any(s <= 0 for s in self.unfreeze)
                                          or sorted(set(self.unfreeze)) != list(self.unfreeze)):
            raise fail(source, prefix + "unfreeze", f"must be increasing steps > 0 or null, got {self.unfreeze}")
        if self.kd_kind != "soft" and self.teacher is None:
            raise fail(source, prefix + "kd_kind", f"={self.kd_kind} distils from a teacher: needs train.teacher")
        if self.index_warmup and not self.index_loss_coef:
            raise fail(source, prefix + "index_warmup", "trains only the indexers, by their loss: needs "
                                                        "train.index_loss_coef > 0")
        if self.qat and self.quantize and QAT_SCHEMES[self.qat] != self.quantize:
            raise fail(source, prefix + "quantize", f"={self.quantize} is not what train.qat={self.qat} trains for "
                                                    f"({QAT_SCHEMES[self.qat]}; or null)")
        if self.prune is not None:
            try:
                parse_pattern(self.prune)
            except ValueError as e:
                raise fail(source, prefix + "prune", str(e)) from None
        for key, needs in (("grad_compression", "ddp"), ("fsdp_reshard", "fsdp"), ("fsdp_offload", "fsdp")):
            value = getattr(self, key)
            if value != getattr(TrainConfig, key) and self.parallel != needs:
                raise fail(source, prefix + key, f"={str(value).lower()} needs train.parallel={needs}, got "
                                                 f"{self.parallel} ({PARALLEL_ONLY[key]})")
        if missing := missing_package(self.tracker, prefix + "tracker"):
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
    except (ImportError, ValueError):  # blocked, or a half-imported module
        return False


def missing_package(tracker: str, key: str = "train.tracker"):
    """The one-line error for a tracker whose package (and extra, of the same name) is not installed, else None."""
    return None if tracker == "none" or _installed(tracker) else \
        f"{key}={tracker} needs the {tracker} package: pip install -e '.[{tracker}]'"


@dataclass
class OptimConfig:
    name: str = "adamw"                     # `adamw`, `sgd`, `adagrad`, `rmsprop`, `adafactor`, `lion`, `muon`,
                                            # `adamw8bit`, `adamw_offload` or `galore` (train/optim's registry;
                                            # "Optimizers" below)
    lr: float = bounded(3e-4, gt=0)         # peak learning rate
    weight_decay: float = bounded(0.1, ge=0)  # weight decay on matrices only (not norms, biases, embeddings):
                                            # decoupled, except sgd, adagrad and rmsprop (torch's L2 on the gradient)
    betas: tuple[float, float] = (0.9, 0.95)  # AdamW's betas (also adamw8bit, adamw_offload, galore, muon's AdamW
                                            # part); Lion's beta1, beta2 (the paper uses [0.9, 0.99])
    eps: float = bounded(1e-8, gt=0)        # the denominator's epsilon (adamw, adamw8bit, adamw_offload, galore, muon's
                                            # AdamW part, adagrad, rmsprop)
    momentum: float = bounded(0.9, ge=0, lt=1)  # sgd
    nesterov: bool = True                   # sgd
    fused: Optional[bool] = None            # force fused AdamW on/off; null = fused where supported
    schedule: Literal["cosine", "constant", "linear", "wsd", "onecycle", "inverse_sqrt", "exponential",
                      "step"] = "cosine"    # LR after the warmup: `cosine`, `constant`, `linear`, `wsd`, `onecycle`,
                                            # `inverse_sqrt`, `exponential`, `step`
    warmup_steps: Optional[int] = bounded(None, ge=0)  # linear warmup steps; when given it wins over
                                            # `warmup_fraction`; < `train.max_steps`, ending before a WSD decay
    warmup_fraction: Optional[float] = bounded(None, ge=0, lt=1)  # warmup as a fraction of `train.max_steps`
                                            # (rounded down); both null: 10% of the run, at most 100 steps
    min_lr_ratio: float = bounded(0.1, ge=0, le=1)  # final LR as a fraction of the peak (cosine, linear, wsd, onecycle)
    decay_fraction: float = bounded(0.2, gt=0, le=1)  # wsd: the final fraction of steps that decays
    onecycle_div: float = bounded(25.0, ge=1)  # onecycle: the first LR is the peak / this (>= 1)
    exponential_gamma: float = bounded(0.999, gt=0, le=1)  # exponential: the LR's factor per step after the warmup
    step_every: int = bounded(100, ge=1)    # step: steps between two drops of the LR (counted from the warmup's end)
    step_gamma: float = bounded(0.1, gt=0, le=1)  # step: the LR's factor at each drop
    rmsprop_alpha: float = bounded(0.99, ge=0, lt=1)  # rmsprop: decay of the squared-gradient average
    rmsprop_momentum: float = bounded(0.0, ge=0, lt=1)  # rmsprop: momentum on the scaled update
    rmsprop_centered: bool = False          # rmsprop: divide by the gradient's variance, not its second moment
    muon_lr: float = bounded(0.02, gt=0)    # muon: Muon's peak LR on the hidden matrices (the schedule scales it as
                                            # it scales `lr`, which the AdamW part uses)
    head_lr: Optional[float] = bounded(None, gt=0)  # the untied LM head's peak LR (the schedule scales it as it
                                            # scales `lr`); null = `lr`
    layer_decay: Optional[float] = bounded(None, gt=0, le=1)  # layer-wise LR decay (fine-tuning): block i of L
                                            # trains at `lr` x layer_decay^(L+1-i), the embeddings at
                                            # x layer_decay^(L+1), the head at `lr`; null: off (not with muon)
    muon_momentum: float = bounded(0.95, ge=0, lt=1)  # muon: Muon's momentum (Nesterov)
    adafactor_beta2_decay: float = bounded(-0.8, lt=0)  # adafactor: the second-moment decay 1 - t^beta2_decay (< 0)
    galore_rank: int = bounded(128, ge=1)   # galore: rank of the projected gradient states
    galore_update_every: int = bounded(200, ge=1)  # galore: steps between two projections (an SVD of the gradient)
    galore_scale: float = bounded(0.25, gt=0)  # galore: factor on the projected-back update
    lr_batch_scaling: Literal["none", "sqrt", "linear"] = "none"  # `lr` and `muon_lr` times (global batch /
                                            # `reference_batch`) to the power 1/2 (sqrt) or 1 (linear), once at build
    reference_batch: Optional[int] = bounded(None, ge=1)  # the global batch in sequences (micro-batch x grad_accum
                                            # x data-parallel ranks) the LRs were tuned at; needed by lr_batch_scaling

    def resolved_warmup_steps(self, max_steps: int) -> int:
        """warmup_steps when given (so `optim.warmup_steps=N` overrides a config's fraction); else
        floor(warmup_fraction x max_steps); else 10% of the run, at most 100 steps."""
        if self.warmup_steps is not None:
            return self.warmup_steps
        if self.warmup_fraction is not None:
            return int(self.warmup_fraction * max_steps + 1e-9)  # 0.29 x 100 is 28.999...: 29
        return min(100, max_steps // 10)

    def validate(self, source, prefix="optim."):
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise fail(source, prefix + "betas", f"must be two numbers in [0, 1), got {list(self.betas)}")
        if self.name not in OPTIMIZERS:
            raise fail(source, prefix + "name", f"must be one of {', '.join(OPTIMIZERS)}, got {self.name!r}")
        if self.layer_decay is not None and self.name == "muon":
            raise fail(source, prefix + "layer_decay", "does not apply to muon, which sets its matrices' LR itself")
        if self.lr_batch_scaling != "none" and self.reference_batch is None:
            raise fail(source, prefix + "reference_batch", f"is needed with lr_batch_scaling={self.lr_batch_scaling}")
        if (package := OPTIMIZERS[self.name].package) and not _installed(package):
            raise fail(source, prefix + "name", f"={self.name} needs the {package} package: pip install -e '.[optim]'")


@dataclass
class RunConfig:
    family: str
    model: Any
    data: Any
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    adapter: AdapterConfig = field(default_factory=AdapterConfig)
    source: str = "<config>"
    rl: Any = None                          # the `rl:` section of a `data.format: prompts` run (train/tasks/rl.py)

    def to_dict(self) -> dict:  # the sections in SECTIONS' order, rl: only where the run has one
        sections = {k: getattr(self, k) for k in SECTIONS[1:]}
        return {"family": self.family, **{k: to_dict(v) for k, v in sections.items() if v is not None}}


SECTIONS = ("family", "model", "data", "train", "optim", "adapter", "rl")

# family (zoo/config.py's FAMILIES) -> "module:Class" of the task that trains it (train/tasks/), named, not
# imported: the tasks sit above the config (docs/architecture.md)
TASKS = {"llm": "train.tasks.lm:LMTask", "convnet": "train.tasks.classify:ClassifyTask",
         "vit": "train.tasks.classify:ClassifyTask",
         "vlm": "train.tasks.vlm:VLMTask",
         "diffusion": "train.tasks.diffusion:DiffusionTask"}


def task_class(family: str, source: str = "<config>", data=None):
    """The task that trains `family` on `data`: the family's own, or the one `formats` names for data.format."""
    from zoo.config import family as family_entry, load_class
    family_entry(family, source)  # a one-line error for an unknown family
    cls = load_class(TASKS[family])
    fmt = data.get("format") if isinstance(data, dict) else getattr(data, "format", None)
    return load_class(cls.formats[fmt]) if isinstance(fmt, str) and fmt in cls.formats else cls


def run_config_from_dict(data: dict, source: str = "<config>", paths: bool = True) -> RunConfig:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the config must be a mapping")
    for k in data:
        if k not in SECTIONS:
            raise ConfigError(f"{source}: unknown key {str(k)!r}{did_you_mean(str(k), SECTIONS)} "
                              f"(known: {', '.join(SECTIONS)})")
    family = data.get("family", "llm")
    if not isinstance(family, str):
        raise ConfigError(f"{source}: family must be a string, got {family!r}")
    task = task_class(family, source, data.get("data"))
    model = model_config_from(data.get("model") or {}, family, source)
    dcfg, train, optim, adapter = (from_dict(cls, data.get(name) or {}, source, name + ".") for cls, name in
                                   ((task.DataConfig, "data"), (TrainConfig, "train"), (OptimConfig, "optim"),
                                    (AdapterConfig, "adapter")))
    rl_cls = getattr(task, "RLConfig", None)
    if data.get("rl") is not None and rl_cls is None:
        raise ConfigError(f"{source}: rl: is the section of reinforcement learning runs (data.format: prompts)")
    rl = from_dict(rl_cls, data.get("rl") or {}, source, "rl.") if rl_cls is not None else None
    cfg = RunConfig(family, model, dcfg, train, optim, adapter, source, rl)
    if (train.qat or train.quantize) and not task.quantizable:
        raise fail(source, "train.qat" if train.qat else "train.quantize",
                   f"quantizes LLMs; the {family} family has no quantized format (docs/deploy.md)")
    check_across_sections(cfg, paths)
    if (check := getattr(task, "validate_config", None)) is not None:
        check(cfg)
    return cfg


def check_across_sections(cfg: RunConfig, paths: bool = True):
    """Keys that are each valid but make no sense together: one-line errors naming both (the first that applies);
    paths: also the files the run reads its weights from (train.init_from, ...) must exist."""
    t, o, a, src = cfg.train, cfg.optim, cfg.adapter, cfg.source
    quant = "train.qat" if t.qat else "train.quantize"
    warmup, decay = o.resolved_warmup_steps(t.max_steps), max(1, round(o.decay_fraction * t.max_steps))
    wkey = "optim.warmup_steps" if o.warmup_steps is not None or o.warmup_fraction is None else "optim.warmup_fraction"
    what = f"={warmup}" if wkey == "optim.warmup_steps" else f"={o.warmup_fraction} ({warmup} steps)"
    rules = [  # (refused, key, why)
        ((t.qat or t.quantize) and a.enabled, quant,
         f"does not combine with adapter.method={a.method} (quantize the merged model afterwards)"),
        (t.float8 and (t.qat or t.quantize), "train.float8", f"does not combine with {quant} (both replace the "
         f"linears; quantize the float8-trained model afterwards)"),
        (t.prune and a.enabled, "train.prune", f"does not combine with adapter.method={a.method} (an adapter's "
         f"update would fill the pruned weights in; prune the merged model)"),
        (getattr(cfg.model, "mup_base_width", None) and o.name == "sgd", "model.mup_base_width",
         "scales the hidden matrices' LR by Adam's rule (x base / width); optim.name=sgd needs another, not implemented"),
        (warmup >= t.max_steps, "optim.warmup_steps", f"={warmup} must be < train.max_steps={t.max_steps} "
         f"(the whole run would be warmup; optim.warmup_fraction scales with the run)"),
        (o.schedule == "wsd" and warmup > t.max_steps - decay, wkey, f"{what} runs into the decay of "
         f"optim.schedule=wsd, which starts at step {t.max_steps - decay} (optim.decay_fraction={o.decay_fraction} "
         f"of train.max_steps={t.max_steps})"),
        (t.precision == "bf16-pure" and (o.name != "adamw" or not _installed("torchao")), "train.precision",
         f"=bf16-pure steps with torchao's AdamW (stochastic rounding): needs optim.name=adamw (got {o.name}) and "
         f"the torchao package"),
        (o.name == "muon" and not hasattr(torch.optim, "Muon"), "optim.name",
         f"=muon needs torch.optim.Muon (torch >= 2.9; this is torch {torch.__version__})"),
        (t.index_warmup and (a.enabled or t.unfreeze is not None), "train.index_warmup",
         "trains only the indexers: does not combine with an adapter or train.unfreeze"),
        (a.enabled and t.unfreeze is not None, "train.unfreeze",
         f"with adapter.method={a.method}: the base stays frozen, nothing to unfreeze"),
        (a.quantize_base != "none" and t.ema_decay is not None, "train.ema_decay",
         f"with adapter.quantize_base={a.quantize_base}: an EMA of a quantised model is not supported"),
        (a.export_merged and a.enabled and not a.mergeable, "adapter.export_merged",
         f"adapter.method={a.method} has no merged form (its vectors and layers are not weights of the base)"),
        (t.average_last > t.keep_checkpoints, "train.average_last",
         f"={t.average_last} needs as many checkpoints kept (train.keep_checkpoints={t.keep_checkpoints})"),
        (t.batch_warmup_steps and t.batch_warmup_steps >= t.max_steps, "train.batch_warmup_steps",
         f"={t.batch_warmup_steps} must be < train.max_steps={t.max_steps}"),
        (t.batch_warmup_steps and t.grad_accum == 1, "train.batch_warmup_steps",
         "ramps the micro-batches up to train.grad_accum, which is 1"),
        (t.log_noise_scale and t.grad_accum == 1 and t.batch_size != "auto", "train.log_noise_scale",
         "compares a micro-batch's gradient with the step's: needs train.grad_accum > 1"),
        (t.batch_size == "auto" and t.lr_find, "train.batch_size",
         "=auto does not combine with train.lr_find (give the batch size to test)"),
        (t.batch_size == "auto" and t.batch_warmup_steps, "train.batch_warmup_steps",
         "does not combine with train.batch_size=auto"),
    ]
    rules += [(path is not None and not Path(path).expanduser().exists(), key, f"={path}: no such file or folder")
              for key, path in (("train.init_from", t.init_from), ("train.teacher", t.teacher),
                                ("adapter.init_from", a.init_from)) if paths]
    if broken := next((r for r in rules if r[0]), None):
        raise fail(src, broken[1], broken[2])


def load_run_config(path: Optional[str], overrides=(), base: Optional[dict] = None, paths: bool = True) -> RunConfig:
    """Read a YAML run config (or start from `base`), apply key=value overrides, validate (paths=False: the
    weights' files, train.init_from and the like, need not exist yet; the memory planner reads the config alone)."""
    data = load_yaml(path) if path else dict(base or {})
    source = str(path) if path else "<config>"
    if overrides:
        over = parse_overrides(list(overrides))
        data = deep_merge(for_format(data, (over.get("data") or {}).get("format")), over)
        source = f"{source} (with overrides)" if path else "command line"
    return run_config_from_dict(data, source, paths)


def for_format(data: dict, fmt) -> dict:
    """The file's config with its data: keys that the data.format given on the command line does not
    know left out (they belong to the file's own format: data.max_chars of text, say)."""
    section = data.get("data")
    if not isinstance(fmt, str) or not isinstance(section, dict) or section.get("format") == fmt:
        return data
    try:
        known = {f.name for f in fields(task_class(data.get("family", "llm"), data=dict(section, format=fmt)).DataConfig)}
    except ConfigError:
        return data  # an unknown family: its one-line error comes later
    return {**data, "data": {k: v for k, v in section.items() if k in known}}
