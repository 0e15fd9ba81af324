"""Everything a GPU user asks about, in one command: training tokens/s and MFU against transformers (bf16
eager, compiled, float8), FSDP2 over one NCCL process, decoding with CUDA graphs, document-masked
attention backends, the planner against the allocator, ResNet-50 against timm, TAESD and DiT against diffusers.

    python train/bench.py gpu --out DIR        # the core rows, within one lease (--dry-run: their limits)
    python train/bench.py gpu --only dit,taesd # any rows
    python train/bench.py gpu --rehearse       # every row at tiny shapes on the CPU (no GPU needed)
    python train/bench.py gpu --dry-run        # the rows, their shapes and commands, on any machine

Each row runs in a process of its own with a time limit (a row that fails or runs out of time is
recorded as such, the others still run) and writes DIR/ROW.json; DIR/gpu.json and DIR/gpu.md hold them
all, and --json (default docs/results/gpu.json) the copy docs/gpu.md renders. Without CUDA it prints
what it would run and exits 0.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import torch

import zoo
from train.benches import harness
from train.benches.harness import ROOT
from train.benches.llm_speed import hf_config, hf_loss, zoo_loss
from train.config import OptimConfig, load_run_config
from train.docs import markdown
from train.hardware import measure_peak_flops, sync, vendor_peak_flops
from train.metrics import read_rows
from train.optim import build_optimizer, state_bytes
from train.step import to_device
from zoo.blocks.attention import flash_available
from zoo.blocks.attention_docs import attend_documents
from zoo.tensors import tensor_bytes

BENCH = [sys.executable, str(ROOT / "train" / "bench.py")]
# the LLM rows' shapes: training batch x sequence, tokens generated, Llama-3.2-1B's layers kept (its compile fits a
# row's limit); --rehearse: the tiny ones, on the CPU
SHAPES = {"gpu": dict(seq=2048, batch=4, new=128, layers=4), "rehearse": dict(seq=32, batch=2, new=4, layers=1)}
TINY_LLAMA = dict(d_model=64, n_heads=4, n_kv_heads=2, ffn_hidden=128, vocab_size=256)  # --rehearse's width
LEASE_S = 8 * 60  # what the core rows' limits add up to at most: one lease
REHEARSE_S = 10 * 60  # each row's limit in a rehearsal
CUDA_TESTS = ["tests/test_cuda.py", "tests/test_plan.py::test_cuda_plan_is_not_under_max_memory_reserved",
              "tests/test_doc_masks.py::test_cuda_document_backends_equal_the_reference",
              "tests/test_doc_masks.py::test_cuda_flex_document_masking_gradients",
              "tests/test_gguf.py::test_device_argument",
              "tests/test_pruning.py::test_semi_structured_linears_match_the_dense_pruned_model_on_cuda"]


class Row(NamedTuple):
    what: str
    shape: str
    command: list          # what runs it (a process of its own); {out} is the row's JSON
    limit_s: int           # its share of the command's time
    tiny: list             # what --rehearse appends: tiny shapes on the CPU
    core: bool = False     # run by default (the core rows fit one lease together)


def rows() -> dict[str, Row]:
    own = [*BENCH, "gpu", "--json", "{out}", "--row"]
    bench = lambda cmd: [*BENCH, *cmd.split(), "--device", "cuda", "--rounds", "5", "--json", "{out}"]  # noqa: E731
    tiny = lambda cmd: ["--device", "cpu", "--rounds", "1", "--steps", "1", *cmd.split()]  # noqa: E731
    smollm = ["configs/llm/smollm-135m.yaml", "data.tokenizer=bytes", "model.vocab_size=256", "train.compile=false",
              "train.max_steps=40", "train.log_every=10", "train.eval_every=0", "train.checkpoint_every=0",
              "train.average_last=0", *harness.QUIET]
    g = SHAPES["gpu"]
    llama = f"Llama-3.2-1B's width, {g['layers']} of its 16 layers, batch {g['batch']} x {g['seq']}"
    return {
        "llm-train": Row("training tokens/s and MFU, Zoo against transformers (fused AdamW, bf16 autocast): eager and "
                         "compiled", llama, [*own, "llm-train"], 200, ["--rehearse"], True),
        "generate": Row("decoding tokens/s, eager against CUDA graphs (generate(compile='reduce-overhead')), the same "
                        "greedy tokens in fp32", f"{llama.split(', batch')[0]}, fp32, batch 1 and 32, "
                        f"128-token prompts + {g['new']} new", [*own, "generate"], 120, ["--rehearse"], True),
        "planner": Row("train/plan.py's peak against torch.cuda.max_memory_reserved of the same step",
                       f"llama-1b batch {g['batch']} x {g['seq']} bf16 (checkpointed), smollm-135m batch 8 x 2048 bf16",
                       [*own, "planner"], 60, ["--rehearse"], True),
        "cuda-tests": Row("the suite's CUDA-only tests (ZOO_TEST_DEVICE=cuda), each passed, failed or skipped",
                          " ".join(CUDA_TESTS), [*own, "cuda-tests"], 90, ["--rehearse"], True),
        "llm-float8": Row("training tokens/s and MFU, Zoo against transformers: compiled + float8 (torchao tensorwise "
                          "on both, LM head kept)", llama, [*own, "llm-float8"], 200, ["--rehearse"]),
        "fsdp": Row("the loop's tokens/s and MFU in one process, plain and FSDP2 over one NCCL process",
                    "SmolLM-135M shape (bytes vocabulary), batch 8 x 2048, 40 steps, eager", ["{fsdp}", *smollm], 90,
                    ["model.d_model=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
                     "model.ffn_hidden=128", "data.seq_len=32", "train.batch_size=2", "train.max_steps=2",
                     "train.device=cpu"]),
        "attention": Row("document-masked causal attention, forward + backward: flash-attn varlen, SDPA (dense mask), "
                         "FlexAttention (compiled)", "batch 4 x 8192 tokens, 16 heads x 128, documents of mean 512",
                         [*own, "attention"], 60, ["--rehearse"]),
        "resnet50": Row("ResNet-50 training images/s against timm, channels-last, bf16, eager and compiled",
                        "batch 128 x 3 x 224 x 224",
                        bench("convnets --archs resnet50 --formats channels_last --batch 128"), 100,
                        tiny("--batch 2 --size 32 --warmup 0 --modes eager")),
        "taesd": Row("TAESD encode + decode images/s against diffusers' AutoencoderTiny", "batch 8 x 3 x 512 x 512",
                     bench("taesd --batch 8 --formats channels_last"), 40, tiny("--batch 1 --size 64")),
        "dit": Row("DiT-B/2 training step against diffusers' DiTTransformer2DModel, eager and compiled",
                   "batch 64 x 4 x 32 x 32 latents", bench("dit --preset B --batch 64 --size 32 --precision bf16"),
                   150, tiny("--preset tiny --batch 2 --size 8 --warmup 0 --modes eager")),
    }


def command(row: Row, out: Path, rehearse: bool = False) -> list[str]:
    fsdp = [sys.executable, *"-m torch.distributed.run --standalone --nproc-per-node 1".split(),
            str(ROOT / "train" / "run.py")]
    cmd = [x for c in row.command for x in (fsdp if c == "{fsdp}" else [c.replace("{out}", str(out))])]
    return cmd + (row.tiny if rehearse else [])


# ---------------------------------------------------------------- the rows measured here
def shape(args) -> dict:
    return SHAPES["rehearse" if args.rehearse else "gpu"]


def compiled(fn, args, **kw):
    """torch.compile(fn); in a rehearsal traced by dynamo only (backend eager: no kernels built on the CPU)."""
    return torch.compile(fn, **kw, **({"backend": "eager"} if args.rehearse else {}))


def llama_pair(args, dev):
    """Zoo's Llama-3.2-1B (its first shape()['layers'] layers; rehearsed: TINY_LLAMA) and transformers'
    LlamaForCausalLM of the same shape, on dev."""
    from transformers import LlamaForCausalLM
    s = shape(args)
    c = dataclasses.replace(load_run_config(str(ROOT / "configs/llm/llama-1b.yaml")).model, n_layers=s["layers"],
                            max_seq_len=s["seq"] + s["new"] + 128, **(TINY_LLAMA if args.rehearse else {}))
    torch.manual_seed(0)
    hf = LlamaForCausalLM(hf_config(c, max_position_embeddings=c.max_seq_len, rms_norm_eps=c.norm_eps,
                                    attn_implementation="sdpa"))
    return zoo.build(c).to(dev), hf.to(dev)


def llm_train(args, dev, modes=("bf16 eager", "bf16 compiled")) -> tuple[dict, dict]:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    zm, hf = llama_pair(args, dev)
    B, T = shape(args)["batch"], shape(args)["seq"]
    ids = torch.randint(zm.config.vocab_size, (B, T + 1), device=dev)
    opts = {"zoo": build_optimizer(zm, OptimConfig(), dev, log=lambda *a: None),
            "transformers": torch.optim.AdamW(hf.parameters(), lr=OptimConfig().lr, fused=True)}
    flops = zm.flops_per_token(T) * B * T
    vendor = vendor_peak_flops(dev, torch.bfloat16) or (torch.cuda.get_device_name(dev) if dev.type == "cuda" else
                                                        dev.type, float("nan"))
    measured = measure_peak_flops(dev, torch.bfloat16)
    rows_, data = [], {"vendor_peak": vendor, "measured_peak": measured, "flops_per_step": flops}
    for mode in modes:
        if mode.startswith("float8"):
            for m in (zm, hf):
                convert_to_float8_training(m, config=Float8LinearConfig.from_recipe_name("tensorwise"),
                                           module_filter_fn=lambda mod, name: name != "lm_head")
        sides = {n: harness.Side(m, loss, opts[n], device=dev) for n, m, loss in
                 (("zoo", zm, zoo_loss(ids)), ("transformers", hf, hf_loss(ids)))}
        for side in sides.values():
            side.fwd = compiled(side.model, args) if "compiled" in mode else side.model
        steps = harness.step_calls(sides, "bf16")
        harness.warm_up(steps, calls=2)
        r = harness.run_rounds(steps, args.rounds, calls=3, sync=lambda: sync(dev))
        for n in sides:
            tps = B * T / r.median(n)
            data[f"{mode} {n}"] = {"step_s": r.times(n), "tokens_per_s": tps}
            rows_.append([mode, n, f"{tps:,.0f}", f"{flops / r.median(n) / vendor[1]:.1%}",
                          f"{flops / r.median(n) / measured:.1%}", f"{1e3 * r.median(n):.0f}",
                          str(r.paired(n, "transformers")) if n == "zoo" else ""])
    return {args.row: harness.table(
        ["mode", "side", "tokens/s", f"MFU ({vendor[0]}: {vendor[1] / 1e12:.0f} TFLOP/s)",
         f"MFU (measured {measured / 1e12:.0f} TFLOP/s)", "step ms (median)", "Zoo / transformers (paired)"],
        rows_, f"Batch {B} x {T} tokens, {args.rounds} alternating rounds of 3 steps.")}, data


def generate(args, dev) -> tuple[dict, dict]:
    """fp32: eager and CUDA-graph decoding must give the same greedy tokens (bf16's near-ties of a random model
    can differ between the two kernels' summation orders)."""
    zm, new, rows_, data = llama_pair(args, dev)[0].eval(), shape(args)["new"], [], {}
    for B in (1,) if args.rehearse else (1, 32):  # (a rehearsal compiles one decoding step, on the CPU)
        ids = torch.randint(zm.config.vocab_size, (B, 128), device=dev)
        sides = {"eager": lambda: zm.generate(ids, new),
                 "cuda-graphs": lambda: zm.generate(ids, new, compile="reduce-overhead")}
        harness.warm_up(sides, calls=2)
        same = torch.equal(sides["eager"](), sides["cuda-graphs"]())
        r = harness.run_rounds(sides, args.rounds, sync=lambda: sync(dev))
        for n in sides:
            data[f"{n} batch {B}"] = {"s": r.times(n), "same_tokens": same}
            rows_.append([B, n, f"{B * new / r.median(n):,.0f}", str(r.paired(n, "eager")) if n != "eager" else "",
                          "yes" if same else "NO"])
    return {"generate": harness.table(["batch", "decoding", "tokens/s", "vs eager (paired)", "same greedy tokens"],
                                      rows_, f"fp32, 128-token prompts, {new} new tokens (prefill included).")}, data


def attention(args, dev) -> tuple[dict, dict]:
    B, H, T, D, mean = (1, 2, 128, 16, 32) if args.rehearse else (4, 16, 8192, 128, 512)
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(B, H, T, D, device=dev, dtype=torch.bfloat16, generator=g, requires_grad=True)
               for _ in range(3))
    doc = (torch.rand(B, T, device=dev, generator=g) < 1 / mean).long().cumsum(1)

    def side(backend, fn=attend_documents):  # forward + backward (FlexAttention on a CPU: torch has no backward)
        def run():
            if backend == "flex" and dev.type != "cuda":
                return fn(q.detach(), k.detach(), v.detach(), doc, backend)
            fn(q, k, v, doc, backend).sum().backward()
        return run
    sides = {"sdpa": side("sdpa"), "flex": side("flex", compiled(attend_documents, args))}
    if flash_available() is not None:
        sides = {"flash": side("flash"), **sides}
    harness.warm_up(sides, calls=2)
    r = harness.run_rounds(sides, args.rounds, calls=3, sync=lambda: sync(dev))
    rows_ = [[n, f"{1e3 * r.median(n):.2f}", str(r.paired(n, "sdpa")) if n != "sdpa" else ""] for n in sides]
    notes = "" if "flash" in sides else "flash-attn is not installed on this machine: its row is absent."
    return {"attention": harness.table(["backend", "forward + backward ms (median)", "vs SDPA (paired)"], rows_,
                                       notes)}, {n: r.times(n) for n in sides}


