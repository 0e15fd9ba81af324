"""What the torchrun tests share (test_distributed.py, test_distributed_cases.py): tiny configs, launching
train/run.py under torchrun (or plainly) as a subprocess, several runs in one launch (tests/torchrun_cases.py),
signalling a torchrun job, and comparing runs' losses and weights."""
import json
import os
import re
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Optional

import pytest
import torch
import yaml
from safetensors.torch import load_file

from conftest import CPU
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
VIT = {"family": "vit",
       "model": {"arch": "vit_tiny_patch16_224", "embed_dim": 32, "depth": 2, "num_heads": 2, "patch_size": 8,
                 "img_size": 16, "in_chans": 1, "num_classes": 10},
       "data": {"path": "digits", "image_size": 16, "shift": 2},
       "train": {**QUIET, "max_steps": 4, "batch_size": 4, "checkpoint_every": 0},
       "optim": {"lr": 3e-3, "warmup_steps": 1, "layer_decay": 0.7}}
VLM_FILE = yaml.safe_load((ROOT / "configs" / "vlm" / "digits-vqa.yaml").read_text())  # its model, tokenizer
VLM = {**VLM_FILE, "data": {**VLM_FILE["data"], "synthetic_rows": 200, "eval_generate": 0},
       "train": {**QUIET, "max_steps": 4, "batch_size": 4, "checkpoint_every": 0},
       "optim": {"lr": 2e-3, "warmup_steps": 1}}
DIFFUSION = {"family": "diffusion",
             "model": {"image_size": 16, "autoencoder": {"latent_channels": 4, "channels": 8}, "channels": [16, 32],
                       "blocks_per_level": 1, "sample_steps": 2},
             "data": {"dataset": "digits", "ae_steps": 3, "ae_batch_size": 8, "samples_per_class": 1},
             "train": {**QUIET, "max_steps": 3, "batch_size": 4, "checkpoint_every": 0, "ema_decay": 0.9,
                       "samples": True},
             "optim": {"lr": 1e-3, "warmup_steps": 1}}
# text to image: a FLUX.2 transformer on 2x2 latent tokens, conditioned on the cached embeddings of generated captions
TEXT = ["data.format=captions", "data.dataset=digits", "model.denoiser=flux2", "model.prediction=flow",
        "model.sampler=flow_euler", "model.min_snr_gamma=null", "model.flux2.double_depth=1", "model.flux2.single_depth=1",
        "model.flux2.heads=2", "model.flux2.head_dim=16", "model.flux2.rope_axes=[4,4,4,4]", "model.flux2.in_channels=16",
        "model.flux2.text_dim=64", f"model.text_encoder={ROOT / 'configs' / 'llm' / 'qwen3-text-tiny.yaml'}",
        "model.text_layers=[2]", "model.text_length=32"]
MOE = ["model.moe.n_experts=4", "model.moe.top_k=2", "model.moe.expert_hidden=32", "model.moe.balance=bias"]
DEEPSEEK = MOE + ["model.moe.scoring=sigmoid", "model.moe.n_groups=2", "model.moe.topk_groups=1", "model.moe.n_shared=1",
                  "model.mla.kv_rank=16", "model.mla.q_rank=24", "model.mla.rope_dim=8", "model.mla.nope_dim=8",
                  "model.mla.v_dim=16"]  # DeepSeek-V3's ideas: latent attention, group-limited sigmoid routing
NEWER = ["model.qk_norm=true", "model.norm_placement=sandwich", "model.mlp_act=gelu_tanh", "model.embed_scale=true",
         "model.head_dim=24", "model.sliding_window=8", "model.attn_pattern=[local,global]",
         "model.rope_theta_local=100.0", "model.attn_softcap=20.0", "model.attn_sinks=true"]  # Gemma 2/3's and GPT-OSS's
SFT = ["data.format=messages", "data.path=synthetic", "data.synthetic_rows=200", "data.seq_len=128",
       "model.max_seq_len=128", "data.eval_generate=0"]
