"""Optimizers and learning-rate schedules.

`build_optimizer(model, cfg, device)` builds `optim.name` from OPTIMIZERS (torch's, torchao's and
Zoo's lion.py and galore.py). Weight decay goes to matrices only; "hidden" matrices are the 2-D
weights other than the embedding and the head. docs/llm.md ("Optimizers") has the table.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

from zoo.tensors import tensor_bytes

from .schedules import lr_multiplier, micro_batches, resume_note  # noqa: F401

def _embedding_ids(model: nn.Module) -> set:
    return {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}


def param_groups(model: nn.Module, weight_decay: float, layer_decay: Optional[float] = None) -> list[dict]:
    """Matrices with weight decay, the rest (and what the model's `no_weight_decay()` names) without; under muP (the
    model config's `mup_ratio`) the hidden matrices in a group of their own whose LR is the run's x base / width
    (`lr_scale`: Adam's rule; Muon sets its own) and weight decay x width / base, so that LR x decay stays the base
    width's as in Microsoft's `mup` (MuAdamW); with layer_decay, split by depth (`layer_groups`)."""
    named = getattr(model, "no_weight_decay", set)()
    exempt = _embedding_ids(model) | {id(p) for n, p in model.named_parameters() if n in named}
    decay, no_decay = [], []
    for p in (p for p in model.parameters() if p.requires_grad):  # a tied weight once
        (no_decay if p.dim() < 2 or id(p) in exempt else decay).append(p)  # biases, norm/BN scales, embeddings
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if ratio := getattr(getattr(model, "config", None), "mup_ratio", None):
        hidden, rest = split_hidden(groups, hidden_matrices(model))
        groups = [dict(g, lr_scale=ratio, weight_decay=g["weight_decay"] / ratio) for g in hidden] + rest
    if layer_decay is not None:
        groups = layer_groups(model, groups, layer_decay)
    # no empty group (e.g. a tied head alone trains under train.unfreeze): DCP's optimizer state maps groups by
    # the names of their parameters, so an empty group would come back without its hyperparameters
    return [g for g in groups if g["params"]] or groups[:1]


def _head(model: nn.Module) -> Optional[nn.Parameter]:
    """The head's weight: the last Linear's (None without one)."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    return linears[-1].weight if linears else None


def hidden_matrices(model: nn.Module) -> set:
    """ids of the hidden layers' 2-D weights: no embedding, no head (the last Linear, or one tied to an embedding)."""
    excluded = _embedding_ids(model) | {id(_head(model))}
    return {id(p) for p in model.parameters() if p.dim() == 2 and id(p) not in excluded}


def head_group(model: nn.Module, groups: list[dict], lr: float, head_lr: float) -> list[dict]:
    """`groups` with the untied head's weight moved into a group of its own at head_lr (lr_scale head_lr / lr)."""
    head = _head(model)
    if head is None or id(head) in _embedding_ids(model):
        raise ValueError("optim.head_lr needs an untied head (model.tie_embeddings=false)")
    if not head.requires_grad:
        return groups
    decay = next(g["weight_decay"] for g in groups if any(p is head for p in g["params"]))
    rest = [dict(g, params=[p for p in g["params"] if p is not head]) for g in groups]
    return [g for g in rest if g["params"]] + [{"params": [head], "weight_decay": decay, "lr": head_lr,
                                                 "lr_scale": head_lr / lr}]


def layer_groups(model: nn.Module, groups: list[dict], decay: float) -> list[dict]:
    """Layer-wise LR decay (BEiT, Bao et al. 2022), grouped as timm's `layer_decay`: each group split by depth, its
    lr_scale times decay^(L + 1 - depth). Repeated unit i of L (`model.repeated_units()`) is depth i, what comes
    before the first unit (embeddings, tokens) 0, the classifier L + 1, the rest after the units (final norm) L."""
    units = model.repeated_units()
    unit_of = {id(p): i for i, u in enumerate(units, 1) for p in u.parameters()}
    heads = [model.get_submodule(n) for n in getattr(model, "classifier_names", list)()] or \
        [m for m in model.modules() if isinstance(m, nn.Linear)][-1:]
    head = {id(p) for m in heads for p in m.parameters()}
    depth, after = {}, False
    for p in model.parameters():
        after = after or id(p) in unit_of
        depth[id(p)] = unit_of.get(id(p), len(units) + (id(p) in head) if after else 0)
    out = []
    for g in groups:
        for d in sorted({depth[id(p)] for p in g["params"]}):
            scale = g.get("lr_scale", 1.0) * decay ** (len(units) + 1 - d)
            out.append(dict(g, params=[p for p in g["params"] if depth[id(p)] == d], lr_scale=scale))
    return out


def split_hidden(groups: list[dict], hidden: set) -> tuple[list[dict], list[dict]]:
    """Each group split into its hidden matrices and the rest (same keys, empty groups dropped)."""
    parts = [[dict(g, params=[p for p in g["params"] if (id(p) in hidden) == inside]) for g in groups]
             for inside in (True, False)]
    return tuple([g for g in part if g["params"]] for part in parts)


def fused_supported(device: torch.device) -> bool:
    """torch's fused AdamW runs on CUDA, CPU (torch >= 2.4) and MPS."""
    return device.type in ("cuda", "cpu", "mps", "xpu")


def one_by_one(groups: list[dict]) -> bool:
    """Whether the parameters lie on several meshes (tensor parallelism's DTensors beside plain tensors, or FSDP2's
    beside them): torch's fused and foreach steps take one kind at once, its for-loop step any."""
    return len({getattr(p, "device_mesh", None) for g in groups for p in g["params"]}) > 1


def _adamw(model, groups, cfg, device: torch.device, log):
    if any(p.dtype == torch.bfloat16 for g in groups for p in g["params"]):  # train.precision: bf16-pure
        from torchao.optim import _AdamW  # round-to-nearest would lose every update under half a bf16 step
        log("optimizer: AdamW from torchao, bf16 moments, bf16 weights updated with stochastic rounding")
        return _AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, bf16_stochastic_round=True)
    if one_by_one(groups):
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, foreach=False)
    fused = fused_supported(device) if cfg.fused is None else cfg.fused
    try:
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=fused)
    except (RuntimeError, TypeError) as e:
        log(f"fused AdamW unavailable on {device.type} ({e}); using the foreach implementation")
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)


