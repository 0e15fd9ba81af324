"""Optimizers: state memory and step time side by side, the loss each reaches, and the LR range test.

    python train/bench.py optimizers                          # state bytes and step time of every optimizer
    python train/bench.py optimizers --quality --train-steps 300   # + an LR sweep of each on the embedded default
    python train/bench.py lr-find                             # train.lr_find's suggestion against a sweep's best LR

Memory and time: one LLM with fixed random gradients, every optimizer stepped in alternating rounds.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import torch

import zoo
from train.benches import harness
from train.config import OptimConfig, load_run_config
from train.metrics import read_rows
from train.optim import OPTIMIZERS, build_optimizer, state_bytes

REFERENCE = "adamw"
LR_START = {"adamw": 2e-3, "sgd": 0.1, "adafactor": 1e-2, "lion": 3e-4, "muon": 2e-3, "adamw8bit": 2e-3,
            "adamw_offload": 2e-3, "galore": 2e-3}  # on the embedded default; the grid is x1/3, x1, x3
MUON_LR = 0.02


def build_model(args):
    """An LLM of the shape options (args.d_model, n_layers, n_heads, vocab): full attention heads, tied."""
    torch.manual_seed(0)
    return zoo.build(harness.llm_config(args, n_kv_heads=args.n_heads, max_seq_len=256, tie_embeddings=True))


def with_gradients(model, seed: int = 0):
    """`model` with fixed random gradients (1e-3 scale) on every parameter."""
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = (torch.randn(p.shape, generator=g) * 1e-3).to(p.device)
    return model


def time_optimizers(model, configs: dict, rounds: int, steps: int = 1, say=print) -> tuple:
    """Every optimizer of `configs` (name -> OptimConfig) on `model` (holding fixed gradients), stepped in
    alternating rounds -> (harness.Rounds, {name: state bytes after a step}, {name: build notes})."""
    device, opts, notes = next(model.parameters()).device, {}, {}
    for name, cfg in configs.items():
        msgs = []
        opts[name] = build_optimizer(model, cfg, device, log=msgs.append)
        notes[name] = "; ".join(msgs)
    harness.warm_up({k: o.step for k, o in opts.items()}, say=say)  # states allocated (and torchao's update compiled)
    with torch.no_grad():
        weights = [p.detach().clone() for p in model.parameters()]

    def restore(_):  # the optimizers move the shared weights by tiny steps: put them back
        with torch.no_grad():
            for p, w in zip(model.parameters(), weights):
                p.copy_(w)
    rounds = harness.run_rounds({k: o.step for k, o in opts.items()}, rounds, calls=steps, between=restore)
    return rounds, {name: state_bytes(o) for name, o in opts.items()}, notes


def memory_and_time(args, names) -> dict:
    model = with_gradients(build_model(args))
    n = sum(p.numel() for p in model.parameters())
    configs = {k: OptimConfig(name=k, lr=1e-5, muon_lr=1e-5) for k in names}
    r, nbytes, notes = time_optimizers(model, configs, args.rounds)
    ref = nbytes[REFERENCE]
    rows = [[k, f"{r.best(k) * 1e3:.1f}", str(r.paired(REFERENCE, k)) if k != REFERENCE else "",
             f"{nbytes[k] / 2**20:.1f}", f"{nbytes[k] / n:.2f}", f"{100 * (1 - nbytes[k] / ref):.0f}%", notes[k]]
            for k in names]
    return harness.table(["optimizer", "best step ms", "step time / adamw's, paired median (range)", "state MiB",
                          "state bytes / param", "state saved vs adamw", "notes"], rows, f"{n / 1e6:.1f}M parameters")


def train_run(args, over: list) -> tuple[dict, list]:
    """The final row and the val-loss curve of a run of the embedded default with `over` (and --set)."""
    from train.loop import train
    from train.run import DEFAULT_CONFIG
    with tempfile.TemporaryDirectory() as tmp:
        over = [f"train.out_dir={tmp}", *harness.QUIET, "train.checkpoint_every=0", "train.average_last=0",
                f"train.precision={args.precision}", *over, *args.set]
        final = train(load_run_config(str(DEFAULT_CONFIG), over), log=lambda m: None)
        rows = read_rows(Path(tmp)) if (Path(tmp) / "metrics.jsonl").is_file() else []  # none from the range test
        return final, [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]


def quality(args, names) -> dict:
    """Each optimizer at each LR of its grid for --train-steps: the best final val loss and its LR; and Muon
    against AdamW: the first evaluation at which each reaches AdamW's best."""
    res = {}
    for name in names:
        for lr in args.lrs or [LR_START[name] / 3, LR_START[name], LR_START[name] * 3]:
            muon = [f"optim.muon_lr={MUON_LR * lr / LR_START[name]}"] if name == "muon" else []
            final, curve = train_run(args, [
                f"train.max_steps={args.train_steps}", f"train.eval_every={args.eval_every}",
                f"optim.warmup_steps={max(1, args.train_steps // 10)}", f"optim.name={name}", f"optim.lr={lr}", *muon])
            res[name, lr] = (final["val_loss"], curve)
            print(f"  {name} lr {lr:.2g}: val loss {final['val_loss']:.4f}", flush=True)
    best = {n: min(((lr, *v) for (m, lr), v in res.items() if m == n), key=lambda t: t[1]) for n in names}
    tables = {"quality": harness.table(
        ["optimizer", "best LR", f"val loss after {args.train_steps} steps", "LRs tried"],
        [[n, f"{lr:.2g}", f"{v:.4f}", ", ".join(f"{x:.2g}" for m, x in res if m == n)]
         for n, (lr, v, _) in best.items()])}
    if "muon" in best and REFERENCE in best:
        target = best[REFERENCE][1]
        rows = [[n, f"{best[n][0]:.2g}", f"{target:.4f}",
                 next((str(s) for s, v in best[n][2] if v <= target), f"not within {args.train_steps}")]
                for n in (REFERENCE, "muon")]
        tables["muon"] = harness.table(["optimizer", "LR", "target val loss",
                                        f"steps to reach it (evaluated every {args.eval_every})"], rows)
    return tables


