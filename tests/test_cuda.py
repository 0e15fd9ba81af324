"""The CUDA-only paths, each against its reference on the same GPU: flash-attn, activation offloading, TF32 and
cudnn.benchmark, NCCL, FSDP2's CPU offload, float8's real kernels, CUDA-graph decoding, pinned batches. Skipped, with the reason, on
a machine without CUDA; on a GPU they run with the rest of the suite (ZOO_TEST_DEVICE=cuda, docs/gpu.md).
FlexAttention's backward and flash-attn's varlen kernel: tests/test_doc_masks.py; the planner against
max_memory_reserved: tests/test_plan.py."""
import os
import subprocess
import sys

import pytest
import torch

import zoo
from train.config import load_run_config
from train.loop import train
from train.metrics import read_rows
from zoo.blocks import attention as A

from conftest import CUDA, ROOT

DEVICES_NAMED = True  # each test names CUDA (and the CPU) itself: no default device (conftest)
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (this machine has no CUDA device)")

RUN = {
    "family": "llm",
    "model": {"vocab_size": 256, "d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 128,
              "max_seq_len": 64},
    "data": {"tokenizer": "bytes", "seq_len": 64},
    "train": {"max_steps": 4, "batch_size": 4, "log_every": 1, "eval_every": 0, "eval_batches": 2, "device": str(CUDA),
              "checkpoint_every": 0, "progress": False, "samples": False, "plot": False, "export": False},
    "optim": {"lr": 3e-3, "warmup_steps": 1},
}


def run(tmp_path, corpus, name, *over, log=None):
    cfg = load_run_config(None, [f"train.out_dir={tmp_path / name}", f"data.path={corpus}", *over], base=RUN)
    final = train(cfg, log=log or (lambda m: None))
    return final, [(r["step"], r["loss"]) for r in read_rows(tmp_path / name) if "loss" in r]


@pytest.mark.parametrize("window", [None, 24])
def test_flash_attention_equals_the_math_reference(window):
    if A.flash_available() is None:
        pytest.skip("flash-attn is not installed (pip install -e '.[flash]')")
    g = torch.Generator(device=CUDA).manual_seed(0)
    q = torch.randn(2, 4, 64, 32, device=CUDA, dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(2, 2, 64, 32, device=CUDA, dtype=torch.bfloat16, generator=g) for _ in range(2))
    want = A.attend_math(q, k, v, A.attention_mask(64, 64, window, CUDA))
    torch.testing.assert_close(A.attend(q, k, v, "flash", window), want, atol=2e-2, rtol=2e-2)  # bf16 kernels


def test_activation_offload_trains_as_without(tmp_path, text_corpus):
    logs = []
    _, plain = run(tmp_path, text_corpus, "plain")
    _, offloaded = run(tmp_path, text_corpus, "offload", "train.activation_offload=true", log=logs.append)
    assert any(m.startswith("activation offload: saved activations go to pinned host memory") for m in logs), logs
    assert offloaded == pytest.approx(plain, rel=1e-6)  # the same tensors, saved in host memory and brought back


def test_tf32_and_cudnn_benchmark_apply_for_the_run_and_are_restored(tmp_path, text_corpus):
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.benchmark)
    during, logs = [], []

    def log(m):
        logs.append(m)
        during.append((torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.benchmark))
    run(tmp_path, text_corpus, "tf32", "train.tf32=true", "train.cudnn_benchmark=true", log=log)
    assert "backends: cuda, tf32=True, cudnn.benchmark=True" in logs and during[-1] == (True, True)
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.benchmark) == before


def test_nccl_with_one_process(tmp_path, text_corpus):
    import yaml
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump({**RUN, "data": {**RUN["data"], "path": str(text_corpus)}}))
    out = tmp_path / "ddp"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                        str(ROOT / "train" / "run.py"), str(cfg), f"train.out_dir={out}", "train.parallel=ddp"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "parallel: ddp over 1 processes (nccl)" in (out / "log.txt").read_text()


