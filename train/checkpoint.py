"""Atomic checkpoints and exact resume.

A checkpoint is a directory `<out_dir>/checkpoints/step_XXXXXXXX/` holding
    model.safetensors   the weights (safetensors: no pickle); an adapter run's: only what trains
    ema.safetensors     the EMA weights, when the run keeps an EMA
    state.pt            optimizer, GradScaler, RNG states, step, task state (read back
                        with torch.load(weights_only=True): tensors and plain containers only)
    manifest.json       written last: step, and the size of every file, with the CRC-32 of those
                        that carry no checksum of their own (safetensors files carry theirs in
                        the header, state.pt in its zip records: zoo/weights/files.py checks both)
It is written into a temporary directory, every file fsynced, then renamed into place, so
a run killed at any moment leaves either a complete checkpoint or none. Resume takes the
newest checkpoint whose manifest, sizes and checksums all hold, and falls back to older
ones (naming the bad one) otherwise. The last `keep` checkpoints are kept.
A run of several processes (train/distributed.py) writes a sharded checkpoint instead (`save_dcp`):
DCP's files (.metadata, one __<rank>_0.distcp per rank) beside rank 0's state.pt (step, every
rank's RNG state, GradScaler, extra), with "format": "dcp" in the manifest, sealed and renamed by
`publish` as here; `load_checkpoint` reads either kind. DCP reshards on load, so a checkpoint of
N ranks resumes on M ranks, one process included (without a process group). `par` below is the
run's train.distributed.Parallel (rank, world, broadcast, gather, barrier), or None in one process.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import time
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from zoo.weights.files import (check_weight_file, file_crc32, fsync_dir, fsync_file, load_tensors,
                               save_safetensors, self_checked)

CKPT_DIR = "checkpoints"
PREFIX = "step_"
REQUIRED = ("model.safetensors", "state.pt")
REQUIRED_DCP = (".metadata", "state.pt")  # a sharded checkpoint (train/distributed.py)


def rng_state() -> dict:
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {"key": np_state[0], "pos": int(np_state[2]), "has_gauss": int(np_state[3]),
                  "cached_gaussian": float(np_state[4]), "state": torch.from_numpy(np_state[1].astype(np.int64))},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict):
    random.setstate(_tuplify(state["python"]))
    n = state["numpy"]
    np.random.set_state((n["key"], n["state"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _tuplify(x):
    return tuple(_tuplify(v) for v in x) if isinstance(x, (list, tuple)) else x


def list_checkpoints(out_dir) -> list[Path]:
    """Complete-looking checkpoint directories, newest first."""
    root = Path(out_dir) / CKPT_DIR
    if not root.is_dir():
        return []
    dirs = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and p.name[len(PREFIX):].isdigit()]
    return sorted(dirs, key=lambda p: int(p.name[len(PREFIX):]), reverse=True)


def set_aside(out_dir) -> Path:
    """Move the checkpoints of a previous run out of the way (train.resume=false): a fresh run
    must neither resume from them nor have its own checkpoints rotated away by their higher steps."""
    root = Path(out_dir) / CKPT_DIR
    stamp = time.strftime("%Y%m%d-%H%M%S")
    dest = root.with_name(f"{CKPT_DIR}.old-{stamp}")
    n = 1
    while dest.exists():
        n += 1
        dest = root.with_name(f"{CKPT_DIR}.old-{stamp}-{n}")
    os.replace(root, dest)
    fsync_dir(root.parent)
    return dest


def save_checkpoint(out_dir, step: int, model, optimizer, scaler=None, ema=None, extra: Optional[dict] = None,
                    keep: int = 2, keys: Optional[set] = None) -> Path:
    """keys: the state-dict names to write (an adapter run: what trains); None = the whole model."""
    root = Path(out_dir) / CKPT_DIR
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{PREFIX}{step:08d}"
    tmp = root / f".tmp-{PREFIX}{step:08d}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    save_safetensors(model if keys is None else _subset(model, keys), tmp / "model.safetensors")
    if ema is not None:
        save_safetensors(ema if keys is None else _subset(ema, keys), tmp / "ema.safetensors")
    state = {"step": step, "optimizer": optimizer.state_dict(), "rng": rng_state(), "extra": extra or {}}
    if scaler is not None:
        state["scaler"] = scaler.state_dict()
    torch.save(state, tmp / "state.pt")
    publish(out_dir, tmp, final, step, keep, os.getpid())
    return final


def publish(out_dir, tmp: Path, final: Path, step: int, keep: int, tag, fmt: Optional[str] = None):
    """Seal a fully written temporary checkpoint directory: fsync every file, write the manifest
    (the size of each, the CRC-32 of those without a checksum of their own) last, rename it to `final`, drop the checkpoints beyond the newest
    `keep` and the temporary directories of killed writers (those not ending in -`tag`).
    fmt: "dcp" for a sharded checkpoint (train/distributed.py); None: the one-process layout."""
    root = final.parent
    files = {}
    for f in sorted(tmp.iterdir()):
        fsync_file(f)
        files[f.name] = {"size": f.stat().st_size, **({} if self_checked(f) else {"crc32": file_crc32(f)})}
    manifest = tmp / "manifest.json"
    manifest.write_text(json.dumps({"step": step, **({"format": fmt} if fmt else {}), "files": files}, indent=1))
    fsync_file(manifest)
    fsync_dir(tmp)
    if final.exists():  # a re-save of the same step (e.g. after a resume): replace it
        old = root / f".old-{final.name}-{tag}"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    fsync_dir(root)
    for stale in list_checkpoints(out_dir)[keep:]:
        shutil.rmtree(stale, ignore_errors=True)
    for leftover in root.glob(".tmp-*"):  # temporary directories of killed writers
        if not leftover.name.endswith(f"-{tag}"):
            shutil.rmtree(leftover, ignore_errors=True)


def verify_checkpoint(path: Path) -> dict:
    """Return the manifest if every file is present with the recorded size and checksum;
    otherwise raise ValueError naming the checkpoint and the problem."""
    man = path / "manifest.json"
    if not man.is_file():
        raise ValueError(f"{path}: no manifest.json (incomplete write)")
    try:
        manifest = json.loads(man.read_text())
        files = manifest["files"]
        sizes = {name: int(meta["size"]) for name, meta in files.items()}
        sums = {name: str(meta["crc32"]) for name, meta in files.items() if "crc32" in meta}
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError):
        raise ValueError(f"{man}: unreadable manifest") from None
    for name in (REQUIRED_DCP if manifest.get("format") == "dcp" else REQUIRED):
        if name not in files:
            raise ValueError(f"{man}: does not list {name}")
    for name in files:
        f = path / name
        if not f.is_file() or f.parent != path:
            raise ValueError(f"{f}: missing")
        if f.stat().st_size != sizes[name]:
            raise ValueError(f"{f}: size {f.stat().st_size} != {sizes[name]} recorded (truncated?)")
        if name in sums and file_crc32(f) != sums[name]:
            raise ValueError(f"{f}: checksum mismatch (corrupt)")
        if self_checked(f):
            check_weight_file(f)  # its own checksum
    return manifest


class CheckpointError(ValueError):
    """No usable checkpoint: one line naming the directory and the reason."""


def read_state(path: Path) -> dict:
    """state.pt through torch.load(weights_only=True): tensors and plain containers only, so a
    file carrying a pickled object (code run on load) is refused without running it."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - unpickling refused, truncated zip, ...: one line
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ValueError(f"{path}: refused or unreadable ({type(e).__name__}: {first[:200]})") from None
    if not isinstance(state, dict) or not isinstance(state.get("step"), int) or "rng" not in state:
        raise ValueError(f"{path}: not a Zoo loop state (no step / rng)")
    return state


