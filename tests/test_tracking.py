"""Experiment tracking (train.tracker): TensorBoard, W&B and MLflow receive exactly the numbers of
metrics.jsonl, step by step, resumed runs included; W&B offline and MLflow's local store touch no
network; a missing package is a one-line config error naming the extra.

Runs: a tiny LLM, bytes tokenizer, 10 steps, one thread.
"""
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from train.config import load_run_config
from train.loop import train
from train.metrics import read_rows
from train.run import main as run_main
from conftest import TEST_DEVICE

ROOT = Path(__file__).resolve().parents[1]

TINY = {
    "family": "llm",
    "model": {"vocab_size": 256, "d_model": 32, "n_layers": 1, "n_heads": 2, "max_seq_len": 32},
    "data": {"tokenizer": "bytes", "seq_len": 32},
    "train": {"max_steps": 10, "batch_size": 4, "log_every": 1, "eval_every": 5, "eval_batches": 2,
              "checkpoint_every": 5, "keep_checkpoints": 5, "device": str(TEST_DEVICE), "peak_flops": 1e12,
              "progress": False, "samples": False, "plot": False, "export": False},
    "optim": {"lr": 3e-3, "warmup_steps": 2},
}


def rows_of(out: Path) -> list:
    return read_rows(out)


def per_key(rows: list, dtype=float) -> dict:
    """metrics.jsonl as {key: [(step, value), ...]} in the order logged, values cast to `dtype`."""
    curves = {}
    for r in rows:
        for k, v in r.items():
            if k != "step":
                curves.setdefault(k, []).append((r["step"], float(dtype(v))))
    return curves


def killed_copy(full: Path, dst: Path, after_step: int) -> Path:
    """`full` as a run killed right after its checkpoint of `after_step` would have left it."""
    shutil.copytree(full, dst)
    for c in sorted((dst / "checkpoints").iterdir()):
        if int(c.name.split("_")[1]) > after_step:
            shutil.rmtree(c)
    (dst / "model.safetensors").unlink()
    return dst


# ------------------------------------------------------------------------------ TensorBoard
def tb_curves(logdir: Path) -> dict:
    """What TensorBoard shows: every event file of the folder read in order, purges applied, by
    the accumulator TensorBoard's Python backend uses."""
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util
    acc = EventAccumulator(str(logdir), size_guidance={"tensors": 0})
    acc.Reload()
    return {tag: [(e.step, tensor_util.make_ndarray(e.tensor_proto).item()) for e in acc.Tensors(tag)]
            for tag in acc.PluginTagToContent("scalars")}


def test_tensorboard_scalars_equal_metrics_and_resume_does_not_double(tmp_path, text_corpus, one_thread):
    import tensorboard  # noqa: F401

    def run(out):
        cfg = load_run_config(None, [f"train.out_dir={out}", f"data.path={text_corpus}", "train.tracker=tensorboard"],
                              base=TINY)
        train(cfg, log=lambda m: None)
        return per_key(rows_of(out), np.float32), tb_curves(out / "tensorboard")  # TensorBoard keeps float32

    full = tmp_path / "full"
    expected, got = run(full)
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "val_loss"} <= set(expected)
    assert len(expected["loss"]) == 10 and [s for s, _ in expected["val_loss"]] == [5, 10]
    assert got == expected  # every key, step and value

    # killed after the step-5 checkpoint (events up to step 10 already written), then resumed:
    # steps 6-10 are logged again and must replace the old ones, and step 5's rows must stay
    part = killed_copy(full, tmp_path / "part", after_step=5)
    expected, got = run(part)
    assert [s for s, _ in expected["loss"]] == list(range(1, 11))
    assert got == expected

    # the same command again on the finished run: its final evaluation is logged again
    expected, got = run(full)
    assert [s for s, _ in expected["val_loss"]] == [5, 10]
    assert got == expected