def planner(args, dev) -> tuple[dict, dict]:
    """The plan against what the step reserves: the CUDA caching allocator's peak (rehearsed: the process's
    resident peak on the CPU)."""
    import train.planner as plan
    B, T = shape(args)["batch"], shape(args)["seq"]
    tiny = [f"model.{k}={v}" for k, v in TINY_LLAMA.items()] + ["model.n_layers=2"] if args.rehearse else []
    cases = {"llama-1b": ("llama-1b.yaml", [f"train.batch_size={B}", f"data.seq_len={T}"]),
             "smollm-135m": ("smollm-135m.yaml", [f"train.batch_size={2 * B}", f"data.seq_len={T}"])}
    rows_, data = [], {}
    for name, (cfg, over) in cases.items():
        cfg = load_run_config(str(ROOT / "configs/llm" / cfg), [*over, "train.precision=bf16", "train.compile=false",
                                                                 *tiny])
        planned = plan.plan(cfg, device=dev).peak_bytes
        if dev.type == "cuda":
            torch.cuda.empty_cache(), torch.cuda.reset_peak_memory_stats(dev)
            base = torch.cuda.memory_reserved(dev)
            plan.simulate(cfg, dev, fake=False)
            reserved = torch.cuda.max_memory_reserved(dev) - base
            torch.cuda.empty_cache()
        else:
            with harness.PeakRSS() as peak:
                plan.simulate(cfg, dev, fake=False)
            reserved = peak.peak
        data[name] = {"planned": planned, "reserved": reserved}
        rows_.append([name, harness.gib(planned), harness.gib(reserved), f"{planned / reserved:.3f}"])
    return {"planner": harness.table(["configuration", "planned peak", "max_memory_reserved", "planned / measured"],
                                     rows_)}, data


