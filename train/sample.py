"""Text to images with a FLUX.2 [klein] pipeline folder (Zoo's transformer and Qwen3 text encoder, PNGs decoded by a
Zoo autoencoder: TAEF2) or with a text-to-image run folder of train/run.py; class numbers to images with a
class-conditional (U-Net or DiT) run folder.

    python train/sample.py FOLDER "a prompt" [...] --decoder taef2_encoder.pth [--out DIR --steps 4 --guidance 4
                                             --seed 0 --n 1 --size 1024 1024 --max-length 512 --shift auto]
    python train/sample.py RUN "a prompt" [...] [--out DIR --steps --guidance --seed 0 --n 1 --size H W --shift]
    python train/sample.py RUN 3 7 [...] [--out DIR --steps --guidance --seed 0 --n 1 --size H W]

FOLDER: what diffusers' Flux2KleinPipeline.save_pretrained writes (transformer/, text_encoder/, tokenizer/, vae/ for
the latents' statistics, model_index.json; `is_distilled` turns guidance off). RUN: a diffusion run folder (its EMA
weights when it kept them, an adapter run's base with its adapter; its sampler, steps, guidance, shift and
model.image_size unless given): of data.format: captions, or class-conditional, each prompt a class number. Writes
DIR/<prompt>-<seed>-<k>.png.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch


def load(folder):
    """(transformer, text encoder, tokenizer, chat template, (mean, std, pixels per token), distilled) of `folder`
    (without vae/: no normalisation, 16 pixels per token)."""
    import zoo
    from train.data.conversations import tokenizer_and_template
    from zoo.weights.diffusers_flux2 import latent_space
    f = Path(folder)
    index = json.loads((f / "model_index.json").read_text()) if (f / "model_index.json").is_file() else {}
    tok, template = tokenizer_and_template(f / "tokenizer")
    if template is None:
        raise ValueError(f"{f / 'tokenizer'}: no chat template (the prompts are rendered with it)")
    return (zoo.from_pretrained(f / "transformer"), zoo.from_pretrained(f / "text_encoder").eval(), tok, template,
            latent_space(f) or (None, None, 16), bool(index.get("is_distilled", False)))


@torch.no_grad()
def generate(folder, prompts: list[str], decoder, steps: int = 4, guidance: float = 4.0, seed: int = 0, n: int = 1,
             size=(1024, 1024), max_length: int = 512, layers=None, shift="auto") -> torch.Tensor:
    """Images (len(prompts) * n, 3, H, W) in [0, 1]: n per prompt, noise from one generator seeded `seed`."""
    from train.data.conversations import prompt_tokens
    from zoo.diffusion import flux2_pipeline as fp
    model, llm, tok, template, (mean, std, f), distilled = load(folder)

    def embed(ps):
        return fp.prompt_embeds(llm, *prompt_tokens(tok, template, ps, max_length), layers or fp.LAYERS)
    prompts = [p for p in prompts for _ in range(n)]
    cond, uncond = embed(prompts), embed([""] * len(prompts))
    z = fp.sample(model, cond, uncond, size[0] // f, size[1] // f, steps, 1.0 if distilled else guidance,
                  torch.Generator().manual_seed(seed), mean, std, shift)
    return decoder.decode(z).clamp(0, 1)


@torch.no_grad()
def generate_run(run, prompts: list[str], steps=None, guidance=None, seed: int = 0, n: int = 1, size=None,
                 shift="run") -> torch.Tensor:
    """Images (len(prompts) * n, 3, H, W) in [0, 1] of a diffusion run folder: its model (EMA weights when
    written; an adapter run: its train.init_from, Zoo weights, with its adapter/), a text-to-image run's text encoder
    (text_encoder/ when the run saved one, else model.text_encoder), a class-conditional run's prompts class
    numbers; `shift` a model.sample_shift value, or the run's."""
    from safetensors.torch import load_model

    from train.config import load_run_config
    from train.tasks.text_to_image import TextEncoder
    from zoo.diffusion.latent import LatentDiffusion
    from zoo.weights import peft_lora
    from zoo.weights.diffusers_lora import LORA_WEIGHTS, load_lora
    run = Path(run)
    cfg = load_run_config(str(run / "config.yaml"))
    if cfg.family != "diffusion":
        raise ValueError(f"{run}: not a diffusion run (family {cfg.family})")
    lora, base = run / "adapter" / LORA_WEIGHTS, Path(cfg.train.init_from or run)
    adapted = lora.is_file() or peft_lora.detect(run / "adapter")  # FLUX.2's in diffusers' file, else PEFT's
    weights = [base / "model.safetensors" if base.is_dir() else base] if adapted else \
        [run / "model_ema.safetensors", run / "model.safetensors"]  # an adapter run's base: what the run loaded
    weights = next((w for w in weights if w.is_file()), None)
    if weights is None:
        raise FileNotFoundError(f"{run}: no model.safetensors (has the run finished?)" if not adapted else
                                f"{run}: an adapter run whose train.init_from={base} holds no Zoo model.safetensors")
    model = LatentDiffusion(cfg.model if shift == "run" else dataclasses.replace(cfg.model, sample_shift=shift)).eval()
    load_model(model, str(weights))
    if lora.is_file():
        load_lora(model, lora)
    elif adapted:
        peft_lora.load(run / "adapter", base=model)
    if cfg.model.denoiser != "flux2":
        cond = class_labels(run, cfg.model.num_classes, prompts, n)
    else:
        own = run / "text_encoder"
        encoder = TextEncoder(cfg.model, cfg.source, torch.device("cpu"), own if own.is_dir() else None)
        cond = encoder.embed([p for p in prompts for _ in range(n)])
    return model.sample(cond, steps=steps, guidance=guidance, generator=torch.Generator().manual_seed(seed), size=size)


