"""Mixture-of-Depths quality at equal training FLOPs, on the embedded corpus (the stdlib source).

    python train/bench.py llm-mod-quality                          # the runs, the table, docs/mod_quality.png
    python train/bench.py llm-mod-quality --steps 200 --out runs/q   # shorter

Runs of train/run.py on the same data, seed, batch and sequence length:
- dense:          configs/llm/tiny.yaml for --steps steps;
- mod:            configs/llm/tiny-mod.yaml (12.5% of the tokens through layers 1 and 3, the causal
                  decision trained by a cross-entropy on the router) for as many steps as use the
                  dense run's training FLOPs (the models' own flops_per_token);
- mod-predictor:  the same with model.mod_router=predictor (a small MLP on stop-gradient inputs).
Each run's schedule (warmup, cosine) spans its own steps. The table: steps, training FLOPs, the
final validation loss with top-k routing (the loop's evaluation), with causal routing (as decoding
routes: `val_loss_causal`), the causal decision's agreement with the top-k on the validation
tokens (`val_mod_accuracy`, the mean over the MoD layers, and its worst layer), and the median
training tokens/s. A second table bounds the decision per MoD layer (`decisions`): the same logit
with the best fixed threshold, and the router logit itself with the best fixed threshold. The PNG: training cross-entropy (smoothed) and validation loss against FLOPs.
Runs that already finished in --out are read, not run again (delete the folder to redo them).
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

from train.benches.moe_quality import plot, run, trained  # noqa: E402

RUNS = {
    "dense": ("tiny.yaml", []),
    "mod": ("tiny-mod.yaml", []),
    "mod-predictor": ("tiny-mod.yaml", ["model.mod_router=predictor"]),
}


def equal_flops_runs(args, runs: dict = RUNS) -> tuple:
    """The runs of `args.runs` (dense first) at the dense run's training FLOPs (args.steps of it):
    (budget FLOPs, {run: FLOPs per token}, {run: steps}, {run: metrics rows})."""
    fpt = {n: flops_per_token(*runs[n], args.seq) for n in args.runs}
    budget = flops_per_token(*runs["dense"], args.seq) * args.steps * args.batch * args.seq
    steps = {n: max(1, round(budget / (fpt[n] * args.batch * args.seq))) for n in args.runs}
    return budget, fpt, steps, {n: run(n, args, runs, steps[n]) for n in args.runs}


def flops_per_token(cfg_name: str, extra: list, seq: int) -> float:
    import zoo
    from train.config import load_run_config
    cfg = load_run_config(str(ROOT / "configs" / "llm" / cfg_name), list(extra) + [f"data.seq_len={seq}"])
    return zoo.build(cfg.model).flops_per_token(seq)


def best_threshold_accuracy(score, target) -> float:
    """The best accuracy of the decision "score > t" against the bool `target` over every threshold t
    (both 1-D): sort by score, and route the first j tokens for every j."""
    import torch
    hits = target[score.argsort(descending=True)].float()
    cum = torch.cat([torch.zeros(1), hits.cumsum(0)])  # the positives among the first j, j = 0..N
    n, pos = len(hits), hits.sum()
    right = cum + (n - torch.arange(n + 1) - (pos - cum))  # routed positives + the negatives not routed
    return float(right.max() / n)


def decisions(out: Path, batch: int, n_batches: int) -> dict:
    """How well a causal decision can agree with the top-k, on the validation tokens of the run in
    `out`, per MoD layer (the layers fed by the top-k forward, as in training):
    'decision': the agreement of the trained decision (logit > the layer's threshold), as the loop measures it;
    'best_threshold': of the same decision logit with the best fixed threshold, chosen on these tokens;
    'router_ceiling': of the router logit itself with the best fixed threshold. The top-k ranks
    router logits within each sequence, so the one thing a fixed threshold on them cannot follow
    is how the k-th largest logit moves from sequence to sequence: this is the agreement a decision
    reaches by learning the router's score exactly."""
    import torch

    from zoo.blocks.mod import MixtureOfDepths
    model, data = trained(out)
    logs = {}  # layer -> lists of (router logit, decision logit, top-k) over the tokens
    with torch.no_grad():
        for x_ids, _ in data.val_batches(batch, n_batches):
            x = model.embed(x_ids)
            cos, sin = model.rope(0, x_ids.shape[1], x.dtype)
            for i, layer in enumerate(model.layers):
                if isinstance(layer, MixtureOfDepths):
                    r = layer.router(x).squeeze(-1).float()
                    k = layer.tokens_routed(r.shape[1])
                    top = torch.zeros_like(r, dtype=torch.bool).scatter_(1, r.topk(k, dim=-1).indices, True)
                    d = layer.decision_logits(x, r) - layer.threshold  # route where > 0
                    for name, v in (("router", r), ("decide", d), ("top", top)):
                        logs.setdefault(i, {}).setdefault(name, []).append(v.flatten())
                x = layer(x, cos, sin)[0]

    res = {}
    for i, v in logs.items():
        r, d, top = (torch.cat(v[n]) for n in ("router", "decide", "top"))
        res[i] = {"decision": float(((d > 0) == top).float().mean()), "best_threshold": best_threshold_accuracy(d, top),
                  "router_ceiling": best_threshold_accuracy(r, top)}
    return res


def main(argv=None):
    from train.benches import harness
    ap = harness.parser("llm-mod-quality", __doc__, precision=None, rounds=False)
    ap.add_argument("--precision", type=harness.precision_name, default=None,
                    help="the runs' train.precision: fp32, bf16 or fp16 (default: the configs' auto)")
    ap.add_argument("--steps", type=harness.positive_int, default=600, help="the dense run's steps")
    ap.add_argument("--batch", type=harness.positive_int, default=16)
    ap.add_argument("--seq", type=harness.positive_int, default=256)
    ap.add_argument("--evals", type=harness.positive_int, default=4, help="evaluations per run")
    ap.add_argument("--eval-batches", type=harness.positive_int, default=20)
    ap.add_argument("--runs", type=harness.name_list(RUNS, "run"), default=",".join(RUNS),
                    help=f"comma list of {', '.join(RUNS)}")
    ap.add_argument("--out", default="runs/mod-quality")
    ap.add_argument("--png", default=str(ROOT / "docs" / "mod_quality.png"))
    args = ap.parse_args(argv)
    budget, fpt, steps, results = equal_flops_runs(args)
    print(f"\nequal training FLOPs ({budget:.3g}): batch {args.batch} x {args.seq} tokens, "
          f"precision {args.precision or 'auto'}")
    header = ["run", "steps", "FLOPs/token", "val loss (top-k)", "val loss (causal)", "decision accuracy (mean / worst layer)",
              "tokens/s (median)"]
    rows = []
    for n, rs in results.items():
        train = [r for r in rs if "loss" in r]
        ev = [r for r in rs if "val_loss" in r][-1]
        tok_s = sorted(r["tokens_per_s"] for r in train)[len(train) // 2]
        acc = [v for k, v in ev.items() if k.startswith("val_mod_accuracy_layer")]
        rows.append([n, steps[n], f"{fpt[n] / 1e6:.1f}M", f"{ev['val_loss']:.4f}",
                     f"{ev['val_loss_causal']:.4f}" if "val_loss_causal" in ev else "-",
                     f"{100 * ev['val_mod_accuracy']:.1f}% / {100 * min(acc):.1f}%" if acc else "-", f"{tok_s:.0f}"])
    harness.print_table(header, rows)
    mods = [n for n in results if n != "dense"]
    if mods:
        print(f"\nHow far a causal decision can agree with the top-k ({args.eval_batches} validation batches, "
              f"per MoD layer): the trained decision (logit > its threshold); the same logit with the best fixed threshold; "
              f"the router logit itself with the best fixed threshold (the ceiling of a decision that learns "
              f"the router's score exactly)")
        rows = [[n, f"layer {i}", *(f"{100 * a[k]:.1f}%" for k in ("decision", "best_threshold", "router_ceiling"))]
                for n in mods for i, a in decisions(Path(args.out) / n, args.batch, args.eval_batches).items()]
        harness.print_table(["run", "layer", "decision", "best threshold", "router ceiling"], rows)
    scaled = {n: [dict(r, step=r["step"] * fpt[n] * args.batch * args.seq / 1e12) for r in rs]
              for n, rs in results.items()}
    plot(scaled, Path(args.png), "dense vs Mixture-of-Depths at equal training FLOPs, embedded corpus",
         "training FLOPs (x 1e12)")
    print(f"\nloss curves: {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
