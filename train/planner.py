"""The memory planner: what a training step needs, from the config alone, before the run starts.

`plan(cfg)` builds the model as the loop does under FakeTensorMode (nothing allocated) and counts the
storages alive through the loop's step (`LiveBytes`), plus the CUDA caching allocator's rules or a CPU
margin. `fits`: settings that fit a budget; `auto_batch_size`: train.batch_size: auto; `measure`: the
real step, to check the plan (docs/memory.md). Its program: train/plan.py.
"""
from __future__ import annotations

import bisect
import contextlib
import dataclasses
import functools
import itertools
import json
import math
import sys
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from zoo.config import ConfigError
from zoo.quantization import targets
from zoo.tensors import tensors_of

from .checkpoint import list_checkpoints
from .config import load_run_config, parse_memory_size, task_class
from .hardware import keep_freed_memory
from .model import build_model
from .optim import build_optimizer
from .step import (EMA, EXIT_CONFIG, RunStopped, amp_dtype, autocast_for, optimizer_step, precision_of,
                   resolve_precision)

MiB, GiB = 2 ** 20, 2 ** 30


# ------------------------------------------------------------------------------ counting live bytes
class LiveBytes(TorchDispatchMode):
    """Counts the bytes of the tensor storages alive, real or fake (added when an op first returns one, or by
    `add`; subtracted when it dies), and their `peak` since `reset_peak()`. device: only that device type's."""

    def __init__(self, device: Optional[str] = None, trace: Optional["AllocTrace"] = None):
        super().__init__()
        self.device, self.trace = device, trace
        self.live = self.peak = 0
        self._refs: dict[int, weakref.ref] = {}

    def add(self, *tensors):
        for t in tree_flatten(tensors)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta" or \
                    (self.device is not None and t.device.type != self.device):
                continue
            inner = getattr(t, "__tensor_flatten__", None)
            if inner is not None and type(t) not in (torch.Tensor, nn.Parameter) \
                    and not type(t).__name__ == "FakeTensor":  # a tensor subclass: count its parts
                self.add(*[getattr(t, n) for n in inner()[0]])
                continue
            s = t.untyped_storage()
            key = id(s)
            if key in self._refs:
                continue
            n = s.nbytes()
            if self.trace is not None:
                self.trace.add(s, n)
            self._refs[key] = weakref.ref(s, lambda _, key=key, n=n: self._drop(key, n))
            self.live += n
            self.peak = max(self.peak, self.live)

    def _drop(self, key, n):
        if self._refs.pop(key, None) is not None:
            self.live -= n

    def reset_peak(self):
        self.peak = self.live

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        fp32_grouped = func is _GROUPED_MM and type(args[0]).__name__ == "FakeTensor" and args[0].dtype == torch.float32
        out = (_grouped_mm_like if fp32_grouped else func)(*args, **(kwargs or {}))
        self.add(out)
        return out


class AllocTrace:
    """The order in which tensor storages are made and freed, [(key, +bytes) or (key, -bytes)], each storage
    once: replayed through the CUDA caching allocator's rules (`cuda_reserved_peak`) it gives its peak."""

    def __init__(self):
        self.events: list[tuple[int, int]] = []
        self._refs: dict[int, weakref.ref] = {}
        self._next = 0

    def add(self, storage, n: int):
        key = id(storage)
        if key in self._refs:
            return
        uid = self.add_bytes(n)
        self._refs[key] = weakref.ref(storage, lambda _, key=key, uid=uid, n=n: self._free(key, uid, n))

    def add_bytes(self, n: int) -> int:
        """A block made (by add, or one that no dispatched op makes: torchao's 8-bit states, the EMA's copy)."""
        self._next += 1
        self.events.append((self._next, n))
        return self._next

    def _free(self, key, uid, n):
        if self._refs.pop(key, None) is not None:
            self.events.append((uid, -n))