# ------------------------------------------------------------------------------ W&B
GUARD = r"""
import socket, sys, traceback
report = sys.argv.pop(1)

def refuse(what):
    with open(report, "a") as f:
        f.write(what + "\n" + "".join(traceback.format_stack()) + "\n")
    raise OSError("no network in this test")

def guarded(orig):
    def connect(self, address):
        if self.family != socket.AF_UNIX:
            refuse(f"connect {address}")
        return orig(self, address)
    return connect

socket.socket.connect = guarded(socket.socket.connect)
socket.socket.connect_ex = guarded(socket.socket.connect_ex)
socket.getaddrinfo = lambda host, *a, **k: refuse(f"getaddrinfo {host}")
from train.run import main
sys.exit(main(sys.argv[1:]))
"""


def strace_prefix(trace: Path) -> list:
    """strace on every process of the run (wandb's service is a Go program, out of the Python
    guard's reach), where strace is installed and allowed; else nothing."""
    exe = shutil.which("strace")
    cmd = [exe, "-f", "--seccomp-bpf", "-qq", "-e", "trace=connect", "-o"]
    if exe is None or subprocess.run(cmd + [os.devnull, "true"], capture_output=True).returncode:
        return []
    return cmd + [str(trace)]


def run_offline(cfg: Path, out: Path, *overrides, tracker="wandb") -> None:
    """train/run.py with train.tracker=`tracker` in a subprocess whose Python refuses (and reports)
    any network use; with strace, no process of the run may connect to anything but a Unix socket.
    MLflow's usage telemetry is on in it (MLflow turns it off under pytest and CI), so that Zoo's keeps it quiet."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(WANDB_CONFIG_DIR=str(out.parent / "wandb_config"), WANDB_CACHE_DIR=str(out.parent / "wandb_cache"),
               WANDB_DATA_DIR=str(out.parent / "wandb_data"), _MLFLOW_TESTING_TELEMETRY="true")
    report, trace = out.parent / "network_attempts.txt", out.parent / "connect_trace.txt"
    trace.unlink(missing_ok=True)
    cmd = strace_prefix(trace) + [sys.executable, "-c", GUARD, str(report), str(cfg), f"train.out_dir={out}",
                                  f"train.tracker={tracker}", *overrides]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert not report.exists(), report.read_text()[:3000]
    if trace.exists():
        calls = [l for l in trace.read_text().splitlines() if "connect(" in l]
        assert tracker != "wandb" or any("AF_UNIX" in l for l in calls), "strace saw no connect to wandb's service"
        inet = [l for l in calls if "AF_UNIX" not in l]
        assert not inet, inet[:5]


def wandb_records(path: Path):
    """The protobuf records of a .wandb file: wandb's transaction log is a LevelDB-style log (a
    7-byte header ':W&B' 0xBEE1 version, then 32 KiB blocks of chunks, each crc32c (4 bytes),
    length (2), type (1: full, 2: first, 3: middle, 4: last))."""
    from wandb.proto import wandb_internal_pb2 as pb
    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    pos, buf = 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a chunk header is padding
            pos += 32768 - pos % 32768
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        buf += data[pos + 7:pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            buf = b""
            yield rec


def _key(item) -> str:
    return item.key or "/".join(item.nested_key)


def wandb_run(out: Path):
    """(run ids, history rows by step, final summary) of the offline runs in out/wandb, in order."""
    ids, history, summary = [], {}, {}
    for d in sorted((out / "wandb").glob("offline-run-*")):
        (f,) = d.glob("run-*.wandb")
        for rec in wandb_records(f):
            kind = rec.WhichOneof("record_type")
            if kind == "run":
                ids.append(rec.run.run_id)
            elif kind == "history":
                row = {_key(i): json.loads(i.value_json) for i in rec.history.item}
                history.setdefault(row["_step"], []).append(row)
            elif kind == "summary":
                summary.update({_key(i): json.loads(i.value_json) for i in rec.summary.update})
    return ids, history, summary


def expected_wandb(rows: list):
    """metrics.jsonl as W&B should hold it: one history row per step (the rows of a step merged)
    and a summary of each key's last value."""
    by_step, last = {}, {}
    for r in rows:
        by_step.setdefault(r["step"], {}).update({k: v for k, v in r.items() if k != "step"})
        last.update(r)
    return by_step, last


