"""Generation speed, load time and load memory: Zoo against transformers on the same checkpoint.

    python train/bench.py llm-generate                       # d_model 512, 8 layers, vocab 32000
    python train/bench.py llm-generate --precision fp32 --rounds 8 --threads 1

The checkpoint: a transformers LlamaForCausalLM with random weights (tied embeddings, GQA),
saved once as model.safetensors in a temporary folder. Both sides load that folder.

Generation: batch 1, a random prompt, greedy, `--new-tokens` new tokens (no end-of-sequence
token, so every side always produces n tokens). Four sides:
  zoo eager              LLM.generate(ids, n)
  zoo compiled           LLM.generate(ids, n, compile=True): the decoding step under torch.compile,
                         its matrix-vector products fused reductions (zoo.blocks.matvec_cpu.MatvecAsReduction)
  transformers eager     generate(ids, max_new_tokens=n, do_sample=False)
  transformers compiled  transformers' own recipe: forward = torch.compile(forward) and
                         generate(..., cache_implementation="static")
One warm-up call each (timed: for the compiled sides it includes compilation), then the sides
alternate for `--rounds` rounds (train/benches/harness.py): each side's best round, and for
eager/eager, compiled/compiled and best/best the ratio of the best rounds and the median of the
paired ratios with its range. The table also says whether each side produced the same tokens as
transformers eager (expected in fp32; in bf16 rounding differences may flip a near tie).
Two clocks: wall time, and the process's CPU time (tokens per CPU-second), which on a shared
machine with `--threads 1` leaves out the time the process waited for a core.

Load: each side's from_pretrained runs in a fresh subprocess, so that its memory is its own: a
first load, then a second one in the same process. Library imports are excluded from times and
memory on both sides, torch._dynamo included: transformers imports it with its model classes,
and torch imports it (seconds and memory: docs/pretrained.md, "Benchmark") at the first
meta-device kernel written in Python, which Zoo's meta-device build runs; a process that has
trained or compiled anything has it already.
Memory: the peak resident set size during the load (Linux VmHWM, reset through
/proc/self/clear_refs) and the RSS after one forward pass (memory-mapped weights count once
their pages are used), both above the RSS before the load. Best of `--load-rounds` processes.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

from train.benches import harness  # noqa: E402


def _status(key: str) -> int:
    """A size from /proc/self/status in bytes (VmRSS: now, VmHWM: peak)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def load_child(side: str, folder: str, precision: str) -> dict:
    """Runs in a fresh process: import, then time one from_pretrained and report memory."""
    import importlib

    import torch._dynamo  # noqa: F401  (see the module docstring)
    dt = harness.PRECISIONS[precision]
    if side == "zoo":
        import zoo
        import zoo.weights
        for name in zoo.weights.FORMATS + ["zoo.llm"]:  # imports are not part of the load
            importlib.import_module(name)
        load = lambda: zoo.from_pretrained(folder, dtype=dt)  # noqa: E731
    else:
        import transformers
        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        transformers.AutoModelForCausalLM, transformers.LlamaForCausalLM  # resolve the lazy imports
        load = lambda: transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dt)  # noqa: E731
    def one_load() -> tuple:
        gc.collect()
        base = _status("VmRSS")
        try:  # reset the peak (VmHWM) to the current RSS, so that the peak is this load's own
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:  # then the first peak may be an import-time one (a lower bound)
            pass
        t0 = time.perf_counter()
        model = load()
        seconds = time.perf_counter() - t0
        peak = max(_status("VmHWM"), _status("VmRSS")) - base
        with torch.inference_mode():  # pages of memory-mapped weights become resident when used
            model(torch.zeros(1, 1, dtype=torch.long))
        return model, seconds, peak, _status("VmRSS") - base

    model, cold, cold_peak, resident = one_load()
    n_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    del model
    _, warm, warm_peak, _ = one_load()
    return {"cold": cold, "warm": warm, "cold_peak": cold_peak, "warm_peak": warm_peak, "resident": resident,
            "weights": n_bytes}


def measure_load(side, folder, precision, threads) -> dict:
    cmd = [sys.executable, "-m", "train.benches.llm_generate", "--load-child", side, folder, precision,
           "--threads", str(threads)]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"load subprocess ({side}, {precision}) failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def make_checkpoint(args, folder: Path):
    import transformers
    cfg = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.d_model, intermediate_size=args.ffn,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads or args.heads,
        max_position_embeddings=2048, tie_word_embeddings=True, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    model.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def bench_generate(args, folder: str, precision: str) -> dict:
    """Each side's rounds (harness.Rounds, seconds per generation), first call's seconds, and
    whether its tokens are transformers eager's."""
    import transformers

    import zoo
    dt = harness.PRECISIONS[precision]
    z = zoo.from_pretrained(folder, dtype=dt)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dt).eval()
    hf.generation_config.eos_token_id = None
    hf_compiled = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dt).eval()
    hf_compiled.generation_config.eos_token_id = None
    hf_compiled.forward = torch.compile(hf_compiled.forward)  # transformers' recipe: static cache + compile
    prompt = torch.randint(0, args.vocab, (1, args.prompt), generator=torch.Generator().manual_seed(1))
    n = args.new_tokens
    hf_kw = dict(do_sample=False, pad_token_id=0)
    run = {
        "zoo eager": lambda: z.generate(prompt, n),
        "zoo compiled": lambda: z.generate(prompt, n, compile=True),
        "transformers eager": lambda: hf.generate(prompt, max_new_tokens=n, **hf_kw),
        "transformers compiled": lambda: hf_compiled.generate(prompt, max_new_tokens=n,
                                                              cache_implementation="static", **hf_kw),
    }
    first, outs = {}, {}

    def keeping_output(name):
        def call():
            outs[name] = run[name]()
        return call

    with torch.inference_mode():  # for the warm-up too: a change of grad mode would recompile
        for s, fn in run.items():  # warm-up; for the compiled sides this is where compilation happens
            t0 = time.perf_counter()
            fn()
            first[s] = time.perf_counter() - t0
        rounds = harness.run_rounds({s: keeping_output(s) for s in run}, args.rounds)
    assert all(o.shape[1] == args.prompt + n for o in outs.values())
    print(f"  {precision}: {rounds.summary('zoo eager', 'transformers eager')}; "
          f"{rounds.summary('zoo compiled', 'transformers compiled')}", flush=True)
    return {"rounds": rounds, "first": first,
            "same": {s: torch.equal(outs[s], outs["transformers eager"]) for s in run}}


