"""muP's coordinate check (Yang et al., "Tensor Programs V", 2022), as Microsoft's mup package runs it: LLMs of
growing width train a few AdamW steps at one LR, then the mean |x| of each layer's output is read on a held-out
batch. Under muP (`model.mup_base_width`: the first width) the scales stay put as the width grows; under the
standard parametrization they grow.

    python train/bench.py mup-coord [--widths 64,128,256,512,1024] [--steps 4] [--lr 0.01]

Every width has `--layers` blocks of `--heads` heads (the head size grows with the width) and trains on the same
batches of the stdlib's sources as bytes.
"""
from __future__ import annotations

import torch

from train.benches import harness

WIDTHS = (64, 128, 256, 512, 1024)


def stdlib_batches(n: int, batch: int, seq: int, seed: int = 0) -> list[torch.Tensor]:
    """n batches (batch, seq + 1) of byte ids, windows drawn at random from the stdlib's sources."""
    from train.data import stdlib_files
    data = torch.frombuffer(bytearray(b"".join(f.read_bytes() for f in stdlib_files()[:40])), dtype=torch.uint8)
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


def coord_check(widths=WIDTHS, mup: bool = True, steps: int = 4, lr: float = 1e-2, layers: int = 2, heads: int = 4,
                batch: int = 8, seq: int = 64, seed: int = 0, precision: str = "fp32") -> dict[int, dict[str, float]]:
    """{width: {layer: mean |x|}} after `steps` AdamW steps at `lr` (the optimizer as train/optim builds it, no weight
    decay) of a byte-level LLM of each width; mup: muP against widths[0], else the standard parametrization."""
    from train.config import OptimConfig
    from train.optim import build_optimizer, set_lr
    from zoo.config import LLMConfig
    from zoo.llm import LLM
    data, out = stdlib_batches(steps + 1, batch, seq, seed), {}
    for width in widths:
        torch.manual_seed(seed)
        model = LLM(LLMConfig(vocab_size=256, d_model=width, n_layers=layers, n_heads=heads, max_seq_len=seq,
                              mup_base_width=widths[0] if mup else None))
        opt = build_optimizer(model, OptimConfig(lr=lr, weight_decay=0.0), torch.device("cpu"), log=lambda m: None)
        set_lr(opt, lr)
        for b in data[:steps]:
            with harness.autocast(precision):
                loss = model(b[:, :-1], b[:, 1:])[1]
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        with harness.autocast(precision):
            out[width] = layer_scales(model, data[-1][:, :-1])
    return out


def growth(scales: dict[int, dict[str, float]]) -> dict[str, float]:
    """Each layer's mean |x| at the largest width over that at the smallest."""
    lo, hi = scales[min(scales)], scales[max(scales)]
    return {n: hi[n] / lo[n] for n in lo}


def main(argv=None, name: str = "mup-coord"):
    p = harness.parser(name, __doc__, precision="fp32", rounds=False, one_precision=True)
    p.add_argument("--widths", type=harness.int_list, default=list(WIDTHS), help="d_model of each model, smallest first")
    p.add_argument("--steps", type=harness.positive_int, default=4, help="AdamW steps before the activations are read")
    p.add_argument("--lr", type=float, default=1e-2, help="the LR of every width (the base width's under muP)")
    p.add_argument("--layers", type=harness.positive_int, default=2)
    p.add_argument("--heads", type=harness.positive_int, default=4)
    args = p.parse_args(argv)
    harness.setup(args)
    kw = dict(steps=args.steps, lr=args.lr, layers=args.layers, heads=args.heads, precision=args.precision)
    scales = {side: coord_check(args.widths, side == "muP", **kw) for side in ("standard", "muP")}
    tables = {}
    for side, s in scales.items():
        g = growth(s)
        rows = [[n, *(f"{s[w][n]:.4g}" for w in args.widths), f"{g[n]:.2f}x"] for n in g]
        tables[side] = harness.table(["layer", *(f"width {w}" for w in args.widths), f"{args.widths[-1]} / "
                                      f"{args.widths[0]}"], rows,
                                     f"{side}: mean |x| of each layer's output after {args.steps} AdamW steps at lr "
                                     f"{args.lr:g}, {args.layers} layers of {args.heads} heads"
                                     + (f", muP against width {args.widths[0]}" if side == "muP" else ""))
    harness.save(args, tables, {"scales": scales, "growth": {k: growth(v) for k, v in scales.items()}, **kw})
