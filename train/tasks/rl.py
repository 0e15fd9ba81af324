"""Reinforcement learning with verifiable rewards (`data.format: prompts`, the `rl:` section).

Each batch of rollouts: group_size completions of every prompt, sampled on Zoo's batched KV-cache generation
(eval mode, no grad), scored, turned into advantages within each group; then the PPO-style clipped objective
over the completions' tokens, with an optional KL term:
    ratio = exp(logp - logp_old);  per token: -min(ratio A, clip(ratio, 1 - clip_low, 1 + clip_high) A)
                                              + kl_beta (exp(ref - logp) - (ref - logp) - 1)   (k3)
GRPO (Shao et al., "DeepSeekMath", 2024): A = (r - mean) / (std + eps) in the group; each completion's
    token mean, then the mean over completions.
Dr. GRPO (Liu et al., "Understanding R1-Zero-Like Training: A Critical Perspective", 2025): A = r - mean;
    the token sum over completions x max_new_tokens (no length or std normalisation, their biases gone).
DAPO (Yu et al., "DAPO: An Open-Source LLM Reinforcement Learning System at Scale", 2025): GRPO's A, the
    token mean over the whole batch, a higher clip_high, dynamic sampling, overlong shaping.
GSPO (Zheng et al., "Group Sequence Policy Optimization", 2025): GRPO's A and aggregation, one ratio per
    completion, exp(the mean over its tokens of logp - logp_old), clipped per completion (tight clips).
The sampler's log-probabilities are not kept: the loss runs a training-mode forward over prompt + completion,
and the old log-probs of updates_per_batch > 1 come from that forward without grad right after sampling, not
from the decode steps (other kernels: cache, compilation, padding), so the ratio is exactly 1 at first."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Literal, Optional

import torch

from zoo.adapters import adapters_disabled
from zoo.config import ConfigError, bounded

from ..data import DataError, TokenizedRows
from ..data.conversations import PostTrainingDataConfig
from ..data.prompts import arithmetic, read_prompts, reward_fn, score
from ..eval import collate, complete, score_rewards, token_logps
from ..optim import micro_batches
from .post_training import PostTrainingTask, unwrapped

ROW_KEYS = ("prompt", "comp", "cut", "values", "total")  # a batch's per-completion lists ("values": each reward's)


@dataclass
class PromptDataConfig(PostTrainingDataConfig):
    format: Literal["prompts"] = "prompts"  # selects reinforcement learning (this task and `rl:`) for `family: llm`
    seq_len: int = bounded(128, ge=1)       # prompt tokens kept (the end of a longer prompt); + `rl.max_new_tokens`
                                            # <= `model.max_seq_len`
    eval_prompts: int = bounded(64, gt=0)   # held-out prompts answered greedily at every evaluation (`val_reward`)


@dataclass
class Reward:
    name: str = "numeric"                   # numeric, exact, contains, format:REGEX, length[:N] or module:function
    weight: float = 1.0                     # its weight in the total reward


@dataclass
class RLConfig:
    algorithm: Literal["grpo", "dr_grpo", "dapo", "gspo"] = "grpo"  # the loss (see train/tasks/rl.py's docstring)
    group_size: int = bounded(8, ge=2)      # completions sampled per prompt
    prompts_per_step: int = bounded(8, gt=0)  # prompts per batch of rollouts (all processes together)
    max_new_tokens: int = bounded(64, gt=0)  # a completion's length at most (past it: truncated)
    temperature: float = bounded(1.0, gt=0)  # sampling temperature of the rollouts
    top_p: float = bounded(1.0, gt=0, le=1)  # nucleus sampling of the rollouts (1: off)
    rewards: list[Reward] = field(default_factory=lambda: [Reward()])  # summed with their weights; the first is
                                            # the check `solved` counts (a completion scoring >= 1)
    kl_beta: float = bounded(0.0, ge=0)     # weight of the k3 KL to the reference (the base with adapters off, else
                                            # a frozen copy of the initial model); 0: no reference
    clip_low: Optional[float] = bounded(None, ge=0, lt=1)  # the ratio's lower clip 1 - clip_low; null: 0.2
                                            # (gspo: 3e-4, its sequence-level ratio staying near 1)
    clip_high: Optional[float] = bounded(None, ge=0)  # the ratio's upper clip 1 + clip_high; null: 0.2 (gspo: 4e-4;
                                            # DAPO's paper: 0.28)

    def clips(self) -> tuple[float, float]:
        """(clip_low, clip_high), the algorithm's defaults where unset (GSPO's from its paper)."""
        low, high = (3e-4, 4e-4) if self.algorithm == "gspo" else (0.2, 0.2)
        return (low if self.clip_low is None else self.clip_low, high if self.clip_high is None else self.clip_high)
    updates_per_batch: int = bounded(1, gt=0)  # optimizer steps on one batch of rollouts (> 1: old log-probs kept)
    dynamic_sampling: bool = False          # DAPO: groups whose rewards are all equal are dropped and refilled
    max_refills: int = bounded(4, ge=0)     # dynamic sampling: extra rounds of sampling at most per batch
    overlong: Literal["none", "mask", "soft"] = "none"  # truncated completions: `mask` (left out of the loss) or
                                            # `soft` (DAPO's penalty over the last `overlong_buffer` tokens)
    overlong_buffer: Optional[int] = bounded(None, gt=0)  # `soft`: the penalty's ramp in tokens; null: max_new_tokens/4
    compile: bool = False                   # decode through torch.compile: the step of fixed shapes
                                            # (LLM.generate(compile="reduce-overhead")); FSDP2: compile=True


def advantages(rewards: torch.Tensor, algorithm: str, eps: float = 1e-4) -> torch.Tensor:
    """rewards (groups, G) -> advantages (groups, G): r - the group's mean, over (its std + eps) but for
    dr_grpo (std: torch.std's unbiased estimate, as TRL). A group of equal rewards: all zero."""
    centred = rewards - rewards.mean(1, keepdim=True)
    return centred if algorithm == "dr_grpo" else centred / (rewards.std(1, keepdim=True) + eps)


def policy_loss(logp, old, ref, adv, mask, algorithm: str, clip_low: float, clip_high: float, kl_beta: float,
                max_new_tokens: int, n_seqs: Optional[float] = None, n_tokens: Optional[float] = None):
    """The clipped objective of completions: logp, old, ref, mask (N, T) (ref None when kl_beta is 0), adv
    (N,). n_seqs, n_tokens: the whole batch's (default these rows'), so the parts' losses add up to the batch's.
    -> (loss, {clip, kl} sums over the tokens; gspo: a clipped completion counts all its tokens)."""
    mask = mask.float()
    lengths, log_ratio = mask.sum(1).clamp(min=1), logp - old
    if algorithm == "gspo":  # one ratio per completion: the geometric mean of its tokens' ratios
        log_ratio = ((log_ratio * mask).sum(1) / lengths)[:, None]
    ratio, a = torch.exp(log_ratio), adv[:, None]
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high)
    per_token = -torch.minimum(ratio * a, clipped * a)
    stats = {"clip": ((ratio * a > clipped * a).float() * mask).sum().detach()}
    if algorithm == "gspo":
        per_token = per_token.expand_as(mask)  # the completion's term, once over its tokens' mean
    if kl_beta > 0:
        d = ref - logp
        k3 = torch.exp(d) - d - 1
        per_token = per_token + kl_beta * k3
        stats["kl"] = (k3 * mask).sum().detach()
    n_seqs = mask.shape[0] if n_seqs is None else n_seqs
    n_tokens = mask.sum() if n_tokens is None else n_tokens
    total = per_token * mask
    if algorithm in ("grpo", "gspo"):
        return (total.sum(1) / lengths).sum() / n_seqs, stats
    if algorithm == "dr_grpo":
        return total.sum() / (n_seqs * max_new_tokens), stats
    return total.sum() / n_tokens, stats  # dapo


