"""Tasks: how a model family plugs into the one loop.

A task turns a run config into a model and batches, a batch into a loss, and a model into eval metrics
and samples. train/config.py's TASKS names each family's; `Task.formats` its other tasks by `data.format`."""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn

class Task:
    """Base class of a family's task: subclasses set DataConfig and `unit` ('tokens', 'images', ...)."""

    DataConfig: type = None
    unit: str = "items"
    formats: dict[str, str] = {}  # data.format -> "module:Class" of the task that trains that format instead
    quantizable: bool = False  # train.qat / train.quantize apply (the quantized model has a format to be written in)
    teacher: Optional[nn.Module] = None  # train.teacher, loaded by the run builder (train/features/distill.py)
    # data parallelism: this rank's own_rows() of a global batch drawn from batch_generator(step, micro)
    rank: int = 0
    world: int = 1
    sum_across_ranks: Callable[[torch.Tensor], torch.Tensor] = staticmethod(lambda x: x)

    def __init__(self, cfg, device: torch.device, log: Callable[[str], None] = print):
        self.cfg, self.device, self.log = cfg, device, log
        self.autocast_dtype: Optional[torch.dtype] = None  # set by the loop from train.precision

    def autocast(self):
        """The run's mixed-precision context (for evaluation and sampling inside a task)."""
        return contextlib.nullcontext() if self.autocast_dtype is None else \
            torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def batch_generator(self, step: int, micro: int) -> torch.Generator:
        """A CPU generator seeded by (train.seed, step, micro) only, so a resumed run sees the same data."""
        seed = hash((self.cfg.train.seed, step, micro)) & 0x7FFF_FFFF_FFFF_FFFF  # ints hash the same in every process
        return torch.Generator().manual_seed(seed)

    def global_rows(self) -> int:
        """Items in one global micro-batch: train.batch_size on each of the `world` ranks."""
        return self.cfg.train.batch_size * self.world

    def own_rows(self, rows):
        """This rank's part of a global micro-batch's rows (a tensor or a list)."""
        B = self.cfg.train.batch_size
        return rows[self.rank * B:(self.rank + 1) * B]

    def load_pretrained(self, load: Callable[[str], Any], say: bool = True):
        """`load(train.init_from)`: whatever goes wrong reading it is a one-line ConfigError naming the file."""
        from zoo.config import ConfigError
        path = self.cfg.train.init_from
        try:
            out = load(path)
        except ConfigError:
            raise
        except (ValueError, FileNotFoundError, OSError, TypeError) as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            where = "" if str(Path(path)) in first or str(path) in first else f"{path}: "
            raise ConfigError(f"{self.cfg.source}: train.init_from: {where}{first}") from None
        if say:
            self.log(f"model: loaded {path}")
        return out

    def setup(self) -> None:
        """Read and prepare the data (called once, before build_model)."""

    def save_files(self, out_dir) -> None:
        """Files the run folder needs beside model.safetensors to be used alone (e.g. the tokenizer)."""

    def build_model(self) -> nn.Module:
        """A fresh (or pretrained, if cfg.train.init_from is set) model on the CPU, fp32."""
        raise NotImplementedError

    def unfreeze_groups(self, model: nn.Module) -> list[list[nn.Parameter]]:
        """Parameter groups for gradual unfreezing (train.unfreeze), head first, then the blocks from the top
        down; default: the top-level modules in reverse, a ModuleList or Sequential split into its blocks."""
        groups = []
        for child in reversed(list(model.children())):
            parts = reversed(list(child)) if isinstance(child, (nn.ModuleList, nn.Sequential)) else [child]
            groups += [list(m.parameters()) for m in parts]
        return [g for g in groups if g]

    def check_teacher(self, teacher: nn.Module, model: nn.Module) -> Optional[str]:
        """Why `teacher` cannot teach `model` (train.teacher), or None when it can."""
        return f"the {self.cfg.family} task has no distillation loss"

    def train_batch(self, step: int, micro: int) -> Any:
        """Micro-batch `micro` of step `step` on self.device: a function of (seed, step, micro) only."""
        raise NotImplementedError

    def loss(self, model: nn.Module, batch) -> tuple[torch.Tensor, int]:
        """(mean loss over the batch, number of items it covers)."""
        raise NotImplementedError

    def step_hook(self, model: nn.Module) -> Optional[Callable[[], None]]:
        """What must run on the (unwrapped) model after every optimizer step, e.g. MoE bias balancing with
        its cross-rank reduction inside; None: nothing. The run builder registers it as a step hook."""

    def example_batch(self, model: nn.Module, batch_size: int) -> Any:
        """A batch of `batch_size` items shaped as train_batch's, made without the data (zeros, or fake under a
        FakeTensorMode), on which `loss` works without setup(): the planner and the batch-size finder run on it."""
        raise NotImplementedError

    def state_dict(self) -> dict:
        """What the task must carry across a resume beyond (seed, step): checkpointed with the loop's state."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Take back what state_dict() returned (an empty dict: nothing was saved)."""

    def train_metrics(self) -> dict[str, float]:
        """The task's training numbers since the last call (e.g. auxiliary losses), added to every logged row."""
        return {}

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> dict[str, float]:
        """Validation metrics, e.g. {'val_loss': ...}."""
        return {}

    def flops_per_item(self, model: nn.Module) -> Optional[float]:
        """Training FLOPs per item, for MFU; None if unknown."""

    def samples(self, model: nn.Module, out_dir) -> Optional[str]:
        """Produce samples at the end of a run (text to print, files in out_dir)."""

    def export(self, model: nn.Module, out_dir) -> Optional[str]:
        """Write the final model in an external format if the run asks for it; returns a path."""
