"""Reliability: runs survive SIGKILL, preemption, corrupt checkpoints, non-finite losses and
malicious pickles, and lose nothing.

The kill and signal tests run `python train/run.py` as subprocesses on a tiny LLM (bytes
tokenizer, CPU, one thread: deterministic without train.deterministic, whose first call is slow
to start) and compare the final weights bitwise with an uninterrupted run of the
same length.
"""
import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

import train.builder as builder
import train.loop as loop
from train.checkpoint import list_checkpoints
from train.config import load_run_config
from train.run import main as run_main
from train.tasks.lm import LMTask

from conftest import CPU, logged_step, starts, wait_for, wait_for_step, wait_for_training
from train.metrics import read_rows

ROOT = Path(__file__).resolve().parents[1]
RUN_PY = ROOT / "train" / "run.py"

CFG = {
    "family": "llm",
    "model": {"vocab_size": 256, "d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "max_seq_len": 64},
    "data": {"tokenizer": "bytes", "seq_len": 64},
    "train": {"max_steps": 150, "batch_size": 8, "log_every": 1, "eval_every": 0, "eval_batches": 2,
              "checkpoint_every": 5, "keep_checkpoints": 2, "average_last": 2, "device": str(CPU), "deterministic": False,
              "peak_flops": 1e12, "progress": False, "samples": False, "plot": False, "export": False},
    "optim": {"lr": 3e-3, "warmup_steps": 5},
}
MAX_STEPS = CFG["train"]["max_steps"]


# ------------------------------------------------------------------------------ helpers
pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.cpu_only("bitwise resume after SIGKILL, compared on the CPU's deterministic kernels")]


def weights(path) -> dict:
    return load_file(str(path))