def _subset(model: torch.nn.Module, keys: set) -> dict:
    return {k: v for k, v in model.state_dict().items() if k in keys}


def read_weights(path: Path, model: torch.nn.Module, keys: Optional[set] = None) -> dict:
    """The tensors of a checked weight file, matched name by name and shape by shape against `model`
    (against its `keys` only, when given)."""
    sd = load_tensors(path)
    want = model.state_dict() if keys is None else _subset(model, keys)
    # tied tensors (one storage, several names) are stored once by save_model: any one name will do
    storage = {k: v.data_ptr() if v.numel() else k for k, v in want.items()}
    names_of = {}
    for k, ptr in storage.items():
        names_of.setdefault(ptr, []).append(k)
    missing = [k for k in want if not any(n in sd for n in names_of[storage[k]])]
    unexpected = [k for k in sd if k not in want]
    if missing or unexpected:
        raise ValueError(f"{path}: does not match the model ({len(missing)} missing e.g. {missing[:2]}, "
                         f"{len(unexpected)} unexpected e.g. {unexpected[:2]}); did the model config change?")
    for k, v in sd.items():
        if v.shape != want[k].shape:
            raise ValueError(f"{path}: {k} has shape {tuple(v.shape)}, the model has {tuple(want[k].shape)}")
    return sd


