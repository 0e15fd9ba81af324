"""What the post-training tasks share: chat SFT (sft.py), preference tuning (dpo.py) and RL (rl.py).

Each is the LM task (lm.py) on rows rendered with a chat template (data.template's or the checkpoint's, written beside
the weights): held-out rows split off, training rows shuffled by epoch, a frozen reference where the loss needs one.
The data keys they share: data/conversations.py's PostTrainingDataConfig."""
from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Callable, Optional

import torch

from zoo.config import ConfigError
from zoo.weights.files import atomic_write

from ..data import DataError, tokenizer_file
from ..data.conversations import ChatTemplate, choose_template, find_template
from ..model import apply_runtime
from .lm import LMTask


class PostTrainingTask(LMTask):
    tokenizer_files = ("tokenizer.json", "tokenizer.model")  # tokenizer.json first: it reads a template's special tokens
    default_template: Optional[str] = None  # the built-in template when neither data.template nor the checkpoint has one
    reference = None            # a frozen copy of the initial model, when wants_reference() and no adapter
    _placed = False             # the copy is on the device with the run's runtime choices
    _epoch, _order = None, None  # the epoch whose shuffled order of the training rows is at hand

    def _template(self) -> Optional[ChatTemplate]:
        """data.template: `none`, a built-in name or a path; null: the checkpoint's own, else default_template."""
        t = self.cfg.data.template
        own = find_template(self._init_tokenizers()) if t is None and self.cfg.train.init_from is not None else None
        if t is None and own is None and self.default_template is not None:
            own = ChatTemplate.builtin(self.default_template)
        template = choose_template(t, own)
        self.log(f"data: chat template: {template.name} (end of turn {template.end_of_turn!r})" if template else
                 "data: no chat template: prompt and response tokens concatenated")
        return template

    def _load_tokenizer(self, make: Optional[Callable] = None):
        """The tokenizer: the checkpoint's, `bytes` or a file; `sentencepiece` and no checkpoint: make() or an error."""
        spec = self._pretrained_tokenizer() or self.cfg.data.tokenizer
        if spec == "sentencepiece" and make is not None:
            return make()
        if spec == "sentencepiece":
            raise ConfigError(f"{self.cfg.source}: data.tokenizer=sentencepiece means the train.init_from checkpoint's "
                              f"tokenizer; without train.init_from set data.tokenizer to bytes or a tokenizer file")
        return tokenizer_file(spec)

    def held_out(self, make: Callable[[str, int], list], read: Callable[[str], list]) -> tuple[list, list]:
        """(training rows, held-out rows): `synthetic` made by make(split, n), val_fraction of them from the
        'val' split; a file read by read(path), held out data.val_path's rows, else split_off's."""
        d = self.cfg.data
        if d.path == "synthetic":
            n_val = max(1, round(d.synthetic_rows * d.val_fraction))
            return make("train", d.synthetic_rows - n_val), make("val", n_val)
        rows = read(d.path)
        return (rows, read(d.val_path)) if d.val_path else self.split_off(rows)

    def split_off(self, rows: list) -> tuple[list, list]:
        """The last data.val_fraction of the rows held out (at least one; at least one left to train on)."""
        d = self.cfg.data
        n_val = max(1, int(len(rows) * d.val_fraction))
        if len(rows) - n_val < 1:
            raise DataError(f"{d.path}: {len(rows)} rows leave none for training after data.val_fraction="
                            f"{d.val_fraction}")
        return rows[:-n_val], rows[-n_val:]

    def shuffled(self, pos: int, n: int, salt: int) -> int:
        """The row at position pos of the stream of epochs over n training rows, each epoch a permutation
        seeded by (train.seed, epoch, salt) only, so that a resumed run sees the same rows."""
        epoch, i = divmod(pos, n)
        if epoch != self._epoch:
            g = torch.Generator().manual_seed(hash((self.cfg.train.seed, epoch, salt)) & 0x7FFF_FFFF_FFFF_FFFF)
            self._epoch, self._order = epoch, torch.randperm(n, generator=g).tolist()
        return self._order[i]

    def wants_reference(self) -> bool:
        """Whether the loss reads a frozen reference model (the base with its adapters off, else a copy)."""
        return False

    def build_model(self):
        model = super().build_model()
        if self.wants_reference() and not self.cfg.adapter.enabled:
            self.reference = copy.deepcopy(model).eval().requires_grad_(False)
        return model

    def _reference_model(self, model):
        """The reference's module: `model` itself with an adapter (read with its adapters off) or where
        there is no copy (the planner's example runs); else the copy, placed as the run's model at first use."""
        if self.cfg.adapter.enabled or self.reference is None:
            return model
        if not self._placed:
            self.reference = apply_runtime(self.reference, self.cfg.train).to(self.device)
            self._placed = True
        return self.reference

    def answered(self, model, n: int) -> tuple[dict, list[tuple[str, str, str]]]:
        """The first n held-out rows answered greedily: (their scores, [(prompt, answer, its reference)])."""
        raise NotImplementedError

    def samples(self, model, out_dir):
        text = "\n".join(f"{p}\n  -> {made!r} ({ref})" for p, made, ref in self.answered(model, 4)[1])
        (Path(out_dir) / "samples.txt").write_text(text + "\n")
        return text

    def save_files(self, out_dir):
        super().save_files(out_dir)
        if self.chat_template is not None:
            write_template(self.chat_template, out_dir)

    def export(self, model, out_dir):
        path = super().export(model, out_dir)
        if path is not None and self.chat_template is not None:
            write_template(self.chat_template, path)
        return path


def unwrapped(model):
    """The module under a torch.compile and a DDP wrapper."""
    model = getattr(model, "_orig_mod", model)
    return getattr(model, "module", model)


def write_template(template: ChatTemplate, folder):
    """Put the template and its special tokens into folder/tokenizer_config.json (kept or made)."""
    path = Path(folder) / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    config.update(template.to_config())
    atomic_write(path, json.dumps(config, indent=2, ensure_ascii=False) + "\n")
