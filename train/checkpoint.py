"""Atomic checkpoints and exact resume.

`<out_dir>/checkpoints/step_XXXXXXXX/` holds model.safetensors, ema.safetensors, state.pt
(weights_only=True) and manifest.json (written last, with checksums); written in a temporary
directory and renamed, so a killed run leaves a complete checkpoint or none. Several processes
write a sharded DCP checkpoint (`save_dcp`). docs/reliability.md has the layout and resume rules.
`Checkpointer` is the loop's component: resume, save every `train.checkpoint_every` steps, average.
"""
from __future__ import annotations

import copy
import dataclasses
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

from .features.averaging import average_last, tied_names
from .optim import resume_note
from .step import EXIT_CONFIG, RunStopped

CKPT_DIR, PREFIX = "checkpoints", "step_"
REQUIRED = ("model.safetensors", "state.pt")
REQUIRED_DCP = (".metadata", "state.pt")  # a sharded checkpoint (train/distributed.py)


def rng_state() -> dict:
    np_state = np.random.get_state()
    state = {"python": random.getstate(),
             "numpy": {"key": np_state[0], "pos": int(np_state[2]), "has_gauss": int(np_state[3]),
                       "cached_gaussian": float(np_state[4]), "state": torch.from_numpy(np_state[1].astype(np.int64))},
             "torch": torch.get_rng_state()}
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


def interval_checkpoints(out_dir) -> list[Path]:
    """The checkpoints the run's schedule wrote (not a signal's), newest first: what `keep` counts and
    averaging averages, so that a resumed run keeps and averages what an uninterrupted one does."""
    def interval(p):
        try:
            return json.loads((p / "manifest.json").read_text()).get("interval", True)
        except (OSError, ValueError):
            return True
    return [p for p in list_checkpoints(out_dir) if interval(p)]


def set_aside(out_dir) -> Path:
    """A previous run's checkpoints moved away (train.resume=false): neither resumed nor rotating this run's away."""
    root, stamp = Path(out_dir) / CKPT_DIR, time.strftime("%Y%m%d-%H%M%S")
    dest, n = root.with_name(f"{CKPT_DIR}.old-{stamp}"), 1
    while dest.exists():
        n += 1
        dest = root.with_name(f"{CKPT_DIR}.old-{stamp}-{n}")
    os.replace(root, dest)
    fsync_dir(root.parent)
    return dest


def save_checkpoint(out_dir, step: int, model, optimizer, scaler=None, ema=None, extra: Optional[dict] = None,
                    keep: int = 2, keys: Optional[set] = None, interval: bool = True) -> Path:
    """keys: the state-dict names to write (an adapter run: what trains); None = the whole model.
    interval=False: a checkpoint outside the run's schedule (a signal's), kept only until the next."""
    root = Path(out_dir) / CKPT_DIR
    root.mkdir(parents=True, exist_ok=True)
    final, tmp = root / f"{PREFIX}{step:08d}", root / f".tmp-{PREFIX}{step:08d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_safetensors(model if keys is None else _subset(model, keys), tmp / "model.safetensors")
    if ema is not None:
        save_safetensors(ema if keys is None else _subset(ema, keys), tmp / "ema.safetensors")
    state = {"step": step, "optimizer": optimizer.state_dict(), "rng": rng_state(), "extra": extra or {}}
    publish(out_dir, tmp, final, state, scaler, keep, os.getpid(), interval=interval)
    return final


