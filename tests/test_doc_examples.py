"""Every code example of README.md and docs/*.md runs (DESIGN.md, "Docs that cannot go stale").

```python blocks: each runs (exec) in a fresh namespace that holds `torch` and `zoo`, with the working
folder a temporary "world" where every path the examples name exists: `configs/` is the checkout's, and
`make_world` below makes tiny stand-ins for the rest (a Hugging Face folder, GGUF files, Zoo run folders,
timm / torchvision weights, a TAESD pair, a diffusers DiT folder; a file's name says what it would hold
in real use, its content is small). What a block uses without making it (its inputs: `x`, `images`, ...)
comes from INPUTS; SHRINK is how an example is shrunk here: a textual substitution (a shape, a length,
`compile=True`), and ON_CPU turns a CUDA device of any block into the CPU, where these examples run. Both
tables are keyed by the page and a text the block contains; an entry that matches no block fails the
test, so they cannot go stale. A block that needs more than a few seconds is in SLOW and runs in the
slow tier only.

```yaml blocks: each is a run config, whole or in part, and loads through load_run_config (the sections it
leaves out take their defaults).

```bash blocks: every `python train/PROGRAM.py ...` line (also after `torchrun ...`) is parsed as the
program parses it: run.py and prepare.py through load_run_config (the config, the overrides and the checks
across sections; init_from paths exist in the world), chat.py / eval.py / predict.py / plan.py and each
benchmark through their own argparse parser, stopped right after it parsed; `python -c` runs. `pip`,
`python -m pytest` and `cp` lines are the business of test_base_install.py, the suite itself and
test_copyable_blocks.py (which runs the README's `cp`).
"""
from __future__ import annotations

import argparse
import json
import re
import shlex
import shutil
import sys
from pathlib import Path

import pytest
import torch

import zoo

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is faster on a busy machine
ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```(python|bash|yaml)\n(.*?)^```", re.S | re.M)
DEVICES_NAMED = True  # conftest: under ZOO_TEST_DEVICE=cuda too, the examples run on the CPU (ON_CPU)

# (page, a text of the block) -> the code that makes the block's inputs (run before it, same namespace)
INPUTS = {
    ("llm.md", "model.generate(prompt_ids"): "x = targets = torch.randint(0, 2048, (2, 64))\n"
                                             "prompt_ids = torch.tensor([[1, 2, 3]])",
    ("pretrained.md", "max_new_tokens=50"): "prompt_ids = torch.tensor([[1, 2, 3]])",
    ("pretrained.md", "load_tokenizer(model)"): "prompt = 'Hello world'",
    ("deploy.md", "int4wo"): "ids = torch.tensor([[1, 2, 3]])",
    ("deploy.md", "compile_frozen"): "x1 = x2 = x3 = torch.randn(4, 1, 32, 32)\nimages = torch.randn(2, 1, 32, 32)",
    ("deploy.md", "zoo.prune"): "model = zoo.build('configs/llm/tiny.yaml', n_layers=1)\n"
                                "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)",
    ("convnet.md", "forward_features"): "x = torch.randn(2, 3, 64, 64)",
    ("vit.md", "dinov3-vits16"): "images = torch.randn(2, 3, 32, 48)",
    ("vit.md", "SmolVLM-256M"): "input_ids = torch.tensor([[1] + [2] * 4 + [3]])\n"
                                "pixel_values = torch.randn(1, 1, 3, 32, 32)\n"
                                "pixel_attention_mask = torch.ones(1, 1, 32, 32, dtype=torch.bool)",
    ("diffusion.md", "ae.encode"): "images = torch.rand(1, 3, 64, 64)",
    ("diffusion.md", "dit(latents"): "latents, timestep = torch.randn(2, 4, 8, 8), torch.tensor([10, 500])\n"
                                     "class_labels = torch.tensor([1, 2])",
    ("diffusion.md", "flux(tokens"): "L, h, w, t = 3, 2, 4, torch.tensor([0.5])\n"
                                     "tokens, text_embeds = torch.randn(1, h * w, 128), torch.randn(1, L, 64)",
    ("post-training.md", "ChatTemplate"): "from train.data.text_tokenizers import load_tokenizer_file\n"
                                          "tokenizer = load_tokenizer_file('path/to/hf_folder/tokenizer.json')\n"
                                          "messages = [{'role': 'user', 'content': 'Hi'}, "
                                          "{'role': 'assistant', 'content': 'Hello!'}]",
}
# (page, a text of the block) -> [(old, new), ...]: how the block is shrunk here
SHRINK = {
    ("README.md", "smollm-135m.yaml"): [('smollm-135m.yaml")', 'smollm-135m.yaml", n_layers=2)')],
    ("llm.md", "model.generate(prompt_ids"): [("max_new_tokens=100", "max_new_tokens=4"),
                                             ("max_new_tokens=500, compile=True", "max_new_tokens=4")],
    ("convnet.md", "forward_features"): [("224, 224", "64, 64")],
    ("pretrained.md", "max_new_tokens=50"): [("max_new_tokens=50", "max_new_tokens=4")],
    ("diffusion.md", "fp.sample"): [("(9, 18, 27)", "(2,)"), ("prompts, 512)", "prompts, 16)"),
                                    ("32, 32, steps=50", "2, 2, steps=2")],
    ("pretrained.md", "load_tokenizer(model)"): [("torch.tensor([ids]), 64,", "torch.tensor([ids]), 4,")],
    ("deploy.md", "int4wo"): [("model.generate(ids, 128)", "model.generate(ids, 4)")],
}
ON_CPU = [('device="cuda"', 'device="cpu"')]  # any block: the examples run on the CPU here, a CUDA device too
SLOW = {("deploy.md", "compile_frozen"): "PT2E int8 quantization and an inductor compile of a ResNet"}
SKIP_LINES = ("pip ", "cp ", "python -m pytest", "ZOO_TEST_DEVICE=")


