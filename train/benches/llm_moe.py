"""MoE LLM training and decoding: Zoo's MoE against transformers' MixtralForCausalLM on the same weights.

    python train/bench.py llm-moe                     # d_model 384, 8 layers, 8 experts of 1024, top-2,
                                                      # vocab 32000, batch 4 x 512 tokens, bf16
    python train/bench.py llm-moe --precision fp32 --rounds 8 --sides zoo-compile,tf-grouped_mm-compile
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
Timing: warm-up steps per side (compilation included), then `--rounds` rounds in which every
side runs `--steps` steps, the order of the sides reversed every other round. Per side: the
best round and the median round. The target figure: per round, the paired ratio of the best
transformers side's time to the best Zoo side's time (the best sides chosen by their median
rounds), and its median over the rounds with the range.

Decoding (`--decode-tokens`, 0 to skip): batch 1, a random prompt of 16 tokens, greedy, the
same four-plus-two kinds of sides: Zoo's generate(ids, n) and generate(ids, n, compile=True);
transformers' generate(do_sample=False) per experts implementation, eager and with its own
compiled recipe (forward = torch.compile(forward), cache_implementation="static").
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
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


def hf_model(folder: Path, experts: str, aux: bool):
    import transformers
    m = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa",
                                                          experts_implementation=experts)
    m.config.output_router_logits = aux
    m.generation_config.eos_token_id = None
    return m


class TrainSide:
    def __init__(self, name, model, step_fn, compile_: bool):
        from train.config import OptimConfig
        from train.optim import build_optimizer
        self.name, self.model, self.step_fn = name, model.train(), step_fn
        self.fwd = torch.compile(model) if compile_ else model
        self.opt = build_optimizer(model, OptimConfig(), torch.device("cpu"), log=lambda *a: None)

    def step(self, dtype, ids):
        ctx = torch.autocast("cpu", dtype=dtype) if dtype is not None else torch.autocast("cpu", enabled=False)
        with ctx:
            loss = self.step_fn(self.fwd, ids)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.detach()


def train_sides(args, folder, names):
    import zoo
    aux = not args.no_aux
    sides = {}
    for name in names:
        kind, _, rest = name.partition("-")
        if kind == "zoo":
            model = zoo.from_pretrained(folder, dtype=torch.float32)
            model.config.moe.balance = "aux_loss" if aux else "none"

            def step_fn(fwd, ids):
                _, loss, extra = fwd(ids[:, :-1], targets=ids[:, 1:], return_aux=True)
                return loss + extra["aux_loss"]  # the LM task's objective
            sides[name] = TrainSide(name, model, step_fn, rest == "compile")
        else:
            experts, _, mode = rest.rpartition("-")
            model = hf_model(folder, experts, aux)

            def step_fn(fwd, ids):  # transformers shifts the labels itself and adds router_aux_loss_coef * aux
                return fwd(input_ids=ids[:, :-1], labels=ids[:, :-1]).loss
            sides[name] = TrainSide(name, model, step_fn, mode == "compile")
    return sides


def alternate(sides: dict, run, rounds: int) -> dict:
    """Every side once a round, the order reversed every other round -> {side: [seconds per round]}."""
    times = {n: [] for n in sides}
    order = list(sides)
    for r in range(rounds):
        for n in (order if r % 2 == 0 else order[::-1]):
            t0 = time.perf_counter()
            run(n)
            times[n].append(time.perf_counter() - t0)
    return times


def paired(times: dict, zoo_names, tf_names):
    """The best side of each library by median round, and the per-round ratio tf / zoo of those two."""
    med = {n: statistics.median(t) for n, t in times.items()}
    z = min(zoo_names, key=med.get)
    h = min(tf_names, key=med.get)
    ratios = sorted(b / a for a, b in zip(times[z], times[h]))
    return z, h, statistics.median(ratios), ratios[0], ratios[-1]


def table(title, times, per_call, unit, zoo_names, tf_names):
    print(f"\n{title}")
    print(f"| side | best round | median round | {unit} (best) | vs best transformers (medians) |")
    print("|---|---|---|---|---|")
    med = {n: statistics.median(t) for n, t in times.items()}
    best_tf = min(med[n] for n in tf_names) if tf_names else None
    for n, t in times.items():
        rel = f"{best_tf / med[n]:.2f}x" if best_tf else "-"
        print(f"| {n} | {min(t):.3f} s | {med[n]:.3f} s | {per_call / min(t):.1f} | {rel} |")
    if zoo_names and tf_names:
        z, h, m, lo, hi = paired(times, zoo_names, tf_names)
        print(f"\nbest Zoo ({z}) / best transformers ({h}): paired median {m:.2f}x (range {lo:.2f}-{hi:.2f}x) "
              f"over {len(times[z])} rounds")


def main(argv=None):
    ap = argparse.ArgumentParser(prog="bench.py llm-moe", description=__doc__.split("\n")[0])
    ap.add_argument("--d-model", type=int, default=384)
    ap.add_argument("--n-layers", type=int, default=8)
    ap.add_argument("--n-heads", type=int, default=6)
    ap.add_argument("--n-kv-heads", type=int, default=2)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--expert-hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--aux-coef", type=float, default=0.02, help="load-balancing loss coefficient (Mixtral's)")
    ap.add_argument("--no-aux", action="store_true", help="no load-balancing loss on either side")
    ap.add_argument("--precision", default="bf16", choices=sorted(PRECISIONS))
    ap.add_argument("--sides", default=",".join(TRAIN_SIDES), help="comma list of " + ", ".join(TRAIN_SIDES))
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps per side (+2 when compiled)")
    ap.add_argument("--steps", type=int, default=1, help="timed steps per side and round")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--decode-tokens", type=int, default=64, help="new tokens per decoding call (0: no decoding table)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-keep-memory", action="store_true", help="leave glibc's default allocator behaviour")
    args = ap.parse_args(argv)
    names = [s.strip() for s in args.sides.split(",") if s.strip()]
    for n in names:
        if n not in TRAIN_SIDES:
            ap.error(f"--sides: unknown {n!r} (choose from {', '.join(TRAIN_SIDES)})")
    if args.threads:
        torch.set_num_threads(args.threads)
    from train.hardware import keep_freed_memory
    kept = False if args.no_keep_memory else keep_freed_memory()
    dtype = PRECISIONS[args.precision]
    zoo_names = [n for n in names if n.startswith("zoo")]
    tf_names = [n for n in names if n.startswith("tf")]

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "mixtral"
        model = build(args, folder)
        n_all, n_active = model.num_params(), model.num_params(active=True)
        del model
        print(f"llm-moe: Mixtral shape, {n_all / 1e6:.1f}M parameters ({n_active / 1e6:.1f}M active): d_model "
              f"{args.d_model}, {args.n_layers} layers, {args.n_heads} heads / {args.n_kv_heads} kv, {args.experts} "
              f"experts of {args.expert_hidden}, top-{args.top_k}, vocab {args.vocab}; batch {args.batch} x seq "
              f"{args.seq}, {args.precision}, aux loss {'off' if args.no_aux else args.aux_coef}; torch "
              f"{torch.__version__}, {torch.get_num_threads()} threads, freed memory "
              f"{'kept' if kept else 'returned to the OS'}", flush=True)

        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
        sides = train_sides(args, folder, names)
        losses = {}
        for n, s in sides.items():
            t0 = time.perf_counter()
            for _ in range(args.warmup + (2 if n.endswith("compile") else 0)):
                losses[n] = float(s.step(dtype, ids))
            print(f"  warm-up {n}: {time.perf_counter() - t0:.1f} s, loss {losses[n]:.3f}", flush=True)

        def run(n):
            for _ in range(args.steps):
                loss = sides[n].step(dtype, ids)
            float(loss)
        times = {n: [t / args.steps for t in ts] for n, ts in alternate(sides, run, args.rounds).items()}
        table(f"Training step ({args.batch} x {args.seq} tokens; forward, loss, backward, AdamW), {args.precision}",
              times, args.batch * args.seq, "tokens/s", zoo_names, tf_names)
        del sides

        if args.decode_tokens:
            decode(args, folder, dtype, zoo_names, tf_names)
    return 0


def decode(args, folder, dtype, zoo_names, tf_names):
    import zoo
    n = args.decode_tokens
    prompt = torch.randint(0, args.vocab, (1, 16), generator=torch.Generator().manual_seed(1))
    z = zoo.from_pretrained(folder, dtype=torch.float32).eval()
    calls = {}
    if zoo_names:
        calls["zoo-eager"] = lambda: z.generate(prompt, n)
        calls["zoo-compile"] = lambda: z.generate(prompt, n, compile=True)
    experts = sorted({name.split("-")[1] for name in tf_names})
    for e in experts:
        hf = hf_model(folder, e, aux=False).eval()
        hfc = hf_model(folder, e, aux=False).eval()
        hfc.forward = torch.compile(hfc.forward)  # transformers' recipe: static cache + compile
        calls[f"tf-{e}-eager"] = lambda hf=hf: hf.generate(prompt, max_new_tokens=n, do_sample=False, pad_token_id=0)
        calls[f"tf-{e}-compile"] = lambda hf=hfc: hf.generate(prompt, max_new_tokens=n, do_sample=False,
                                                               pad_token_id=0, cache_implementation="static")
    ctx = (lambda: torch.autocast("cpu", dtype=dtype)) if dtype is not None else \
        (lambda: torch.autocast("cpu", enabled=False))
    outs = {}
    with torch.inference_mode():
        for name, call in calls.items():
            t0 = time.perf_counter()
            with ctx():
                outs[name] = call()
            print(f"  decode warm-up {name}: {time.perf_counter() - t0:.1f} s", flush=True)

        def run(name):
            with ctx():
                calls[name]()
        times = alternate(calls, run, args.rounds)
    table(f"Decoding (batch 1, 16-token prompt, {n} new tokens, greedy), {args.precision}", times, n, "tokens/s",
          [c for c in calls if c.startswith("zoo")], [c for c in calls if c.startswith("tf")])
    ref = next((o for k, o in outs.items() if k.startswith("tf")), None)
    if ref is not None:
        same = {k: torch.equal(o, ref) for k, o in outs.items()}
        print("same tokens as " + next(k for k in outs if k.startswith("tf")) + ": "
              + ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in same.items()))


if __name__ == "__main__":
    sys.exit(main())
