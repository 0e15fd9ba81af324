"""Adapters and gradual unfreezing in the loop: the `adapter:` section, adapter-only checkpoints
that resume bitwise, PEFT export, QLoRA through train/run.py, `train.unfreeze`."""
import json
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import TEST_DEVICE, ROOT, shared_file
from safetensors.torch import load_file

import zoo
from train.config import load_run_config
from train.loop import train
from train.optim import build_optimizer
from train.features.unfreeze import GradualUnfreezing
from zoo.adapters import AdapterConfig, apply_adapters, count_params, param_bytes, trainable_keys

from test_loop import TINY, losses
from train.metrics import read_rows


@pytest.fixture
def base(tmp_path):
    """A tiny random LLM saved as a Hugging Face folder (the base to fine-tune)."""
    torch.manual_seed(0)
    model = zoo.build(TINY["model"])
    return zoo.save_pretrained(model, tmp_path / "base")


def run(tmp_path, corpus, name, *over):
    overrides = [f"train.out_dir={tmp_path / name}", f"data.path={corpus}", *over]
    cfg = load_run_config(None, overrides, base=TINY)
    final = train(cfg, log=lambda m: None)
    rows = read_rows(tmp_path / name)
    return final, rows


@pytest.mark.parametrize("method", ["lora", "dora", "prefix", "prompt", "bottleneck"])
def test_adapter_run_resumes_bitwise_with_adapter_only_checkpoints(tmp_path, text_corpus, base, method, one_thread):
    over = [f"train.init_from={base}", f"adapter.method={method}", "adapter.r=4", "adapter.dropout=0.1",
            "adapter.prefix_len=4", "train.checkpoint_every=4", "train.keep_checkpoints=5", "train.max_steps=8",
            "optim.warmup_steps=1"]
    _, full = run(tmp_path, text_corpus, "full", *over)
    ck = load_file(tmp_path / "full" / "checkpoints" / "step_00000004" / "model.safetensors")
    expect = {"lora": ("lora_A", "lora_B"), "dora": ("lora_A", "lora_B", "magnitude"), "prefix": ("prefix",),
              "prompt": ("prompt",), "bottleneck": ("_adapter",)}[method]
    assert ck and all(any(e in k for e in expect) for k in ck), sorted(ck)[:5]  # only what trains
    part = tmp_path / "part"  # killed after the step-4 checkpoint
    shutil.copytree(tmp_path / "full", part)
    shutil.rmtree(part / "checkpoints" / "step_00000008")
    shutil.rmtree(part / "adapter")
    _, resumed = run(tmp_path, text_corpus, "part", *over)
    assert losses(resumed) == losses(full)  # bitwise, step for step
    name = "zoo_adapter.safetensors" if method in ("prefix", "bottleneck") else "adapter_model.safetensors"
    a, b = load_file(tmp_path / "full" / "adapter" / name), load_file(part / "adapter" / name)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the export (PEFT's format, or Zoo's), loaded onto its base, holds the final checkpoint's adapters
    model = zoo.from_pretrained(tmp_path / "full" / "adapter")
    last = load_file(tmp_path / "full" / "checkpoints" / "step_00000008" / "model.safetensors")
    sd = model.state_dict()
    assert all(torch.equal(sd[k], v) for k, v in last.items())


def test_adapter_resume_refuses_another_adapter(tmp_path, text_corpus, base, one_thread):
    over = [f"train.init_from={base}", "adapter.method=lora", "train.max_steps=2", "optim.warmup_steps=0"]
    run(tmp_path, text_corpus, "a", *over)
    with pytest.raises(Exception, match="trained with adapter"):
        run(tmp_path, text_corpus, "a", *over[:-2], "adapter.alpha=32", "train.max_steps=3", "optim.warmup_steps=0")


def test_merged_export_matches_the_adapter(tmp_path, text_corpus, base, one_thread):
    over = [f"train.init_from={base}", "adapter.method=dora", "adapter.export_merged=true", "train.max_steps=3",
            "optim.warmup_steps=0", "optim.lr=0.01"]
    run(tmp_path, text_corpus, "m", *over)
    x = torch.randint(0, 256, (2, 32))
    with torch.no_grad():
        ad = zoo.from_pretrained(tmp_path / "m" / "adapter")(x)
        merged = zoo.from_pretrained(tmp_path / "m" / "hf")(x)
        plain = zoo.from_pretrained(base)(x)
    assert (ad - plain).abs().max() > 1e-3
    assert (ad - merged).abs().max() <= 1e-4