def blocks(lang: str):
    for page in PAGES:
        text = page.read_text()
        for m in BLOCK.finditer(text):
            if m.group(1) == lang:
                yield page.name, text[:m.start()].count("\n") + 1, m.group(2)


def entry(table: dict, page: str, code: str):
    found = [v for (p, needle), v in table.items() if p == page and needle in code]
    assert len(found) <= 1, (page, code[:80])
    return found[0] if found else None


def test_the_tables_name_blocks_that_exist():
    """Every INPUTS / SHRINK / SLOW entry matches a python block of its page."""
    code = [(page, c) for page, _, c in blocks("python")]
    for table in (INPUTS, SHRINK, SLOW):
        for page, needle in table:
            assert any(p == page and needle in c for p, c in code), f"no python block of {page} has {needle!r}"


# ----------------------------------------------------------------------------------------------- the world

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
TEXT = ("The quick brown fox jumps over the lazy dog. def f(x): return x ** 2  # 1234\n"
        "Hello world, the dog and the fox are friends; numbers 0 1 2 3 4 5 6 7 8 9.\n") * 20


def gguf_tokenizer(folder: Path):
    """A byte-level BPE with ChatML's specials and template, as a GGUF file's tokenizer metadata holds it."""
    import gguf
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from zoo.weights.gguf_llm import load_tokenizer
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=320, special_tokens=specials, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    vocab = tok.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    merges = [" ".join(m) if isinstance(m, list) else m for m in json.loads(tok.to_str())["model"]["merges"]]
    path = folder / "tokenizer-only.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in specials else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(CHATML)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return load_tokenizer(path)


def small_llm(vocab_size: int, **kw):
    return zoo.build({"vocab_size": vocab_size, "d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
                      "max_seq_len": 256, **kw})


