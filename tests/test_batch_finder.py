"""train.batch_size: auto on a CPU with train.memory_budget: the largest micro-batch whose planned
peak fits, the global batch kept by accumulation; its measured peak is under the budget."""
import json
from pathlib import Path

import pytest
import torch
import yaml

from train import planner
from train.config import load_run_config
from train.loop import train
from train.step import RunStopped
from zoo.config import ConfigError
from train.metrics import read_rows
from conftest import CPU

BASE = {"family": "llm",
        "model": {"vocab_size": 2048, "d_model": 128, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "max_seq_len": 128},
        "data": {"tokenizer": "bytes", "seq_len": 128},
        "train": {"max_steps": 2, "log_every": 1, "eval_every": 0, "eval_batches": 1, "checkpoint_every": 0,
                  "chunked_loss": False, "progress": False, "samples": False, "plot": False, "precision": "fp32"},
        "optim": {"warmup_steps": 0}}
GLOBAL = 32


def run_auto(tmp_path, corpus, budget, name="run"):
    over = [f"train.out_dir={tmp_path / name}", f"data.path={corpus}", "train.batch_size=auto",
            f"train.global_batch={GLOBAL}", f"train.memory_budget={budget}"]
    logs = []
    train(load_run_config(None, over, base=BASE), log=logs.append)
    return logs, yaml.safe_load((tmp_path / name / "config.yaml").read_text())["train"]


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_the_chosen_batch_fits_and_the_next_does_not(tmp_path, text_corpus, one_thread):
    cfg = load_run_config(None, [], base={**BASE, "train": {**BASE["train"], "batch_size": 1}})
    p8, p16 = (planner.plan(cfg, batch_size=b).peak_bytes for b in (8, 16))
    budget = (p8 + p16) // 2
    logs, chosen = run_auto(tmp_path, text_corpus, budget)
    b, accum = chosen["batch_size"], chosen["grad_accum"]
    assert (b, accum) == (8, 4) and b * accum == GLOBAL
    assert any(m.startswith("batch size: auto -> micro-batch 8 x 4") for m in logs), logs
    rows = read_rows(tmp_path / "run")
    steps = [r for r in rows if "loss" in r]
    assert len(steps) == 2 and all(r["tokens_per_s"] > 0 for r in steps)
    measured = planner.measure_in_subprocess(BASE, [f"train.batch_size={b}"], threads=1)["peak"]
    assert measured <= budget < planner.plan(cfg, batch_size=16).peak_bytes, (measured, budget)


def test_a_budget_too_small_is_a_one_line_error(tmp_path, text_corpus):
    """A budget that holds the weights, gradients and optimizer states (so the run is not refused outright) but
    not a micro-batch's activations."""
    floor = planner.floor_bytes(load_run_config(None, [], base={**BASE, "train": {**BASE["train"], "batch_size": 1}}),
                                CPU)
    with pytest.raises(RunStopped, match="micro-batch of 1 is planned at") as e:
        run_auto(tmp_path, text_corpus, floor)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("over, key", [(["train.batch_size=auto"], "train.global_batch"),
                                       (["train.batch_size=auto", "train.global_batch=8", "train.memory_budget=lots"],
                                        "train.memory_budget"),
                                       (["train.batch_size=0"], "train.batch_size")])
def test_config_errors(over, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as e:
        load_run_config(None, over, base=BASE)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("fast", ["bf16", "fp32"])
def test_precision_auto_plans_the_dtype_the_loop_runs(tmp_path, text_corpus, monkeypatch, fast):
    """train.precision: auto resolves from measured matmul speeds. The batch finder plans the dtype
    the loop resolved (not a measurement of its own), and the planner on its own resolves it as the
    loop does: here the CPU is made to look bf16-fast, then fp32-fast."""
    import train.step as step
    speed = {torch.bfloat16: 3.0, None: 1.0} if fast == "bf16" else {torch.bfloat16: 1.0, None: 3.0}
    monkeypatch.setattr(step, "measure_peak_flops", lambda device, dtype, **kw: speed[dtype] * 1e11)
    planned = []
    real_plan = planner.plan
    monkeypatch.setattr(planner, "plan", lambda cfg, **kw: planned.append(cfg.train.precision) or real_plan(cfg, **kw))
    monkeypatch.setattr(planner, "_AUTO", {})
    base = {**BASE, "train": {**BASE["train"], "precision": "auto"}}
    over = [f"train.out_dir={tmp_path / 'run'}", f"data.path={text_corpus}", "train.batch_size=auto",
            f"train.global_batch={GLOBAL}", "train.memory_budget=64GB"]
    logs = []
    train(load_run_config(None, over, base=base), log=logs.append)
    assert any(m.startswith(f"precision: auto -> {fast}") for m in logs), logs
    assert planned and set(planned) == {fast}  # every plan the finder made, in the loop's dtype
    cfg = load_run_config(None, [], base={**base, "train": {**base["train"], "batch_size": 1}})
    assert planner._precision(cfg, CPU) == fast


def test_out_of_memory_mid_step_halves_the_micro_batch_and_redoes_the_step(tmp_path, text_corpus, monkeypatch,
                                                                          one_thread):
    """A CUDA out-of-memory error injected once, in step 1's second micro-batch (its first already backpropagated):
    the run halves the micro-batch, keeps the global batch by accumulation, says so, and redoes the step; its losses
    then equal, bitwise, those of a run started at that micro-batch (the same data, the same computation)."""
    from train.tasks.lm import LMTask
    cfg = load_run_config(None, [], base={**BASE, "train": {**BASE["train"], "batch_size": 1}})
    p8, p16 = (planner.plan(cfg, batch_size=b).peak_bytes for b in (8, 16))
    real, seen = LMTask.loss, []

    def loss(self, model, batch):
        if type(batch[0]).__name__ == "FakeTensor":  # the batch finder's plans
            return real(self, model, batch)
        seen.append(len(batch[0]))
        if len(seen) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return real(self, model, batch)
    monkeypatch.setattr(LMTask, "loss", loss)
    logs, chosen = run_auto(tmp_path, text_corpus, (p8 + p16) // 2)
    assert seen == [8, 8] + [4] * 8 * BASE["train"]["max_steps"]
    assert (chosen["batch_size"], chosen["grad_accum"]) == (4, 8)  # config.yaml: a resume keeps the smaller batch
    assert any(m.startswith("step 1: a micro-batch of 8 ran out of memory: now 4 x 8 accumulated") for m in logs), logs
    monkeypatch.setattr(LMTask, "loss", real)
    train(load_run_config(None, [f"train.out_dir={tmp_path / 'fixed'}", f"data.path={text_corpus}",
                                 "train.batch_size=4", "train.grad_accum=8"], base=BASE), log=lambda m: None)
    losses = [[(r["step"], r["loss"]) for r in read_rows(tmp_path / d) if "loss" in r] for d in ("run", "fixed")]
    assert losses[0] == losses[1] and len(losses[0]) == BASE["train"]["max_steps"]
