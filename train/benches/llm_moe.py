"""MoE LLM training and decoding: Zoo's MoE against transformers' MixtralForCausalLM on the same weights.

    python train/bench.py llm-moe                     # d_model 384, 8 layers, 8 experts of 1024, top-2,
                                                      # vocab 32000, batch 4 x 512 tokens, bf16
    python train/bench.py llm-moe --precision fp32,bf16 --sides zoo-compile,tf-grouped_mm-compile
    python train/bench.py llm-moe --d-model 64 --n-layers 2 --vocab 512 --seq 64 --batch 2 --rounds 2  # a smoke run

The model: a Mixtral shape (every layer sparse, softmax top-k with renormalised weights, GQA,
untied embeddings), random weights built by Zoo and saved as a Hugging Face folder that both
sides load, so they hold the same weights. Training step = forward + loss + backward + AdamW
(fused where the device supports it) + zero_grad(set_to_none), bf16 autocast over fp32 master
weights (as train/loop.py runs `train.precision: bf16`), the same batch. Both sides add the
Switch load-balancing loss with the same coefficient: Zoo through `forward(..., return_aux=True)`
(as the LM task does), transformers through output_router_logits=True (`--no-aux`: neither).

Sides (`--sides`, all by default), each at its best by trying its options:
  zoo-eager, zoo-compile                          Zoo's MoE (grouped_mm dispatch), eager / torch.compile
  tf-eager-eager, tf-eager-compile                transformers, experts_implementation="eager" (a loop over
                                                  the experts that received tokens), eager / torch.compile
  tf-grouped_mm-eager, tf-grouped_mm-compile      transformers, experts_implementation="grouped_mm"
Timing (train/benches/harness.py): warm-up steps per side (compilation included), then
`--rounds` rounds in which every side runs `--steps` steps, the order of the sides reversed
every other round. Per side: the best round and the median round, tokens/s of the best round,
MFU (the active parameters' FLOPs per token, the same count for both sides, over the loop's
peak-FLOPs measurement, the best of several taken between rounds). The target figure: per
round, the paired ratio of the best transformers side's time to the best Zoo side's time (each
library's best side chosen by its median round), and its median over the rounds with the range.

Decoding (`--decode-tokens`, 0 to skip; `--decode-only` skips training): batch 1, a random prompt
of 16 tokens, greedy, the weights held in the precision (bf16 weights for bf16, as llm-generate
decodes), the same four-plus-two kinds of sides: Zoo's generate(ids, n) and generate(ids, n, compile=True);
transformers' generate(do_sample=False) per experts implementation, eager and with its own
compiled recipe (forward = torch.compile(forward), cache_implementation="static").
"""
from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

from train.benches import harness  # noqa: E402

TRAIN_SIDES = ("zoo-eager", "zoo-compile", "tf-eager-eager", "tf-eager-compile", "tf-grouped_mm-eager",
               "tf-grouped_mm-compile")


def build(args, folder: Path):
    """Zoo's model with random weights, saved to `folder` as a MixtralForCausalLM checkpoint."""
    import zoo
    from zoo.config import LLMConfig, MoEConfig
    torch.manual_seed(0)
    cfg = LLMConfig(vocab_size=args.vocab, d_model=args.d_model, n_layers=args.n_layers, n_heads=args.n_heads,
                    n_kv_heads=args.n_kv_heads, ffn_hidden=args.expert_hidden, max_seq_len=max(args.seq, 64),
                    tie_embeddings=False, rope_theta=1e6,
                    moe=MoEConfig(n_experts=args.experts, top_k=args.top_k, balance="aux_loss",
                                  aux_loss_coef=args.aux_coef, z_loss_coef=0.0))
    model = zoo.build(cfg)
    zoo.save_pretrained(model, folder)
    return model


def hf_model(folder: Path, experts: str, aux: bool, dtype=torch.float32):
    import transformers
    m = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa",
                                                          experts_implementation=experts)
    m.config.output_router_logits = aux
    m.generation_config.eos_token_id = None
    return m


class TrainSide:
    def __init__(self, model, step_fn, compile_: bool):
        from train.config import OptimConfig
        from train.optim import build_optimizer
        self.model, self.step_fn = model.train(), step_fn
        self.fwd = torch.compile(model) if compile_ else model
        self.opt = build_optimizer(model, OptimConfig(), torch.device("cpu"), log=lambda *a: None)

    def step(self, precision, ids):
        with harness.autocast(precision):
            loss = self.step_fn(self.fwd, ids)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.detach()


