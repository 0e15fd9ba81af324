"""The memory planner (train/planner.py; its program train/plan.py): live-byte counting, optimizer
states against the real optimizers, depth extrapolation, the large presets without allocating them,
the command line, and one prediction against a measured peak."""
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from train.benches.harness import rss
from train.config import load_run_config
from train.optim import build_optimizer, state_bytes
from train import planner
from train.plan import main as plan_main
from conftest import TEST_DEVICE, CPU, CUDA

ROOT = Path(__file__).resolve().parents[1]
SMALL = {"family": "llm",
         "model": {"vocab_size": 512, "d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "max_seq_len": 64},
         "data": {"tokenizer": "bytes", "seq_len": 64}, "train": {"batch_size": 4, "precision": "fp32"}}


def cfg_of(*over, base=SMALL):
    return load_run_config(None, list(over), base=base)


def test_live_bytes_counts_storages_once_and_forgets_the_dead():
    counter = planner.LiveBytes()
    with counter:
        a = torch.empty(1000)
        b = a.view(10, 100)[2:]             # a view: the same storage, not counted again
        c = torch.empty(300, dtype=torch.float64)
        both = a.numel() * a.element_size() + c.numel() * c.element_size()
        assert counter.live == both and counter.peak == both
        del a, b
        assert counter.live == c.numel() * c.element_size()
        assert counter.peak == both
        counter.reset_peak()
        assert counter.peak == counter.live


@pytest.mark.parametrize("over", [f"optim.name={n}" for n in ("adamw", "sgd", "adagrad", "rmsprop", "adafactor", "lion", "muon", "galore")]
                         + ["train.precision=bf16-pure"])
def test_planned_optimizer_states_are_those_of_the_real_optimizer(over, monkeypatch):
    """The plan's states come from the optimizer run on fake tensors (bf16-pure's torchao AdamW: from its
    layout); the reference is the same optimizer stepped for real (train.optim.state_bytes)."""
    monkeypatch.setattr(torch, "compile", lambda fn=None, **kw: fn)  # torchao's step, eagerly (a CPU compile is slow)
    cfg = cfg_of(over, "optim.galore_rank=8")
    torch.manual_seed(0)
    model = planner.build_model(cfg)
    opt = build_optimizer(model, cfg.optim, TEST_DEVICE, lambda m: None)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    static = planner._static(cfg, TEST_DEVICE, 1)
    assert static.states == state_bytes(opt) > 0
    size = 2 if "bf16-pure" in over else 4
    assert static.params == sum(p.numel() * size for p in set(model.parameters()))


def test_adamw8bit_state_layout_matches_torchao():
    import torchao  # noqa: F401
    from torchao.optim import AdamW8bit
    params = [torch.nn.Parameter(torch.zeros(s)) for s in [(64, 128), (100,), (4096,), (33, 128), (3, 1000)]]
    opt = AdamW8bit(params)
    real = 0
    for p in params:  # the two moments as torchao makes them, plus the step counter
        for t in (opt._new_buffer(p, True), opt._new_buffer(p, False), torch.tensor(0.0)):
            real += planner._bytes([t])
    assert planner.adamw8bit_state_bytes(params) == real


def test_deep_stacks_extrapolate_to_the_full_simulation(monkeypatch):
    monkeypatch.setattr(planner, "SIMULATE_FULL_DEPTH", 8)
    cfg = cfg_of("model.n_layers=12")
    extrapolated = planner.plan(cfg)
    assert extrapolated.extrapolated_from == [2, 4]
    monkeypatch.setattr(planner, "SIMULATE_FULL_DEPTH", 100)
    full = planner.plan(cfg)
    assert full.extrapolated_from is None
    assert extrapolated.breakdown["params"] == full.breakdown["params"]
    assert abs(extrapolated.peak_bytes - full.peak_bytes) <= 0.01 * full.peak_bytes


def test_llama2_7b_is_planned_without_allocating_it():
    cfg = load_run_config(str(ROOT / "configs/llm/llama2-7b.yaml"))
    m = cfg.model
    d, f, V, L = m.d_model, m.resolved_ffn_hidden, m.vocab_size, m.n_layers
    n_params = 2 * V * d + L * (4 * d * d + 3 * d * f + 2 * d) + d  # untied embeddings, MHA, SwiGLU, 2 norms
    before = rss()
    p = planner.plan(cfg)
    grown = rss() - before
    assert p.breakdown["params"] == 4 * n_params  # fp32 master weights
    assert p.breakdown["grads"] == 4 * n_params and p.breakdown["optimizer_states"] >= 8 * n_params
    assert grown < 1 * 2 ** 30, grown  # the weights alone would be 25 GiB
    assert p.extrapolated_from is not None and len(p.per_layer_activations) == L


def test_fsdp2_shards_and_ddp_replicates():
    cfg = cfg_of()
    one, ddp, fsdp = planner.plan(cfg), planner.plan(cfg, 4, "ddp"), planner.plan(cfg, 4, "fsdp2")
    for k in ("params", "grads", "optimizer_states"):
        assert ddp.breakdown[k] == one.breakdown[k]
        assert fsdp.breakdown[k] == one.breakdown[k] // 4
    tensors = lambda p: p.peak_bytes - p.breakdown["allocator"]  # noqa: E731
    assert tensors(ddp) == tensors(one) + one.breakdown["grads"]  # DDP's gradient buckets
    assert fsdp.breakdown["activations"] > one.breakdown["activations"]  # gathered blocks


def test_zero2_keeps_the_whole_model_gathered_and_offload_moves_the_shards_to_the_host():
    """ZeRO-2 (train.fsdp_reshard=false): FSDP2's shards plus every parameter gathered from forward to backward,
    where FSDP2 holds two blocks' (counted on the built model); train.fsdp_offload on a CUDA plan: the shards in
    host memory."""
    import zoo
    sides = (([], CPU), (["train.fsdp_reshard=false"], CPU), ([], CUDA), (["train.fsdp_offload=true"], CUDA))
    fsdp, zero2, on, off = (planner.plan(cfg_of("train.parallel=fsdp", *o), 4, "fsdp2", device=d) for o, d in sides)
    model = zoo.build({"model": SMALL["model"]})
    nbytes = lambda ps: sum(p.numel() * p.element_size() for p in ps)  # noqa: E731 (fp32; a tied weight once)
    block = max(nbytes(u.parameters()) for u in model.repeated_units())
    sharded = ("params", "grads", "optimizer_states")
    assert all(zero2.breakdown[k] == fsdp.breakdown[k] for k in sharded)
    assert zero2.breakdown["activations"] - fsdp.breakdown["activations"] == nbytes(model.parameters()) - 2 * block
    assert off.host_bytes == sum(on.breakdown[k] for k in sharded) > 0 and not any(off.breakdown[k] for k in sharded)
    assert off.peak_bytes < on.peak_bytes


def test_the_settings_that_fit_are_under_the_budget_and_cheapest_first():
    cfg = cfg_of("train.chunked_loss=false", "train.batch_size=8", "model.vocab_size=4096")
    full = planner.plan(cfg).peak_bytes
    budget = int(0.6 * full)
    found = planner.fits(cfg, budget, top=3)
    assert found, "no setting fits"
    assert all(q.peak_bytes <= budget for _, _, q in found)
    assert [s for s, _, _ in found] == sorted(s for s, _, _ in found)
    assert planner.fits(cfg, full + 1, top=3)[0][1] == []  # as configured


def run_cli(*args):
    return subprocess.run([sys.executable, "train/plan.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def test_cli_json():
    out = run_cli("configs/llm/tiny.yaml", "train.batch_size=2", "--json", "--memory", "1GB")
    assert out.returncode == 0, out.stderr
    obj = json.loads(out.stdout)
    assert obj["peak_bytes"] == sum(obj["breakdown"].values())
    assert obj["fits"][0]["overrides"] == []  # as configured


@pytest.mark.parametrize("args, word", [(["configs/llm/tiny.yaml", "--memory", "24XB"], "24XB"),
                                        (["configs/llm/tiny.yaml", "train.batchsize=2"], "train.batchsize"),
                                        (["configs/llm/missing.yaml"], "missing.yaml"),
                                        (["configs/llm/tiny.yaml", "--devices", "0"], "--devices")])
def test_cli_bad_input_is_one_line(args, word, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert plan_main(args) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and word in err, err


def test_post_training_configs_are_planned():
    """The shipped SFT, preference (DPO) and RL (GRPO) configs plan a step of their own task's loss (with their
    train.init_from left out: the planner builds the model from the config's model section)."""
    for name, over in (("tiny-sft", []), ("tiny-sft", ["data.format=preference", "data.path=synthetic"]),
                       ("tiny-grpo", []), ("tiny-grpo", ["adapter.method=lora", "rl.kl_beta=0.05"])):
        cfg = load_run_config(str(ROOT / "configs/llm" / f"{name}.yaml"), ["train.init_from=null", *over])
        assert planner.plan(cfg, device=CPU).peak_bytes > 0, (name, over)


def test_a_fine_tuning_is_planned_before_its_base_is_trained(tmp_path, capsys, monkeypatch):
    """plan.py on configs/llm/tiny-grpo.yaml where its train.init_from (runs/tiny-sft) does not exist yet: planned
    from the config's model section, as the config states it for the planner."""
    monkeypatch.chdir(tmp_path)
    assert plan_main([str(ROOT / "configs/llm/tiny-grpo.yaml"), "--json"]) == 0, capsys.readouterr().err
    assert json.loads(capsys.readouterr().out)["peak_bytes"] > 0


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc")
def test_prediction_is_not_under_a_fresh_measurement():
    """The plan (the tensors and the CPU's allocator margin) against a fresh process's measured
    peak (train.planner.measure, the loop's own step): never under it, not far over it (the memory
    bench's worst-case target). The tensors left after the steps (weights, optimizer state, EMA,
    batch) are the planned ones, byte for byte."""
    from train.benches.memory import CONFIGS, base_of
    spec, over = CONFIGS["diffusion bf16 (batch 64)"]
    base, over = base_of(spec), [*over, "train.batch_size=8"]
    p = planner.plan(cfg_of(*over, base=base))
    m = planner.measure_in_subprocess(base, over, threads=1)
    assert m["peak"] <= p.peak_bytes <= 1.6 * m["peak"], (p.peak_bytes, m["peak"])
    b = p.breakdown
    assert m["live"] == b["params"] + b["buffers"] + b["optimizer_states"] + b["ema"] + b["inputs"]


def test_live_bytes_counts_one_device_only():
    counter = planner.LiveBytes("cuda")
    counter.add(torch.empty(100))  # a host tensor: where offloaded activations live
    assert counter.live == 0


def test_activation_offload_is_skipped_off_cuda_in_one_line(tmp_path, text_corpus):
    from tests.test_loop import TINY
    from train.loop import train
    logs = []
    cfg = load_run_config(None, [f"train.out_dir={tmp_path / 'r'}", f"data.path={text_corpus}", "train.max_steps=2",
                                 "optim.warmup_steps=1", "train.activation_offload=true"], base=TINY)
    train(cfg, log=logs.append)
    assert [m for m in logs if m.startswith("activation offload:")] == [
        "activation offload: skipped on cpu (CUDA only: activations already live in host memory)"]


def test_planned_tensors_are_those_of_the_real_step():
    """The plan's tensor part is exact: the same step run on real tensors (simulate(fake=False),
    every storage allocated) holds the same bytes at rest, at the forward/backward and optimizer
    peaks, per checkpointed block and in the loss, and allocates and frees the same blocks (the
    trace the heap is replayed from; only the order of a few frees inside the backward differs).
    bf16 autocast with checkpointing on every block: autocast's weight copies, made again in the
    recomputation, are counted as the real run makes them."""
    cfg = cfg_of("train.precision=bf16", "train.activation_checkpointing=true")
    fake = planner.simulate(cfg, TEST_DEVICE)
    real = planner.simulate(cfg, TEST_DEVICE, fake=False)
    for k in ("persistent", "params", "grads", "states", "inputs", "forward_backward", "optimizer_step",
              "per_unit", "logits"):
        assert getattr(fake, k) == getattr(real, k), k
    assert fake.forward_backward > 0 and len(fake.per_unit) == 2
    assert sorted(fake.events) == sorted(real.events)


def test_a_cpu_plan_adds_the_stated_allocator_margin():
    """On a CPU the allocator part is the family's CPU_MARGIN (a share of the tensors' peak plus a
    constant), said in a note; off the CPU (the CUDA caching allocator's replay) it is not."""
    cpu = CPU
    p = planner.plan(cfg_of(), device=cpu)
    tensors = p.peak_bytes - p.breakdown["allocator"]
    share, constant = planner.CPU_MARGIN["llm"]
    assert p.breakdown["allocator"] == round(share * tensors) + constant
    assert any("allocator's margin" in n for n in p.notes)
    assert planner.allocator_overhead([(1, 100), (1, -100)], cpu) == 0


def test_cuda_replay_rounds_blocks_and_keeps_segments():
    """The CUDA caching allocator's rules (cuda_reserved_peak): a small request takes a 2 MiB segment,
    a large one below 10 MiB a 20 MiB segment, a larger one its size rounded up to 2 MiB; freed
    blocks stay reserved and are reused by the best fit."""
    MiB = planner.MiB
    assert planner.cuda_reserved_peak([(1, 100)]) == 2 * MiB
    assert planner.cuda_reserved_peak([(1, 5 * MiB)]) == 20 * MiB
    assert planner.cuda_reserved_peak([(1, 21 * MiB + 1)]) == 22 * MiB
    assert planner.cuda_reserved_peak([(1, 5 * MiB), (1, -5 * MiB), (2, 8 * MiB)]) == 20 * MiB
    assert planner.cuda_reserved_peak([(1, 5 * MiB), (2, 8 * MiB), (3, 8 * MiB)]) == 40 * MiB


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (torch.cuda.max_memory_reserved)")
def test_cuda_plan_is_not_under_max_memory_reserved():
    """On a GPU the plan (the step's allocations replayed through the caching allocator's rules) is
    not under what the allocator reserved for the same step, nor far over it."""
    dev = CUDA
    cfg = cfg_of("train.precision=bf16", "model.d_model=256", "model.n_layers=4", "train.batch_size=8",
                 "model.max_seq_len=256", "data.seq_len=256")
    p = planner.plan(cfg, device=dev)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)
    base = torch.cuda.memory_reserved(dev)
    planner.simulate(cfg, dev, fake=False)
    reserved = torch.cuda.max_memory_reserved(dev) - base
    assert reserved <= p.peak_bytes <= 1.6 * reserved, (p.peak_bytes, reserved)


def test_a_cuda_plan_from_any_machine_with_pasteable_settings(capsys, monkeypatch):
    """--device cuda plans for a GPU on a machine without one (precision resolved for it and printed);
    the same command gives the same plan every time; every suggestion, pasted after train/run.py's
    command as printed, is accepted by the config loader."""
    monkeypatch.chdir(ROOT)
    cuda = CUDA
    peak = planner.plan(load_run_config("configs/llm/tiny.yaml", ["train.batch_size=64"]), device=cuda).peak_bytes
    args = ["configs/llm/tiny.yaml", "train.batch_size=64", "--device", "cuda", "--memory", str(int(0.6 * peak))]
    outs = []
    for _ in range(2):
        assert plan_main(args) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1]
    head = outs[0].splitlines()[0]
    assert "device=cuda" in head and "precision=bf16" in head, head
    lines = [line for line in outs[0].splitlines() if "python train/run.py" in line]
    assert len(lines) >= 2 and "(as configured)" not in outs[0], outs[0]
    for line in lines:
        tokens = shlex.split(line.split("python train/run.py", 1)[1])
        cfg = load_run_config(tokens[0], tokens[1:])  # the overrides as printed
        assert cfg.train.device == "auto"
    tiny = [planner.plan(cfg_of(), device=cuda).peak_bytes for _ in range(5)]
    assert len(set(tiny)) == 1
    on_cuda = cfg_of("train.device=cuda")  # a device as data; the run's own device, planned from here without a crash
    assert plan_main(["configs/llm/tiny.yaml", "train.device=cuda", "--json"]) == 0  # a device as data
    assert json.loads(capsys.readouterr().out)["device"] == "cuda"
    assert on_cuda.train.device == "cuda"


# ------------------------------------------------------------------------------ a run far too big, refused
def test_a_run_far_over_its_memory_is_refused_in_one_line_with_the_settings_that_fit():
    """On a GPU (simulated here) whose memory is under the weights, gradients and AdamW states by more than
    REFUSE_OVER, with room for them once the states go to host memory: refused, naming the plan, the memory
    and the planner's setting that fits; train.ignore_plan lets it start; the same run with room is not refused."""
    over = ["model.d_model=2048", "model.n_layers=2", "model.vocab_size=2048", "data.seq_len=32", "train.batch_size=1"]
    cfg = cfg_of(*over)
    floor = planner.floor_bytes(cfg, CUDA)
    offload = planner.plan(cfg_of(*over, "optim.name=adamw_offload"), device=CUDA).peak_bytes
    assert offload < floor / planner.REFUSE_OVER  # the case this test is about
    budget = int((offload + floor / planner.REFUSE_OVER) / 2)
    why = planner.refusal(cfg_of(*over, f"train.memory_budget={budget}"), CUDA)
    assert why is not None and "\n" not in why
    assert f"needs {planner.fmt_bytes(floor)} for the weights, gradients and optimizer states" in why
    assert f"the {planner.fmt_bytes(budget)} train.memory_budget" in why and "optim.name=adamw_offload" in why
    assert planner.refusal(cfg_of(*over, f"train.memory_budget={budget}", "train.ignore_plan=true"), CUDA) is None
    assert planner.refusal(cfg_of(*over, f"train.memory_budget={floor}"), CUDA) is None


def test_the_embedded_default_is_not_refused_here():
    from train.config import load_run_config
    assert planner.refusal(load_run_config(str(ROOT / "configs/llm/tiny.yaml")), CPU) is None


@pytest.mark.slow
def test_deepseek_v3_on_this_machine_is_refused_before_it_allocates(tmp_path):
    """The preset's 671B parameters: refused in one line, in a process that allocates nothing of the model."""
    out = subprocess.run([sys.executable, "train/run.py", "configs/llm/deepseek-v3.yaml", "train.max_steps=20",
                          f"train.out_dir={tmp_path}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    err = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert out.returncode == 2 and len(err) == 1, out.stderr
    assert re.search(r"the plan needs [\d.]+ GiB for the weights, gradients and optimizer states alone, over 1\.5x the "
                     r"[\d.]+ [KMGT]iB free on \w+; no setting fits one device: FSDP2 over at least \d+ .*"
                     r"train\.ignore_plan=true", err[0]), err[0]


@pytest.mark.parametrize("saved", [False, True], ids=["config-file", "folder"])
def test_a_text_to_image_plan_counts_the_text_encoder_and_the_prompt_cache_as_the_run_makes_them(saved, tmp_path):
    """A text-to-image plan: the text encoder's weights are those of the encoder the run builds (from its config file,
    kept in host memory to the end; or from the folder it was saved to, freed after setup), embedding a batch of
    prompts holds what the same embedding holds on real tensors, and the prompt cache's bytes are those of the cache
    the run writes."""
    import zoo
    from parallel_runs import DIFFUSION, TEXT
    from train.data.latents import prompt_cache
    from train.tasks.text_to_image import TextEncoder, load_captioned
    over = [*TEXT, "train.batch_size=2", "data.encode_batch_size=8"]
    cfg = load_run_config(None, over, base=DIFFUSION)
    if saved:
        zoo.save_pretrained(TextEncoder(cfg.model, cfg.source, CPU).llm, tmp_path / "encoder")
        cfg = load_run_config(None, [*over, f"model.text_encoder={tmp_path / 'encoder'}"], base=DIFFUSION)
    text, enc = planner.text_side(cfg, CPU), TextEncoder(cfg.model, cfg.source, CPU)
    tensors = [*enc.llm.parameters(), *enc.llm.buffers()]  # the RoPE tables too: buffers outside the state dict
    assert text["text_encoder"] == sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                                        for t in tensors}.values())
    assert text["text_encoding"] == planner.text_side(cfg, CPU, fake=False)["text_encoding"] > 0
    prompts = load_captioned(cfg.data, cfg.model.image_size, cfg.source, lambda m: None)[1]
    cache = prompt_cache(tmp_path / "prompts", enc.key(), prompts, enc.embed, log=lambda m: None)
    assert text["prompt_cache"] == cache.nbytes
    p = planner.plan(cfg, device=CPU)
    assert p.breakdown["prompt_cache"] == cache.nbytes and p.setup_bytes == text["text_encoder"] + text["text_encoding"]
    assert p.breakdown["text_encoder"] == (0 if saved else text["text_encoder"])
