"""Tensor and pipeline parallelism of the LLM, applied from outside the model (it exposes its repeated units):

    tp       each block's attention heads and MLP width split over the processes (DTensor's parallelize_module:
             q/k/v and gate/up column-wise, the output and down projections row-wise), its norms sequence-parallel
    fsdp+tp  the same within groups of train.tp_size processes, FSDP2 over the groups (a 2-D mesh, as torchtitan)
    pp       the blocks in consecutive stages, one per process (torch.distributed.pipelining, 1F1B schedule)

The fused projections (`qkv`, `gate_up`) are one matrix whose rows are segments (q, k, v heads; gate, up):
column-wise sharding needs each rank's part of every segment in one contiguous chunk, so their rows are held
rank-major while training, and put back in the model's order in every saved state (`Fused`).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from zoo.blocks.chunked_ce import chunked_cross_entropy
from zoo.config import RECURRENT_TYPES
from zoo.blocks.norm import RMSNorm


def refusal(cfg, world: int) -> Optional[str]:
    """Why cfg cannot run with train.parallel=tp / fsdp+tp / pp on `world` processes, naming the key (None: it can).
    Covered: the dense LLM's pretraining (GQA, windows, soft-caps, biases), AdamW or SGD, fp32 or bf16."""
    t, m, how = cfg.train, cfg.model, f"train.parallel={cfg.train.parallel}"
    if cfg.family != "llm":
        return f"{how} splits LLM blocks; family={cfg.family} runs with ddp or fsdp"
    tp, ways = t.parallel != "pp", t.tp_size if t.parallel == "fsdp+tp" else world
    if world % ways:
        return f"train.tp_size={ways} does not divide the {world} processes ({how})"
    sizes = {"model.n_heads": m.n_heads, "model.n_kv_heads": m.resolved_n_kv_heads,
             "model.ffn_hidden": m.resolved_ffn_hidden} if tp else {"model.n_layers": m.n_layers}
    features = {"model.moe": m.moe is not None, "model.mla": m.mla is not None, "model.mod_capacity": m.mod_capacity,
                "model.value_embeds": m.value_embeds, "model.unet_skips": m.unet_skips,
                "model.mlp": tp and m.mlp != "swiglu",
                "adapter.method": cfg.adapter.enabled, "train.ema_decay": t.ema_decay, "train.compile": t.compile,
                "train.teacher": t.teacher, "train.qat": t.qat, "train.prune": t.prune, "train.unfreeze": t.unfreeze,
                "train.float8": t.float8, "train.precision": t.precision in ("fp16", "bf16-pure"),
                "train.lr_find": t.lr_find,
                "train.batch_size": t.batch_size == "auto", "data.format": cfg.data.format != "text",
                "model.qk_norm": tp and m.qk_norm, "model.attn_sinks": tp and m.attn_sinks,
                "model.attn_gate": tp and m.attn_gate, "model.layer_types": tp and bool(RECURRENT_TYPES & set(m.layer_types)),
                "model.final_softcap": not tp and m.final_softcap is not None,
                "model.kv_shared_layers": m.kv_shared_layers, "model.per_layer_dim": m.per_layer_dim,
                "model.global_head_dim": tp and (m.global_head_dim or m.global_n_kv_heads or m.global_kv_same)}
    if key := next((k for k, on in features.items() if on), None):
        return f"{key} does not combine with {how} (it covers the dense LLM's pretraining; use ddp or fsdp)"
    if not tp and isinstance(t.batch_size, int) and t.batch_size % t.pp_microbatches:
        return f"train.pp_microbatches={t.pp_microbatches} does not divide train.batch_size={t.batch_size} ({how})"
    if key := next((k for k, n in sizes.items() if n % ways), None):
        return f"{key}={sizes[key]} does not divide over {ways} {'tensor-parallel ranks' if tp else 'stages'} ({how})"
    return None


