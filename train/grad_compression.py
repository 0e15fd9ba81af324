"""train.grad_compression: what DDP all-reduces, by torch's communication hooks
(torch.distributed.algorithms.ddp_comm_hooks): the gradient buckets cast to fp16 or bf16, or PowerSGD
(Vogels et al., "PowerSGD: Practical Low-Rank Gradient Compression for Distributed Optimization", 2019):
each matrix M all-reduced as factors P, Q of rank r (M ~ P Q^T), what that leaves out of a rank's gradient
added to its next one (error feedback), Q reused as the next step's start (warm start).

torch's PowerSGDState keys a rank's error and Q by DDP bucket, and DDP builds its buckets again after a
process's first step, so a resumed process meets other buckets than the ones checkpointed. `PowerSGD` keeps
them by parameter name across that rebuild and in checkpoints (one file per rank), so that a resumed run
continues bit for bit.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

from zoo.weights.files import fsync_file

STATE_FILE = "powersgd-rank{}.pt"  # in a DCP checkpoint: each rank's error feedback and Q


def attach(ddp, t, say):
    """Register train.grad_compression's hook on `ddp`; the PowerSGD object whose state checkpoints keep, or None."""
    if t.grad_compression == "none":
        return None
    if t.grad_compression != "powersgd":
        ddp.register_comm_hook(None, getattr(default_hooks, f"{t.grad_compression}_compress_hook"))
        say(f"grad_compression: gradients all-reduced in {t.grad_compression} (half the bytes of fp32)")
        return None
    hook = PowerSGD(ddp.module, t.powersgd_rank, t.powersgd_start, t.seed)
    ddp.register_comm_hook(hook.state, hook.hook)
    full, sent, n, k = hook.counts()
    say(f"grad_compression: powersgd rank {t.powersgd_rank} from step {t.powersgd_start + 1}: {k} of {n} gradient "
        f"matrices as factors, {full:,} -> {sent:,} numbers all-reduced per step ({full / sent:.2f}x)")
    return hook


class PowerSGD:
    """torch's powerSGD_hook, its per-rank state (error feedback, warm-start Q) kept by parameter name."""

    def __init__(self, model: torch.nn.Module, rank: int, start: int, seed: int):
        self.state = psgd.PowerSGDState(None, matrix_approximation_rank=rank, start_powerSGD_iter=start,
                                        random_seed=seed)
        self.params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.names = {p: n for n, p in self.params}
        self.layout: dict = {}   # bucket index -> (parameter names, their shapes), as DDP made the bucket
        self.pending = {"error": {}, "q": {}}  # by name: state to place in the next buckets that hold it
        self.synced, self.rebuilt = 0, False  # this process's all-reduced steps; DDP rebuilds its buckets after one

    def hook(self, state, bucket):  # (no annotation: DDP checks it against an object, not a string)
        if self.synced == 1 and not self.rebuilt:  # the buckets may be new: their state goes by name
            self.pending, self.layout, self.rebuilt = self.by_name(), {}, True
            for d in (state.error_dict, state.p_memory_dict, state.q_memory_dict):
                d.clear()
        i, buf = bucket.index(), bucket.buffer()
        self.layout[i] = names, shapes = [self.names[p] for p in bucket.parameters()], \
            [g.shape for g in bucket.gradients()]
        err, q, factors = self.pending["error"], self.pending["q"], self.factors(names, shapes)
        if names and all(n in err for n in names):
            state.error_dict[i] = torch.cat([err.pop(n).reshape(-1) for n in names]).to(buf)
        if factors and all(f[0] in q for f in factors):
            state.q_memory_dict[i] = torch.cat([q.pop(f[0]).reshape(-1) for f in factors]).to(buf)
            state.p_memory_dict[i] = buf.new_empty(sum(rows * r for _, rows, _, r in factors))
        self.synced += bucket.is_last()
        return psgd.powerSGD_hook(state, bucket)

    def factors(self, names, shapes) -> list:
        """The matrices torch compresses, in the order of its Q memory (grouped by shape): (name, rows, cols, rank)."""
        groups = {}
        for name, shape in zip(names, shapes):
            rows = shape[0] if len(shape) else 1
            cols = math.prod(shape) // rows
            r = min(rows, cols, self.state.matrix_approximation_rank)
            if psgd._should_compress(rows, cols, r, self.state.min_compression_rate)[0]:
                groups.setdefault((rows, cols), []).append((name, rows, cols, r))
        return [f for group in groups.values() for f in group]

    def counts(self) -> tuple[int, int, int, int]:
        """Numbers per step: every gradient's, those all-reduced (P and Q of a compressed matrix, else the
        gradient); matrices, compressed ones. Their ratio is torch's compression_stats() rate."""
        names, shapes = [n for n, _ in self.params], [p.shape for _, p in self.params]
        factors = self.factors(names, shapes)
        full = sum(math.prod(s) for s in shapes)
        saved = sum(rows * cols - (rows + cols) * r for _, rows, cols, r in factors)
        return full, full - saved, sum(len(s) > 1 for s in shapes), len(factors)

    def by_name(self) -> dict:
        """This rank's error feedback and Q by parameter name (views of torch's buffers; the unplaced ones too)."""
        out = {k: dict(v) for k, v in self.pending.items()}
        for i, (names, shapes) in self.layout.items():
            if i in self.state.error_dict:
                out["error"].update(zip(names, self.state.error_dict[i].split([math.prod(s) for s in shapes])))
            if i in self.state.q_memory_dict:
                factors = self.factors(names, shapes)
                out["q"].update(zip([f[0] for f in factors],
                                    self.state.q_memory_dict[i].split([cols * r for _, _, cols, r in factors])))
        return out

    def save(self, folder: Path, rank: int):
        f = folder / STATE_FILE.format(rank)
        torch.save({k: {n: t.to("cpu", copy=True) for n, t in v.items()} for k, v in self.by_name().items()}, f)
        fsync_file(f)

    def resume(self, folder: Path, step: int, same_world: bool, rank: int, say):
        """Continue after `step` from a checkpoint folder: this rank's state when the world size is the same."""
        self.state.iter, f = step, folder / STATE_FILE.format(rank)
        if same_world and f.is_file():
            self.pending = torch.load(f, map_location="cpu", weights_only=True)
        elif step > self.state.start_powerSGD_iter:
            say(f"grad_compression: {folder} holds no PowerSGD state of this world size: its error feedback "
                f"and factors start again")