def make_world(w: Path):
    from PIL import Image

    from train.data.text_tokenizers import train_sentencepiece
    from zoo.convnet.preprocess import Preprocess
    from zoo.diffusion.dit import DiT
    from zoo.diffusion.flux2 import Flux2
    from zoo.diffusion.taesd import TAESD
    from zoo.config import DiTConfig, ViTConfig, VLMConfig
    from zoo.vlm import VLM
    from zoo.weights import hf_vit, zoo_folder
    (w / "configs").symlink_to(ROOT / "configs")
    shutil.copy(ROOT / "zoo/blocks/norm.py", w / "norm.py")  # the README's copied block, next to "your code"
    torch.manual_seed(0)
    # LLMs: a GGUF file (and the names the examples give it), a Hugging Face folder, Zoo run folders
    tok = gguf_tokenizer(w)
    llm = small_llm(tok.vocab_size)
    for name in ("model.gguf", "source.gguf", "SmolLM2-135M-Instruct.Q4_1.gguf",
                 "PATH/TO/SmolLM2-135M-Instruct.Q4_1.gguf"):
        (w / name).parent.mkdir(parents=True, exist_ok=True)
        zoo.save_pretrained(llm, w / name, tokenizer=tok)
    zoo.save_pretrained(zoo.from_pretrained(w / "model.gguf"), w / "path/to/hf_folder", tokenizer=tok)
    train_sentencepiece([TEXT], 340, w / "path/to/tokenizer.model", log=lambda s: None)
    for run in ("runs/tiny", "runs/tiny-sft"):
        zoo_folder.save(small_llm(2048), w / run)
    zoo_folder.save(small_llm(2048, mod_capacity=0.25, mod_every=2), w / "runs/mod")
    # ConvNets: timm / torchvision files, a run folder with its preprocessing and an image
    tiny_resnet = zoo.build({"family": "convnet", "model": {"arch": "resnet18", "layers": [1, 1, 1, 1], "width": 8}})
    zoo.save_pretrained(tiny_resnet, w / "resnet50.pth")
    zoo.save_pretrained(zoo.build({"family": "convnet", "model": {"arch": "resnet18"}}), w / "tv_resnet18.pth")
    atto = zoo.build({"family": "convnet", "model": {"arch": "convnext_atto"}})
    zoo.save_pretrained(atto, w / "convnext_atto.pth")
    zoo.save_pretrained(atto, w / "convnext_atto.safetensors")
    effnet = zoo.build({"family": "convnet", "model": {"arch": "efficientnet_b0"}})
    zoo.save_pretrained(effnet, w / "efficientnet_b0.ra_in1k")
    digits = zoo.build({"family": "convnet", "model": {"arch": "resnet18", "layers": [1, 1, 1, 1], "width": 8,
                                                       "in_chans": 1, "num_classes": 10, "stem": "small"}})
    for run in ("runs/imgs", "runs/resnet-digits"):
        zoo.save_pretrained(digits, w / run)
        Preprocess(32, 1, (0.5,), (0.25,), classes=tuple(str(i) for i in range(10))).save(w / run)
    Image.new("RGB", (40, 48), (200, 30, 30)).save(w / "photo.jpg")
    dinov3 = {"arch": "vit_small_patch16_224", "embed_dim": 32, "depth": 1, "num_heads": 2, "patch_size": 8,
              "img_size": 32, "num_classes": 0, "rope_theta": 100.0, "init_values": 1.0, "no_embed_class": True}
    hf_vit.save(zoo.build({"family": "vit", "model": dinov3}), w / "dinov3-vits16")  # an HF DINOv3ViTModel folder
    vision = {k: v for k, v in dinov3.items() if k not in ("rope_theta", "init_values")}
    vlm = VLMConfig(vision=ViTConfig(**vision, class_token=False, mlp="gelu_tanh"), image_token_id=2,
                    text=small_llm(64).config)
    zoo.save_pretrained(VLM(vlm), w / "SmolVLM-256M-Instruct")  # an HF SmolVLMForConditionalGeneration folder
    # diffusion: a TAEF2-shaped pair, a diffusers AutoencoderTiny folder, diffusers DiT and FLUX.2 folders
    zoo.save_pretrained(TAESD(32, midblock_gn=True, channels=8), w / "taef2_encoder.pth")
    zoo.save_pretrained(TAESD(4, channels=8), w / "taesd_diffusers")
    zoo.save_pretrained(DiT(DiTConfig(depth=1, width=32, heads=2, patch_size=2), 4, 10, 8),
                        w / "DiT-XL-2-256/transformer")
    zoo.save_pretrained(Flux2(), w / "FLUX.2-klein-4B/transformer")
    zoo.save_pretrained(small_llm(tok.vocab_size), w / "FLUX.2-klein-4B/text_encoder", tokenizer=tok)  # width 64
    (w / "FLUX.2-klein-4B/tokenizer").mkdir()
    tok.save(w / "FLUX.2-klein-4B/tokenizer")
    config = w / "FLUX.2-klein-4B/tokenizer/tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "pad_token": "<|endoftext|>"}))


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    w = tmp_path_factory.mktemp("world")
    make_world(w)
    return w


# ------------------------------------------------------------------------------------------ python blocks