# ------------------------------------------------------------------------------ tensor parallelism
class Fused:
    """The fused projections' rows: {parameter name: segment sizes}, held rank-major over `ways` ranks in training."""

    def __init__(self, ways: int):
        self.ways, self.sizes = ways, {}

    def rank_major(self, t: torch.Tensor, sizes, back: bool = False) -> torch.Tensor:
        """Rows [seg_0; seg_1; ...] -> [seg_0 part 0; seg_1 part 0; ...; seg_0 part 1; ...] (back: the inverse)."""
        n = self.ways
        if back:
            parts = [c.split([s // n for s in sizes]) for c in t.chunk(n)]
            return torch.cat([parts[r][i] for i in range(len(sizes)) for r in range(n)])
        segs = [s.chunk(n) for s in t.split(sizes)]
        return torch.cat([seg[r] for r in range(n) for seg in segs])

    def hold(self, name: str, p: nn.Parameter, sizes: list):
        self.sizes[name] = sizes
        with torch.no_grad():
            p.copy_(self.rank_major(p, sizes))

    def saved(self, state: dict, back: bool = True) -> dict:
        """A full state (model: {name: tensor}; optimizer: {"state": {name: {k: tensor}}}) in the model's row order
        (back=False: in the training order)."""
        def fix(name, v):
            ok = name in self.sizes and torch.is_tensor(v) and v.dim() and v.shape[0] == sum(self.sizes[name])
            return self.rank_major(v, self.sizes[name], back) if ok else v
        return {k: {n: {s: fix(n, x) for s, x in d.items()} for n, d in v.items()}  # an optimizer's state by name
                if k == "state" and isinstance(v, dict) else fix(k, v) for k, v in state.items()}


def apply_tp(model: nn.Module, mesh) -> Fused:
    """Megatron's split of every block over the 1-D `mesh`, in place: attention heads and MLP width column-wise then
    row-wise, norms sequence-parallel (the residual stream between blocks stays split along the sequence)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                                   RowwiseParallel, SequenceParallel, parallelize_module)
    fused, names, n = Fused(mesh.size()), {m: k for k, m in model.named_modules()}, mesh.size()
    units = model.repeated_units()
    seq, whole = Shard(1), Replicate()
    for block in units:
        a, m = block.attn, block.mlp
        qkv = [a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim, a.n_kv_heads * a.head_dim]
        for mod, sizes in ((a.qkv, qkv), (m.gate_up, [m.hidden, m.hidden])):
            for k, p in mod.named_parameters():
                fused.hold(f"{names[mod]}.{k}", p, sizes)
        a.n_heads, a.n_kv_heads = a.n_heads // n, a.n_kv_heads // n  # the heads this rank computes
        norms = {k: SequenceParallel(use_local_output=True) for k, c in block.named_children()
                 if isinstance(c, RMSNorm)}  # LayerNorm too (a subclass)
        parallelize_module(block, mesh, {
            **norms,
            "attn": PrepareModuleInput(input_layouts=(seq, *[None] * 5), desired_input_layouts=(whole, *[None] * 5)),
            "attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel(output_layouts=seq),
            "mlp": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(whole,)),
            "mlp.gate_up": ColwiseParallel(), "mlp.down": RowwiseParallel(output_layouts=seq)})
    parallelize_module(units[0], mesh, PrepareModuleInput(  # x, cos, sin: x split along the sequence
        input_layouts=(whole, None, None), desired_input_layouts=(seq, None, None), use_local_output=True))
    parallelize_module(units[-1], mesh, PrepareModuleOutput(  # (x, MoE stats): x whole again
        output_layouts=(seq, None), desired_output_layouts=(whole, None), use_local_output=True))
    return fused


# ------------------------------------------------------------------------------ pipeline parallelism
class Stage(nn.Module):
    """Stage `index` of `count` of the LLM: consecutive blocks (the first stage embeds, the last normalises and holds
    the LM head, which the loss reads). Its modules are the model's own: the model is what is checkpointed."""

    def __init__(self, model: nn.Module, index: int, count: int):
        super().__init__()
        per = len(model.layers) // count
        self.first, self.last, self.lo = index == 0, index == count - 1, index * per
        self.layers = nn.ModuleList(model.layers[self.lo:self.lo + per])
        self.embed = model.embed if self.first else None
        self.norm, self.head = (model.norm, model.lm_head) if self.last else (None, None)
        object.__setattr__(self, "model", model)  # for its helpers, not a submodule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.model
        if self.first:
            x = m.embed_tokens(x)
        tables = m.rope_tables(x, x.shape[1])
        for i, layer in enumerate(self.layers, self.lo):
            x, _ = layer(x, *tables[m.config.is_local(i)])
        return m.final_norm(x) if self.last else x


class Pipeline:
    """The LLM's stages over the processes, run by a 1F1B schedule of `micro` micro-batches per call."""

    def __init__(self, model: nn.Module, rank: int, world: int, micro: int, device):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B
        self.model, self.rank, self.world, self.device = model, rank, world, device
        self.stage = Stage(model, rank, world)
        # each weight's rank (a tied embedding: the first stage's, the last trains it too)
        self.owner = {id(p): r for r in reversed(range(world)) for p in Stage(model, r, world).parameters()}
        self.tied = model.lm_head.weight if model.config.tie_embeddings else None
        ends = self.tied is not None and world > 1  # the group that sums the tie's gradient (made on every rank)
        self.ends = dist.new_group([0, world - 1]) if ends else None
        mine = {id(p) for p in self.stage.parameters()}
        for p in model.parameters():
            p.requires_grad_(id(p) in mine)
        self.scale, self.micro = 1.0, micro  # the gradients scaled in the loss (the schedule's scaling would
        # scale what earlier micro-batches of the optimizer step accumulated too)
        self.schedule = Schedule1F1B(PipelineStage(self.stage, rank, world, device), micro, loss_fn=self._loss,
                                     scale_grads=False)

    def _loss(self, h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        m = self.model
        if m.chunked_loss:
            loss = chunked_cross_entropy(h.flatten(0, 1), m.lm_head.weight, y.flatten(), m.loss_chunk_size)
        else:
            loss = F.cross_entropy(m.logits(h).float().flatten(0, 1), y.flatten(), ignore_index=-100)
        return loss * (self.scale / self.micro)

    def __call__(self, batch, scale: float = 1.0) -> tuple:
        """Forward and backward of micro-batch (x, y), the gradients times `scale` -> (its mean loss on every rank,
        its tokens)."""
        (x, y), losses = batch, []
        self.scale = scale
        if self.stage.first:
            self.schedule.step(x, target=y if self.stage.last else None, losses=losses)
        else:
            self.schedule.step(target=y, losses=losses)
        loss = torch.stack(losses).sum() / scale if losses else torch.zeros((), device=x.device)
        dist.broadcast(loss, src=self.world - 1)
        return loss.detach(), y.numel()

    def finish_grads(self, params: list, clip: Optional[float]) -> torch.Tensor:
        """The tied embedding's gradient summed over its two stages; the global norm over the stages (the tie counted
        once), the gradients clipped to `clip` when set."""
        if self.ends is not None and (self.stage.first or self.stage.last):
            if self.tied.grad is None:
                self.tied.grad = torch.zeros_like(self.tied)
            dist.all_reduce(self.tied.grad, group=self.ends)
        grads = [p.grad for p in params if p.grad is not None and self.owner[id(p)] == self.rank]
        sq = torch.nn.utils.get_total_norm(grads).square() if grads else torch.zeros((), device=self.device)
        dist.all_reduce(sq)
        norm = sq.sqrt()
        if clip:
            torch.nn.utils.clip_grads_with_norm_(params, clip, norm)
        return norm

    def sync(self):
        """Every rank's copy of the whole model made current: each stage's weights broadcast from its rank."""
        for p in self.model.parameters():
            dist.broadcast(p.data, src=self.owner[id(p)])
