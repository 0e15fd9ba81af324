"""Language modelling: next-token cross-entropy on windows of a token stream.

MoE router losses and MoD decision losses join the loss, with their routing statistics (docs/llm.md,
"Metrics"); with `data.attention: document` every forward gets the batch's document ids."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import torch

import zoo
from zoo.blocks import attention, attention_docs
from zoo.blocks.attention_docs import document_positions
from zoo.config import ConfigError
from zoo.llm import Distill
from zoo.weights import gguf_llm, hf_llm, zoo_folder
from zoo.weights.files import atomic_write

from ..data import (Prefetcher, SeqLenSchedule, TextDataConfig, TokenData, model_tokenizer, token_bytes,
                    tokenizer_folder)
from ..eval import evaluate_files, metric_row
from ..optim import micro_batches
from ..step import eval_mode
from . import Task


def aux_losses(aux: dict, t, moe) -> dict:
    """LLM.forward's return_aux statistics weighted by train: `t` -> {'aux_loss': what the training loss adds to
    the LM loss, and its parts of MoD layers 'mod_aux_loss' and of lightning indexers 'index_loss' where there}."""
    total = t.moe_z_loss_coef * aux["z_loss"].mean() if "z_loss" in aux else 0.0
    if "z_loss" in aux and moe.balance == "aux_loss":
        total = total + t.moe_aux_loss_coef * aux["lb_loss"].mean()
    parts = {k: coef * aux[a] for k, coef, a in (("mod_aux_loss", t.mod_aux_loss_coef, "mod_decision_loss"),
                                                 ("index_loss", t.index_loss_coef, "index_kl")) if a in aux}
    return {"aux_loss": total + sum(parts.values()), **parts}


class LMTask(Task):
    DataConfig, unit = TextDataConfig, "tokens"
    masked_targets = False  # targets -100 where no loss is taken (chat SFT: all but the assistant's tokens)
    formats = {**{f: "train.tasks.sft:SFTTask" for f in ("messages", "prompt_completion", "alpaca")},
               "preference": "train.tasks.dpo:DPOTask", "prompts": "train.tasks.rl:RLTask"}  # data.format -> chat SFT,
                                                                            # DPO / SimPO, or RL
    tokenizer_files = ("tokenizer.model", "tokenizer.json")  # a checkpoint's tokenizer, in order of preference
    quantizable = True
    moe = None           # the model's MoEConfig, when it has one
    mod = False          # whether the model has Mixture-of-Depths layers
    _step = 0   # the step train_batch was last asked for (named in the log lines of train_metrics)
    _sums: Optional[dict] = None
    boundary: Optional[str] = None  # data.boundary in force ('bos', 'eos', 'both'), with data.attention: document
    chat_template = None  # the chat template the data is rendered with (None: plain text)

    @staticmethod
    def validate_config(cfg):
        m, d, init = cfg.model, cfg.data, cfg.train.init_from
        if init is not None and Path(init).expanduser().is_file() and not init.endswith(".gguf"):
            raise ConfigError(f"{cfg.source}: train.init_from={init} is a file: give the folder that holds it "
                              f"(a Hugging Face or Zoo LLM folder) or a .gguf file")
        if cfg.train.init_from is None and d.seq_len > m.max_seq_len:
            raise ConfigError(f"{cfg.source}: data.seq_len={d.seq_len} exceeds model.max_seq_len={m.max_seq_len}")
        if cfg.train.init_from is None and d.tokenizer == "bytes" and m.vocab_size < 256:
            raise ConfigError(f"{cfg.source}: model.vocab_size={m.vocab_size} is smaller than the bytes "
                              f"tokenizer's 256")
        if d.format not in ("text", *LMTask.formats):
            raise ConfigError(f"{cfg.source}: data.format must be one of text, {', '.join(LMTask.formats)}, "
                              f"got {d.format!r}")

    def _pretrained_tokenizer(self) -> Optional[str]:
        """With train.init_from and data.tokenizer 'sentencepiece', the checkpoint's own tokenizer file."""
        init = self.cfg.train.init_from
        if init is None or self.cfg.data.tokenizer != "sentencepiece":
            return None
        found = model_tokenizer(self._init_tokenizers(), self.tokenizer_files)
        if found is None:
            raise ConfigError(f"{self.cfg.source}: train.init_from={init} has no {' or '.join(self.tokenizer_files)}; "
                              f"set data.tokenizer to a tokenizer file or 'bytes'")
        return found

    def setup(self):
        self._schedule = self._prefetcher = None
        self.data = TokenData(self.cfg.data, self._pretrained_tokenizer(), self.log, progress=self.cfg.train.progress)
        self.entropy = self.data.unigram_entropy()
        self.log(f"data: unigram entropy {self.entropy:.3f} nats/token (the loss of a context-free model)")
        d = self.cfg.data
        if d.attention == "document":
            if self.data.boundary == "none":
                raise ConfigError(f"{self.cfg.source}: data.attention=document needs documents separated by a BOS "
                                  f"or EOS token (data.boundary), and this stream has none (data.boundary="
                                  f"{d.boundary}, tokenizer {d.tokenizer})")
            self.boundary = self.data.boundary
            self.log(f"data: attention within documents (bounded by {self.boundary}), {d.positions} positions")

    @property
    def documents(self) -> bool:
        """Whether the training forwards confine attention to documents."""
        return self.boundary is not None

    def doc_inputs(self, x: torch.Tensor) -> dict:
        """The model's document keywords for x (B, T) with data.attention: document (doc_ids, position_ids), else {}."""
        if self.boundary is None:
            return {}
        doc = self.data.document_ids(x)
        return {"doc_ids": doc, **({"position_ids": document_positions(doc)} if self.cfg.data.positions == "document"
                                   else {})}

    def build_model(self):
        if self.cfg.train.init_from:
            # the checkpoint's architecture (how it runs: train:), in fp32 master weights (the loop autocasts)
            def load(path):
                if not (hf_llm.detect(path) or zoo_folder.detect(path) or gguf_llm.detect(path)):
                    raise ValueError(f"{path}: not a Hugging Face causal-LM folder (config.json and model.safetensors "
                                     f"of {', '.join(hf_llm.ARCHITECTURES)}), a Zoo LLM folder (config.yaml and "
                                     f"model.safetensors, as train/run.py writes) nor a GGUF file")
                return zoo.from_pretrained(path, dtype=torch.float32)
            model = self.load_pretrained(load)
        else:
            model = zoo.build(self.cfg.model)
            if self.cfg.train.init_std != 0.02:  # zoo.build drew the default's weights
                model.reset_parameters(self.cfg.train.init_std)
        self._use(model)
        vocab = self.data.vocab_size  # the tokenizer's, or one past the largest id of pre-tokenized data
        if model.config.vocab_size < vocab:
            src = self.cfg.train.init_from or f"{self.cfg.source}: model.vocab_size"
            whose = f"data's (largest id {vocab - 1})" if self.data.max_id + 1 == vocab else "tokenizer's"
            raise ConfigError(f"{src}: the model's vocab_size={model.config.vocab_size} is smaller than the "
                              f"{whose} {vocab}")
        backend, dtype = self.cfg.train.attn_backend, self.autocast_dtype or torch.float32
        resolve = attention_docs.resolve_backend if self.documents else attention.resolve_backend
        picked = resolve(backend, self.device, dtype, self.cfg.data.seq_len, self.cfg.train.compile)
        why = f" (auto, for {self.cfg.data.seq_len} keys)" if backend == "auto" else ""
        self.log(f"attention: {picked}{why}{', within documents' if self.documents else ''}")
        return model

    def _use(self, model):
        self.moe, self.mod = model.config.moe, model.config.mod_capacity > 0

    def example_batch(self, model, batch_size, seq_len=None):
        self._use(model)
        x = torch.zeros(batch_size, seq_len or self.cfg.data.seq_len, dtype=torch.long, device=self.device)
        return x, torch.zeros_like(x)

    def unfreeze_groups(self, model):
        """The LM head with the final norm, then the blocks from the last, then the embedding."""
        return ([list(model.lm_head.parameters()) + list(model.norm.parameters())]
                + [list(layer.parameters()) for layer in reversed(model.layers)] + [list(model.embed.parameters())])

    def seq_len_at(self, step: int) -> int:
        """The training window of `step` (data.seq_len_schedule, made once the batch size is known)."""
        if self._schedule is None:
            t, d = self.cfg.train, self.cfg.data
            self._schedule = SeqLenSchedule(d, t.batch_size, lambda s: micro_batches(s, t.grad_accum,
                                                                                     t.batch_warmup_steps))
            if d.seq_len_schedule:
                stages = ", ".join(f"{n} until step {u}" for u, n in self._schedule.stages)
                self.log(f"data: seq_len curriculum: {stages}, then {d.seq_len}")
        return self._schedule(step)

    def train_batch(self, step, micro):
        self._step = step
        window = self.seq_len_at(step)
        if window != getattr(self, "_window", None) and self.cfg.data.seq_len_schedule:
            self.log(f"step {step + 1}: training windows of {window} tokens (data.seq_len_schedule)")
        self._window = window
        depth = self.cfg.data.prefetch
        if depth and self._prefetcher is None:
            self._prefetcher = Prefetcher(self._windows, self._after, depth)
        xy = self._prefetcher.get((step, micro)) if depth else self._windows((step, micro))
        xy = xy.to(self.device, non_blocking=True)
        return xy[:, :-1], xy[:, 1:]

    def _windows(self, key):
        """The (B, T + 1) ids of micro-batch `key` = (step, micro) on the CPU, made ahead by the prefetcher."""
        step, micro = key
        B = self.cfg.train.batch_size
        return self.data.windows("train", self.global_rows(), self.batch_generator(step, micro), self.seq_len_at(step),
                                 slice(self.rank * B, (self.rank + 1) * B) if self.world > 1 else None,
                                 pin=self.device.type == "cuda")

    def _after(self, key):
        step, micro = key
        t = self.cfg.train
        return (step, micro + 1) if micro + 1 < micro_batches(step, t.grad_accum, t.batch_warmup_steps) else (step + 1, 0)

    def check_teacher(self, teacher, model):
        if getattr(teacher, "family", None) != "llm":
            return f"a {type(teacher).__name__} cannot teach an LLM"
        if self.cfg.train.kd_kind != "soft":
            return f"train.kd_kind={self.cfg.train.kd_kind}: an LLM distils the teacher's soft targets only"
        if teacher.config.vocab_size != model.config.vocab_size:
            return f"its vocab_size={teacher.config.vocab_size} is not the student's {model.config.vocab_size}"
        return None

    def loss(self, model, batch):
        x, y = batch
        return self.forward_loss(model, x, y, self.doc_inputs(x))

    def forward_loss(self, model, x, y, docs: dict):
        """(the loss of x and y with document keywords `docs`, distillation and the MoE / MoD terms; the tokens)."""
        kw = dict(docs)
        if self.teacher is not None:  # its final hidden states only: the logits are made chunk by chunk
            with torch.no_grad():
                hidden = self.teacher.features(x)
            t = self.cfg.train
            kw["distill"] = Distill(hidden, self.teacher.lm_head.weight, t.kd_alpha, t.kd_temperature)
        if self.moe is None and not self.mod and not self.cfg.train.index_loss_coef:
            _, loss = model(x, y, **kw)
            return self._global_mean(loss, y), y.numel()
        _, loss, aux = model(x, y, return_aux=True, **kw)
        aux.update(aux_losses(aux, self.cfg.train, self.moe))
        self._accumulate(loss, aux, y.numel())
        return self._global_mean(loss, y) + aux["aux_loss"], y.numel()

    def _global_mean(self, loss, y):
        """A rank's mean over its targets -> its share of the mean over the global micro-batch's targets, so
        that the ranks' average is one process's loss when masked targets (chat SFT) differ from rank to rank."""
        if self.world == 1 or not self.masked_targets:
            return loss
        n = (y != -100).sum().float()
        return loss * n * self.world / self.sum_across_ranks(n.clone()).clamp(min=1)

    def step_hook(self, model):
        """MoE bias balancing and MoD thresholds after every optimizer step, from what the step's forwards
        recorded over every rank's batch (so every rank keeps the routing state one process would reach)."""
        bias = self.moe is not None and self.moe.balance == "bias" and not self.cfg.train.index_warmup  # frozen
        if not (bias or self.mod):
            return None
        model.keep_mod_decisions = self.mod

        def update():
            if bias:
                self.sum_across_ranks(model.router_load)
                model.update_router_biases(self.cfg.train.moe_bias_update_rate)
            d = model.take_mod_decisions() if self.mod else None
            if d is not None:
                if self.world > 1:  # every rank's decision logits: an all-gather (zeros elsewhere, then a sum)
                    every = torch.zeros((self.world, *d.shape), device=d.device, dtype=d.dtype)
                    every[self.rank] = d
                    d = self.sum_across_ranks(every).transpose(0, 1).flatten(1, 2)
                model.update_mod_thresholds(model.mod_boundaries(d), self.cfg.train.mod_threshold_rate)
        return update

    @torch.no_grad()
    def _accumulate(self, loss, aux, tokens):
        """Sums on the device (no host sync per step); train_metrics reads them once per log."""
        now = {"lm_loss": loss.detach().float(), "aux_loss": aux["aux_loss"].detach().float(),
               "n": torch.ones((), device=loss.device)}
        if self.moe is not None:
            now.update({"lb_loss": aux["lb_loss"].mean(), "z_loss": aux["z_loss"].mean(), "load": aux["load"],
                        "dropped": aux["dropped"].sum(), "choices": torch.full(
                            (), float(tokens * self.moe.top_k * aux["load"].shape[0]), device=loss.device)})
        if self.mod:
            now.update({k: aux[k].detach().float() for k in ("mod_aux_loss", "mod_routed", "mod_decided",
                                                              "mod_accuracy")})
        now.update({k: aux[k].detach().float() for k in ("index_kl", "index_loss") if k in aux})
        self._sums = now if self._sums is None else {k: v + now[k] for k, v in self._sums.items()}

    def train_metrics(self):
        if self._sums is None:
            return {}
        s, self._sums = self._sums, None
        out = {k: (s[k] / s["n"]).item() for k in ("lm_loss", "index_kl") if k in s}
        if self.moe is not None:
            out.update(self._moe_metrics(s))
        if self.mod:
            out.update(self._mod_metrics(s))
        return out

    def _mod_metrics(self, s):
        flat = torch.cat([(s["mod_aux_loss"] / s["n"])[None]] +
                         [s[k] / s["n"] for k in ("mod_routed", "mod_decided", "mod_accuracy")]).tolist()
        L = (len(flat) - 1) // 3
        out = {"mod_aux_loss": flat[0], "mod_routed": flat[1:1 + L], "mod_decided": flat[1 + L:1 + 2 * L],
               "mod_accuracy": flat[1 + 2 * L:]}
        per_layer = " ".join(f"{a:.3f}/{b:.3f}/{c:.3f}" for a, b, c in
                             zip(out["mod_routed"], out["mod_decided"], out["mod_accuracy"]))
        self.log(f"step {self._step + 1}: mod aux_loss {out['mod_aux_loss']:.5f} "
                 f"routed/decided/decision accuracy per MoD layer {per_layer}")
        return out

    def _moe_metrics(self, s):
        # the MoD and indexer parts of the auxiliary loss are reported on their own
        s = dict(s, aux_loss=s["aux_loss"] - sum(s[k] for k in ("mod_aux_loss", "index_loss") if k in s))
        load = s["load"]  # (sparse layers, experts): the choices each expert received
        rel = load / load.mean(-1, keepdim=True).clamp(min=1e-9)
        flat = torch.cat([torch.stack([s[k] / s["n"] for k in ("lm_loss", "aux_loss", "lb_loss", "z_loss")]),
                          (s["dropped"] / s["choices"])[None], rel.max(-1).values, rel.min(-1).values]).tolist()
        L = load.shape[0]
        out = {"moe_aux_loss": flat[1], "moe_lb_loss": flat[2], "moe_z_loss": flat[3],
               "moe_dropped": flat[4], "moe_load_max": flat[5:5 + L], "moe_load_min": flat[5 + L:]}
        per_layer = " ".join(f"{a:.2f}/{b:.2f}" for a, b in zip(out["moe_load_max"], out["moe_load_min"]))
        self.log(f"step {self._step + 1}: moe lb_loss {out['moe_lb_loss']:.4f} z_loss {out['moe_z_loss']:.4f} "
                 f"aux_loss {out['moe_aux_loss']:.5f} dropped {100 * out['moe_dropped']:.2f}% "
                 f"load max/min per layer {per_layer}")
        return out

    @torch.no_grad()
    def evaluate(self, model):
        with eval_mode(model):
            total, n = 0.0, 0
            causal, acc = 0.0, 0.0  # Mixture-of-Depths: loss with causal routing, decision accuracy (per layer)
            nats, nbytes, table = 0.0, 0.0, self.byte_table(model)  # the loss and UTF-8 bytes of byte-bearing targets
            B = self.cfg.train.batch_size  # every rank evaluates the global batches, in micro-batches of B rows
            for x, y in (part for batch in self.data.val_batches(B * self.world, self.cfg.train.eval_batches)
                         for part in zip(*(t.split(B) for t in batch[:2]))):
                x, y = x.to(self.device), y.to(self.device)
                k = int((y != -100).sum())  # the targets the loss averages over (all of them, unless masked)
                docs = self.doc_inputs(x)
                with self.autocast():
                    if self.mod:
                        _, loss, aux = model(x, y, return_aux=True, **docs)
                        acc = acc + aux["mod_accuracy"].float() * k
                        causal += model(x, y, mod_causal=True, **docs)[1].item() * k
                    else:
                        _, loss = model(x, y, **docs)
                total += loss.item() * k
                n += k
                if table is not None:
                    b = table[y.clamp(min=0)] * (y != -100)
                    kb, nbytes = int((b > 0).sum()), nbytes + b.sum().item()
                    if 0 < kb < k:  # special tokens among the targets: their loss left out
                        with self.autocast():
                            loss = model(x, y.masked_fill(b == 0, -100), **docs)[1]
                    nats += loss.item() * kb
        out = {"val_loss": total / max(n, 1), "val_ppl": math.exp(min(total / max(n, 1), 50)),
               "unigram_entropy": self.entropy, **self.eval_tasks(model)}
        if nbytes:
            out["val_bpb"] = nats / math.log(2) / nbytes
        if self.mod:
            per_layer = (acc / max(n, 1)).tolist()
            layers = [i for i in range(model.config.n_layers) if model.config.is_mod(i)]
            out.update({"val_loss_causal": causal / max(n, 1), "val_mod_accuracy": sum(per_layer) / len(per_layer),
                        **{f"val_mod_accuracy_layer{i}": a for i, a in zip(layers, per_layer)}})
        return out

    def byte_table(self, model) -> Optional[torch.Tensor]:
        """(vocab,) the UTF-8 bytes each id decodes to, on the device (None without a tokenizer)."""
        if getattr(self, "_byte_table", None) is None:
            table = token_bytes(self.data.tokenizer, model.config.vocab_size)
            self._byte_table = None if table is None else torch.tensor(table, device=self.device)
        return self._byte_table

    def eval_tasks(self, model) -> dict[str, float]:
        """data.eval_tasks (train/eval.py) scored on `model`, as `eval_<file stem>_<metric>` numbers."""
        files = getattr(self.cfg.data, "eval_tasks", None)
        if not files:
            return {}
        return metric_row(evaluate_files(model, self.data.tokenizer, files, self.device, self.chat_template,
                                         self.cfg.train.batch_size, autocast=self.autocast, log=self.log))

    def flops_per_item(self, model):
        return model.flops_per_token(self.cfg.data.seq_len)

    def samples(self, model, out_dir):
        tok = self.data.tokenizer
        if tok.spec[0] == "ids":
            self.log("samples: skipped (pre-tokenized data without a tokenizer file cannot encode a prompt)")
            return None
        prompts = ["def ", "import ", "class "] if self.cfg.data.path == "stdlib" else ["\n", "The ", "A"]
        g, texts = torch.Generator(device=self.device).manual_seed(self.cfg.train.seed), []
        for p in prompts:
            ids = torch.tensor([tok.encode(p)], dtype=torch.long, device=self.device)
            with self.autocast():
                out = model.generate(ids, max_new_tokens=80, temperature=0.8, top_k=50, generator=g)
            texts.append(tok.decode(out[0].tolist()))
        text = ("\n" + "-" * 60 + "\n").join(texts)
        (Path(out_dir) / "samples.txt").write_text(text)
        return text

    def export(self, model, out_dir):
        if not self.cfg.train.init_from:
            return None
        zoo_only = zoo_folder.exports(model)  # MoD / MoE routing bias: a Zoo folder, else Hugging Face's
        path = Path(out_dir) / ("zoo" if zoo_only else "hf")
        tok = getattr(self.data.tokenizer, "model_path", None)
        if tok is not None and Path(tok).parent == self._init_tokenizers() and not zoo_only:
            tok = Path(tok).parent  # the checkpoint's tokenizer files, config included
        zoo.save_pretrained(model, path, tokenizer=tok if tok is not None or not zoo_only else "bytes")
        return str(path)

    def _init_tokenizers(self) -> Optional[Path]:
        """The folder of train.init_from's tokenizer files (a GGUF file's: written into the cache)."""
        init = self.cfg.train.init_from
        return tokenizer_folder(init, getattr(self.cfg.data, "cache_dir", None)) if init else None

    def save_files(self, out_dir):
        """The tokenizer beside model.safetensors, so the run folder loads and fine-tunes on its own (with
        the special tokens and chat template of train.init_from's tokenizer_config.json)."""
        if (tok := getattr(self.data.tokenizer, "model_path", None)) is not None:
            name = "tokenizer.json" if tok.endswith(".json") else "tokenizer.model"
            atomic_write(Path(out_dir) / name, Path(tok).read_bytes())
            config = Path(tok).with_name("tokenizer_config.json")
            if Path(tok).parent == self._init_tokenizers() and config.is_file():
                atomic_write(Path(out_dir) / config.name, config.read_bytes())
