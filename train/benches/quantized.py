"""Quantized LLM inference on this machine: generation speed and validation loss of int8 / int4
weight-only and 8da4w (zoo.quantize, torchao) against the bf16 model.

    python train/bench.py quantized                  # both parts, the tables, runs/bench-quantized/quantized.json
    python train/bench.py quantized --docs           # also docs/deploy/quantized.json and the tables in docs/deploy.md
    python train/bench.py quantized --render         # only re-render docs/deploy.md's tables from the JSON
    python train/bench.py quantized --parts speed --rounds 8 --threads 2

Speed: the SmolLM-135M shape (configs/llm/smollm-135m.yaml: 30 layers, d_model 576, GQA 9/3 heads,
vocab 49152, tied embeddings) with random weights (speed does not depend on the values), cast to
--precision (bf16 by default: "bf16" below), and one quantized copy per scheme (group size --group-size; the embedding and the LM head
stay bf16). Batch 1, a random prompt of --prompt tokens, --new-tokens greedy tokens with
LLM.generate (eager; --compile adds each side's compiled decoding step, generate(compile=True)).
One warm-up call per side, then the sides alternate for --rounds rounds (train/benches/harness.py):
tokens/s of each side's best round, and the median of the paired per-round ratios against bf16
with their range, on the wall clock. Also each model's weight bytes (torchao's
get_model_size_in_bytes) and whether its tokens equal bf16's.

Quality: a trained model, by default the embedded default (configs/llm/tiny.yaml, its 400 steps
on the Python standard library, trained once into --out/tiny by train/run.py and reused; with
--train-overrides that run changed, e.g. shorter), or any LLM run folder given with --trained. Its validation windows (--eval-batches batches of the run's
batch size, the loop's own val_batches) are scored by the fp32 model, the bf16 model and each
quantized copy; the change against bf16 is the mean over the batches of the per-batch
difference with its 95% Student-t interval (the same windows on both sides, so the batches
pair): how much the quantization moves the loss on this model and data, not a seed variance.
"""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

from train.benches import harness  # noqa: E402

SCHEMES = ("int8wo", "int4wo", "8da4w")
PAGE = ROOT / "docs" / "deploy.md"
DOCS_JSON = ROOT / "docs" / "deploy" / "quantized.json"
QUALITY_OUT = "runs/bench-quantized"


def built_model(config, dtype: torch.dtype, seed: int = 0):
    import zoo
    from zoo.weights.zoo_folder import cast_weights
    torch.manual_seed(seed)
    return cast_weights(zoo.build(config), dtype).eval()


def quantized_sides(model, schemes, group_size: int, name: str) -> dict:
    """{name: model, scheme: a quantized copy, ...}."""
    import zoo
    return {name: model, **{s: zoo.quantize(copy.deepcopy(model), s, group_size) for s in schemes}}


def weight_bytes(model) -> int:
    from torchao.utils import get_model_size_in_bytes
    return int(get_model_size_in_bytes(model, ignore_embeddings=False))


def bench_speed(args) -> dict:
    base = args.precision
    models = quantized_sides(built_model(ROOT / "configs" / "llm" / "smollm-135m.yaml", harness.PRECISIONS[base]),
                             args.schemes, args.group_size, base)
    vocab = models[base].config.vocab_size
    prompt = torch.randint(0, vocab, (1, args.prompt), generator=torch.Generator().manual_seed(1))
    n = args.new_tokens
    calls = {s: (lambda m=m: m.generate(prompt, n)) for s, m in models.items()}
    if args.compile:
        calls.update({f"{s} compiled": (lambda m=m: m.generate(prompt, n, compile=True)) for s, m in models.items()})
    first, outs = {}, {}

    def keeping(name):
        def call():
            outs[name] = calls[name]()
        return call

    with torch.inference_mode():
        for s, fn in calls.items():
            t0 = time.perf_counter()
            fn()
            first[s] = time.perf_counter() - t0
            print(f"  warm-up {s}: {first[s]:.1f} s", flush=True)
        rounds = harness.run_rounds({s: keeping(s) for s in calls}, args.rounds)
    rows = []
    for s in calls:
        ref = f"{base} compiled" if s.endswith("compiled") else base
        p = rounds.paired(s, ref)
        rows.append({"side": s, "tok_s": n / rounds.best(s), "tok_s_cpu": n / rounds.best(s, "cpu"),
                     "paired": [p.median, p.low, p.high], "first_s": first[s],
                     "weights_mib": weight_bytes(models[s.removesuffix(" compiled")]) / 2**20,
                     "same_tokens": bool(torch.equal(outs[s], outs[ref]))})
    return {"shape": "configs/llm/smollm-135m.yaml", "params": sum(p.numel() for p in models[base].parameters()),
            "precision": base,
            "batch": 1, "prompt": args.prompt, "new_tokens": n, "rounds": args.rounds, "group_size": args.group_size,
            "threads": torch.get_num_threads(), "rows": rows}


