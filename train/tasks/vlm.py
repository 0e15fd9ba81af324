"""Chat fine-tuning of a vision-language model (`family: vlm`, zoo/vlm.py): the chat SFT task (sft.py) on `messages`
rows whose contents may be lists of text and image parts ({"type": "image", "image": PATH}); each image decoded to
the encoder's square, its place in the rendered conversation its image tokens (SmolVLM's layout without tiles), the
loss on the assistant's tokens. `path: synthetic` is the embedded set: questions about scikit-learn's digits."""
from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch

import zoo
from zoo.config import ConfigError, bounded

from ..data import DataError, cache_dir
from ..data.chat_data import ChatData
from ..data.conversations import (IMAGE_TOKENS, ChatDataConfig, content_text, image_path, image_text,
                                  read_conversations)
from ..data.images import digits_dataset, image_pixels
from ..step import eval_mode
from . import Task
from .post_training import unwrapped
from .sft import SFTTask

WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
QUESTIONS = ("What digit is this?", "Which number is shown?", "Name the digit in the picture.",
             "What number do you see?")


@dataclass
class VLMDataConfig(ChatDataConfig):
    synthetic_rows: int = bounded(2000, ge=10)  # `path: synthetic`: questions about scikit-learn's digits, the
                                            # held-out ones about images no training row shows
    val_fraction: float = bounded(0.1, gt=0, lt=1)  # conversations held out for validation when there is no
                                            # `val_path`
    drop_images: bool = False               # remove every image part (the text-only baseline of the same rows)


def image_parts(messages: list) -> list[str]:
    """The image files of a conversation, in order."""
    return [image_path(p) for m in messages if not isinstance(m["content"], str) for p in m["content"]
            if p["type"] == "image"]


def digit_rows(split: str, n: int, folder) -> list:
    """n conversations about the digits of `split` (scikit-learn's, a fifth held out), each image a PNG in
    `folder`: a question in one of a few phrasings, the digit's word as the answer."""
    from PIL import Image
    images, labels = digits_dataset(split, size=8)
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        k, path = i % len(labels), folder / f"{split}-{i % len(labels)}.png"
        if not path.is_file():
            Image.fromarray((images[k, 0].numpy() * 255).round().astype(np.uint8)).save(path)
        question = {"type": "text", "text": random.Random(i).choice(QUESTIONS)}
        rows.append(([{"role": "user", "content": [{"type": "image", "image": str(path)}, question]},
                      {"role": "assistant", "content": WORDS[int(labels[k])]}], (f"synthetic-{split}", i + 1)))
    return rows


class ImageChatData(ChatData):
    """ChatData whose rows carry their images' pixels (images, C, size, size), each image part rendered as its
    `tokens` image tokens; a batch's pixel_values (B, images, C, H, W; all-zero images pad) among its keywords."""

    def __init__(self, train_rows, val_rows, tokenizer, template, cfg, seed, log, size: int, tokens: int,
                 image_id: int):
        self.size, self.tokens, self.image_id, self._pixels = size, tokens, image_id, {}
        super().__init__(train_rows, val_rows, tokenizer, template, cfg, seed, log)

    def pixels(self, messages: list):
        """(images, C, size, size) of a conversation's image parts, or None; a DataError names a bad file."""
        paths = image_parts(messages)
        for p in paths:
            if p not in self._pixels:
                self._pixels[p] = image_pixels(p, self.size)[0]
        return torch.cat([self._pixels[p] for p in paths]) if paths else None

    def encode_row(self, messages):
        pixels = self.pixels(messages)
        text = [m if isinstance(m["content"], str) else {**m, "content": [
            p if p["type"] == "text" else {"type": "text", "text": image_text(self.tokens)} for p in m["content"]]}
            for m in messages]
        ids, labels = self.template.encode(self.tokenizer, text, self.cfg.train_on_prompt)
        n, found = 0 if pixels is None else len(pixels), ids.count(self.image_id)
        if found != n * self.tokens:
            raise DataError(f"{found} image tokens for {n} images of {self.tokens} each (images the template does not "
                            f"place, or {IMAGE_TOKENS[0]} in the text)")
        if self.image_id in ids[self.cfg.seq_len:]:
            raise DataError(f"its image tokens run past data.seq_len={self.cfg.seq_len}")
        return ids, [-100 if t == self.image_id else t for t in labels], pixels

    def collate(self, items):
        x, y, n, kw = ChatData.collate(items)
        pixels = [item[2] for item in items]
        if any(p is not None for p in pixels):
            shape = next(p for p in pixels if p is not None).shape[1:]
            kw = {"pixel_values": torch.zeros(len(items), max(len(p) for p in pixels if p is not None), *shape)}
            for r, p in enumerate(pixels):
                if p is not None:
                    kw["pixel_values"][r, :len(p)] = p
        return x, y, n, kw


