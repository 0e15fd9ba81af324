"""Preference tuning of an LLM: DPO, and SimPO without a reference (`data.format: preference`).

With r a response's implicit reward and eps label smoothing:
    DPO (Rafailov et al., "Direct Preference Optimization: Your Language Model is Secretly a
    Reward Model", 2023): r = beta * (log pi(y|x) - log ref(y|x))
    SimPO (Meng et al., "SimPO: Simple Preference Optimization with a Reference-Free Reward",
    2024): r = beta * log pi(y|x) / |y|, with a margin gamma
    loss = -(1 - eps) log sigmoid(r_c - r_r [- gamma]) - eps log sigmoid(r_r - r_c [+ gamma])
The reference: the model with its adapters off, else a frozen copy of the initial model.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

import torch
import torch.nn.functional as F

from zoo.adapters import adapters_disabled
from zoo.config import ConfigError, bounded, fail

from ..data import DataError, check_files, load_tokenizer_file
from ..data.conversations import BUILTIN, ChatTemplate, find_template
from ..data.preference import PreferenceData
from ..eval import collate, sequence_logps
from ..model import apply_runtime
from .lm import LMTask
from .sft import SFTTask, write_template


@dataclass
class PreferenceDataConfig:
    format: Literal["preference"] = "preference"  # selects preference tuning (this task) for `family: llm`
    path: str = ""                          # a jsonl file of `{"prompt", "chosen", "rejected"}` rows, or
                                            # `synthetic`: pairs made from the embedded conversations
    synthetic_rows: int = bounded(2000, ge=10)  # `path: synthetic`: how many pairs are made (`val_fraction` of them
                                            # from the held-out conversations)
    val_path: Optional[str] = None          # held-out pairs (same format); null = the last `val_fraction` of `path`
    val_fraction: float = bounded(0.1, gt=0, lt=1)  # rows held out when there is no `val_path` (at least one)
    tokenizer: str = "sentencepiece"        # `sentencepiece` = the `train.init_from` checkpoint's own tokenizer;
                                            # `bytes`; or a tokenizer file's path
    template: Optional[str] = None          # null = the `train.init_from` model's own template, if any; a built-in
                                            # name or a path as for chat data; `none`: no template
    seq_len: int = bounded(256, ge=2)       # tokens per prompt + response (longer: the prompt loses its start, then
                                            # the response its end; counted in the log); <= `model.max_seq_len`
    loss: Literal["dpo", "simpo"] = "dpo"   # `dpo` (against the frozen reference) or `simpo` (reference-free, length
                                            # normalised, with the margin `simpo_gamma`)
    beta: float = bounded(0.1, gt=0)        # the reward scale: DPO's beta (0.1 is common); SimPO's (about 2)
    label_smoothing: float = bounded(0.0, ge=0, lt=0.5)  # the assumed fraction of flipped preferences (conservative
                                            # DPO): the loss also pushes the other way with this weight
    simpo_gamma: float = bounded(0.5, ge=0)  # `simpo`: the target margin between the rewards
    reference: Literal["copy", "precomputed"] = "copy"  # `dpo` without an adapter: `copy` (a frozen copy of the
                                            # initial model) or `precomputed` (its log-probabilities, computed at start)
    eval_tasks: Optional[list[str]] = None  # task files (train/eval.py) evaluated at every evaluation, their
                                            # metrics logged as `eval_<file stem>_<metric>`

    def validate(self, source, prefix="data."):
        if not self.path:
            raise fail(source, prefix + "path", "must name a jsonl file of prompt/chosen/rejected rows")
        check_files(self.eval_tasks, source, prefix + "eval_tasks")
        if self.path == "synthetic" and self.val_path is not None:
            raise fail(source, prefix + "val_path", "must be null with path: synthetic (it has its own held-out pairs)")
        if self.template not in (None, "none", *BUILTIN) and not Path(self.template).expanduser().exists():
            raise fail(source, prefix + "template", f"={self.template}: neither none, a built-in template "
                                                    f"({', '.join(BUILTIN)}) nor an existing file or folder")


class DPOTask(LMTask):
    DataConfig = PreferenceDataConfig
    tokenizer_files = SFTTask.tokenizer_files  # tokenizer.json first: it reads a template's special tokens
    chat_template = None
    reference = None            # the frozen copy (full fine-tuning, data.reference: copy)
    reference_table = None      # (pairs, 2) the initial model's log-probabilities of every pair's chosen and
                                # rejected response (data.reference: precomputed); train pairs, then val pairs
    _placed = False             # the copy is on the device with the run's runtime choices
    _pair_sums = None           # pair_sums of the training batches since the last logged row
    _epoch, _order = None, None  # the epoch whose shuffled order of the training pairs is at hand

    def setup(self):
        d = self.cfg.data
        spec = self._pretrained_tokenizer() or d.tokenizer
        if spec == "sentencepiece":
            raise ConfigError(f"{self.cfg.source}: data.tokenizer=sentencepiece means the train.init_from checkpoint's "
                              f"tokenizer; without train.init_from set data.tokenizer to bytes or a tokenizer file")
        if spec != "bytes" and not Path(spec).expanduser().is_file():
            raise DataError(f"{spec}: tokenizer file not found (data.tokenizer must be bytes, sentencepiece or a "
                            f"path to a tokenizer.model / tokenizer.json)")
        self.chat_template = self._template()
        self.data = PreferenceData(d, load_tokenizer_file(spec), self.chat_template, self.log)
        self.log(f"preference: loss={d.loss} beta={d.beta} label_smoothing={d.label_smoothing}"
                 + (f" gamma={d.simpo_gamma}" if d.loss == "simpo" else "")
                 + (", reference: the base with its adapters off" if d.loss == "dpo" and self.cfg.adapter.enabled
                    else f", reference: the initial model ({d.reference})" if d.loss == "dpo" else ""))

    def template(self):
        return self.chat_template

    def _template(self):
        t, init = self.cfg.data.template, self.cfg.train.init_from
        if t == "none" or (t is None and init is None):
            template = None
        elif t in BUILTIN:
            template = ChatTemplate.builtin(t)
        else:
            template = ChatTemplate.from_pretrained(t) if t is not None else find_template(self._init_tokenizers())
        self.log(f"data: chat template: {template.name} (end of turn {template.end_of_turn!r})" if template else
                 "data: no chat template: prompt and response tokens concatenated")
        return template

    def save_files(self, out_dir):
        super().save_files(out_dir)
        if self.chat_template is not None:
            write_template(self.chat_template, out_dir)

    def export(self, model, out_dir):
        path = super().export(model, out_dir)
        if path is not None and self.chat_template is not None:
            write_template(self.chat_template, path)
        return path

    def build_model(self):
        model = super().build_model()
        if self.cfg.data.loss == "dpo" and not self.cfg.adapter.enabled:
            if self.cfg.data.reference == "copy":
                self.reference = copy.deepcopy(model).eval().requires_grad_(False)
            else:
                self.reference_table = self.precompute(model)
        return model

    @torch.no_grad()
    def precompute(self, model) -> torch.Tensor:
        """The reference log-probabilities of every pair (train, then val), in batches of train.batch_size."""
        model = apply_runtime(model, self.cfg.train).to(self.device)
        was = model.training
        model.eval()
        pairs, B, out = self.data.train + self.data.val, self.cfg.train.batch_size, []
        for i in range(0, len(pairs), B):
            x, y, _ = self._batch(pairs[i:i + B], range(i, i + len(pairs[i:i + B])))
            with self.autocast():
                lp = sequence_logps(model, x, y)[0]
            out.append(torch.stack(lp.chunk(2), dim=1))
        model.train(was)
        self.log(f"reference: log-probabilities of {len(pairs)} pairs precomputed (data.reference=precomputed)")
        return torch.cat(out)

    def _reference_model(self, model):
        if self.cfg.adapter.enabled or self.reference is None:  # the planner's example runs have no copy
            return model
        if not self._placed:
            apply_runtime(self.reference, self.cfg.train)
            self.reference.to(self.device)
            self._placed = True
        return self.reference

    @torch.no_grad()
    def reference_logps(self, model, batch):
        """The reference's summed log-probabilities of a batch's rows (2B,)."""
        x, y, ids = batch
        if self.reference_table is not None:
            return self.reference_table[ids].t().reshape(-1)  # the chosen rows, then the rejected
        base = unwrapped(self._reference_model(model))
        with adapters_disabled(base):
            return sequence_logps(base, x, y)[0]

    def example_batch(self, model, batch_size, seq_len=None):
        self._use(model)
        x = torch.zeros(2 * batch_size, seq_len or self.cfg.data.seq_len, dtype=torch.long, device=self.device)
        return x, torch.zeros_like(x), torch.zeros(batch_size, dtype=torch.long, device=self.device)

    def _batch(self, pairs, ids):
        """(inputs (2B, T), labels (2B, T), the pairs' ids (B,)): the chosen rows, then the rejected.
        A pair's id is its index among the training pairs, or len(train) + its index among the val pairs."""
        rows = [(c, cl) for c, cl, _, _ in pairs] + [(r, rl) for _, _, r, rl in pairs]
        return (*collate(rows, self.device), torch.tensor(list(ids), dtype=torch.long, device=self.device))

    def train_batch(self, step, micro):
        """This rank's part of one global micro-batch of pairs, reshuffled every epoch, at (step, micro)."""
        n, G = len(self.data.train), self.global_rows()
        pos = (step * self.cfg.train.grad_accum + micro) * G
        idx = []
        for p in range(pos, pos + G):
            epoch, i = divmod(p, n)
            if epoch != self._epoch:
                g = torch.Generator().manual_seed(hash((self.cfg.train.seed, epoch, -1)) & 0x7FFF_FFFF_FFFF_FFFF)
                self._epoch, self._order = epoch, torch.randperm(n, generator=g).tolist()
            idx.append(self._order[i])
        idx = self.own_rows(idx)
        return self._batch([self.data.train[i] for i in idx], idx)

    def pair_loss(self, model, batch):
        """(per-pair losses (B,), chosen rewards (B,), rejected rewards (B,))."""
        x, y, _ = batch
        logps, n = sequence_logps(model, x, y)
        d = self.cfg.data
        if d.loss == "dpo":
            ref = self.reference_logps(model, batch)
            return preference_loss(logps, ref, n, "dpo", d.beta, d.label_smoothing)
        return preference_loss(logps, None, n, "simpo", d.beta, d.label_smoothing, d.simpo_gamma)

    def loss(self, model, batch):
        losses, rc, rr = self.pair_loss(model, batch)
        now = pair_sums(losses.detach(), rc, rr)
        self._pair_sums = now if self._pair_sums is None else self._pair_sums + now
        return losses.mean(), batch[1].numel()  # the positions computed (padding included), as the LM task

    def train_metrics(self):
        if self._pair_sums is None:
            return {}
        s, self._pair_sums = self._pair_sums, None
        out = pair_metrics(self.sum_across_ranks(s))  # every rank logs at the same steps: all pairs counted
        del out["loss"]  # the row's own `loss`
        return out

    @torch.no_grad()
    def evaluate(self, model):
        was = model.training
        model.eval()
        sums, B, n = None, self.cfg.train.batch_size, len(self.data.train)
        for i in range(0, len(self.data.val), B):
            pairs = self.data.val[i:i + B]
            with self.autocast():
                now = pair_sums(*self.pair_loss(model, self._batch(pairs, range(n + i, n + i + len(pairs)))))
            sums = now if sums is None else sums + now
        model.train(was)
        out = {f"val_{k}": v for k, v in pair_metrics(sums).items()}
        return {**out, **self.eval_tasks(model)}

    def flops_per_item(self, model):
        """Per position: the policy's forward and backward, plus the reference's forward (DPO)."""
        f = model.flops_per_token(self.cfg.data.seq_len)
        return f * 4 / 3 if self.cfg.data.loss == "dpo" else f

    def samples(self, model, out_dir):
        return None


def preference_loss(policy: torch.Tensor, reference: Optional[torch.Tensor], tokens: torch.Tensor, kind: str,
                    beta: float, label_smoothing: float = 0.0, gamma: float = 0.0):
    """Per-pair losses and rewards of 2B rows (B chosen, then B rejected): policy and reference (B*2,)
    summed log-probabilities, tokens (B*2,) their scored tokens. kind 'dpo' or 'simpo' (reference
    unused). Returns (losses (B,), chosen rewards (B,), rejected rewards (B,)), the rewards detached."""
    if kind == "dpo":
        reward = beta * (policy - reference)
    else:
        reward = beta * policy / tokens.clamp(min=1)
    B = policy.shape[0] // 2
    logits = reward[:B] - reward[B:] - (gamma if kind == "simpo" else 0.0)
    losses = -(1 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)
    r = reward.detach()
    return losses, r[:B], r[B:]


def unwrapped(model):
    """The module under a torch.compile and a DDP wrapper."""
    model = getattr(model, "_orig_mod", model)
    return getattr(model, "module", model)


def pair_sums(losses, chosen, rejected) -> torch.Tensor:
    """[loss sum, chosen reward sum, rejected reward sum, pairs ranked right, pairs] of a batch."""
    return torch.stack([losses.sum(), chosen.sum(), rejected.sum(), (chosen > rejected).sum().float(),
                        torch.tensor(float(len(chosen)), device=chosen.device)])


def pair_metrics(sums: torch.Tensor) -> dict[str, float]:
    """[loss sum, chosen reward sum, rejected reward sum, pairs ranked right, pairs] -> their means."""
    loss, rc, rr, right = (sums[:4] / sums[4].clamp(min=1)).tolist()
    return {"loss": loss, "rewards_chosen": rc, "rewards_rejected": rr, "reward_margin": rc - rr,
            "reward_accuracy": right}