def test_wandb_offline_logs_metrics_resumes_the_same_run_and_touches_no_network(tmp_path, text_corpus):
    import wandb  # noqa: F401
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump({**TINY, "data": {**TINY["data"], "path": str(text_corpus)}}))
    out = tmp_path / "run"
    run_offline(cfg, out)
    ids, history, summary = wandb_run(out)
    by_step, last = expected_wandb(rows_of(out))
    assert len(ids) == 1 and ids[0] == (out / "wandb" / "run_id").read_text().strip()
    assert set(history) == set(by_step) == set(range(1, 11))
    for step, want in by_step.items():
        (got,) = history[step]  # exactly one row per step
        assert {k: got[k] for k in want} == want, step
    assert {k: summary[k] for k in last if k != "step"} == {k: v for k, v in last.items() if k != "step"}
    assert summary["_step"] == 10

    # resumed from the step-10 checkpoint with more steps: the same W&B run goes on at step 11
    run_offline(cfg, out, "train.max_steps=14")
    ids, history, summary = wandb_run(out)
    by_step, last = expected_wandb(rows_of(out))
    assert len(ids) == 2 and ids[0] == ids[1]
    assert set(history) == set(by_step) == set(range(1, 15))
    for step, want in by_step.items():
        (got,) = history[step]
        assert {k: got[k] for k in want} == want, step
    assert summary["val_loss"] == last["val_loss"] and summary["_step"] == 14


# ------------------------------------------------------------------------------ MLflow
def mlflow_run(out: Path):
    """(the run's parameters, {key: [(step, value), ...]} by step) read back through MLflow's client."""
    from mlflow import MlflowClient
    client = MlflowClient(tracking_uri=f"sqlite:///{out / 'mlruns' / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("zoo").experiment_id])
    return run.data.params, {k: sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, k))
                             for k in run.data.metrics}


@pytest.mark.slow
def test_mlflow_logs_every_row_and_the_config_resumes_its_run_and_touches_no_network(tmp_path, text_corpus):
    pytest.importorskip("mlflow", reason="mlflow is not installed (pip install -e '.[mlflow]')")
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump({**TINY, "data": {**TINY["data"], "path": str(text_corpus)}}))
    full = tmp_path / "full"
    run_offline(cfg, full, tracker="mlflow")
    params, got = mlflow_run(full)
    assert got == per_key(rows_of(full)) and len(got["loss"]) == 10  # every key, step and value
    written = load_run_config(str(full / "config.yaml"), []).to_dict()
    assert params["optim.lr"] == "0.003" and params["train.max_steps"] == "10" and params["family"] == "llm"
    assert params["model.d_model"] == json.dumps(written["model"]["d_model"])

    # killed after the step-5 checkpoint (points up to step 10 held), then resumed: the same MLflow run, one point
    # per step; what the run computes equals metrics.jsonl, the speed the killed process measured stays
    part = killed_copy(full, tmp_path / "part", after_step=5)
    run_offline(cfg, part, tracker="mlflow")
    _, got = mlflow_run(part)
    want = per_key(rows_of(part))
    assert {k: got[k] for k in ("loss", "lr", "grad_norm", "val_loss")} == {k: want[k] for k in ("loss", "lr",
                                                                                                  "grad_norm", "val_loss")}
    assert [s for s, _ in got["tokens_per_s"]] == list(range(1, 11))


# ------------------------------------------------------------------------------ missing package
class _Absent:
    """A meta-path finder for which the named top-level packages are not installed."""

    def __init__(self, *names):
        self.names = names

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in self.names:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


@pytest.mark.parametrize("tracker", ["tensorboard", "wandb", "mlflow"])
def test_missing_package_is_a_one_line_config_error_naming_the_extra(tracker, tmp_path, text_corpus, capsys,
                                                                     monkeypatch):
    for name in list(sys.modules):
        if name.partition(".")[0] == tracker:
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [_Absent(tracker)] + sys.meta_path)
    with pytest.raises(ImportError):
        __import__(tracker)
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump(TINY))
    out = tmp_path / "run"
    code = run_main([str(cfg), f"train.out_dir={out}", f"data.path={text_corpus}", f"train.tracker={tracker}"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.strip() == (f"error: {cfg} (with overrides): train.tracker={tracker} needs the {tracker} package: "
                           f"pip install -e '.[{tracker}]'")
    assert not out.exists()  # refused before the run started