def trained_folder(trained=None, out=QUALITY_OUT, overrides=()) -> Path:
    """`trained` (--trained), or the embedded default (with `overrides`, key=value strings for
    train/run.py) trained once into out/tiny[-<hash of the overrides>]."""
    if trained:
        return Path(trained)
    import hashlib
    tag = "-" + hashlib.sha1(" ".join(overrides).encode()).hexdigest()[:8] if overrides else ""
    out = Path(out) / f"tiny{tag}"
    if (out / "model.safetensors").is_file():
        print(f"trained model: {out} (from an earlier run; delete it to train again)", flush=True)
        return out
    cmd = [sys.executable, str(ROOT / "train" / "run.py"), str(ROOT / "configs" / "llm" / "tiny.yaml"),
           f"train.out_dir={out}", "train.samples=false", "train.plot=false", "train.progress=false",
           "train.export=false", *overrides]
    print("trained model: " + " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)
    return out


def batch_losses(model, batches) -> list[float]:
    with torch.inference_mode():
        return [model(x, y)[1].item() for x, y in batches]


def bench_quality(args) -> dict:
    import zoo
    from train.config import load_run_config
    from train.tasks.lm import LMTask
    folder = trained_folder(args.trained, args.out, args.train_overrides.split())
    cfg = load_run_config(str(folder / "config.yaml"))
    task = LMTask(cfg, torch.device("cpu"), lambda m: None)
    task.setup()
    batches = list(task.data.val_batches(cfg.train.batch_size, args.eval_batches))
    fp32 = zoo.from_pretrained(folder, dtype=torch.float32)
    base = args.precision
    models = {"fp32": fp32, **quantized_sides(zoo.from_pretrained(folder, dtype=harness.PRECISIONS[base]),
                                              args.schemes, args.group_size, base)}
    losses = {s: batch_losses(m, batches) for s, m in models.items()}
    rows = []
    for s, v in losses.items():
        d = [a - b for a, b in zip(v, losses[base])]
        mean, half = harness.mean_interval(d)
        rows.append({"side": s, "val_loss": sum(v) / len(v), "delta": mean, "delta_half": half,
                     "verdict": "" if s == base else harness.verdict(mean, half)})
    tokens = sum(y.numel() for _, y in batches)
    return {"trained": str(folder), "config": cfg.source, "precision": base, "eval_batches": len(batches), "tokens": tokens,
            "group_size": args.group_size, "rows": rows}


# ---------------------------------------------------------------- tables
def speed_table(s: dict) -> str:
    base = s.get("precision", "bf16")
    return harness.table_text(
        ["model", "weights MiB", "tokens/s (best round)", "tokens per CPU-second (best round)",
         f"against {base}: paired median (range)", f"same tokens as {base}"],
        [[r["side"], f"{r['weights_mib']:.0f}", f"{r['tok_s']:.3g}", f"{r['tok_s_cpu']:.3g}",
          f"{r['paired'][0]:.2f}x ({r['paired'][1]:.2f}-{r['paired'][2]:.2f}x)", "yes" if r["same_tokens"] else "no"]
         for r in s["rows"]])


def quality_table(q: dict) -> str:
    base = q.get("precision", "bf16")
    return harness.table_text(
        ["model", "val loss", f"change against {base} (95% interval)", "verdict"],
        [[r["side"], f"{r['val_loss']:.4f}",
          "" if r["side"] == base else f"{r['delta']:+.4f} (±{r['delta_half']:.4f})", r["verdict"]]
         for r in q["rows"]])


def render(data: dict, page: Path = PAGE, write: bool = True) -> list[str]:
    """Rewrite the tables of docs/deploy.md from the JSON; returns the names that differed."""
    tables = {"quantized-speed": speed_table(data["speed"]) if "speed" in data else None,
              "quantized-quality": quality_table(data["quality"]) if "quality" in data else None}
    return [n for n, t in tables.items() if t is not None and harness.update_docs_table(page, n, t, write)]


def main(argv=None):
    p = harness.parser("quantized", __doc__, precision=None)
    p.add_argument("--precision", type=harness.precision_name, default="bf16",
                   help="the dtype of the unquantized model and of each copy's unquantized parts (default bf16)")
    p.add_argument("--parts", type=harness.name_list(("speed", "quality"), "part"), default="speed,quality")
    p.add_argument("--schemes", type=harness.name_list(SCHEMES, "scheme"), default=",".join(SCHEMES))
    p.add_argument("--group-size", type=harness.positive_int, default=32)
    p.add_argument("--prompt", type=harness.positive_int, default=16)
    p.add_argument("--new-tokens", type=harness.positive_int, default=128)
    p.add_argument("--compile", action="store_true", help="also each side's compiled decoding step")
    p.add_argument("--trained", default=None, help="an LLM run folder (default: the embedded default, trained once)")
    p.add_argument("--train-overrides", default="", help="key=value overrides (space-separated) of the embedded "
                                                          "default's training run, e.g. 'train.max_steps=100'")
    p.add_argument("--eval-batches", type=harness.positive_int, default=40)
    p.add_argument("--out", default=QUALITY_OUT)
    p.add_argument("--docs", action="store_true", help=f"write {DOCS_JSON.relative_to(ROOT)} and the tables of "
                                                       f"{PAGE.relative_to(ROOT)}")
    p.add_argument("--render", action="store_true", help="only re-render the docs tables from the JSON")
    args = p.parse_args(argv)
    if args.render:
        return harness.render_docs(DOCS_JSON, render)
    harness.setup(args)
    from train.benches.report import hardware
    data = {"hardware": hardware(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "load_average_at_start": os.getloadavg()[0]}
    if "speed" in args.parts:
        print(f"speed: {args.new_tokens} new tokens, batch 1, {args.rounds} alternating rounds", flush=True)
        data["speed"] = bench_speed(args)
        print(speed_table(data["speed"]))
    if "quality" in args.parts:
        data["quality"] = bench_quality(args)
        q = data["quality"]
        print(f"quality: {q['trained']}, {q['eval_batches']} validation batches ({q['tokens']} tokens)")
        print(quality_table(q))
    if args.docs and DOCS_JSON.is_file():  # a part not run now keeps its earlier numbers in the docs
        old = json.loads(DOCS_JSON.read_text())
        data.update({k: old[k] for k in ("speed", "quality") if k in old and k not in data})
    harness.write_results(data, Path(args.out) / "quantized.json", DOCS_JSON if args.docs else None, render)
    return 0


if __name__ == "__main__":
    sys.exit(main())
