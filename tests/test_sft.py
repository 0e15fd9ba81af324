"""Chat fine-tuning (train/tasks/sft.py, train/data/chat_data.py) and the chat command (train/chat.py).

The end-to-end run is small on purpose: a 2-layer model from scratch learns which sound each of
six animals makes from conversations (one and two turns, the second asking "And again?"; packed
into rows, data.pack), and is asked about greeting + animal combinations it never saw. Guessing among the six sounds is right
1/6 of the time; the test asks for at least 1/2. The embedded example at its real size (the
tiny pretrained model, four kinds of conversation) is `python train/bench.py sft`.
"""
import json
import random
import subprocess
import sys

import pytest
import torch

import zoo
from conftest import ROOT
from zoo.config import ConfigError
from train.chat import ChatSession, load, main as chat_main
from train.config import load_run_config
from train.data import ByteTokenizer
from train.data.chat_data import ChatData
from train.data.conversations import ChatDataConfig, ChatTemplate
from train.loop import train

SOUNDS = {"cow": "moo", "dog": "woof", "cat": "meow", "duck": "quack", "sheep": "baa", "owl": "hoot"}
GREETINGS = ["Hi.", "Hello!", "Hey there.", "Good morning.", "Quick question:", "Tell me,", "Please answer:",
             "I wonder:", "Kids ask:", "Say,"]
COMBOS = random.Random(0).sample([(g, a) for g in GREETINGS for a in SOUNDS], len(GREETINGS) * len(SOUNDS))
TRAIN, HELD_OUT = COMBOS[:42], COMBOS[42:]


def question(greeting, animal):
    return f"{greeting} What does a {animal} say?"


def conversation(greeting, animal, two_turns):
    m = [{"role": "user", "content": question(greeting, animal)}, {"role": "assistant", "content": SOUNDS[animal]}]
    return m + ([{"role": "user", "content": "And again?"}, {"role": "assistant", "content": SOUNDS[animal]}]
                if two_turns else [])


@pytest.fixture(scope="module")
def sounds_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sft")
    rows = tmp / "sounds.jsonl"
    rows.write_text("".join(json.dumps({"messages": conversation(g, a, i % 2)}) + "\n"
                            for i, (g, a) in enumerate(TRAIN * 3)))
    cfg = load_run_config(None, base={
        "family": "llm", "model": {"vocab_size": 320, "d_model": 64, "n_layers": 2, "n_heads": 4, "max_seq_len": 128},
        "data": {"format": "messages", "path": str(rows), "vocab_size": 320, "seq_len": 128, "eval_generate": 8,
                 "val_fraction": 0.1, "pack": True},
        "train": {"out_dir": str(tmp / "run"), "max_steps": 150, "batch_size": 8, "eval_every": 50, "eval_batches": 2,
                  "log_every": 50, "checkpoint_every": 0, "progress": False, "plot": False, "samples": False},
        "optim": {"lr": 1e-2}})
    train(cfg, log=lambda m: None)
    return tmp / "run"