def class_labels(run, num_classes: int, prompts: list[str], n: int) -> torch.Tensor:
    """A class-conditional run's labels (len(prompts) * n,): each prompt a class number below num_classes."""
    bad = next((p for p in prompts if not (p.isdigit() and int(p) < num_classes)), None)
    if bad is not None:
        raise ValueError(f"{run}: a class-conditional run samples class numbers 0-{num_classes - 1}, got {bad!r}")
    return torch.tensor([int(p) for p in prompts for _ in range(n)])


def shift_value(v: str):
    """--shift's text -> a model.sample_shift value: "auto", None ("none") or a number > 0."""
    if v in ("auto", "none"):
        return None if v == "none" else v
    try:
        if float(v) > 0:
            return float(v)
    except ValueError:
        pass
    raise ValueError(f"--shift must be auto, none or a number > 0, got {v!r}")


def check_args(args):
    """The arguments no model needs to judge: the folder is there, --n and --steps at least 1, --decoder only for a
    pipeline folder (a run decodes with its own autoencoder)."""
    if not Path(args.folder).is_dir():
        raise ValueError(f"{args.folder}: no such folder")
    for name in ("n", "steps"):
        if (v := getattr(args, name)) is not None and v < 1:
            raise ValueError(f"--{name} must be >= 1, got {v}")
    if args.decoder is not None and (Path(args.folder) / "config.yaml").is_file():
        raise ValueError(f"--decoder is for a pipeline folder; {args.folder} is a run, decoded by its own autoencoder")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python train/sample.py", description=__doc__.split("\n\n")[0])
    p.add_argument("folder", help="a FLUX.2 [klein] pipeline folder or a diffusion run folder")
    p.add_argument("prompts", nargs="+", help="one or more prompts (a class-conditional run: class numbers)")
    p.add_argument("--decoder", help="a pipeline folder's: a Zoo autoencoder of the latent space (taef2_encoder.pth)")
    p.add_argument("--out", default="samples", help="folder for the PNGs (default samples)")
    p.add_argument("--steps", type=int, help="Euler steps (default 4; a run: its model.sample_steps)")
    p.add_argument("--guidance", type=float, help="classifier-free guidance scale (default 4; a run: its model.guidance)")
    p.add_argument("--seed", type=int, default=0, help="seed of the noise (default 0)")
    p.add_argument("--n", type=int, default=1, help="images per prompt (default 1)")
    p.add_argument("--size", type=int, nargs=2, metavar=("H", "W"),
                   help="pixels (default 1024 1024; a run: its model.image_size square)")
    p.add_argument("--shift", help="the noise levels' shift: auto (FLUX.2's for the size), none, or a number (default "
                                   "auto; a run: its model.sample_shift)")
    p.add_argument("--max-length", type=int, default=512, help="prompt tokens, padded to it (default 512)")
    p.add_argument("--layers", type=int, nargs="+", help="the text encoder's layers (default 9 18 27)")
    args = p.parse_args(argv)
    import zoo
    from train.tasks.diffusion import save_grid
    try:
        check_args(args)
        if (Path(args.folder) / "config.yaml").is_file():
            images = generate_run(args.folder, args.prompts, args.steps, args.guidance, args.seed, args.n, args.size,
                                  "run" if args.shift is None else shift_value(args.shift))
        elif args.decoder is None:
            raise ValueError(f"{args.folder}: a pipeline folder needs --decoder (its latent space's autoencoder)")
        else:
            images = generate(args.folder, args.prompts, zoo.from_pretrained(args.decoder).eval(), args.steps or 4,
                              4.0 if args.guidance is None else args.guidance, args.seed, args.n,
                              args.size or (1024, 1024), args.max_length, args.layers,
                              shift_value(args.shift or "auto"))
    except (FileNotFoundError, ValueError, OSError) as e:
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for i, image in enumerate(images):
        name = re.sub(r"[^\w-]+", "_", args.prompts[i // args.n])[:60] or "empty"
        save_grid(image[None], out / f"{name}-{args.seed}-{i % args.n}.png", 1, padding=0)
        print(out / f"{name}-{args.seed}-{i % args.n}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
