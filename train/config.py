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
from zoo.pruning import parse_pattern

from .optim import OPTIMIZERS


QAT_SCHEMES = {"int8": "int8wo", "int4": "int4wo", "8da4w": "8da4w"}  # train.qat -> the scheme it converts to


@dataclass
class TrainConfig:
    out_dir: str = "runs/default"           # where metrics, checkpoints and the final `model.safetensors` go
    max_steps: int = bounded(1000, gt=0)    # optimizer steps
    batch_size: Union[int, Literal["auto"]] = bounded(16, gt=0)  # sequences per micro-batch; `auto`: the largest
                                            # divisor of `global_batch` whose planned peak fits `memory_budget`
                                            # (docs/memory.md), `grad_accum` set to keep `global_batch`, the choice
                                            # logged (and kept by a resumed run)
    global_batch: Optional[int] = bounded(None, gt=0)  # with `batch_size: auto`: items per optimizer step (required
                                            # there)
    memory_budget: Optional[Union[int, str]] = None  # with `batch_size: auto`: the memory a training step may use
                                            # (`8GB`, `512MB` or bytes); null = the device's (CPU: MemAvailable; CUDA:
                                            # free memory). It covers the step (weights, gradients, optimizer states,
                                            # activations), not the few hundred MB the Python process and torch take
                                            # by themselves
    activation_offload: bool = False        # CUDA: the activations saved for the backward go to pinned host memory
                                            # (`torch.autograd.graph.save_on_cpu`); elsewhere skipped with one log
                                            # line
    grad_accum: int = bounded(1, gt=0)      # micro-batches per optimizer step
    device: str = "auto"                    # `auto` (cuda, then mps, then cpu), `cpu`, `cuda`, `cuda:N`, `mps`
    precision: Literal["fp32", "bf16", "fp16", "auto"] = "fp32"  # `fp32`, `bf16` (autocast), `fp16` (autocast +
                                            # GradScaler; a step whose gradients overflow is skipped by the scaler,
                                            # counted in `overflow_steps` and logged with `loss_scale`, not a failure)
                                            # or `auto`: bf16 on a GPU that supports it; on a CPU bf16 only when a
                                            # measured bf16 matmul is at least 1.5x the fp32 one (CPUs without native
                                            # bf16 instructions emulate it 10-1000x slower), else fp32; the log names
                                            # the choice and both speeds. A resumed `auto` run keeps the precision it
                                            # started with. An explicit `bf16` on a CPU that emulates it runs, with a
                                            # warning. The presets use `auto`
    tf32: bool = True                       # TF32 matmuls on CUDA (logged as skipped elsewhere)
    cudnn_benchmark: bool = True            # cudnn autotuning on CUDA (logged as skipped elsewhere)
    cpu_keep_memory: Optional[bool] = None  # CPU on Linux with glibc: freed memory is kept and reused instead of
                                            # being unmapped (glibc maps each block over 32 MiB afresh, so a step's
                                            # large tensors page-fault in again every step). Measured on a 2-core
                                            # AVX-512-bf16 host in bf16: `tiny.yaml` at 16 x 256 tokens 13.2k to
                                            # 14.2-15.3k tokens/s, the 42.1M 8-layer MHA `llm-train` shape (8 x 256
                                            # tokens) +12% (bf16, compiled). It changes malloc for the whole process,
                                            # so null means: on when `train/run.py` runs the loop (the process is the
                                            # run's), off when your own code calls `train.loop.train()`. `true` turns
                                            # it on there too, and glibc's defaults are restored (the kept memory
                                            # released) when `train()` returns. Logged as skipped elsewhere
    compile: bool = False                   # `torch.compile` the model (the first steps include compilation)
    attn_backend: Literal["auto", "sdpa", "flash", "bmm", "math", "flex"] = "auto"  # LLM attention, set on the built
                                            # model (zoo/blocks/attention.py): `auto`, `sdpa`, `flash`, `bmm` or
                                            # `math`, each name one implementation: `sdpa` is torch's
                                            # `scaled_dot_product_attention`; `flash` is flash-attn (CUDA, fp16/bf16;
                                            # an error elsewhere or when it is not installed); `bmm` is batched
                                            # matmuls around an fp32 softmax, the queries in blocks that skip the keys
                                            # they cannot see, with a hand-written backward (zoo/blocks/attention_cpu.py; faster than torch's CPU
                                            # flash kernel up to ~1024 keys, see docs/llm.md, Training speed); `math` the plain
                                            # fp32 reference. `auto` picks `flash` on CUDA in fp16/bf16 when
                                            # flash-attn is installed, `bmm` on a CPU with at most 512 keys (1024
                                            # under `train.compile`), `sdpa` otherwise; the run's log names what it
                                            # picked. `flex` is torch's FlexAttention with a block mask (fused under
                                            # `train.compile`; no backward on a CPU). With `data.attention: document`
                                            # `auto` picks flash-attn's varlen kernel where `flash` runs, `flex` on
                                            # CUDA under `train.compile`, else the document mask through `sdpa`
                                            # (docs/llm.md, Document masking)
    activation_checkpointing: Union[bool, Literal["none", "full", "selective"]] = False  # recompute the model's
                                            # repeated units (LLM blocks, ResNet residual blocks, U-Net residual and
                                            # attention blocks) in the backward pass instead of storing their
                                            # activations: `false`/`none`, `true`/`full` (a unit keeps only its
                                            # input), `selective` (keeps its matmul, convolution and attention
                                            # outputs, recomputes norms and element-wise ops); BatchNorm's running
                                            # statistics are updated once; applied to the built model
                                            # (train/builder.py); see docs/memory.md
    activation_checkpointing_every: int = bounded(1, ge=1)  # with `activation_checkpointing`: units 0, n, 2n, ...
                                            # are checkpointed, in the order they run (2: every other unit)
    chunked_loss: bool = True               # LLM: compute the loss chunk by chunk without the full logits (the
                                            # model's forward returns `(None, loss)`)
    loss_chunk_size: int = bounded(2048, gt=0)  # LLM: tokens per chunk of the chunked loss
    clip_grad: Optional[float] = bounded(1.0, gt=0)  # max global gradient norm; null = no clipping (the norm is still
                                            # logged)
    seed: int = 0                           # seeds init and data order
    deterministic: bool = False             # `torch.use_deterministic_algorithms`
    log_every: int = bounded(10, gt=0)      # steps between metrics lines
    eval_every: int = bounded(200, ge=0)    # steps between evaluations (0 = only at the end)
    eval_batches: int = bounded(20, gt=0)   # validation batches per evaluation
    checkpoint_every: int = bounded(500, ge=0)  # steps between checkpoints (0 = only at the end)
    keep_checkpoints: int = bounded(2, gt=0)  # how many recent checkpoints are kept
    resume: bool = True                     # continue from the newest complete checkpoint in `out_dir`
    channels_last: bool = False             # channels-last memory format for 4-D models and batches (ConvNets)
    ema_decay: Optional[float] = bounded(None, gt=0, lt=1)  # keep an exponential moving average of the weights;
                                            # evaluated beside them (`ema_*` metrics)
    max_nonfinite: int = bounded(5, gt=0)   # non-finite losses in a row before the run stops (each one skips its
                                            # step)
    peak_flops: Optional[float] = bounded(None, gt=0)  # the MFU denominator in FLOP/s; null = a matmul measured at
                                            # start in the run's dtype (`train.hardware.measure_peak_flops`, as in the
                                            # benchmarks)
    init_from: Optional[str] = None         # a pretrained folder to fine-tune from: a Hugging Face checkpoint, or a
                                            # Zoo folder (the output folder of an earlier LLM run: config.yaml,
                                            # model.safetensors, tokenizer; docs/pretrained.md); its architecture
                                            # replaces the `model:` section (how it runs still comes from this
                                            # section: `attn_backend`, `activation_checkpointing`, `chunked_loss`)
    export: bool = True                     # at the end, write the model back in its pretrained format (`out_dir/hf`)
    progress: bool = True                   # live progress bar (loss, lr, tokens/s, MFU)
    samples: bool = True                    # generate samples at the end (printed and written to `samples.txt`)
    plot: bool = True                       # write `loss.png` at the end
    tracker: Literal["none", "tensorboard", "wandb"] = "none"  # `tensorboard` or `wandb`: every row written to
                                            # `metrics.jsonl` (training, evaluation, non-finite) goes there too, the
                                            # same keys at the same steps, with the resolved run config as the
                                            # hyperparameters. `tensorboard`: event files in `out_dir/tensorboard/`,
                                            # one scalar per key (float32); a resumed run drops the events logged
                                            # after its checkpoint, as it drops those rows of `metrics.jsonl`, so no
                                            # curve is doubled. `wandb`: files in `out_dir/wandb/`, the run named
                                            # after `out_dir`, W&B's step = the training step; a resumed run continues
                                            # the same W&B run (its id is kept in `out_dir/wandb/run_id`; offline,
                                            # each start writes its own `offline-run-*` folder with that id). Needs
                                            # the extra (`pip install -e '.[tensorboard]'` or `'.[wandb]'`); without
                                            # it the config is refused with a one-line error
    tracker_project: Optional[str] = None   # the W&B project; null = `zoo` (the entity: `$WANDB_ENTITY`, else your
                                            # default)
    tracker_mode: Optional[Literal["offline", "online"]] = None  # W&B: `offline` (files only, nothing is sent over
                                            # the network, not even W&B's own telemetry; upload later with `wandb sync
                                            # out_dir/wandb/offline-run-*`) or `online` (needs `wandb login`); null =
                                            # `$WANDB_MODE` if set, else `offline`
    unfreeze: Optional[list[int]] = None    # gradual unfreezing (any family): a list of increasing steps; before the
                                            # first only the head trains (LLM: `lm_head` and the final norm; with tied
                                            # embeddings the embedding matrix too), at each listed step the next group
                                            # from the top becomes trainable (LLM: the blocks from the last, then the
                                            # embedding; other families: the model's top-level modules from the last,
                                            # a block list split into its blocks), and the optimizer gets its
                                            # parameters as new groups. Not with an `adapter:` method. See
                                            # docs/adapters.md
    batch_warmup_steps: int = bounded(0, ge=0)  # batch-size warmup: the micro-batches accumulated per step grow
                                            # linearly from 1 at step 0 to `grad_accum` at this step (`1 + (grad_accum
                                            # - 1) * step // batch_warmup_steps`), then stay at `grad_accum`. Needs
                                            # `grad_accum` > 1 and must be < `max_steps`
    clip_weights: Optional[float] = bounded(None, gt=0)  # weight clipping: after every applied step each trainable
                                            # weight is clamped to [-c, c] (off by default)
    average_last: int = bounded(0, ge=0)    # checkpoint averaging: at the end, the weights of the last K checkpoints
                                            # (the final one included) are averaged into
                                            # `out_dir/model_avg.safetensors` and evaluated beside the final weights
                                            # (`avg_val_loss`, ... in the final row). Must be <= `keep_checkpoints`;
                                            # averages fewer (and says so) when the run wrote fewer. Any family
    average_weighting: Literal["uniform", "linear"] = "uniform"  # `uniform` (1/K each) or `linear` (weights 1..K,
                                            # oldest to newest, normalised)
    lr_find: bool = False                   # run the LR range test instead of training (see "Optimizers" below):
                                            # `out_dir/lr_find.png`, `out_dir/lr_find.json`, the suggested LR printed;
                                            # the run's checkpoints are neither read nor written
    lr_find_min: float = bounded(1e-6, gt=0)  # the range test's LRs, exponentially spaced
    lr_find_max: float = bounded(1.0, gt=0)  # the range test's first and last LR (exponentially spaced)
    lr_find_steps: int = bounded(100, ge=2)  # the range test's steps (it stops early once the smoothed loss passes 4x
                                            # its best)
    parallel: Literal["none", "ddp", "fsdp"] = "none"  # under `torchrun`: `ddp` (DistributedDataParallel) or `fsdp`
                                            # (FSDP2, parameters, gradients and optimizer state sharded); `batch_size`
                                            # is per process, the global batch `batch_size x grad_accum x` processes.
                                            # Ignored by a plain `python train/run.py`. See docs/distributed.md
    teacher: Optional[str] = None           # knowledge distillation: a model `zoo.from_pretrained` loads (a Hugging
                                            # Face folder, a Zoo run folder, a .gguf file, ResNet weights) with the
                                            # student's vocabulary (LLM: data.tokenizer the teacher's) or classes
                                            # (ConvNet). It runs in eval mode without
                                            # gradients under the run's precision, beside the model and never
                                            # wrapped (DDP / FSDP), and the training loss becomes `kd_alpha` *
                                            # KL(teacher || student at `kd_temperature`) * T^2 + (1 - `kd_alpha`) *
                                            # cross-entropy; for LLMs chunk by chunk with `chunked_loss`, so neither
                                            # model's full logits exist. Evaluation stays the student's
                                            # cross-entropy. See docs/deploy.md
    kd_alpha: float = bounded(0.5, ge=0, le=1)  # with `teacher`: the weight of the distillation term
    kd_temperature: float = bounded(2.0, gt=0)  # with `teacher`: the softmax temperature T of both models
    qat: Optional[Literal["int8", "int4", "8da4w"]] = None  # quantization-aware training (LLM): the linears
                                            # `quantize` would quantize are fake-quantized in every forward
                                            # (torchao's QAT: `int8` per-row int8 weights, `int4` int4 weights in
                                            # groups of `quant_group_size`, `8da4w` int8 per-token activations and
                                            # int4 weights); at the end they are converted to the matching `quantize`
                                            # scheme (int8wo, int4wo, 8da4w), evaluated (`quant_val_loss`, ...) and
                                            # written to `out_dir/quantized/`. model.safetensors keeps the trained
                                            # float weights. See docs/deploy.md
    quantize: Optional[Literal["int8wo", "int4wo", "8da4w"]] = None  # post-training quantization (LLM): at the
                                            # end a bf16 copy of the final model is quantized through torchao
                                            # (zoo.quantize), evaluated beside the float model (`quant_val_loss`,
                                            # ... in the final row; `quant_ref_val_loss`, ...: the bf16 copy before
                                            # quantization) and written to `out_dir/quantized/` (a quantized
                                            # Zoo folder, zoo.from_pretrained loads it). With `qat` it must be
                                            # that scheme's (null: it is)
    quant_group_size: int = bounded(32, gt=0)  # with `qat` / `quantize`: weights per int4 group (int4 schemes;
                                            # on a CPU int4wo packs 32, 64 or 128)
    quant_keep: list[str] = field(default_factory=lambda: ["embed", "lm_head"])  # with `qat` / `quantize`: the
                                            # modules that stay in 16-bit (a qualified name, or a name's last
                                            # part); the embedding and the LM head by default
    prune: Optional[str] = None             # magnitude pruning (zoo/pruning.py) of the linears outside `prune_keep`,
                                            # once, on the built model (after `init_from`'s weights): `unstructured`
                                            # (each linear's `prune_sparsity` share of smallest weights) or `N:M` such
                                            # as `2:4` (the N largest of every M consecutive inputs of a row stay). The
                                            # run is the recovery fine-tune: the pruned weights are set to zero again
                                            # after every optimizer step, and evaluations log `sparsity` (the zeros'
                                            # share of those linears' weights). See docs/deploy.md
    prune_sparsity: float = bounded(0.5, gt=0, lt=1)  # with `prune: unstructured`: the share of each linear pruned
    prune_keep: list[str] = field(default_factory=lambda: ["embed", "lm_head"])  # with `prune`: the modules that
                                            # stay dense (as `quant_keep` names them)
    sync_bn: bool = False                   # with `parallel`: BatchNorm layers normalise with the statistics of the
                                            # global batch (ResNets; torch's SyncBatchNorm on GPUs, its CPU
                                            # counterpart in train/distributed.py on CPUs)

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
        if self.qat and self.quantize and QAT_SCHEMES[self.qat] != self.quantize:
            raise fail(source, prefix + "quantize", f"={self.quantize} is not what train.qat={self.qat} trains for "
                                                    f"({QAT_SCHEMES[self.qat]}; or null)")
        if self.prune is not None:
            try:
                parse_pattern(self.prune)
            except ValueError as e:
                raise fail(source, prefix + "prune", str(e)) from None
        from .metrics import missing_package
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
    name: str = "adamw"                     # a name of the optimizer registry (train/optim OPTIMIZERS): `adamw`
                                            # (fused where the device supports it), `sgd`, `adafactor`, `lion`,
                                            # `muon`, `adamw8bit`, `adamw_offload` or `galore`: see "Optimizers" below
    lr: float = bounded(3e-4, gt=0)         # peak learning rate
    weight_decay: float = bounded(0.1, ge=0)  # decoupled weight decay, applied to matrices only (not norms, biases,
                                            # embeddings)
    betas: tuple[float, float] = (0.9, 0.95)  # AdamW's betas (also adamw8bit, adamw_offload, galore, muon's AdamW
                                            # part); Lion's beta1, beta2 (the paper uses [0.9, 0.99])
    eps: float = bounded(1e-8, gt=0)        # Adam epsilon (adamw, adamw8bit, adamw_offload, galore, muon's AdamW
                                            # part)
    momentum: float = bounded(0.9, ge=0, lt=1)  # sgd
    nesterov: bool = True                   # sgd
    fused: Optional[bool] = None            # force fused AdamW on/off; null = fused where supported
    schedule: Literal["cosine", "constant", "linear", "wsd", "onecycle", "inverse_sqrt"] = "cosine"  # `cosine` (warmup + cosine),
                                            # `constant` (warmup + constant), `linear`, `wsd` (warmup-stable-decay),
                                            # `onecycle` (from peak / `onecycle_div` up to the peak over the warmup
                                            # along a cosine, then a cosine down to `min_lr_ratio`; torch's
                                            # `OneCycleLR` with two phases), `inverse_sqrt` (linear warmup, then
                                            # `sqrt((warmup + 1) / (step + 1))` of the peak, no floor)
    warmup_steps: Optional[int] = bounded(None, ge=0)  # linear warmup steps, absolute; when given it wins over
                                            # `warmup_fraction` (so `optim.warmup_steps=N` on the command line overrides a
                                            # config's fraction). Must be < `train.max_steps` (and end before a WSD decay
                                            # starts): otherwise a one-line config error
    warmup_fraction: Optional[float] = bounded(None, ge=0, lt=1)  # warmup as a fraction of the run:
                                            # `floor(warmup_fraction x train.max_steps)` steps, used when `warmup_steps` is
                                            # null. The shipped configs use it, so `train.max_steps=N` composes with them
                                            # for any N. Both null: 10% of `train.max_steps`, at most 100
    min_lr_ratio: float = bounded(0.1, ge=0, le=1)  # final LR as a fraction of the peak (cosine, linear, wsd,
                                            # onecycle)
    decay_fraction: float = bounded(0.2, gt=0, le=1)  # wsd: the final fraction of steps that decays
    onecycle_div: float = bounded(25.0, ge=1)  # onecycle: the first LR is the peak / this (>= 1)
    muon_lr: float = bounded(0.02, gt=0)    # muon: Muon's peak LR on the hidden matrices (the schedule scales it as
                                            # it scales `lr`, which the AdamW part uses)
    muon_momentum: float = bounded(0.95, ge=0, lt=1)  # muon: Muon's momentum (Nesterov)
    adafactor_beta2_decay: float = bounded(-0.8, lt=0)  # adafactor: the second-moment decay 1 - t^beta2_decay (< 0)
    galore_rank: int = bounded(128, ge=1)   # galore: rank of the projected gradient states
    galore_update_every: int = bounded(200, ge=1)  # galore: steps between two projections (an SVD of the gradient)
    galore_scale: float = bounded(0.25, gt=0)  # galore: factor on the projected-back update

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
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise fail(source, prefix + "betas", f"must be two numbers in [0, 1), got {list(self.betas)}")
        if self.name not in OPTIMIZERS:
            raise fail(source, prefix + "name", f"must be one of {', '.join(OPTIMIZERS)}, got {self.name!r}")
        package = OPTIMIZERS[self.name].package
        if package and not _installed(package):
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
    task = task_class(family, source, data.get("data"))
    model = model_config_from(data.get("model") or {}, family, source)
    dcfg = from_dict(task.DataConfig, data.get("data") or {}, source, "data.")
    train = from_dict(TrainConfig, data.get("train") or {}, source, "train.")
    optim = from_dict(OptimConfig, data.get("optim") or {}, source, "optim.")
    adapter = from_dict(AdapterConfig, data.get("adapter") or {}, source, "adapter.")
    cfg = RunConfig(family, model, dcfg, train, optim, adapter, source)
    if (train.qat or train.quantize) and not task.quantizable:
        key = "train.qat" if train.qat else "train.quantize"
        raise fail(source, key, f"quantizes LLMs; the {family} family has no quantized format (docs/deploy.md)")
    check_across_sections(cfg)
    check = getattr(task, "validate_config", None)
    if check is not None:
        check(cfg)
    return cfg


