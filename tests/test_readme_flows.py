"""The README's flows as a user types them, in a temporary folder, each run shortened by overrides:
pretrain the default, fine-tune it on conversations with LoRA, chat with the adapter run, evaluate
it, load its export in transformers with its chat template; train a ConvNet on an RGB image folder
and name the classes of new images with predict.py."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
QUICK = ["train.progress=false", "train.eval_every=0", "train.eval_batches=2", "train.samples=false",
         "train.plot=false", "optim.warmup_steps=1"]


def run(*args, stdin=None):
    out = subprocess.run([sys.executable, *map(str, args)], cwd=ROOT, env=ENV, input=stdin, capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0, (args, out.stderr[-3000:])
    return out.stdout


def test_pretrain_then_lora_chat_eval_and_export(tmp_path):
    tiny, sft = tmp_path / "tiny", tmp_path / "sft"
    run("train/run.py", "configs/llm/tiny.yaml", f"train.out_dir={tiny}", "train.max_steps=6", "data.max_chars=400000",
        "train.average_last=0", *QUICK)
    run("train/run.py", "configs/llm/tiny-sft.yaml", f"train.init_from={tiny}", f"train.out_dir={sft}",
        "adapter.method=lora", "adapter.export_merged=true", "train.max_steps=4", "data.synthetic_rows=64",
        "data.eval_generate=0", *QUICK)
    answer = run("train/chat.py", sft, "--max-new-tokens", "8", stdin="Hi, my name is Ada.\n")
    assert answer.strip() is not None
    task = tmp_path / "task.jsonl"
    task.write_text(json.dumps({"context": "1 + 1 =", "choices": ["2", "3"], "answer": 0}) + "\n")
    run("train/eval.py", sft, "--task", task, "--json", tmp_path / "eval.json")
    assert "acc" in json.loads((tmp_path / "eval.json").read_text())["tasks"]["task"]
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(sft / "hf")
    assert tok.chat_template and "<|im_start|>" in tok.apply_chat_template([{"role": "user", "content": "hi"}],
                                                                             tokenize=False)
    AutoModelForCausalLM.from_pretrained(sft / "hf")


def colour_folder(root: Path, per_class: int, seed: int):
    rng = np.random.default_rng(seed)
    for name, colour in (("red", (210, 40, 40)), ("green", (40, 190, 40)), ("blue", (40, 40, 210))):
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            pixels = np.clip(np.array(colour) + rng.normal(0, 30, (28, 28, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(root / name / f"{i}.png")


def test_convnet_on_an_rgb_folder_then_predict(tmp_path):
    data, new, out = tmp_path / "data", tmp_path / "new", tmp_path / "run"
    colour_folder(data, 12, seed=0)
    colour_folder(new, 2, seed=1)
    run("train/run.py", "configs/convnet/resnet-digits.yaml", f"data.path={data}", f"train.out_dir={out}",
        "train.max_steps=40", *QUICK)
    import yaml
    built = yaml.safe_load((out / "config.yaml").read_text())["model"]  # the preset says 1 channel, 10 classes
    assert (built["in_chans"], built["num_classes"]) == (3, 3)       # the RGB folder of 3 classes decides
    lines = [json.loads(line) for line in run("train/predict.py", out, new, "--json").splitlines()]
    assert len(lines) == 6
    assert all(Path(r["image"]).parent.name == r["top"][0][0] for r in lines), lines
