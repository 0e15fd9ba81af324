"""Data-parallel training under torchrun (gloo, CPU, 2 processes): DDP and FSDP2 match one
process with the same global batch (the LLM under both, the ResNet with SyncBatchNorm under DDP,
the diffusion denoiser and an MoE LLM under FSDP2, fp16, gradual unfreezing and whole-batch stochastic
depth under both), and sharded (DCP) checkpoints that survive SIGKILL and SIGTERM of the torchrun job
and resume on another world size (and one-process checkpoints that resume on 2 processes).

Every multi-process run is `python -m torch.distributed.run --standalone --nproc-per-node 2
train/run.py ...` as a subprocess on tiny models in fp32 (unless a case says), one thread per process. Parity is
checked against `python train/run.py` with batch_size doubled: the same global micro-batches
(train/distributed.py), summed in another order, so the tolerance is 1e-5 relative for losses
and 1e-5 absolute for weights (fp32 round-off of a reduction over 2 ranks instead of 1).
"""
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

import zoo
import zoo.config
from conftest import CPU, logged_step, starts, wait_for, wait_for_step, wait_for_training
from parallel_runs import configs  # noqa: F401 (a fixture)
from parallel_runs import (ATOL, HYBRID_SFT, assert_bitwise, assert_close_weights, assert_same_losses, case,
                           copy_step, curve, kill_job, last_stderr, launch, ranks_of, run)
from train.checkpoint import list_checkpoints, read_weights
from train.metrics import read_rows
from train.run import main as run_main
from train.step import optimizer_step

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.cpu_only("two processes over gloo share the CPU; NCCL needs a GPU per process")]



# ------------------------------------------------------------------------------ one LLM, three ways
@pytest.fixture(scope="module")
def llm_runs(configs, tmp_path_factory):
    """One process with batch_size 8, and 2-process DDP and FSDP2 runs with batch_size 4 (the
    same global batch of 2 x 8 per step, 2 micro-batches each). Each run also averages its last 2
    checkpoints (steps 3 and 6) at the end; the one-process run keeps an EMA (test_unfreezing_and_resuming_...).
    DDP's batch size is train.batch_size=auto with train.global_batch=16 and a memory budget between the
    planned per-rank peaks of micro-batches 4 and 8 (2 ranks, ddp): the planner's choice is 4, accumulated twice."""
    from train.config import load_run_config
    from train.planner import plan
    d = tmp_path_factory.mktemp("llm_runs")
    one = launch(configs["llm"], d / "one", "train.batch_size=8", "train.average_last=2", "train.ema_decay=0.9",
                 nproc=0)
    cfg = load_run_config(str(configs["llm"]), [])
    budget = sum(plan(cfg, 2, "ddp", batch_size=b, device=CPU).peak_bytes for b in (4, 8)) // 2
    procs = {"one": one, "ddp": launch(configs["llm"], d / "ddp", "train.parallel=ddp", "train.average_last=2",
                                       "train.batch_size=auto", "train.global_batch=16",
                                       f"train.memory_budget={budget}")}
    for name, p in procs.items():
        assert p.wait(300) == 0, last_stderr(d / name)[-3000:]
    run(configs["llm"], d / "fsdp", "train.parallel=fsdp", "train.average_last=2")
    return d


