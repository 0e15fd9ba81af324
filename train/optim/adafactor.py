"""Adafactor (Shazeer & Stern, 2018) that also runs on FSDP2's sharded parameters.

torch.optim.Adafactor updates its factored statistics in place, which DTensor refuses. Here a sharded
parameter is stepped whole: gradient and weights gathered, torch's single-tensor update run with the
statistics held whole on every rank, each rank keeping its shard: one process's step. Parameters that
are not sharded take torch's step unchanged.
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim._adafactor import _single_tensor_adafactor
from torch.optim.optimizer import _get_scalar_dtype


class Adafactor(torch.optim.Adafactor):
    @torch.no_grad()
    def step(self, closure=None):
        if not any(isinstance(p, DTensor) for g in self.param_groups for p in g["params"]):
            return super().step(closure)
        with torch.enable_grad():
            loss = closure() if closure is not None else None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._step_whole(p, group)
        return loss

    def _step_whole(self, p, group):
        """One parameter's update on its gathered whole (DTensor) or on itself."""
        sharded = isinstance(p, DTensor)
        weight = p.full_tensor() if sharded else p
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        state = self.state[p]
        if not state:  # as torch.optim.Adafactor starts them, for the whole parameter
            state["step"] = torch.tensor(0.0, dtype=_get_scalar_dtype())
            if grad.dim() > 1:
                state["row_var"] = grad.new_zeros((*grad.shape[:-1], 1))
                state["col_var"] = grad.new_zeros((*grad.shape[:-2], 1, grad.shape[-1]))
            else:
                state["variance"] = torch.zeros_like(grad)
        eps1, eps2 = group["eps"]
        _single_tensor_adafactor([weight], [grad], [state.get("row_var")], [state.get("col_var")],
                                 [state.get("variance")], [state["step"]], None, None, d=group["d"], lr=group["lr"],
                                 beta2_decay=group["beta2_decay"], weight_decay=group["weight_decay"], eps1=eps1,
                                 eps2=eps2, maximize=group["maximize"], has_complex=False)
        if sharded:  # this rank's shard of the updated whole (no communication)
            p.to_local().copy_(distribute_tensor(weight, p.device_mesh, p.placements, src_data_rank=None).to_local())
