"""Past one process: torchrun's environment, the process group, DDP / FSDP2 wrapping and
cross-rank agreement. (Sharded checkpoints are train/checkpoint.py's.)

    torchrun --nproc-per-node N train/run.py CONFIG train.parallel=ddp|fsdp|tp|fsdp+tp|pp

Without torchrun's variables a run is one unwrapped process. NCCL on CUDA, gloo on CPU. fsdp:
FSDP2 `fully_shard` on each of `model.repeated_units()`, then the root; tp, fsdp+tp and pp are
train/model_parallel.py's. The data depends only on the global batch, split over the data-parallel
ranks; one all-reduce per step carries the loss and the stop flags (docs/distributed.md).
"""
from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from .grad_compression import attach
from .model_parallel import refusal
from .optim import OPTIMIZERS


_PROCESS_GROUP_USED = False  # set once this process has made a process group (see exit_process)


def exit_process(code: int):
    """End a run's process with `code`: after a run that made a process group, os._exit once stdout
    and stderr are flushed, skipping the interpreter's teardown (where FSDP2's DeviceMesh objects,
    still holding the gloo group, now and then abort a rank); otherwise sys.exit."""
    if not _PROCESS_GROUP_USED:
        sys.exit(code)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


@dataclass
class Launch:
    """Where this process stands in a torchrun job (rank 0 of 1 when not launched by torchrun)."""
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    torchrun: bool = False