def load_checkpoint(path: Path, model, optimizer=None, scaler=None, ema=None, keys: Optional[set] = None,
                    before_optimizer=None, par=None, seed: int = 0) -> dict:
    """Load a verified checkpoint into the given objects; returns the state dict (step, extra).
    Every file is read and checked before anything is loaded, so a bad checkpoint changes nothing.
    keys: as for save_checkpoint. before_optimizer(state): called before the optimizer state is
    loaded (e.g. to give the optimizer the parameter groups it had at that step)."""
    manifest = verify_checkpoint(path)
    if manifest.get("format") == "dcp":
        return _load_sharded(path, manifest, model, optimizer, scaler, ema, before_optimizer, par, seed)
    if par is not None and par.active:
        raise ValueError(f"{path}: written by one process; a run under torchrun resumes from sharded "
                         f"checkpoints only (resume it in one process, or start in another train.out_dir)")
    weights = read_weights(path / "model.safetensors", model, keys)
    ema_weights = read_weights(path / "ema.safetensors", ema, keys) \
        if ema is not None and (path / "ema.safetensors").is_file() else None
    state = read_state(path / "state.pt")
    if state["step"] != manifest.get("step"):
        raise ValueError(f"{path / 'state.pt'}: step {state['step']} != {manifest.get('step')} in the manifest")
    model.load_state_dict(weights, strict=False)
    if ema_weights is not None:
        ema.load_state_dict(ema_weights, strict=False)
    elif ema is not None:  # an EMA switched on for a run that had none: it starts from the resumed weights
        ema.load_state_dict(weights, strict=False)
        state["ema_started"] = True
    if before_optimizer is not None:
        before_optimizer(state)
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    if scaler is not None and "scaler" in state:
        scaler.load_state_dict(state["scaler"])
    set_rng_state(state["rng"])
    return state


def _load_sharded(path, manifest, model, optimizer, scaler, ema, before_optimizer, par, seed) -> dict:
    """A DCP checkpoint of any number of ranks, into this run (one process or many)."""
    if before_optimizer is not None:
        before_optimizer(read_state(path / "state.pt"))
    state = load_dcp(par, path, model, optimizer, scaler, ema, seed)
    if state["step"] != manifest.get("step"):
        raise ValueError(f"{path / 'state.pt'}: step {state['step']} != {manifest.get('step')} in the manifest")
    return state


def resume_latest(out_dir, model, optimizer=None, scaler=None, ema=None, log=print, keys: Optional[set] = None,
                  before_optimizer=None, par=None, seed: int = 0) -> Optional[dict]:
    """Resume from the newest complete, uncorrupted checkpoint; None if there is none.
    When checkpoints exist but none is usable, raise CheckpointError rather than start over
    (starting over would rotate them away: nothing is deleted without the user saying so)."""
    paths = list_checkpoints(out_dir)
    if par is not None and par.active:  # rank 0 picks the checkpoint, every rank loads it (collectively)
        found, paths = par.broadcast((len(paths), _first_verified(paths, log)) if par.main else None)
        if found and not paths:
            raise CheckpointError(f"{Path(out_dir) / CKPT_DIR}: none of the {found} checkpoints is usable (see "
                                  f"log.txt); move them away or set train.resume=false to start over")
        for path in paths:
            try:
                state = load_checkpoint(path, model, optimizer, scaler, ema, keys, before_optimizer, par, seed)
            except ValueError as e:
                raise CheckpointError(str(e).splitlines()[0]) from None
            log(f"resumed from {path} (step {state['step']})"
                + (" written by {} processes, resharded to {}".format(*state["resharded"])
                   if "resharded" in state else ""))
            return dict(state, path=str(path))
        return None
    for path in paths:
        try:
            state = load_checkpoint(path, model, optimizer, scaler, ema, keys, before_optimizer, par, seed)
        except Exception as e:  # noqa: BLE001 - corrupt or truncated: say which, try the previous one
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            log(f"checkpoint {path} is unusable ({msg}); falling back to the previous one")
            continue
        log(f"resumed from {path} (step {state['step']})"
            + (" written by {} processes, resharded to {}".format(*state["resharded"]) if "resharded" in state else ""))
        state["path"] = str(path)
        return state
    if paths:
        raise CheckpointError(f"{Path(out_dir) / CKPT_DIR}: none of the {len(paths)} checkpoints is usable (see "
                              f"log.txt); move them away or set train.resume=false to start over")
    return None