def cuda_tests(args, dev) -> tuple[dict, dict]:
    """CUDA_TESTS under ZOO_TEST_DEVICE=cuda (rehearsed: on the CPU, where they skip), one outcome each."""
    import xml.etree.ElementTree as ET
    report = Path(args.json).with_suffix(".xml")
    env = {**os.environ, **({} if args.rehearse else {"ZOO_TEST_DEVICE": "cuda"})}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "not slow", "-p", "no:cacheprovider",
                          f"--junitxml={report}", *CUDA_TESTS], cwd=ROOT, env=env, capture_output=True, text=True)
    if out.returncode not in (0, 1):  # 1: some failed (recorded); else the tests did not run
        raise RuntimeError(f"pytest exited {out.returncode}: {(out.stdout + out.stderr).strip().splitlines()[-1:]}")
    cases = [[f"{c.get('classname')}::{c.get('name')}",
              next((e.tag for e in c if e.tag in ("failure", "error", "skipped")), "passed")]
             for c in ET.parse(report).iter("testcase")]
    return {"cuda-tests": harness.table(["test", "outcome"], cases, out.stdout.strip().splitlines()[-1])}, \
        {"outcomes": dict(cases)}


OWN = {"llm-train": llm_train, "llm-float8": lambda a, d: llm_train(a, d, ("float8 compiled",)), "generate": generate,
       "attention": attention, "planner": planner, "cuda-tests": cuda_tests}


