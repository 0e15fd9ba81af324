"""muP's coordinate check (Yang et al., "Tensor Programs V", 2022), as Microsoft's mup package runs it: LLMs of
growing width train a few AdamW steps at one LR, then the mean |x| of each layer's output is read on a held-out
batch. Under muP (`model.mup_base_width`: the first width) the scales stay put as the width grows; under the
standard parametrization they grow. And the LR transfer it promises: every width trains on equal tokens at each LR
of a factor-2 grid over seeds, and the best LR by held-out loss is compared across widths, muP beside standard.

    python train/bench.py mup-coord [--widths 64,128,256,512,1024] [--steps 4] [--lr 0.01]
    python train/bench.py mup-transfer [--widths 64,128,256,512] [--log2-lrs=-12,...,-5] [--steps 256] [--batch 8]

Every width has `--layers` blocks of `--heads` heads (the head size grows with the width) and trains on the same
batches of the stdlib's sources as bytes.
"""
from __future__ import annotations

import torch

from train.benches import harness
from train.config import OptimConfig
from train.plots import line_panels

WIDTHS = (64, 128, 256, 512, 1024)


def stdlib_batches(n: int, batch: int, seq: int, seed: int = 0, files: slice = slice(40)) -> list[torch.Tensor]:
    """n batches (batch, seq + 1) of byte ids, windows drawn at random from those of the stdlib's sources."""
    from train.data import stdlib_files
    data = torch.frombuffer(bytearray(b"".join(f.read_bytes() for f in stdlib_files()[files])), dtype=torch.uint8)
    starts = torch.randint(len(data) - seq - 1, (n, batch), generator=torch.Generator().manual_seed(seed))
    return [torch.stack([data[s:s + seq + 1] for s in row.tolist()]).long() for row in starts]


def layer_scales(model, ids: torch.Tensor) -> dict[str, float]:
    """The mean |x| of the outputs of the embedding, each block's attention, MLP and whole block, and the logits, in a
    forward of ids (B, T)."""
    modules = {"embed": model.embed}
    for i, b in enumerate(model.blocks()):
        modules.update({f"attn.{i}": b.attn, f"mlp.{i}": b.mlp, f"block.{i}": b})
    modules["logits"] = model.lm_head
    out = {}

    def hook(name):
        return lambda m, args, y: out.__setitem__(name, (y[0] if isinstance(y, tuple) else y).abs().mean().item())
    handles = [m.register_forward_hook(hook(n)) for n, m in modules.items()]
    with torch.no_grad():
        model(ids)
    for h in handles:
        h.remove()
    return {n: out[n] for n in modules}


def tiny_llm(width: int, base, layers: int, heads: int, seq: int, seed: int):
    """A byte-level LLM of that width (muP against `base`, None: the standard parametrization), seeded."""
    from zoo.config import LLMConfig
    from zoo.llm import LLM
    torch.manual_seed(seed)
    return LLM(LLMConfig(vocab_size=256, d_model=width, n_layers=layers, n_heads=heads, max_seq_len=seq,
                         mup_base_width=base))


def train_steps(model, batches: list[torch.Tensor], cfg, precision: str):
    """One optimizer step per batch, the optimizer as train/optim builds it from cfg, the LR on cfg's schedule."""
    from train.optim import build_optimizer, lr_multiplier, set_lr
    opt = build_optimizer(model, cfg, torch.device("cpu"), log=lambda m: None)
    for step, b in enumerate(batches):
        set_lr(opt, cfg.lr * lr_multiplier(step, len(batches), cfg))
        with harness.autocast(precision):
            loss = model(b[:, :-1], b[:, 1:])[1]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model


def coord_check(widths=WIDTHS, mup: bool = True, steps: int = 4, lr: float = 1e-2, layers: int = 2, heads: int = 4,
                batch: int = 8, seq: int = 64, seed: int = 0, precision: str = "fp32") -> dict[int, dict[str, float]]:
    """{width: {layer: mean |x|}} after `steps` AdamW steps at `lr` (constant, no weight decay) of a byte-level LLM
    of each width; mup: muP against widths[0], else the standard parametrization."""
    data, out = stdlib_batches(steps + 1, batch, seq, seed), {}
    cfg = OptimConfig(lr=lr, weight_decay=0.0, schedule="constant", warmup_steps=0)
    for width in widths:
        model = train_steps(tiny_llm(width, widths[0] if mup else None, layers, heads, seq, seed), data[:steps], cfg,
                            precision)
        with harness.autocast(precision):
            out[width] = layer_scales(model, data[-1][:, :-1])
    return out


def growth(scales: dict[int, dict[str, float]]) -> dict[str, float]:
    """Each layer's mean |x| at the largest width over that at the smallest."""
    lo, hi = scales[min(scales)], scales[max(scales)]
    return {n: hi[n] / lo[n] for n in lo}


def lr_transfer(widths, log2_lrs, seeds, steps: int, batch: int, seq: int, layers: int, heads: int, precision: str,
                evals: int = 8, say=print, seed_done=lambda out: None) -> dict:
    """{side: {width: {log2 lr: [held-out loss per seed]}}} for the standard parametrization and muP (against
    widths[0]): every width trains `steps` steps of batch x seq tokens of the first stdlib sources at each peak LR
    2^k with AdamW as the loop's defaults set it (warmup, cosine decay, weight decay), then reads its mean loss on
    `evals` batches of later sources it never saw. seed_done(out) is called as each seed ends."""
    held = stdlib_batches(evals, batch, seq, files=slice(40, None))
    out = {side: {w: {k: [] for k in log2_lrs} for w in widths} for side in ("standard", "muP")}
    for seed in seeds:  # seeds outermost: a sweep cut short still covers every width
        data = stdlib_batches(steps, batch, seq, seed)
        for side, width, k in ((s, w, k) for s in out for w in widths for k in log2_lrs):
            model = train_steps(tiny_llm(width, widths[0] if side == "muP" else None, layers, heads, seq, seed), data,
                                OptimConfig(lr=2.0 ** k), precision)
            with torch.no_grad(), harness.autocast(precision):
                loss = sum(model(b[:, :-1], b[:, 1:])[1].item() for b in held) / len(held)
            out[side][width][k].append(loss)
            say(f"  seed {seed} {side} width {width} lr 2^{k}: held-out loss {loss:.4f}")
        seed_done(out)
    return out