# LoRA chat SFT of a Qwen3.5-shaped hybrid: Gated DeltaNet layers (chunks of 16 tokens, so documents cross chunks),
# an LFM2 short convolution and gated attention with q/k norms, conversations packed (each layer resets at doc_ids)
HYBRID_SFT = SFT + ["model.n_layers=4", "model.layer_types=[linear_attention,conv,linear_attention,full_attention]",
                    "model.attn_gate=true", "model.qk_norm=true", "model.rotary_fraction=0.5",
                    "model.recurrent.n_heads=2", "model.recurrent.head_dim=16", "model.recurrent.n_v_heads=4",
                    "model.recurrent.conv_kernel=3", "model.recurrent.chunk=16", "data.pack=true",
                    "adapter.method=lora"]


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    from train.data import stdlib_files
    d = tmp_path_factory.mktemp("dist")
    corpus = d / "corpus.txt"
    corpus.write_text("".join(f.read_text(errors="replace") for f in stdlib_files()[:10])[:100_000])
    out = {}
    for name, cfg in {"llm": LLM, "resnet": RESNET, "vit": VIT, "vlm": VLM, "diffusion": DIFFUSION}.items():
        if name == "llm":
            cfg = {**cfg, "data": {**cfg["data"], "path": str(corpus)}}
        out[name] = d / f"{name}.yaml"
        out[name].write_text(yaml.safe_dump(cfg))
    return out


def launch(cfg: Path, out: Path, *overrides, nproc: int = 2, cases: Optional[list] = None,
           env: Optional[dict] = None) -> subprocess.Popen:
    """torchrun with nproc processes (nproc=0: plain `python train/run.py`); its stderr in
    out/stderr-N.txt. cases: instead of one run, the runs (and checkpoint copies) of tests/torchrun_cases.py
    in one launch (cfg and overrides unused); env: variables added to the process's environment."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONFAULTHANDLER": "1", **(env or {})}
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


def run(cfg: Path, out: Path, *overrides, nproc: int = 2, relaunches: int = 0) -> Path:
    """A run to its end. relaunches: how many times a job whose worker a signal killed (a native crash: a rank's
    SIGSEGV mid-training, under load, has been seen once) is launched again, which resumes it, with a warning."""
    for attempt in range(relaunches + 1):
        p = launch(cfg, out, *overrides, nproc=nproc)
        try:
            code = p.wait(300)
        except subprocess.TimeoutExpired:
            kill_job(p)
            raise
        err = last_stderr(out)
        signals = re.findall(r"exitcode\s*: -(\d+)", err)
        if code == 0 or not signals or attempt == relaunches:
            break
        warnings.warn(f"{out}: a worker died of signal {signals[0]}, relaunched; its stack:\n{crash_stack(err)}")
    assert code == 0, crash_stack(err) + err[-3000:]
    return out


def crash_stack(stderr: str) -> str:
    """The Python stack faulthandler printed when a process crashed (PYTHONFAULTHANDLER is set), else ''."""
    at = stderr.find("Fatal Python error")
    return stderr[at:at + 3000] + "\n...\n" if at >= 0 else ""


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


def assert_same_losses(a: Path, b: Path, steps=None, rtol=RTOL):
    ca, cb = dict(curve(a)), dict(curve(b))
    steps = steps or sorted(ca)
    assert steps and all(s in cb for s in steps), (ca, cb)
    for s in steps:
        assert cb[s] == pytest.approx(ca[s], rel=rtol), (s, ca[s], cb[s])


def assert_close_weights(a: Path, b: Path, name="model.safetensors", atol=ATOL, rtol=0.0):
    wa, wb = load_file(str(a / name)), load_file(str(b / name))
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=rtol, atol=atol, msg=k)



def checkpoint_weights(ckpt: Path) -> dict:
    """The model weights of a checkpoint directory, one process's (model.safetensors) or sharded (DCP)."""
    if (ckpt / "model.safetensors").is_file():
        return load_file(str(ckpt / "model.safetensors"))
    import tempfile
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    with tempfile.TemporaryDirectory() as d:
        dcp_to_torch_save(ckpt, Path(d) / "state.pt")
        return torch.load(Path(d) / "state.pt", weights_only=True)["model"]


def assert_bitwise(a: Path, b: Path, name="model.safetensors"):
    wa, wb = load_file(str(a / name)), load_file(str(b / name))
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