def zoo_step(fwd, ids):
    _, loss, extra = fwd(ids[:, :-1], targets=ids[:, 1:], return_aux=True)
    return loss + extra["aux_loss"]  # the LM task's objective


def tf_step(fwd, ids):  # transformers shifts the labels itself and adds router_aux_loss_coef * aux
    return fwd(input_ids=ids[:, :-1], labels=ids[:, :-1]).loss


def train_sides(args, folder, names) -> dict:
    import zoo
    aux = not args.no_aux
    sides = {}
    for name in names:
        kind, _, rest = name.partition("-")
        if kind == "zoo":
            model = zoo.from_pretrained(folder, dtype=torch.float32)
            model.config.moe.balance = "aux_loss" if aux else "none"
            sides[name] = TrainSide(model, zoo_step, rest == "compile")
        else:
            experts, _, mode = rest.rpartition("-")
            sides[name] = TrainSide(hf_model(folder, experts, aux), tf_step, mode == "compile")
    return sides


def time_training(sides: dict, prec: str, ids, args, device) -> tuple:
    """Warm up each TrainSide (args.warmup steps, 2 more when compiled), then time them in
    alternating rounds (args.rounds of args.steps steps). -> (Rounds, the best peak FLOP/s
    measured between rounds)."""
    peak = harness.best_peak_flops(device, prec)
    for n, s in sides.items():
        t0 = time.perf_counter()
        for _ in range(args.warmup + (2 if n.endswith("compile") else 0)):
            loss = float(s.step(prec, ids))
        print(f"  {prec} warm-up {n}: {time.perf_counter() - t0:.1f} s, loss {loss:.3f}", flush=True)

    def between(r):
        nonlocal peak
        peak = harness.best_peak_flops(device, prec, peak)
    rounds = harness.run_rounds({n: (lambda s=s: float(s.step(prec, ids))) for n, s in sides.items()},
                                args.rounds, calls=args.steps, between=between)
    return rounds, peak


def report(title, rounds: harness.Rounds, per_call: int, unit: str, extra=None):
    """The table of one comparison, and the paired median of the best Zoo and transformers sides."""
    names = list(rounds.wall)
    med = {n: statistics.median(rounds.times(n)) for n in names}
    zoo_names = [n for n in names if n.startswith("zoo")]
    tf_names = [n for n in names if n.startswith("tf")]
    best_tf = min((med[n] for n in tf_names), default=None)
    print(f"\n{title}")
    header = ["side", "best round s", "median round s", f"{unit} (best round)", "vs best transformers (medians)"]
    rows = [[n, f"{rounds.best(n):.3f}", f"{med[n]:.3f}", f"{per_call / rounds.best(n):.1f}",
             f"{best_tf / med[n]:.2f}x" if best_tf else "-"] + (extra(n) if extra else []) for n in names]
    harness.print_table(header + (["MFU (best round)"] if extra else []), rows)
    if zoo_names and tf_names:
        z, h = min(zoo_names, key=med.get), min(tf_names, key=med.get)
        print(f"best Zoo over best transformers: {rounds.summary(z, h)}")


