"""RL: rollout speed (Zoo's batched generation against transformers' generate) and what RL teaches.

    python train/bench.py rollout      # P prompts of different lengths x G samples, N new tokens each
    python train/bench.py rl-quality   # held-out reward of runs/tiny-sft, then of tiny-grpo over 3 seeds
    python train/bench.py rl-memory    # peak memory of GRPO steps: full fine-tuning and LoRA, KL or not

One Llama checkpoint (random weights) loaded by both. Zoo: `LLM.generate` on the P x G rows left-padded,
a generator per row (as the RL task samples); transformers: `generate(do_sample=True,
num_return_sequences=G)` on the P prompts left-padded. Both sample at temperature 1 with top_p and
produce exactly N tokens per row; eager and compiled (Zoo: its decoding step of fixed shapes,
compile="reduce-overhead"; transformers: its forward compiled on a static cache). Where Zoo is faster by
design: it runs each distinct prompt's forward once for its G rows (transformers runs P x G), and its
nucleus sampling redraws the rare token outside the nucleus instead of sorting the vocabulary each step.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

import zoo
from train.benches import harness
from train.benches.harness import ROOT
from train.benches.llm_speed import hf_config, hf_decoders, hf_load


def prompts(args) -> tuple[torch.Tensor, torch.Tensor]:
    """P left-padded prompts of lengths spread over [prompt / 2, prompt] and their attention mask."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.linspace(args.prompt // 2, args.prompt, args.prompts).round().long().tolist()
    ids = torch.zeros(args.prompts, args.prompt, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, -n:] = torch.randint(1, args.vocab, (n,), generator=g)
        mask[i, -n:] = 1
    return ids, mask


def sides(args, folder: Path, prec: str) -> dict:
    dt, (ids, mask), G, n = harness.PRECISIONS[prec], prompts(args), args.group, args.new_tokens
    rows, row_mask = ids.repeat_interleave(G, 0), mask.repeat_interleave(G, 0)
    model = zoo.from_pretrained(folder, dtype=dt).eval()

    def zoo_side(c):
        gens = [torch.Generator().manual_seed(i) for i in range(len(rows))]
        return model.generate(rows, n, temperature=1.0, top_p=args.top_p, generator=gens, attention_mask=row_mask,
                              compile=c)
    hf = hf_decoders("transformers", lambda: hf_load(folder, dt), args.modes, inputs=ids, attention_mask=mask,
                     max_new_tokens=n, min_new_tokens=n, do_sample=True, temperature=1.0, top_p=args.top_p, top_k=0,
                     num_return_sequences=G, pad_token_id=0)
    return {k: v for m in args.modes for k, v in (
        (f"zoo-{m}", lambda c="reduce-overhead" if m == "compile" else False: zoo_side(c)),
        (f"transformers-{m}", hf[f"transformers-{m}"]))}


def rollout_table(args, folder: Path, prec: str) -> tuple[dict, dict]:
    calls, outs = sides(args, folder, prec), {}
    fns = harness.inference_sides(calls, prec, outs)
    first = harness.warm_up(fns, say=lambda m: print(f"  {prec} rollouts {m}", flush=True))
    r, done, rows = harness.run_rounds(fns, args.rounds), args.prompts * args.group, []
    for k in calls:
        ref = "transformers-" + k.split("-")[1]
        rows.append([k, f"{r.median(k):.3f}", f"{done / r.median(k):.1f}", f"{done / r.best(k):.1f}", f"{first[k]:.1f}",
                     "x".join(map(str, outs[k].shape)), "-" if k == ref else str(r.paired(k, ref))])
    note = (f"{prec}: {args.prompts} prompts of {args.prompt // 2}-{args.prompt} tokens x {args.group} samples, "
            f"{args.new_tokens} new tokens each, temperature 1, top_p {args.top_p}; a Llama of d_model {args.d_model}, "
            f"{args.n_layers} layers, {args.n_heads} heads ({args.n_kv_heads} kv), vocab {args.vocab}; "
            f"{args.rounds} alternating rounds; speedup: transformers' seconds / Zoo's, paired median (range)")
    table = harness.table(["side", "median s", "completions/s (median)", "completions/s (best)", "first call s",
                           "output", "speedup vs transformers, same mode"], rows, note)
    return table, {k: {"wall": r.times(k)} for k in calls}