def lr_find(args) -> dict:
    """The range test (train.lr_find, its default range and steps), then --train-steps at each LR of --lrs."""
    found, _ = train_run(args, ["train.lr_find=true"])
    suggested, res = found["suggested_lr"], {}
    for lr in args.lrs:
        res[lr] = train_run(args, [f"train.max_steps={args.train_steps}", "train.eval_every=0", f"optim.lr={lr}",
                                   f"optim.warmup_steps={max(1, args.train_steps // 10)}"])[0]["val_loss"]
    best = min(res, key=res.get)
    ratio = max(best / suggested, suggested / best)
    rows = [[f"{lr:.3g}" + (" (best)" if lr == best else ""), f"{v:.4f}"] for lr, v in res.items()]
    return {"sweep": harness.table(["LR", f"val loss after {args.train_steps} steps"], rows,
                                   f"suggested {suggested:.3g} ({len(found['lr'])} range-test steps), best of the "
                                   f"sweep {best:.3g}: a factor of {ratio:.2f} "
                                   f"({'within' if ratio <= 3 else 'NOT within'} 3)")}


def main(argv=None, preset: str = "optimizers"):
    p = harness.parser(preset, __doc__, precision="fp32", rounds=preset == "optimizers", one_precision=True)
    harness.llm_args(p, d_model=512, n_layers=8, n_heads=8, vocab=32000)
    p.add_argument("--optimizers", type=harness.name_list(OPTIMIZERS, "optimizer"), default=",".join(OPTIMIZERS))
    p.add_argument("--train-steps", type=harness.positive_int, default=300 if preset == "optimizers" else 200)
    p.add_argument("--quality", action="store_true", help="also sweep LRs on the embedded default")
    p.add_argument("--skip-memory", action="store_true", help="--quality only")
    p.add_argument("--lrs", type=lambda s: [float(x) for x in s.split(",")],
                   default=None if preset == "optimizers" else [5e-4, 1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2],
                   help="comma list of LRs")
    p.add_argument("--eval-every", type=harness.positive_int, default=50)
    p.add_argument("--set", nargs="*", default=[], help="key=value overrides of every training run")
    args = p.setup(argv)
    if preset == "lr-find":
        tables = lr_find(args)
    else:
        names = [REFERENCE] + [n for n in args.optimizers if n != REFERENCE]
        tables = {} if args.skip_memory else {"memory and time": memory_and_time(args, names)}
        tables |= quality(args, names) if args.quality else {}
    harness.save(args, tables, {})


# ---------------------------------------------------------------- the techniques report's claims
def claim_fused(ctx) -> list[dict]:
    """Fused AdamW (one kernel for the whole update) against the for-each one: the optimizer step."""
    model = with_gradients(build_model(ctx.s.opt).to(ctx.device))
    configs = {k: OptimConfig(name="adamw", lr=1e-5, fused=k == "fused") for k in ("foreach", "fused")}
    r, b, _ = time_optimizers(model, configs, ctx.n_rounds, steps=2, say=lambda m: None)
    n = sum(p.numel() for p in model.parameters())
    return [ctx.speed("fused AdamW", r, "fused", "foreach", unit=f"optimizer step ({n / 1e6:.1f}M params)",
                      memory=f"state {b['foreach'] / 2**20:.1f} / {b['fused'] / 2**20:.1f} MiB")]


def claim_state(ctx) -> list[dict]:
    """Optimizer-state bytes after a step (train.optim.state_bytes) of each optimizer against AdamW's."""
    model = with_gradients(build_model(ctx.s.opt).to(ctx.device))
    names = ["adamw", "adamw8bit", "lion", "sgd", "adafactor"]
    r, b, _ = time_optimizers(model, {k: OptimConfig(name=k, lr=1e-5) for k in names}, ctx.n_rounds, say=lambda m: None)
    n, ref = sum(p.numel() for p in model.parameters()), b["adamw"]
    ctx.memory["optimizer state"] = {k: v / 2**20 for k, v in b.items()}
    return [dict(key=f"{k} (state memory)", evidence="exact", samples=[1 - b[k] / ref],
                 numbers={"base_bytes": ref, "tech_bytes": b[k]},
                 memory=f"state {ref / 2**20:.1f} -> {b[k] / 2**20:.1f} MiB ({b[k] / n:.2f} bytes/param)",
                 speed=f"optimizer step {r.paired(k, 'adamw')} of AdamW's speed") for k in names[1:]]
