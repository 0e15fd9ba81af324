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
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import pytest
import torch
import yaml
from safetensors.torch import load_file

import zoo
import zoo.config
from train.checkpoint import list_checkpoints, read_weights
from train.step import optimizer_step
from train.run import main as run_main

from conftest import CPU, starts, wait_for_training
from train.metrics import read_rows

ROOT = Path(__file__).resolve().parents[1]
RUN_PY = ROOT / "train" / "run.py"
CASES_PY = ROOT / "tests" / "torchrun_cases.py"
RTOL, ATOL = 1e-5, 1e-5

QUIET = {"device": str(CPU), "peak_flops": 1e12, "progress": False, "samples": False, "plot": False, "export": False,
         "log_every": 1, "eval_every": 0, "eval_batches": 1}
LLM = {"family": "llm",
       "model": {"vocab_size": 256, "d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "max_seq_len": 32},
       "data": {"tokenizer": "bytes", "seq_len": 32},
       "train": {**QUIET, "max_steps": 6, "batch_size": 4, "grad_accum": 2, "checkpoint_every": 3},
       "optim": {"lr": 3e-3, "warmup_steps": 2}}
RESNET = {"family": "convnet",
          "model": {"arch": "resnet18", "layers": [1, 1], "width": 8, "stem": "small", "in_chans": 1,
                    "num_classes": 10},
          "data": {"path": "digits", "image_size": 16, "shift": 2},
          "train": {**QUIET, "max_steps": 4, "batch_size": 4, "checkpoint_every": 0, "clip_grad": None},
          "optim": {"lr": 3e-3, "warmup_steps": 1}}
DIFFUSION = {"family": "diffusion",
             "model": {"image_size": 16, "autoencoder": {"latent_channels": 4, "channels": 8}, "channels": [16, 32],
                       "blocks_per_level": 1, "sample_steps": 2},
             "data": {"dataset": "digits", "ae_steps": 3, "ae_batch_size": 8, "samples_per_class": 1},
             "train": {**QUIET, "max_steps": 3, "batch_size": 4, "checkpoint_every": 0, "ema_decay": 0.9,
                       "samples": True},
             "optim": {"lr": 1e-3, "warmup_steps": 1}}
MOE = ["model.moe.n_experts=4", "model.moe.top_k=2", "model.moe.expert_hidden=32", "model.moe.balance=bias"]
DEEPSEEK = MOE + ["model.moe.scoring=sigmoid", "model.moe.n_groups=2", "model.moe.topk_groups=1", "model.moe.n_shared=1",
                  "model.mla.kv_rank=16", "model.mla.q_rank=24", "model.mla.rope_dim=8", "model.mla.nope_dim=8",
                  "model.mla.v_dim=16"]  # DeepSeek-V3's ideas: latent attention, group-limited sigmoid routing

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.cpu_only("two processes over gloo share the CPU; NCCL needs a GPU per process")]


# ------------------------------------------------------------------------------ helpers
@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    from train.data import stdlib_files
    d = tmp_path_factory.mktemp("dist")
    corpus = d / "corpus.txt"
    corpus.write_text("".join(f.read_text(errors="replace") for f in stdlib_files()[:10])[:100_000])
    out = {}
    for name, cfg in {"llm": LLM, "resnet": RESNET, "diffusion": DIFFUSION}.items():
        if name == "llm":
            cfg = {**cfg, "data": {**cfg["data"], "path": str(corpus)}}
        out[name] = d / f"{name}.yaml"
        out[name].write_text(yaml.safe_dump(cfg))
    return out


def launch(cfg: Path, out: Path, *overrides, nproc: int = 2, cases: Optional[list] = None) -> subprocess.Popen:
    """torchrun with nproc processes (nproc=0: plain `python train/run.py`); its stderr in
    out/stderr-N.txt. cases: instead of one run, the runs (and checkpoint copies) of tests/torchrun_cases.py
    in one launch (cfg and overrides unused)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    out.mkdir(parents=True, exist_ok=True)
    n = len(list(out.glob("stderr-*.txt")))
    head = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] \
        if nproc else [sys.executable]
    args = [str(RUN_PY), str(cfg), f"train.out_dir={out}", *overrides]
    if cases is not None:
        (out / f"cases-{n}.json").write_text(json.dumps(cases))
        args = [str(CASES_PY), str(out / f"cases-{n}.json")]
    with open(out / f"stderr-{n}.txt", "w") as err:
        return subprocess.Popen([*head, *args], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err)


def ranks_of(p: subprocess.Popen) -> list:
    """The pids of torchrun's workers (it starts each in a session of its own)."""
    try:
        return [int(pid) for pid in Path(f"/proc/{p.pid}/task/{p.pid}/children").read_text().split()]
    except FileNotFoundError:
        return []