def test_fsdp_offload_trains_as_without(tmp_path, text_corpus):
    """train.fsdp_offload (CPUOffloadPolicy: shards in pinned host memory, the optimizer stepping on the CPU, gloo
    beside NCCL) under torchrun on the GPUs there are (at most 2): the losses and weights of FSDP2 without it, to
    the round-off of an optimizer step on the CPU instead of the GPU (1e-5)."""
    import yaml
    from safetensors.torch import load_file
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump({**RUN, "data": {**RUN["data"], "path": str(text_corpus)}}))
    n = min(2, torch.cuda.device_count())
    for name, over in (("plain", []), ("offload", ["train.fsdp_offload=true"])):
        r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
                            str(ROOT / "train" / "run.py"), str(cfg), f"train.out_dir={tmp_path / name}",
                            "train.parallel=fsdp", *over], cwd=ROOT, capture_output=True, text=True, timeout=600,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert r.returncode == 0, r.stderr[-3000:]
    assert "parameters, gradients and optimizer states in host memory" in (tmp_path / "offload" / "log.txt").read_text()
    curves = [[(r["step"], r["loss"]) for r in read_rows(tmp_path / d) if "loss" in r] for d in ("plain", "offload")]
    assert len(curves[0]) == 4 and curves[1] == pytest.approx(curves[0], rel=1e-5)
    a, b = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("plain", "offload"))
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-5, msg=k)


def test_float8_real_kernels_agree_with_the_emulation(tmp_path, text_corpus):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip(f"float8 matmuls need compute capability 8.9+ ({torch.cuda.get_device_name()} has "
                    f"{torch.cuda.get_device_capability()})")
    import copy
    import dataclasses

    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    torch.manual_seed(0)
    lin = torch.nn.Sequential(torch.nn.Linear(256, 512)).to(CUDA)
    cfg = Float8LinearConfig.from_recipe_name("tensorwise")
    real = convert_to_float8_training(copy.deepcopy(lin), config=cfg)
    emulated = convert_to_float8_training(copy.deepcopy(lin), config=dataclasses.replace(cfg, emulate=True))
    x = torch.randn(64, 256, device=CUDA)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        torch.testing.assert_close(real(x).float(), emulated(x).float(), atol=5e-2, rtol=5e-2)  # float8 accumulation
    logs = []
    _, losses = run(tmp_path, text_corpus, "f8", "train.float8=true", "train.precision=bf16", log=logs.append)
    said = [m for m in logs if m.startswith("float8:")]
    assert said and "emulated" not in said[0] and all(torch.isfinite(torch.tensor(l)) for _, l in losses)


@pytest.mark.parametrize("batch", [1, 3])
def test_cuda_graph_decoding_gives_the_tokens_of_eager_decoding(batch):
    torch.manual_seed(0)
    model = zoo.build(zoo.config.LLMConfig(**RUN["model"])).to(CUDA).eval()
    ids = torch.randint(0, 256, (batch, 8), device=CUDA)
    eager = model.generate(ids, 24)
    assert torch.equal(model.generate(ids, 24, compile="reduce-overhead"), eager)
    assert torch.equal(model.generate(ids, 24, compile="reduce-overhead"), eager)  # replayed graphs
    if batch > 1:  # left-padded rows: their keys masked in the replayed step
        mask = torch.ones_like(ids)
        mask[0, :3] = 0
        eager = model.generate(ids, 24, attention_mask=mask)
        assert torch.equal(model.generate(ids, 24, compile="reduce-overhead", attention_mask=mask), eager)


def test_batches_come_pinned_and_on_the_gpu(text_corpus):
    from train.tasks.lm import LMTask
    cfg = load_run_config(None, [f"data.path={text_corpus}"], base=RUN)
    task = LMTask(cfg, CUDA, lambda m: None)
    task.setup()
    x, y = task.data.batch("train", 2, torch.Generator().manual_seed(0), CUDA)
    assert x.device.type == "cuda" and y.device.type == "cuda"
    assert task.data.windows("train", 2, torch.Generator().manual_seed(0), pin=True).is_pinned()
