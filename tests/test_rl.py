"""Reinforcement learning with verifiable rewards (train/tasks/rl.py): each variant's loss and gradient
against the formula computed token by token, advantages, rewards, the prompts loader, and short runs:
metrics, LoRA with the base as the reference, a killed run resuming with the same rollouts."""
import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file

import zoo
from train.config import load_run_config
from train.data import DataError
from train.data.prompts import arithmetic, read_prompts, reward_fn, score
from train.loop import train
from train.metrics import read_rows
from train.tasks.rl import advantages, overlong_penalty, policy_loss
from zoo.config import ConfigError

MODEL = {"vocab_size": 256, "d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "max_seq_len": 96}


def config(tmp_path, name, *over):
    base = {"family": "llm", "model": MODEL,
            "data": {"format": "prompts", "path": "synthetic", "tokenizer": "bytes", "template": "none",
                     "seq_len": 72, "synthetic_rows": 100, "eval_prompts": 4},
            "rl": {"group_size": 4, "prompts_per_step": 2, "max_new_tokens": 6, "top_p": 0.9,
                   "rewards": [{"name": "numeric"}, {"name": "format:\\D*\\d.*", "weight": 0.5}]},
            "train": {"max_steps": 4, "batch_size": 8, "log_every": 1, "eval_every": 0, "checkpoint_every": 0,
                      "progress": False, "samples": False, "plot": False, "out_dir": str(tmp_path / name),
                      "peak_flops": 1e12},
            "optim": {"lr": 3e-3, "warmup_steps": 0, "schedule": "constant"}}
    return load_run_config(None, list(over), base=base)


def reference_loss(logp, old, ref, adv, mask, algorithm, lo, hi, beta, max_new):
    """The loss and its gradient by logp, token by token in float64 Python (the formulas written out)."""
    N, T = len(mask), len(mask[0])
    lengths = [sum(mask[i]) for i in range(N)]
    total_tokens = sum(lengths)
    loss, grad = 0.0, [[0.0] * T for _ in range(N)]
    for i in range(N):
        if algorithm == "gspo":  # one ratio for the completion: exp of its tokens' mean log-ratio
            n = max(lengths[i], 1)
            r = math.exp(sum(logp[i][t] - old[i][t] for t in range(T) if mask[i][t]) / n)
            c = min(max(r, 1 - lo), 1 + hi)
            loss -= min(r * adv[i], c * adv[i]) / N
            d_r = -adv[i] * r if r * adv[i] <= c * adv[i] else 0.0  # d(term) / d(log r)
        for t in range(T):
            if not mask[i][t]:
                continue
            if algorithm == "gspo":  # d(log r) / d(logp[i][t]) = 1 / n
                grad[i][t] = d_r / (n * N)
                if beta:
                    d = ref[i][t] - logp[i][t]
                    loss += beta * (math.exp(d) - d - 1) / (n * N)
                    grad[i][t] += beta * (1 - math.exp(d)) / (n * N)
                continue
            r = math.exp(logp[i][t] - old[i][t])
            a = adv[i]
            c = min(max(r, 1 - lo), 1 + hi)
            unclipped = r * a <= c * a
            term, d_term = -min(r * a, c * a), (-a * r if unclipped else 0.0)
            if beta:
                d = ref[i][t] - logp[i][t]
                term += beta * (math.exp(d) - d - 1)
                d_term += beta * (1 - math.exp(d))
            w = {"grpo": 1 / (max(lengths[i], 1) * N), "dr_grpo": 1 / (N * max_new), "dapo": 1 / total_tokens}[algorithm]
            loss += w * term
            grad[i][t] = w * d_term
    return loss, grad


ALGORITHMS = ["grpo", "dr_grpo", "dapo", "gspo"]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("beta", [0.0, 0.05])
def test_each_loss_and_gradient_is_its_formula(algorithm, beta):
    g = torch.Generator().manual_seed(0)
    N, T = 6, 7
    logp = -3 * torch.rand(N, T, generator=g)
    old = logp + 0.4 * torch.randn(N, T, generator=g)  # ratios on both sides of both clips
    ref = logp + 0.3 * torch.randn(N, T, generator=g)
    adv = torch.randn(N, generator=g)
    mask = torch.rand(N, T, generator=g) > 0.3
    mask[:, 0] = True
    lo, hi = 0.2, 0.28
    if algorithm == "gspo":  # a completion's ratio: its tokens' noise averages out, so old moves per completion
        old = logp - torch.tensor([0.4, 0.1, 0.0, -0.1, -0.3, -0.5])[:, None] + 0.25 * torch.randn(N, T, generator=g)
        adv = torch.tensor([1.0, -1.0, 0.5, -0.5, -1.0, 1.0])  # some clipped, some not
    x = logp.clone().requires_grad_(True)
    loss, stats = policy_loss(x, old, ref, adv, mask, algorithm, lo, hi, beta, max_new_tokens=10)
    loss.backward()
    want, grad = reference_loss(logp.tolist(), old.tolist(), ref.tolist(), adv.tolist(), mask.tolist(), algorithm,
                                lo, hi, beta, 10)
    assert abs(loss.item() - want) <= 1e-6
    assert (x.grad - torch.tensor(grad)).abs().max() <= 1e-6
    ratio = (logp - old).exp()
    if algorithm == "gspo":
        ratio = (((logp - old) * mask).sum(1) / mask.sum(1)).exp()[:, None].expand(N, T)
    assert ((ratio < 1 - lo) & mask).any() and ((ratio > 1 + hi) & mask).any() and 0 < stats["clip"] < mask.sum()
    # another clipping or another normalisation gives another loss
    for other in (dict(lo=0.2, hi=0.2), dict(lo=0.1, hi=0.28)):
        changed, _ = policy_loss(logp, old, ref, adv, mask, algorithm, other["lo"], other["hi"], beta, 10)
        assert abs(changed.item() - want) > 1e-4
    for a in set(ALGORITHMS) - {algorithm}:  # gspo against grpo: the token-level ratio differs
        assert abs(policy_loss(logp, old, ref, adv, mask, a, lo, hi, beta, 10)[0].item() - want) > 1e-4


def test_parts_add_up_to_the_batch_loss():
    """Micro-batches (or processes) normalised by the batch's counts sum to the whole batch's loss."""
    g = torch.Generator().manual_seed(1)
    logp, old = -torch.rand(8, 5, generator=g), -torch.rand(8, 5, generator=g)
    adv, mask = torch.randn(8, generator=g), torch.rand(8, 5, generator=g) > 0.4
    for a in ALGORITHMS:
        whole, _ = policy_loss(logp, old, None, adv, mask, a, 0.2, 0.28, 0.0, 5)
        parts = sum(policy_loss(logp[s], old[s], None, adv[s], mask[s], a, 0.2, 0.28, 0.0, 5, 8, float(mask.sum()))[0]
                    for s in (slice(0, 3), slice(3, 8)))
        assert abs(parts.item() - whole.item()) <= 1e-6


def test_advantages_and_equal_reward_groups():
    r = torch.tensor([[1.0, 0.0, 0.5, 0.5], [2.0, 2.0, 2.0, 2.0]])
    for a in ("grpo", "dapo"):
        adv = advantages(r, a)
        want = (r[0] - r[0].mean()) / (r[0].std() + 1e-4)
        assert torch.allclose(adv[0], want, atol=1e-6) and torch.equal(adv[1], torch.zeros(4))
    assert torch.allclose(advantages(r, "dr_grpo")[0], r[0] - 0.5) and torch.equal(advantages(r, "dr_grpo")[1],
                                                                                     torch.zeros(4))
    assert overlong_penalty(5, 10, 4) == 0 and overlong_penalty(8, 10, 4) == -0.5 and overlong_penalty(10, 10, 4) == -1


def test_dapo_drops_groups_of_equal_rewards():
    from train.tasks.rl import RLTask
    task = RLTask.__new__(RLTask)
    task.cfg = type("C", (), {"rl": type("R", (), {"group_size": 2})})()
    got = {"prompt": [[1], [2], [3], [4]], "comp": [[5], [6], [7], [8]], "cut": [False] * 4,
           "total": [1.0, 1.0, 0.0, 1.0], "values": [(1.0,), (1.0,), (0.0,), (1.0,)], "seconds": 0.0, "tokens": 4}
    kept = task._keep_varied(got)
    assert kept["total"] == [0.0, 1.0] and kept["prompt"] == [[3], [4]] and kept["values"] == [(0.0,), (1.0,)]


def test_rewards(tmp_path, monkeypatch):
    c, a = ["so it is 12.", "12", "x"], [12, "12", 3]
    assert reward_fn("numeric")(c, a, None) == [1.0, 1.0, 0.0]
    assert reward_fn("exact")(c, a, None) == [0.0, 1.0, 0.0]
    assert reward_fn("contains")(c, a, None) == [1.0, 1.0, 0.0]
    assert reward_fn("format:\\d+")(c, a, None) == [0.0, 1.0, 0.0]
    assert reward_fn("length:4")(c, a, None) == [-2.0, 0.0, 0.0]
    (tmp_path / "my_rewards.py").write_text("def short(completions, answers, prompts):\n"
                                            "    return [float(len(c) < 3) for c in completions]\n")
    monkeypatch.chdir(tmp_path)
    assert reward_fn("my_rewards:short")(c, a, None) == [0.0, 1.0, 1.0]
    with pytest.raises(ConfigError, match="rl.rewards"):
        reward_fn("nonsense")
    with pytest.raises(ConfigError, match="my_rewards:missing"):
        reward_fn("my_rewards:missing")
    for values, says in ((["x"] * 3, "not a number"), ([1.0, float("nan"), 0.0], "not a number"), ([1.0], "1 values")):
        with pytest.raises(DataError, match=f"reward mine: .*{says}"):
            score([("mine", 1.0, lambda *_: values)], c, a, None)


def test_chat_prompts_without_a_template_are_refused_in_one_line(tmp_path):
    """A prompts file with a messages row and data.template=none: refused as the data is read, naming the file and
    the key (was a TypeError at the first rollout or evaluation)."""
    from train.builder import build_run
    p = tmp_path / "p.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in [{"prompt": "1+1?", "answer": 2}] * 8 + [
        {"messages": [{"role": "user", "content": "2+2?"}], "answer": 4}]))
    with pytest.raises(DataError, match=f"{p}: a prompt of chat messages needs a chat template, .*data.template"):
        build_run(config(tmp_path, "run", f"data.path={p}"))


