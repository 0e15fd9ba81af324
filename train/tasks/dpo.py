"""Preference tuning of an LLM: DPO, and SimPO without a reference (`data.format: preference`).

With r a response's implicit reward and eps label smoothing:
    DPO (Rafailov et al., "Direct Preference Optimization: Your Language Model is Secretly a
    Reward Model", 2023): r = beta * (log pi(y|x) - log ref(y|x))
    SimPO (Meng et al., "SimPO: Simple Preference Optimization with a Reference-Free Reward",
    2024): r = beta * log pi(y|x) / |y|, with a margin gamma
    loss = -(1 - eps) log sigmoid(r_c - r_r [- gamma]) - eps log sigmoid(r_r - r_c [+ gamma])
The reference: the model with its adapters off, else a frozen copy of the initial model."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

import torch
import torch.nn.functional as F

from zoo.adapters import adapters_disabled
from zoo.config import bounded

from ..data.conversations import PostTrainingDataConfig
from ..data.preference import PreferenceData, preference_row, read_jsonl, synthetic_pairs
from ..eval import collate, sequence_logps
from ..model import apply_runtime
from ..step import eval_mode
from .post_training import PostTrainingTask, unwrapped


@dataclass
class PreferenceDataConfig(PostTrainingDataConfig):
    format: Literal["preference"] = "preference"  # selects preference tuning (this task) for `family: llm`
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


class DPOTask(PostTrainingTask):
    DataConfig = PreferenceDataConfig
    reference_table = None      # (pairs, 2) the initial model's log-probabilities of every pair's chosen and
                                # rejected response (data.reference: precomputed); train pairs, then val pairs
    _pair_sums = None           # pair_sums of the training batches since the last logged row

    def setup(self):
        d, tokenizer = self.cfg.data, self._load_tokenizer()
        self.chat_template = self._template()
        rows, val = self.held_out(synthetic_pairs, lambda path: read_jsonl(path, preference_row, self.log,
                                                                           "preference rows"))
        self.data = PreferenceData(rows, val, d, tokenizer, self.chat_template, self.log)
        self.log(f"preference: loss={d.loss} beta={d.beta} label_smoothing={d.label_smoothing}"
                 + (f" gamma={d.simpo_gamma}" if d.loss == "simpo" else "")
                 + (", reference: the base with its adapters off" if d.loss == "dpo" and self.cfg.adapter.enabled
                    else f", reference: the initial model ({d.reference})" if d.loss == "dpo" else ""))

    def wants_reference(self):
        return self.cfg.data.loss == "dpo" and self.cfg.data.reference == "copy"

    def build_model(self):
        model, d = super().build_model(), self.cfg.data
        if d.loss == "dpo" and d.reference == "precomputed" and not self.cfg.adapter.enabled:
            self.reference_table = self.precompute(model)
        return model

    @torch.no_grad()
    def precompute(self, model) -> torch.Tensor:
        """The reference log-probabilities of every pair (train, then val), in batches of train.batch_size."""
        model = apply_runtime(model, self.cfg.train).to(self.device)
        with eval_mode(model):
            pairs, B, out = self.data.train + self.data.val, self.cfg.train.batch_size, []
            for i in range(0, len(pairs), B):
                x, y, _ = self._batch(pairs[i:i + B], range(i, i + len(pairs[i:i + B])))
                with self.autocast():
                    lp = sequence_logps(model, x, y)[0]
                out.append(torch.stack(lp.chunk(2), dim=1))
        self.log(f"reference: log-probabilities of {len(pairs)} pairs precomputed (data.reference=precomputed)")
        return torch.cat(out)

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
        x, y = super().example_batch(model, 2 * batch_size, seq_len)
        return x, y, torch.zeros(batch_size, dtype=torch.long, device=self.device)

    def _batch(self, pairs, ids):
        """(inputs (2B, T), labels (2B, T), the pairs' ids (B,)): the chosen rows, then the rejected.
        A pair's id is its index among the training pairs, or len(train) + its index among the val pairs."""
        rows = [(c, cl) for c, cl, _, _ in pairs] + [(r, rl) for _, _, r, rl in pairs]
        return (*collate(rows, self.device), torch.tensor(list(ids), dtype=torch.long, device=self.device))

    def train_batch(self, step, micro):
        """This rank's part of one global micro-batch of pairs, reshuffled every epoch, at (step, micro)."""
        n, G = len(self.data.train), self.global_rows()
        pos = (step * self.cfg.train.grad_accum + micro) * G
        idx = self.own_rows([self.shuffled(p, n, -1) for p in range(pos, pos + G)])
        return self._batch([self.data.train[i] for i in idx], idx)

    def pair_loss(self, model, batch):
        """(per-pair losses (B,), chosen rewards (B,), rejected rewards (B,))."""
        x, y, _ = batch
        logps, n = sequence_logps(model, x, y)
        d = self.cfg.data
        ref = self.reference_logps(model, batch) if d.loss == "dpo" else None
        return preference_loss(logps, ref, n, d.loss, d.beta, d.label_smoothing, d.simpo_gamma)

    def loss(self, model, batch):
        losses, rc, rr = self.pair_loss(model, batch)
        now = pair_sums(losses.detach(), rc, rr)
        self._pair_sums = now if self._pair_sums is None else self._pair_sums + now
        return losses.mean(), batch[1].numel()  # the positions computed (padding included), as the LM task

    def train_metrics(self):
        if self._pair_sums is None:
            return {}
        s, self._pair_sums = self._pair_sums, None
        # every rank logs at the same steps: all pairs counted; the row's own `loss` is the step's
        return {k: v for k, v in pair_metrics(self.sum_across_ranks(s)).items() if k != "loss"}

    @torch.no_grad()
    def evaluate(self, model):
        with eval_mode(model):
            sums, B, n = None, self.cfg.train.batch_size, len(self.data.train)
            for i in range(0, len(self.data.val), B):
                pairs = self.data.val[i:i + B]
                with self.autocast():
                    now = pair_sums(*self.pair_loss(model, self._batch(pairs, range(n + i, n + i + len(pairs)))))
                sums = now if sums is None else sums + now
        return {**{f"val_{k}": v for k, v in pair_metrics(sums).items()}, **self.eval_tasks(model)}

    def flops_per_item(self, model):
        """Per position: the policy's forward and backward, plus the reference's forward (DPO)."""
        f = model.flops_per_token(self.cfg.data.seq_len)
        return f * 4 / 3 if self.cfg.data.loss == "dpo" else f

    def samples(self, model, out_dir):
        return None


def preference_loss(policy: torch.Tensor, reference: Optional[torch.Tensor], tokens: torch.Tensor, kind: str,
                    beta: float, label_smoothing: float = 0.0, gamma: float = 0.0):
    """Per-pair (losses, chosen rewards, rejected rewards), each (B,), the rewards detached, of 2B rows (B chosen, then
    B rejected): policy, reference (unused by simpo) (2B,) summed log-probabilities, tokens (2B,) their scored ones."""
    reward = beta * (policy - reference) if kind == "dpo" else beta * policy / tokens.clamp(min=1)
    B = policy.shape[0] // 2
    logits = reward[:B] - reward[B:] - (gamma if kind == "simpo" else 0.0)
    losses = -(1 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)
    r = reward.detach()
    return losses, r[:B], r[B:]


def pair_sums(losses, chosen, rejected) -> torch.Tensor:
    """[loss sum, chosen reward sum, rejected reward sum, pairs ranked right, pairs] of a batch."""
    return torch.stack([losses.sum(), chosen.sum(), rejected.sum(), (chosen > rejected).sum().float(),
                        torch.tensor(float(len(chosen)), device=chosen.device)])


def pair_metrics(sums: torch.Tensor) -> dict[str, float]:
    """[loss sum, chosen reward sum, rejected reward sum, pairs ranked right, pairs] -> their means."""
    loss, rc, rr, right = (sums[:4] / sums[4].clamp(min=1)).tolist()
    return {"loss": loss, "rewards_chosen": rc, "rewards_rejected": rr, "reward_margin": rc - rr,
            "reward_accuracy": right}