class VLMTask(SFTTask):
    DataConfig, formats, symbols = VLMDataConfig, {}, IMAGE_TOKENS
    unfreeze_groups = Task.unfreeze_groups

    @staticmethod
    def validate_config(cfg):
        d, m = cfg.data, cfg.model
        if d.format != "messages":
            raise ConfigError(f"{cfg.source}: data.format={d.format}: a vision-language model trains on messages")
        if d.pack:
            raise ConfigError(f"{cfg.source}: data.pack: conversations with images are not packed")
        if d.template == "none":
            raise ConfigError(f"{cfg.source}: data.template=none: chat fine-tuning renders the conversations with a "
                              f"template (null: the checkpoint's own, else chatml)")
        if cfg.train.init_from is None and d.seq_len > m.text.max_seq_len:
            raise ConfigError(f"{cfg.source}: data.seq_len={d.seq_len} exceeds model.text.max_seq_len="
                              f"{m.text.max_seq_len}")

    def _fresh(self):
        """The model of train.init_from (a vision-language model), else of the config, in fp32 on the CPU."""
        if not self.cfg.train.init_from:
            return zoo.build(self.cfg.model)
        model = self.load_pretrained(lambda p: zoo.from_pretrained(p, dtype=torch.float32), say=False)
        if getattr(model, "family", None) != "vlm":
            raise ConfigError(f"{self.cfg.source}: train.init_from={self.cfg.train.init_from}: not a "
                              f"vision-language model")
        return model

    def setup(self):
        d, self.chat_template = self.cfg.data, self._template()
        with torch.device("meta") if not self.cfg.train.init_from else torch.device("cpu"):
            m = self._fresh()  # its image size and tokens per image
        folder = cache_dir(d.cache_dir) / "vlm-digits"
        train_rows, val_rows = self.held_out(lambda split, n: digit_rows(split, n, folder),
                                             lambda path: read_conversations(path, d.format, self.log, parts=True))
        if d.drop_images:
            for row, _ in train_rows + val_rows:
                for msg in row:
                    if not isinstance(msg["content"], str):
                        msg["content"] = [p for p in msg["content"] if p["type"] != "image"]
        tokenizer = self._load_tokenizer(lambda: self._sentencepiece(train_rows))
        self.data = ImageChatData(train_rows, val_rows, tokenizer, self.chat_template, d, self.cfg.train.seed,
                                  self.log, m.vision.spec["img_size"], m.image_tokens, m.config.image_token_id)
        self.log(f"data: images of {self.data.size}x{self.data.size}, {m.image_tokens} tokens each"
                 + ("; image parts removed (data.drop_images)" if d.drop_images else ""))

    def build_model(self):
        model = self._fresh()
        if self.data.tokenizer.encode(IMAGE_TOKENS[0]) != [model.config.image_token_id]:
            raise ConfigError(f"{self.cfg.source}: the tokenizer does not encode {IMAGE_TOKENS[0]} as the model's "
                              f"image_token_id={model.config.image_token_id}")
        if model.config.text.vocab_size < self.data.tokenizer.vocab_size:
            raise ConfigError(f"{self.cfg.source}: the model's vocab_size={model.config.text.vocab_size} is smaller "
                              f"than the tokenizer's {self.data.tokenizer.vocab_size}")
        self._use(model)
        return model

    def _use(self, model):
        self.moe, self.mod = None, False

    def flops_per_item(self, model):
        return None

    def loss(self, model, batch):
        x, y, n, kw = batch
        return self._global_mean(model(x, targets=y, **kw)[1], y), n

    @torch.no_grad()
    def evaluate(self, model):
        total, n = 0.0, 0
        with eval_mode(model):
            for x, y, _, kw in self.data.val_batches(self.cfg.train.batch_size, self.cfg.train.eval_batches):
                k = int((y != -100).sum())
                with self.autocast():
                    loss = model(x.to(self.device), targets=y.to(self.device),
                                 **{key: v.to(self.device) for key, v in kw.items()})[1]
                total, n = total + loss.item() * k, n + k
        out = {"val_loss": total / max(n, 1)}
        if self.cfg.data.eval_generate:
            out["val_exact_match"] = self.answered(model, self.cfg.data.eval_generate)[0]["exact_match"]
        return out

    def answered(self, model, n):
        """Each held-out conversation's last answer generated greedily, with its images."""
        from ..chat import ChatSession
        vlm, out, hits = unwrapped(model), [], 0
        if hasattr(vlm, "unshard"):  # FSDP2: the root's own tensors (embeddings, connector) whole for calls outside
            vlm.unshard()            # its forward; the blocks gather theirs when called
        with eval_mode(vlm), self.autocast():
            for m in self.data.val_rows[:n]:
                last = max(i for i, x in enumerate(m) if x["role"] == "assistant")
                pixels = self.data.pixels(m[:last])
                chat = ChatSession(vlm, self.data.tokenizer, self.chat_template, max_new_tokens=16,
                                   image=None if pixels is None else pixels[None].to(self.device))
                answer, want = chat.respond(m[:last]).strip(), content_text(m[last]).strip()
                hits += answer == want
                out.append((" | ".join(f"{x['role']}: " + "[image] " * len(image_parts([x])) + content_text(x)
                                       for x in m[:last]), answer, f"reference {want!r}"))
        if hasattr(vlm, "reshard"):
            vlm.reshard()
        return {"exact_match": hits / max(len(out), 1)}, out

    def export(self, model, out_dir):
        if not self.cfg.train.init_from or not self.cfg.train.export:
            return None
        path = zoo.save_pretrained(model, out_dir / "hf")
        self.save_files(path)
        return str(path)