def overlong_penalty(length: int, max_new_tokens: int, buffer: int) -> float:
    """DAPO's soft overlong punishment: 0 up to max - buffer tokens, then falling linearly to -1 at max."""
    return min(0.0, (max_new_tokens - buffer - length) / buffer)


def reward_keys(rewards) -> list[str]:
    """Each reward's metric: reward_<name up to a colon>, a repeated name numbered from its second (_2, ...)."""
    keys = []
    for name, _, _ in rewards:
        key = "reward_" + name.split(":")[0]
        keys.append(key if key not in keys else f"{key}_{sum(k.startswith(key) for k in keys) + 1}")
    return keys


class RLTask(PostTrainingTask):
    DataConfig = PromptDataConfig
    RLConfig = RLConfig
    sections = (RLConfig, Reward)  # the config dataclasses of the rl: section (docs tables)
    _rollouts, _key = None, None  # the batch of rollouts at hand and its index (step // updates_per_batch)
    _window: list = []            # each batch's metric sums since the last logged row
    _clock = None                 # when the logging window began
    _generating = 0.0             # seconds spent sampling in the window
    _trained = None               # [clipped tokens, k3 sum, entropy sum, tokens] of the losses since the last row

    def setup(self):
        d, rl = self.cfg.data, self.cfg.rl
        tokenizer = self._load_tokenizer()
        if rl.prompts_per_step % self.world:
            raise ConfigError(f"{self.cfg.source}: rl.prompts_per_step={rl.prompts_per_step} must divide among the "
                              f"{self.world} processes")
        self.chat_template = self._template()
        train, val = self.held_out(arithmetic, lambda path: read_prompts(path, self.log))  # [{prompt, answer}]
        if self.chat_template is None and any(not isinstance(r["prompt"], str) for r in train + val):
            raise DataError(f"{d.path}: a prompt of chat messages needs a chat template, and this run has none "
                            f"(data.template: chatml, a file or folder)")
        self.data = TokenizedRows(train, val, tokenizer)
        self.log(f"data: {d.path}: {len(self.data.train)} train + {len(self.data.val)} held-out prompts")
        self.rewards = [(r.name, r.weight, reward_fn(r.name, self.cfg.source)) for r in rl.rewards]
        self._window = []
        ref = "the base with its adapters off" if self.cfg.adapter.enabled else "a frozen copy of the initial model"
        self.log(f"rl: {rl.algorithm}, {rl.prompts_per_step} prompts x {rl.group_size} completions per batch, "
                 f"rewards {', '.join(f'{n} x {w:g}' for n, w, _ in self.rewards)}"
                 + (f", kl_beta {rl.kl_beta:g} against {ref}" if rl.kl_beta > 0 else ""))

    def wants_reference(self):
        return self.cfg.rl.kl_beta > 0

    def build_model(self):
        model, need = super().build_model(), self.cfg.data.seq_len + self.cfg.rl.max_new_tokens
        if need > model.config.max_seq_len:
            raise ConfigError(f"{self.cfg.source}: data.seq_len + rl.max_new_tokens = {need} exceeds the model's "
                              f"max_seq_len={model.config.max_seq_len}")
        return model

    def train_batch(self, step, micro):
        """Where the step's rollouts are: they are sampled in loss(), which holds the model."""
        return {"step": step, "micro": micro}

    def _groups(self, model, idx: list[int], seeds: list[tuple]):
        """Sample, decode and score group_size completions of the training prompts idx; a row's draws come
        from its own generator seeded by seeds[prompt] + (row,). -> dict of per-row lists."""
        rl, G = self.cfg.rl, self.cfg.rl.group_size
        rows = [self.data.train[i] for i in idx for _ in range(G)]
        gens = [torch.Generator(self.device).manual_seed(hash((*seeds[k // G], k % G)) & 0x7FFF_FFFF_FFFF_FFFF)
                for k in range(len(rows))]
        # rl.compile: the decoding step of fixed shapes (one CUDA graph replayed on a GPU), but under FSDP2, whose
        # gathered weights change between steps, the compiled step
        fsdp, t0 = self.cfg.train.parallel == "fsdp", time.perf_counter()
        with self.autocast():
            prompt, comp, texts, cut = complete(model, self.data.tokenizer, self.chat_template,
                                                [r["prompt"] for r in rows], rl.max_new_tokens, rl.temperature,
                                                rl.top_p, gens, self.cfg.data.seq_len, stop_early=not fsdp,
                                                compile=rl.compile and (True if fsdp else "reduce-overhead"))
        seconds = time.perf_counter() - t0
        values = list(zip(*score(self.rewards, texts, [r["answer"] for r in rows], [r["prompt"] for r in rows])))
        total = [sum(w * v for (_, w, _), v in zip(self.rewards, vs)) for vs in values]
        if rl.overlong == "soft":
            buf = rl.overlong_buffer or max(1, rl.max_new_tokens // 4)
            total = [t + overlong_penalty(len(c), rl.max_new_tokens, buf) for t, c in zip(total, comp)]
        return {"prompt": prompt, "comp": comp, "cut": cut, "values": values, "total": total,
                "seconds": seconds, "tokens": sum(map(len, comp))}

    @torch.no_grad()
    def rollouts(self, model, key: int) -> dict:
        """The batch of rollouts number `key`: this process's prompts, their groups sampled and scored
        (dynamic sampling: groups of equal rewards dropped and refilled), advantages, the old and the
        reference log-probs where needed, the batch-wide counts the loss normalises by."""
        rl, G = self.cfg.rl, self.cfg.rl.group_size
        P = rl.prompts_per_step // self.world
        model = unwrapped(model)  # sampling and the no-grad forwards skip DDP's gradient hooks
        pos = [key * rl.prompts_per_step + self.rank * P + i for i in range(P)]
        picked = [self.shuffled(p, len(self.data.train), -2) for p in pos]
        seeds = [(self.cfg.train.seed, key, p) for p in pos]
        got = self._groups(model, picked, seeds)
        sampled, seconds, tokens = P, got["seconds"], got["tokens"]
        if rl.dynamic_sampling:
            got = self._keep_varied(got)
            for attempt in range(1, rl.max_refills + 1):
                if len(got["total"]) >= P * G:
                    break
                g = torch.Generator().manual_seed(hash((self.cfg.train.seed, key, self.rank, attempt)) & 0x7FFF_FFFF)
                idx = torch.randint(len(self.data.train), (P,), generator=g).tolist()
                more = self._keep_varied(self._groups(model, idx, [(self.cfg.train.seed, key, -attempt, i)
                                                                   for i in idx]))
                seconds, tokens, sampled = seconds + more["seconds"], tokens + more["tokens"], sampled + P
                got = {k: got[k] + more[k] for k in ROW_KEYS}
            if not got["total"]:  # nothing varied: the last groups, whose advantages are zero
                got = more if rl.max_refills else self._groups(model, picked, seeds)
            got = {k: got[k][:P * G] for k in ROW_KEYS}
        rewards = torch.tensor(got["total"], dtype=torch.float32).view(-1, G)
        adv = advantages(rewards, rl.algorithm).flatten()
        seqs = [(p + c, [-100] * len(p) + ([-100] * len(c) if cut and rl.overlong == "mask" else c))
                for p, c, cut in zip(got["prompt"], got["comp"], got["cut"])]
        x, y = collate(seqs, self.device)
        out = {"x": x, "y": y, "adv": adv.to(self.device)}
        n_micro = micro_batches(key * rl.updates_per_batch, self.cfg.train.grad_accum, self.cfg.train.batch_warmup_steps)
        if rl.updates_per_batch > 1:
            out["old"] = self._logps(model, x, y, n_micro)
        if rl.kl_beta > 0:
            ref = unwrapped(self._reference_model(model))
            with adapters_disabled(ref):
                out["ref"] = self._logps(ref, x, y, n_micro)
        counts = self.sum_across_ranks(torch.tensor([float(len(seqs)), float((y != -100).sum())], device=self.device))
        out["n_seqs"], out["n_tokens"] = counts.tolist()
        self._record(got, rewards, seconds, tokens, sampled)
        return out

    def _keep_varied(self, got: dict) -> dict:
        """The groups whose rewards are not all equal (DAPO's dynamic sampling)."""
        G = self.cfg.rl.group_size
        keep = [k for k in range(0, len(got["total"]), G) if len(set(got["total"][k:k + G])) > 1]
        rows = [k + j for k in keep for j in range(G)]
        return {**got, **{k: [got[k][r] for r in rows] for k in ROW_KEYS}}

    def _logps(self, model, x, y, parts: int) -> torch.Tensor:
        """Per-token log-probs of x, y from a training-mode forward without grad, in `parts` micro-batches."""
        with self.autocast():
            return torch.cat([token_logps(model, xs, ys)[0] for xs, ys in zip(x.tensor_split(parts),
                                                                               y.tensor_split(parts))])

    def loss(self, model, batch):
        """The clipped objective of one micro-batch of the step's rollouts (sampled at its first micro-batch),
        scaled so that the micro-batches' and processes' parts add up to the batch's loss."""
        scale = 1
        if "step" in batch:
            step, micro = batch["step"], batch["micro"]
            if (key := step // self.cfg.rl.updates_per_batch) != self._key:
                self._rollouts, self._key = self.rollouts(model, key), key
            t = self.cfg.train
            n = micro_batches(step, t.grad_accum, t.batch_warmup_steps)
            batch = {k: v.tensor_split(n)[micro] if torch.is_tensor(v) else v for k, v in self._rollouts.items()}
            scale = n * self.world
        rl = self.cfg.rl
        logp, valid, ent = token_logps(model, batch["x"], batch["y"], entropy=True)
        old = batch["old"] if "old" in batch else logp.detach()
        loss, stats = policy_loss(logp, old, batch.get("ref"), batch["adv"], valid, rl.algorithm, *rl.clips(),
                                  rl.kl_beta, rl.max_new_tokens, batch.get("n_seqs"), batch.get("n_tokens"))
        now = torch.stack([stats["clip"], torch.as_tensor(stats.get("kl", 0.0), device=logp.device),
                           (ent * valid).sum(), valid.sum().float()])
        self._trained = now if self._trained is None else self._trained + now
        return loss * scale, batch["y"].numel()  # the positions computed, as the LM task (no sync; plannable)

    def example_batch(self, model, batch_size, seq_len=None):
        """A batch shaped as the rollouts: ids, advantages and the per-token log-probs the run keeps (π_old with
        updates_per_batch > 1, the reference's with kl_beta > 0), for the memory planner and the batch finder."""
        rl = self.cfg.rl
        x, y = super().example_batch(model, batch_size, seq_len or self.cfg.data.seq_len + rl.max_new_tokens)
        kept = {"old": rl.updates_per_batch > 1, "ref": rl.kl_beta > 0}
        return {"x": x, "y": y, "adv": torch.zeros(batch_size, device=self.device),
                **{k: torch.zeros(y.shape, device=self.device) for k, on in kept.items() if on}}

    def state_dict(self):
        """This process's batch of rollouts at hand while updates_per_batch > 1 (a resume in its middle trains on it)."""
        if self.cfg.rl.updates_per_batch == 1 or self._rollouts is None:
            return {}
        return {"key": self._key, "rollouts": {k: v.cpu() if torch.is_tensor(v) else v
                                               for k, v in self._rollouts.items()}}

    def load_state_dict(self, state):
        if state:
            self._key = state["key"]
            self._rollouts = {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in state["rollouts"].items()}

    def _record(self, got, rewards, seconds, tokens, sampled):
        """The batch's numbers (sums over every process) into the logging window."""
        if self._clock is None:
            self._clock = time.perf_counter() - seconds
        self._generating += seconds
        lengths = torch.tensor([float(len(c)) for c in got["comp"]])
        sums = torch.tensor([float(rewards.numel()), *map(sum, zip(*got["values"])), float(rewards.sum()),
                             float((rewards ** 2).sum()), sum(float(v[0] >= 1) for v in got["values"]),
                             float(lengths.sum()), float(sum(got["cut"])), float(tokens), float(sampled)],
                            device=self.device)
        self._window.append({"sums": self.sum_across_ranks(sums), "len_max": float(lengths.max()), "seconds": seconds})

    def train_metrics(self):
        out = {}
        if self._trained is not None:  # clip fraction, KL and entropy over the trained tokens
            clip, kl, ent, n = self.sum_across_ranks(self._trained).tolist()
            self._trained = None
            out = {"clip_fraction": clip / max(n, 1), "kl": kl / max(n, 1), "entropy": ent / max(n, 1)}
        if not self._window:
            return out
        window, self._window = self._window, []
        s = sum(w["sums"] for w in window).tolist()
        n, k = s[0], len(self.rewards)
        out.update({key: v / n for key, v in zip(reward_keys(self.rewards), s[1:1 + k])})
        mean = s[1 + k] / n
        out.update({"reward_mean": mean, "reward_std": math.sqrt(max(0.0, s[2 + k] / n - mean ** 2)),
                    "solved": s[3 + k] / n, "completion_len_mean": s[4 + k] / n,
                    "completion_len_max": max(w["len_max"] for w in window), "truncated": s[5 + k] / n,
                    "rollout_tokens_per_s": s[6 + k] / self.world / max(sum(w["seconds"] for w in window), 1e-9)})
        if self.cfg.rl.dynamic_sampling:
            out["prompts_sampled"] = s[7 + k] / len(window)
        now = time.perf_counter()
        out["generation_share"] = self._generating / max(now - self._clock, 1e-9)
        self._clock, self._generating = now, 0.0
        return out

    @torch.no_grad()
    def evaluate(self, model):
        """val_reward and val_solved: greedy completions of the first data.eval_prompts held-out prompts."""
        m, _ = self.answered(model, self.cfg.data.eval_prompts)
        return {"val_reward": m["reward"], "val_solved": m["pass@1"], **self.eval_tasks(unwrapped(model))}

    def answered(self, model, n):
        rl, rows = self.cfg.rl, self.data.val[:n]
        m, details = score_rewards(unwrapped(model), self.data.tokenizer, rows, self.device, self.chat_template, n,
                                   rl.max_new_tokens, self.autocast, self.cfg.data.seq_len + rl.max_new_tokens,
                                   self.rewards)
        return m, [(repr(r["prompt"]), d["output"], f"answer {r['answer']!r}") for r, d in zip(rows, details)]

    def flops_per_item(self, model):
        return model.flops_per_token(self.cfg.data.seq_len + self.cfg.rl.max_new_tokens)
