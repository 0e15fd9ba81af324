"""Chat fine-tuning of a vision-language model (`family: vlm`, zoo/vlm.py): the chat SFT task (sft.py) on `messages`
rows whose contents may be lists of text and image parts ({"type": "image", "image": PATH}); each image through the
model's ImageProcessor (zoo/vlm_processor.py: SmolVLM's tiles, or one tile of the encoder's size), its `<image>` place
in the rendered conversation the processor's text, the loss on the assistant's tokens. `path: synthetic` is the
embedded set: questions about scikit-learn's digits."""
from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

import zoo
from zoo.config import ConfigError, bounded
from zoo.vlm_processor import pad_images

from ..data import DataError, cache_dir
from ..data.chat_data import ChatData
from ..data.conversations import IMAGE_TOKENS, ChatDataConfig, content_text, image_path, read_conversations
from ..data.images import DIGIT_NAMES as WORDS, digits_dataset, image_processor, processed_image
from ..step import eval_mode
from . import Task
from .post_training import unwrapped
from .sft import SFTTask

QUESTIONS = ("What digit is this?", "Which number is shown?", "Name the digit in the picture.",
             "What number do you see?")


@dataclass
class VLMDataConfig(ChatDataConfig):
    synthetic_rows: int = bounded(2000, ge=10)  # `path: synthetic`: questions about scikit-learn's digits, the
                                            # held-out ones about images no training row shows
    val_fraction: float = bounded(0.1, gt=0, lt=1)  # conversations held out for validation when there is no
                                            # `val_path`
    drop_images: bool = False               # remove every image part (the text-only baseline of the same rows)
    image_splitting: Optional[bool] = None  # split each image into tiles of the encoder's size plus the whole image
                                            # as one, as SmolVLM's processor; null: train.init_from's
                                            # preprocessor_config.json, else false (one tile per image)
    longest_edge: Optional[int] = bounded(None, gt=0)  # images resized first so that their longest edge is this
                                            # (with image_splitting: a multiple of the tile); null: train.init_from's,
                                            # else four tiles with image_splitting and no resizing without


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
    """ChatData whose rows carry their images' tiles (n, C, S, S) from `processor` (an ImageProcessor), each image
    place in the rendered conversation the processor's text; a batch's pixel_values and pixel_attention_mask
    (pad_images) among its keywords."""

    def __init__(self, train_rows, val_rows, tokenizer, template, cfg, seed, log, processor, image_id: int):
        self.processor, self.image_id, self._images = processor, image_id, {}
        super().__init__(train_rows, val_rows, tokenizer, template, cfg, seed, log)

    def images(self, messages: list) -> tuple:
        """(the tiles of a conversation's images (n, C, S, S) or None, the text of each image); a DataError names
        a bad file."""
        paths = image_parts(messages)
        for p in paths:
            if p not in self._images:
                self._images[p] = processed_image(self.processor, p)
        done = [self._images[p] for p in paths]
        return torch.cat([d[0] for d in done]) if done else None, [d[1] for d in done]

    def encode_row(self, messages):
        pixels, texts = self.images(messages)
        ids, labels = self.template.encode(self.tokenizer, messages, self.cfg.train_on_prompt, texts)
        n, found, each = 0 if pixels is None else len(pixels), ids.count(self.image_id), self.processor.tokens
        if found != n * each:
            raise DataError(f"{found} image tokens for {n} images of {each} each (the tokenizer does not keep "
                            f"{IMAGE_TOKENS[0]} whole)")
        if self.image_id in ids[self.cfg.seq_len:]:
            raise DataError(f"its image tokens run past data.seq_len={self.cfg.seq_len}")
        return ids, [-100 if t == self.image_id else t for t in labels], pixels

    def collate(self, items):
        x, y, n, kw = ChatData.collate(items)
        pixels = [item[2] for item in items]
        if any(p is not None for p in pixels):
            kw = dict(zip(("pixel_values", "pixel_attention_mask"), pad_images(pixels)))
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
        p = self.processor = self._processor(m)
        folder = cache_dir(d.cache_dir) / "vlm-digits"
        train_rows, val_rows = self.held_out(lambda split, n: digit_rows(split, n, folder),
                                             lambda path: read_conversations(path, d.format, self.log, parts=True))
        if d.drop_images:
            for row, _ in train_rows + val_rows:
                for msg in row:
                    if not isinstance(msg["content"], str):
                        msg["content"] = [p for p in msg["content"] if p["type"] != "image"]
        self.symbols = p.markers()
        tokenizer = self._load_tokenizer(lambda: self._sentencepiece(train_rows))
        self.data = ImageChatData(train_rows, val_rows, tokenizer, self.chat_template, d, self.cfg.train.seed,
                                  self.log, p, m.config.image_token_id)
        self.log(f"data: images as {'tiles' if p.splitting else 'one tile'} of {p.size}x{p.size}, {p.tokens} tokens "
                 f"each" + (f", the longest edge resized to {p.longest_edge} first" if p.longest_edge else "")
                 + ("; image parts removed (data.drop_images)" if d.drop_images else ""))

    def _processor(self, model):
        """The ImageProcessor of train.init_from (its preprocessor_config.json), else of the model, with
        data.image_splitting and data.longest_edge where they are set."""
        d = self.cfg.data
        try:
            p = image_processor(model, self.cfg.train.init_from)
        except ValueError as e:
            raise ConfigError(f"{self.cfg.source}: train.init_from: {e}") from None
        splitting = p.splitting if d.image_splitting is None else d.image_splitting
        p = dataclasses.replace(p, splitting=splitting, longest_edge=d.longest_edge or p.longest_edge or
                                4 * p.size * bool(d.image_splitting))
        if p.splitting and d.longest_edge and d.longest_edge % p.size:
            raise ConfigError(f"{self.cfg.source}: data.longest_edge={d.longest_edge} must be a multiple of the tile "
                              f"size {p.size} (the encoder's image size)")
        return p

    def save_files(self, out_dir):
        super().save_files(out_dir)
        self.processor.save(out_dir)

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
                pixels, texts = self.data.images(m[:last])
                chat = ChatSession(vlm, self.data.tokenizer, self.chat_template, max_new_tokens=16,
                                   images=None if pixels is None else (pixels.to(self.device), texts))
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