def test_sft_lowers_the_assistant_loss_and_answers_held_out_prompts(sounds_run):
    rows = [json.loads(line) for line in (sounds_run / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "val_loss" in r]
    assert evals[-1]["val_loss"] < 0.25 * evals[0]["val_loss"] and evals[-1]["val_loss"] < evals[-1]["unigram_entropy"]
    assert "val_exact_match" in evals[-1] and evals[-1]["val_bpb"] < evals[0]["val_bpb"]  # bits per trained byte
    model, tok, template = load(str(sounds_run))
    chat = ChatSession(model, tok, template, max_new_tokens=16)
    answers = [chat.respond([{"role": "user", "content": question(g, a)}]) for g, a in HELD_OUT]
    accuracy = sum(ans == SOUNDS[a] for ans, (_, a) in zip(answers, HELD_OUT)) / len(HELD_OUT)
    assert accuracy >= 0.5, (accuracy, answers)  # chance: 1/6


def test_a_run_whose_validation_conversations_are_all_cut_trains_without_exact_match(tmp_path):
    """data.seq_len shorter than every conversation (data.train_on_prompt keeps the cut rows trained): no held-out
    conversation is whole, so there is no answer to generate; the run logs no val_exact_match and writes its samples."""
    rows = tmp_path / "sounds.jsonl"
    rows.write_text("".join(json.dumps({"messages": conversation(g, a, 1)}) + "\n" for g, a in TRAIN))
    cfg = load_run_config(None, base={
        "family": "llm", "model": {"vocab_size": 256, "d_model": 32, "n_layers": 1, "n_heads": 2, "max_seq_len": 32},
        "data": {"format": "messages", "path": str(rows), "tokenizer": "bytes", "seq_len": 32, "eval_generate": 4,
                 "train_on_prompt": True},
        "train": {"out_dir": str(tmp_path / "run"), "max_steps": 1, "batch_size": 4, "eval_every": 1,
                  "eval_batches": 1, "checkpoint_every": 0, "progress": False, "plot": False}})
    train(cfg, log=lambda m: None)
    evals = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any("val_loss" in r for r in evals) and not any("val_exact_match" in r for r in evals)
    assert (tmp_path / "run" / "samples.txt").is_file()


def test_chat_command_two_turns_through_stdin(sounds_run, capsys):
    """The second answer of each conversation follows from the first turn: the two conversations
    differ only there, and each answer equals greedy decoding of the whole conversation without
    any cache reuse (LLM.generate on the re-rendered text)."""
    turns = [question("Hi.", "sheep"), "And again?", "/reset", question("Hi.", "duck"), "And again?"]
    r = subprocess.run([sys.executable, "train/chat.py", str(sounds_run), "--max-new-tokens", "16"], cwd=ROOT,
                       input="\n".join(turns) + "\n", capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = r.stdout.splitlines()
    assert len(out) == 4 and out[1] != out[3], out
    model, tok, template = load(str(sounds_run))
    eot = template.end_of_turn
    for first, replies in ((turns[0], out[:2]), (turns[3], out[2:])):
        messages = []
        for user, reply in zip((first, "And again?"), replies):
            messages.append({"role": "user", "content": user})
            ids = tok.encode(template.render(messages, add_generation_prompt=True))
            gen = model.generate(torch.tensor([ids]), max_new_tokens=16)[0, len(ids):].tolist()
            assert reply == tok.decode(gen).split(eot)[0]
            messages.append({"role": "assistant", "content": reply})
    assert chat_main([str(sounds_run), "--prompt", turns[0], "--max-new-tokens", "16"]) == 0  # one answer, then exit
    assert capsys.readouterr().out == out[0] + "\n"


def test_chat_prompt_errors_are_one_line(tmp_path, capsys):
    """--prompt: a conversation past the model's context, a tokenizer with more ids than the model's vocabulary, a
    model path that does not exist, a run of another family: exit 2 and one line each, no traceback."""
    from zoo.weights import zoo_folder
    cfg = {"vocab_size": 300, "d_model": 32, "n_layers": 1, "n_heads": 2, "max_seq_len": 16}
    zoo_folder.save(zoo.build(cfg), tmp_path / "short", tokenizer="bytes")
    zoo_folder.save(zoo.build({**cfg, "vocab_size": 64}), tmp_path / "narrow", tokenizer="bytes")
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "config.yaml").write_text("family: diffusion\n")  # a diffusion run folder
    for folder, says in (("short", "the model's context 16"), ("narrow", "vocab_size=64"), ("typo", "typo: no such"),
                         ("images", "images: a diffusion run, not a language model")):
        assert chat_main([str(tmp_path / folder), "--prompt", "word " * 20, "--max-new-tokens", "4"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and says in err and err.count("\n") == 1, err


def test_chat_template_option(tmp_path, capsys):
    """--template: a .jinja file or a built-in name replaces the model's template (a base model has none: ChatML
    otherwise); the prompt the model sees is the chosen template's; none, or a missing file: one line, exit 2."""
    from zoo.weights import zoo_folder
    torch.manual_seed(0)
    zoo_folder.save(zoo.build({"vocab_size": 256, "d_model": 32, "n_layers": 1, "n_heads": 2, "max_seq_len": 64}),
                    tmp_path / "base", tokenizer="bytes")
    jinja = tmp_path / "plain.jinja"
    jinja.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                     "{% if add_generation_prompt %}assistant:{% endif %}")
    model, tok, template = load(str(tmp_path / "base"), template_name=str(jinja))
    assert template.name == str(jinja) and load(str(tmp_path / "base"))[2].name == "built-in chatml"
    assert template.render([{"role": "user", "content": "Hi"}], add_generation_prompt=True) == "user: Hi\nassistant:"
    ids = tok.encode("user: Hi\nassistant:")
    want = tok.decode(model.generate(torch.tensor([ids]), max_new_tokens=4)[0, len(ids):].tolist())
    assert len(want) == 4  # seeded: no stop inside the four answer bytes
    assert chat_main([str(tmp_path / "base"), "--prompt", "Hi", "--max-new-tokens", "4", "--template", str(jinja)]) == 0
    assert capsys.readouterr().out == want + "\n"
    for bad, says in (("none", "--template none"), (str(tmp_path / "missing.jinja"), "missing.jinja")):
        assert chat_main([str(tmp_path / "base"), "--prompt", "Hi", "--template", bad]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and says in err and err.count("\n") == 1, err


@pytest.mark.parametrize("packed", [False, True])
def test_a_batch_gives_the_loss_and_gradients_of_one_conversation_per_forward(packed):
    """Padded rows, or conversations packed into rows (document masking, positions restarting per
    conversation): the batch's loss and gradients equal the token-weighted mean over one forward per
    conversation (fp32, 1e-5)."""
    tok, template = ByteTokenizer(), ChatTemplate.builtin("chatml")
    convs = [conversation("Hi.", "cow", True), conversation("Say,", "sheep", False),
             [{"role": "system", "content": "Be brief."}] + conversation("Hello!", "owl", True),
             conversation("Hey there.", "dog", False)]
    data = ChatData([(c, ("t", i)) for i, c in enumerate(convs)], [(convs[0], ("v", 1))], tok, template,
                    ChatDataConfig(seq_len=400, pack=packed), log=lambda m: None)
    model = zoo.build("configs/llm/tiny.yaml", vocab_size=256, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1,
                      max_seq_len=512)
    model.chunked_loss = False
    rows = 2 if packed else 4
    x, y, n, docs = data.batch(0, rows)
    assert x.shape[0] == rows and n == sum(len(c[0]) for c in data.train) < x.numel()  # padding, not counted
    assert set(docs) == ({"doc_ids", "position_ids"} if packed else set())
    loss = model(x, y, **docs)[1]
    grads = torch.autograd.grad(loss, list(model.parameters()))
    each = [(model(torch.from_numpy(a)[None], torch.from_numpy(b)[None])[1], int((b != -100).sum()))
            for a, b in data.train]
    ref = sum(l * k for l, k in each) / sum(k for _, k in each)
    ref_grads = torch.autograd.grad(ref, list(model.parameters()))
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=0)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-4)


def test_length_bucketing_batches_every_conversation_and_cuts_padding():
    tok, template = ByteTokenizer(), ChatTemplate.builtin("chatml")
    rng = random.Random(0)
    convs = [[{"role": "user", "content": "x" * rng.randint(1, 200)}, {"role": "assistant", "content": "ok"}]
             for _ in range(64)]
    data = ChatData([(c, ("t", i)) for i, c in enumerate(convs)], [(convs[0], ("v", 1))], tok, template,
                    ChatDataConfig(seq_len=512, bucket_batches=8), seed=3, log=lambda m: None)
    assert data.padding_waste(8) < 0.5 * data.padding_waste(8, bucket_batches=1)
    firsts = [tuple(data.batch(i, 8)[0][:, 0].tolist()) for i in range(8)]
    assert sum(data.batch(i, 8)[2] for i in range(8)) == sum(len(x) for x, _ in data.train)  # an epoch: each once
    again = ChatData([(c, ("t", i)) for i, c in enumerate(convs)], [(convs[0], ("v", 1))], tok, template,
                     ChatDataConfig(seq_len=512, bucket_batches=8), seed=3, log=lambda m: None)
    assert [tuple(again.batch(i, 8)[0][:, 0].tolist()) for i in range(8)] == firsts  # the same for the same seed


@pytest.mark.parametrize("overrides,match", [
    (["data.format=chat"], "data.format must be one of text, messages, prompt_completion, alpaca"),
    (["data.format=alpaca"], "data.path=synthetic is a set of conversations: it needs data.format=messages"),
    (["data.format=messages", "data.template=nowhere.jinja"], "data.template=nowhere.jinja: neither a built-in"),
])
def test_chat_config_errors_are_one_line(overrides, match):
    with pytest.raises(ConfigError, match=match) as e:
        load_run_config(None, overrides, base={"family": "llm"})
    assert "\n" not in str(e.value)
