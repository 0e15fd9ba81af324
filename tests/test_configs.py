"""Every shipped config runs: `python train/run.py CONFIG train.max_steps=20` exits 0 for each file
in configs/ (the three small ones also run under torchrun: tests/test_configs_torchrun.py).

Each run is a subprocess from the repository root (one thread per process), into its own
out_dir. Overrides beyond train.max_steps and train.out_dir are listed per config, each with the
reason it is there: only shapes of the large presets (so that 20 steps of a 7B preset fit in a
test on a CPU), data that is not on this machine (ImageNet and flower folders: the embedded digits
instead), and downloads (pretrained weights: a small file of the same format written here). The
small configs run exactly as shipped (but for the TAEF2 digits preset's denoiser width). Configs
that need ../shared (TAESD weights) skip, with the reason, when it is absent. The whole file is in the
slow tier (tests/conftest.py's SLOW).
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import SHARED

ROOT = Path(__file__).resolve().parents[1]
RUN_PY = ROOT / "train" / "run.py"
STEPS = "train.max_steps=20"

# A large LLM preset shrunk to a tiny model of the same kind (its GQA / MoE / tying / RoPE / norm
# choices kept): width, depth, heads and FFN sizes. The context and vocabulary shrink with it: the
# model's max_seq_len and the windows trained on (data.seq_len), and the sentencepiece vocabulary
# (data.vocab_size / model.vocab_size) trained on the first 6M characters of the corpus
# (data.max_chars), as configs/llm/tiny.yaml does, so that every LLM config shares one tokenizer
# (trained once, cached for the whole test run) instead of training one of 32000-152000 pieces on the
# whole corpus. The presets' accumulation over 16-64 micro-batches (a global batch for many GPUs)
# shrinks to 2 micro-batches (still accumulating): at 64 it is 1280 forward/backward passes in 20
# steps. train.compile stays as shipped in smollm-135m (the dense preset: one compilation); in the
# others it is off, since each compilation (recompiled per MoE routing shape) is slow on a CPU and
# says nothing more about the config.
LLM_SHAPES = ["model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.ffn_hidden=128",
              "model.max_seq_len=64", "model.vocab_size=2048", "data.vocab_size=2048", "data.seq_len=64",
              "data.max_chars=6000000", "train.grad_accum=2"]
NO_COMPILE = ["train.compile=false"]
# An ImageNet ResNet preset on data that is here: /data/imagenet is absent, so the embedded digits
# (1 grey channel, 10 classes) at 32x32; the depth (a ResNet-10 of the same block
# type), width and stem shrink so that a batch of 256 trains on a CPU in a test.
IMAGENET = ["data.path=digits", "data.image_size=32", "model.in_chans=1", "model.layers=[1,1,1,1]",
            "model.width=8", "model.stem=small", "model.num_classes=10"]

CASES = {  # config -> (the overrides beyond max_steps and out_dir, why)
    "llm/tiny.yaml": [],
    "llm/tiny-moe.yaml": [],
    "llm/tiny-mod.yaml": [],
    "llm/speedrun.yaml": [],
    "llm/smollm-135m.yaml": LLM_SHAPES + ["model.n_kv_heads=2"],  # 9 query heads over 3 kv heads -> 4 over 2
    "llm/llama-1b.yaml": LLM_SHAPES + NO_COMPILE + ["model.n_kv_heads=2"],
    "llm/llama2-7b.yaml": LLM_SHAPES + NO_COMPILE,
    "llm/mixtral-8x7b.yaml": LLM_SHAPES + NO_COMPILE + ["model.n_kv_heads=2"],  # its 8 experts, top-2, kept
    # 128 experts of 768 -> 8 of 32 (top-8 of 8 would route to all: top-2), head_dim 128 -> 16
    "llm/qwen3-30b-a3b.yaml": LLM_SHAPES + NO_COMPILE + ["model.n_kv_heads=2", "model.head_dim=16", "model.moe.n_experts=8",
                                            "model.moe.top_k=2", "model.moe.expert_hidden=32"],
    # MQA, head_dim 256 -> 16, a pattern of five local layers (window 512 -> 16) to one global over 6 layers
    "llm/gemma3-270m.yaml": LLM_SHAPES + NO_COMPILE + ["model.n_layers=6", "model.head_dim=16",
                                                       "model.sliding_window=16"],
    "convnet/resnet-digits.yaml": [],
    "convnet/convnext-digits.yaml": [],
    "convnet/efficientnet-digits.yaml": [],
    "convnet/mobilenetv3-digits.yaml": [],
    "vit/vit-tiny-digits.yaml": ["model.depth=1"],
    # taught by runs/resnet-digits (trained by the user first): resnet-digits.yaml's ResNet written here stands in
    "vit/deit-digits.yaml": ["model.depth=1", "train.teacher={resnet}"],
    "convnet/resnet18.yaml": IMAGENET,
    "convnet/resnet50.yaml": IMAGENET,
    # fine-tunes pretrained timm weights (train.init_from, downloaded by the user) on a flower folder
    # (absent): a ResNet of timm's layout written here stands in for the download, digits for the folder
    "convnet/resnet50-finetune.yaml": ["data.path=digits", "data.image_size=32", "model.num_classes=10",
                                       "train.init_from={weights}"],
    # SFT of the embedded default's run folder (runs/tiny, trained by the user first): a small LLM folder
    # on bytes written here stands in for it; a tenth of the conversations (encoding all is slow)
    # and 4 generated answers per evaluation instead of 64
    "llm/tiny-sft.yaml": ["train.init_from={llm}", "data.synthetic_rows=400", "data.eval_generate=4"],
    # RL from the SFT run (runs/tiny-sft, trained by the user first): the small LLM folder on bytes stands in for
    # it; 2 prompts x 4 completions of 8 tokens per step instead of 8 x 8 x 16
    "llm/tiny-grpo.yaml": ["train.init_from={llm}", "rl.prompts_per_step=2", "rl.group_size=4",
                           "rl.max_new_tokens=8", "data.eval_prompts=4"],
    "diffusion/digits.yaml": [],
    "diffusion/digits-text.yaml": [],
    "vlm/digits-vqa.yaml": ["data.eval_generate=20"],  # 20 held-out questions answered instead of 200
    # needs ../shared/weights/taef2_encoder.pth (skipped without it); its denoiser of [128, 256] channels
    # (slow on a CPU for 20 steps and the 80 guided samples) shrinks to [32, 64]
    "diffusion/digits-taef2.yaml": ["model.channels=[32,64]"],
    # the DiT variant of digits.yaml (the same cached autoencoder): 10 sampling steps instead of 50 for the
    # 80 guided samples, the only part of its 20-step run that its DiT makes slower than the U-Net's
    "diffusion/digits-dit.yaml": ["model.sample_steps=10"],
}
SMALL = ["llm/tiny.yaml", "convnet/resnet-digits.yaml", "diffusion/digits.yaml", "vlm/digits-vqa.yaml"]


def test_every_config_is_covered():
    """Each shipped config runs here, or is a model-family preset that tests/test_hf_arch.py checks against
    its transformers class (gemma3-270m does both)."""
    from test_hf_arch import PRESETS
    shipped = sorted(str(p.relative_to(ROOT / "configs")) for p in (ROOT / "configs").glob("*/*.yaml"))
    assert shipped == sorted(set(CASES) | {f"llm/{p}.yaml" for p in PRESETS})


def run(args: list, out: Path, timeout=600):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    p = subprocess.run([*args, f"train.out_dir={out}"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                       stderr=subprocess.PIPE, text=True, timeout=timeout)
    assert p.returncode == 0, p.stderr[-4000:]
    assert (out / "model.safetensors").is_file()


def timm_resnet(path: Path) -> Path:
    """A small ResNet in timm's layout (torch.save), as a downloaded timm / torchvision file is."""
    import torch

    import zoo
    from zoo.config import ConvNetConfig
    from zoo.convnet import ResNet
    torch.manual_seed(0)
    zoo.save_pretrained(ResNet(ConvNetConfig(arch="resnet50", layers=[1, 1, 1, 1], width=8, stem="small",
                                             in_chans=1, num_classes=1000)), path)
    return path


