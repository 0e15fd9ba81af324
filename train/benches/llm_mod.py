"""Mixture-of-Depths against the dense model: training and decoding speed at the same shape.

    python train/bench.py llm-mod                    # d_model 384, 8 layers, vocab 8192, batch 4 x 512, fp32
    python train/bench.py llm-mod --capacity 0.125 --every 2 --modes eager,compile
    python train/bench.py llm-mod --decode-only --precision bf16   # the decoding table only
    python train/bench.py llm-mod --d-model 64 --n-layers 2 --vocab 512 --seq 64 --batch 2 --rounds 2 \\
        --new-tokens 16  # a smoke run

The models: Zoo's LLM with random weights, once dense and once with Mixture-of-Depths
(`model.mod_capacity` = `--capacity`, `model.mod_every` = `--every`; the paper's best is 12.5% on
every other layer), the same shape, batch and precision. Training step = forward + loss (+ the
MoD decision loss, as the LM task adds it) + backward + AdamW + zero_grad(set_to_none), eager and
under torch.compile (`--modes`), as train/benches/llm_moe.py runs it. MFU uses each model's own flops_per_token (the MoD count
reflects the capacity).

Decoding: batch 1, a random 16-token prompt, greedy, `--new-tokens` new tokens, generate() eager
and compiled. A MoD layer skips a token when its causal decision says so; with random weights
the decision logits are centred on 0 and would route about half of the tokens, which a trained
decision does not (it learns to route the top-k's share, `mod_decided` in metrics.jsonl). So,
before timing, each MoD router's bias is set so that its decision routes `--capacity` of the
tokens of a calibration batch (random tokens, run through the causal forward); the table says
the fraction each layer routed while decoding.

Timing (train/benches/harness.py): a warm-up per side (compilation included), then `--rounds`
rounds in which the sides alternate. The target figure: the paired median of dense time over
MoD time in each mode (training >= 1.5x, decoding >= 1.3x are the targets).
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

from train.benches import harness  # noqa: E402
from train.benches.llm_moe import TrainSide, time_training, zoo_step  # noqa: E402

MODES = ("eager", "compile")


def build(args, capacity: float):
    import zoo
    from zoo.config import LLMConfig
    torch.manual_seed(0)
    cfg = LLMConfig(vocab_size=args.vocab, d_model=args.d_model, n_layers=args.n_layers, n_heads=args.n_heads,
                    n_kv_heads=args.n_kv_heads, max_seq_len=max(args.seq, 16 + args.new_tokens),
                    mod_capacity=capacity, mod_every=args.every, mod_router=args.router)
    return zoo.build(cfg)


@torch.no_grad()
def calibrate(model, args):
    """Set each MoD router's bias so that its causal decision routes `capacity` of the tokens of a
    random batch, layer after layer along the causal forward. Returns the fractions reached."""
    from zoo.blocks.mod import MixtureOfDepths
    ids = torch.randint(0, args.vocab, (4, min(args.seq, 256)), generator=torch.Generator().manual_seed(7))
    x = model.embed(ids)
    cos, sin = model.rope(0, ids.shape[1], x.dtype)
    fracs = []
    for layer in model.layers:
        if isinstance(layer, MixtureOfDepths):
            if layer.predictor is not None:
                layer.predictor[-1].bias.zero_()
                d = layer.decision_logits(x, None).flatten()
                layer.predictor[-1].bias.fill_(-torch.quantile(d, 1 - layer.capacity).item())
            else:
                layer.router.bias.zero_()
                d = layer.router(x).flatten()
                layer.router.bias.fill_(-torch.quantile(d, 1 - layer.capacity).item())
            x, _, stats = layer(x, cos, sin, causal=True)
            fracs.append(stats["routed"].item())
        else:
            x, _ = layer(x, cos, sin)
    return fracs


def dense_step(fwd, ids):
    return fwd(ids[:, :-1], targets=ids[:, 1:])[1]


def table(title, rounds: harness.Rounds, per_call: int, unit: str, extra=None):
    names = list(rounds.wall)
    print(f"\n{title}")
    rows = [[n, f"{rounds.best(n):.3f}", f"{per_call / rounds.best(n):.1f}"] + (extra(n) if extra else [])
            for n in names]
    harness.print_table(["side", "best round s", f"{unit} (best round)"] + (["MFU (best round)"] if extra else []),
                        rows)
    for mode in MODES:
        if f"dense-{mode}" in names and f"mod-{mode}" in names:
            print(f"MoD over dense, {mode}: {rounds.summary(f'mod-{mode}', f'dense-{mode}')}")


def main(argv=None):
    ap = harness.parser("llm-mod", __doc__, precision="fp32", keep_memory=True)
    ap.add_argument("--d-model", type=harness.positive_int, default=384)
    ap.add_argument("--n-layers", type=harness.positive_int, default=8)
    ap.add_argument("--n-heads", type=harness.positive_int, default=6)
    ap.add_argument("--n-kv-heads", type=harness.positive_int, default=2)
    ap.add_argument("--vocab", type=harness.positive_int, default=8192)
    ap.add_argument("--seq", type=harness.positive_int, default=512)
    ap.add_argument("--batch", type=harness.positive_int, default=4)
    ap.add_argument("--capacity", type=float, default=0.125)
    ap.add_argument("--every", type=harness.positive_int, default=2)
    ap.add_argument("--router", choices=("aux_loss", "predictor"), default="aux_loss")
    ap.add_argument("--modes", type=harness.name_list(MODES, "mode"), default=",".join(MODES),
                    help="comma list of " + ", ".join(MODES))
    ap.add_argument("--warmup", type=int, default=1, help="untimed training steps per side (+2 when compiled)")
    ap.add_argument("--steps", type=harness.positive_int, default=1, help="timed training steps per side and round")
    ap.add_argument("--new-tokens", type=int, default=128, help="new tokens per decoding call (0: no decoding table)")
    ap.add_argument("--decode-only", action="store_true", help="the decoding table only")
    args = ap.parse_args(argv)
    if not 0 < args.capacity <= 1:
        ap.error(f"--capacity must be in (0, 1], got {args.capacity}")
    kept = harness.setup(args)
    cpu = torch.device("cpu")
    dense, mod = build(args, 0.0), build(args, args.capacity)
    flops = {"dense": dense.flops_per_token(args.seq), "mod": mod.flops_per_token(args.seq)}
    print(f"llm-mod: d_model {args.d_model}, {args.n_layers} layers, {args.n_heads} heads / {args.n_kv_heads} kv, "
          f"vocab {args.vocab}; batch {args.batch} x seq {args.seq}; MoD capacity {args.capacity} every "
          f"{args.every} layer(s), router {args.router}; FLOPs/token dense {flops['dense'] / 1e6:.1f}M, MoD "
          f"{flops['mod'] / 1e6:.1f}M ({flops['dense'] / flops['mod']:.2f}x fewer); torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, freed memory {'kept' if kept else 'returned to the OS'}", flush=True)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(0))
    tokens = args.batch * args.seq
    for prec in args.precision:
        if args.decode_only:
            decode(args, dense, mod, prec)
            continue
        import copy
        sides = {f"{kind}-{mode}": TrainSide(copy.deepcopy(m), step, mode == "compile")
                 for mode in args.modes for kind, m, step in (("dense", dense, dense_step), ("mod", mod, zoo_step))}
        rounds, peak = time_training(sides, prec, ids, args, cpu)
        table(f"Training step ({args.batch} x {args.seq} tokens; forward, loss, backward, AdamW), {prec}",
              rounds, tokens, "tokens/s",
              extra=lambda n: [f"{100 * flops[n.split('-')[0]] * tokens / rounds.best(n) / peak:.1f}%"])
        del sides
        if args.new_tokens:
            decode(args, dense, mod, prec)
    return 0


def decode(args, dense, mod, prec):
    n = args.new_tokens
    fracs = calibrate(mod, args)
    print(f"  MoD routers calibrated: decisions route {', '.join(f'{f:.3f}' for f in fracs)} of the calibration tokens")
    prompt = torch.randint(0, args.vocab, (1, 16), generator=torch.Generator().manual_seed(1))
    models = {"dense": dense.eval(), "mod": mod.eval()}
    calls = {f"{k}-{mode}": (lambda m=m, c=(mode == "compile"): m.generate(prompt, n, compile=c))
             for mode in args.modes for k, m in models.items()}

    def timed(call):
        def run():
            with torch.inference_mode(), harness.autocast(prec):
                return call()
        return run
    outs = {}
    for name, call in calls.items():
        t0 = time.perf_counter()
        outs[name] = timed(call)()
        print(f"  {prec} decoding warm-up {name}: {time.perf_counter() - t0:.1f} s", flush=True)
    with torch.inference_mode():  # the fraction of the generated tokens each MoD layer processed
        _, aux = mod(outs[next(k for k in outs if k.startswith("mod"))], return_aux=True, mod_causal=True)
    routed = ", ".join(f"{f:.3f}" for f in aux["mod_routed"].tolist())
    rounds = harness.run_rounds({k: timed(c) for k, c in calls.items()}, args.rounds)
    table(f"Decoding (batch 1, 16-token prompt, {n} new tokens, greedy), {prec}; MoD layers routed {routed} "
          f"of the tokens", rounds, n, "tokens/s")


if __name__ == "__main__":
    sys.exit(main())
