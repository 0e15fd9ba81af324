"""LLM quality at equal compute: MoE and Mixture-of-Depths against dense, full fine-tuning against adapters.

    python train/bench.py llm-moe-quality   # dense vs MoE (same active parameters, 4x the total), 3 ways of balancing
    python train/bench.py llm-mod-quality   # dense vs Mixture-of-Depths (top-k 12.5%, 2 routers), equal FLOPs
    python train/bench.py peft              # full fine-tuning vs LoRA, DoRA and QLoRA at the SmolLM-135M shape

Runs of train/run.py on the same data, seed and tokens (read back from --out when finished).
"""
from __future__ import annotations

import statistics
from argparse import Namespace
from pathlib import Path

import torch

import zoo
from train.benches import harness
from train.benches.harness import ROOT
from train.config import load_run_config

LLM = ROOT / "configs" / "llm"
TARGETS = "[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]"
LORA = ["adapter.method=lora", "adapter.r=8", "adapter.alpha=16", f"adapter.targets={TARGETS}"]
RUNS = {  # preset -> run -> (config, overrides)
    "llm-moe-quality": {
        "dense": ("tiny.yaml", []), "moe": ("tiny-moe.yaml", []),
        # a bias step of 0.01: the default 0.001 is too slow for a run this short (routing collapses first)
        "moe-bias": ("tiny-moe.yaml", ["model.moe.balance=bias", "train.moe_bias_update_rate=0.01"]),
        "moe-none": ("tiny-moe.yaml", ["model.moe.balance=none", "train.moe_z_loss_coef=0"])},
    "llm-mod-quality": {"dense": ("tiny.yaml", []), "mod": ("tiny-mod.yaml", []),
                        "mod-predictor": ("tiny-mod.yaml", ["model.mod_router=predictor"])},
    "peft": {"full": ("tiny.yaml", []), "lora": ("tiny.yaml", LORA),
             "dora": ("tiny.yaml", [o.replace("=lora", "=dora") for o in LORA]),
             "qlora": ("tiny.yaml", LORA + ["adapter.quantize_base=nf4"])},
}
COLUMNS = {  # preset -> the table's columns (keys of `summary`)
    "llm-moe-quality": ["val loss", "tokens/s (median)", "load max", "load min", "lb loss", "starved experts"],
    "llm-mod-quality": ["steps", "FLOPs/token", "val loss (top-k)", "val loss (causal)",
                        "decision accuracy (mean / worst layer)", "tokens/s (median)"],
    "peft": ["trainable params", "model state MiB", "peak RSS GiB", "step s (median)", "val loss"],
}


def flops_per_token(preset, name, seq) -> float:
    cfg, extra = RUNS[preset][name]
    return zoo.build(load_run_config(str(LLM / cfg), [*extra, f"data.seq_len={seq}"]).model).flops_per_token(seq)


def steps_of(preset, args, equal_flops=None) -> tuple[dict, dict]:
    """{run: steps}: args.steps, or (MoD; `equal_flops`) as many as the dense run's training FLOPs buy; {run:
    FLOPs/token}."""
    equal_flops = preset == "llm-mod-quality" if equal_flops is None else equal_flops
    fpt = {n: flops_per_token(preset, n, args.seq) for n in args.runs} if equal_flops else {}
    if not fpt:
        return dict.fromkeys(args.runs, args.steps), fpt
    budget = flops_per_token(preset, "dense", args.seq) * args.steps
    return {n: max(1, round(budget / fpt[n])) for n in args.runs}, fpt


def run(preset, name, args, steps: int, seed: int = 0, base=None) -> list[dict]:
    """One run of the preset (its metrics rows); `base`: the fine-tunes' starting folder (peft)."""
    cfg, extra = RUNS[preset][name]
    over = [f"train.max_steps={steps}", f"train.batch_size={args.batch}", f"data.seq_len={args.seq}",
            f"train.eval_batches={args.eval_batches}", "train.checkpoint_every=0", f"train.seed={seed}", *extra]
    if preset == "peft":  # full fine-tuning at lr 3e-4, adapters at 3e-3
        over += [f"train.init_from={base}", "data.tokenizer=bytes", "train.grad_accum=1", "train.eval_every=0",
                 "train.average_last=0", "train.log_every=1", "train.compile=false", "train.resume=false",
                 f"optim.lr={3e-4 if name == 'full' else 3e-3}", f"optim.warmup_steps={max(1, steps // 10)}",
                 *([f"data.path={args.data}"] if args.data else [])]
    else:
        over += [f"train.eval_every={max(1, steps // args.evals)}", "train.log_every=10",
                 f"optim.warmup_steps={max(1, steps // 12)}"]
    over += [f"train.precision={args.precision}"] if args.precision else []
    done = "adapter" if preset == "peft" and name != "full" else "model.safetensors"
    return harness.run_loop(LLM / cfg, Path(args.out) / (name if seed == 0 else f"{name}-seed{seed}"), over,
                            args.threads, done=done)