# ------------------------------------------------------------------------------ parity
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_processes_match_one_with_the_same_global_batch(llm_runs, strategy):
    one, par = llm_runs / "one", llm_runs / strategy
    assert len(curve(one)) == 6
    assert_same_losses(one, par)
    assert_close_weights(one, par)
    log = (par / "log.txt").read_text()
    assert f"parallel: {strategy} over 2 processes (gloo)" in log
    if strategy == "ddp":  # train.batch_size=auto: every rank found the planner's 4, and used it
        assert "batch size: auto -> micro-batch 4 x 2 accumulated x 2 ranks = train.global_batch 16" in log
        assert "batch size: auto: each rank's micro-batch [4, 4]; all 2 use 4" in log
    assert (par / "metrics.jsonl").read_text().count('"step": 1,') == 1  # only rank 0 writes metrics
    row = read_rows(par)[0]
    assert len(row["peak_mem_gb_ranks"]) == 2
    # the consolidated weights load into a model built from the run's config
    cfg = yaml.safe_load((par / "config.yaml").read_text())
    model = zoo.build(zoo.config.model_config_from(cfg["model"], "llm", str(par / "config.yaml")))
    model.load_state_dict(read_weights(par / "model.safetensors", model), strict=False)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_checkpoint_averaging_under_torchrun(llm_runs, tmp_path, strategy):
    """train.average_last=2 under DDP and FSDP2: rank 0 reads the sharded (DCP) checkpoints of
    steps 3 and 6 back whole and writes model_avg.safetensors (the names of model.safetensors),
    equal (bit for bit: halving is exact in fp32) to the mean of the checkpoints' weights as torch's own DCP converter reads
    them; the average is evaluated (avg_val_loss) beside the final weights."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    par = llm_runs / strategy
    ckpts = [par / "checkpoints" / f"step_{s:08d}" for s in (3, 6)]
    weights = []
    for c in ckpts:
        assert json.loads((c / "manifest.json").read_text())["format"] == "dcp"
        dcp_to_torch_save(c, tmp_path / f"{c.name}.pt")
        weights.append(torch.load(tmp_path / f"{c.name}.pt", weights_only=True)["model"])
    final, avg = load_file(str(par / "model.safetensors")), load_file(str(par / "model_avg.safetensors"))
    assert set(final) == set(avg) < set(weights[0])  # a tie once, as in the final weights; DCP holds both names
    for k in avg:
        assert torch.equal(avg[k], (weights[0][k] + weights[1][k]) / 2), k
    for k in final:  # the newest checkpoint holds the final weights
        assert torch.equal(weights[1][k], final[k]), k
    assert not all(torch.equal(weights[0][k], weights[1][k]) for k in final)
    log = (par / "log.txt").read_text()
    assert "average: uniform over the last 2 checkpoints (step_00000003, step_00000006)" in log
    rows = [json.loads(l) for l in (par / "metrics.jsonl").read_text().splitlines()]
    ev = [r for r in rows if "avg_val_loss" in r]
    assert len(ev) == 1 and ev[0]["step"] == 6 and math.isfinite(ev[0]["avg_val_loss"])
    assert ev[0]["avg_val_loss"] != next(r["val_loss"] for r in rows if "val_loss" in r)


def test_fsdp_checkpoint_of_two_processes_resumes_in_one(configs, llm_runs, tmp_path):
    """Resharding: the 2-process FSDP2 checkpoint of step 3 resumes in one process (batch_size 8:
    the same global batch) and continues with the losses and weights of the 2-process run; its average
    of the last 2 checkpoints (the 2-process step 3, its own step 6) equals the 2-process run's."""
    import shutil
    src = llm_runs / "fsdp" / "checkpoints" / "step_00000003"
    assert json.loads((src / "manifest.json").read_text())["format"] == "dcp"
    out = tmp_path / "resharded"
    (out / "checkpoints").mkdir(parents=True)
    shutil.copytree(src, out / "checkpoints" / src.name)
    run(configs["llm"], out, "train.batch_size=8", "train.average_last=2", nproc=0)
    assert "written by 2 processes, resharded to 1" in (out / "log.txt").read_text()
    assert [s for s, _ in curve(out)] == [4, 5, 6]
    assert_same_losses(llm_runs / "fsdp", out, steps=[4, 5, 6])
    assert_close_weights(llm_runs / "fsdp", out)
    assert_close_weights(llm_runs / "fsdp", out, "model_avg.safetensors")


