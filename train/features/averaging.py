"""Checkpoint averaging (`train.average_last: K`): the last K checkpoints' weights averaged (`uniform`, or
`linear`: the newest counts most; floating-point tensors in fp32, others the newest's) into
`<out_dir>/model_avg.safetensors`, evaluated as `avg_*`. One-process and DCP checkpoints alike are read
back whole, so under torchrun rank 0 averages alone, no collective.
"""
from __future__ import annotations

from pathlib import Path

import torch

from zoo.weights.files import load_tensors, save_safetensors

AVG_FILE = "model_avg.safetensors"


def average_tensors(states: list[dict], weights: list[float]) -> dict:
    """Weighted average of state dicts (same keys), oldest first; weights are normalised."""
    total, out = sum(weights), {}
    for k, newest in states[-1].items():
        if newest.is_floating_point():
            acc = torch.zeros(newest.shape, dtype=torch.float32)
            for sd, w in zip(states, weights):
                acc.add_(sd[k].float(), alpha=w / total)
            out[k] = acc.to(newest.dtype)
        else:
            out[k] = newest.clone()
    return out


def checkpoint_weights(path: Path) -> dict:
    """The model weights of a checkpoint directory, whole, on the CPU: model.safetensors, or a DCP checkpoint's
    "model" entries (written by any number of ranks; their shapes and dtypes from its .metadata)."""
    path = Path(path)
    if (path / "model.safetensors").is_file():
        return load_tensors(path / "model.safetensors")
    if not (path / ".metadata").is_file():
        raise ValueError(f"{path}: holds neither model.safetensors nor a DCP checkpoint (.metadata)")
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    meta = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    sd = {k[len("model."):]: torch.empty(m.size, dtype=m.properties.dtype)
          for k, m in meta.items() if k.startswith("model.") and isinstance(m, TensorStorageMetadata)}
    if not sd:
        raise ValueError(f"{path / '.metadata'}: the DCP checkpoint holds no model tensors")
    dcp.load({"model": sd}, storage_reader=dcp.FileSystemReader(str(path)), no_dist=True)  # in place
    return sd


def tied_names(model: torch.nn.Module) -> list[list[str]]:
    """Groups of state-dict names that share one tensor (tied weights), in state-dict order."""
    groups = {}
    for k, v in model.state_dict().items():
        if v.numel():
            groups.setdefault((v.data_ptr(), v.shape), []).append(k)
    return [g for g in groups.values() if len(g) > 1]


def one_name_per_tie(sd: dict, tied: list[list[str]], names) -> dict:
    """A tied tensor under one name, its group's first in `names` (a DCP checkpoint stores it under each)."""
    for group in tied:
        keep, got = next((n for n in group if n in names), None), [n for n in group if n in sd]
        if keep is not None and got:
            sd.setdefault(keep, sd[got[0]])
            for n in got:
                if n != keep:
                    del sd[n]
    return sd


def average_last(out_dir, paths: list[Path], weighting: str = "uniform", tied: list[list[str]] = ()) -> Path:
    """Average the checkpoints `paths` (oldest first) into out_dir/model_avg.safetensors; `tied`
    (tied_names of the model) lets checkpoints of one process and of several be averaged together."""
    states = [checkpoint_weights(p) for p in paths]
    names = list(states[-1])
    states = [one_name_per_tie(sd, tied, names) for sd in states]
    keys = set(states[-1])
    for p, sd in zip(paths, states):
        if set(sd) != keys:
            raise ValueError(f"{p}: holds other tensors than {paths[-1]} (model changed?)")
    weights = [1.0] * len(paths) if weighting == "uniform" else [float(i + 1) for i in range(len(paths))]
    return save_safetensors(average_tensors(states, weights), Path(out_dir) / AVG_FILE)