def peft_runs(args, names) -> dict:
    """Per method, its fine-tune of the base: rows, parameters, state and weight bytes, peak RSS, val loss."""
    base, res = make_base(args), {}
    for n in names:
        rows = run("peft", n, args, args.steps, base=base)
        t, total, state = state_bytes(base, RUNS["peft"][n][1])
        res[n] = {"rows": rows, "trainable": t, "total": total, "state": state, "weights": state - 12 * t,
                  "peak_rss": max(r["peak_mem_gb"] for r in rows if "loss" in r) * 2**30,
                  "val": harness.last(rows, "val_loss")}
    return res


def trained(out: Path):
    """The final model of the run in `out` (eval mode) and its data."""
    return zoo.from_pretrained(out).eval(), harness.run_task(out).data


def starved(out: Path, batch: int) -> int:
    """Experts (over all layers) that receive under a tenth of a uniform share of a validation batch."""
    model, data = trained(out)
    x, y = next(iter(data.val_batches(batch, 1)))
    with torch.no_grad():
        load = model(x, y, return_aux=True)[2]["load"]
    return int((load < 0.1 * load.mean(-1, keepdim=True)).sum())


def best_threshold_accuracy(score, target) -> float:
    """The best accuracy of the decision "score > t" against the bool `target` over every threshold t
    (both 1-D): sort by score, and route the first j tokens for every j."""
    hits = target[score.argsort(descending=True)].float()
    cum = torch.cat([torch.zeros(1), hits.cumsum(0)])  # the positives among the first j, j = 0..N
    n, pos = len(hits), hits.sum()
    right = cum + (n - torch.arange(n + 1) - (pos - cum))  # routed positives + the negatives not routed
    return float(right.max() / n)


def decisions(out: Path, batch: int, n_batches: int) -> dict:
    """Per MoD layer, how well a causal decision agrees with the top-k on the validation tokens: the
    trained decision, its logit with the best fixed threshold, and the router logit with the best
    fixed threshold (the ceiling of a decision that learns the router's score exactly)."""
    from zoo.blocks.mod import MixtureOfDepths
    model, data = trained(out)
    logs = {}
    with torch.no_grad():
        for x_ids, _ in data.val_batches(batch, n_batches):
            x = model.embed(x_ids)
            cos, sin = model.rope(0, x_ids.shape[1], x.dtype)
            for i, layer in enumerate(model.layers):
                if isinstance(layer, MixtureOfDepths):
                    r = layer.router(x).squeeze(-1).float()
                    k = layer.tokens_routed(r.shape[1])
                    top = torch.zeros_like(r, dtype=torch.bool).scatter_(1, r.topk(k, -1).indices, True)
                    d = layer.decision_logits(x, r) - layer.threshold  # route where > 0
                    for name, v in (("router", r), ("decide", d), ("top", top)):
                        logs.setdefault(i, {}).setdefault(name, []).append(v.flatten())
                x = layer(x, cos, sin)[0]
    out = {}
    for i, v in logs.items():
        r, d, top = (torch.cat(v[n]) for n in ("router", "decide", "top"))
        out[i] = {"decision": float(((d > 0) == top).float().mean()), "best threshold": best_threshold_accuracy(d, top),
                  "router ceiling": best_threshold_accuracy(r, top)}
    return out