# ------------------------------------------------------------------------------ tensor and pipeline parallelism
MODEL_PARALLEL = {"tp": (2, "train.batch_size=8"), "pp": (2, "train.batch_size=8"),  # one data-parallel rank
                  "fsdp+tp": (4, "train.batch_size=4")}  # 2 data-parallel ranks x 2 tensor-parallel ones
EPS = "optim.eps=1e-5"  # not 1e-8: Adam's first update, lr * g / (|g| + eps), would scale a near-zero gradient
# entry's round-off up to a part of the LR (measured, tp: one weight of 16k 1.7e-5 away, the mean 3e-9)


def test_tensor_and_pipeline_parallelism_match_one_process_and_resume_in_one(configs, tmp_path):
    """train.parallel=tp and pp on 2 processes (one launch), fsdp+tp on 4 (a 2 x 2 mesh), each with one process's
    global batch of 8: its losses (1e-5 relative) and weights (1e-5 absolute; round-off of sums split over ranks, and
    AdamW's for-loop step beside one process's fused one); each's step-3 DCP checkpoint resumes in one process and
    ends with the losses and weights of the torchrun run, and the one-process run's resumes under tp."""
    cfg, d = configs["llm"], tmp_path
    one = launch(cfg, d / "one", "train.batch_size=8", EPS, nproc=0)
    steps = {s: case(cfg, d / s, f"train.parallel={s}", over, EPS) for s, (_, over) in MODEL_PARALLEL.items()}
    for n in (2, 4):
        p = launch(cfg, d / f"mp{n}", nproc=n, cases=[v for s, v in steps.items() if MODEL_PARALLEL[s][0] == n])
        assert p.wait(600) == 0, last_stderr(d / f"mp{n}")[-3000:]
    assert one.wait(300) == 0, last_stderr(d / "one")[-3000:]
    resumes = []
    for s in [*MODEL_PARALLEL, "one"]:  # and the one-process checkpoint under tp
        out = d / (f"{s}-one" if s != "one" else "one-tp")
        (out / "checkpoints").mkdir(parents=True)
        shutil.copytree(d / s / "checkpoints" / "step_00000003", out / "checkpoints" / "step_00000003")
        resumes.append(launch(cfg, out, "train.batch_size=8", EPS, *(["train.parallel=tp"] if s == "one" else []),
                              nproc=2 if s == "one" else 0))
    assert all(p.wait(300) == 0 for p in resumes), [last_stderr(d / f"{s}-one")[-2000:] for s in MODEL_PARALLEL]
    assert "(step 3) written by 1 process, resharded to 2" in (d / "one-tp" / "log.txt").read_text()
    assert_same_losses(d / "one", d / "one-tp", steps=[4, 5, 6])
    assert_close_weights(d / "one", d / "one-tp")
    for s, (n, _) in MODEL_PARALLEL.items():
        log = (d / s / "log.txt").read_text()
        assert f"parallel: {s} over {n} processes" in log
        assert ("sequence-parallel" if s != "pp" else "1F1B") in log
        assert_same_losses(d / "one", d / s)
        assert_close_weights(d / "one", d / s)
        resumed = d / f"{s}-one"
        assert f"(step 3) written by {n} processes, resharded to 1" in (resumed / "log.txt").read_text()
        assert_same_losses(d / s, resumed, steps=[4, 5, 6])
        assert_close_weights(d / s, resumed)


# ------------------------------------------------------------------------------ unfreezing; resuming
UNFREEZE = ["train.unfreeze=[2,4]"]  # the head (its weight tied to the embedding) alone, then a block at steps 2, 4
KILLED = {"lora": ["adapter.method=lora"], "muon": ["optim.name=muon"],  # FSDP2 runs SIGKILLed, then resumed
          "hybrid": HYBRID_SFT}