# ---------------------------------------------------------------- the command
def fsdp_row(out: Path, row: Row, rehearse: bool) -> tuple[dict, dict]:
    """The fsdp row: the loop's speed in one process, plain and under torchrun with FSDP2 (its metrics)."""
    cmd = command(row, out, rehearse)
    plain = [sys.executable, *cmd[cmd.index(str(ROOT / "train" / "run.py")):]]
    res, sides = {}, {"one process": plain, "FSDP2, 1 NCCL process": [*cmd, "train.parallel=fsdp"]}
    for i, (name, c) in enumerate(sides.items()):
        subprocess.run([*c, f"train.out_dir={out / f'run{i}'}"], check=True, cwd=ROOT, timeout=row.limit_s / 2,
                       stdout=subprocess.DEVNULL)
        metrics = read_rows(out / f"run{i}")
        res[name] = {k: harness.median_of(metrics, k) for k in ("tokens_per_s", "mfu")}
    return {"fsdp": harness.table(["run", "tokens/s (median)", "MFU (the loop's: the vendor's peak on known GPUs)"],
                                  [[n, f"{v['tokens_per_s']:,.0f}", f"{v['mfu']:.1%}"] for n, v in res.items()])}, res


def run_all(args, rows_: dict) -> tuple[dict, dict]:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    overview, tables, data = [], {}, {}
    for name, row in rows_.items():
        t0, status = time.perf_counter(), "ok"
        print(f"gpu: {name}: {row.what} ({row.shape})", flush=True)
        try:
            if name == "fsdp":
                t, d = fsdp_row(out / "fsdp", row, args.rehearse)
            else:
                subprocess.run(command(row, out / f"{name}.json", args.rehearse), check=True, cwd=ROOT,
                               timeout=row.limit_s)
                result = harness.load_result(out / f"{name}.json")
                t, d = result["tables"], result["data"]
            tables.update({k if k == name else f"{name}: {k}": v for k, v in t.items()})
            data[name] = d
        except subprocess.TimeoutExpired:
            status = f"out of time ({row.limit_s} s)"
        except (subprocess.CalledProcessError, OSError, KeyError, ValueError) as e:
            status = f"failed: {type(e).__name__}: {str(e).splitlines()[-1][:160] if str(e) else ''}"
        overview.append([name, row.what, row.shape, status, f"{time.perf_counter() - t0:.0f}"])
        print(f"gpu: {name}: {status}", flush=True)
    return {"rows": harness.table(["row", "measures", "shape", "status", "seconds"], overview), **tables}, data