def _first_verified(paths: list, log) -> list:
    """[the newest checkpoint that verifies] (the others named in the log), or [] when none does."""
    for path in paths:
        try:
            verify_checkpoint(path)
            return [path]
        except ValueError as e:
            log(f"checkpoint {path} is unusable ({e}); falling back to the previous one")
    return []


# ------------------------------------------------------------------------------ DCP checkpoints
def _dcp_state(model, optimizer, ema) -> dict:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict
    msd, osd = get_state_dict(model, optimizer)
    state = {"model": msd, "optimizer": osd}
    if ema is not None:
        state["ema"] = get_model_state_dict(ema)
    return state


def save_dcp(par, out_dir, step: int, model, optimizer, scaler=None, ema=None,
             extra: Optional[dict] = None, keep: int = 2) -> Path:
    """Every rank writes its shards into one temporary directory; rank 0 adds state.pt and the
    manifest and renames it into place (publish). Collective."""
    import torch.distributed.checkpoint as dcp

    root = Path(out_dir) / CKPT_DIR
    tag = par.broadcast(os.getpid())  # one temporary name for all ranks: rank 0's pid
    tmp = root / f".tmp-{PREFIX}{step:08d}-{tag}"
    if par.main:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    par.barrier()
    dcp.save(_dcp_state(model, optimizer, ema), storage_writer=dcp.FileSystemWriter(str(tmp), sync_files=True))
    rngs = par.gather(rng_state())
    final = root / f"{PREFIX}{step:08d}"
    if par.main:
        state = {"step": step, "rng": rngs[0], "rng_ranks": rngs, "world_size": par.world,
                 "has_ema": ema is not None, "extra": extra or {}}
        if scaler is not None:
            state["scaler"] = scaler.state_dict()
        torch.save(state, tmp / "state.pt")
        publish(out_dir, tmp, final, step, keep, tag, fmt="dcp")
    par.barrier()  # nobody goes on (or is killed as done) before the checkpoint is in place
    return final


def load_dcp(par, path: Path, model, optimizer=None, scaler=None, ema=None, seed: int = 0) -> dict:
    """Load a verified DCP checkpoint written by any number of ranks into this run (collective
    when distributed; works in one process without a process group: par None)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    state = read_state(path / "state.pt")
    with_ema = ema is not None and state.get("has_ema", False)
    sd = _dcp_state(model, optimizer, ema if with_ema else None)
    dcp.load(sd, storage_reader=dcp.FileSystemReader(str(path)))
    set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optimizer"])
    if ema is not None:  # an EMA switched on for a run that had none starts from the resumed weights
        set_model_state_dict(ema, sd["ema"] if with_ema else sd["model"])
        state["ema_started"] = not with_ema
    if scaler is not None and "scaler" in state:
        scaler.load_state_dict(state["scaler"])
    rngs = state.get("rng_ranks") or [state["rng"]]
    rank, world = (par.rank, par.world) if par is not None and par.active else (0, 1)
    if len(rngs) == world:
        set_rng_state(rngs[rank])
    else:  # resharded: rank 0 continues rank 0's stream, the others start fresh ones
        set_rng_state(rngs[0])
        if par is not None:
            par.seed_rank(seed)
        state["resharded"] = (len(rngs), world)
    return state