def kill_after_a_checkpoint(p: subprocess.Popen, out: Path, log: Path):
    """SIGKILL the job p (torchrun and its ranks) as soon as the run in `out` has a checkpoint: mid-run."""
    deadline = time.monotonic() + 300
    while not list_checkpoints(out) and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    assert p.poll() is None, last_stderr(log)[-3000:]  # still running: the kill lands before the end
    kill_job(p)


def test_unfreezing_and_resuming_under_torchrun(configs, llm_runs, tmp_path):
    """In 3 torchrun launches (tests/torchrun_cases.py runs several runs in one):
    - train.unfreeze under DDP and FSDP2 (every parameter wrapped, the stages unfreeze them later): the losses
      and weights of one process with the same global batch; each resumes from its step-3 DCP checkpoint (its
      optimizer groups added per stage, the tied head's among them) bit for bit;
    - the one-process step-3 checkpoint of llm_runs resumes on 2 processes (DDP and FSDP2) and ends with the
      losses, weights, EMA and average of the last 2 checkpoints (train.average_last, over a one-process and a
      DCP checkpoint) of the one-process run;
    - a LoRA, a Muon and a hybrid's LoRA chat SFT (HYBRID_SFT: recurrent and attention layers, packed conversations)
      FSDP2 run SIGKILLed (torchrun and its ranks) right after their first checkpoint, each relaunched in the next
      launch: the losses and trained weights of the uninterrupted runs, bit for bit.
    Tolerances: losses 1e-6 relative (measured 1.8e-7 unfreezing, 0 resuming 1 -> 2); 1 -> 2 weights 1e-6
    relative (measured 9e-8). Unfrozen weights 1e-5 absolute (measured 1.8e-6 DDP, 4.2e-6 FSDP2): a weight's
    first Adam update, lr * g / (|g| + eps), turns the round-off of its gradient entries near eps into a part
    of lr (with optim.eps=1e-5 instead of 1e-8, the same runs agree to 7e-8)."""
    cfg, d = configs["llm"], tmp_path
    killed = {n: ["train.parallel=fsdp", "train.max_steps=8", *over] for n, over in KILLED.items()}
    one = launch(cfg, d / "one", "train.batch_size=8", *UNFREEZE, nproc=0)
    steps = []  # each launch: the previous killed run resumed, the next one started and killed
    for name, over in killed.items():
        p = launch(cfg, d, cases=[*steps, case(cfg, d / name, *over)])
        kill_after_a_checkpoint(p, d / name, d)
        steps = [case(cfg, d / name, *over)]
    steps += [case(cfg, d / f"{n}-ref", *over) for n, over in killed.items()]
    for s in ("ddp", "fsdp"):
        steps += [case(cfg, d / s, f"train.parallel={s}", *UNFREEZE), copy_step(d / s, d / f"{s}-resumed"),
                  case(cfg, d / f"{s}-resumed", f"train.parallel={s}", *UNFREEZE),
                  copy_step(llm_runs / "one", d / f"{s}-from-one"),
                  case(cfg, d / f"{s}-from-one", f"train.parallel={s}", "train.average_last=2", "train.ema_decay=0.9")]
    p = launch(cfg, d, cases=steps)
    assert p.wait(600) == 0 and one.wait(300) == 0, last_stderr(d)[-3000:]
    for s in ("ddp", "fsdp"):
        par = d / s
        assert "unfreeze: step 4: group 3 of 4 trainable" in (par / "log.txt").read_text()
        ca, cb = dict(curve(d / "one")), dict(curve(par))
        assert len(ca) == 6 and all(cb[i] == pytest.approx(ca[i], rel=1e-6) for i in ca), (ca, cb)
        assert_close_weights(d / "one", par, atol=ATOL)
        resumed = d / f"{s}-resumed"
        assert "resumed from" in (resumed / "log.txt").read_text()
        assert curve(resumed) == curve(par)[3:]
        assert_bitwise(par, resumed)
        moved = d / f"{s}-from-one"
        assert "(step 3) written by 1 process, resharded to 2" in (moved / "log.txt").read_text()
        ca, cb = dict(curve(llm_runs / "one")), dict(curve(moved))
        assert sorted(cb) == [4, 5, 6] and all(cb[i] == pytest.approx(ca[i], rel=1e-6) for i in cb), (ca, cb)
        for name in ("model.safetensors", "model_avg.safetensors", "model_ema.safetensors"):
            assert_close_weights(llm_runs / "one", moved, name, atol=1e-7, rtol=1e-6)
    for name in KILLED:
        ref, out = d / f"{name}-ref", d / name
        assert (out / "log.txt").read_text().count("resumed from") == 1 and len(curve(ref)) == 8
        assert curve(out) == curve(ref)  # the metrics the kill cut off are written again, once
        files = sorted(f.name for f in ref.glob("*.safetensors")) + \
            sorted(f"adapter/{f.name}" for f in (ref / "adapter").glob("*.safetensors"))
        assert files and (name != "lora" or any(f.startswith("adapter/") for f in files)), files
        for f in files:
            assert_bitwise(ref, out, f)


