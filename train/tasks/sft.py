"""Chat fine-tuning (SFT) of an LLM (`data.format: messages | prompt_completion | alpaca`): conversations rendered with
the model's chat template, the loss on the assistant's tokens only; evaluation adds `val_exact_match`."""
from __future__ import annotations

import random

import numpy as np
import torch

from zoo.config import ConfigError

from ..data import DataError, cache_dir, chat_example, load_tokenizer_file, short_digest, train_sentencepiece
from ..data.chat_data import ChatData
from ..data.conversations import ChatDataConfig, read_conversations
from ..eval import score_generation
from .lm import LMTask
from .post_training import PostTrainingTask


class SFTTask(PostTrainingTask):
    masked_targets, DataConfig = True, ChatDataConfig
    default_template = "chatml"
    symbols: tuple = ()  # texts a tokenizer trained here keeps as one token each

    @staticmethod
    def validate_config(cfg):
        LMTask.validate_config(cfg)
        d = cfg.data
        if d.path == "synthetic" and d.format != "messages":
            raise ConfigError(f"{cfg.source}: data.path=synthetic is a set of conversations: it needs "
                              f"data.format=messages, got {d.format}")
        if d.template == "none":
            raise ConfigError(f"{cfg.source}: data.template=none: chat fine-tuning renders the conversations with a "
                              f"template (null: the checkpoint's own, else chatml)")

    def setup(self):
        d, self.chat_template = self.cfg.data, self._template()
        train_rows, val_rows = self.held_out(
            lambda split, n: [(m, ("synthetic" + ("-val" if split == "val" else ""), i + 1))
                              for i, m in enumerate(chat_example.conversations(split, n))],
            lambda path: read_conversations(path, d.format, self.log))
        tokenizer = self._load_tokenizer(lambda: self._sentencepiece(train_rows))
        self.data = ChatData(train_rows, val_rows, tokenizer, self.chat_template, d, self.cfg.train.seed, self.log)
        trained = np.concatenate([y[y != -100] for _, y, *_ in self.data.train])
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

    def split_off(self, rows):
        """A fixed random data.val_fraction of the conversations held out, whatever the run's seed."""
        d = self.cfg.data
        if len(rows) < 2:
            raise DataError(f"{d.path}: 1 usable conversation; at least 2 are needed (training and validation)")
        order = random.Random(0).sample(range(len(rows)), len(rows))
        n_val = min(len(rows) - 1, max(1, round(len(rows) * d.val_fraction)))
        held = set(order[:n_val])
        return [r for i, r in enumerate(rows) if i not in held], [r for i, r in enumerate(rows) if i in held]

    def _sentencepiece(self, train_rows):
        """A sentencepiece tokenizer trained on the rendered conversations (cached by its input)."""
        d = self.cfg.data
        texts = [self.chat_template.render(m) for m, _ in train_rows]  # a tokenizer for the rendered conversations
        path = cache_dir(d.cache_dir) / f"sp-chat-{short_digest(d.vocab_size, *self.symbols, ''.join(texts))}.model"
        if not path.is_file():
            train_sentencepiece(texts, d.vocab_size, path, self.log, self.symbols)
        return load_tokenizer_file(path)

    @property
    def documents(self) -> bool:
        return self.cfg.data.pack

    def train_batch(self, step, micro):
        """(inputs, targets, real tokens, document keywords: doc_ids and position_ids when packed)."""
        self._step, B = step, self.cfg.train.batch_size
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

    @torch.no_grad()
    def evaluate(self, model):
        out = super().evaluate(model)
        if self.cfg.data.eval_generate and self.data.val_rows:  # val_rows: the held-out conversations kept whole
            out["val_exact_match"] = self.answered(model, self.cfg.data.eval_generate)[0]["exact_match"]
        return out

    def answered(self, model, n):
        """Each conversation's last answer generated greedily from the messages before it."""
        rows = [{"prompt": m[:last], "expected": m[last]["content"], "until": None} for m in self.data.val_rows[:n]
                for last in [max(i for i, x in enumerate(m) if x["role"] == "assistant")]]
        scores, details = score_generation(model, self.data.tokenizer, rows, self.device, self.chat_template, 64,
                                           self.autocast)
        return scores, [(" | ".join(f"{m['role']}: {m['content']}" for m in r["prompt"]), d["output"],
                         f"reference {r['expected']!r}") for r, d in zip(rows, details)]
