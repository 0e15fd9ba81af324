"""Zoo's own LLM folder (zoo/weights/zoo_folder.py): a train/run.py output folder (config.yaml,
model.safetensors, tokenizer) loads with zoo.from_pretrained and fine-tunes with train.init_from,
including models no Hugging Face format holds (Mixture-of-Depths, MoE routing bias); and a
fine-tuning run from pretrained weights trains in training mode (adapter dropout active)."""
import copy
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

import zoo
from train.config import load_run_config
from train.loop import train
from zoo.config import ConfigError
from zoo.weights import zoo_folder

from test_loop import TINY, losses
from train.metrics import read_rows

# MoD on every other layer and MoE layers with bias balancing: both only Zoo's format can hold
MOD_MOE = copy.deepcopy(TINY)
MOD_MOE["model"].update(n_layers=2, mod_capacity=0.5, mod_every=2,
                        moe={"n_experts": 4, "top_k": 2, "balance": "bias"})
MOD_MOE["train"].update(mod_threshold_rate=0.5, moe_bias_update_rate=0.01)


def run(tmp_path, corpus, name, *over, base=MOD_MOE):
    cfg = load_run_config(None, [f"train.out_dir={tmp_path / name}", f"data.path={corpus}", *over], base=base)
    last = train(cfg, log=lambda m: None)
    rows = read_rows(tmp_path / name)
    return last, rows


@pytest.fixture
def pretrained(tmp_path, text_corpus, one_thread):
    """A MoD + MoE (bias) LLM pretrained for 6 steps on bytes: its run folder."""
    run(tmp_path, text_corpus, "pre", "train.max_steps=6", "optim.warmup_steps=1")
    return tmp_path / "pre"


def test_run_folder_loads_with_everything_it_trained(pretrained):
    assert zoo_folder.detect(pretrained) and zoo_folder.tokenizer_of(pretrained) == "bytes"
    model = zoo.from_pretrained(pretrained)
    sd = load_file(pretrained / "model.safetensors")
    # what no Hugging Face checkpoint holds came back, and it had moved during training
    assert model.layers[1].threshold.item() == sd["layers.1.threshold"].item() != 0.0
    assert torch.equal(model.layers[0].mlp.score_bias, sd["layers.0.mlp.score_bias"])
    assert model.layers[0].mlp.score_bias.abs().sum() > 0
    ref = zoo.build(MOD_MOE["model"])
    ref.load_state_dict(sd, strict=False)  # tied lm_head: stored once
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = model(x), ref.eval()(x)
    assert (got - want).abs().max().item() <= 1e-6  # fp32, the same weights: equal up to round-off
    # bf16 on request; a Zoo-only model saves back as a Zoo folder, not a Hugging Face one
    half = zoo.from_pretrained(pretrained, dtype="bfloat16")
    assert half.embed.weight.dtype == torch.bfloat16 and half.lm_head.weight is half.embed.weight
    assert half.rope.cos.dtype == half.layers[1].threshold.dtype == torch.float32  # buffers stay fp32
    assert half.layers[1].threshold.item() == model.layers[1].threshold.item()
    out = zoo.save_pretrained(model, pretrained.parent / "again")
    assert (out / "config.yaml").is_file() and not (out / "config.json").exists()
    again = zoo.from_pretrained(out)
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), model.state_dict().values()))


def test_mismatched_folder_is_a_one_line_error(pretrained, tmp_path, text_corpus):
    bad = tmp_path / "bad"
    shutil.copytree(pretrained, bad)
    text = (bad / "config.yaml").read_text().replace("d_model: 64", "d_model: 32")
    (bad / "config.yaml").write_text(text)
    with pytest.raises(ValueError) as e:
        zoo.from_pretrained(bad)
    msg = str(e.value)
    assert "\n" not in msg and str(bad / "model.safetensors") in msg and "wrong shape" in msg
    with pytest.raises(ConfigError, match="train.init_from"):  # through the loop: the same line, exit 2
        run(tmp_path, text_corpus, "ft", f"train.init_from={bad}", "adapter.method=prefix", "train.max_steps=2",
            "optim.warmup_steps=1")


def test_lora_on_a_pretrained_mod_run_resumes_bitwise_and_exports_merged(pretrained, tmp_path, text_corpus,
                                                                         one_thread):
    over = [f"train.init_from={pretrained}", "adapter.method=lora", "adapter.r=4", "adapter.dropout=0.1", "adapter.targets=[q_proj,v_proj,o_proj]",
            "train.checkpoint_every=3", "train.keep_checkpoints=5", "train.max_steps=6", "optim.warmup_steps=1",
            "adapter.export_merged=true"]
    _, full = run(tmp_path, text_corpus, "full", *over)
    ck = load_file(tmp_path / "full" / "checkpoints" / "step_00000003" / "model.safetensors")
    assert any("lora_A" in k for k in ck) and "layers.1.threshold" in ck  # the adapters and what else moved
    base_thr = load_file(pretrained / "model.safetensors")["layers.1.threshold"]
    assert ck["layers.1.threshold"].item() != base_thr.item()
    part = tmp_path / "part"  # killed after the step-3 checkpoint
    shutil.copytree(tmp_path / "full", part)
    shutil.rmtree(part / "checkpoints" / "step_00000006")
    for extra in ("adapter", "zoo"):
        shutil.rmtree(part / extra)
    _, resumed = run(tmp_path, text_corpus, "part", *over)
    assert losses(resumed) == losses(full)  # bitwise, step for step
    # the merged export is a Zoo folder (MoD), holding the final checkpoint's thresholds
    merged = zoo.from_pretrained(tmp_path / "full" / "zoo")
    last = load_file(tmp_path / "full" / "checkpoints" / "step_00000006" / "model.safetensors")
    assert merged.layers[1].threshold.item() == last["layers.1.threshold"].item()
    # and the LoRA adapter (PEFT format) loads onto the Zoo folder it names as its base
    adapted = zoo.from_pretrained(tmp_path / "full" / "adapter")
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():  # the top-k forward does not read the thresholds: merged == base + adapter
        assert (merged(x) - adapted(x)).abs().max().item() <= 1e-5


