"""Text to image: captioned images -> cached latents and cached prompt embeddings -> a FLUX.2 transformer trained with
rectified flow (data.format: captions, model.denoiser: flux2).

setup() fills the latent cache as the diffusion task does and embeds every distinct caption once with the frozen
text encoder (model.text_encoder, a Zoo LLM) into a prompt cache beside it, so a step runs no LLM; a dropped caption
is the empty prompt (row 0 of the cache), the unconditional side of classifier-free guidance."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

import zoo
from zoo.config import ConfigError, bounded
from zoo.diffusion.flux2_pipeline import prompt_embeds

from ..data import DataError, cache_dir, short_digest
from ..data.images import DIGIT_NAMES as DIGITS
from ..data.latents import prompt_cache, weights_fingerprint
from .diffusion import (DiffusionDataConfig, DiffusionTask, ImageData, buckets_of, load_images, sample_grid,
                        save_grid, split_images)

PHRASINGS = ("a handwritten digit {}", "the number {}, written by hand", "a {} in thick strokes", "a scanned {}")


@dataclass
class CaptionDataConfig(DiffusionDataConfig):
    format: str = "captions"                # images with captions: `dataset` a folder of images with a .txt caption
                                            # beside each, a jsonl file of {"image", "caption"} rows (paths relative
                                            # to it), or `digits` with generated captions
    caption_dropout: float = bounded(0.1, ge=0, le=1)  # captions replaced by the empty prompt (guidance; 1: none kept)
    sample_prompts: list[str] = field(default_factory=list)  # the rows of samples.png; empty: up to ten val captions


def caption_pairs(dataset: str, source: str, log=print) -> list:
    """[(image path, caption)] of a folder (a .txt beside each image) or a jsonl file; an image without a caption or
    that does not decode is counted and skipped (one line naming the first); none left is a one-line error."""
    from PIL import Image

    from ..data.images import IMAGE_EXTENSIONS
    root, pairs = Path(dataset), []
    if root.suffix == ".jsonl" and root.is_file():
        for n, line in enumerate(root.read_text().splitlines(), 1):
            try:
                row = json.loads(line) if line.strip() else None
                pairs += [(str(root.parent / row["image"]), row.get("caption"))] if row is not None else []
            except (ValueError, KeyError, TypeError, AttributeError):
                raise ConfigError(f"{source}: data.dataset: {root}:{n}: not a {{\"image\", \"caption\"}} row") from None
    elif root.is_dir():
        images = sorted(p for p in root.rglob("*") if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file())
        pairs = [(str(p), p.with_suffix(".txt").read_text().strip() if p.with_suffix(".txt").is_file() else None)
                 for p in images]
    else:
        raise ConfigError(f"{source}: data.dataset: {dataset}: no such folder or .jsonl file")
    if missing := [p for p, c in pairs if not isinstance(c, str)]:
        log(f"data: skipped {len(missing)} images without a caption (first: {missing[0]})")
    bad = {}
    for p, c in pairs:
        try:
            with Image.open(p) as im:
                im.verify()
        except Exception as e:  # any decoding failure (or a missing file): counted, named, skipped
            bad[p] = f"{p} ({type(e).__name__})"
    if bad:
        log(f"data: skipped {len(bad)} undecodable images (first: {next(iter(bad.values()))})")
    pairs = [(p, c) for p, c in pairs if isinstance(c, str) and p not in bad]
    if not pairs:
        raise ConfigError(f"{source}: data.dataset: {dataset}: no captioned images")
    return pairs


def load_captioned(d: CaptionDataConfig, size: int, source: str, log=print, buckets=None) -> tuple[ImageData, list]:
    """(ImageData whose labels index the prompts, the prompts: "" first, then every distinct caption and sample
    prompt). `digits` captions each image with one of a few phrasings of its digit's name; `buckets` as
    split_images."""
    if d.dataset == "digits":
        data = load_images(d, size, source)
        captions = {s: [PHRASINGS[i % len(PHRASINGS)].format(DIGITS[y]) for i, y in enumerate(data.labels[s].tolist())]
                    for s in data.labels}
        texts = captions["train"] + captions["val"]
    else:
        pairs = caption_pairs(d.dataset, source, log)
        texts = [c for _, c in pairs]
    prompts = ["", *sorted(set(texts + list(d.sample_prompts)) - {""})]
    index = {p: i for i, p in enumerate(prompts)}
    if d.dataset == "digits":
        data = dataclasses.replace(data, labels={s: torch.tensor([index[c] for c in captions[s]]) for s in captions})
    else:
        key = {"dataset": d.dataset, "size": size, "val": d.val_fraction}
        data = split_images(d, [(p, index[c]) for p, c in pairs], size, source, key, 0, buckets)
    data.key["captions"] = short_digest(prompts)
    return dataclasses.replace(data, classes=len(prompts)), prompts


class TextEncoder:
    """model.text_encoder, frozen: a model folder (the tokenizer and chat template in it or, as in a pipeline folder, in
    ../tokenizer; without one, a byte-vocab model reads the caption's bytes) or an LLM config file built at random (seed 0; vocab_size 256).
    embed(prompts) -> (B, text_length, len(text_layers) * d_model); `truncated`: the prompts it cut to text_length."""
    CAPTION = "{{ messages[0]['content'] }}"  # a byte-level encoder reads the caption alone

    def __init__(self, m, source: str, device, path=None):
        from ..data.conversations import ChatTemplate, tokenizer_and_template
        from ..data.text_tokenizers import ByteTokenizer
        path, self.m, self.device = Path(path or m.text_encoder), m, device
        try:
            if path.is_dir():
                self.llm, self.random = zoo.from_pretrained(path), False
            else:
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(0)
                    self.llm, self.random = zoo.build(path), True
            tokenizer = next((d for d in (path, path.parent / "tokenizer")  # a pipeline folder's: ../tokenizer
                              if any((d / f).is_file() for f in ("tokenizer.json", "tokenizer.model"))), None)
            if not tokenizer and self.llm.config.vocab_size != 256:
                raise ValueError(f"no tokenizer, and vocab_size={self.llm.config.vocab_size} is not the bytes' 256")
            self.tok, self.template = tokenizer_and_template(tokenizer) if tokenizer else \
                (ByteTokenizer(), ChatTemplate(self.CAPTION, name="caption"))
        except (ValueError, OSError, DataError) as e:
            raise ConfigError(f"{source}: model.text_encoder={path}: {str(e).splitlines()[0]}") from None
        if self.template is None:
            raise ConfigError(f"{source}: model.text_encoder={path}: no chat template (prompts are rendered with it)")
        c, width = self.llm.config, len(m.text_layers) * self.llm.config.d_model
        if m.flux2.text_dim != width:
            raise ConfigError(f"{source}: model.flux2.text_dim={m.flux2.text_dim}: the text encoder gives "
                              f"{len(m.text_layers)} layers x {c.d_model}; set it to {width}")
        if bad := [i for i in m.text_layers if not 0 <= i <= c.n_layers]:
            raise ConfigError(f"{source}: model.text_layers: {bad} out of range (the text encoder has {c.n_layers})")
        if m.text_length > c.max_seq_len:
            raise ConfigError(f"{source}: model.text_length={m.text_length} exceeds the text encoder's context "
                              f"{c.max_seq_len}")
        self.llm.requires_grad_(False).eval().to(device)
        self.truncated = []

    def key(self) -> dict:
        """What the embeddings depend on: the weights, layers, length, tokenizer and template."""
        return {"encoder": weights_fingerprint(self.llm), "layers": list(self.m.text_layers),
                "length": self.m.text_length, "tokenizer": str(self.tok.spec), "template": self.template.source}

    @torch.no_grad()
    def embed(self, prompts: list) -> torch.Tensor:
        from ..data.conversations import prompt_tokens
        L = self.m.text_length
        ids, mask = prompt_tokens(self.tok, self.template, prompts, L + 1)
        self.truncated += [p for p, long in zip(prompts, mask[:, L].tolist()) if long]
        return prompt_embeds(self.llm, ids[:, :L].to(self.device), mask[:, :L].to(self.device), self.m.text_layers)


def encoder_architecture(path) -> torch.nn.Module:
    """model.text_encoder's model with random weights (the planner builds it on fake tensors): an LLM config file, or
    a folder's config (Zoo's config.yaml, else Hugging Face's config.json) in the dtype of its weights."""
    from zoo.weights import hf_llm, zoo_folder
    from zoo.weights.files import FILE_DTYPES, read_json, read_safetensors_header
    p = Path(path)
    if not p.is_dir():
        return zoo.build(p)
    arch = zoo_folder.folder_config(p) or hf_llm.config_from_hf(hf_llm.unwrap(read_json(p / "config.json"))[0])[0]
    table, model = read_safetensors_header(sorted(p.glob("*.safetensors"))[0])[0], zoo.build(arch)
    dtype = next(d for d in (FILE_DTYPES.get(t["dtype"], torch.bool) for t in table.values()) if d.is_floating_point)
    for w in model.parameters():  # as bf16-pure does it: fake tensors too
        w.data = w.data.to(dtype)
    return model


class TextToImageTask(DiffusionTask):
    DataConfig = CaptionDataConfig
    null_label = 0  # the prompt cache's row of the empty prompt

    def label_dropout(self) -> float:
        return self.cfg.data.caption_dropout

    def load_data(self) -> ImageData:
        data, self.prompts = load_captioned(self.cfg.data, self.cfg.model.image_size, self.cfg.source, self.log,
                                            buckets_of(self.cfg))
        return data

    def setup(self):
        super().setup()
        cfg, d = self.cfg, self.cfg.data
        enc = TextEncoder(cfg.model, cfg.source, self.device)
        key = enc.key()
        key["prompts"] = short_digest(self.prompts)
        folder = cache_dir(d.cache_dir) / f"prompts-{Path(d.dataset).name}-{short_digest(key)}"
        self.embeds = prompt_cache(folder, key, self.prompts, enc.embed, d.encode_batch_size, self.log)
        if enc.truncated:
            self.log(f"prompts: {len(enc.truncated)} longer than model.text_length={cfg.model.text_length} tokens, "
                     f"truncated (first: {enc.truncated[0][:60]!r})")
        self.encoder = enc.llm.cpu() if enc.random else None  # saved with the run (save_files); off the device
        self.log(f"prompts: {len(self.prompts)} distinct, embeddings {tuple(self.embeds.shape[1:])} each")

    def condition(self, labels: torch.Tensor) -> torch.Tensor:
        """Prompt indices (B,) -> their cached embeddings (B, L, D) on the device."""
        return torch.from_numpy(np.ascontiguousarray(self.embeds[labels.cpu().numpy()])).to(self.device)

    def build_model(self):
        model = super().build_model()
        model.null_text.copy_(self.condition(torch.zeros(1, dtype=torch.long))[0])
        return model

    def example_batch(self, model, batch_size):
        batch, m = super().example_batch(model, batch_size), self.cfg.model
        return {**batch, "labels": torch.zeros(batch_size, m.text_length, m.flux2.text_dim, device=self.device)}

    def save_files(self, out_dir):
        """A random-init text encoder's weights (text_encoder/), which train/sample.py reads back."""
        if self.encoder is not None:
            zoo.save_pretrained(self.encoder, Path(out_dir) / "text_encoder")

    def samples(self, model, out_dir):
        d = self.cfg.data
        prompts = d.sample_prompts or list(dict.fromkeys(self.prompts[i] for i in self.y_va.tolist()))[:10]
        rows = torch.tensor([self.prompts.index(p) for p in prompts])
        images = sample_grid(model, d.samples_per_class, self.device, self.cfg.train.seed, self.autocast,
                             conditions=self.condition(rows))
        path = Path(out_dir) / "samples.png"
        save_grid(images, path, nrow=d.samples_per_class)
        m = self.cfg.model
        return (f"{path}: {len(images)} samples, a row per prompt ({', '.join(map(repr, prompts[:3]))}, ...; "
                f"{m.sampler}, {m.sample_steps} steps, guidance {m.guidance})")