def main(argv=None):
    ap = harness.parser("llm-moe", __doc__, precision="bf16", keep_memory=True)
    ap.add_argument("--d-model", type=harness.positive_int, default=384)
    ap.add_argument("--n-layers", type=harness.positive_int, default=8)
    ap.add_argument("--n-heads", type=harness.positive_int, default=6)
    ap.add_argument("--n-kv-heads", type=harness.positive_int, default=2)
    ap.add_argument("--experts", type=harness.positive_int, default=8)
    ap.add_argument("--top-k", type=harness.positive_int, default=2)
    ap.add_argument("--expert-hidden", type=harness.positive_int, default=1024)
    ap.add_argument("--vocab", type=harness.positive_int, default=32000)
    ap.add_argument("--seq", type=harness.positive_int, default=512)
    ap.add_argument("--batch", type=harness.positive_int, default=4)
    ap.add_argument("--aux-coef", type=float, default=0.02, help="load-balancing loss coefficient (Mixtral's)")
    ap.add_argument("--no-aux", action="store_true", help="no load-balancing loss on either side")
    ap.add_argument("--sides", type=harness.name_list(TRAIN_SIDES, "side"), default=",".join(TRAIN_SIDES),
                    help="comma list of " + ", ".join(TRAIN_SIDES))
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps per side (+2 when compiled)")
    ap.add_argument("--steps", type=harness.positive_int, default=1, help="timed steps per side and round")
    ap.add_argument("--decode-tokens", type=int, default=64, help="new tokens per decoding call (0: no decoding table)")
    ap.add_argument("--decode-only", action="store_true", help="the decoding table only")
    args = ap.parse_args(argv)
    kept = harness.setup(args)
    cpu = torch.device("cpu")

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "mixtral"
        model = build(args, folder)
        n_all, n_active = model.num_params(), model.num_params(active=True)
        flops_tok = model.flops_per_token(args.seq)
        del model
        print(f"llm-moe: Mixtral shape, {n_all / 1e6:.1f}M parameters ({n_active / 1e6:.1f}M active): d_model "
              f"{args.d_model}, {args.n_layers} layers, {args.n_heads} heads / {args.n_kv_heads} kv, {args.experts} "
              f"experts of {args.expert_hidden}, top-{args.top_k}, vocab {args.vocab}; batch {args.batch} x seq "
              f"{args.seq}; aux loss {'off' if args.no_aux else args.aux_coef}; torch {torch.__version__}, "
              f"{torch.get_num_threads()} threads, freed memory {'kept' if kept else 'returned to the OS'}", flush=True)
        ids = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(0))
        tokens = args.batch * args.seq
        for prec in args.precision:
            if args.decode_only:
                decode(args, folder, prec)
                continue
            sides = train_sides(args, folder, args.sides)
            rounds, peak = time_training(sides, prec, ids, args, cpu)
            report(f"Training step ({args.batch} x {args.seq} tokens; forward, loss, backward, AdamW), {prec}",
                   rounds, tokens, "tokens/s",
                   extra=lambda n: [f"{100 * flops_tok * tokens / rounds.best(n) / peak:.1f}%"])
            del sides
            if args.decode_tokens:
                decode(args, folder, prec)
    return 0


def decode(args, folder, prec):
    import zoo
    n = args.decode_tokens
    prompt = torch.randint(0, args.vocab, (1, 16), generator=torch.Generator().manual_seed(1))
    dt = harness.PRECISIONS[prec]  # decoding holds the weights in the precision (no autocast), as llm-generate
    z = zoo.from_pretrained(folder, dtype=dt).eval()
    calls = {}
    if any(s.startswith("zoo") for s in args.sides):
        calls["zoo-eager"] = lambda: z.generate(prompt, n)
        calls["zoo-compile"] = lambda: z.generate(prompt, n, compile=True)
    for e in sorted({s.split("-")[1] for s in args.sides if s.startswith("tf")}):
        hf = hf_model(folder, e, aux=False, dtype=dt).eval()
        hfc = hf_model(folder, e, aux=False, dtype=dt).eval()
        hfc.forward = torch.compile(hfc.forward)  # transformers' recipe: static cache + compile
        calls[f"tf-{e}-eager"] = lambda hf=hf: hf.generate(prompt, max_new_tokens=n, do_sample=False, pad_token_id=0)
        calls[f"tf-{e}-compile"] = lambda hf=hfc: hf.generate(prompt, max_new_tokens=n, do_sample=False,
                                                               pad_token_id=0, cache_implementation="static")
    outs = {}

    def timed(call):
        def run():
            with torch.inference_mode():
                return call()
        return run
    for name, call in calls.items():
        t0 = time.perf_counter()
        outs[name] = timed(call)()
        print(f"  {prec} decoding warm-up {name}: {time.perf_counter() - t0:.1f} s", flush=True)
    rounds = harness.run_rounds({k: timed(c) for k, c in calls.items()}, args.rounds)
    report(f"Decoding (batch 1, 16-token prompt, {n} new tokens, greedy), {prec}", rounds, n, "tokens/s")
    ref_name = next((k for k in outs if k.startswith("tf")), None)
    if ref_name is not None:
        print(f"same tokens as {ref_name}: "
              + ", ".join(f"{k} {'yes' if torch.equal(o, outs[ref_name]) else 'no'}" for k, o in outs.items()))


if __name__ == "__main__":
    sys.exit(main())
