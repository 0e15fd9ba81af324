"""Muon on the hidden matrices, AdamW on the rest, as one optimizer (the split of the
modded-nanogpt recipe: Jordan et al., "Muon: An optimizer for hidden layers in neural networks", 2024).

`torch.optim.Muon` takes the hidden 2-D weights; AdamW the embeddings, head, norms, biases and convolutions.
`Chained` steps, saves and loads the two as one; Muon's LR follows the run's through `lr_scale`.
"""
from __future__ import annotations

import torch


class Chained:
    """Several optimizers over disjoint parameters, stepped, saved and loaded as one."""

    def __init__(self, optimizers: dict):
        self.optimizers = dict(optimizers)

    def __iter__(self):  # torch.distributed.checkpoint reads several optimizers' state as one
        return iter(self.optimizers.values())

    @property
    def param_groups(self) -> list[dict]:
        return [g for o in self.optimizers.values() for g in o.param_groups]

    @property
    def state(self) -> dict:
        return {p: s for o in self.optimizers.values() for p, s in o.state.items()}

    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for o in self.optimizers.values():
            o.step()
        return loss

    def zero_grad(self, set_to_none: bool = True):
        for o in self.optimizers.values():
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {name: o.state_dict() for name, o in self.optimizers.items()}

    def load_state_dict(self, state: dict):
        if set(state) != set(self.optimizers):
            raise ValueError(f"optimizer state holds {sorted(state)}, this run has {sorted(self.optimizers)}")
        for name, o in self.optimizers.items():
            o.load_state_dict(state[name])


def muon_with_adamw(hidden_groups: list[dict], other_groups: list[dict], lr: float, muon_lr: float, momentum: float,
                    betas, eps: float, fused: bool) -> Chained:
    """hidden_groups / other_groups: param groups (with their weight_decay) for Muon / AdamW."""
    opts = {"muon": torch.optim.Muon([dict(g, lr_scale=muon_lr / lr) for g in hidden_groups], lr=muon_lr,
                                     momentum=momentum)}
    if other_groups:
        opts["adamw"] = torch.optim.AdamW(other_groups, lr=lr, betas=tuple(betas), eps=eps, fused=fused)
    return Chained(opts)
