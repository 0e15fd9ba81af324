"""The loop end to end on a tiny LLM: learning, exact resume, precision/compile paths, metrics."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from train.config import load_run_config
from train.loop import train
from train.metrics import read_rows
from conftest import TEST_DEVICE, CPU

TINY = {
    "family": "llm",
    "model": {"vocab_size": 256, "d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "max_seq_len": 64},
    "data": {"tokenizer": "bytes", "seq_len": 64},
    "train": {"max_steps": 40, "batch_size": 8, "log_every": 1, "eval_every": 0, "eval_batches": 4,
              "checkpoint_every": 0, "progress": False, "samples": False, "plot": False},
    "optim": {"lr": 3e-3, "warmup_steps": 5},
}


def run(tmp_path, corpus, name="run", **over):
    overrides = [f"train.out_dir={tmp_path / name}", f"data.path={corpus}"] + [f"{k}={v}" for k, v in over.items()]
    cfg = load_run_config(None, overrides, base=TINY)
    final = train(cfg, log=lambda m: None)
    rows = read_rows(tmp_path / name)
    return final, rows


def losses(rows):
    return [(r["step"], r["loss"]) for r in rows if "loss" in r]


def test_short_run_lowers_loss_and_writes_outputs(tmp_path, text_corpus, one_thread):
    final, rows = run(tmp_path, text_corpus, **{"train.plot": True, "train.samples": True, "train.max_steps": 150})
    ls = [l for _, l in losses(rows)]
    assert sum(ls[-5:]) / 5 < sum(ls[:5]) / 5 - 1.0, ls
    out = tmp_path / "run"
    for f in ("model.safetensors", "metrics.jsonl", "loss.png", "config.yaml", "samples.txt", "log.txt"):
        assert (out / f).is_file(), f
    row = [r for r in rows if "loss" in r][-1]
    for k in ("step", "loss", "lr", "grad_norm", "tokens_per_s", "mfu", "peak_mem_gb"):
        assert k in row
    assert final["val_loss"] < final["unigram_entropy"]


def check_resume_is_exact(tmp_path, corpus, last: int, **over):
    """A run of `last` steps, and a copy of it killed after its previous checkpoint (the last
    checkpoint, weights and metrics dropped) and resumed: the same losses and weights, bitwise."""
    _, full = run(tmp_path, corpus, "full", **over)
    part = tmp_path / "part"
    shutil.copytree(tmp_path / "full", part)
    shutil.rmtree(part / "checkpoints" / f"step_{last:08d}")
    (part / "model.safetensors").unlink()
    _, resumed = run(tmp_path, corpus, "part", **over)
    assert losses(resumed) == losses(full)  # bitwise-equal floats, step for step
    a, b = load_file(tmp_path / "full" / "model.safetensors"), load_file(part / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    return part, a


def test_resume_continues_exactly(tmp_path, text_corpus, one_thread):
    check_resume_is_exact(tmp_path, text_corpus, 20, **{"train.checkpoint_every": 10, "train.keep_checkpoints": 5,
                                                        "train.max_steps": 20})


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_runs(tmp_path, text_corpus, precision, one_thread):
    _, rows = run(tmp_path, text_corpus, **{"train.precision": precision, "train.max_steps": 3, "optim.warmup_steps": 1})
    assert all(torch.isfinite(torch.tensor(l)) for _, l in losses(rows))


def test_train_leaves_the_callers_backend_settings_as_it_found_them(tmp_path, text_corpus, one_thread):
    """train() called from the user's code applies train.deterministic (and on CUDA TF32 and cudnn.benchmark)
    for the run and restores the caller's settings when it returns."""
    seen, was = {}, torch.are_deterministic_algorithms_enabled()  # (a test before may have run a process's way)
    torch.use_deterministic_algorithms(False)
    try:
        before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cuda.matmul.allow_tf32,
                  torch.backends.cudnn.benchmark)
        cfg = load_run_config(None, [f"train.out_dir={tmp_path / 'r'}", f"data.path={text_corpus}",
                                     "train.max_steps=2", "train.deterministic=true", "optim.warmup_steps=1"], base=TINY)
        train(cfg, log=lambda m: seen.__setitem__("during", torch.are_deterministic_algorithms_enabled()))
        assert seen["during"] is True and before[0] is False
        assert (torch.are_deterministic_algorithms_enabled(), torch.backends.cuda.matmul.allow_tf32,
                torch.backends.cudnn.benchmark) == before
    finally:
        torch.use_deterministic_algorithms(was)


def test_compile_and_accumulation_run(tmp_path, text_corpus, one_thread):
    _, rows = run(tmp_path, text_corpus, **{"train.compile": True, "train.max_steps": 3, "train.grad_accum": 2, "optim.warmup_steps": 1})
    assert len(losses(rows)) == 3 and all(torch.isfinite(torch.tensor(l)) for _, l in losses(rows))