def publish(out_dir, tmp: Path, final: Path, state: dict, scaler, keep: int, tag, fmt: Optional[str] = None,
            interval: bool = True):
    """Seal a temporary checkpoint directory: write `state` (and the scaler's) to state.pt, fsync every file,
    write the manifest last, rename it to `final`, drop killed writers' temporaries and all but the newest `keep`
    interval checkpoints (the newest is always kept). fmt: "dcp" sharded; None: the one-process layout."""
    if scaler is not None:
        state["scaler"] = scaler.state_dict()
    torch.save(state, tmp / "state.pt")
    root, step, files = final.parent, state["step"], {}
    for f in sorted(tmp.iterdir()):
        fsync_file(f)
        files[f.name] = {"size": f.stat().st_size, **({} if self_checked(f) else {"crc32": file_crc32(f)})}
    manifest = tmp / "manifest.json"
    manifest.write_text(json.dumps({"step": step, **({"format": fmt} if fmt else {}),
                                    **({} if interval else {"interval": False}), "files": files}, indent=1))
    fsync_file(manifest)
    fsync_dir(tmp)
    old = root / f".old-{final.name}-{tag}"
    if final.exists():  # a re-save of the same step (e.g. after a resume): replace it
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
    fsync_dir(root)
    every = list_checkpoints(out_dir)
    kept = set(interval_checkpoints(out_dir)[:keep]) | set(every[:1])
    for stale in (p for p in every if p not in kept):
        shutil.rmtree(stale, ignore_errors=True)
    for leftover in root.glob(".tmp-*"):  # temporary directories of killed writers
        if not leftover.name.endswith(f"-{tag}"):
            shutil.rmtree(leftover, ignore_errors=True)


def verify_checkpoint(path: Path) -> dict:
    """The manifest when every file has its recorded size and checksum; else a ValueError saying why."""
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
    if unlisted := [n for n in (REQUIRED_DCP if manifest.get("format") == "dcp" else REQUIRED) if n not in files]:
        raise ValueError(f"{man}: does not list {unlisted[0]}")
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
    """state.pt through torch.load(weights_only=True): a file carrying a pickled object is refused, not run."""
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
    """The tensors of a checked weight file, matched by name and shape against `model` (or its `keys`)."""
    sd = load_tensors(path)
    want = model.state_dict() if keys is None else _subset(model, keys)
    # tied tensors (one storage, several names) are stored once by save_model: any one name will do
    params = {n: id(p) for n, p in model.named_parameters(remove_duplicate=False)}
    storage = {k: params.get(k, k) if hasattr(v, "device_mesh") else v.data_ptr() if v.numel() else k
               for k, v in want.items()}  # a shard (DTensor): by its parameter
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
    """Load a verified checkpoint into the given objects (every file checked first, so a bad one changes
    nothing); returns the state dict. before_optimizer(state) runs before the optimizer state loads."""
    manifest = verify_checkpoint(path)
    dcp = manifest.get("format") == "dcp"  # written by any number of ranks, into this run (one process or many)
    if not dcp:
        weights = read_weights(path / "model.safetensors", model, keys)
        ema_weights = read_weights(path / "ema.safetensors", ema, keys) \
            if ema is not None and (path / "ema.safetensors").is_file() else None
    state = read_state(path / "state.pt")
    if state["step"] != manifest.get("step"):
        raise ValueError(f"{path / 'state.pt'}: step {state['step']} != {manifest.get('step')} in the manifest")
    if before_optimizer is not None:
        before_optimizer(state)
    how = [{k: g[k] for k in ("fused", "foreach") if k in g} for g in getattr(optimizer, "param_groups", [])]
    if dcp:
        ema_weights = _load_dcp(path, state, model, optimizer, ema, trained_only=keys is not None, par=par)
    elif par is not None and par.pipeline is not None:
        raise ValueError(f"{path}: a one-process checkpoint (its optimizer state indexed by the whole model's "
                         f"parameters) does not resume under train.parallel=pp; resume it under another strategy")
    elif par is not None and par.active:
        _load_into_ranks(state, weights, ema_weights, model, optimizer, ema, keys is not None, par)
    else:
        model.load_state_dict(weights, strict=False)
        if ema is not None:
            ema.load_state_dict(weights if ema_weights is None else ema_weights, strict=False)
        if optimizer is not None:
            optimizer.load_state_dict(state["optimizer"])
    for g, kept in zip(getattr(optimizer, "param_groups", []), how):  # how this run steps, not the checkpoint's run
        g.update(kept)
    if ema is not None:  # an EMA switched on for a run that had none starts from the resumed weights
        state["ema_started"] = ema_weights is None
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