def kill_job(p: subprocess.Popen, sig=signal.SIGKILL):
    """Signal torchrun and its workers at once, as a cluster kills a job, and wait until all are gone."""
    pids = [p.pid] + ranks_of(p)
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    p.wait()
    deadline = time.monotonic() + 60
    for pid in pids[1:]:  # reparented when torchrun died: gone once they are not running any more
        while time.monotonic() < deadline:
            try:
                if Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][0] in "ZX":
                    break
            except (FileNotFoundError, ProcessLookupError):
                break
            time.sleep(0.005)


def last_stderr(out: Path) -> str:
    return max(out.glob("stderr-*.txt"), key=lambda f: int(f.stem.split("-")[1])).read_text()


def run(cfg: Path, out: Path, *overrides, nproc: int = 2) -> Path:
    p = launch(cfg, out, *overrides, nproc=nproc)
    try:
        code = p.wait(300)
    except subprocess.TimeoutExpired:
        kill_job(p)
        raise
    assert code == 0, last_stderr(out)[-3000:]
    return out


def case(cfg: Path, out: Path, *over) -> list:
    """A run of tests/torchrun_cases.py: train/run.py's arguments."""
    return [str(cfg), f"train.out_dir={out}", *over]


def copy_step(src: Path, dst: Path, step: int = 3) -> dict:
    """A step of tests/torchrun_cases.py: a run's checkpoint of `step` copied into another run's folder."""
    name = f"checkpoints/step_{step:08d}"
    return {"copy": [str(src / name), str(dst / name)]}


def curve(out: Path) -> list:
    rows = read_rows(out)
    return [(r["step"], r["loss"]) for r in rows if "loss" in r]


def assert_same_losses(a: Path, b: Path, steps=None):
    ca, cb = dict(curve(a)), dict(curve(b))
    steps = steps or sorted(ca)
    assert steps and all(s in cb for s in steps), (ca, cb)
    for s in steps:
        assert cb[s] == pytest.approx(ca[s], rel=RTOL), (s, ca[s], cb[s])


def assert_close_weights(a: Path, b: Path, name="model.safetensors", atol=ATOL, rtol=0.0):
    wa, wb = load_file(str(a / name)), load_file(str(b / name))
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=rtol, atol=atol, msg=k)


@pytest.fixture(scope="module")
def llm_runs(configs, tmp_path_factory):
    """One process with batch_size 8, and 2-process DDP and FSDP2 runs with batch_size 4 (the
    same global batch of 2 x 8 per step, 2 micro-batches each). Each run also averages its last 2
    checkpoints (steps 3 and 6) at the end; the one-process run keeps an EMA (test_unfreezing_and_resuming_...).
    DDP's batch size is train.batch_size=auto with train.global_batch=16 and a memory budget between the
    planned per-rank peaks of micro-batches 4 and 8 (2 ranks, ddp): the planner's choice is 4, accumulated twice."""
    from train.config import load_run_config
    from train.plan import plan
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


# ------------------------------------------------------------------------------ parity, case by case
ADAPTERS = {"lora": ["adapter.method=lora"], "dora": ["adapter.method=dora"],
            "prefix": ["adapter.method=prefix", "adapter.prefix_len=4"],
            # NF4 stores blocks of 64 weights, their scales in blocks of 256: a wider model
            "qlora": ["adapter.method=lora", "adapter.quantize_base=nf4", "model.d_model=256", "model.n_kv_heads=4",
                      "model.ffn_hidden=512"]}