def _sgd(model, groups, cfg, device, log):
    return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov and cfg.momentum > 0,
                           foreach=False if one_by_one(groups) else None)


def _adagrad(model, groups, cfg, device, log):
    return torch.optim.Adagrad(groups, lr=cfg.lr, eps=cfg.eps)


def _rmsprop(model, groups, cfg, device, log):
    return torch.optim.RMSprop(groups, lr=cfg.lr, alpha=cfg.rmsprop_alpha, eps=cfg.eps, momentum=cfg.rmsprop_momentum,
                               centered=cfg.rmsprop_centered)


def _adafactor(model, groups, cfg, device, log):
    from .adafactor import Adafactor
    return Adafactor(groups, lr=cfg.lr, beta2_decay=cfg.adafactor_beta2_decay)


def _lion(model, groups, cfg, device, log):
    from .lion import Lion
    return Lion(groups, lr=cfg.lr, betas=tuple(cfg.betas))


def _muon(model, groups, cfg, device, log):
    from .muon import muon_with_adamw
    hidden, other = split_hidden(groups, hidden_matrices(model))
    hidden = [dict(g, weight_decay=cfg.weight_decay if g["weight_decay"] else 0.0) for g in hidden]  # not muP's
    if not hidden:
        raise ValueError("optim.name=muon: the model has no hidden 2-D weights for Muon")
    fused = fused_supported(device) if cfg.fused is None else cfg.fused
    return muon_with_adamw(hidden, other, cfg.lr, cfg.muon_lr, cfg.muon_momentum, cfg.betas, cfg.eps, fused)


