"""train.prune: the model's linears magnitude-pruned when the run is built (zoo/pruning.py); the
masks are held after every optimizer step by the run builder's step hook."""
from __future__ import annotations

from typing import Optional

from torch import nn

from zoo.pruning import prune, sparsity_of

from ..step import EXIT_CONFIG, RunStopped


def prune_linears(model: nn.Module, cfg, say) -> Optional[dict]:
    """train.prune: the model's linears magnitude-pruned in place; their masks (None without it)."""
    t = cfg.train
    if not t.prune:
        return None
    try:
        masks = prune(model, t.prune, t.prune_sparsity, t.prune_keep)
    except ValueError as e:
        raise RunStopped(f"{cfg.source}: train.prune={t.prune}: {e}", EXIT_CONFIG) from None
    n = sum(w.numel() for w, _ in masks.values())
    kind = f"unstructured {t.prune_sparsity:g}" if t.prune == "unstructured" else t.prune
    say(f"prune: {kind} magnitude pruning of {len(masks)} linears outside {', '.join(t.prune_keep)}: "
        f"{sparsity_of(masks):.1%} of their {n / 1e6:.2f}M weights zero, held after every optimizer step")
    return masks