# optim.name -> (losses' rel, weights' abs tolerance) against one process: where an optimizer rounds what it
# is given (Muon orthogonalises in bf16, 8-bit AdamW quantises its states per block of the shard, GaLore
# projects on a few singular vectors), the round-off of 2 ranks' gradient sums grows to its own size
OPTIM_TOL = {"adamw_offload": (RTOL, ATOL), "muon": (1e-4, 1e-2), "adamw8bit": (1e-4, 2e-3), "galore": (1e-5, 1e-3)}
SFT = ["data.format=messages", "data.path=synthetic", "data.synthetic_rows=200", "data.seq_len=128",
       "model.max_seq_len=128", "data.eval_generate=0"]
RL = ["data.format=prompts", "data.path=synthetic", "data.synthetic_rows=40", "data.template=none", "data.seq_len=24",
      "data.eval_prompts=2", "rl.prompts_per_step=4", "rl.group_size=2", "rl.max_new_tokens=6", "rl.kl_beta=0.1",
      "rl.updates_per_batch=2", "train.max_steps=4",
      "optim.name=sgd", "optim.lr=0.5"]  # not Adam: it would scale the round-off of near-zero gradients up to the LR
BOTH = ("ddp", "fsdp")
FP16_SCALE = 3e6
PARITY = {  # case -> (config, overrides, strategies, the parallel runs' own overrides)
    **{m: ("llm", ["train.average_last=2", *over], BOTH, []) for m, over in ADAPTERS.items()},
    "sft": ("llm", SFT, BOTH, []),
    "dpo": ("llm", ["data.format=preference", "data.path={pairs}", "data.seq_len=24", "data.val_fraction=0.2",
                    "adapter.method=lora"], BOTH, []),
    "compress": ("llm", ["train.teacher={teacher}", "train.kd_alpha=0.5", "train.qat=int8", "train.prune=2:4",
                         "optim.name=adafactor", "optim.lr=1e-2"], BOTH, []),
    **{f"optim-{n}": ("llm", [f"optim.name={n}"], BOTH, []) for n in OPTIM_TOL},
    "diffusion": ("diffusion", [], ("fsdp",), []),
    "moe": ("llm", DEEPSEEK + ["train.grad_accum=1"], ("fsdp",), []),
    "mod": ("llm", MOE + ["train.grad_accum=1", "model.mod_capacity=0.25"], ("ddp",), []),
    "float8": ("llm", ["train.float8=true", "train.float8_keep=[]"], ("fsdp",), []),
    "rl": ("llm", RL, BOTH, []),
    "lr_find": ("llm", ["train.lr_find=true", "train.lr_find_steps=10", "optim.name=lion"], ("fsdp",), []),
    # without sync_bn each rank normalises its own half: on this config the loss of step 4 is then 3e-3
    # away, relative, so parity fails
    "resnet": ("resnet", [], ("ddp",), ["train.sync_bn=true"]),
    # a loss scale that overflows the fp16 gradients of the first steps, which are skipped, then trains
    "fp16": ("llm", ["train.precision=fp16", f"train.loss_scale={FP16_SCALE}", "optim.eps=1e-5"], BOTH, []),
    # train.seed=1: the second block is dropped in some steps and kept in others
    "drop_path": ("resnet", ["model.drop_path_rate=0.5", "model.drop_path_mode=batch", "train.seed=1"], BOTH,
                  ["train.sync_bn=true"]),
}


@pytest.fixture(scope="module")
def parity(configs, tmp_path_factory):
    """Every case of PARITY run in one process with batch_size 8 (one after another in one process),
    and under each of its strategies on 2 processes with batch_size 4, the same global batch (one after
    another in one torchrun launch: tests/torchrun_cases.py); the FSDP2 GRPO run's step-3 checkpoint then
    resumes to step 6 (rl/resumed). Returns the folder: CASE/one, CASE/ddp, CASE/fsdp."""
    d = tmp_path_factory.mktemp("parity")
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghij") for _ in range(rng.randint(3, 6))) for _ in range(100)]
    (d / "pairs.jsonl").write_text("".join(json.dumps({"prompt": w + "=", "chosen": w.upper(), "rejected": w}) + "\n"
                                           for w in words))
    zoo.save_pretrained(zoo.build({"model": dict(LLM["model"], d_model=48)}), d / "teacher")
    fill = lambda over: [o.format(pairs=d / "pairs.jsonl", teacher=d / "teacher") for o in over]  # noqa: E731
    ones, pars = [], []
    for name, (cfg, over, strategies, par_over) in PARITY.items():
        ones.append(case(configs[cfg], d / name / "one", "train.batch_size=8", *fill(over)))
        pars += [case(configs[cfg], d / name / s, f"train.parallel={s}", *fill(over), *par_over) for s in strategies]
    pars += [copy_step(d / "rl" / "fsdp", d / "rl" / "resumed"),
             case(configs["llm"], d / "rl" / "resumed", "train.parallel=fsdp", *RL, "train.max_steps=6")]
    one, par = launch(None, d / "one-process", cases=ones, nproc=0), launch(None, d / "torchrun", cases=pars)
    assert par.wait(1500) == 0, last_stderr(d / "torchrun")[-3000:]
    assert one.wait(600) == 0, last_stderr(d / "one-process")[-3000:]
    return d