def quality(args) -> dict:
    """Greedy answers to the embedded task's held-out prompts: the starting model, then each seed's run."""
    from train.chat import load
    from train.config import load_run_config
    from train.data.prompts import arithmetic, reward_fn
    from train.eval import score_rewards
    override = [f"train.init_from={args.init}", *args.override]
    cfg = load_run_config(args.config, override)
    rl, rows = cfg.rl, arithmetic("val", args.prompts)
    rewards = [(r.name, r.weight, reward_fn(r.name)) for r in rl.rewards]

    def score(folder):
        model, tok, template = load(str(folder))
        m, details = score_rewards(model, tok, rows, torch.device("cpu"), template, 64, rl.max_new_tokens,
                                   lambda: harness.autocast(args.precision), cfg.data.seq_len + rl.max_new_tokens,
                                   rewards=rewards)
        return [m["reward"], *(sum(d["rewards"][k] for d in details) / len(rows) for k in range(len(rewards)))]
    before, after = score(args.init), []
    for seed in range(args.seeds):
        harness.run_loop(args.config, args.out / f"seed{seed}", [f"train.seed={seed}", *override])
        after.append(score(args.out / f"seed{seed}"))
    names = ["reward"] + [f"{n} rate" for n, _, _ in rewards]
    table = [["before: " + relative(args.init), *(f"{v:.3f}" for v in before)]]
    table += [[f"after, seed {i}", *(f"{v:.3f}" for v in a)] for i, a in enumerate(after)]
    table.append([f"after - before: mean ± 95% interval ({args.seeds} seeds)",
                  *(harness.interval_text((a[k] - before[k] for a in after), "+.3f", half=".3f", paren=True)
                    for k in range(len(names)))])
    return harness.table(["model", *names], table,
                         f"greedy answers to {args.prompts} held-out prompts of the embedded task; "
                         f"{relative(args.config)} with {' '.join(args.override) or 'no overrides'}; {args.precision}")


STEP_PEAKS = """
import json, sys
from train import loop
from train.config import load_run_config
from train.planner import _proc_bytes
peaks, step = [], loop.optimizer_step
def measured(*a, **k):  # the resident peak of each optimizer step (rollouts, reference, backward, update)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM back to the resident set now
    out = step(*a, **k)
    peaks.append(_proc_bytes("/proc/self/status", "VmHWM"))
    return out
loop.optimizer_step = measured
loop.train(load_run_config(sys.argv[1], []), log=lambda m: None)
print(json.dumps(peaks))
"""


