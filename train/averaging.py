"""Checkpoint averaging (`train.average_last: K`): the weights of the run's last K checkpoints,
averaged entry by entry, written to `<out_dir>/model_avg.safetensors` and evaluated beside the
final weights (the `avg_*` metrics). `uniform`: each checkpoint 1/K; `linear`: weights 1..K over
the checkpoints oldest to newest, normalised (the newest counts most). Floating-point tensors
are averaged in fp32 and stored in their own dtype; other tensors (counters) come from the
newest checkpoint. Works for every family: it only reads the checkpoints' model.safetensors.
"""
from __future__ import annotations

from pathlib import Path

import torch

from zoo.weights.files import load_tensors, save_safetensors

from . import checkpoint as ckpt

AVG_FILE = "model_avg.safetensors"


def average_tensors(states: list[dict], weights: list[float]) -> dict:
    """Weighted average of state dicts (same keys), oldest first; weights are normalised."""
    total = sum(weights)
    out = {}
    for k, newest in states[-1].items():
        if newest.is_floating_point():
            acc = torch.zeros(newest.shape, dtype=torch.float32)
            for sd, w in zip(states, weights):
                acc.add_(sd[k].float(), alpha=w / total)
            out[k] = acc.to(newest.dtype)
        else:
            out[k] = newest.clone()
    return out


def average_last(out_dir, k: int, weighting: str = "uniform") -> tuple[Path, list[Path]]:
    """Average the newest `k` checkpoints of out_dir into out_dir/model_avg.safetensors.
    Returns the file and the checkpoints averaged (fewer than k when the run wrote fewer)."""
    paths = list(reversed(ckpt.list_checkpoints(out_dir)[:k]))  # oldest first
    if not paths:
        raise ValueError(f"{Path(out_dir) / ckpt.CKPT_DIR}: no checkpoints to average")
    states = [load_tensors(p / "model.safetensors") for p in paths]
    keys = set(states[-1])
    for p, sd in zip(paths, states):
        if set(sd) != keys:
            raise ValueError(f"{p / 'model.safetensors'}: holds other tensors than {paths[-1]} (model changed?)")
    weights = [1.0] * len(paths) if weighting == "uniform" else [float(i + 1) for i in range(len(paths))]
    dest = Path(out_dir) / AVG_FILE
    save_safetensors(average_tensors(states, weights), dest)
    return dest, paths
