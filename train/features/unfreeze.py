"""Gradual unfreezing (Howard & Ruder, "Universal Language Model Fine-tuning for Text
Classification", 2018): train the head first, then unfreeze the blocks from the top down.

`train.unfreeze: [s1, s2, ...]`: the steps at which the next of the task's `unfreeze_groups`
becomes trainable (groups past the list stay frozen). Each unfrozen group is added to the
optimizer (`add_param_groups`), so optimizer state exists only for what has trained; a resume
replays the additions before loading the optimizer state (`restore`).
"""
from __future__ import annotations

from torch import nn


def add_param_groups(optimizer, model: nn.Module, params: list, weight_decay: float, layer_decay=None):
    """Add `model`'s newly trainable `params` to `optimizer`, split as it was built (weight decay, layer-wise LR),
    each new group with the optimizer's defaults for the other hyperparameters."""
    from ..optim import param_groups
    new = {id(p) for p in params}
    for g in param_groups(model, weight_decay, layer_decay):
        if ps := [p for p in g["params"] if id(p) in new]:
            optimizer.add_param_group({**g, "params": ps, "lr": optimizer.param_groups[0]["lr"]})


class GradualUnfreezing:
    def __init__(self, model: nn.Module, groups: list[list[nn.Parameter]], steps: list[int], weight_decay: float,
                 log=print, layer_decay=None):
        if len(groups) < 2:
            raise ValueError("gradual unfreezing needs at least two parameter groups")
        # a tied tensor belongs to the first (topmost) group that names it; what the model keeps frozen (a
        # latent diffusion model's autoencoder) stays frozen, and DDP and FSDP2 wrapped it as frozen
        seen, self.groups = {id(p) for p in model.parameters() if not p.requires_grad}, []
        for g in groups:
            g = [p for p in g if id(p) not in seen]
            seen.update(id(p) for p in g)
            self.groups.append(g)
        self.model, self.steps, self.weight_decay, self.log = model, list(steps), weight_decay, log
        self.layer_decay = layer_decay
        model.requires_grad_(False)
        for p in self.groups[0]:
            p.requires_grad_(True)
        self.n = 1  # groups trainable now
        log(f"unfreeze: {len(self.groups)} groups, the first (head) trains from step 0; the next at steps "
            f"{', '.join(map(str, self.steps[:len(self.groups) - 1]))}")

    def stage(self, step: int) -> int:
        """How many groups train at (0-based) step `step`."""
        return min(len(self.groups), 1 + sum(s <= step for s in self.steps))

    def advance(self, step: int, optimizer):
        """Unfreeze the groups due by `step` and add them to the optimizer."""
        while self.n < self.stage(step):
            g = self.groups[self.n]
            for p in g:
                p.requires_grad_(True)
            add_param_groups(optimizer, self.model, g, self.weight_decay, self.layer_decay)
            self.n += 1
            self.log(f"unfreeze: step {step}: group {self.n} of {len(self.groups)} trainable "
                     f"({sum(p.numel() for p in g) / 1e6:.3f}M parameters)")

    def restore(self, optimizer, step: int):
        """On resume: the groups (and optimizer groups) as they were when step `step` was saved."""
        self.advance(max(step - 1, 0), optimizer)