def summary(preset, name, rows, args, steps, fpt, base=None) -> dict:
    """A run's numbers, by the names of the table's columns."""
    train, ev = [r for r in rows if "loss" in r], harness.last_with(rows, "val_loss")
    s = {"steps": steps, "val loss": f"{ev['val_loss']:.4f}", "val loss (top-k)": f"{ev['val_loss']:.4f}",
         "tokens/s (median)": f"{statistics.median(r['tokens_per_s'] for r in train):.0f}",
         "step s (median)": f"{statistics.median([r['step_time_s'] for r in train[1:] or train]):.2f}",
         "peak RSS GiB": f"{max(r['peak_mem_gb'] for r in train):.2f}", "val_loss": ev["val_loss"]}
    if name in fpt:
        s["FLOPs/token"] = f"{fpt[name] / 1e6:.1f}M"
    if "val_loss_causal" in ev:
        acc = [v for k, v in ev.items() if k.startswith("val_mod_accuracy_layer")]
        s["val loss (causal)"] = f"{ev['val_loss_causal']:.4f}"
        s["decision accuracy (mean / worst layer)"] = f"{100 * ev['val_mod_accuracy']:.1f}% / {100 * min(acc):.1f}%"
    if "moe_load_max" in train[-1]:  # the mean over the last quarter of the logged steps, the worst layer
        tail = train[-max(1, len(train) // 4):]
        mean = lambda k, i: sum(r[k][i] for r in tail) / len(tail)  # noqa: E731
        layers = range(len(tail[0]["moe_load_max"]))
        s.update({"load max": f"{max(mean('moe_load_max', i) for i in layers):.2f}",
                  "load min": f"{min(mean('moe_load_min', i) for i in layers):.2f}",
                  "lb loss": f"{sum(r['moe_lb_loss'] for r in tail) / len(tail):.3f}",
                  "starved experts": starved(Path(args.out) / name, args.batch)})
    if preset == "peft":
        trainable, total, nbytes = state_bytes(base, RUNS[preset][name][1])
        s.update({"trainable params": f"{trainable / 1e6:.2f}M ({100 * trainable / total:.2f}%)",
                  "model state MiB": f"{nbytes / 2**20:,.0f}", "trainable": trainable, "total": total, "state": nbytes})
    return s


def make_base(args) -> Path:
    """The fine-tunes' base: --config's shape (--layers deep) with random weights, saved once."""
    folder = Path(args.out) / "base"
    if not (folder / "config.json").is_file():
        torch.manual_seed(0)
        zoo.save_pretrained(zoo.build(ROOT / args.config, **({"n_layers": args.layers} if args.layers else {})), folder)
    return folder


def state_bytes(base: Path, extra: list) -> tuple[int, int, int]:
    """(trainable parameters, all parameters, bytes of the weights + the trainables' gradients and AdamW moments)."""
    from zoo.adapters import apply_adapters, count_params, param_bytes
    model, adapter = zoo.from_pretrained(base, dtype=torch.float32), load_run_config(None, extra, base={}).adapter
    if adapter.enabled:
        apply_adapters(model, adapter)
    trainable, total = count_params(model)
    return trainable, total, param_bytes(model) + 3 * 4 * trainable


def plot(results: dict, png: Path, title: str, xlabel: str = "step", scale: dict = None):
    """Each run's training cross-entropy (a moving mean over 5 logged rows) and validation loss."""
    from train.plots import line_plot
    series, styles = {}, {}
    for i, (name, rows) in enumerate(results.items()):
        x = (scale or {}).get(name, 1.0)
        steps, losses = zip(*[(r["step"] * x, r.get("lm_loss", r["loss"])) for r in rows if "loss" in r])
        series[f"{name} train"] = [(s, statistics.fmean(losses[max(0, j - 4):j + 1])) for j, s in enumerate(steps)]
        series[f"{name} val"] = [(r["step"] * x, r["val_loss"]) for r in rows if "val_loss" in r]
        styles |= {f"{name} train": {"color": f"C{i}"}, f"{name} val": {"color": f"C{i}", "ls": "--"}}
    return line_plot(series, png, xlabel, "cross-entropy (nats/token)", title=title,
                     markers={f"{n} val" for n in results}, styles=styles)


def main(argv=None, preset: str = "llm-moe-quality"):
    peft = preset == "peft"
    p = harness.parser(preset, __doc__, precision="fp32" if peft else "", rounds=False, one_precision=True, out=True)
    harness.llm_args(p, **(dict(seq=128, batch=4) if peft else dict(seq=256, batch=16)))
    harness.counts(p, steps=(20 if peft else 600, "steps (MoD: the dense run's)"), evals=(
        6 if preset == "llm-moe-quality" else 4, "evaluations per run"), eval_batches=8 if peft else 20)
    p.add_argument("--runs", "--only", type=harness.name_list(RUNS[preset], "run"), default=",".join(RUNS[preset]))
    if peft:
        p.add_argument("--config", default="configs/llm/smollm-135m.yaml", help="the model shape")
        p.add_argument("--layers", type=int, default=None, help="its number of layers")
        p.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"))
    args = p.setup(argv)  # --threads here too, so that the result's machine line names the runs' threads
    if peft and not Path(args.data).is_file():
        p.error(f"--data {args.data}: no such file (tinyshakespeare.txt)")
    base = make_base(args) if peft else None
    steps, fpt = steps_of(preset, args)
    results = {n: run(preset, n, args, steps[n], base=base) for n in args.runs}
    sums = {n: summary(preset, n, rows, args, steps[n], fpt, base) for n, rows in results.items()}
    rows = [[n, *(s.get(c, "-") for c in COLUMNS[preset])] for n, s in sums.items()]
    tables = {"runs": harness.table(["run", *COLUMNS[preset]], rows)}
    if preset == "llm-mod-quality" and len(results) > 1:
        dec = {n: decisions(Path(args.out) / n, args.batch, args.eval_batches) for n in results if n != "dense"}
        tables["decisions"] = harness.table(
            ["run", "layer", "decision", "best threshold", "router ceiling"],
            [[n, f"layer {i}", *(f"{100 * v:.1f}%" for v in a.values())] for n, d in dec.items() for i, a in d.items()])
    if not peft:
        scale = {n: args.batch * args.seq * fpt[n] / 1e12 for n in fpt}
        plot(results, ROOT / "docs" / f"{preset[4:7]}_quality.png",
             f"{preset}: {args.steps} steps of {args.batch} x {args.seq} tokens",
             "training FLOPs (x 1e12)" if fpt else "step", scale)
    harness.save(args, tables, {"summaries": sums, "steps": steps, "flops_per_token": fpt})


# ---------------------------------------------------------------- the techniques report's claims
def claim_lora(ctx) -> list[dict]:
    """Full fine-tuning against LoRA and QLoRA (the peft bench's runs; the state bytes counted from the tensors)."""
    data = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"
    args = Namespace(config="configs/llm/tiny.yaml", layers=ctx.s.lora_layers, steps=ctx.s.lora_steps, batch=4, seq=64,
                     eval_batches=2, precision=ctx.precision, threads=None, data=str(data) if data.is_file() else None,
                     out=str(ctx.work / "peft"))
    res = peft_runs(args, ("full", "lora", "qlora"))
    ctx.plot("lora_loss", f"full fine-tuning vs LoRA vs QLoRA ({ctx.s.lora_steps} steps)",
             {n: v.pop("rows") for n, v in res.items()}, "loss", "training loss")
    ctx.memory["fine-tuning (weights + grads + AdamW state)"] = {n: v["state"] / 2**20 for n, v in res.items()}
    f, lo, q = res["full"], res["lora"], res["qlora"]
    half = (lo["weights"] - 4 * lo["trainable"]) / 2 + 4 * lo["trainable"]  # LoRA's fp32 base halved, adapters in fp32
    peaks = " / ".join(f"{v['peak_rss'] / 2**30:.2f}" for v in res.values())
    peak = f"measured peak memory (peak RSS {peaks} GiB full / LoRA / QLoRA, one run each)"
    common = dict(evidence="exact", unmeasured=peak, numbers=res,
                  quality=f"val loss {f['val']:.3f} / {lo['val']:.3f} / {q['val']:.3f} (full / LoRA / QLoRA)")
    return [dict(key="LoRA (training state)", samples=[1 - lo["state"] / f["state"]],
                 memory=f"state {f['state'] / 2**20:.1f} -> {lo['state'] / 2**20:.1f} MiB", **common),
            dict(key="QLoRA (base weights)", samples=[1 - q["weights"] / half],
                 memory=f"weights {half / 2**20:.1f} (16-bit base) -> {q['weights'] / 2**20:.1f} MiB", **common)]


def claim_averaging(ctx) -> list[dict]:
    """Loop runs of the embedded default per seed with an EMA and checkpoint averaging (the last 4 checkpoints, a
    sixteenth of the run apart, weighted 1 to 4 oldest to newest: average_weighting=linear): their val loss beside
    the weights'."""
    n, last = ctx.s.loop_steps, 4
    decay = round(max(0.5, 1 - 10 / n), 4)  # an averaging horizon of about a tenth of the run
    over = [f"train.max_steps={n}", f"train.batch_size={ctx.s.loop_batch}", f"data.seq_len={ctx.s.loop_seq}",
            "data.tokenizer=bytes", f"data.max_chars={ctx.s.max_chars}", f"train.ema_decay={decay}",
            "train.eval_batches=4", f"train.eval_every={max(1, n // 4)}", f"train.checkpoint_every={max(1, n // 16)}",
            f"train.average_last={last}", f"train.keep_checkpoints={last}", "train.average_weighting=linear",
            f"optim.warmup_steps={max(1, n // 10)}", f"train.log_every={max(1, n // 20)}"]
    runs = [ctx.loop("averaging", LLM / "tiny.yaml", over, s) for s in range(ctx.seeds)]
    ema = [dict(r, val_loss=r["ema_val_loss"]) for r in runs[0] if "ema_val_loss" in r]
    ctx.plot("averaging_loss", f"final weights vs EMA (decay {decay}), seed 0",
             {"weights (val)": runs[0], "EMA (val)": ema}, "val_loss", "validation loss")
    v = {k: [harness.last(r, k) for r in runs] for k in ("val_loss", "ema_val_loss", "avg_val_loss")}
    q = "val loss (mean of seeds): " + ", ".join(f"{k} {statistics.fmean(x):.4f}" for k, x in v.items())
    return [dict(key=key, samples=[(b - a) / b for b, a in zip(v["val_loss"], v[k])], quality=q,
                 numbers={**v, "ema_decay": decay, "average_last": last})
            for key, k in (("checkpoint averaging", "avg_val_loss"), ("EMA of the weights", "ema_val_loss"))]


def seeded(ctx, preset) -> list:
    """Per seed at the report's scale, the dense run (read back by MoE and MoD) and the preset's other (moe, mod)."""
    args = Namespace(steps=ctx.s.loop_steps, batch=ctx.s.loop_batch, seq=ctx.s.loop_seq, evals=8, threads=None,
                     eval_batches=20 if ctx.s.name == "full" else 4, precision=ctx.precision,
                     out=str(ctx.work / "llm"), runs=["dense", preset[4:7]])
    steps, fpt = steps_of(preset, args, equal_flops=True)
    got = [({n: run(preset, n, args, steps[n], seed) for n in args.runs}, {"steps": steps, "flops_per_token": fpt})
           for seed in range(ctx.seeds)]
    ctx.plot(f"{preset[4:7]}_val", f"dense vs {preset[4:7]}: validation loss (seed 0)", got[0][0], "val_loss",
             "validation loss")
    return [(res, info, {f"{n}_tok_s": harness.median_of(res[n], "tokens_per_s") for n in res}) for res, info in got]


def claim_moe(ctx) -> list[dict]:
    """Dense against MoE (the same active parameters; 4x the total) at equal training FLOPs (the FLOPs of the active
    parameters and attention, flops_per_token), per seed: the final validation loss."""
    ps = [{"dense_val": harness.last(res["dense"], "val_loss"), "moe_val": harness.last(res["moe"], "val_loss"),
           **info, **tok} for res, info, tok in seeded(ctx, "llm-moe-quality")]
    m = {k: statistics.fmean(p[k] for p in ps) for k in ("dense_val", "moe_val", "dense_tok_s", "moe_tok_s")}
    return [dict(key="MoE (equal compute)", samples=[(p["dense_val"] - p["moe_val"]) / p["dense_val"] for p in ps],
                 numbers={"per_seed": ps},
                 quality=f"val loss {m['dense_val']:.4f} -> {m['moe_val']:.4f} (equal training FLOPs: "
                         f"{ps[0]['steps']['dense']} dense steps, {ps[0]['steps']['moe']} MoE steps)",
                 speed=f"tokens/s {m['dense_tok_s']:.0f} -> {m['moe_tok_s']:.0f} on this machine (separate runs; "
                       f"not judged: the claim is per compute)")]


def claim_mod(ctx) -> list[dict]:
    """Dense against Mixture-of-Depths at equal training FLOPs, per seed, on MoD's causal validation loss (routing as
    decoding does; the loop's top-k evaluation looks at later tokens): the mod-quality bench's runs."""
    ps = [{"dense_val": harness.last(res["dense"], "val_loss"), "mod_val_topk": harness.last(res["mod"], "val_loss"),
           "mod_val_causal": harness.last(res["mod"], "val_loss_causal"), **info, **tok}
          for res, info, tok in seeded(ctx, "llm-mod-quality")]
    m = {k: statistics.fmean(p[k] for p in ps) for k in ("dense_val", "mod_val_causal", "mod_val_topk",
                                                         "dense_tok_s", "mod_tok_s")}
    return [dict(key="Mixture-of-Depths (equal FLOPs)", numbers={"per_seed": ps},
                 samples=[(p["dense_val"] - p["mod_val_causal"]) / p["dense_val"] for p in ps],
                 quality=f"val loss {m['dense_val']:.4f} -> {m['mod_val_causal']:.4f} causal, "
                         f"{m['mod_val_topk']:.4f} top-k (steps {ps[0]['steps']})",
                 speed=f"tokens/s {m['dense_tok_s']:.0f} -> {m['mod_tok_s']:.0f} "
                       f"(medians of separate runs, not paired)")]