def python_cases():
    for page, line, code in blocks("python"):
        key = f"{page}:{line}"
        why = entry(SLOW, page, code)
        yield pytest.param(page, code, id=key, marks=[pytest.mark.slow] if why else [])


@pytest.mark.parametrize("page,code", python_cases())
def test_python_example_runs(page, code, world, monkeypatch):
    monkeypatch.chdir(world)
    monkeypatch.syspath_prepend(str(world))
    monkeypatch.delitem(sys.modules, "norm", raising=False)
    inputs = entry(INPUTS, page, code) or ""
    for old, new in entry(SHRINK, page, code) or []:
        assert old in code, (page, old)
        code = code.replace(old, new)
    for old, new in ON_CPU:
        code = code.replace(old, new)
    namespace = {"torch": torch, "zoo": zoo, "__name__": "__doc_example__"}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        exec(compile(inputs, f"<inputs of {page}>", "exec"), namespace)
        exec(compile(code, f"<{page} example>", "exec"), namespace)


# -------------------------------------------------------------------------------------------- bash blocks

class Parsed(Exception):
    """Raised by argparse once a program's arguments parsed: the program stops before it does anything."""


def commands():
    """(page, line of the block, argv) of every command line of the bash blocks; continued lines joined,
    comments dropped."""
    for page, line, code in blocks("bash"):
        for cmd in re.sub(r"\\\n\s*", " ", code).splitlines():
            cmd = cmd.strip()
            if cmd and not cmd.startswith(SKIP_LINES):
                yield pytest.param(page, shlex.split(cmd, comments=True), id=f"{page}:{line}:{cmd[:50]}")


def check_command(argv: list[str], world: Path, monkeypatch):
    if argv[0] == "torchrun":  # its own options, then the script and its arguments
        argv = ["python"] + argv[next(i for i, a in enumerate(argv) if a.endswith(".py")):]
    assert argv[0] == "python", f"not a python command: {argv}"
    if argv[1] == "-c":
        exec(compile(argv[2], "<python -c>", "exec"), {"__name__": "__main__"})
        return
    program, args = Path(argv[1]).stem, argv[2:]
    assert argv[1] == f"train/{program}.py" and (ROOT / argv[1]).is_file(), argv
    if program in ("run", "prepare"):
        from train.config import load_run_config
        path = args.pop(0) if args and "=" not in args[0] else str(ROOT / "configs/llm/tiny.yaml")
        load_run_config(path, args)
        return
    import importlib
    original = argparse.ArgumentParser.parse_args

    def parse_args(self, *a, **kw):
        original(self, *a, **kw)
        raise Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_args)
    if program == "bench":
        from train.bench import BENCHES
        assert args[0] in BENCHES, args[0]
    with pytest.raises(Parsed):
        importlib.import_module(f"train.{program}").main(args)


@pytest.mark.parametrize("page,argv", commands())
def test_shell_command_parses(page, argv, world, monkeypatch):
    monkeypatch.chdir(world)
    check_command(argv, world, monkeypatch)


@pytest.mark.parametrize("page,text", [pytest.param(page, code, id=f"{page}:{line}")
                                       for page, line, code in blocks("yaml")])
def test_yaml_example_is_a_run_config(page, text, world, monkeypatch):
    import yaml

    from train.config import load_run_config
    monkeypatch.chdir(world)
    load_run_config(None, base=yaml.safe_load(text))


def test_a_broken_example_fails(world, monkeypatch):
    """The checks above catch a wrong key, a wrong argument and a wrong call."""
    from zoo.config import ConfigError
    monkeypatch.chdir(world)
    with pytest.raises(ConfigError, match="train.max_stepz"):
        check_command(["python", "train/run.py", "configs/llm/tiny.yaml", "train.max_stepz=2"], world, monkeypatch)
    with pytest.raises(SystemExit):
        check_command(["python", "train/chat.py", "runs/tiny", "--temprature", "0.8"], world, monkeypatch)
    with pytest.raises(ConfigError, match="n_layerz"):
        test_python_example_runs("llm.md", "zoo.build('configs/llm/tiny.yaml', n_layerz=2)", world, monkeypatch)
    with pytest.raises(AttributeError):
        test_python_example_runs("llm.md", "zoo.build('configs/llm/tiny.yaml').generat()", world, monkeypatch)