def test_prompts_loader_skips_malformed_rows_and_refuses_an_empty_set(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text("\n".join([json.dumps({"prompt": "1+1?", "answer": 2}), "not json", json.dumps({"prompt": "x"}),
                            json.dumps({"messages": [{"role": "user", "content": "hi"}], "answer": [1, 2]})]) + "\n")
    said = []
    rows = read_prompts(p, said.append)
    assert [r["answer"] for r in rows] == [2, [1, 2]] and rows[1]["prompt"][0]["content"] == "hi"
    assert len(said) == 1 and "2 malformed lines skipped (line 2, 3" in said[0]
    (tmp_path / "bad.jsonl").write_text("{}\n")
    with pytest.raises(DataError, match="bad.jsonl: no usable prompt rows"):
        read_prompts(tmp_path / "bad.jsonl", said.append)
    train, val = arithmetic("train", 300), arithmetic("val", 50)
    assert arithmetic("val", 50) == val and not {r["prompt"] for r in train} & {r["prompt"] for r in val}
    assert all(isinstance(r["answer"], int) for r in train + val)


def test_rl_section_belongs_to_prompts(tmp_path):
    with pytest.raises(ConfigError, match="rl: is the section"):
        load_run_config(None, [], base={"family": "llm", "model": MODEL, "data": {"path": "x"}, "rl": {}})
    with pytest.raises(ConfigError, match="rl.algorithm"):
        config(tmp_path, "x", "rl.algorithm=ppo")


def test_clip_defaults_follow_the_algorithm(tmp_path):
    """Unset clips: 0.2 / 0.2, and GSPO's tight 3e-4 / 4e-4 (its ratio is a mean over the tokens); set: kept."""
    assert config(tmp_path, "x").rl.clips() == (0.2, 0.2)
    assert config(tmp_path, "x", "rl.algorithm=gspo").rl.clips() == (3e-4, 4e-4)
    assert config(tmp_path, "x", "rl.algorithm=gspo", "rl.clip_high=0.01").rl.clips() == (3e-4, 0.01)


def test_run_logs_the_metrics_and_resumes_with_the_same_rollouts(tmp_path, one_thread):
    """LoRA GRPO with a KL to the base with its adapters off (no copy): the metrics of every step; a run
    killed after its step-3 checkpoint (amid a batch of rollouts) resumes with the same rollouts and ends on the same adapter."""
    torch.manual_seed(0)
    init = zoo.save_pretrained(zoo.build(dict(MODEL, family="llm")), tmp_path / "base")
    over = [f"train.init_from={init}", "adapter.method=lora", "adapter.r=4", "rl.kl_beta=0.05",
            "rl.updates_per_batch=2", "train.checkpoint_every=3"]
    final = train(config(tmp_path, "full", *over), log=lambda m: None)
    rows = [r for r in read_rows(tmp_path / "full") if "kl" in r]
    assert len(rows) == 4 and [r["step"] for r in rows if "reward_mean" in r] == [1, 3]  # a batch per 2 updates
    for k in ("reward_numeric", "reward_format", "reward_mean", "reward_std", "solved", "completion_len_mean",
              "completion_len_max", "truncated", "clip_fraction", "kl", "entropy", "rollout_tokens_per_s",
              "generation_share"):
        assert all(math.isfinite(r[k]) for r in rows if "reward_mean" in r or k in ("clip_fraction", "kl")), k
    assert rows[0]["kl"] == 0 and rows[1]["kl"] > 0  # the adapters start at zero: policy = base
    assert rows[0]["clip_fraction"] == rows[2]["clip_fraction"] == 0  # a batch's first update: ratio 1
    assert "val_reward" in final
    part = tmp_path / "part"
    shutil.copytree(tmp_path / "full", part)
    shutil.rmtree(part / "checkpoints" / "step_00000004")
    shutil.rmtree(part / "adapter")
    said = []
    train(config(tmp_path, "part", *over), log=said.append)
    assert any("(step 3)" in m and m.startswith("resumed from") for m in said)
    again = [r for r in read_rows(part) if "kl" in r]
    keys = ("loss", "kl", "clip_fraction", "entropy")
    assert [r[k] for k in keys for r in again] == [r[k] for k in keys for r in rows]
    a, b = (load_file(d / "adapter" / "adapter_model.safetensors") for d in (tmp_path / "full", part))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_eval_scores_a_prompts_file_with_rewards(tmp_path, one_thread):
    """train/eval.py --task on prompt/answer rows: reward and pass@1 equal each row generated alone,
    decoded and checked; pass@k from k samples."""
    from train.data.text_tokenizers import ByteTokenizer
    from train.eval import main
    torch.manual_seed(0)
    model = zoo.build(dict(MODEL, family="llm"))
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
    folder = zoo.save_pretrained(model, tmp_path / "m")
    tok, rows, alone = ByteTokenizer(), arithmetic("val", 6), []
    for i, r in enumerate(rows):  # the even rows' answers: what the model answers alone
        ids = tok.encode(r["prompt"])
        alone.append(tok.decode(model.generate(torch.tensor([ids]), 5)[0, len(ids):].tolist()))
        r["answer"] = alone[-1].strip() if i % 2 == 0 else "no"
    task = tmp_path / "arith.jsonl"
    task.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "eval.json"
    assert main([str(folder), "--task", str(task), "--tokenizer", "bytes", "--template", "none", "--max-new-tokens",
                 "5", "--samples", "3", "--reward", "exact", "--reward", "length:3", "--json", str(out),
                 "--device", "cpu"]) == 0
    got = json.loads(out.read_text())["tasks"]["arith"]
    penalty = reward_fn("length:3")(alone, None, None)
    assert got["kind"] == "reward" and got["n"] == 6 and got["pass@1"] == 0.5
    assert got["reward"] == pytest.approx((3 + sum(penalty)) / 6) and any(penalty)
    assert 0 <= got["pass@3"] <= 1


def test_the_reference_is_the_base_with_adapters_off_or_a_frozen_copy(tmp_path):
    from train.builder import build_run
    torch.manual_seed(0)
    init = zoo.save_pretrained(zoo.build(dict(MODEL, family="llm")), tmp_path / "base")
    lora = build_run(config(tmp_path, "a", f"train.init_from={init}", "adapter.method=lora", "rl.kl_beta=0.1"))
    assert lora.task.reference is None  # the KL reads the base with its adapters off: no second copy
    full = build_run(config(tmp_path, "b", f"train.init_from={init}", "rl.kl_beta=0.1"))
    ref = full.task.reference
    assert ref is not None and not any(p.requires_grad for p in ref.parameters())
    assert {p.data_ptr() for p in ref.parameters()}.isdisjoint(p.data_ptr() for p in full.model.parameters())
    assert build_run(config(tmp_path, "c", f"train.init_from={init}")).task.reference is None  # kl_beta 0


def test_dapo_run_with_dynamic_sampling_and_overlong_shaping(tmp_path, one_thread):
    train(config(tmp_path, "dapo", "rl.algorithm=dapo", "rl.clip_high=0.28", "rl.dynamic_sampling=true",
                 "rl.max_refills=2", "rl.overlong=soft", "rl.overlong_buffer=2", "train.max_steps=2"),
          log=lambda m: None)
    rows = [r for r in read_rows(tmp_path / "dapo") if "reward_mean" in r]
    assert len(rows) == 2 and all(2 <= r["prompts_sampled"] <= 6 for r in rows)
    assert all(r["truncated"] == 1 and r["reward_mean"] <= 0.5 for r in rows)  # 6 bytes, no stop: -1 each