def memory(args) -> dict:
    """The resident peak of GRPO steps of one random LLM (the loop's, in a fresh process each: the largest
    over `--steps` steps, everything resident counted): full fine-tuning and LoRA, each without and with a
    KL reference. Full fine-tuning keeps a frozen copy for it; LoRA's reference is the base with its
    adapters off, so its KL should cost no copy."""
    model = {"vocab_size": args.vocab, "d_model": args.d_model, "n_layers": args.n_layers, "n_heads": args.n_heads,
             "n_kv_heads": args.n_kv_heads, "max_seq_len": 128}
    base = zoo.build({"family": "llm", "model": model})
    weights, mib = sum(p.numel() * p.element_size() for p in base.parameters()), lambda n: f"{n / 2**20:.0f}"
    rows, median = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        init = zoo.save_pretrained(base, Path(tmp) / "base")
        for method in ("full", "lora"):
            for beta in (0.0, 0.05):
                cfg = {"family": "llm", "model": model,
                       "data": {"format": "prompts", "path": "synthetic", "tokenizer": "bytes", "template": "none",
                                "seq_len": 64, "synthetic_rows": 100, "eval_prompts": 4},
                       "rl": {"group_size": args.group, "prompts_per_step": args.prompts, "max_new_tokens": 16,
                              "kl_beta": beta},
                       "train": {"init_from": str(init), "max_steps": args.steps, "precision": args.precision,
                                 "batch_size": args.group * args.prompts, "eval_every": 0, "checkpoint_every": 0,
                                 "log_every": 1, "peak_flops": 1e12,  # not measured: its matrices would set the peak
                                 "cpu_keep_memory": False,  # freed memory handed back: the resident set is what lives
                                 "progress": False, "samples": False, "plot": False, "export": False},
                       "optim": {"lr": 1e-4}}
                if method == "lora":
                    cfg["adapter"] = {"method": "lora", "r": 16}
                env, v = dict(os.environ, OMP_NUM_THREADS=str(args.threads or 1)), []
                for r in range(args.repeat):  # a run of its own each (a finished run's folder would resume)
                    cfg["train"]["out_dir"] = str(Path(tmp) / f"{method}-{beta}-{r}")
                    (path := Path(tmp) / f"{method}-{beta}-{r}.yaml").write_text(json.dumps(cfg))  # JSON is YAML
                    out = subprocess.run([sys.executable, "-c", STEP_PEAKS, str(path)], cwd=ROOT, env=env, check=True,
                                         capture_output=True, text=True)
                    v.append(max(json.loads(out.stdout.strip().splitlines()[-1])))
                    print(f"  {method}, kl_beta {beta}: step peak {harness.gib(v[-1])} GiB", flush=True)
                median[method, beta] = statistics.median(v)
                extra = median[method, beta] - median[method, 0.0]
                rows.append([method, beta, f"{mib(median[method, beta])} ({mib(min(v))}-{mib(max(v))})",
                             "-" if beta == 0 else f"{mib(extra)} ({extra / weights:.2f}x)"])
    return harness.table(["fine-tuning", "kl_beta", "step peak RSS MiB: median (range)",
                          "the reference's cost: MiB (x the weights), of the medians"],
                         rows, f"GRPO in the loop, the largest resident set during {args.steps} optimizer steps "
                         f"(rollouts, reference log-probs, backward, update; the interpreter and torch included) of "
                         f"{args.prompts} prompts x {args.group} completions, 16 new tokens, {args.precision}, "
                         f"a fresh process each; a random LLM of d_model {args.d_model}, {args.n_layers} layers, vocab "
                         f"{args.vocab}: {base.num_params() / 1e6:.1f}M parameters, {mib(weights)} MiB of weights; "
                         f"LoRA r 16; {args.repeat} runs each")


def relative(path) -> str:
    """A path under the checkout as the checkout names it."""
    p = Path(path).resolve()
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(path)


def main(argv=None, preset: str = "rollout"):
    rl = preset != "rollout"  # rl-quality and rl-memory: one table of loop runs
    p = harness.parser(preset, __doc__, precision="fp32" if rl else "bf16", one_precision=rl, rounds=not rl)
    if preset == "rl-quality":
        p.add_argument("--config", default=str(ROOT / "configs" / "llm" / "tiny-grpo.yaml"))
        p.add_argument("--init", default=str(ROOT / "runs" / "tiny-sft"), help="the model before RL")
        p.add_argument("--out", type=Path, default=ROOT / "runs" / "rl-quality", help="the runs' folders")
        harness.counts(p, seeds=3, prompts=200)
        p.add_argument("override", nargs="*", help="key=value overrides of the config")
    elif preset == "rl-memory":
        harness.llm_args(p, d_model=1024, n_layers=8, n_heads=16, n_kv_heads=8, vocab=8192)
        harness.counts(p, prompts=(2, "prompts per step"), group=(4, "completions per prompt"),
                       steps=(2, "optimizer steps per run"), repeat=(3, "runs of each side"))
    else:
        harness.llm_args(p, d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, ffn=0, vocab=2048)
        harness.counts(p, prompts=(8, "prompts (P)"), group=(8, "samples per prompt (G)"),
                       prompt=(40, "the longest prompt's tokens"), new_tokens=(32, "tokens sampled per row (N)"))
        p.add_argument("--top-p", type=float, default=0.95)
        p.add_argument("--modes", type=harness.name_list(("eager", "compile"), "mode"), default="eager,compile")
    args = p.setup(argv)
    if rl:
        return harness.save(args, {"": (quality if preset == "rl-quality" else memory)(args)}, {})
    from transformers import LlamaForCausalLM
    tables, data = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        LlamaForCausalLM(hf_config(harness.llm_config(args), intermediate_size=args.ffn or 4 * args.d_model * 2 // 3,
                                   max_position_embeddings=512)).save_pretrained(tmp)
        for prec in args.precision:
            tables[prec], data[prec] = rollout_table(args, Path(tmp), prec)
    harness.save(args, tables, data)
