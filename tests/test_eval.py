"""Evaluation on task files (train/eval.py, train/eval.py): multiple choice against a hand
computation of the summed and length-normalised log-likelihoods, generation scoring, loss rows, the
command line and `data.eval_tasks` in a run."""
import json
import re
import subprocess
import sys

import pytest
import torch

import zoo
from conftest import TEST_DEVICE, ROOT
from train.data import ByteTokenizer, DataError
from zoo.config import ConfigError
from train.eval import choice_pair, cut_at, evaluate_files, read_task

MODEL = {"vocab_size": 256, "d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "max_seq_len": 64}


@pytest.fixture
def model():
    torch.manual_seed(0)
    return zoo.build(MODEL).eval()


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def logprobs(model, ids):
    """log p(ids[t] | ids[:t]) for t >= 1, by one plain forward and a log-softmax."""
    with torch.no_grad():
        logits = model(torch.tensor([ids]))[0]
    lp = torch.log_softmax(logits.double(), -1)
    return [lp[t - 1, ids[t]].item() for t in range(1, len(ids))]


def test_multiple_choice_equals_a_hand_computation(tmp_path, model, one_thread):
    rng = torch.Generator().manual_seed(1)
    words = ["é", "ab", "çàb", "x", "hello", "naïve", "zz", "über"]  # characters != bytes (the tokens) for some
    rows = []
    for i in range(12):
        pick = torch.randperm(len(words), generator=rng)[:3].tolist()
        rows.append({"context": f"Q{i}: which?", "choices": [words[j] for j in pick], "answer": i % 3})
    f = write(tmp_path / "mc.jsonl", rows)
    res = evaluate_files(model, ByteTokenizer(), [f], TEST_DEVICE, batch_size=5, log=lambda m: None)["mc"]
    acc = acc_norm = 0
    for r, d in zip(rows, res["details"]):
        ctx = list(r["context"].encode())
        lls = []
        for c in r["choices"]:
            cont = list((" " + c).encode())
            lls.append(sum(logprobs(model, ctx + cont)[len(ctx) - 1:]))
        assert d["loglikelihoods"] == pytest.approx(lls, abs=1e-4)
        normed = [ll / len(c) for ll, c in zip(lls, r["choices"])]  # characters, as lm-evaluation-harness
        acc += max(range(3), key=lambda k: (lls[k], -k)) == r["answer"]
        acc_norm += max(range(3), key=lambda k: (normed[k], -k)) == r["answer"]
    assert res["acc"] == acc / len(rows) and res["acc_norm"] == acc_norm / len(rows)
    assert res["n"] == len(rows) and res["kind"] == "choice"


class WordTokenizer:
    """Words with their leading space as one token (as GPT-2's BPE splits ' cat'): the context's
    trailing space must move to the continuation, or ' sat' would be tokenised as ' ' + 'sat'."""
    eos_id = None

    def __init__(self):
        self.vocab = {}

    def encode(self, text):
        return [self.vocab.setdefault(p, len(self.vocab)) for p in re.findall(r" ?[^ ]+| +", text)]


def test_choice_pair_moves_the_contexts_trailing_space_as_the_harness_does():
    tok = WordTokenizer()
    ctx, cont = choice_pair(tok, "the cat ", "sat")
    assert ctx == tok.encode("the cat") and cont == tok.encode(" sat")
    ctx, cont = choice_pair(tok, "the cat", " sat")
    assert ctx == tok.encode("the cat") and cont == tok.encode(" sat")


def test_generation_scores_exact_match_and_contains(tmp_path, model, one_thread):
    tok = ByteTokenizer()
    prompts = ["abc", "hello", "x = 1"]
    outputs = []
    for p in prompts:  # the model's own greedy continuations
        out = model.generate(torch.tensor([tok.encode(p)]), max_new_tokens=6)[0, len(p):].tolist()
        outputs.append(tok.decode(out))
    rows = [{"prompt": prompts[0], "expected": outputs[0], "until": ["\x00\x01"]},   # exact (and contains)
            {"prompt": prompts[1], "expected": outputs[1][1:4], "until": ["\x00\x01"]},  # contains only
            {"prompt": prompts[2], "expected": "not this", "until": ["\x00\x01"]}]      # neither
    f = write(tmp_path / "gen.jsonl", rows)
    res = evaluate_files(model, tok, [f], TEST_DEVICE, max_new_tokens=6, log=lambda m: None)["gen"]
    assert [d["output"] for d in res["details"]] == outputs
    exact = (outputs[0].strip() == outputs[0].strip()) + (outputs[1].strip() == outputs[1][1:4].strip())
    contains = 1 + (outputs[1][1:4].strip() in outputs[1]) + ("not this" in outputs[2])
    assert res["exact_match"] == pytest.approx(exact / 3) and res["contains"] == pytest.approx(contains / 3)
    assert res["contains"] >= 2 / 3 and res["exact_match"] <= 2 / 3


def test_cut_at_stops_at_the_first_stop_string():
    assert cut_at("ab\ncd", ["\n"]) == "ab"
    assert cut_at("ab.cd\n", ["\n", "."]) == "ab"
    assert cut_at("abc", []) == "abc" and cut_at("abc", None) == "abc"


def test_loss_rows_score_only_the_completion(tmp_path, model, one_thread):
    rows = [{"prompt": "2+2=", "completion": "4"}, {"prompt": "name: ", "completion": "zoo"}]
    f = write(tmp_path / "loss.jsonl", rows)
    res = evaluate_files(model, ByteTokenizer(), [f], TEST_DEVICE, log=lambda m: None)["loss"]
    total, n = 0.0, 0
    for r in rows:
        p, c = list(r["prompt"].encode()), list(r["completion"].encode())
        total += sum(logprobs(model, p + c)[len(p) - 1:])
        n += len(c)
    assert res["tokens"] == n and res["loss"] == pytest.approx(-total / n, abs=1e-5)
    text = write(tmp_path / "text.jsonl", [{"text": "plain text"}])
    res = evaluate_files(model, ByteTokenizer(), [text], TEST_DEVICE, log=lambda m: None)["text"]
    ids = list(b"plain text")
    assert res["loss"] == pytest.approx(-sum(logprobs(model, ids)) / (len(ids) - 1), abs=1e-5)


def test_task_files_are_checked_row_by_row(tmp_path):
    said = []
    f = write(tmp_path / "t.jsonl", [{"context": "a", "choices": ["b", "c"], "answer": "c"},
                                      {"context": "a", "choices": ["b"], "answer": 0},
                                      {"context": "a", "choices": ["b", "c"], "answer": 5}])
    kind, rows = read_task(f, said.append)
    assert kind == "choice" and len(rows) == 1 and rows[0]["answer"] == 1
    assert len(said) == 1 and "t.jsonl: 2 malformed lines skipped (line 2, 3" in said[0]
    mixed = write(tmp_path / "m.jsonl", [{"text": "a"}, {"prompt": "a", "expected": "b"}])
    with pytest.raises(DataError, match="m.jsonl: rows of several kinds"):
        read_task(mixed, said.append)
    chat = write(tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": "hi"},
                                                      {"role": "assistant", "content": "yo"}]}])
    with pytest.raises(DataError, match="c.jsonl: a prompt of chat messages needs a chat template"):
        evaluate_files(zoo.build(MODEL), ByteTokenizer(), [chat], TEST_DEVICE, log=said.append)