@pytest.mark.parametrize("method", list(ADAPTERS))
def test_adapters_under_two_processes_match_one(parity, configs, tmp_path, method):
    """LoRA, DoRA, prefix tuning and QLoRA under DDP and FSDP2 (the frozen base, NF4 included, sharded with
    its adapters): the losses, the trained adapter and the final and averaged evaluations of one process
    with the same global batch; the checkpoints (DCP) hold what trains, not the base. The FSDP2 LoRA
    checkpoint of step 3 resumes in one process and ends with the same adapter."""
    import torch.distributed.checkpoint as dcp
    one = parity / method / "one"
    files = sorted(f.name for f in (one / "adapter").glob("*.safetensors"))
    last = lambda d: {k: v for r in read_rows(d) if r["step"] == 6 for k, v in r.items()}  # noqa: E731
    for s in BOTH:
        par = parity / method / s
        assert_same_losses(one, par)
        assert files and files == sorted(f.name for f in (par / "adapter").glob("*.safetensors"))
        for f in files:
            assert_close_weights(one / "adapter", par / "adapter", f)
        assert [last(par)[k] for k in ("val_loss", "avg_val_loss")] == \
            pytest.approx([last(one)[k] for k in ("val_loss", "avg_val_loss")], rel=RTOL)
        ckpt = par / "checkpoints" / "step_00000003"
        held = {k for k in dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata if k.startswith("model.")}
        trained = {"model." + k for k in load_file(str(par / "model_avg.safetensors"))}
        assert held == trained and not any(".base" in k or "embed" in k for k in held), held
    if method == "lora":
        import shutil
        fsdp, out = parity / method / "fsdp", tmp_path / "resharded"
        shutil.copytree(fsdp / "checkpoints" / "step_00000003", out / "checkpoints" / "step_00000003")
        run(configs["llm"], out, "train.batch_size=8", *PARITY[method][1], nproc=0)
        assert "written by 2 processes, resharded to 1" in (out / "log.txt").read_text()
        assert_same_losses(fsdp, out, steps=[4, 5, 6])
        assert_close_weights(fsdp / "adapter", out / "adapter", files[0])


@pytest.mark.parametrize("task", ["sft", "dpo"])
def test_post_training_under_two_processes_matches_one(parity, task):
    """Chat SFT (the assistant's tokens only: each rank's loss is its share of the global micro-batch's
    mean, as their numbers of targets differ) and DPO with LoRA (the reference: the base with adapters
    off) under DDP and FSDP2: the losses and the trained weights of one process with the same global batch."""
    one = parity / task / "one"
    for s in BOTH:
        par = parity / task / s
        assert_same_losses(one, par)
        if task == "sft":
            assert_close_weights(one, par)
        else:
            assert_close_weights(one / "adapter", par / "adapter", "adapter_model.safetensors")