def digits_resnet(path: Path) -> Path:
    """configs/convnet/resnet-digits.yaml's ResNet at random init, saved as a folder as its run leaves one."""
    import zoo
    return zoo.save_pretrained(zoo.build(ROOT / "configs" / "convnet" / "resnet-digits.yaml"), path)


def zoo_llm(path: Path) -> Path:
    """A small LLM run folder on bytes (config.yaml, model.safetensors), as train/run.py writes one."""
    import torch

    import zoo
    from zoo.weights import zoo_folder
    torch.manual_seed(0)
    model = zoo.build(ROOT / "configs" / "llm" / "tiny.yaml", vocab_size=256, d_model=64, n_layers=2, n_heads=4,
                      n_kv_heads=2)
    return zoo_folder.save(model, path, tokenizer="bytes")


@pytest.mark.parametrize("config", sorted(CASES))
def test_config_runs_20_steps(config, tmp_path):
    if config == "diffusion/digits-taef2.yaml" and not (SHARED / "weights" / "taef2_encoder.pth").exists():
        pytest.skip(f"{SHARED / 'weights' / 'taef2_encoder.pth'} is absent (../shared is not beside this checkout)")
    made = {"weights": lambda: timm_resnet(tmp_path / "resnet50.pth"), "llm": lambda: zoo_llm(tmp_path / "llm"),
            "resnet": lambda: digits_resnet(tmp_path / "resnet-digits")}
    over = [o.format(**{k: f() for k, f in made.items() if "{" + k + "}" in o}) for o in CASES[config]]
    run([sys.executable, str(RUN_PY), str(ROOT / "configs" / config), STEPS, *over], tmp_path / "out")