def launch_env() -> Launch:
    """RANK, WORLD_SIZE and LOCAL_RANK as torchrun sets them."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return Launch()
    return Launch(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0)), True)


MODEL_PARALLEL = ("tp", "fsdp+tp", "pp")  # train/model_parallel.py's


def unsupported(cfg, world: int = 2) -> Optional[str]:
    """A one-line reason why this config cannot run with train.parallel (the key named), or None: an
    optimizer of the registry that does not run under the strategy (with the registry's reason); what tp, fsdp+tp
    and pp over `world` processes do not cover."""
    t, name = cfg.train, cfg.optim.name
    if t.parallel in MODEL_PARALLEL and (why := refusal(cfg, world)):
        return why
    optimizers = [n for n, o in OPTIMIZERS.items() if t.parallel in o.parallel]  # the ones run under it
    if name in optimizers:
        return None
    why = OPTIMIZERS[name].why_not if name in OPTIMIZERS else ""
    return (f"optim.name={name} does not combine with train.parallel={t.parallel} "
            f"({why + '; ' if why else ''}with it, use one of {', '.join(optimizers)})")


class Parallel:
    """The parallel side of a run: rank, world size, the wrapped model, agreement, DCP. tp_size: the processes
    of a tensor-parallel group under fsdp+tp (tp: all of them); pp_micro: micro-batches per pipeline pass."""

    def __init__(self, strategy: str, launch: Launch, tp_size: int = 2, pp_micro: int = 2):
        self.strategy, self.rank, self.world, self.local_rank = strategy, launch.rank, launch.world, launch.local_rank
        self.main, self.active = self.rank == 0, launch.torchrun and strategy != "none"
        self.tp = {"tp": self.world, "fsdp+tp": tp_size}.get(strategy, 1) if self.active else 1
        self.dp_world = self.world // self.tp if strategy != "pp" else 1  # the ranks that share out the data
        self.dp_rank = self.rank // self.tp if self.dp_world > 1 else 0
        self.pp_micro, self.mesh, self.fused, self.pipeline, self._dp_group = pp_micro, None, None, None, None
        self.comm = None  # train.grad_compression=powersgd: the hook whose state checkpoints keep

    def device(self, device: torch.device) -> torch.device:
        """The device of this rank: cuda:LOCAL_RANK on GPUs (one per process)."""
        if self.active and device.type == "cuda":
            device = torch.device("cuda", self.local_rank)
            torch.cuda.set_device(device)
        return device

    def init(self, device: torch.device, host: bool = False):
        """The process group; host: collectives of host tensors too (gloo beside NCCL: train.fsdp_offload)."""
        global _PROCESS_GROUP_USED
        if not self.active:
            return
        if not dist.is_initialized():
            cuda = device.type == "cuda"
            dist.init_process_group(("cpu:gloo,cuda:nccl" if host else "nccl") if cuda else "gloo",
                                    device_id=device if cuda else None)
            _PROCESS_GROUP_USED = True
        if self.tp > 1:
            from torch.distributed.device_mesh import init_device_mesh
            self.mesh = init_device_mesh(device.type, (self.dp_world, self.tp), mesh_dim_names=("dp", "tp"))
            self._dp_group = self.mesh["dp"].get_group()

    def close(self):
        if self.active and dist.is_initialized():
            dist.destroy_process_group()

    def describe(self) -> str:
        if not self.active:
            return ""
        backend = dist.get_backend() if dist.is_initialized() else "?"
        mesh = f" (data {self.dp_world} x tensor {self.tp})" if self.strategy == "fsdp+tp" else ""
        return f"parallel: {self.strategy} over {self.world} processes{mesh} ({backend}); this is rank {self.rank}"

    def wrap(self, model: nn.Module, precision: str, t, device, say, unused=False):
        """-> (model, fwd): the module whose state is checkpointed, and what the loss runs. ddp: the plain
        module and DDP(model) (compiled when asked, train.grad_compression's hook); fsdp: the model sharded in place
        for both (each unit compiled first when asked; train.fsdp_*). t: train:. unused: parameters without a
        gradient in some steps (train.unfreeze, drop_path_mode=batch). fsdp with fp16: DTensor all-reduces the
        GradScaler's inf/nan check, so every rank skips the same steps."""
        if not self.active:
            return model, None
        if t.sync_bn:
            n = convert_sync_batchnorm(model, device)
            say(f"sync_bn: {n} BatchNorm layers normalise with the statistics of all {self.world} ranks"
                if n else "sync_bn: skipped (the model has no BatchNorm layer)")
        if self.strategy == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP
            # the gradients are views into the all-reduce buckets: no second copy of them. Every rank builds the
            # same weights; rank 0's are not broadcast to a QLoRA base (DDP's broadcast alters torchao's NF4 tensors)
            nf4 = getattr(getattr(model, "adapter_config", None), "quantize_base", "none") == "nf4"
            # torch's PowerSGD hook waits for collectives inside gloo's callbacks: buckets in flight at once can hold
            # all of gloo's threads (a hang), so on gloo one bucket holds every gradient
            one = t.grad_compression == "powersgd" and device.type != "cuda"
            cap = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20 + 1 if one else None
            ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, bucket_cap_mb=cap,
                      gradient_as_bucket_view=True, init_sync=not nf4, find_unused_parameters=unused)
            self.comm = attach(ddp, t, say)
            if t.compile:
                say("compile: torch.compile(DDP(model)); the first steps include compilation")
                return model, torch.compile(ddp)
            return model, ddp
        units = model.repeated_units()
        if self.strategy == "pp":
            from .model_parallel import Pipeline
            self.pipeline = Pipeline(model, self.rank, self.world, self.pp_micro, device)
            say(f"pp: {self.world} stages of {len(units) // self.world} blocks, a 1F1B schedule of {self.pp_micro} "
                f"micro-batches per micro-batch; every rank holds the whole model, each trains its stage")
            return model, model
        if self.tp > 1:
            from .model_parallel import apply_tp
            self.fused = apply_tp(model, self.mesh["tp"])
            say(f"tp: attention heads and MLP width of {len(units)} blocks split over {self.tp} ranks, "
                f"norms sequence-parallel")
            if self.strategy == "tp":
                return model, model
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if precision == "bf16" else MixedPrecisionPolicy()
        offload = t.fsdp_offload and device.type == "cuda"  # CPUOffloadPolicy pins host memory: CUDA only
        if t.fsdp_offload and not offload:
            say(f"fsdp_offload: skipped on {device.type} (CUDA only: the parameters already live in host memory)")
        mesh = self.mesh["dp"] if self.mesh is not None else None
        policy = dict(mesh=mesh, mp_policy=mp, reshard_after_forward=t.fsdp_reshard,
                      offload_policy=CPUOffloadPolicy() if offload else OffloadPolicy())
        if t.compile:
            say(f"compile: each of the {len(units)} repeated units compiled, then sharded")
        # parameters that do not train stay whole (a frozen autoencoder), except an adapter's base: it is
        # sharded with the adapters, so that no rank holds all of it
        adapted = hasattr(model, "adapter_config")
        self._frozen = {n for n, p in model.named_parameters() if not p.requires_grad and not adapted}
        frozen = {p for p in model.parameters() if not p.requires_grad and not adapted}
        for unit in units:
            if t.compile:
                unit.compile()
            fully_shard(unit, ignored_params=frozen or None, **policy)
        fully_shard(model, ignored_params=frozen or None, **policy)
        say(f"fsdp: {len(units)} units and the root sharded over {self.dp_world} ranks"
            + (" (bf16 parameters, fp32 gradient reduction)" if precision == "bf16" else "")
            + ("; ZeRO-2: gathered parameters kept from forward to backward" if not t.fsdp_reshard else "")
            + ("; parameters, gradients and optimizer states in host memory" if offload else ""))
        return model, model

    def shard_like(self, model: nn.Module):
        """Shard a copy of the trained model (the EMA, whose parameters train none) as wrap() sharded it."""
        if self.active and self.strategy == "fsdp":
            from torch.distributed.fsdp import fully_shard
            frozen = {p for n, p in model.named_parameters() if n in self._frozen} or None
            for unit in model.repeated_units():
                fully_shard(unit, ignored_params=frozen)
            fully_shard(model, ignored_params=frozen)
        return model

    def shard_masks(self, model: nn.Module, masks: Optional[dict]):
        """train.prune under FSDP2: each mask of {name: (weight, mask)} replaced by its weight's shard (in place)."""
        if masks and self.active and self.strategy == "fsdp":
            from torch.distributed.tensor import distribute_tensor
            modules = dict(model.named_modules())
            for name, (_, mask) in masks.items():
                w = modules[name].weight
                masks[name] = (w, distribute_tensor(mask, w.device_mesh, w.placements, src_data_rank=None))

    def no_sync(self, fwd, last: bool):
        """DDP: no gradient all-reduce on the micro-batches before the last of an optimizer step."""
        return contextlib.nullcontext() if last or not self.active or self.strategy != "ddp" else \
            getattr(fwd, "_orig_mod", fwd).no_sync()

    def agree(self, stats: torch.Tensor, stop: bool) -> tuple[torch.Tensor, bool]:
        """[loss sum, grad norm] of this rank -> every rank's: the loss averaged over the ranks, the norm NaN
        when any rank's is not finite; and whether any rank was asked to stop. One all-reduce."""
        if not self.active:
            return stats, stop
        t = torch.stack([stats[0], (~torch.isfinite(stats[1])).to(stats.dtype),
                         torch.tensor(float(stop), device=stats.device)])
        dist.all_reduce(t)
        gnorm = torch.where(t[1] > 0, torch.full_like(stats[1], float("nan")), stats[1])
        return torch.stack([t[0] / self.world, gnorm]), bool(t[2] > 0)

    def sum_(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the data-parallel ranks, in place (e.g. MoE router load before a bias update)."""
        if self.active and self.dp_world > 1:
            dist.all_reduce(x, group=self._dp_group)
        return x

    def gather(self, value: float) -> list:
        """One number from every rank, in rank order (on every rank)."""
        if not self.active:
            return [value]
        out = [None] * self.world
        dist.all_gather_object(out, value)
        return out

    def broadcast(self, obj):
        """Rank 0's object on every rank."""
        if not self.active:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def seed_rank(self, seed: int):
        """Ranks > 0 draw from their own RNG streams (dropout, ...); rank 0 keeps the run's."""
        if self.active and self.rank:
            torch.manual_seed(seed + 1_000_003 * self.rank)

    def barrier(self):
        if self.active:
            dist.barrier()

    def full_state(self, model: nn.Module) -> dict:
        """The whole model's state dict on the CPU of rank 0 (empty on the others); collective."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        self.sync(model)
        if not self.active or self.strategy in ("ddp", "pp"):
            return {k: v.detach().cpu() for k, v in model.state_dict().items()} if self.main else {}
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return self.fused.saved(full) if self.fused is not None and full else full

    def sync(self, model: nn.Module):
        """pp: every rank's copy of the model made current (each stage's weights from its rank); else nothing."""
        if self.pipeline is not None:
            self.pipeline.sync()


# ------------------------------------------------------------------------------ SyncBatchNorm
class CPUSyncBatchNorm(nn.BatchNorm2d):
    """BatchNorm2d with the whole global batch's training statistics on any device (torch's
    SyncBatchNorm takes GPU inputs only): two differentiable all-reduces per layer (mean, then the
    centred sum of squares), running statistics updated as BatchNorm2d does."""

    def forward(self, x):
        if not (self.training and dist.is_initialized() and dist.get_world_size() > 1):
            return super().forward(x)
        from torch.distributed.nn.functional import all_reduce
        C, xf = x.shape[1], x.float()
        local = torch.cat([xf.sum((0, 2, 3)), xf.new_tensor([x.numel() / C])])
        total = all_reduce(local)
        n = total[-1]
        mean = total[:C] / n
        centred = xf - mean.view(1, C, 1, 1)
        var = all_reduce(centred.square().sum((0, 2, 3))) / n
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked += 1
                m = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
                self.running_mean.lerp_(mean.detach().to(self.running_mean.dtype), m)
                self.running_var.lerp_((var.detach() * n / (n - 1)).to(self.running_var.dtype), m)
        y = centred * torch.rsqrt(var + self.eps).view(1, C, 1, 1)
        if self.affine:
            y = y * self.weight.view(1, C, 1, 1) + self.bias.view(1, C, 1, 1)
        return y.to(x.dtype)


def convert_sync_batchnorm(model: nn.Module, device: torch.device) -> int:
    """Each BatchNorm2d made a synchronised one in place (SyncBatchNorm on GPUs, else CPUSyncBatchNorm); how many."""
    count = 0
    for parent in model.modules():
        for name, bn in list(parent.named_children()):
            if not isinstance(bn, nn.BatchNorm2d) or isinstance(bn, CPUSyncBatchNorm):
                continue
            cls = nn.SyncBatchNorm if device.type == "cuda" else CPUSyncBatchNorm
            new = cls(bn.num_features, bn.eps, bn.momentum, bn.affine, bn.track_running_stats,
                      device=bn.weight.device if bn.affine else None)
            new.load_state_dict(bn.state_dict())
            new.train(bn.training)
            if bn.affine:
                new.weight.requires_grad_(bn.weight.requires_grad)
                new.bias.requires_grad_(bn.bias.requires_grad)
            setattr(parent, name, new)
            count += 1
    return count