def test_grad_accumulation_matches_bigger_batch(tmp_path, text_corpus):
    """Two micro-batches of 4 rows give the update of one batch of those 8 rows (the loop's
    optimizer_step with SGD at lr 1: the update is minus the gradient; fp32, <= 1e-6), and the
    loop logs the mean of the two micro-batch losses."""
    import copy
    from train.step import optimizer_step
    from train.tasks.lm import LMTask
    cfg = load_run_config(None, [f"data.path={text_corpus}", "train.grad_accum=2", "train.batch_size=4",
                                 f"train.out_dir={tmp_path / 'acc'}", "train.max_steps=1", "optim.warmup_steps=0"], base=TINY)
    task = LMTask(cfg, TEST_DEVICE, lambda m: None)
    task.setup()
    torch.manual_seed(cfg.train.seed)
    model = task.build_model()
    micro = [task.train_batch(0, m) for m in range(2)]
    expected = sum(task.loss(model, b)[0].item() for b in micro) / 2
    accumulated, whole = copy.deepcopy(model), copy.deepcopy(model)
    opt = torch.optim.SGD(accumulated.parameters(), lr=1.0)
    r = optimizer_step(lambda b: task.loss(accumulated, b), iter(micro), 2, opt,
                       torch.amp.GradScaler("cpu", enabled=False), list(accumulated.parameters()), None)
    assert r.applied and r.loss == pytest.approx(expected, abs=1e-6)
    task.loss(whole, tuple(torch.cat(parts) for parts in zip(*micro)))[0].backward()
    for (name, p), p0, big in zip(accumulated.named_parameters(), model.parameters(), whole.parameters()):
        assert (p0 - p - big.grad).abs().max() <= 1e-6, name
    _, rows = run(tmp_path, text_corpus, "acc", **{"train.grad_accum": 2, "train.batch_size": 4, "train.max_steps": 1, "optim.warmup_steps": 0})
    assert losses(rows)[0][1] == pytest.approx(expected, abs=1e-5)


def test_cpu_keep_memory_keeps_freed_blocks_and_release_returns_them():
    """train.cpu_keep_memory (Linux glibc): by default glibc maps a 64 MiB tensor on its own and
    unmaps it when freed (the resident memory drops by 64 MiB, and the next step faults all its
    pages in again); after keep_freed_memory() a freed block stays with the process for reuse;
    after release_freed_memory() glibc's defaults are back and freeing returns memory again.
    Run in a fresh process: the setting is process-wide."""
    import platform
    import subprocess
    import sys
    if sys.platform != "linux" or platform.libc_ver()[0] != "glibc":
        pytest.skip("needs Linux with glibc")
    code = """
import torch
from train.hardware import keep_freed_memory, release_freed_memory
def rss():
    return int(open('/proc/self/statm').read().split()[1]) * 4096
def returned_by_free():
    x = torch.ones(64 * 2**20 // 4)
    before = rss()
    del x
    return before - rss()
plain = returned_by_free()
assert keep_freed_memory()
kept = returned_by_free()
assert release_freed_memory()
released = returned_by_free()
print(plain, kept, released)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    plain, kept, released = (int(v) / 2**20 for v in out.stdout.split())
    assert plain >= 60 and kept < 4 and released >= 60, (plain, kept, released)  # MiB


def test_lm_task_names_the_attention_it_runs(tmp_path, text_corpus):
    from train.tasks.lm import LMTask
    logs = []
    for backend, expected in (("auto", "attention: sdpa (auto, for 64 keys)"), ("bmm", "attention: bmm")):
        cfg = load_run_config(None, [f"data.path={text_corpus}", f"train.attn_backend={backend}",
                                     f"train.out_dir={tmp_path}"], base=TINY)
        task = LMTask(cfg, TEST_DEVICE, logs.append)
        task.setup()
        task.build_model()
        assert expected in logs, logs


def test_peak_flops_size_is_set_by_flops_not_by_a_slow_first_timing(monkeypatch):
    """measure_peak_flops times a matmul of a size fixed by the device (PEAK_SIZES), so a first
    timing slowed by a busy machine neither shrinks the matmul nor lowers the peak (the fastest of
    the timed runs counts). A fake clock: the warm-up takes 10 s, every later matmul 10 ms."""
    import train.hardware as hw
    clock = {"t": 0.0, "calls": 0}

    def perf_counter():
        clock["calls"] += 1
        if clock["calls"] % 2 == 0:  # the end of a timed matmul
            clock["t"] += 10.0 if clock["calls"] == 2 else 0.01
        return clock["t"]
    monkeypatch.setattr(hw.time, "perf_counter", perf_counter)
    peak = hw.measure_peak_flops(CPU, None)
    n = hw.PEAK_SIZES["cpu"]
    assert peak == pytest.approx(2 * n ** 3 / 0.01)


def test_mfu_is_never_above_100_percent(tmp_path, text_corpus, monkeypatch):
    """A peak measured far too low at the start (a busy machine) makes the achieved rate exceed it:
    the peak is measured again and the log says so; what is still above is capped."""
    import train.metrics as metrics
    peaks = iter([1e3, 2e3])  # FLOP/s: far below what any step achieves
    monkeypatch.setattr(metrics, "measure_peak_flops", lambda device, dtype: next(peaks))
    logs = []
    cfg = load_run_config(None, [f"train.out_dir={tmp_path / 'r'}", f"data.path={text_corpus}", "train.max_steps=3",
                                 "optim.warmup_steps=1"], base=TINY)
    train(cfg, log=logs.append)
    rows = read_rows(tmp_path / "r")
    assert all(0 < r["mfu"] <= 1.0 for r in rows if "mfu" in r)
    assert any(m.startswith("mfu above 100%") and "measured again" in m for m in logs), logs
    assert any(m.startswith("mfu above 100%") and "capped" in m for m in logs), logs


def test_the_plain_model_takes_the_runs_runtime_settings(tmp_path, text_corpus):
    """run.plain_model() (the averaged and the gathered weights of a torchrun run) is evaluated as the trained model
    is: with model.final_softcap and train.chunked_loss=false (configs/llm/speedrun.yaml) its loss is computed."""
    from train.builder import build_run
    cfg = load_run_config(None, [f"data.path={text_corpus}", f"train.out_dir={tmp_path}", "model.final_softcap=15",
                                 "train.chunked_loss=false", "train.eval_batches=1"], base=TINY)
    run = build_run(cfg)
    plain = run.plain_model()
    assert plain.chunked_loss is False and "val_loss" in run.task.evaluate(plain)
