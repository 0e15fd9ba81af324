"""Chat fine-tuning (SFT) of an LLM: conversations rendered with the model's chat template, the
loss on the assistant's tokens only.

The LM task (train/tasks/lm.py) with conversations for data (train/data/chat_data.py) for
`data.format: messages | prompt_completion | alpaca`; evaluation adds `val_exact_match`.
"""
from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import numpy as np
import torch

from zoo.config import ConfigError
from zoo.weights.files import atomic_write

from ..data import DataError, cache_dir, load_tokenizer_file, model_tokenizer, train_sentencepiece
from ..data import chat_example
from ..data.chat_data import ChatData
from ..data.conversations import BUILTIN, ChatDataConfig, ChatTemplate, find_template, read_conversations
from .lm import LMTask


class SFTTask(LMTask):
    masked_targets = True
    DataConfig = ChatDataConfig
    tokenizer_files = ("tokenizer.json", "tokenizer.model")

    @staticmethod
    def validate_config(cfg):
        LMTask.validate_config(cfg)
        d = cfg.data
        if d.path == "synthetic" and d.format != "messages":
            raise ConfigError(f"{cfg.source}: data.path=synthetic is a set of conversations: it needs "
                              f"data.format=messages, got {d.format}")

    # ------------------------------------------------------------------ data
    def setup(self):
        d = self.cfg.data
        self.chat_template = self._template()
        train_rows, val_rows = self._rows()
        tokenizer = self._tokenizer(train_rows)
        self.data = ChatData(train_rows, val_rows, tokenizer, self.chat_template, d, self.cfg.train.seed, self.log)
        trained = np.concatenate([y[y != -100] for _, y in self.data.train])
        p = np.bincount(trained).astype(np.float64)
        p = p[p > 0] / p.sum()
        self.entropy = float(-(p * np.log(p)).sum())
        rows = self.global_rows() if isinstance(self.cfg.train.batch_size, int) else 16
        waste = {"packed": self.data.padding_waste(rows, packed=True), "bucketed": self.data.padding_waste(rows),
                 "random": self.data.padding_waste(rows, 1)}
        self.log(f"data: {'packed' if d.pack else 'padded'} rows; padding would be {100 * waste['packed']:.1f}% of the "
                 f"batch tokens packed into rows of {d.seq_len}, {100 * waste['bucketed']:.1f}% padded with length "
                 f"bucketing (data.bucket_batches={d.bucket_batches}), {100 * waste['random']:.1f}% without; "
                 f"unigram entropy of the trained tokens {self.entropy:.3f} nats")

    def template(self) -> ChatTemplate:
        """The chat template the conversations are rendered with."""
        return self.chat_template

    def _template(self) -> ChatTemplate:
        t, init = self.cfg.data.template, self.cfg.train.init_from
        if t in BUILTIN:
            template = ChatTemplate.builtin(t)
        elif t is not None:
            template = ChatTemplate.from_pretrained(t)
        else:
            template = (find_template(self._init_tokenizers()) if init is not None else None) \
                or ChatTemplate.builtin("chatml")
        self.log(f"data: chat template: {template.name} (end of turn {template.end_of_turn!r})")
        return template

    def _rows(self):
        """(training rows, validation rows), each [(messages, (file, line))]."""
        d = self.cfg.data
        if d.path == "synthetic":  # the held-out conversations draw on names, numbers and words training never saw
            n_val = max(1, round(d.synthetic_rows * d.val_fraction))
            return ([(m, ("synthetic", i + 1)) for i, m in enumerate(chat_example.conversations("train", d.synthetic_rows - n_val))],
                    [(m, ("synthetic-val", i + 1)) for i, m in enumerate(chat_example.conversations("val", n_val))])
        rows = read_conversations(d.path, d.format, self.log)
        if len(rows) < 2:
            raise DataError(f"{d.path}: 1 usable conversation; at least 2 are needed (training and validation)")
        order = random.Random(0).sample(range(len(rows)), len(rows))  # the same split whatever the run's seed
        n_val = min(len(rows) - 1, max(1, round(len(rows) * d.val_fraction)))
        held = set(order[:n_val])
        return [r for i, r in enumerate(rows) if i not in held], [r for i, r in enumerate(rows) if i in held]

    def _tokenizer(self, train_rows):
        d = self.cfg.data
        spec = self._pretrained_tokenizer() or d.tokenizer
        if spec != "sentencepiece":
            if spec != "bytes" and not Path(spec).expanduser().is_file():
                raise DataError(f"{spec}: tokenizer file not found (data.tokenizer must be bytes, sentencepiece or "
                                f"a path to a tokenizer.model / tokenizer.json)")
            return load_tokenizer_file(spec if spec == "bytes" else Path(spec).expanduser())
        texts = [self.chat_template.render(m) for m, _ in train_rows]  # a tokenizer for the rendered conversations
        key = hashlib.sha256(f"{d.vocab_size}:{''.join(texts)}".encode()).hexdigest()[:16]
        path = cache_dir(d.cache_dir) / f"sp-chat-{key}.model"
        if not path.is_file():
            train_sentencepiece(texts, d.vocab_size, path, self.log)
        return load_tokenizer_file(path)

    # ------------------------------------------------------------------ training
    @property
    def documents(self) -> bool:
        return self.cfg.data.pack

    def train_batch(self, step, micro):
        """(inputs, targets, real tokens, document keywords: doc_ids and position_ids when packed)."""
        self._step = step
        B = self.cfg.train.batch_size
        x, y, n, docs = self.data.batch(step * self.cfg.train.grad_accum + micro, self.global_rows(),
                                        slice(self.rank * B, (self.rank + 1) * B) if self.world > 1 else None)
        return x.to(self.device), y.to(self.device), n, {k: v.to(self.device) for k, v in docs.items()}

    def example_batch(self, model, batch_size, seq_len=None):
        x, y = super().example_batch(model, batch_size, seq_len)
        docs = {"doc_ids": torch.zeros_like(x), "position_ids": torch.zeros_like(x)} if self.cfg.data.pack else {}
        return x, y, x.numel(), docs

    def loss(self, model, batch):
        """The mean loss over the batch's trained (assistant) tokens; it counts its real tokens."""
        x, y, n, docs = batch
        return self.forward_loss(model, x, y, docs)[0], n

    # ------------------------------------------------------------------ evaluation, samples
    @torch.no_grad()
    def evaluate(self, model):
        out = super().evaluate(model)
        if self.cfg.data.eval_generate:
            out["val_exact_match"] = self.exact_match(model, self.data.val_rows[:self.cfg.data.eval_generate])
        return out

    def exact_match(self, model, conversations) -> float:
        """The share of conversations whose greedily generated last answer equals the reference."""
        hits = 0
        for messages in conversations:
            last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
            got = self.answer(model, messages[:last])
            hits += got.strip() == messages[last]["content"].strip()
        return hits / max(len(conversations), 1)

    def answer(self, model, messages, max_new_tokens: int = 64) -> str:
        from ..chat import ChatSession
        session = ChatSession(model, self.data.tokenizer, self.chat_template, max_new_tokens=max_new_tokens)
        with self.autocast():
            return session.respond(messages)

    def samples(self, model, out_dir):
        lines = []
        for messages in self.data.val_rows[:4]:
            last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
            prompt = " | ".join(f"{m['role']}: {m['content']}" for m in messages[:last])
            lines.append(f"{prompt}\n  -> {self.answer(model, messages[:last])!r} "
                         f"(reference {messages[last]['content']!r})")
        text = "\n".join(lines)
        (Path(out_dir) / "samples.txt").write_text(text + "\n")
        return text

    # ------------------------------------------------------------------ files
    def save_files(self, out_dir):
        super().save_files(out_dir)
        write_template(self.chat_template, out_dir)

    def export(self, model, out_dir):
        path = super().export(model, out_dir)
        if path is not None:
            write_template(self.chat_template, path)
        return path


def write_template(template: ChatTemplate, folder):
    """Put the template and its special tokens into folder/tokenizer_config.json (kept or made)."""
    path = Path(folder) / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    config.update(template.to_config())
    atomic_write(path, json.dumps(config, indent=2, ensure_ascii=False) + "\n")