def _galore(model, groups, cfg, device, log):
    from .galore import GaLoreAdamW
    hidden, other = split_hidden(groups, hidden_matrices(model))
    return GaLoreAdamW([dict(g, galore=True) for g in hidden] + other, lr=cfg.lr, betas=tuple(cfg.betas),
                       eps=cfg.eps, rank=cfg.galore_rank, update_every=cfg.galore_update_every,
                       scale=cfg.galore_scale)


def _adamw8bit(model, groups, cfg, device, log):
    if device.type == "cuda":
        with contextlib.suppress(ImportError):
            import bitsandbytes as bnb
            log("optimizer: adamw8bit from bitsandbytes")
            return bnb.optim.AdamW8bit(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)
    from torchao.optim import AdamW8bit
    log("optimizer: adamw8bit from torchao (block-wise quantised states; tensors under 4096 entries in fp32)")
    return AdamW8bit(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)


def _adamw_offload(model, groups, cfg, device, log):
    if device.type != "cuda":
        log(f"optimizer: adamw_offload skipped on {device.type} (CPU offload needs CUDA); fused AdamW instead")
        return _adamw(model, groups, cfg, device, log)
    try:
        from torchao.optim import CPUOffloadOptimizer
    except ImportError:
        raise ValueError("optim.name=adamw_offload needs the torchao package: pip install -e '.[optim]'") from None
    return CPUOffloadOptimizer(groups, torch.optim.AdamW, fused=True, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)


@dataclass(frozen=True)
class Optimizer:
    """A registry entry: its builder (model, param groups, optim config, device, log) -> optimizer, the package
    it needs (None: torch alone), the train.parallel strategies it runs under (the others refused with why_not)."""
    build: Callable
    package: Optional[str] = None
    parallel: tuple = ("ddp", "fsdp")
    why_not: str = ""  # why the strategies left out cannot run it


# optim.name -> its entry: the one list of optimizers (the config checks names against it)
ALL = ("ddp", "fsdp", "tp", "fsdp+tp", "pp")
OPTIMIZERS: dict[str, Optimizer] = {"adamw": Optimizer(_adamw, parallel=ALL), "sgd": Optimizer(_sgd, parallel=ALL),
                                    "adagrad": Optimizer(_adagrad), "rmsprop": Optimizer(_rmsprop),
                                    "adafactor": Optimizer(_adafactor), "lion": Optimizer(_lion),
                                    "muon": Optimizer(_muon), "adamw8bit": Optimizer(_adamw8bit, package="torchao"),
                                    "adamw_offload": Optimizer(_adamw_offload), "galore": Optimizer(_galore)}


def build_optimizer(model: nn.Module, cfg, device: torch.device, log=print):
    """The optimizer `cfg.name` of the registry over `model`'s parameter groups."""
    if cfg.name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {cfg.name!r} (known: {', '.join(OPTIMIZERS)})")
    groups = param_groups(model, cfg.weight_decay, cfg.layer_decay)
    if cfg.head_lr is not None:
        groups = head_group(model, groups, cfg.lr, cfg.head_lr)
    return OPTIMIZERS[cfg.name].build(model, groups, cfg, device, log)


def set_lr(optimizer, lr: float):
    """Every group's LR: the run's LR times the group's lr_scale (1 unless the optimizer set one)."""
    for g in optimizer.param_groups:
        value = lr * g.get("lr_scale", 1.0)
        if isinstance(g["lr"], torch.Tensor):  # torchao keeps the LR as a tensor (its step is compiled)
            g["lr"].fill_(value)
        else:
            g["lr"] = value


def state_bytes(optimizer) -> int:
    """Bytes the optimizer's state holds (its tensors, counted once; quantised tensors by their storage)."""
    return tensor_bytes(list(optimizer.state.values()))