# the quality benches: the tiny LLM in bf16 autocast against bf16 with these overrides
QUALITY = {"float8": (["train.float8=true"], "tensorwise scales, the LM head kept in bf16; float8 emulated on this "
                                              "machine"),
           "bf16-pure": (["train.precision=bf16-pure"], "bf16-pure: bf16 weights, gradients and AdamW moments, "
                                                       "stochastic rounding (torchao)")}


def quality(args, name: str) -> tuple[dict, dict]:
    """The tiny LLM, bf16 autocast against the side QUALITY names, per seed: the final val loss (bf16-pure: also
    the bytes per parameter of a built run's weights, gradients and optimizer states)."""
    over = [f"train.max_steps={args.steps}", "train.precision=bf16", "train.eval_every=0", "train.checkpoint_every=0",
            "train.average_last=0", "train.resume=false", *args.overrides]
    sides = {"bf16": over, name: [*over, *QUALITY[name][0]]}
    loss = {side: [harness.last(harness.run_loop(ROOT / "configs/llm/tiny.yaml", Path(args.out) / f"{side}-{seed}",
                                                 [*o, f"train.seed={seed}"], done=None), "val_loss")
                   for seed in args.seeds] for side, o in sides.items()}
    rel = [f / b - 1 for b, f in zip(loss["bf16"], loss[name])]
    rows_ = [[seed, f"{b:.4f}", f"{f:.4f}", f"{100 * r:+.2f}%"]
             for seed, b, f, r in zip(args.seeds, loss["bf16"], loss[name], rel)]
    mean, half = harness.mean_interval(rel)
    rows_.append(["mean (95% interval)", "", "", f"{100 * mean:+.2f}% ({100 * (mean - half):+.2f}% to "
                                                 f"{100 * (mean + half):+.2f}%)"])
    tables = {"quality": harness.table(["seed", "bf16 val loss", f"{name} val loss", f"{name} / bf16 - 1"], rows_,
                                       f"{' '.join(['configs/llm/tiny.yaml', *args.overrides])}, {args.steps} steps, "
                                       f"{QUALITY[name][1]}.")}
    data = {"val_loss": loss, "relative": rel}
    if name == "bf16-pure":
        data["bytes_per_param"] = {s: bytes_per_param(ROOT / "configs/llm/tiny.yaml", [*o, f"train.out_dir={args.out}"])
                                   for s, o in sides.items()}
        tables["memory"] = harness.table(["precision", "weights", "gradients", "optimizer states", "total"],
                                         [[s, *(f"{v:.2f}" for v in b.values()), f"{sum(b.values()):.2f}"]
                                          for s, b in data["bytes_per_param"].items()],
                                         "Bytes per trained parameter, from the tensors of a run built by the loop's "
                                         "builder after one step (AdamW).")
    return tables, data