def _load_into_ranks(state, weights, ema_weights, model, optimizer, ema, trained_only, par):
    """A one-process checkpoint, read whole by every rank, into a run under torchrun: each rank keeps its
    part (DDP: all of it; FSDP2, TP: its shards) through DCP's full state dicts. Collective."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict
    opts = dataclasses.replace(_dcp_options(trained_only), full_state_dict=True)
    weights = _rows(par, _every_tied_name(model, weights), back=False)
    if optimizer is None:
        set_model_state_dict(model, weights, options=opts)
    else:
        set_state_dict(model, optimizer, model_state_dict=weights, optim_state_dict=_rows(par, _by_name(
                       model, optimizer, state["optimizer"]), back=False), options=opts)
    if ema is not None:
        set_model_state_dict(ema, _every_tied_name(ema, ema_weights) if ema_weights is not None else weights,
                             options=opts)


def _every_tied_name(model, weights: dict) -> dict:
    """weights with a tied tensor (stored once) under each of its names, as DCP's state dicts list it."""
    names = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    out = dict(weights)
    for group in names.values():
        have = next((n for n in group if n in weights), None)
        for n in group if have is not None else ():
            out.setdefault(n, weights[have])
    return out


def _by_name(model, optimizer, osd: dict) -> dict:
    """A one-process optimizer state (by index; a Chained one's by part) keyed by parameter names, as DCP's are."""
    parts = getattr(optimizer, "optimizers", None)
    pairs = [(o, osd[k]) for k, o in parts.items()] if parts else [(optimizer, osd)]
    name = {id(p): n for n, p in model.named_parameters()}
    out = {"state": {}, "param_groups": []}
    for opt, sd in pairs:
        names = [name[id(p)] for g in opt.param_groups for p in g["params"]]
        out["state"].update({names[i]: s for i, s in sd["state"].items()})
        out["param_groups"] += [{**g, "params": [names[i] for i in g["params"]]} for g in sd["param_groups"]]
    return out