def test_eval_command_prints_a_table_and_writes_json(tmp_path, model, capsys, one_thread):
    folder = zoo.save_pretrained(model, tmp_path / "hf")
    f = write(tmp_path / "mc.jsonl", [{"context": "x", "choices": ["a", "bb"], "answer": 0},
                                       {"context": "y", "choices": ["a", "bb"], "answer": 1}])
    out = tmp_path / "res.json"
    p = subprocess.run([sys.executable, str(ROOT / "train" / "eval.py"), str(folder), "--task", str(f),
                        "--tokenizer", "bytes", "--json", str(out)], capture_output=True, text=True, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    want = evaluate_files(model, ByteTokenizer(), [f], TEST_DEVICE, log=lambda m: None)["mc"]
    got = json.loads(out.read_text())["tasks"]["mc"]
    assert got["acc"] == want["acc"] and got["acc_norm"] == want["acc_norm"] and "details" not in got
    assert re.search(r"mc\s+choice\s+2\s+acc ", p.stdout), p.stdout
    from train.eval import main
    capsys.readouterr()
    assert main([str(folder), "--task", str(tmp_path / "missing.jsonl"), "--tokenizer", "bytes"]) == 2
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and "missing.jsonl: no such file" in err


def test_eval_tasks_run_at_every_evaluation_of_a_run(tmp_path, text_corpus, one_thread):
    from train.config import load_run_config
    from train.loop import train
    from train.metrics import read_rows
    from test_loop import TINY
    f = write(tmp_path / "mc.jsonl", [{"context": "def", "choices": [" f():", "zzz"], "answer": 0}])
    cfg = load_run_config(None, [f"train.out_dir={tmp_path / 'run'}", f"data.path={text_corpus}",
                                 f"data.eval_tasks=[{f}]", "train.max_steps=2", "train.eval_every=1",
                                 "optim.warmup_steps=0"], base=TINY)
    final = train(cfg, log=lambda m: None)
    evals = [r for r in read_rows(tmp_path / "run") if "val_loss" in r]
    assert len(evals) == 2 and all("eval_mc_acc" in r and "eval_mc_acc_norm" in r for r in evals)
    assert final["eval_mc_acc"] in (0.0, 1.0)
    with pytest.raises(ConfigError, match="data.eval_tasks .*nope.jsonl: no such file"):
        load_run_config(None, [f"data.eval_tasks=[{tmp_path / 'nope.jsonl'}]"], base=TINY)


def test_chat_prompts_are_answered_through_the_template(tmp_path, one_thread):
    from train.chat import ChatSession
    torch.manual_seed(0)
    model = zoo.build({**MODEL, "max_seq_len": 160}).eval()
    from train.data.conversations import ChatTemplate
    chatml, tok = ChatTemplate.builtin("chatml"), ByteTokenizer()
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    reply = ChatSession(model, tok, chatml, max_new_tokens=5).respond(msgs)
    plain = ChatSession(model, tok, chatml, max_new_tokens=5).respond([{"role": "user", "content": "yo"}])
    f = write(tmp_path / "chat.jsonl", [{"prompt": msgs, "expected": reply}, {"prompt": "yo", "expected": plain}])
    res = evaluate_files(model, tok, [f], TEST_DEVICE, template=chatml, max_new_tokens=5,
                         log=lambda m: None)["chat"]
    assert [d["output"] for d in res["details"]] == [reply, plain] and res["exact_match"] == 1.0


def test_image_questions_bad_rows_name_the_file_and_line(tmp_path, model):
    """Image questions: the image's path relative to the task file; a row without its question, one whose image is
    missing: an error naming the file and line (not skipped); image questions for a model that is not a
    vision-language model: an error naming the file."""
    (tmp_path / "a.png").write_bytes(b"")
    ok = {"image": "a.png", "question": "What digit is this?", "answer": "seven"}
    f = write(tmp_path / "img.jsonl", [ok, {"image": "a.png", "answer": "seven"}])
    with pytest.raises(DataError, match=r"img.jsonl: line 2: an image question needs image, question and answer "
                                        r"strings \(question missing\)$"):
        read_task(f)
    f.write_text(json.dumps(ok) + "\n\n" + json.dumps({**ok, "image": "sub/gone.png"}) + "\n")
    with pytest.raises(DataError, match=r"img.jsonl: line 3: image .*sub/gone.png: no such file$"):
        read_task(f)
    kind, rows = read_task(write(f, [ok]))
    assert kind == "image" and rows[0]["image"] == str(tmp_path / "a.png")
    with pytest.raises(DataError, match=r"img.jsonl: image questions need a vision-language model, not LLM$"):
        evaluate_files(model, ByteTokenizer(), [f], TEST_DEVICE, log=lambda m: None)
