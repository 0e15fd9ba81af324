"""Preference tuning (train/tasks/dpo.py): the DPO and SimPO losses against their formulas, a short
DPO run on a toy preference set, LoRA + DPO with the base (adapters off) as the reference."""
import json
import math
import random

import pytest
import torch

import zoo
from train.builder import build_run
from train.config import load_run_config
from train.eval import sequence_logps
from train.loop import train, train_step
from train.metrics import read_rows
from train.tasks.dpo import DPOTask, preference_loss
from zoo.adapters import quantize_nf4
from zoo.config import ConfigError

MODEL = {"vocab_size": 256, "d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "max_seq_len": 64}


def toy_pairs(path, n, seed):
    """Prompt `word=`; chosen: the word in capitals, rejected: the word as it is (a preference a
    model must learn from the pairs: both responses copy the prompt)."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            w = "".join(rng.choice("abcdefghij") for _ in range(rng.randint(3, 6)))
            f.write(json.dumps({"prompt": w + "=", "chosen": w.upper(), "rejected": w}) + "\n")
    return path


def config(tmp_path, pairs, *over):
    base = {"family": "llm", "model": MODEL,
            "data": {"format": "preference", "path": str(pairs), "tokenizer": "bytes", "seq_len": 24,
                     "val_fraction": 0.2},
            "train": {"max_steps": 20, "batch_size": 8, "log_every": 1, "eval_every": 0, "checkpoint_every": 0,
                      "progress": False, "samples": False, "plot": False, "out_dir": str(tmp_path / "run"),
                      "peak_flops": 1e12},  # no matmul measured for MFU
            "optim": {"lr": 3e-3, "warmup_steps": 2}}
    return load_run_config(None, list(over), base=base)


def _logsigmoid(x):
    return -math.log1p(math.exp(-x))


@pytest.mark.parametrize("ls", [0.0, 0.2])
def test_dpo_loss_is_the_formula(ls):
    g = torch.Generator().manual_seed(0)
    pol, ref = -10 * torch.rand(8, generator=g, dtype=torch.float64), -10 * torch.rand(8, generator=g, dtype=torch.float64)
    n = torch.randint(1, 9, (8,), generator=g)
    beta = 0.3
    losses, rc, rr = preference_loss(pol, ref, n, "dpo", beta, ls)
    for i in range(4):
        z = beta * ((pol[i] - ref[i]) - (pol[4 + i] - ref[4 + i])).item()
        want = -(1 - ls) * _logsigmoid(z) - ls * _logsigmoid(-z)
        assert losses[i].item() == pytest.approx(want, abs=1e-12)
        assert rc[i].item() == pytest.approx(beta * (pol[i] - ref[i]).item(), abs=1e-12)
        assert rr[i].item() == pytest.approx(beta * (pol[4 + i] - ref[4 + i]).item(), abs=1e-12)


def test_simpo_loss_is_the_formula():
    g = torch.Generator().manual_seed(1)
    pol = -10 * torch.rand(6, generator=g, dtype=torch.float64)
    n = torch.randint(1, 9, (6,), generator=g)
    beta, gamma, ls = 2.0, 0.5, 0.1
    losses, rc, rr = preference_loss(pol, None, n, "simpo", beta, ls, gamma)
    for i in range(3):
        c, r = beta * pol[i].item() / n[i].item(), beta * pol[3 + i].item() / n[3 + i].item()
        want = -(1 - ls) * _logsigmoid(c - r - gamma) - ls * _logsigmoid(gamma - c + r)
        assert losses[i].item() == pytest.approx(want, abs=1e-12)
        assert (rc[i].item(), rr[i].item()) == pytest.approx((c, r), abs=1e-12)


def test_dpo_run_raises_the_held_out_margin_and_accuracy(tmp_path, one_thread):
    cfg = config(tmp_path, toy_pairs(tmp_path / "pairs.jsonl", 200, 0))
    run = build_run(cfg)
    assert isinstance(run.task, DPOTask) and run.task.reference is not None
    before = run.task.evaluate(run.model)  # policy = reference: every reward 0, no pair ranked right
    assert before["val_reward_margin"] == 0 and before["val_reward_accuracy"] == 0
    assert before["val_loss"] == pytest.approx(math.log(2), abs=1e-6)
    final = train(cfg, log=lambda m: None)
    assert final["val_reward_margin"] > 1.0 and final["val_reward_accuracy"] >= 0.9, final
    assert final["val_loss"] < 0.5 * math.log(2)
    rows = [r for r in read_rows(tmp_path / "run") if "reward_margin" in r]
    assert len(rows) == 20 and all(k in rows[0] for k in ("rewards_chosen", "rewards_rejected", "reward_accuracy"))
    assert rows[-1]["reward_margin"] > rows[0]["reward_margin"]


def test_simpo_run_raises_the_held_out_margin(tmp_path, one_thread):
    cfg = config(tmp_path, toy_pairs(tmp_path / "pairs.jsonl", 200, 0), "data.loss=simpo", "data.beta=2.0",
                 "train.max_steps=15")
    final = train(cfg, log=lambda m: None)
    assert final["val_reward_accuracy"] >= 0.9 and final["val_reward_margin"] > 0.5, final


@pytest.mark.parametrize("method", ["lora", "dora", "prefix", "qlora"])
def test_adapter_dpo_uses_the_base_as_reference(tmp_path, method, one_thread):
    if method == "qlora":
        import torchao  # noqa: F401
    torch.manual_seed(0)
    base = zoo.save_pretrained(zoo.build(MODEL), tmp_path / "base")
    nf4 = ["adapter.quantize_base=nf4"] if method == "qlora" else []
    cfg = config(tmp_path, toy_pairs(tmp_path / "pairs.jsonl", 60, 1), f"train.init_from={base}",
                 f"adapter.method={method.replace('qlora', 'lora')}", "adapter.r=4", "adapter.prefix_len=4",
                 "optim.lr=0.02", *nf4)
    run = build_run(cfg)
    assert run.task.reference is None  # no second copy of the model
    for step in range(3):
        train_step(run, step)
    batch = run.task.train_batch(0, 0)
    x, y, _ = batch
    plain = zoo.from_pretrained(base, dtype=torch.float32).eval()
    if method == "qlora":  # the reference is the base as the run holds it: in NF4
        quantize_nf4(plain)
    with torch.no_grad():
        want = sequence_logps(plain, x, y)[0]
        policy = sequence_logps(run.model, x, y)[0]
    ref = run.task.reference_logps(run.model, batch)
    torch.testing.assert_close(ref, want, atol=1e-4, rtol=0)  # the base, whatever the adapters learned
    assert (policy - want).abs().max() > 1e-2  # the adapters did change the policy
    with torch.no_grad():
        again = sequence_logps(run.model, x, y)[0]
    torch.testing.assert_close(again, policy)  # and they are back on after the reference


def test_full_dpo_reference_is_the_frozen_initial_model(tmp_path, one_thread):
    cfg = config(tmp_path, toy_pairs(tmp_path / "pairs.jsonl", 60, 2))
    run = build_run(cfg)
    pre = build_run(config(tmp_path, cfg.data.path, "data.reference=precomputed"))
    assert pre.task.reference is None and pre.task.reference_table.shape == (60, 2)
    init = {k: v.clone() for k, v in run.model.state_dict().items()}
    losses = [(train_step(run, step)[0].loss, train_step(pre, step)[0].loss) for step in range(3)]
    assert losses[0][0] == pytest.approx(math.log(2), abs=1e-6)  # the policy starts as the reference
    assert losses[-1][0] < losses[0][0] - 0.01  # and moves away from it
    for a, b in losses:  # the precomputed table is the frozen copy's log-probabilities
        assert a == pytest.approx(b, abs=1e-5)
    ref = run.task.reference
    assert not any(p.requires_grad for p in ref.parameters())
    assert all(torch.equal(v, init[k]) for k, v in ref.state_dict().items())
    assert any(not torch.equal(v, init[k]) for k, v in run.model.state_dict().items())


def test_preference_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="data.path"):
        config(tmp_path, "")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "chosen": "b"}\nnot json\n')
    from train.data import DataError
    with pytest.raises(DataError, match="bad.jsonl: no usable preference rows .2 malformed"):
        build_run(config(tmp_path, bad))


def test_chat_prompts_are_rendered_with_the_template_and_only_the_last_answer_scored(tmp_path, one_thread):
    from train.data import ByteTokenizer
    from train.data.conversations import ChatTemplate
    from train.data.preference import encode_response
    chatml, tok = ChatTemplate.builtin("chatml"), ByteTokenizer()
    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
              {"role": "assistant", "content": "hello"}, {"role": "user", "content": "2+2?"}]
    ids, labels = encode_response(tok, prompt, "4", chatml)
    assert tok.decode(ids) == chatml.render(prompt + [{"role": "assistant", "content": "4"}])
    assert tok.decode([t for t in labels if t != -100]) == "4" + chatml.end_of_turn  # not the earlier "hello"
    rows = [{"prompt": [{"role": "user", "content": w + "="}], "chosen": [{"role": "assistant", "content": w.upper()}],
             "rejected": w} for w in ("abc", "defg", "hij", "klmn", "opq")]
    pairs = tmp_path / "chat.jsonl"
    pairs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = config(tmp_path, pairs, "data.template=chatml", "data.seq_len=96", "model.max_seq_len=128",
                 "train.batch_size=2")
    run = build_run(cfg)
    c_ids, c_labels, r_ids, r_labels = run.task.data.train[0]
    assert tok.decode(c_ids).startswith("<|im_start|>user\nabc=<|im_end|>")
    assert tok.decode([t for t in c_labels if t != -100]) == "ABC<|im_end|>"
    assert tok.decode([t for t in r_labels if t != -100]) == "abc<|im_end|>"
    r, *_ = train_step(run, 0)
    assert math.isfinite(r.loss) and r.loss == pytest.approx(math.log(2), abs=1e-5)  # the policy starts as the reference
    run.task.save_files(tmp_path)
    assert ChatTemplate.from_pretrained(tmp_path).source == chatml.source  # the run folder keeps its template


def test_dpo_run_resumes_exactly(tmp_path, one_thread):
    """Killed after a checkpoint, the run resumes with the same pairs and the same reference (the
    precomputed one is made again from the initial weights, not from the checkpoint's)."""
    import shutil
    pairs = toy_pairs(tmp_path / "pairs.jsonl", 40, 3)
    over = ["data.reference=precomputed", "train.max_steps=6", "train.checkpoint_every=3", "train.batch_size=4"]
    train(config(tmp_path, pairs, *over), log=lambda m: None)
    part = tmp_path / "part"
    shutil.copytree(tmp_path / "run", part)
    shutil.rmtree(part / "checkpoints" / "step_00000006")
    train(config(tmp_path, pairs, *over, f"train.out_dir={part}"), log=lambda m: None)
    full, resumed = read_rows(tmp_path / "run"), read_rows(part)
    assert [r["loss"] for r in full if "loss" in r] == [r["loss"] for r in resumed if "loss" in r]


def test_synthetic_pairs_come_from_the_embedded_conversations(tmp_path):
    from train.data import DataError
    from train.data import chat_example
    from train.data.preference import synthetic_pairs
    rows = synthetic_pairs("train", 40)
    assert len(rows) >= 36 and all(r["chosen"] != r["rejected"] for r in rows)
    convs = chat_example.conversations("train", 44)
    assert rows[0]["prompt"] == convs[0][:-1] and rows[0]["chosen"] == convs[0][-1]["content"]
    held = {r["chosen"] for r in synthetic_pairs("val", 40)}
    assert held and not held & {r["chosen"] for r in rows if "name" not in r["chosen"]}  # other numbers and words
    cfg = config(tmp_path, "synthetic", "data.synthetic_rows=20", "data.template=chatml", "data.seq_len=160",
                 "model.max_seq_len=160")
    run = build_run(cfg)
    assert len(run.task.data.train) + len(run.task.data.val) <= 20 and len(run.task.data.val) >= 1
    with pytest.raises(DataError, match="needs a chat template.*set data.template"):
        build_run(config(tmp_path, "synthetic", "data.synthetic_rows=20"))