def test_fine_tuning_from_pretrained_weights_trains_in_training_mode(pretrained, tmp_path, text_corpus, one_thread,
                                                                    monkeypatch):
    """from_pretrained returns eval mode; every training forward of the loop runs in training mode
    (MoD thresholds, MoE capacity and jitter, dropout depend on it), evaluation in eval mode."""
    from train.tasks.lm import LMTask
    modes, loss = [], LMTask.loss

    def recording(self, model, batch):
        modes.append({m.training for m in model.modules()})
        return loss(self, model, batch)
    monkeypatch.setattr(LMTask, "loss", recording)
    run(tmp_path, text_corpus, "ft", f"train.init_from={pretrained}", "adapter.method=lora",
        "adapter.targets=[q_proj,v_proj]", "train.max_steps=3", "optim.warmup_steps=1")
    assert modes == [{True}] * 3


def test_a_run_folder_or_checkpoint_without_the_other_file_says_what_is_missing(tmp_path):
    """An unfinished run (config.yaml, no model.safetensors yet) and one of its checkpoints (model.safetensors,
    its config.yaml two folders up): one line each naming the missing file, not 'not a recognised format'."""
    folder = zoo.save_pretrained(zoo.build(MOD_MOE["model"]), tmp_path / "run")
    step = folder / "checkpoints" / "step_00000002"
    step.mkdir(parents=True)
    (folder / "model.safetensors").rename(step / "model.safetensors")
    (step / "manifest.json").write_text("{}")
    for path, needles in ((folder, ["no model.safetensors"]), (step, ["no config.yaml", str(folder / "config.yaml")])):
        with pytest.raises(FileNotFoundError) as e:
            zoo.from_pretrained(path)
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith(str(path)) and all(n in msg for n in needles), msg
    shutil.copy(folder / "config.yaml", step)  # the remedy the message gives
    assert zoo.from_pretrained(step).config.mod_capacity == 0.5


def test_run_folder_holds_its_sentencepiece_tokenizer(tmp_path, text_corpus, one_thread):
    """A run on a trained tokenizer copies it beside model.safetensors; fine-tuning from the folder
    tokenises with it (data.tokenizer left at its default)."""
    base = copy.deepcopy(TINY)
    base["data"] = {"tokenizer": "sentencepiece", "vocab_size": 512, "seq_len": 64}
    base["model"]["vocab_size"] = 512
    run(tmp_path, text_corpus, "sp", "train.max_steps=2", "optim.warmup_steps=1", base=base)
    tok = tmp_path / "sp" / "tokenizer.model"
    assert tok.is_file() and zoo_folder.tokenizer_of(tmp_path / "sp") == str(tok)
    plain = copy.deepcopy(TINY)
    plain["data"] = {"seq_len": 64}
    del plain["model"]
    cfg = load_run_config(None, [f"train.out_dir={tmp_path / 'ft'}", f"data.path={text_corpus}",
                                 f"train.init_from={tmp_path / 'sp'}", "train.max_steps=2", "optim.warmup_steps=1"],
                          base=plain)
    train(cfg, log=lambda m: None)  # a tokenizer trained anew (data.vocab_size's default) would not fit the model
    assert (tmp_path / "ft" / "tokenizer.model").read_bytes() == tok.read_bytes()  # the one it tokenised with


def test_a_folder_written_before_the_runtime_keys_moved_still_loads(tmp_path):
    """config.yaml files written when model: still held attn_backend, activation_checkpointing,
    checkpoint_every, chunked_loss, loss_chunk_size, init_std and the MoE / MoD training settings
    (now train: keys) load as before."""
    import yaml
    model = zoo.build(dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, max_seq_len=16, moe={"n_experts": 2}))
    out = zoo_folder.save(model, tmp_path / "old")
    data = yaml.safe_load((out / "config.yaml").read_text())
    data["model"].update(attn_backend="sdpa", activation_checkpointing=True, checkpoint_every=2, chunked_loss=False,
                         loss_chunk_size=512, init_std=0.02, mod_aux_loss_coef=0.01, mod_threshold_rate=0.02)
    data["model"]["moe"].update(aux_loss_coef=0.01, z_loss_coef=0.001, capacity_factor=None, dispatch="auto")
    (out / "config.yaml").write_text(yaml.safe_dump(data))
    again = zoo.from_pretrained(out)
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), model.state_dict().values()))