# ------------------------------------------------------------------------------ SIGKILL, SIGTERM
KILL = ["train.parallel=fsdp", "train.max_steps=200", "train.checkpoint_every=5", "train.keep_checkpoints=2",
        "train.grad_accum=1", "train.ema_decay=0.9"]


@pytest.fixture(scope="module")
def uninterrupted(configs, tmp_path_factory):
    """The run the stopped ones must reproduce."""
    return run(configs["llm"], tmp_path_factory.mktemp("uninterrupted"), *KILL)


def tmp_dirs(out: Path) -> set:
    """The temporary directories of checkpoint writes (a killed writer's stay until the next write)."""
    try:
        return {e.name for e in os.scandir(out / "checkpoints") if e.name.startswith(".tmp-")}
    except FileNotFoundError:
        return set()


def test_sigkill_and_sigterm_of_the_torchrun_job_then_relaunch_is_bitwise_identical(configs, uninterrupted,
                                                                                      tmp_path, slow_fsync):
    """An FSDP2 run (with an EMA) stopped again and again and relaunched each time:
    - SIGTERM to torchrun (which forwards it to its workers): both ranks stop at the same step
      after one checkpoint of that step;
    - SIGTERM to the ranks alone: torchrun reports each rank's exit code, 75;
    - SIGKILL to the whole torchrun job (torchrun and both ranks at once) at least 3 times: after a random number
      of steps past the checkpoint it resumed from, and inside a sharded checkpoint write (every fsync of those
      processes slowed down, so that the write lasts long enough to be cut short on any machine).
    The final weights, EMA and losses equal the uninterrupted 2-process run's bit for bit (same
    world size, same reduction order: nothing rounds differently)."""
    rng = random.Random(0)
    out = tmp_path / "stopped"
    for target in ("job", "ranks"):
        before = starts(out)
        p = launch(configs["llm"], out, *KILL)
        assert wait_for_training(p, out, before)
        assert wait_for_step(p, out, logged_step(out) + 1)
        if target == "job":
            p.send_signal(signal.SIGTERM)  # torchrun forwards it to its workers
        else:
            kids = ranks_of(p)
            assert len(kids) == 2, kids
            for pid in kids:
                os.kill(pid, signal.SIGTERM)
        code = p.wait(120)
        err = last_stderr(out)
        steps = re.findall(r"received SIGTERM(?: \(on another rank\))? at step (\d+): checkpoint written", err)
        assert len(steps) == 2 and steps[0] == steps[1], err[-3000:]  # both ranks, the same step
        assert list_checkpoints(out)[0].name == f"step_{int(steps[0]):08d}"
        assert code != 0
        if target == "ranks":  # torchrun's report of its workers' exit codes
            codes = dict(re.findall(r"rank\s*: (\d+) \(local_rank: \d+\)\s*exitcode\s*: (-?\d+)", err))
            assert codes == {"0": "75", "1": "75"}, err[-3000:]
    kills = in_write = 0
    for attempt in range(12):
        if kills >= 3 and in_write >= 1:
            break
        before, old_tmp, mid_write = starts(out), tmp_dirs(out), attempt % 2 == 1
        p = launch(configs["llm"], out, *KILL, env=slow_fsync if mid_write else None)
        if not wait_for_training(p, out, before):
            break
        if mid_write:  # inside a checkpoint write: a new temporary directory is on disk
            reached = wait_for(p, lambda: tmp_dirs(out) - old_tmp, "a checkpoint write")
            time.sleep(rng.uniform(0.0, 0.05))  # within the first of its slowed fsyncs
        else:  # a random number of steps past the checkpoint it resumed from
            reached = wait_for_step(p, out, logged_step(out) + rng.randint(1, 10))
        if not reached or p.poll() is not None:
            break
        kill_job(p)
        kills += 1
        in_write += bool(tmp_dirs(out) - old_tmp)  # left behind: the kill landed before the rename
    print(f"SIGKILLs: {kills}, {in_write} inside a checkpoint write")
    assert kills >= 3 and in_write >= 1, (kills, in_write)
    run(configs["llm"], out, *KILL, relaunches=1)  # a crash is one more stop to resume from
    assert (out / "log.txt").read_text().count("resumed from") >= 4
    assert_bitwise(uninterrupted, out)
    assert_bitwise(uninterrupted, out, "model_ema.safetensors")
    assert curve(out) == curve(uninterrupted)
    assert not list((out / "checkpoints").glob(".tmp-*"))