def main(argv=None):
    p = harness.parser("llm-generate", __doc__, precision="fp32,bf16")
    p.add_argument("--dtypes", dest="precision", type=harness.name_list(harness.PRECISIONS, "precision"),
                   default=argparse.SUPPRESS, help=argparse.SUPPRESS)  # the earlier name of --precision
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4, help="0: as many as heads")
    p.add_argument("--ffn", type=int, default=1408)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--load-rounds", type=int, default=2, help="load subprocesses per side and precision (0: skip)")
    p.add_argument("--load-child", nargs=3, metavar=("SIDE", "FOLDER", "PRECISION"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    harness.setup(args)
    threads = torch.get_num_threads()
    if args.load_child:
        print(json.dumps(load_child(*args.load_child)))
        return 0

    import transformers
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as tmp:
        n_params = make_checkpoint(args, Path(tmp))
        print(f"checkpoint: LlamaForCausalLM d_model={args.d_model} layers={args.layers} heads={args.heads} "
              f"kv_heads={args.kv_heads or args.heads} ffn={args.ffn} vocab={args.vocab} (tied), "
              f"{n_params / 1e6:.1f}M params, fp32 safetensors; torch {torch.__version__}, "
              f"transformers {transformers.__version__}, {threads} thread(s)")
        print(f"\ngeneration: batch 1, prompt {args.prompt}, {args.new_tokens} new tokens, greedy, "
              f"best of {args.rounds} alternating rounds after one warm-up call (first call: compile included)")
        results = {prec: bench_generate(args, tmp, prec) for prec in args.precision}
        n = args.new_tokens
        harness.print_table(
            ["precision", "side", "tok/s (wall)", "tok/s (CPU)", "first call s", "same tokens as transformers eager"],
            [[prec, s, f"{n / r['rounds'].best(s):.1f}", f"{n / r['rounds'].best(s, 'cpu'):.1f}",
              f"{r['first'][s]:.1f}", "yes" if r["same"][s] else "no"]
             for prec, r in results.items() for s in r["first"]])
        print()
        rows = []
        for prec, r in results.items():
            rounds = r["rounds"]
            best_z = min(("zoo eager", "zoo compiled"), key=rounds.best)
            best_h = min(("transformers eager", "transformers compiled"), key=rounds.best)
            for what, a, b in (("eager", "zoo eager", "transformers eager"),
                               ("compiled", "zoo compiled", "transformers compiled"),
                               (f"best / best ({best_z} / {best_h})", best_z, best_h)):
                rows.append([prec, what] + [x for clock in ("wall", "cpu") for x in
                                            (f"{rounds.ratio(a, b, clock):.2f}x", str(rounds.paired(a, b, clock)))])
        harness.print_table(["precision", "Zoo / transformers", "wall: best rounds", "wall: paired median (range)",
                             "CPU: best rounds", "CPU: paired median (range)"], rows)
        if args.load_rounds < 1:
            return 0

        print(f"\nload: from_pretrained in a fresh process (first), then again in the same process "
              f"(second); best of {args.load_rounds} processes; memory in MiB above the RSS before the load")
        keys = ("cold", "warm", "cold_peak", "warm_peak", "resident")
        rows = []
        for prec in args.precision:
            best: dict = {}
            for _, side in harness.schedule(("zoo", "hf"), args.load_rounds):
                m = measure_load(side, tmp, prec, threads)
                old = best.get(side)
                best[side] = m if old is None else {k: min(old[k], m[k]) for k in m}
            for side, name in (("zoo", "Zoo"), ("hf", "transformers")):
                m = best[side]
                rows.append([prec, name, f"{m['cold']:.2f}", f"{m['warm']:.2f}"]
                            + [f"{m[k] / 2**20:.0f}" for k in ("cold_peak", "warm_peak", "resident", "weights")])
            z, h = best["zoo"], best["hf"]
            rows.append([prec, "Zoo / transformers"]
                        + [f"{z[k] / max(h[k], 1e-9 if k in ('cold', 'warm') else 2**20):.2f}x" for k in keys] + [""])
        harness.print_table(["precision", "side", "first load s", "second load s", "first peak", "second peak",
                             "resident after a forward", "weights"], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