def test_checkpoint_is_small_at_smollm_shape():
    """LoRA r=8 on all seven projections of the SmolLM-135M shape: what an adapter checkpoint
    holds (trainable tensors + AdamW's two moments) is < 5% of a full one (all weights + moments)."""
    with torch.device("meta"):
        model = zoo.build(ROOT / "configs/llm/smollm-135m.yaml")
    full = 3 * param_bytes(model)
    apply_adapters(model, AdapterConfig(method="lora", r=8))
    sd = model.state_dict()
    held = sum(3 * sd[k].numel() * sd[k].element_size() for k in trainable_keys(model))
    assert held < 0.05 * full, held / full


def test_nf4_base_weights_bound_and_bits(one_thread):
    """NF4 dequantises within half the widest gap between NF4 levels times each block's absmax
    (plus the double-quantised scale's error); the base weights take <= 4.5 bits per parameter."""
    import torchao  # noqa: F401
    from torchao.quantization import to_nf4
    torch.manual_seed(0)
    model = zoo.build(TINY["model"], d_model=128, n_heads=4)
    dense = {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
             and not n.endswith("lm_head")}
    apply_adapters(model, AdapterConfig(method="lora", quantize_base="nf4"))
    levels = to_nf4(torch.randn(64 * 256)).nf4.sort().values
    half_gap = (levels[1:] - levels[:-1]).max() / 2
    n_params, n_bytes = 0, 0
    for name, w in dense.items():
        q = model.get_submodule(name).weight
        assert type(q).__name__ == "NF4Tensor"
        err = (q.get_original_weight() - w).abs().view(-1, 64)
        absmax = w.abs().view(-1, 64).amax(1, keepdim=True)
        assert (err <= absmax * (half_gap + 0.01)).all(), (err / absmax).max()
        n_params += w.numel()
        n_bytes += sum(getattr(q, k).numel() * getattr(q, k).element_size() for k in q.__tensor_flatten__()[0])
    bits = 8 * n_bytes / n_params
    assert bits <= 4.5, bits