def test_distill_qat_prune_and_adafactor_under_two_processes_match_one(parity):
    """Distillation (the teacher replicated on each rank, each rank distilling its own rows), int8 QAT,
    2:4 pruning (under FSDP2 each mask sharded like its weight) and Adafactor (under FSDP2 each sharded
    parameter stepped whole, so its factored statistics are the one process's) in one run, under DDP and
    FSDP2: the losses, the masks, the sparsity and the quantized model's evaluation of one process with
    the same global batch; the weights within 1e-3: QAT's rounding to int8 is discontinuous in the weights,
    so a round-off-sized difference moves a weight across a rounding boundary, a whole quantization step
    in the forward (without QAT, each of the others is within 1e-6 of one process)."""
    one = parity / "compress" / "one"
    last = lambda d: {k: v for r in read_rows(d) if r["step"] == 6 for k, v in r.items()}  # noqa: E731
    w1 = load_file(str(one / "model.safetensors"))
    for s in BOTH:
        par = parity / "compress" / s
        log = (par / "log.txt").read_text()
        assert all(s in log for s in ("teacher: ", "qat: int8 fake quantization", "prune: 2:4 magnitude pruning"))
        assert_same_losses(one, par)
        assert_close_weights(one, par, atol=1e-3)
        w2 = load_file(str(par / "model.safetensors"))
        pruned = [k for k in w1 if ".mlp." in k or ".attn." in k]
        assert pruned and all(torch.equal(w1[k] == 0, w2[k] == 0) for k in pruned)
        assert last(par)["sparsity"] == last(one)["sparsity"] == 0.5
        for k in ("val_loss", "quant_ref_val_loss", "quant_val_loss"):
            assert last(par)[k] == pytest.approx(last(one)[k], rel=1e-4), k
        assert (par / "quantized").is_dir()


def test_lr_find_under_torchrun_matches_one_process(parity):
    """train.lr_find under FSDP2 (with Lion): each rank runs the range test on its rows of every global
    batch, the ranks agreeing on each step's loss; every rank suggests the same LR, the one one process
    suggests with the same global batch, from the same losses."""
    a, b = (json.loads((parity / "lr_find" / d / "lr_find.json").read_text()) for d in ("one", "fsdp"))
    assert b["ranks"] == [a["suggested_lr"]] * 2 and b["suggested_lr"] == a["suggested_lr"]
    assert len(a["loss"]) == len(b["loss"]) >= 3 and b["loss"] == pytest.approx(a["loss"], rel=RTOL)


@pytest.mark.parametrize("name", list(OPTIM_TOL))
def test_optimizers_under_two_processes_match_one(parity, name):
    """Every optimizer of the registry under DDP and on FSDP2's sharded parameters (Muon orthogonalises each
    whole matrix: DTensor gathers the shards for its matmuls): the losses and weights of one process with the
    same global batch, within what the optimizer's own rounding allows (OPTIM_TOL). (Muon's chained state
    through DCP: the SIGKILL case of test_unfreezing_and_resuming_under_torchrun.)"""
    one, rel, atol = parity / f"optim-{name}" / "one", *OPTIM_TOL[name]
    for s in BOTH:
        par = parity / f"optim-{name}" / s
        ca, cb = dict(curve(one)), dict(curve(par))
        assert len(ca) == 6 and all(cb[i] == pytest.approx(ca[i], rel=rel) for i in ca), (s, ca, cb)
        assert_close_weights(one, par, atol=atol)


@pytest.mark.parametrize("family,strategy", [("diffusion", "fsdp"), ("moe", "fsdp"), ("mod", "ddp"), ("float8", "fsdp"),
                                             ("rl", "ddp"), ("rl", "fsdp"), ("resnet", "ddp")])