def best_lr(losses: dict) -> int:
    """The log2 LR of the lowest seed-mean loss (a diverged one counts as infinite)."""
    mean = {k: sum(v) / len(v) for k, v in losses.items()}
    return min(mean, key=lambda k: mean[k] if mean[k] == mean[k] else float("inf"))


def transfer_tables(result: dict, log2_lrs: list[int], note: str) -> tuple[dict, dict]:
    """The tables (per side the loss at every LR, and the best LR's shift) and each side's best log2 LR per width."""
    best = {side: {w: best_lr(r) for w, r in by_width.items()} for side, by_width in result.items()}
    edge = (min(log2_lrs), max(log2_lrs))
    tables = {side: harness.table(
        ["width", *(f"lr 2^{k}" for k in log2_lrs), "best lr"],
        [[w, *(harness.interval_text(r[k], ".4f") for k in log2_lrs),
          f"2^{best[side][w]}" + (" (grid edge)" if best[side][w] in edge else "")] for w, r in by_width.items()],
        f"{side}: held-out loss (mean ± 95% interval over seeds) {note}") for side, by_width in result.items()}
    tables["shift"] = harness.table(
        ["parametrization", *(f"best lr, width {w}" for w in best["muP"]), "shift first to last width (grid steps)",
         "spread (grid steps)"],
        [[side, *(f"2^{k}" for k in b.values()), f"{list(b.values())[-1] - list(b.values())[0]:+d}",
          max(b.values()) - min(b.values())] for side, b in best.items()],
        "the best LR (lowest seed-mean held-out loss) on the factor-2 grid; spread: largest minus smallest best LR")
    return tables, best


def save_transfer(args, result: dict):
    """The tables, plot and result JSON of the seeds `result` holds (a sweep cut short keeps its finished seeds)."""
    seeds = args.seeds[:len(result["muP"][args.widths[0]][args.log2_lrs[0]])]
    kw = {k: getattr(args, k) for k in ("steps", "batch", "seq", "layers", "heads", "precision")}
    note = (f"after {args.steps} steps of {args.batch} x {args.seq} bytes ({args.steps * args.batch * args.seq} tokens "
            f"at every width), {args.layers} layers of {args.heads} heads, seeds {seeds}")
    tables, best = transfer_tables(result, args.log2_lrs, note)
    line_panels({side: {f"width {w}": [(k, sum(v) / len(v)) for k, v in r.items()] for w, r in by_width.items()}
                 for side, by_width in result.items()}, args.json.with_suffix(".png"), "log2 peak LR", "held-out loss")
    harness.save(args, tables, {"loss": result, "best_log2_lr": best, "log2_lrs": args.log2_lrs,
                                "widths": args.widths, "seeds": seeds, **kw})


def transfer_main(argv, name: str):
    p = harness.parser(name, __doc__, precision="fp32", rounds=False, one_precision=True, seeds=1)
    p.add_argument("--widths", type=harness.int_list, default=list(WIDTHS[:4]), help="d_model of each model, "
                   "smallest first (muP's base width)")
    p.add_argument("--log2-lrs", type=harness.int_list, default=list(range(-12, -4)), help="the LR grid's exponents")
    harness.counts(p, steps=256, batch=8, seq=64, layers=2, heads=4)
    args = p.setup(argv)
    lr_transfer(args.widths, args.log2_lrs, args.seeds, args.steps, args.batch, args.seq, args.layers, args.heads,
                args.precision, seed_done=lambda result: save_transfer(args, result))


def main(argv=None, name: str = "mup-coord"):
    if name == "mup-transfer":
        return transfer_main(argv, name)
    p = harness.parser(name, __doc__, precision="fp32", rounds=False, one_precision=True)
    p.add_argument("--widths", type=harness.int_list, default=list(WIDTHS), help="d_model of each model, smallest first")
    p.add_argument("--steps", type=harness.positive_int, default=4, help="AdamW steps before the activations are read")
    p.add_argument("--lr", type=float, default=1e-2, help="the LR of every width (the base width's under muP)")
    harness.counts(p, layers=2, heads=4)
    args = p.setup(argv)
    kw = dict(steps=args.steps, lr=args.lr, layers=args.layers, heads=args.heads, precision=args.precision)
    scales, tables = {side: coord_check(args.widths, side == "muP", **kw) for side in ("standard", "muP")}, {}
    for side, s in scales.items():
        g = growth(s)
        rows = [[n, *(f"{s[w][n]:.4g}" for w in args.widths), f"{g[n]:.2f}x"] for n in g]
        tables[side] = harness.table(["layer", *(f"width {w}" for w in args.widths), f"{args.widths[-1]} / "
                                      f"{args.widths[0]}"], rows,
                                     f"{side}: mean |x| of each layer's output after {args.steps} AdamW steps at lr "
                                     f"{args.lr:g}, {args.layers} layers of {args.heads} heads"
                                     + (f", muP against width {args.widths[0]}" if side == "muP" else ""))
    harness.save(args, tables, {"scales": scales, "growth": {k: growth(v) for k, v in scales.items()}, **kw})