def test_qlora_run_on_tinyshakespeare_lowers_val_loss(tmp_path, base):
    import torchao  # noqa: F401
    text = shared_file("data/tinyshakespeare.txt")
    cfg = tmp_path / "run.yaml"
    import yaml
    cfg.write_text(yaml.safe_dump({**TINY, "data": {"tokenizer": "bytes", "seq_len": 64, "path": str(text)}}))
    out = tmp_path / "q"
    r = subprocess.run([sys.executable, "train/run.py", str(cfg), f"train.out_dir={out}", f"train.init_from={base}",
                        "adapter.method=lora", "adapter.quantize_base=nf4", "train.max_steps=30", "train.eval_every=1",
                        "optim.lr=0.01", "optim.warmup_steps=2", "train.checkpoint_every=0"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    rows = read_rows(out)
    val = [r["val_loss"] for r in rows if "val_loss" in r]
    assert val[-1] < val[0] - 0.1, val
    assert "linear weights in NF4" in (out / "log.txt").read_text()
    assert (out / "adapter" / "adapter_model.safetensors").is_file()


def test_gradual_unfreezing_stages_and_frozen_weights_never_change(text_corpus, one_thread):
    torch.manual_seed(0)
    model = zoo.build(TINY["model"])
    cfg = load_run_config(None, [f"data.path={text_corpus}"], base=TINY)
    from train.tasks.lm import LMTask
    task = LMTask(cfg, TEST_DEVICE, lambda m: None)
    groups = task.unfreeze_groups(model)
    assert len(groups) == 2 + 2  # head (+ norm), 2 blocks, embedding
    steps = [2, 4, 6]
    unf = GradualUnfreezing(model, groups, steps, 0.1, log=lambda m: None)
    opt = build_optimizer(model, cfg.optim, TEST_DEVICE, lambda m: None)
    names = {id(p): n for n, p in model.named_parameters()}
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    g = torch.Generator().manual_seed(0)
    for step in range(8):
        unf.advance(step, opt)
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        expect = {names[id(p)] for grp in unf.groups[:unf.stage(step)] for p in grp}
        assert trainable == expect
        in_opt = {names[id(p)] for grp in opt.param_groups for p in grp["params"]}
        assert in_opt == expect
        x = torch.randint(0, 256, (4, 32), generator=g)
        _, loss = model(x, x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        for n, p in model.named_parameters():
            if n not in trainable:
                assert torch.equal(p, start[n]), f"frozen {n} changed at step {step}"
            else:
                assert not torch.equal(p, start[n]), f"trainable {n} did not change at step {step}"
    # stage by stage: the head alone, then the top block, ...
    assert [unf.stage(s) for s in range(8)] == [1, 1, 2, 2, 3, 3, 4, 4]
    assert "lm_head.weight" in {names[id(p)] for p in unf.groups[0]} or model.config.tie_embeddings


def test_unfreezing_stages_through_dcp_state_dicts_and_what_the_model_froze(text_corpus, one_thread):
    """The stages' optimizer groups survive DCP's optimizer state dict (how torchrun runs checkpoint): a tied head
    with the final norm trains first, all of it without weight decay, so no empty decay group is made (DCP maps
    groups by their parameters' names and would hand an empty one back without its hyperparameters). A part the
    model keeps frozen (here the first block) stays frozen through every stage."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
    cfg = load_run_config(None, [f"data.path={text_corpus}"], base=TINY)
    from train.tasks.lm import LMTask
    task = LMTask(cfg, TEST_DEVICE, lambda m: None)

    def staged():
        torch.manual_seed(0)
        model = zoo.build(TINY["model"])
        assert model.lm_head.weight is model.embed.weight
        model.layers[0].requires_grad_(False)
        unf = GradualUnfreezing(model, task.unfreeze_groups(model), [1, 2], 0.1, log=lambda m: None)
        opt = build_optimizer(model, cfg.optim, TEST_DEVICE, lambda m: None)
        return model, unf, opt

    model, unf, opt = staged()
    assert [len(g["params"]) for g in opt.param_groups] == [2]  # the tied head and the norm, no decay
    x = torch.randint(0, 256, (2, 16))
    for step in range(3):
        unf.advance(step, opt)
        model(x, x)[1].backward()
        opt.step()
        opt.zero_grad()
    assert not any(p.requires_grad for p in model.layers[0].parameters())
    assert all(p.requires_grad for n, p in model.named_parameters() if not n.startswith("layers.0."))
    again, unf2, opt2 = staged()
    unf2.restore(opt2, 3)
    set_optimizer_state_dict(again, opt2, get_optimizer_state_dict(model, opt))
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt2.param_groups] == \
        [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]


def test_unfreeze_run_resumes_bitwise(tmp_path, text_corpus, one_thread):
    over = ["train.unfreeze=[2,4]", "train.checkpoint_every=3", "train.keep_checkpoints=5", "train.max_steps=6",
            "optim.warmup_steps=1"]
    _, full = run(tmp_path, text_corpus, "full", *over)
    part = tmp_path / "part"
    shutil.copytree(tmp_path / "full", part)
    shutil.rmtree(part / "checkpoints" / "step_00000006")
    (part / "model.safetensors").unlink()
    _, resumed = run(tmp_path, text_corpus, "part", *over)
    assert losses(resumed) == losses(full)
    a, b = load_file(tmp_path / "full" / "model.safetensors"), load_file(part / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_unfreeze_resnet_trains_top_down(tmp_path, one_thread):
    """A ResNet: fc first, then the blocks from the top; the stem and lower stages, never unfrozen in
    this run, end with their initial weights, the unfrozen parts with changed ones."""
    cfg = load_run_config(str(ROOT / "configs/convnet/resnet-digits.yaml"),
                          [f"train.out_dir={tmp_path / 'r'}", "train.max_steps=6", "train.unfreeze=[2,4]",
                           "train.eval_every=0", "train.progress=false", "train.samples=false", "train.plot=false",
                           "train.ema_decay=null", "optim.warmup_steps=1"])
    torch.manual_seed(cfg.train.seed)
    init = zoo.build(cfg.model).state_dict()
    train(cfg, log=lambda m: None)
    final = load_file(tmp_path / "r" / "model.safetensors")
    params = {n for n, _ in zoo.build(cfg.model).named_parameters()}
    changed = {n for n in params if not torch.equal(init[n], final[n])}
    unfrozen = {n for n in params if n.startswith(("fc.", "layer4.0.", "layer3.0."))}
    assert changed == unfrozen, sorted(changed ^ unfrozen)


@pytest.mark.parametrize("over,msg", [
    (["adapter.method=lora", "adapter.targets=[q_proj,qq_proj]"], "adapter.targets: qq_proj not in this model"),
    (["adapter.quantize_base=nf4"], "adapter.quantize_base"),
    (["adapter.method=lora", "adapter.r=0"], "adapter.r"),
    (["train.unfreeze=[5,3]"], "train.unfreeze"),
    (["adapter.method=lora", "train.unfreeze=[3]"], "train.unfreeze"),
    (["adapter.method=prefix", "adapter.export_merged=true"], "adapter.export_merged"),
])
def test_adapter_config_errors_are_one_line(tmp_path, text_corpus, over, msg):
    from zoo.config import ConfigError
    with pytest.raises(ConfigError, match=msg) as e:
        run(tmp_path, text_corpus, "bad", *over)
    assert "\n" not in str(e.value)


def test_checkpoint_averaging_of_an_adapter_run(tmp_path, text_corpus, base, one_thread):
    """`train.average_last` on adapter-only checkpoints: the adapters are averaged, the frozen base
    comes from the model, and the average is evaluated."""
    over = [f"train.init_from={base}", "adapter.method=lora", "adapter.r=4", "train.max_steps=6",
            "train.checkpoint_every=2", "train.keep_checkpoints=3", "train.average_last=2", "optim.warmup_steps=1",
            "optim.lr=0.01"]
    final, _ = run(tmp_path, text_corpus, "avg", *over)
    out = tmp_path / "avg"
    a, b = (load_file(out / "checkpoints" / f"step_{s:08d}" / "model.safetensors") for s in (4, 6))
    avg = load_file(out / "model_avg.safetensors")
    assert avg.keys() == a.keys() and all("lora_" in k for k in avg)
    assert all(torch.allclose(avg[k], (a[k] + b[k]) / 2, rtol=0, atol=1e-7) for k in avg)
    assert final["avg_val_loss"] != final["val_loss"]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["prompt", "bottleneck"])
def test_prompt_and_bottleneck_runs_resume_bitwise_after_sigkill(tmp_path, text_corpus, base, method):
    """train/run.py with prompt tuning or bottleneck adapters, SIGKILLed past its first checkpoint and run again:
    the exported adapter and every logged loss equal the uninterrupted run's, bit for bit."""
    import os
    import signal
    import yaml
    from conftest import wait_for_step
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump({**TINY, "data": {"tokenizer": "bytes", "seq_len": 64, "path": str(text_corpus)}}))
    over = [f"train.init_from={base}", f"adapter.method={method}", "adapter.prefix_len=4", "adapter.r=4",
            "train.max_steps=30", "train.checkpoint_every=5", "optim.warmup_steps=2"]

    def launch(name):
        return subprocess.Popen([sys.executable, "train/run.py", str(cfg), f"train.out_dir={tmp_path / name}", *over],
                                cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert launch("full").wait(600) == 0
    p = launch("killed")
    assert wait_for_step(p, tmp_path / "killed", 12), "the run ended before it could be killed"
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert launch("killed").wait(600) == 0
    assert "resumed from" in (tmp_path / "killed" / "log.txt").read_text()
    assert losses(read_rows(tmp_path / "killed")) == losses(read_rows(tmp_path / "full"))
    name = "zoo_adapter.safetensors" if method == "bottleneck" else "adapter_model.safetensors"
    a, b = (load_file(tmp_path / r / "adapter" / name) for r in ("full", "killed"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