def resume_latest(out_dir, model, optimizer=None, scaler=None, ema=None, log=print, keys: Optional[set] = None,
                  before_optimizer=None, par=None, seed: int = 0) -> Optional[dict]:
    """Resume from the newest complete, uncorrupted checkpoint; None if there is none. When checkpoints
    exist but none is usable, raise CheckpointError rather than start over (and rotate them away)."""
    paths = list_checkpoints(out_dir)
    found, ranks = len(paths), par is not None and par.active
    if ranks:  # rank 0 picks the checkpoint, every rank loads it (collectively, no falling back)
        found, paths = par.broadcast((found, _first_verified(paths, log)) if par.main else None)
    for path in paths:
        try:
            state = load_checkpoint(path, model, optimizer, scaler, ema, keys, before_optimizer, par, seed)
        except Exception as e:  # noqa: BLE001 - corrupt or truncated: say which, try the previous one
            if ranks and isinstance(e, ValueError):
                raise CheckpointError(str(e).splitlines()[0]) from None
            if ranks:
                raise
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            log(f"checkpoint {path} is unusable ({msg}); falling back to the previous one")
            continue
        was, now = state.get("resharded", (0, 0))  # the world sizes when the checkpoint was resharded
        log(f"resumed from {path} (step {state['step']})"
            + (f" written by {was} process{'es' if was > 1 else ''}, resharded to {now}" if was else ""))
        return dict(state, path=str(path))
    if found:
        raise CheckpointError(f"{Path(out_dir) / CKPT_DIR}: none of the {found} checkpoints is usable (see "
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
def _dcp_options(trained_only: bool, par=None):
    """What a DCP checkpoint holds: every tensor, or (an adapter run) only what trains; under tensor parallelism
    whole tensors, so that one process (or any other layout) reads the fused projections' rows in the model's order."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    return StateDictOptions(ignore_frozen_params=trained_only, strict=not trained_only,
                            full_state_dict=getattr(par, "fused", None) is not None)


def _rows(par, state: dict, back: bool = True) -> dict:
    """A full state (model or optimizer) with the fused projections' rows in the model's order (back=False: as
    tensor parallelism trains them; train/model_parallel.py's Fused)."""
    fused = getattr(par, "fused", None)
    return fused.saved(state, back) if fused is not None else state


def _dcp_state(model, optimizer, ema, trained_only: bool = False, par=None) -> dict:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict
    msd, osd = (_rows(par, sd) for sd in get_state_dict(model, optimizer, options=_dcp_options(trained_only, par)))
    if trained_only:  # a frozen weight tied to another (an LM head) is still listed
        frozen = {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
        msd = {k: v for k, v in msd.items() if k not in frozen}
    state = {"model": msd, "optimizer": osd}
    if ema is not None:
        state["ema"] = {k: v for k, v in get_model_state_dict(ema).items() if not trained_only or k in msd}
    return state


def save_dcp(par, out_dir, step: int, model, optimizer, scaler=None, ema=None,
             extra: Optional[dict] = None, keep: int = 2, interval: bool = True, trained_only: bool = False) -> Path:
    """Every rank writes its shards into one temporary directory; rank 0 adds state.pt and publishes it.
    Collective. trained_only: an adapter run's checkpoint, without the frozen base."""
    import torch.distributed.checkpoint as dcp

    root = Path(out_dir) / CKPT_DIR
    tag = par.broadcast(os.getpid())  # one temporary name for all ranks: rank 0's pid
    tmp = root / f".tmp-{PREFIX}{step:08d}-{tag}"
    if par.main:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    par.barrier()
    par.sync(model)
    dcp.save(_dcp_state(model, optimizer, ema, trained_only, par),
             storage_writer=dcp.FileSystemWriter(str(tmp), sync_files=True))
    if par.comm is not None:  # train.grad_compression=powersgd: this rank's state, before rank 0 seals the folder
        par.comm.save(tmp, par.rank)
    rngs, final = par.gather(rng_state()), root / f"{PREFIX}{step:08d}"
    if par.main:
        state = {"step": step, "rng": rngs[0], "rng_ranks": rngs, "world_size": par.world,
                 "has_ema": ema is not None, "extra": extra or {}}
        publish(out_dir, tmp, final, state, scaler, keep, tag, fmt="dcp", interval=interval)
    par.barrier()  # nobody goes on (or is killed as done) before the checkpoint is in place
    return final


def _load_dcp(path: Path, state: dict, model, optimizer=None, ema=None, trained_only: bool = False, par=None):
    """A verified DCP checkpoint of any number of ranks into this run (collective under torchrun); returns
    the EMA's weights it held (None: none)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    with_ema = ema is not None and state.get("has_ema", False)
    sd = _dcp_state(model, optimizer, ema if with_ema else None, trained_only, par)
    dcp.load(sd, storage_reader=dcp.FileSystemReader(str(path)))
    opts = _dcp_options(trained_only, par)
    set_state_dict(model, optimizer, model_state_dict=_rows(par, sd["model"], back=False),
                   optim_state_dict=_rows(par, sd["optimizer"], back=False), options=opts)
    if ema is not None:
        set_model_state_dict(ema, sd["ema"] if with_ema else sd["model"], options=opts)
    return sd["ema"] if with_ema else None


# ------------------------------------------------------------------------------ the loop's component
class Checkpointer:
    def __init__(self, run, out: Path, say):
        self.run, self.out, self.say, self.t = run, out, say, run.cfg.train
        self.start = 0          # the step the run starts (or resumed) at
        self.resumed: Optional[dict] = None
        self.metrics = None     # the Metrics whose rows a checkpoint seals (set by the loop)

    def resume(self) -> int:
        """Load the newest usable checkpoint (train.resume) or set old ones aside; returns the start step."""
        run, t, par = self.run, self.t, self.run.par
        if not t.resume and par.broadcast(bool(list_checkpoints(self.out)) if par.main else None):
            if par.main:
                self.say(f"train.resume=false: the previous checkpoints were moved to {set_aside(self.out)}")
            par.barrier()
        if not t.resume:
            return 0
        restore = (lambda st: run.unfreezer.restore(run.optimizer, st["step"])) if run.unfreezer else None
        try:
            state = resume_latest(self.out, run.model, run.optimizer, run.scaler, run.ema.model if run.ema else None,
                                  self.say, run.keys, restore, par, t.seed)
        except CheckpointError as e:
            raise RunStopped(str(e), EXIT_CONFIG) from None
        if state is None:
            return 0
        self.resumed, self.start = state, state["step"]
        if par.comm is not None:
            par.comm.resume(Path(state["path"]), self.start, state.get("world_size") == par.world, par.rank, self.say)
        extra = state["extra"]
        tasks = extra.get("task_ranks") or [extra.get("task") or {}]  # each process's own task state
        if len(tasks) != par.world and any(tasks):
            self.say(f"task: the checkpoint holds the state of {len(tasks)} processes, this run has {par.world}; "
                     f"it starts afresh (an RL run samples its batch of rollouts again)")
        run.task.load_state_dict(tasks[par.rank] if len(tasks) == par.world else {})
        if note := resume_note(self.start, extra.get("max_steps"), t.max_steps, run.cfg.optim):
            self.say(note)  # train.max_steps changed since the checkpoint: the schedule is recomputed; or none is left
        if extra.get("optim", run.cfg.optim.name) != run.cfg.optim.name:  # its states are not another's
            raise RunStopped(f"{state['path']}: trained with optim.name={extra['optim']}, this run has "
                             f"{run.cfg.optim.name}; use another train.out_dir or train.resume=false", EXIT_CONFIG)
        was_id = {k: extra.get(k) for k in run.adapter_id()}
        if was_id != run.adapter_id():  # an adapter checkpoint only makes sense on the base it was trained on
            raise RunStopped(f"{state['path']}: trained with adapter/base {was_id}, this run has {run.adapter_id()}; "
                             f"use another train.out_dir or train.resume=false", EXIT_CONFIG)
        if state.get("ema_started"):
            self.say(f"ema: the checkpoint has none; train.ema_decay={t.ema_decay} starts it from the resumed "
                     f"weights (step {self.start})")
        was = extra.get("precision")
        if t.precision == "auto" and was in ("fp32", "bf16") and was != run.precision:
            self.say(f"precision: auto -> {was}, as in the run being resumed (measured now: {run.precision})")
            run.set_precision(was)
        return self.start

    def metrics_state(self) -> Optional[dict]:
        """The logging window the checkpoint sealed (None: an older checkpoint, or none)."""
        return (self.resumed or {}).get("extra", {}).get("metrics")

    def due(self, step: int) -> bool:
        every = self.t.checkpoint_every
        return bool(every) and step % every == 0 and step != self.t.max_steps

    def save(self, step: int):
        run = self.run
        extra = {"precision": run.precision, "max_steps": self.t.max_steps, "optim": run.cfg.optim.name,
                 **run.adapter_id()}  # see resume_note, resume
        if self.metrics is not None:  # the rows up to this step are durable before the checkpoint is
            self.metrics.sync()
            extra["metrics"] = self.metrics.state_dict()
        tasks = run.par.gather(run.task.state_dict())  # every process's, in rank order
        if any(tasks):
            extra["task_ranks"] = tasks
        scaler = run.scaler if run.scaler is not None and run.scaler.is_enabled() else None
        ema = run.ema.model if run.ema is not None else None
        interval = step >= self.t.max_steps or self.due(step)  # else a signal's
        if run.par.active:
            path = save_dcp(run.par, self.out, step, run.model, run.optimizer, scaler, ema, extra=extra,
                            keep=self.t.keep_checkpoints, interval=interval, trained_only=run.keys is not None)
        else:
            path = save_checkpoint(self.out, step, run.model, run.optimizer, scaler, ema, extra=extra,
                                   keep=self.t.keep_checkpoints, keys=run.keys, interval=interval)
        self.say(f"checkpoint: {path}")

    def evaluate_average(self) -> dict:
        """train.average_last: the last checkpoints' weights (an adapter run's: what trains) averaged, saved
        and evaluated (avg_*); under torchrun rank 0 alone does it in a plain model, the others return {}."""
        run, t = self.run, self.t
        if run.par.active and not run.par.main:
            return {}
        used = list(reversed(interval_checkpoints(self.out)[:t.average_last]))  # oldest first
        if not used:
            raise RunStopped(f"{self.out / CKPT_DIR}: no checkpoints to average", EXIT_CONFIG)
        # under torchrun the trained model is wrapped or sharded: a plain one on its device
        avg = run.plain_model() if run.par.active else copy.deepcopy(run.model)
        path = average_last(self.out, used, t.average_weighting, tied_names(avg))
        avg.load_state_dict(read_weights(path, avg, run.keys), strict=False)
        fewer = f" (train.average_last={t.average_last}, fewer were written)" if len(used) < t.average_last else ""
        self.say(f"average: {t.average_weighting} over the last {len(used)} checkpoints "
                 f"({', '.join(p.name for p in used)}) -> {path}{fewer}")
        with run.autocast():
            return {f"avg_{k}": v for k, v in run.task.evaluate(avg).items()}