# ------------------------------------------------------------------------------ in one process
def test_ddp_all_reduces_gradients_on_the_last_micro_batch_only(monkeypatch, tmp_path):
    """optimizer_step with Parallel.no_sync: one gradient all-reduce per optimizer step of 3
    micro-batches (a one-process gloo group; DDP's communication hook counts the calls)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from train.distributed import Launch, Parallel
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        ddp = DDP(model)
        calls = []

        def hook(state, bucket):
            calls.append(1)
            fut = torch.futures.Future()
            fut.set_result(bucket.buffer())
            return fut

        ddp.register_comm_hook(None, hook)
        par = Parallel("ddp", Launch(0, 1, 0, True))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", enabled=False)
        batches = [torch.randn(3, 4) for _ in range(3)]
        loss = lambda b: (ddp(b).square().mean(), len(b))  # noqa: E731
        for no_sync, expected in ((lambda last: par.no_sync(ddp, last), 1), (None, 3)):
            calls.clear()
            optimizer_step(loss, iter(batches), 3, opt, scaler, list(model.parameters()), None, no_sync=no_sync)
            assert len(calls) == expected
    finally:
        dist.destroy_process_group()


def test_config_errors_under_torchrun(monkeypatch, capsys, tmp_path):
    """Under torchrun (its environment variables), parallel=none with 2 processes and an optimizer
    the registry does not run under the strategy (none today: one is made so) are one-line errors
    (exit 2), with the registry's reason, before any process group is made."""
    import dataclasses
    from train.optim import OPTIMIZERS
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    base = [f"train.out_dir={tmp_path}", "model.n_layers=1", "data.tokenizer=bytes", "data.path=stdlib",
            "train.average_last=0"]
    assert run_main(["train.parallel=none", *base]) == 2
    assert "train.parallel=none" in capsys.readouterr().err
    monkeypatch.setitem(OPTIMIZERS, "sgd", dataclasses.replace(OPTIMIZERS["sgd"], parallel=("ddp",), why_not="a reason"))
    assert run_main(["train.parallel=fsdp", "optim.name=sgd", *base]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "optim.name=sgd does not combine with train.parallel=fsdp (a reason; " in err
