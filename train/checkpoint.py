"""Atomic checkpoints and exact resume.

A checkpoint is a directory `<out_dir>/checkpoints/step_XXXXXXXX/` holding
    model.safetensors   the weights (safetensors: no pickle)
    ema.safetensors     the EMA weights, when the run keeps an EMA
    state.pt            optimizer, GradScaler, RNG states, step, task state (read back
                        with torch.load(weights_only=True): tensors and plain containers only)
    manifest.json       written last: step, and the size and sha256 of every file
It is written into a temporary directory, every file fsynced, then renamed into place, so
a run killed at any moment leaves either a complete checkpoint or none. Resume takes the
newest checkpoint whose manifest, sizes and checksums all hold, and falls back to older
ones (naming the bad one) otherwise. The last `keep` checkpoints are kept.
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from safetensors.torch import load_model, save_model

CKPT_DIR = "checkpoints"
PREFIX = "step_"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_file(path: Path):
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path):
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_save_model(model: torch.nn.Module, path: Path):
    """model -> safetensors at `path`, through a temporary file and a rename."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    save_model(model, str(tmp))
    _fsync_file(tmp)
    os.replace(tmp, path)
    _fsync_dir(path.parent)


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


def save_checkpoint(out_dir, step: int, model, optimizer, scaler=None, ema=None, extra: Optional[dict] = None,
                    keep: int = 2) -> Path:
    root = Path(out_dir) / CKPT_DIR
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{PREFIX}{step:08d}"
    tmp = root / f".tmp-{PREFIX}{step:08d}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    save_model(model, str(tmp / "model.safetensors"))
    if ema is not None:
        save_model(ema, str(tmp / "ema.safetensors"))
    state = {"step": step, "optimizer": optimizer.state_dict(), "rng": rng_state(), "extra": extra or {}}
    if scaler is not None:
        state["scaler"] = scaler.state_dict()
    torch.save(state, tmp / "state.pt")
    files = {}
    for f in sorted(tmp.iterdir()):
        _fsync_file(f)
        files[f.name] = {"size": f.stat().st_size, "sha256": _sha256(f)}
    manifest = tmp / "manifest.json"
    manifest.write_text(json.dumps({"step": step, "files": files}, indent=1))
    _fsync_file(manifest)
    _fsync_dir(tmp)
    if final.exists():  # a re-save of the same step (e.g. after a resume): replace it
        old = root / f".old-{final.name}-{os.getpid()}"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    _fsync_dir(root)
    for stale in list_checkpoints(out_dir)[keep:]:
        shutil.rmtree(stale, ignore_errors=True)
    for leftover in root.glob(".tmp-*"):  # temporary directories of killed writers
        if not leftover.name.endswith(f"-{os.getpid()}"):
            shutil.rmtree(leftover, ignore_errors=True)
    return final


def verify_checkpoint(path: Path) -> dict:
    """Return the manifest if every file is present with the recorded size and checksum;
    otherwise raise ValueError naming the checkpoint and the problem."""
    man = path / "manifest.json"
    if not man.is_file():
        raise ValueError(f"{path}: no manifest.json (incomplete write)")
    try:
        manifest = json.loads(man.read_text())
        files = manifest["files"]
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"{man}: unreadable manifest") from None
    for name, meta in files.items():
        f = path / name
        if not f.is_file():
            raise ValueError(f"{f}: missing")
        if f.stat().st_size != meta["size"]:
            raise ValueError(f"{f}: size {f.stat().st_size} != {meta['size']} recorded (truncated?)")
        if _sha256(f) != meta["sha256"]:
            raise ValueError(f"{f}: checksum mismatch (corrupt)")
    return manifest


def load_checkpoint(path: Path, model, optimizer=None, scaler=None, ema=None) -> dict:
    """Load a verified checkpoint into the given objects; returns the state dict (step, extra)."""
    verify_checkpoint(path)
    missing, unexpected = load_model(model, str(path / "model.safetensors"), strict=True)
    if ema is not None and (path / "ema.safetensors").is_file():
        load_model(ema, str(path / "ema.safetensors"), strict=True)
    state = torch.load(path / "state.pt", map_location="cpu", weights_only=True)
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    if scaler is not None and "scaler" in state:
        scaler.load_state_dict(state["scaler"])
    set_rng_state(state["rng"])
    return state


def resume_latest(out_dir, model, optimizer=None, scaler=None, ema=None, log=print) -> Optional[dict]:
    """Resume from the newest complete, uncorrupted checkpoint; None if there is none."""
    for path in list_checkpoints(out_dir):
        try:
            state = load_checkpoint(path, model, optimizer, scaler, ema)
        except Exception as e:  # corrupt or truncated: say which, try the previous one
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            log(f"checkpoint {path} is unusable ({msg}); falling back to the previous one")
            continue
        log(f"resumed from {path} (step {state['step']})")
        state["path"] = str(path)
        return state
    return None