def test_diffusion_moe_and_mod_match_one_process(parity, family, strategy):
    """FSDP2 on the denoiser's blocks (frozen autoencoder kept whole, EMA sharded like the model)
    and on an MoE LLM's layers, DeepSeek-V3's kind (latent attention, a shared expert, group-limited sigmoid
    routing; expert weights sharded like any other; the router load summed over the ranks for the bias
    balancing): the losses, the weights and the EMA of one process with
    the same global batch; DDP on a Mixture-of-Depths LLM with MoE layers: the losses and the
    decision thresholds (moved by the global batch's top-k boundary, from every rank's decision
    logits); float8 (emulated) under FSDP2:
    each rank scales its own activations, so the losses agree to float8's round-off; GRPO with a KL term
    (each rank samples its own prompts of the global batch, a generator per row): the rewards, losses and
    weights, and the FSDP2 run resumes; a ResNet with train.sync_bn under DDP normalises with the statistics
    of the global batch: the losses and weights (BatchNorm running statistics included)."""
    one, par = parity / family / "one", parity / family / strategy
    log = (par / "log.txt").read_text()
    assert f"parallel: {strategy} over 2 processes" in log
    if family == "float8":
        assert "float8: tensorwise scaling on 9 of 9 linears" in log
        ca, cb = dict(curve(one)), dict(curve(par))
        assert len(ca) == 6 and all(cb[s] == pytest.approx(ca[s], rel=1e-2) for s in ca), (ca, cb)
        return
    assert_same_losses(one, par)
    if family == "rl":
        rewards = [[r.get(k) for r in read_rows(d) if "reward_mean" in r] for d in (one, par)
                   for k in ("reward_mean", "completion_len_mean")]
        assert rewards[:2] == rewards[2:] and len(rewards[0]) == 2
        assert max(r["loss"] for r in read_rows(par) if "loss" in r) > 1e-6  # the KL term: not a zero loss
        assert_close_weights(one, par)
        if strategy == "fsdp":  # resumed from its sharded checkpoint of step 3, on to step 6
            resumed = parity / family / "resumed"
            assert "resumed from" in (resumed / "log.txt").read_text() and curve(resumed)[-1][0] == 6
        return
    if family == "resnet":
        assert re.search(r"sync_bn: \d+ BatchNorm layers normalise", log)
    if family == "mod":  # a top-k choice flips on a round-off difference between near-tied router
        # scores, which moves the routed block's weights by far more than round-off: losses only,
        # and the thresholds, which every rank moves by the boundary of the whole global batch
        one_w, par_w = load_file(str(one / "model.safetensors")), load_file(str(par / "model.safetensors"))
        # (apart by the logits' round-off only; a mean of the ranks' own boundaries would fail this tolerance)
        torch.testing.assert_close(par_w["layers.1.threshold"], one_w["layers.1.threshold"], rtol=1e-3, atol=1e-9)
        assert one_w["layers.1.threshold"].item() != 0.0
        return
    assert_close_weights(one, par)
    if family == "diffusion":
        assert_close_weights(one, par, "model_ema.safetensors")
        assert (par / "samples.png").is_file()


def test_fp16_and_whole_batch_drop_path_match_one_process(parity):
    """fp16 under DDP and FSDP2 (there the GradScaler's inf/nan check of the sharded DTensor gradients is
    all-reduced over the ranks by DTensor): the steps whose gradients overflow are skipped on every rank,
    those one process skips, with the same loss scales; the losses within 1e-5 relative (measured 1.4e-6
    DDP, 9.5e-8 FSDP2) and the weights within 1e-3 absolute (measured 1.3e-4 both): fp16 gradients carry
    a relative round-off of 2^-11, which Adam's lr * g / (|g| + eps) passes on to weights whose gradients
    are near eps (with the default eps both are 1.8e-3 away). model.drop_path_mode=batch (a ResNet with
    sync_bn) under DDP (find_unused_parameters) and FSDP2: each micro-batch's draws come from a generator
    every rank seeds alike, so the ranks drop the blocks one process drops: the losses and weights
    (measured 1.0e-7 and 6e-7)."""
    one = parity / "fp16" / "one"
    for s in BOTH:
        par = parity / "fp16" / s
        scales = [[r["loss_scale"] for r in read_rows(d) if "loss" in r] for d in (one, par)]
        assert scales[0] == scales[1] and len(scales[0]) == 6, scales
        assert scales[0][0] < FP16_SCALE and scales[0][-1] == scales[0][-2]  # overflows first, then steps applied
        ca, cb = dict(curve(one)), dict(curve(par))
        assert all(cb[i] == pytest.approx(ca[i], rel=RTOL) for i in ca) and ca[6] < ca[1], (ca, cb)
        assert_close_weights(one, par, atol=1e-3)
    one = parity / "drop_path" / "one"
    for s in BOTH:
        assert_same_losses(one, parity / "drop_path" / s)
        assert_close_weights(one, parity / "drop_path" / s)