def cuda_reserved_peak(events) -> int:
    """The peak bytes PyTorch's CUDA caching allocator reserves for `events` (CUDACachingAllocator.cpp: 512-byte
    rounding, small and large pools, best fit, splitting, merging, segments cached), the CUDA context not in it."""
    reserved = peak = 0
    free: dict[bool, list] = {True: [], False: []}   # small pool? -> sorted [(size, segment, offset)]
    start_of: dict[tuple, int] = {}                   # (segment, offset) -> size of a free block
    end_of: dict[tuple, int] = {}                     # (segment, end) -> offset of a free block
    blocks: dict[int, tuple] = {}
    segments = 0

    def take(small, seg, off, size):
        del start_of[(seg, off)], end_of[(seg, off + size)]
        free[small].pop(bisect.bisect_left(free[small], (size, seg, off)))

    def put(small, seg, off, size):
        start_of[(seg, off)], end_of[(seg, off + size)] = size, off
        bisect.insort(free[small], (size, seg, off))

    for uid, n in events:
        if n > 0:
            size = max(512, (n + 511) // 512 * 512)
            small = size <= MiB
            pool = free[small]
            i = bisect.bisect_left(pool, (size, -1, -1))
            if i < len(pool):
                fsize, seg, off = pool[i]
                take(small, seg, off, fsize)
            else:
                fsize = 2 * MiB if small else 20 * MiB if size < 10 * MiB else (size + 2 * MiB - 1) // (2 * MiB) * 2 * MiB
                seg, off = segments, 0
                segments += 1
                reserved += fsize
                peak = max(peak, reserved)
            if fsize - size > (512 if small else MiB):
                put(small, seg, off + size, fsize - size)
            else:
                size = fsize
            blocks[uid] = (small, seg, off, size)
        else:
            if uid not in blocks:
                continue
            small, seg, off, size = blocks.pop(uid)
            if nsize := start_of.get((seg, off + size)):  # merged with the free blocks after and before it
                take(small, seg, off + size, nsize)
                size += nsize
            if (prev := end_of.get((seg, off))) is not None:
                take(small, seg, prev, off - prev)
                size, off = size + off - prev, prev
            put(small, seg, off, size)
    return peak


_GROUPED_MM = getattr(getattr(torch.ops.aten, "_grouped_mm", None), "default", None)


def _grouped_mm_like(a, b, offs=None, bias=None, out_dtype=None):
    """An empty result of aten._grouped_mm's shape (its shape function refuses the fp32 the CPU kernel runs)."""
    dims = (a.dim(), b.dim())  # the leading sizes, then b's last
    lead = a.shape[:1] if dims == (2, 3) else (offs.shape[0], a.shape[0]) if dims == (2, 2) else \
        a.shape[:2] if dims == (3, 3) else a.shape[1:2]
    return a.new_empty((*lead, b.shape[-1]), dtype=out_dtype or a.dtype)


# ------------------------------------------------------------------------------ optimizer states
def adamw8bit_state_bytes(params) -> int:
    """torchao's AdamW8bit: per tensor of >= 4096 values (a multiple of the 256-value block) two int8 moments,
    an fp32 scale per block and a 256-entry fp32 code map each; smaller tensors fp32 moments; a step count each."""
    total = 0
    for p in params:
        n = p.numel()
        total += (2 * (n + 4 * (n // 256) + 4 * 256) if n >= 4096 and n % 256 == 0 else 2 * n * p.element_size()) + 4
    return total


def planned_optimizer(model, params, cfg, device):
    """(the optimizer to step on fake tensors, None), or (None, its state bytes from its layout) for those whose
    step cannot run on fake tensors: torchao's 8-bit AdamW (a compiled step) and GaLore (`planned_state_bytes`)."""
    if cfg.optim.name == "adamw8bit":
        return None, adamw8bit_state_bytes(params)
    if cfg.train.precision == "bf16-pure":  # torchao's AdamW (a compiled step): two moments in bf16, an fp32 count
        return None, sum(2 * p.numel() * p.element_size() + 4 for p in params)
    opt = build_optimizer(model, cfg.optim, device, lambda m: None)
    return (None, opt.planned_state_bytes()) if hasattr(opt, "planned_state_bytes") else (opt, 0)


def fake_step(optimizer):
    """optimizer.step() on fake tensors; an optimizer that reads a value back (Adafactor's, GaLore's step count)
    stops there, so each tensor is then stepped alone, every one getting its state (what the plan needs)."""
    from torch._subclasses.fake_tensor import DataDependentOutputException
    with contextlib.suppress(DataDependentOutputException):
        optimizer.step()
        return
    groups = optimizer.param_groups
    try:
        for g in groups:
            for p in g["params"]:
                optimizer.param_groups = [dict(g, params=[p])]
                with contextlib.suppress(DataDependentOutputException):
                    optimizer.step()
    finally:
        optimizer.param_groups = groups


# ------------------------------------------------------------------------------ the model and its units
def repeated_units(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks (transformer blocks, residual blocks)."""
    return list(model.checkpoint_units() if hasattr(model, "checkpoint_units") else getattr(model, "layers", []))


def _depth_keys(cfg):
    """(n_layers, its block pattern's period: MoD, sparse MoE, checkpointing every n-th, the leading dense layers of
    an MoE) of an LLM stack, else None."""
    if cfg.family != "llm":
        return None
    m = cfg.model
    dense = next((i for i in range(m.n_layers) if i not in m.moe.dense_layers), m.n_layers) if m.moe else 0
    return m.n_layers, math.lcm(m.mod_every if m.mod_capacity > 0 else 1, m.moe.sparse_every if m.moe else 1,
                                cfg.train.activation_checkpointing_every), dense


# ------------------------------------------------------------------------------ the simulated step
@dataclass
class Simulated:
    persistent: int          # params + buffers + optimizer states + batch at rest
    params: int
    buffers: int
    grads: int
    states: int
    inputs: int
    forward_backward: int    # peak above `persistent` during forward and backward
    optimizer_step: int      # peak above `persistent` during clipping and the optimizer step
    per_unit: list           # bytes each repeated block keeps from its forward to the backward
    logits: int              # the peak the loss adds over the last block's output (forward)
    events: list = field(default_factory=list)  # AllocTrace.events: construction and three steps


def _precision(cfg, device: torch.device) -> str:
    """The precision the loop runs cfg in (train/step.py's resolve_precision: `auto` measured
    once per process and device, as the loop measures it; outside any fake-tensor mode)."""
    p = cfg.train.precision
    if p == "auto":
        key = (str(device), torch.get_num_threads())
        if key not in _AUTO:
            from torch._subclasses.fake_tensor import unset_fake_temporarily
            with unset_fake_temporarily():
                _AUTO[key] = resolve_precision(p, device)
        p = _AUTO[key]
    return p


_AUTO: dict = {}  # (device, threads) -> what train.precision: auto resolved to


def simulate(cfg, device: torch.device, batch_size: Optional[int] = None, n_layers: Optional[int] = None,
             fake: bool = True) -> Simulated:
    """One steady-state training step of `cfg` (a RunConfig) counted by LiveBytes: fake tensors
    (nothing allocated) unless fake=False. n_layers: build the LLM at that depth instead."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    if n_layers is not None:
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, n_layers=n_layers, depth=None))
        if cfg.model.moe is not None:
            dense = [i for i in cfg.model.moe.dense_layers if i < n_layers]
            cfg.model.moe = dataclasses.replace(cfg.model.moe, dense_layers=dense)
    precision, B = _precision(cfg, device), batch_size or cfg.train.batch_size
    trace = AllocTrace()  # the run's storages in order, from the model's construction to the third step
    with FakeTensorMode() if fake else contextlib.nullcontext(), torch.random.fork_rng(devices=[]):
        with torch.device(device), LiveBytes(device.type, trace):
            model = build_model(cfg)
        if cfg.train.ema_decay:  # the loop's EMA: a copy of the model, made before the optimizer
            trace.add_bytes(_bytes(model.parameters()) + _bytes(model.buffers()))
        if cfg.train.prune:
            trace.add_bytes(mask_bytes(model, cfg.train))
        task = task_class(cfg.family, cfg.source, cfg.data)(cfg, device, lambda m: None)
        task.autocast_dtype = amp_dtype(precision)
        with LiveBytes(device.type, trace):
            batch = task.example_batch(model, B)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer, states = planned_optimizer(model, params, cfg, device)
        autocast, units = autocast_for(device, precision), repeated_units(model)
        counter = LiveBytes(device.type, trace)
        per_unit, phase, before = {}, {"name": "warm-up"}, {}

        def watch(i, unit):  # the bytes unit i keeps from its (first tracked) forward to the backward
            def pre(mod, args):
                if phase["name"] == "forward" and i not in per_unit:
                    before[i] = counter.live

            def post(mod, args, out):
                if phase["name"] == "forward" and i not in per_unit and i in before:
                    per_unit[i] = counter.live - before[i]
            return [unit.register_forward_pre_hook(pre), unit.register_forward_hook(post)]

        handles = [h for i, u in enumerate(units) for h in watch(i, u)]
        logits = {"start": None, "peak": 0}
        if units:
            def after_last(mod, args, out):
                if phase["name"] == "forward":
                    logits["start"] = counter.live
                    counter.reset_peak()
            handles.append(units[-1].register_forward_hook(after_last))

        offload = cfg.train.activation_offload and device.type == "cuda"

        def step(track: bool, first: bool = False):
            with autocast(), (torch.autograd.graph.save_on_cpu() if offload else contextlib.nullcontext()):
                loss, _ = task.loss(model, batch)
            if track and logits["start"] is not None:
                logits["peak"] = counter.peak - logits["start"]
            phase["name"] = "backward"
            loss.backward()
            if track:
                fb = counter.peak
                phase["name"] = "optimizer"
                counter.reset_peak()
            torch.nn.utils.clip_grad_norm_(params, cfg.train.clip_grad or float("inf"))
            if optimizer is not None:
                fake_step(optimizer)
                optimizer.zero_grad(set_to_none=True)
            else:
                if first:  # torchao's 8-bit states, made at its first step
                    trace.add_bytes(states)
                for p in params:
                    p.grad = None
            return (fb, counter.peak) if track else None

        with counter:
            step(track=False, first=True)  # the optimizer makes its state
        state_tensors = tensors_of(optimizer.state) if optimizer is not None else []
        states = _bytes(state_tensors) if optimizer is not None else states
        counter = LiveBytes(device.type, trace)
        counter.add(list(model.parameters()), list(model.buffers()), state_tensors, batch)
        persistent = counter.live + (states if optimizer is None else 0)  # 8-bit states: their bytes (no tensors here)
        counter.live = counter.peak = persistent
        with counter:
            phase["name"] = "forward"
            fb, opt = step(track=True)
            phase["name"] = "third"
            step(track=False)  # the caching allocator's blocks settle over the first steps
        for h in handles:
            h.remove()
        p_bytes = _bytes(model.parameters())
        b_bytes = _bytes(model.buffers()) + mask_bytes(model, cfg.train)
        g_bytes = sum(p.numel() * p.element_size() for p in params)
        inputs = _bytes(tree_flatten(batch)[0])
    return Simulated(persistent, p_bytes, b_bytes, g_bytes, states, inputs, fb - persistent, opt - persistent,
                     [per_unit.get(i, 0) for i in range(len(units))], logits["peak"], trace.events)


def text_side(cfg, device: torch.device, fake: bool = True) -> dict:
    """A text-to-image run's text encoder and prompt cache as its setup makes them (train/tasks/text_to_image.py):
    {"text_encoder": the encoder's weights and buffers, "text_encoding": the peak above them while it embeds a batch
    of data.encode_batch_size prompts (padded: a key mask), "prompt_cache": the embeddings, fp32, a row per distinct
    prompt}; fake tensors unless fake=False."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from .tasks.text_to_image import encoder_architecture, load_captioned
    m, d = cfg.model, cfg.data
    prompts = len(load_captioned(d, m.image_size, cfg.source, lambda _: None)[1])
    with FakeTensorMode() if fake else contextlib.nullcontext(), torch.random.fork_rng(devices=[]), \
            torch.device(device), torch.no_grad():
        llm = encoder_architecture(m.text_encoder).eval()
        weights = _bytes([*llm.parameters(), *llm.buffers()])
        B, L = min(d.encode_batch_size, prompts), m.text_length
        with LiveBytes(device.type) as counter:
            ids, mask = torch.zeros(B, L, dtype=torch.long), torch.arange(L).expand(B, L) < L - 1
            torch.stack(llm.hidden_states(ids, m.text_layers, mask), 2).flatten(2)  # zoo's prompt_embeds
    return {"text_encoder": weights, "text_encoding": counter.peak, "prompt_cache": prompts * L * m.flux2.text_dim * 4}


def mask_bytes(model: nn.Module, t) -> int:
    """train.prune's masks, counted with the buffers: a bool per weight of the pruned linears."""
    if not t.prune:
        return 0
    modules = dict(model.named_modules())
    return sum(modules[n].weight.numel() for n in targets(model, t.prune_keep))


def _bytes(tensors) -> int:
    probe = LiveBytes()
    probe.add(list(tensors))
    return probe.live


# ------------------------------------------------------------------------------ the plan
@dataclass
class Plan:
    peak_bytes: int
    breakdown: dict                      # params, buffers, grads, optimizer_states, inputs, activations
    per_layer_activations: list          # bytes per repeated block
    logits_bytes: int
    kv_cache_bytes: Optional[int]        # LLM: generation at the run's batch and model.max_seq_len
    host_bytes: int = 0                  # offloaded to host memory (CUDA: optimizer states, activations)
    devices: int = 1
    sharding: str = "none"
    extrapolated_from: Optional[list] = None  # the depths simulated when the stack was extrapolated
    notes: list = field(default_factory=list)
    device: str = "cpu"                  # the device planned for
    precision: str = "fp32"              # the precision the run computes in there
    setup_bytes: int = 0                 # text to image: the text encoder embedding the prompts, before the model

    to_dict = dataclasses.asdict


SIMULATE_FULL_DEPTH = 8  # deeper LLM stacks are simulated at two reduced depths and extrapolated


def run_device(cfg) -> torch.device:
    name = cfg.train.device
    return torch.device(("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name)


def for_target(cfg, target: torch.device) -> tuple:
    """(cfg as it runs on `target`, the device its step is simulated on, its precision and why): a CUDA target
    without CUDA is simulated on the CPU's fake tensors, `auto` as bf16, attention through SDPA."""
    t, sim = cfg.train, target
    if target.type == "cuda" and not torch.cuda.is_available():
        sim = torch.device("cpu")
        precision = "bf16" if t.precision == "auto" else t.precision
        why = "auto: bf16 on a CUDA GPU (compute capability 8.0+ assumed)" if t.precision == "auto" else "as set"
        over = {"attn_backend": "sdpa"} if t.attn_backend == "auto" else {}
    else:
        precision, over = _precision(cfg, target), {}
        why = f"auto on this {target.type}" if t.precision == "auto" else "as set"
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(t, precision=precision, **over))
    return cfg, sim, precision, why


def plan(cfg, devices: int = 1, sharding: str = "ddp", batch_size: Optional[int] = None,
         device: Optional[torch.device] = None) -> Plan:
    """The predicted peak memory per device of one training step of `cfg` on `device` (default: the run's)."""
    target = device or run_device(cfg)
    cfg, device, precision, why = for_target(cfg, target)
    B, depth = batch_size or cfg.train.batch_size, _depth_keys(cfg)
    notes = [f"precision {precision} ({why})"]
    if cfg.train.activation_offload and target.type == "cuda" and device.type != "cuda":
        notes.append("train.activation_offload is simulated only on a machine with CUDA: planned without it")
    if depth is not None and depth[0] > max(SIMULATE_FULL_DEPTH, depth[2] + 4 * depth[1]):
        L, p, dense = depth
        l1, l2 = dense + 2 * p, dense + 4 * p  # past an MoE's leading dense layers: its sparse ones in both
        s1, s2 = simulate(cfg, device, B, l1), simulate(cfg, device, B, l2)
        full, k = _static(cfg, device, B), (L - l1) / (l2 - l1)
        lin = lambda a, b: round(a + k * (b - a))  # noqa: E731
        # activations above the persistent part extrapolate in depth; the full model's own grads
        fb = lin(s1.forward_backward - s1.grads, s2.forward_backward - s2.grads) + full.grads
        opt = lin(s1.optimizer_step - s1.grads, s2.optimizer_step - s2.grads) + full.grads
        per_unit = (s2.per_unit + [s2.per_unit[-1]] * (L - l2)) if s2.per_unit else []
        sim = dataclasses.replace(full, forward_backward=fb, optimizer_step=opt, per_unit=per_unit, logits=s2.logits)
        allocator = lin(allocator_overhead(s1.events, target), allocator_overhead(s2.events, target))
        extrapolated = [l1, l2]
    else:
        sim, extrapolated = simulate(cfg, device, B), None
        allocator = allocator_overhead(sim.events, target)
    activations = max(sim.forward_backward, sim.optimizer_step) - sim.grads
    host, params, grads, states = 0, sim.params, sim.grads, sim.states
    if cfg.optim.name == "adamw_offload" and target.type == "cuda":
        host, states = states + params + grads, 0  # torchao keeps fp32 params, grads and states on the host
        notes.append("optim.name=adamw_offload: optimizer states, a copy of the parameters and the gradients "
                     "are in host memory")
    elif cfg.optim.name == "adamw_offload":
        notes.append("optim.name=adamw_offload runs as AdamW on a CPU (its states are in host memory already)")
    if sharding == "fsdp2" and devices > 1:  # the block running and the one prefetched, unsharded (ZeRO-2: all)
        t = cfg.train
        with _fake_model(cfg, device) as model:
            gathered = _bytes(model.parameters()) if not t.fsdp_reshard else \
                2 * max((_bytes(u.parameters()) for u in repeated_units(model)), default=0)
        params, grads, states = params // devices, grads // devices, states // devices
        activations += gathered
        notes.append(f"fsdp2 over {devices} devices: parameters, gradients and optimizer states sharded; "
                     f"{fmt_bytes(gathered)} for the all-gathered parameters of "
                     + ("the whole model, kept from forward to backward (train.fsdp_reshard=false: ZeRO-2)"
                        if not t.fsdp_reshard else "two blocks"))
        if t.fsdp_offload and target.type == "cuda":
            host, params, grads, states = host + params + grads + states, 0, 0, 0
            notes.append("train.fsdp_offload: the shards of parameters, gradients and optimizer states in host memory")
    elif sharding == "ddp" and devices > 1:
        activations += sim.grads  # DDP's gradient buckets: one more copy of the gradients
        notes.append(f"ddp over {devices} devices: everything replicated, plus DDP's gradient buckets "
                     f"(one more copy of the gradients)")
    ema = sim.params + sim.buffers if cfg.train.ema_decay else 0  # train.ema_decay: a copy of the model
    breakdown = {"params": params, "buffers": sim.buffers, "grads": grads, "optimizer_states": states,
                 "ema": ema, "inputs": sim.inputs, "activations": activations}
    setup = 0
    if cfg.family == "diffusion" and cfg.model.denoiser == "flux2":
        text, kept = text_side(cfg, device), not Path(cfg.model.text_encoder).is_dir()  # a random one: saved at the end
        setup = text["text_encoder"] + text["text_encoding"]
        resident = {"text_encoder": text["text_encoder"] * kept, "prompt_cache": text["prompt_cache"]}
        host += sum(resident.values()) if target.type != "cpu" else 0
        breakdown.update({k: v if target.type == "cpu" else 0 for k, v in resident.items()})
        notes.append(f"text to image: the frozen text encoder ({cfg.model.text_encoder}) embeds the prompts before the "
                     f"model is built ({fmt_bytes(setup)} at its peak), then "
                     + ("stays in host memory, " if kept else "is freed, ")
                     + f"beside the prompt cache (a memmap, {fmt_bytes(text['prompt_cache'])})")
    if target.type == "cpu":
        share, constant = CPU_MARGIN.get(cfg.family, CPU_MARGIN_OTHER)
        allocator = round(share * sum(breakdown.values())) + constant
        notes.append(f"CPU: the allocator's margin for the {cfg.family} family is {share:.0%} of the tensors' peak "
                     f"plus {fmt_bytes(constant)}, chosen to err high (docs/memory.md)")
    breakdown["allocator"] = max(0, allocator)
    m = cfg.model  # the KV cache of generation at the run's batch and model.max_seq_len
    kv = 2 * m.n_layers * B * m.resolved_n_kv_heads * m.max_seq_len * m.resolved_head_dim * \
        (amp_dtype(_precision(cfg, device)) or torch.float32).itemsize if cfg.family == "llm" else None
    return Plan(max(sum(breakdown.values()), setup), breakdown, sim.per_unit, sim.logits, kv, host, devices,
                sharding if devices > 1 else "none", extrapolated, notes, str(target), precision, setup)


CUDA_WORKSPACE_BYTES = 32 * MiB  # cuBLAS's workspace, allocated through the caching allocator


# A CPU's allocator margin per family: (share of the tensors' peak, constant), for glibc's heap holes
# and what no tensor holds (autograd objects, BLAS/oneDNN buffers); errs high (`bench.py memory`).
CPU_MARGIN = {"llm": (0.5, 32 * MiB), "convnet": (0.8, 64 * MiB), "diffusion": (0.3, 48 * MiB)}
CPU_MARGIN_OTHER = (0.8, 64 * MiB)  # a family without its own


def allocator_overhead(events, device) -> int:
    """What the CUDA caching allocator holds at its peak beyond the tensors alive (`cuda_reserved_peak` of the
    step's allocations) plus cuBLAS's workspace; 0 elsewhere (a CPU's margin is `CPU_MARGIN`)."""
    if device.type != "cuda":
        return 0
    peak_live = max(itertools.accumulate((n for _, n in events), initial=0))
    return cuda_reserved_peak(events) + CUDA_WORKSPACE_BYTES - peak_live


@contextlib.contextmanager
def _fake_model(cfg, device):
    """cfg's model built on fake tensors (nothing allocated), the RNG untouched."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode(), torch.random.fork_rng(devices=[]):
        with torch.device(device):
            model = build_model(cfg)
        yield model


def _static(cfg, device, B) -> Simulated:
    """The full model's params, buffers, grads and optimizer states (fake; no forward)."""
    with _fake_model(cfg, device) as model:
        params = [p for p in model.parameters() if p.requires_grad]
        opt, states = planned_optimizer(model, params, cfg, device)
        if opt is not None:
            for p in params:
                p.grad = torch.zeros_like(p)
            fake_step(opt)
            states = _bytes(tensors_of(opt.state))
        grads = sum(p.numel() * p.element_size() for p in params)
        pb, bb = _bytes(model.parameters()), _bytes(model.buffers()) + mask_bytes(model, cfg.train)
    return Simulated(pb + bb + states, pb, bb, grads, states, 0, 0, 0, [], 0)


# ------------------------------------------------------------------------------ what makes it fit
@dataclass
class Option:
    overrides: dict        # the config keys it sets
    slowdown: float        # estimated step-time factor (docs/memory.md)

    @property
    def name(self) -> str:
        """The overrides as train/run.py takes them on its command line."""
        return " ".join(f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in self.overrides.items())


def options(cfg, device) -> list[list[Option]]:
    """Groups of mutually exclusive options (one of each group may be chosen)."""
    t, o = cfg.train, cfg.optim
    groups = []
    if cfg.family == "llm" and not t.chunked_loss:
        groups.append([Option({"train.chunked_loss": True}, 1.0)])
    if t.precision == "fp32" and device.type == "cuda":
        groups.append([Option({"train.precision": "bf16"}, 0.6)])
    if o.name in ("adamw", "galore", "muon"):
        groups.append([Option({"optim.name": "adamw8bit"}, 1.05)]
                      + ([Option({"optim.name": "adamw_offload"}, 1.3)] if device.type == "cuda" else []))
    if device.type == "cuda" and not t.activation_offload:
        groups.append([Option({"train.activation_offload": True}, 1.2)])
    if t.activation_checkpointing in (False, "none"):
        groups.append([Option({"train.activation_checkpointing": "selective"}, 1.1),
                       Option({"train.activation_checkpointing": True, "train.activation_checkpointing_every": 2}, 1.15),
                       Option({"train.activation_checkpointing": True}, 1.3)])
    b = t.batch_size
    splits = [Option({"train.batch_size": b // k, "train.grad_accum": t.grad_accum * k}, 1.0 + 0.05 * math.log2(k))
              for k in (2 ** i for i in range(1, b.bit_length() if b != "auto" else 1)) if b % k == 0]
    if splits:
        groups.append(splits)
    return groups


def floor_bytes(cfg, target: torch.device, devices: int = 1, sharding: str = "ddp") -> int:
    """What no setting of the step itself changes: weights, buffers, gradients and optimizer states (fake tensors;
    fsdp2 shards all but the buffers; adamw_offload keeps the states in a CUDA device's host memory)."""
    cfg, sim, _, _ = for_target(cfg, target)
    key = (json.dumps(cfg.to_dict(), sort_keys=True, default=str), str(sim))
    if key not in _FLOORS:
        _FLOORS[key] = _static(cfg, sim, 1)
    s = _FLOORS[key]
    states = 0 if cfg.optim.name == "adamw_offload" and target.type == "cuda" else s.states
    return sum(n // (devices if sharding == "fsdp2" else 1) for n in (s.params, s.grads, states)) + s.buffers


_FLOORS: dict = {}  # (config, device) -> its `_static` (a refusal plans the configured run, then `fits` it again)


def fits(cfg, budget: int, devices: int = 1, sharding: str = "ddp", top: int = 5,
         device: Optional[torch.device] = None) -> list[tuple[float, list[str], Plan]]:
    """Up to `top` option combinations planned under `budget` bytes, cheapest first: [(slowdown, overrides, plan)]."""
    device = device or run_device(cfg)
    cfg = for_target(cfg, device)[0]  # the options of the precision it runs in there
    base = cfg.to_dict()
    picks = [[c for c in choice if c is not None] for choice in itertools.product(*[[None] + g for g in
                                                                                   options(cfg, device)])]
    combos = sorted(((math.prod(c.slowdown for c in p), p) for p in picks), key=lambda c: (c[0], len(c[1])))
    found, cache = [], {}
    for slowdown, picked in combos:
        if any({c.name for c in picked} <= set(f) for _, f, _ in found):
            continue  # a superset of a combination that already fits is never cheaper
        over = [tok for c in picked for tok in c.name.split()]
        key = tuple(sorted(over))
        if key not in cache:
            try:
                c = load_run_config(None, over, base=base)
            except ConfigError:
                continue
            cache[key] = plan(c, devices, sharding, device=device) \
                if floor_bytes(c, device, devices, sharding) <= budget else None  # a cheap bound first
        if (p := cache[key]) is not None and p.peak_bytes <= budget:
            found.append((slowdown, [c.name for c in picked], p))  # [] = as configured
            if len(found) >= top or not picked:
                break
    return found


# ------------------------------------------------------------------------------ a run far too big, refused
REFUSE_OVER = 1.5  # a run whose `floor_bytes` exceed this many times its memory is refused (train.ignore_plan)


def refusal(cfg, device: torch.device, devices: int = 1, sharding: str = "ddp") -> Optional[str]:
    """The one line refusing a run whose `floor_bytes` exceed REFUSE_OVER x its memory (train.memory_budget, else
    the device's free memory), before anything is allocated: the plan, the memory, the settings that fit (`fits`)
    or the devices that would shard it; None when it may start (or its architecture comes from train.init_from)."""
    t = cfg.train
    if t.ignore_plan or t.init_from:
        return None
    try:
        budget = parse_memory_size(t.memory_budget) if t.memory_budget else device_memory(device)
    except ValueError:  # no memory to read on this system
        return None
    try:
        need = floor_bytes(cfg, device, devices, sharding)
    except ConfigError:  # the builder says it in its own words (the weights' file, the key)
        return None
    if need <= REFUSE_OVER * budget:
        return None
    if found := fits(cfg, budget, devices, sharding, top=1, device=device):
        fix = f"it fits with {' '.join(found[0][1])} (planned peak {fmt_bytes(found[0][2].peak_bytes)})"
    else:
        n = math.ceil((floor_bytes(cfg, device) if devices > 1 else need) / budget)
        fix = (f"no setting fits one device: FSDP2 over at least {n} (train.parallel=fsdp under torchrun; "
               f"train/plan.py --devices {n} --sharding fsdp2 plans it)")
    where = "train.memory_budget" if t.memory_budget else f"free on {device}"
    return (f"{cfg.source}: the plan needs {fmt_bytes(need)} for the weights, gradients and optimizer states alone, "
            f"over {REFUSE_OVER}x the {fmt_bytes(budget)} {where}; {fix}; train.ignore_plan=true starts it anyway")


# ------------------------------------------------------------------------------ train.batch_size: auto
def _proc_bytes(path: str, key: str) -> Optional[int]:
    """The `key: N kB` line of a /proc file in bytes (None without it or the file)."""
    try:
        with open(path) as f:
            return next((int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":")), None)
    except OSError:
        return None


def device_memory(device: torch.device) -> int:
    """A step's memory when train.memory_budget is null: free memory on a GPU, MemAvailable on a CPU."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if (available := _proc_bytes("/proc/meminfo", "MemAvailable")) is None:
        raise ValueError("train.memory_budget: needed on this system (no /proc/meminfo to read the available memory)")
    return available


def auto_batch_size(cfg, model, task, device, out: Path, say, par=None) -> tuple[int, int]:
    """train.batch_size=auto in the loop: the resumed run's micro-batch (its config.yaml), else the largest that
    fits (find_batch_size), train.global_batch kept by accumulation; under torchrun the ranks' smallest."""
    import yaml
    t, world = cfg.train, par.world if par is not None and par.active else 1
    if t.resume and list_checkpoints(out) and (out / "config.yaml").is_file():
        was = (yaml.safe_load((out / "config.yaml").read_text()) or {}).get("train", {})
        if isinstance(was.get("batch_size"), int) and was.get("global_batch") == t.global_batch \
                and was["batch_size"] * was["grad_accum"] * world == t.global_batch:  # the same number of ranks
            say(f"batch size: auto -> micro-batch {was['batch_size']} x {was['grad_accum']}, as in the run being resumed")
            return was["batch_size"], was["grad_accum"]
    try:
        b, _ = find_batch_size(cfg, device, say, model, task, world, "fsdp2" if t.parallel == "fsdp" else "ddp")
    except ValueError as e:
        raise RunStopped(str(e), EXIT_CONFIG) from None
    if world > 1:
        found = par.gather(b)
        b = min(found)
        say(f"batch size: auto: each rank's micro-batch {found}; all {world} use {b}")
    return b, t.global_batch // (b * world)


def find_batch_size(cfg, device: torch.device, log, model: Optional[nn.Module] = None, task=None,
                    devices: int = 1, sharding: str = "ddp") -> tuple[int, int]:
    """train.batch_size=auto: (micro-batch, grad_accum) per rank of `devices`, the largest divisor of
    train.global_batch / devices whose planned peak per device (`sharding`) fits train.memory_budget (null:
    `device_memory`); `model`: plan its architecture. On CUDA the choice is tried, backing off on out-of-memory."""
    t = cfg.train
    if t.global_batch % devices:
        raise ValueError(f"train.global_batch={t.global_batch} is not a multiple of the {devices} processes")
    G = t.global_batch // devices
    if model is not None and getattr(model, "config", None) is not None:
        cfg = dataclasses.replace(cfg, model=model.config)
    if task is not None and t.precision == "auto":  # plan the precision the run resolved, not a new measurement
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, precision=precision_of(task.autocast_dtype)))
    budget = parse_memory_size(t.memory_budget) if t.memory_budget else device_memory(device)
    sizes = [d for d in range(1, G + 1) if G % d == 0]
    @functools.cache
    def peak(b):
        return plan(cfg, devices=devices, sharding=sharding, batch_size=b, device=device).peak_bytes

    # the planned peak grows with the micro-batch: bisect for the first size over the budget
    best = bisect.bisect_left(sizes, True, key=lambda b: peak(b) > budget) - 1
    if best < 0:
        raise ValueError(f"train.batch_size=auto: a micro-batch of 1 is planned at {fmt_bytes(peak(1))}, over "
                         f"train.memory_budget={fmt_bytes(budget)} (docs/memory.md: what else makes it fit)")
    if device.type == "cuda" and model is not None and task is not None:
        best = _try_on_cuda(cfg, model, task, device, sizes, best, log)
    b = sizes[best]
    nxt = f"; {sizes[best + 1]} would need {fmt_bytes(peak(sizes[best + 1]))}" if best + 1 < len(sizes) else ""
    log(f"batch size: auto -> micro-batch {b} x {G // b} accumulated{f' x {devices} ranks' if devices > 1 else ''} = "
        f"train.global_batch {G * devices} (planned peak {fmt_bytes(peak(b))} of {fmt_bytes(budget)}{nxt})")
    return b, G // b


def _try_on_cuda(cfg, model, task, device, sizes, best, log) -> int:
    """The largest size from sizes[best] down whose forward and backward run (with the optimizer's
    planned state held on the device); the model's weights, buffers and RNG are left as they were."""
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    params = [p for p in model.parameters() if p.requires_grad]
    states = _static(cfg, device, 1).states
    autocast = autocast_for(device, _precision(cfg, device))
    while best >= 0:
        b, hold = sizes[best], None
        try:
            with torch.random.fork_rng(devices=[device]):
                hold = torch.empty(states, dtype=torch.uint8, device=device)
                with autocast():
                    loss, _ = task.loss(model, task.example_batch(model, b))
                loss.backward()
            return best
        except torch.cuda.OutOfMemoryError:
            log(f"batch size: auto: micro-batch {b} ran out of memory on {device}; trying a smaller one")
            best -= 1
        finally:
            del hold
            for p in params:
                p.grad = None
            with torch.no_grad():
                for k, v in model.named_buffers():
                    v.copy_(buffers[k])
            torch.cuda.empty_cache()
    raise ValueError(f"train.batch_size=auto: even a micro-batch of {sizes[0]} runs out of memory on {device}")


# ------------------------------------------------------------------------------ measured, to check the plan
MEASURE_STEPS = 8


def measure(cfg) -> dict:
    """The measured CPU memory of `cfg`'s training in this process, along the loop's code path for MEASURE_STEPS:
    {start_rss (before the model), hwm (VmHWM after), peak (hwm - start_rss: what is planned), live (tensors kept)}."""
    import gc
    device = torch.device("cpu")
    if cfg.train.cpu_keep_memory is not False:  # null: on, as under train/run.py; else glibc's defaults
        keep_freed_memory()
    precision = _precision(cfg, device)
    with torch.device("meta"):  # the modules the model needs imported (torch._dynamo among them)
        build_model(cfg)
    gc.collect()
    start = _proc_bytes("/proc/self/status", "VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    model = build_model(cfg)
    task = task_class(cfg.family, cfg.source, cfg.data)(cfg, device, lambda m: None)
    task.autocast_dtype = amp_dtype(precision)
    ema = EMA(model, cfg.train.ema_decay) if cfg.train.ema_decay else None
    optimizer = build_optimizer(model, cfg.optim, device, lambda m: None)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    batch = task.example_batch(model, cfg.train.batch_size)
    params = [p for p in model.parameters() if p.requires_grad]
    autocast = autocast_for(device, precision)
    for _ in range(MEASURE_STEPS):
        optimizer_step(lambda b: task.loss(model, b), iter([batch]), 1, optimizer, scaler, params,
                       cfg.train.clip_grad, autocast)
        if ema is not None:
            ema.update(model)
    hwm = _proc_bytes("/proc/self/status", "VmHWM")
    kept = [*model.parameters(), *model.buffers(), *tensors_of(optimizer.state), *tree_flatten(batch)[0]]
    if ema is not None:
        kept += [*ema.model.parameters(), *ema.model.buffers()]
    return {"start_rss": start, "hwm": hwm, "peak": hwm - start, "live": _bytes(kept)}


def measure_in_subprocess(base: dict, overrides: list, threads: int = 0) -> dict:
    """`measure` in a fresh Python process: the run config `base` with `overrides`. Returns its dict."""
    import subprocess
    arg = json.dumps({"base": base, "overrides": list(overrides), "threads": threads})
    code = "import sys; from train.planner import measure_main; sys.exit(measure_main(sys.argv[1]))"
    out = subprocess.run([sys.executable, "-c", code, arg], cwd=Path(__file__).resolve().parents[1],
                         capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"measuring {overrides}: {out.stderr.strip().splitlines()[-1] if out.stderr.strip() else out.returncode}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure_main(arg: str) -> int:
    """measure_in_subprocess's side: measure the JSON `arg`'s config, print the result as JSON."""
    a = json.loads(arg)
    if a.get("threads"):
        torch.set_num_threads(a["threads"])
    print(json.dumps(measure(load_run_config(None, a["overrides"], base=a["base"]))))
    return 0


def fmt_bytes(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if abs(n) >= GiB else f"{n / MiB:.1f} MiB"