def bytes_per_param(config: Path, over: list) -> dict:
    """{weights, gradients, optimizer states}: bytes per trained parameter of the run `config` builds, from its
    tensors after one forward, backward and optimizer step."""
    from train.builder import build_run
    run = build_run(load_run_config(str(config), over))
    params = run.params()
    with run.train_context():
        loss, _ = run.task.loss(run.fwd, to_device(run.task.train_batch(0, 0), run.device, False))
    loss.backward()
    grads = tensor_bytes([p.grad for p in params])
    run.optimizer.step()
    n = sum(p.numel() for p in params)
    return {"weights": tensor_bytes(params) / n, "gradients": grads / n,
            "optimizer states": state_bytes(run.optimizer) / n}


def main(argv=None, name: str = "gpu"):
    if name in QUALITY:
        p = harness.parser(name, quality.__doc__, precision=None, rounds=False, out=True, seeds=1)
        p.add_argument("--steps", type=harness.positive_int, default=20)
        p.add_argument("overrides", nargs="*", help="key=value overrides of every run")
        args = p.setup(argv)
        tables, data = quality(args, name)
        return harness.save(args, tables if name != "float8" else {"float8": tables["quality"]}, data)
    p = harness.parser(name, __doc__, precision=None)
    p.add_argument("--out", default="runs/bench-gpu", help="the folder of the rows' results")
    p.add_argument("--dry-run", action="store_true", help="list the rows and their commands; measure nothing")
    p.add_argument("--rehearse", action="store_true", help="run every row (or --only's) at tiny shapes on the CPU; "
                                                           "the result goes to --out only")
    p.add_argument("--row", choices=sorted(OWN), help=argparse.SUPPRESS)
    p.add_argument("--only", type=harness.name_list(list(rows()), "row"),
                   help="comma list of the rows to run (default: the core rows; --rehearse: all)")
    args = p.parse_args(argv)
    if args.row:  # one of the rows measured in this module, in its own process
        return harness.save(args, *OWN[args.row](args, torch.device("cpu" if args.rehearse else "cuda")))
    every = rows()
    rows_ = {n: every[n] for n in args.only or [n for n, r in every.items() if r.core or args.rehearse]}
    if args.rehearse:  # on a CPU, shared maybe: a row's time says nothing of the GPU's, its limit is REHEARSE_S
        tables, data = run_all(args, {n: r._replace(limit_s=REHEARSE_S) for n, r in rows_.items()})
        save_both(args, tables, data, docs=False)
        return int(any(r[3] != "ok" for r in tables["rows"]["rows"]))
    if args.dry_run or not torch.cuda.is_available():
        core = sum(r.limit_s for r in every.values() if r.core)
        print(("gpu: dry run" if args.dry_run else "gpu: no CUDA device here; what it would run:")
              + f" ({len(rows_)} rows, at most {sum(r.limit_s for r in rows_.values()) / 60:.1f} minutes; the core "
                f"rows' limits add up to {core / 60:.1f} of one lease's {LEASE_S / 60:.0f}; the others: "
                f"{', '.join(n for n, r in every.items() if not r.core)}, with --only)")
        for n, r in rows_.items():
            cmd = " ".join(command(r, Path(args.out) / f"{n}.json"))
            print(f"  {n}: {r.what}\n    shape: {r.shape}\n    limit: {r.limit_s} s\n    runs: {cmd}")
        if args.dry_run:
            overview = [[n, r.what, r.shape, "not run (dry run)", ""] for n, r in rows_.items()]
            save_both(args, {"rows": harness.table(["row", "measures", "shape", "status", "seconds"], overview,
                                                   "No GPU run yet: the rows list what the command measures.")},
                      {"dry_run": True})
        return
    save_both(args, *run_all(args, rows_))


def save_both(args, tables: dict, data: dict, docs: bool = True):
    """The result in --out (gpu.json, gpu.md) and at --json (docs=False: --out only)."""
    out = Path(args.out)
    harness.save(args, tables, data, path=out / "gpu.json")
    (out / "gpu.md").write_text("\n".join(f"### {k}\n\n{markdown(t)}" for k, t in tables.items()))
    if docs:
        harness.save(args, tables, data, show_tables=False)