def check_across_sections(cfg: RunConfig):
    """Keys that are each valid but make no sense together: one-line errors naming both."""
    t, o, src = cfg.train, cfg.optim, cfg.source
    if (t.qat or t.quantize) and cfg.adapter.enabled:
        raise fail(src, "train.qat" if t.qat else "train.quantize",
                   f"does not combine with adapter.method={cfg.adapter.method} (quantize the merged model afterwards)")
    if t.prune and cfg.adapter.enabled:
        raise fail(src, "train.prune", f"does not combine with adapter.method={cfg.adapter.method} (an adapter's "
                                       f"update would fill the pruned weights in; prune the merged model)")
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
        raise fail(src, "train.features.unfreeze", f"with adapter.method={a.method}: the base stays frozen, nothing to unfreeze")
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
        raise fail(src, "train.batch_size", "=auto does not combine with train.features.lr_find (give the batch size to test)")
    if t.batch_size == "auto" and t.batch_warmup_steps:
        raise fail(src, "train.batch_warmup_steps", "does not combine with train.batch_size=auto")
    if t.init_from is not None and not Path(t.init_from).expanduser().exists():
        raise fail(src, "train.init_from", f"={t.init_from}: no such file or folder")
    if t.teacher is not None and not Path(t.teacher).expanduser().exists():
        raise fail(src, "train.teacher", f"={t.teacher}: no such file or folder")


def load_run_config(path: Optional[str], overrides=(), base: Optional[dict] = None) -> RunConfig:
    """Read a YAML run config (or start from `base`), apply key=value overrides, validate."""
    data = load_yaml(path) if path else dict(base or {})
    source = str(path) if path else "<config>"
    if overrides:
        data = deep_merge(data, parse_overrides(list(overrides)))
        source = f"{source} (with overrides)" if path else "command line"
    return run_config_from_dict(data, source)