def assert_bitwise_equal(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def curve(out: Path) -> list:
    """(step, loss, lr, grad_norm) of every logged training step: what a resumed run must reproduce."""
    rows = read_rows(out)
    return [(r["step"], r["loss"], r["lr"], r["grad_norm"]) for r in rows if "loss" in r]


@pytest.fixture(scope="module")
def run_cfg(tmp_path_factory):
    """A YAML run config on a small corpus (a slice of the standard library)."""
    from train.data import stdlib_files
    d = tmp_path_factory.mktemp("rel")
    corpus = d / "corpus.txt"
    corpus.write_text("".join(f.read_text(errors="replace") for f in stdlib_files()[:20])[:150_000])
    cfg = {**CFG, "data": {**CFG["data"], "path": str(corpus)}}
    path = d / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def launch(cfg: Path, out: Path, *overrides, env=None) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    out.mkdir(parents=True, exist_ok=True)
    n = len(list(out.glob("stderr-*.txt")))
    with open(out / f"stderr-{n}.txt", "w") as err:  # the child keeps its own copy of the handle
        return subprocess.Popen([sys.executable, str(RUN_PY), str(cfg), f"train.out_dir={out}", *overrides],
                                cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err)


def finish(p: subprocess.Popen, timeout=300) -> int:
    try:
        return p.wait(timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        raise


def tmp_dirs_of(out: Path, pid: int) -> list:
    root = out / "checkpoints"
    try:
        return [e.name for e in os.scandir(root) if e.name.startswith(".tmp-") and e.name.endswith(f"-{pid}")]
    except FileNotFoundError:
        return []


@pytest.fixture(scope="module")
def reference(run_cfg, tmp_path_factory):
    """An uninterrupted run: its final weights, loss curve and the sum of its step times in seconds."""
    out = tmp_path_factory.mktemp("reference")
    assert finish(launch(run_cfg, out)) == 0, (out / "stderr-0.txt").read_text()
    rows = read_rows(out)
    return weights(out / "model.safetensors"), curve(out), sum(r.get("step_time_s", 0) for r in rows), out


# ------------------------------------------------------------------------------ SIGKILL
def test_sigkill_at_random_moments_then_resume_is_bitwise_identical(run_cfg, reference, tmp_path, slow_fsync):
    """At least 5 SIGKILLs, each followed by a resume: the final weights and the whole loss curve equal the
    uninterrupted run's, bit for bit. The moments come from the run's own progress, so that no machine's
    speed or load changes what is tested: the first kill after a random number of steps past the first
    checkpoint, then each after a random number of steps past the checkpoint the process resumed from; every
    other process is killed inside a checkpoint write (its temporary directory on disk, every fsync of that
    process slowed down so that the write lasts long enough to be cut short on any machine)."""
    rng = random.Random(0)
    ref_weights, ref_curve, _, _ = reference
    out, every = tmp_path / "killed", CFG["train"]["checkpoint_every"]
    kills, in_write = 0, 0
    for attempt in range(14):
        if kills >= 5 and in_write >= 1:
            break
        n_starts, mid_write = starts(out), attempt % 2 == 1
        p = launch(run_cfg, out, env=slow_fsync if mid_write else None)
        if not wait_for_training(p, out, n_starts):
            break  # it finished before we could kill it
        resumed_at = logged_step(out)  # the checkpoint this process resumed from (0: none yet)
        if mid_write:  # at a random point of a write this process started
            reached = wait_for(p, lambda: tmp_dirs_of(out, p.pid), "a checkpoint write")
            time.sleep(rng.uniform(0.0, 0.05))  # within the first of its slowed fsyncs
        else:
            reached = wait_for_step(p, out, min(resumed_at + rng.randint(1, 2 * every) + (0 if resumed_at else every),
                                                MAX_STEPS - every))
        if not reached or p.poll() is not None:
            break
        p.send_signal(signal.SIGKILL)
        p.wait()
        kills += 1
        in_write += bool(tmp_dirs_of(out, p.pid))  # left behind: the kill landed before the rename
    print(f"SIGKILLs: {kills}, {in_write} of them inside a checkpoint write")
    assert kills >= 5 and in_write >= 1, (kills, in_write)
    p = launch(run_cfg, out)
    assert finish(p) == 0, sorted(out.glob("stderr-*"))[-1].read_text()
    log = (out / "log.txt").read_text()
    assert log.count("resumed from") >= 4, log
    assert_bitwise_equal(weights(out / "model.safetensors"), ref_weights)
    assert curve(out) == ref_curve  # every step logged once, with the uninterrupted run's numbers
    ref_out = reference[3]  # and the files themselves, byte for byte
    assert (out / "model.safetensors").read_bytes() == (ref_out / "model.safetensors").read_bytes()
    assert (out / "metrics.jsonl").read_bytes() == (ref_out / "metrics.jsonl").read_bytes()  # avg_* included
    assert not list((out / "checkpoints").glob(".tmp-*"))  # killed writers' leftovers are cleaned up
    assert len(list_checkpoints(out)) == CFG["train"]["keep_checkpoints"]


# ------------------------------------------------------------------------------ SIGTERM / SIGINT
def test_sigterm_and_sigint_checkpoint_exit_75_and_resume_exactly(run_cfg, reference, tmp_path, slow_fsync):
    out = tmp_path / "preempted"
    for sig in (signal.SIGTERM, signal.SIGINT):
        n_starts = starts(out)
        p = launch(run_cfg, out)
        assert wait_for_training(p, out, n_starts)
        assert wait_for_step(p, out, logged_step(out) + 1)  # a step of its own
        p.send_signal(sig)
        assert finish(p) == 75
        err = sorted(out.glob("stderr-*"), key=lambda f: f.stat().st_mtime)[-1].read_text().strip()
        assert len(err.splitlines()) == 1, err
        m = re.search(rf"received {sig.name} at step (\d+): checkpoint written", err)
        assert m and "resume" in err, err
        step = int(m.group(1))
        assert 0 < step < MAX_STEPS
        assert list_checkpoints(out)[0].name == f"step_{step:08d}"  # the step it stopped at, nothing lost
    # a second Ctrl-C, while the first one's checkpoint is being written, stops at once (exit 130,
    # one line); the previous complete checkpoint is used and the run still resumes exactly.
    # Every fsync of that process is slowed down (`slow_fsync`), so that the write lasts long enough for the
    # test to see it begin: a tiny model's checkpoint takes a few ms.
    n_starts = starts(out)
    p = launch(run_cfg, out, env=slow_fsync)
    assert wait_for_training(p, out, n_starts)
    assert wait_for_step(p, out, logged_step(out) + 1)
    before = {c.name for c in list_checkpoints(out)}
    # the second signal must come after the first one was handled (two SIGINTs that arrive before
    # Python runs its handler count as one): wait for the write the first one starts, which is a
    # temporary directory that was not there when it was sent (a periodic write may be under way)
    writing = set(tmp_dirs_of(out, p.pid))
    p.send_signal(signal.SIGINT)
    assert wait_for(p, lambda: set(tmp_dirs_of(out, p.pid)) - writing, "the signal's checkpoint write")
    p.send_signal(signal.SIGINT)
    assert finish(p) == 130
    err = sorted(out.glob("stderr-*"), key=lambda f: f.stat().st_mtime)[-1].read_text().strip()
    assert len(err.splitlines()) == 1 and "interrupted" in err, err
    cut = {name.split("-")[1] for name in tmp_dirs_of(out, p.pid)}  # e.g. step_00000061: the write cut short
    after = {c.name for c in list_checkpoints(out)}
    # the cut-short write left no checkpoint and removed none. A periodic one may have completed
    # between the snapshot and the first signal; its rotation (keep_checkpoints is 2) may then have
    # removed older ones, the signal's checkpoint among them: anything added is newer than all before.
    added = after - before
    assert cut and not cut & after, (cut, before, after)
    assert after == before if not added else min(added) > max(before), (before, after)
    assert finish(launch(run_cfg, out)) == 0
    ref_weights, ref_curve, _, ref_out = reference
    assert_bitwise_equal(weights(out / "model.safetensors"), ref_weights)
    assert curve(out) == ref_curve
    # averaging (train.average_last: 2) counts the schedule's checkpoints only, never a signal's:
    # the files, the average's metrics included, are the uninterrupted run's byte for byte
    for name in ("metrics.jsonl", "model.safetensors", "model_avg.safetensors"):
        assert (out / name).read_bytes() == (ref_out / name).read_bytes(), name


def test_a_signals_checkpoint_is_never_averaged(run_cfg, tmp_path):
    """With checkpoints only at the end, a SIGINT's checkpoint would be among train.average_last's two
    if it counted: the resumed run averages what the uninterrupted one does (the final checkpoint
    alone), so its files equal the uninterrupted run's byte for byte."""
    over = ["train.checkpoint_every=0", "train.average_last=2"]
    ref, out = tmp_path / "ref", tmp_path / "int"
    assert finish(launch(run_cfg, ref, *over)) == 0
    p = launch(run_cfg, out, *over)
    assert wait_for_training(p, out, 0)
    assert wait_for_step(p, out, 1)
    p.send_signal(signal.SIGINT)
    assert finish(p) == 75
    assert finish(launch(run_cfg, out, *over)) == 0
    for name in ("metrics.jsonl", "model.safetensors", "model_avg.safetensors"):
        assert (out / name).read_bytes() == (ref / name).read_bytes(), name


# ------------------------------------------------------------------------------ in-process runs
SMALL = {**CFG, "train": {**CFG["train"], "max_steps": 20, "deterministic": True}}


def run(tmp_path, corpus, name, base=SMALL, **over):
    overrides = [f"train.out_dir={tmp_path / name}", f"data.path={corpus}"] + [f"{k}={v}" for k, v in over.items()]
    logs = []
    loop.train(load_run_config(None, overrides, base=base), log=logs.append)
    return tmp_path / name, logs


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def corrupt(ckpt: Path, how: str):
    if how == "truncate_weights":
        f = ckpt / "model.safetensors"
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    elif how == "flip_weights":
        f = ckpt / "model.safetensors"
        b = bytearray(f.read_bytes())
        b[len(b) - 100] ^= 0xFF
        f.write_bytes(bytes(b))
    elif how == "flip_state":
        f = ckpt / "state.pt"
        b = bytearray(f.read_bytes())
        b[len(b) // 2] ^= 0x01
        f.write_bytes(bytes(b))
    elif how == "truncate_manifest":
        f = ckpt / "manifest.json"
        f.write_text(f.read_text()[:40])
    elif how == "missing_state":
        (ckpt / "state.pt").unlink()
    else:
        raise ValueError(how)


@pytest.fixture(scope="module")
def small_full(tmp_path_factory):
    """A 20-step in-process run with checkpoints every 5 steps (all kept)."""
    from train.data import stdlib_files
    d = tmp_path_factory.mktemp("small")
    corpus = d / "corpus.txt"
    corpus.write_text("".join(f.read_text(errors="replace") for f in stdlib_files()[:10])[:80_000])
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # module-scoped: set up before the per-test one_thread fixture
    try:
        out, _ = run(d, corpus, "full", **{"train.keep_checkpoints": 10})
    finally:
        torch.set_num_threads(n)
    return corpus, out


def killed_copy(full: Path, dst: Path, after_step: int) -> Path:
    """The run directory as a run killed right after the checkpoint of `after_step` left it."""
    shutil.copytree(full, dst)
    for c in list_checkpoints(dst):
        if int(c.name.split("_")[1]) > after_step:
            shutil.rmtree(c)
    (dst / "model.safetensors").unlink()
    return dst


@pytest.mark.parametrize("how", ["truncate_weights", "flip_weights", "flip_state", "truncate_manifest",
                                 "missing_state"])
def test_corrupt_newest_checkpoint_falls_back_to_previous(small_full, tmp_path, how):
    corpus, full = small_full
    part = killed_copy(full, tmp_path / "part", after_step=15)
    corrupt(part / "checkpoints" / "step_00000015", how)
    _, logs = run(tmp_path, corpus, "part", **{"train.keep_checkpoints": 10})
    bad = [m for m in logs if "step_00000015 is unusable" in m]
    assert len(bad) == 1 and "falling back" in bad[0], logs
    assert any(m.startswith("resumed from") and m.rstrip().endswith("step_00000010 (step 10)") for m in logs), logs
    # from step 10 the run is redone exactly: same weights as the run that was never interrupted
    assert_bitwise_equal(weights(part / "model.safetensors"), weights(full / "model.safetensors"))


def test_killed_after_the_last_checkpoint_only_finishes(small_full, tmp_path):
    """Killed after the final checkpoint but before the final weights: the rerun writes them, with
    no training step and no duplicated final evaluation in the metrics."""
    corpus, full = small_full
    part = tmp_path / "part"
    shutil.copytree(full, part)
    (part / "model.safetensors").unlink()
    _, logs = run(tmp_path, corpus, "part", **{"train.keep_checkpoints": 10})
    assert any(m.rstrip().endswith("(step 20)") and m.startswith("resumed from") for m in logs), logs
    assert_bitwise_equal(weights(part / "model.safetensors"), weights(full / "model.safetensors"))
    assert (part / "metrics.jsonl").read_text() == (full / "metrics.jsonl").read_text()


def test_resume_inside_a_logging_window_logs_the_same_bytes(small_full, tmp_path):
    """log_every=3 with checkpoints every 5 steps: the windows of steps 10-12 and 13-15 span a resume.
    The window is checkpointed, so metrics.jsonl and model.safetensors equal the uninterrupted run's
    byte for byte (speed.jsonl holds the wall-clock numbers, which no two runs share)."""
    corpus, _ = small_full
    over = {"train.keep_checkpoints": 10, "train.log_every": 3}
    full, _ = run(tmp_path, corpus, "full3", **over)
    part = killed_copy(full, tmp_path / "part3", after_step=10)
    _, logs = run(tmp_path, corpus, "part3", **over)
    assert any(m.rstrip().endswith("(step 10)") and m.startswith("resumed from") for m in logs), logs
    assert (part / "metrics.jsonl").read_bytes() == (full / "metrics.jsonl").read_bytes()
    assert (part / "model.safetensors").read_bytes() == (full / "model.safetensors").read_bytes()
    rows = read_rows(part)
    assert [r["step"] for r in rows if "loss" in r] == [3, 6, 9, 12, 15, 18, 20]
    assert all("tokens_per_s" in r for r in rows if "loss" in r)


def test_no_usable_checkpoint_is_an_error_not_a_fresh_start(small_full, tmp_path, capsys):
    corpus, full = small_full
    part = killed_copy(full, tmp_path / "part", after_step=10)
    for c in list_checkpoints(part):
        corrupt(c, "flip_weights")
    before = {c.name: sha(c / "model.safetensors") for c in list_checkpoints(part)}
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({**SMALL, "data": {**SMALL["data"], "path": str(corpus)}}))
    assert run_main([str(cfg), f"train.out_dir={part}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "checkpoints" in err and "train.resume=false" in err, err
    assert {c.name: sha(c / "model.safetensors") for c in list_checkpoints(part)} == before  # nothing lost


def test_resume_with_another_optimizer_is_refused(small_full, tmp_path, capsys):
    """optim.name changed since the checkpoint (adamw -> lion): one optimizer's states are not the other's, so the
    run stops in one line naming both (exit 2), the checkpoints kept."""
    corpus, full = small_full
    part = killed_copy(full, tmp_path / "part", after_step=10)
    before = {c.name: sha(c / "state.pt") for c in list_checkpoints(part)}
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({**SMALL, "data": {**SMALL["data"], "path": str(corpus)}}))
    assert run_main([str(cfg), f"train.out_dir={part}", "optim.name=lion"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "optim.name=adamw" in err and "lion" in err, err
    assert {c.name: sha(c / "state.pt") for c in list_checkpoints(part)} == before


def test_resume_false_sets_the_old_checkpoints_aside(small_full, tmp_path):
    corpus, full = small_full
    part = tmp_path / "part"
    shutil.copytree(full, part)
    old = {c.name for c in list_checkpoints(part)}
    _, logs = run(tmp_path, corpus, "part", **{"train.resume": False, "train.max_steps": 10})
    assert not any(m.startswith("resumed from") for m in logs)
    (aside,) = part.glob("checkpoints.old-*")
    assert {c.name for c in aside.iterdir()} == old  # the previous run's checkpoints, all kept
    assert [c.name for c in list_checkpoints(part)] == ["step_00000010", "step_00000005"]


# ------------------------------------------------------------------------------ non-finite losses
def nan_task(nan_steps, what="loss"):
    """The LM task with a NaN loss (or, with what="grad", a finite loss whose gradient is NaN)
    injected at the given (0-based) optimizer steps; it snapshots the weights at every step's start."""
    class NaNTask(LMTask):
        snapshots = {}

        def build_model(self):
            self.model = super().build_model()
            return self.model

        def train_batch(self, step, micro):
            self.step = step
            if micro == 0:
                NaNTask.snapshots[step] = {k: v.clone() for k, v in self.model.state_dict().items()}
            return super().train_batch(step, micro)

        def loss(self, model, batch):
            loss, n = super().loss(model, batch)
            if nan_steps(self.step) and what == "loss":
                loss = loss * float("nan")
            elif nan_steps(self.step):  # sqrt'(0) = inf, times d(0 * w)/dw = 0: NaN gradients, loss + 0
                loss = loss + (0 * sum(p.sum() for p in model.parameters())).sqrt()
            return loss, n
    return NaNTask


@pytest.mark.parametrize("what", ["loss", "grad"])
def test_nan_loss_skips_the_step_and_training_goes_on(small_full, tmp_path, monkeypatch, what):
    corpus, _ = small_full
    k = 7
    task = nan_task(lambda s: s == k, what)
    monkeypatch.setattr(builder, "task_class", lambda family, *_: task)
    out, logs = run(tmp_path, corpus, "nan")
    snaps = task.snapshots
    assert_bitwise_equal(snaps[k + 1], snaps[k])  # the NaN step left the weights untouched
    for s in (k - 1, k + 1):  # the steps around it did train
        assert any(not torch.equal(snaps[s][n], snaps[s + 1][n]) for n in snaps[s])
    rows = read_rows(out)
    assert {"step": k + 1, "nonfinite": True, "skipped_steps": 1} in rows
    assert all(r.get("skipped_steps") == 1 for r in rows if "loss" in r and r["step"] > k)
    (msg,) = [m for m in logs if "non-finite" in m and "skipped" in m]
    assert msg.startswith(f"step {k + 1}:") and ("(nan, nan)" in msg) == (what == "loss"), msg
    state = torch.load(list_checkpoints(out)[0] / "state.pt", weights_only=True)
    assert all(int(s["step"]) == SMALL["train"]["max_steps"] - 1 for s in state["optimizer"]["state"].values())
    first_loss = next(r["loss"] for r in rows if "loss" in r)
    final = [r for r in rows if "val_loss" in r][-1]
    assert final["val_loss"] < first_loss - 1.0  # it went on learning


def test_nan_on_every_step_stops_cleanly_keeping_the_last_good_checkpoint(small_full, tmp_path, monkeypatch,
                                                                          capsys):
    corpus, full = small_full
    part = killed_copy(full, tmp_path / "part", after_step=10)
    kept = {c.name: sha(c / "model.safetensors") for c in list_checkpoints(part)}
    monkeypatch.setattr(builder, "task_class", lambda family, *_: nan_task(lambda s: True))
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({**SMALL, "data": {**SMALL["data"], "path": str(corpus)}}))
    code = run_main([str(cfg), f"train.out_dir={part}", "train.checkpoint_every=2", "train.max_nonfinite=4",
                     "train.keep_checkpoints=2"])
    assert code == 3
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "non-finite" in err and "step 14" in err, err
    assert f"the last good checkpoint, {list_checkpoints(part)[0]}, is kept" in err
    # no checkpoint of the NaN streak rotated the good ones away; they are intact
    assert {c.name: sha(c / "model.safetensors") for c in list_checkpoints(part)} == kept
    assert not (part / "model.safetensors").exists()
    rows = read_rows(part)
    assert [r["step"] for r in rows if r.get("nonfinite")] == [11, 12, 13, 14]
    code = run_main([str(cfg), f"train.out_dir={tmp_path / 'fresh'}", "train.max_nonfinite=2"])  # none yet
    assert code == 3 and "no checkpoint was written before them" in capsys.readouterr().err
    assert not list_checkpoints(tmp_path / "fresh")


# ------------------------------------------------------------------------------ malicious pickles
class Payload:
    """Unpickling this calls open(marker, 'w'): code run by merely loading the file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def malicious(path: Path, tensors: dict, marker: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({**tensors, "payload": Payload(marker)}, path)
    return path


def test_the_payload_is_live(tmp_path):
    """The test payload really runs code when unpickled without weights_only (so the tests below can fail)."""
    marker = tmp_path / "pwned"
    f = malicious(tmp_path / "x.pth", {"w": torch.zeros(1)}, marker)
    torch.load(f, weights_only=False)
    assert marker.exists()


def test_resume_refuses_a_malicious_state_pt(small_full, tmp_path):
    corpus, full = small_full
    part = killed_copy(full, tmp_path / "part", after_step=15)
    ck = part / "checkpoints" / "step_00000015"
    marker = tmp_path / "pwned"
    state = torch.load(ck / "state.pt", weights_only=True)
    malicious(ck / "state.pt", state, marker)
    # an attacker who can write the file can also fix up the manifest: only weights_only stands in the way
    man = json.loads((ck / "manifest.json").read_text())
    man["files"]["state.pt"] = {"size": (ck / "state.pt").stat().st_size}  # state.pt's checksum is its own (zip CRCs)
    (ck / "manifest.json").write_text(json.dumps(man))
    _, logs = run(tmp_path, corpus, "part", **{"train.keep_checkpoints": 10})
    assert not marker.exists()
    bad = [m for m in logs if "step_00000015 is unusable" in m]
    assert len(bad) == 1 and "state.pt" in bad[0], logs
    assert_bitwise_equal(weights(part / "model.safetensors"), weights(full / "model.safetensors"))


RESNET_KEYS = ["conv1.weight", "bn1.weight", "layer1.0.conv1.weight", "layer1.0.bn1.weight", "layer1.0.conv2.weight",
               "layer1.0.bn2.weight", "fc.weight", "fc.bias"]


@pytest.mark.parametrize("layout", ["resnet18.pth", "model.pt", "folder/pytorch_model.bin", "taesd_encoder.pth",
                                    "taesd_decoder.pth"])
def test_from_pretrained_refuses_malicious_pth(tmp_path, layout):
    import zoo
    marker = tmp_path / "pwned"
    tensors = {k: torch.zeros(4, 4) for k in RESNET_KEYS} if "taesd" not in layout else \
        {f"{i}.weight": torch.zeros(4, 4) for i in range(3)}
    f = malicious(tmp_path / layout, tensors, marker)
    if "taesd" in layout:  # the other file of the pair, also poisoned
        other = {"taesd_encoder.pth": "taesd_decoder.pth", "taesd_decoder.pth": "taesd_encoder.pth"}[layout]
        malicious(tmp_path / other, tensors, marker)
    target = f.parent if layout.startswith("folder/") else f
    with pytest.raises((ValueError, FileNotFoundError)) as e:
        zoo.from_pretrained(target)
    assert not marker.exists()
    assert len(str(e.value).splitlines()) == 1 and str(tmp_path) in str(e.value)


UNSAFE = [re.compile(r"\bpickle\.loads?\("), re.compile(r"\bdill\."), re.compile(r"allow_pickle\s*=\s*True"),
          re.compile(r"weights_only\s*=\s*False")]


def test_nothing_in_the_project_unpickles_arbitrary_objects():
    """Every torch.load in zoo/ and train/ passes weights_only=True; no pickle.load, np.load(allow_pickle=True)."""
    offenders = []
    for f in sorted((ROOT / "zoo").rglob("*.py")) + sorted((ROOT / "train").rglob("*.py")):
        src = f.read_text()
        for m in re.finditer(r"torch\.load\(", src):
            depth, i = 1, m.end()
            while depth and i < len(src):
                depth += {"(": 1, ")": -1}.get(src[i], 0)
                i += 1
            if not re.search(r"weights_only\s*=\s*True", src[m.end():i]):
                offenders.append(f"{f.relative_to(ROOT)}: {src[m.start():i]}")
        offenders += [f"{f.relative_to(ROOT)}: {p.pattern}" for p in UNSAFE if p.search(src)]
    assert not offenders, offenders


# ------------------------------------------------------------------------------ corrupt weight files
def saved_weights(tmp_path, kind) -> tuple:
    """(path to load, file to damage) of a tiny model saved by zoo.save_pretrained."""
    import zoo
    from zoo.config import LLMConfig
    if kind == "hf_llm":
        zoo.save_pretrained(zoo.build(LLMConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2, max_seq_len=16)),
                            tmp_path / "hf")
        return tmp_path / "hf", tmp_path / "hf" / "model.safetensors"
    if kind.startswith("resnet"):
        model = zoo.build({"family": "convnet", "model": {"arch": "resnet18", "layers": [1, 1], "width": 8,
                                                          "num_classes": 2}})
        f = tmp_path / f"resnet18.{kind.split('.')[1]}"
        zoo.save_pretrained(model, f)
        return f, f
    from zoo.diffusion.taesd import TAESD
    zoo.save_pretrained(TAESD(latent_channels=4, channels=8), tmp_path / "taesd_encoder.pth")
    return tmp_path / "taesd_encoder.pth", tmp_path / "taesd_decoder.pth"  # the partner file is damaged


@pytest.mark.parametrize("kind,how", [("hf_llm", "truncate"), ("hf_llm", "header"), ("resnet.safetensors", "truncate"),
                                      ("resnet.pth", "truncate"), ("resnet.pth", "flip"), ("taesd.pth", "truncate"),
                                      ("taesd.pth", "flip")])
def test_from_pretrained_names_a_truncated_or_corrupt_file(tmp_path, kind, how):
    """safetensors: header and byte ranges are checked; torch zip files: every record's CRC-32
    (torch.load alone would load a flipped byte as a wrong weight)."""
    import zoo
    target, f = saved_weights(tmp_path, kind)
    zoo.from_pretrained(target)  # intact: loads
    b = bytearray(f.read_bytes())
    if how == "truncate":
        b = b[: len(b) * 2 // 3]
    elif how == "header":
        b[8:20] = b"\xff" * 12
    else:  # a flipped byte inside the last tensor's data, whose file offset the zip directory gives
        import zipfile
        with zipfile.ZipFile(f) as z:
            info = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.header_offset)
        off = info.header_offset  # local header: 30 bytes, then the name and extra field lengths it records
        start = off + 30 + int.from_bytes(b[off + 26:off + 28], "little") + int.from_bytes(b[off + 28:off + 30], "little")
        b[start + 2] ^= 0x01
    f.write_bytes(bytes(b))
    with pytest.raises(ValueError) as e:
        zoo.from_pretrained(target)
    msg = str(e.value)
    assert len(msg.splitlines()) == 1 and str(f) in msg, msg


# ------------------------------------------------------------------------------ other families
DIFFUSION = {
    "family": "diffusion",
    "model": {"image_size": 16, "num_classes": 10, "channels": [16], "blocks_per_level": 1, "heads": 2,
              "autoencoder": {"latent_channels": 4, "channels": 8}, "sample_steps": 2},
    "data": {"ae_steps": 2, "ae_batch_size": 8, "encode_batch_size": 64},
    "train": {**SMALL["train"], "max_steps": 6, "checkpoint_every": 3, "keep_checkpoints": 5, "batch_size": 8,
              "ema_decay": 0.9},
}


@pytest.mark.parametrize("text", [False, True], ids=["classes", "captions"])
def test_diffusion_resume_is_exact_with_ema(tmp_path, text):
    """The latent diffusion task (noise, timesteps and label dropout drawn per step) resumes exactly,
    EMA included; so does text to image (caption dropout drawn per step), whose second run reuses the prompt cache."""
    from parallel_runs import TEXT
    over = [f"data.cache_dir={tmp_path / 'cache'}", *(TEXT if text else [])]
    loop.train(load_run_config(None, [f"train.out_dir={tmp_path / 'full'}", *over], base=DIFFUSION), log=lambda m: None)
    part = killed_copy(tmp_path / "full", tmp_path / "part", after_step=3)
    (part / "model_ema.safetensors").unlink()
    logs = []
    loop.train(load_run_config(None, [f"train.out_dir={part}", *over], base=DIFFUSION), log=logs.append)
    assert any(m.startswith("resumed from") and "(step 3)" in m for m in logs), logs
    assert not text or any(m.startswith("prompts: reusing") for m in logs), logs
    for f in ("model.safetensors", "model_ema.safetensors"):
        assert_bitwise_equal(weights(part / f), weights(tmp_path / "full" / f))
    assert curve(part) == curve(tmp_path / "full")