# ------------------------------------------------------------------------------ unfreezing; resuming
UNFREEZE = ["train.unfreeze=[2,4]"]  # the head (its weight tied to the embedding) alone, then a block at steps 2, 4
KILLED = {"lora": ["adapter.method=lora"], "muon": ["optim.name=muon"]}  # FSDP2 runs SIGKILLed, then resumed


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
    - a LoRA and a Muon FSDP2 run SIGKILLed (torchrun and its ranks) right after their first checkpoint, then
      relaunched: the losses and trained weights of the uninterrupted runs, bit for bit.
    Tolerances: losses 1e-6 relative (measured 1.8e-7 unfreezing, 0 resuming 1 -> 2); 1 -> 2 weights 1e-6
    relative (measured 9e-8). Unfrozen weights 1e-5 absolute (measured 1.8e-6 DDP, 4.2e-6 FSDP2): a weight's
    first Adam update, lr * g / (|g| + eps), turns the round-off of its gradient entries near eps into a part
    of lr (with optim.eps=1e-5 instead of 1e-8, the same runs agree to 7e-8)."""
    cfg, d = configs["llm"], tmp_path
    lora, muon = (["train.parallel=fsdp", "train.max_steps=8", *over] for over in KILLED.values())
    one = launch(cfg, d / "one", "train.batch_size=8", *UNFREEZE, nproc=0)
    p = launch(cfg, d, cases=[case(cfg, d / "lora", *lora)])
    kill_after_a_checkpoint(p, d / "lora", d)
    p = launch(cfg, d, cases=[case(cfg, d / "lora", *lora), case(cfg, d / "muon", *muon)])
    kill_after_a_checkpoint(p, d / "muon", d)
    steps = [case(cfg, d / "muon", *muon), case(cfg, d / "lora-ref", *lora), case(cfg, d / "muon-ref", *muon)]
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
    """The run the stopped ones must reproduce, and the sum of its step times in seconds."""
    out = run(configs["llm"], tmp_path_factory.mktemp("uninterrupted"), *KILL)
    rows = read_rows(out)
    return out, sum(r.get("step_time_s", 0) for r in rows)


def tmp_dirs(out: Path) -> set:
    """The temporary directories of checkpoint writes (a killed writer's stay until the next write)."""
    try:
        return {e.name for e in os.scandir(out / "checkpoints") if e.name.startswith(".tmp-")}
    except FileNotFoundError:
        return set()


def assert_bitwise(a: Path, b: Path, name="model.safetensors"):
    wa, wb = load_file(str(a / name)), load_file(str(b / name))
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


def test_sigkill_and_sigterm_of_the_torchrun_job_then_relaunch_is_bitwise_identical(configs, uninterrupted,
                                                                                      tmp_path):
    """An FSDP2 run (with an EMA) stopped again and again and relaunched each time:
    - SIGTERM to torchrun (which forwards it to its workers): both ranks stop at the same step
      after one checkpoint of that step;
    - SIGTERM to the ranks alone: torchrun reports each rank's exit code, 75;
    - SIGKILL to the whole torchrun job (torchrun and both ranks at once) at random moments, at
      least 3 times and at least once while a sharded checkpoint is being written.
    The final weights, EMA and losses equal the uninterrupted 2-process run's bit for bit (same
    world size, same reduction order: nothing rounds differently)."""
    rng = random.Random(0)
    uninterrupted, train_time = uninterrupted
    out = tmp_path / "stopped"
    for target in ("job", "ranks"):
        before = starts(out)
        p = launch(configs["llm"], out, *KILL)
        assert wait_for_training(p, out, before)
        time.sleep(0.3)
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
        before, old_tmp = starts(out), tmp_dirs(out)
        p = launch(configs["llm"], out, *KILL)
        if not wait_for_training(p, out, before):
            break
        if attempt % 2 == 1:  # inside a checkpoint write: a new temporary directory is on disk
            deadline = time.monotonic() + 30
            while not tmp_dirs(out) - old_tmp and p.poll() is None and time.monotonic() < deadline:
                time.sleep(0.0005)
            time.sleep(rng.uniform(0.0, 0.001))  # a tiny model's sharded checkpoint takes a few ms
        else:  # a random moment, scaled to this machine's speed so that the kills fit in the run
            time.sleep(rng.uniform(0.0, 0.3 * train_time))
        if p.poll() is not None:
            break
        kill_job(p)
        kills += 1
        in_write += bool(tmp_dirs(out) - old_tmp)  # left behind: the kill landed before the rename
    print(f"SIGKILLs: {kills}, {in_write} inside a checkpoint write")
    assert kills >= 3 and in_write >= 1, (kills, in_write)
    run(configs["llm"], out, *KILL)
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
