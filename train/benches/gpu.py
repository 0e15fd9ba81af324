"""Everything a GPU user asks about, in one command: training tokens/s and MFU against transformers (bf16
eager, compiled, float8), FSDP2 over one NCCL process, decoding with CUDA graphs, document-masked
attention backends, the planner against the allocator, ResNet-50 against timm, TAESD and DiT against diffusers.

    python train/bench.py gpu --out DIR        # about 8 minutes on one H100
    python train/bench.py gpu --dry-run        # the rows, their shapes and commands, on any machine

Each row runs in a process of its own with a time limit (a row that fails or runs out of time is
recorded as such, the others still run) and writes DIR/ROW.json; DIR/gpu.json and DIR/gpu.md hold them
all, and --json (default docs/results/gpu.json) the copy docs/gpu.md renders. Without CUDA it prints
what it would run and exits 0.
"""
from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import torch

from train.benches import harness
from train.benches.harness import ROOT

BENCH = [sys.executable, str(ROOT / "train" / "bench.py")]
SEQ, BATCH, NEW = 2048, 4, 128  # training batch x sequence of the LLM rows; tokens generated per row


class Row(NamedTuple):
    what: str
    shape: str
    command: list          # what runs it (a process of its own); {out} is the row's JSON
    limit_s: int           # its share of the command's time


def rows() -> dict[str, Row]:
    own = [*BENCH, "gpu", "--json", "{out}", "--row"]
    bench = lambda cmd: [*BENCH, *cmd.split(), "--device", "cuda", "--rounds", "5", "--json", "{out}"]  # noqa: E731
    smollm = ["configs/llm/smollm-135m.yaml", "data.tokenizer=bytes", "model.vocab_size=256", "train.compile=false",
              "train.max_steps=40", "train.log_every=10", "train.eval_every=0", "train.checkpoint_every=0",
              "train.average_last=0", *harness.QUIET]
    return {
        "llm-train": Row("training tokens/s and MFU, Zoo against transformers (fused AdamW, bf16 autocast): eager, "
                         "compiled, compiled + float8 (torchao tensorwise on both, LM head kept)",
                         f"Llama-3.2-1B (configs/llm/llama-1b.yaml), batch {BATCH} x {SEQ}", [*own, "llm-train"], 300),
        "fsdp": Row("the loop's tokens/s and MFU in one process, plain and FSDP2 over one NCCL process",
                    "SmolLM-135M shape (bytes vocabulary), batch 8 x 2048, 40 steps, eager", ["{fsdp}", *smollm], 90),
        "generate": Row("decoding tokens/s, eager against CUDA graphs (generate(compile='reduce-overhead')), the same "
                        "greedy tokens", f"Llama-3.2-1B in bf16, batch 1 and 32, 128-token prompts + {NEW} new",
                        [*own, "generate"], 150),
        "attention": Row("document-masked causal attention, forward + backward: flash-attn varlen, SDPA (dense mask), "
                         "FlexAttention (compiled)", "batch 4 x 8192 tokens, 16 heads x 128, documents of mean 512",
                         [*own, "attention"], 60),
        "planner": Row("train/plan.py's peak against torch.cuda.max_memory_reserved of the same step",
                       f"llama-1b batch {BATCH} x {SEQ} bf16 (checkpointed), smollm-135m batch 8 x 2048 bf16",
                       [*own, "planner"], 50),
        "resnet50": Row("ResNet-50 training images/s against timm, channels-last, bf16, eager and compiled",
                        "batch 128 x 3 x 224 x 224",
                        bench("convnets --archs resnet50 --formats channels_last --batch 128"), 100),
        "taesd": Row("TAESD encode + decode images/s against diffusers' AutoencoderTiny", "batch 8 x 3 x 512 x 512",
                     bench("taesd --batch 8 --formats channels_last"), 40),
        "dit": Row("DiT-B/2 training step against diffusers' DiTTransformer2DModel, eager and compiled",
                   "batch 64 x 4 x 32 x 32 latents", bench("dit --preset B --batch 64 --size 32 --precision bf16"),
                   150),
    }


def command(row: Row, out: Path) -> list[str]:
    fsdp = [sys.executable, *"-m torch.distributed.run --standalone --nproc-per-node 1".split(),
            str(ROOT / "train" / "run.py")]
    return [x for c in row.command for x in (fsdp if c == "{fsdp}" else [c.replace("{out}", str(out))])]


# ---------------------------------------------------------------- the rows measured here
def llama_pair(dev):
    """Zoo's Llama-3.2-1B and transformers' LlamaForCausalLM of the same shape, on dev."""
    import zoo
    from transformers import LlamaForCausalLM
    from train.benches.llm_speed import hf_config
    from train.config import load_run_config
    c = dataclasses.replace(load_run_config(str(ROOT / "configs/llm/llama-1b.yaml")).model, max_seq_len=SEQ + NEW + 128)
    torch.manual_seed(0)
    hf = LlamaForCausalLM(hf_config(c, max_position_embeddings=c.max_seq_len, rms_norm_eps=c.norm_eps,
                                    attn_implementation="sdpa"))
    return zoo.build(c).to(dev), hf.to(dev)


def llm_train(args, dev) -> tuple[dict, dict]:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from train.config import OptimConfig
    from train.optim import build_optimizer
    from train.benches.llm_speed import hf_loss, zoo_loss
    from train.hardware import measure_peak_flops, vendor_peak_flops
    zm, hf = llama_pair(dev)
    ids = torch.randint(zm.config.vocab_size, (BATCH, SEQ + 1), device=dev)
    opts = {"zoo": build_optimizer(zm, OptimConfig(), dev, log=lambda *a: None),
            "transformers": torch.optim.AdamW(hf.parameters(), lr=OptimConfig().lr, fused=True)}
    flops = zm.flops_per_token(SEQ) * BATCH * SEQ
    vendor = vendor_peak_flops(dev, torch.bfloat16) or (torch.cuda.get_device_name(dev), float("nan"))
    measured = measure_peak_flops(dev, torch.bfloat16)
    rows_, data = [], {"vendor_peak": vendor, "measured_peak": measured, "flops_per_step": flops}
    for mode in ("bf16 eager", "bf16 compiled", "float8 compiled"):
        if mode.startswith("float8"):
            for m in (zm, hf):
                convert_to_float8_training(m, config=Float8LinearConfig.from_recipe_name("tensorwise"),
                                           module_filter_fn=lambda mod, name: name != "lm_head")
        sides = {n: harness.Side(m, loss, opts[n], compile="compiled" in mode, device=dev)
                 for n, m, loss in (("zoo", zm, zoo_loss(ids)), ("transformers", hf, hf_loss(ids)))}
        steps = {n: (lambda s=s: s.step("bf16")) for n, s in sides.items()}
        harness.warm_up(steps, calls=2)
        r = harness.run_rounds(steps, args.rounds, calls=3, sync=torch.cuda.synchronize)
        for n in sides:
            tps = BATCH * SEQ / r.median(n)
            data[f"{mode} {n}"] = {"step_s": r.times(n), "tokens_per_s": tps}
            rows_.append([mode, n, f"{tps:,.0f}", f"{flops / r.median(n) / vendor[1]:.1%}",
                          f"{flops / r.median(n) / measured:.1%}", f"{1e3 * r.median(n):.0f}",
                          str(r.paired(n, "transformers")) if n == "zoo" else ""])
    return {"llm-train": harness.table(
        ["mode", "side", "tokens/s", f"MFU ({vendor[0]}: {vendor[1] / 1e12:.0f} TFLOP/s)",
         f"MFU (measured {measured / 1e12:.0f} TFLOP/s)", "step ms (median)", "Zoo / transformers (paired)"],
        rows_, f"Batch {BATCH} x {SEQ} tokens, {args.rounds} alternating rounds of 3 steps.")}, data


def generate(args, dev) -> tuple[dict, dict]:
    from zoo.weights.zoo_folder import cast_weights
    zm = cast_weights(llama_pair(dev)[0], torch.bfloat16).eval()
    rows_, data = [], {}
    for B in (1, 32):
        ids = torch.randint(zm.config.vocab_size, (B, 128), device=dev)
        sides = {"eager": lambda: zm.generate(ids, NEW),
                 "cuda-graphs": lambda: zm.generate(ids, NEW, compile="reduce-overhead")}
        harness.warm_up(sides, calls=2)
        same = torch.equal(sides["eager"](), sides["cuda-graphs"]())
        r = harness.run_rounds(sides, args.rounds, sync=torch.cuda.synchronize)
        for n in sides:
            data[f"{n} batch {B}"] = {"s": r.times(n), "same_tokens": same}
            rows_.append([B, n, f"{B * NEW / r.median(n):,.0f}", str(r.paired(n, "eager")) if n != "eager" else "",
                          "yes" if same else "NO"])
    return {"generate": harness.table(["batch", "decoding", "tokens/s", "vs eager (paired)", "same greedy tokens"],
                                      rows_, f"128-token prompts, {NEW} new tokens (prefill included).")}, data


def attention(args, dev) -> tuple[dict, dict]:
    from zoo.blocks.attention import flash_available
    from zoo.blocks.attention_docs import attend_documents
    g = torch.Generator(device=dev).manual_seed(0)
    q, k, v = (torch.randn(4, 16, 8192, 128, device=dev, dtype=torch.bfloat16, generator=g, requires_grad=True)
               for _ in range(3))
    doc = (torch.rand(4, 8192, device=dev, generator=g) < 1 / 512).long().cumsum(1)
    flex = torch.compile(attend_documents)
    sides = {"sdpa": lambda: attend_documents(q, k, v, doc, "sdpa").sum().backward(),
             "flex": lambda: flex(q, k, v, doc, "flex").sum().backward()}
    if flash_available() is not None:
        sides = {"flash": lambda: attend_documents(q, k, v, doc, "flash").sum().backward(), **sides}
    harness.warm_up(sides, calls=2)
    r = harness.run_rounds(sides, args.rounds, calls=3, sync=torch.cuda.synchronize)
    rows_ = [[n, f"{1e3 * r.median(n):.2f}", str(r.paired(n, "sdpa")) if n != "sdpa" else ""] for n in sides]
    notes = "" if "flash" in sides else "flash-attn is not installed on this machine: its row is absent."
    return {"attention": harness.table(["backend", "forward + backward ms (median)", "vs SDPA (paired)"], rows_,
                                       notes)}, {n: r.times(n) for n in sides}


def planner(args, dev) -> tuple[dict, dict]:
    import train.planner as plan
    from train.config import load_run_config
    cases = {"llama-1b": ("llama-1b.yaml", [f"train.batch_size={BATCH}", f"data.seq_len={SEQ}"]),
             "smollm-135m": ("smollm-135m.yaml", ["train.batch_size=8", "data.seq_len=2048"])}
    rows_, data = [], {}
    for name, (cfg, over) in cases.items():
        cfg = load_run_config(str(ROOT / "configs/llm" / cfg), [*over, "train.precision=bf16", "train.compile=false"])
        planned = plan.plan(cfg, device=dev).peak_bytes
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_reserved(dev)
        plan.simulate(cfg, dev, fake=False)
        reserved = torch.cuda.max_memory_reserved(dev) - base
        data[name] = {"planned": planned, "reserved": reserved}
        rows_.append([name, harness.gib(planned), harness.gib(reserved), f"{planned / reserved:.3f}"])
        torch.cuda.empty_cache()
    return {"planner": harness.table(["configuration", "planned peak", "max_memory_reserved", "planned / measured"],
                                     rows_)}, data


OWN = {"llm-train": llm_train, "generate": generate, "attention": attention, "planner": planner}


# ---------------------------------------------------------------- the command
def fsdp_row(out: Path, row: Row) -> tuple[dict, dict]:
    """The fsdp row: the loop's speed in one process, plain and under torchrun with FSDP2 (its metrics)."""
    from train.metrics import read_rows
    cmd = command(row, out)
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
                t, d = fsdp_row(out / "fsdp", row)
            else:
                subprocess.run(command(row, out / f"{name}.json"), check=True, cwd=ROOT, timeout=row.limit_s)
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


def float8_quality(args) -> tuple[dict, dict]:
    """The tiny LLM, bf16 against bf16 + float8 (emulated without a float8 GPU), per seed: the final val loss."""
    over = [f"train.max_steps={args.steps}", "train.precision=bf16", "train.eval_every=0", "train.checkpoint_every=0",
            "train.average_last=0", "train.resume=false"]
    loss = {side: [harness.last(harness.run_loop(ROOT / "configs/llm/tiny.yaml", Path(args.out) / f"{side}-{seed}",
                                                 [*over, f"train.seed={seed}", f"train.float8={side == 'float8'}"],
                                                 done=None), "val_loss") for seed in args.seeds]
            for side in ("bf16", "float8")}
    rel = [f / b - 1 for b, f in zip(loss["bf16"], loss["float8"])]
    rows_ = [[seed, f"{b:.4f}", f"{f:.4f}", f"{100 * r:+.2f}%"]
             for seed, b, f, r in zip(args.seeds, loss["bf16"], loss["float8"], rel)]
    mean, half = harness.mean_interval(rel)
    rows_.append(["mean (95% interval)", "", "",
                  f"{100 * mean:+.2f}% ({100 * (mean - half):+.2f}% to {100 * (mean + half):+.2f}%)"])
    return {"float8": harness.table(["seed", "bf16 val loss", "float8 val loss", "float8 / bf16 - 1"], rows_,
                                    f"configs/llm/tiny.yaml, {args.steps} steps, tensorwise scales, the LM head kept "
                                    f"in bf16; float8 emulated on this machine.")}, {"val_loss": loss, "relative": rel}


def main(argv=None, name: str = "gpu"):
    if name == "float8":
        p = harness.parser(name, float8_quality.__doc__, precision=None, rounds=False, out=True, seeds=1)
        p.add_argument("--steps", type=harness.positive_int, default=20)
        args = p.parse_args(argv)
        harness.setup(args)
        harness.save(args, *float8_quality(args))
        return
    p = harness.parser(name, __doc__, precision=None)
    p.add_argument("--out", default="runs/bench-gpu", help="the folder of the rows' results")
    p.add_argument("--dry-run", action="store_true", help="list the rows and their commands; measure nothing")
    p.add_argument("--row", choices=sorted(OWN), help=argparse.SUPPRESS)
    p.add_argument("--only", type=harness.name_list(list(rows()), "row"), default=",".join(rows()),
                   help="comma list of the rows to run (default: all)")
    args = p.parse_args(argv)
    if args.row:  # one of the rows measured in this module, in its own process
        harness.save(args, *OWN[args.row](args, torch.device("cuda")))
        return
    rows_ = {n: r for n, r in rows().items() if n in args.only}
    if args.dry_run or not torch.cuda.is_available():
        print(("gpu: dry run" if args.dry_run else "gpu: no CUDA device here; what it would run:")
              + f" ({len(rows_)} rows, about {sum(r.limit_s for r in rows_.values()) / 60:.0f} minutes at most)")
        for n, r in rows_.items():
            cmd = " ".join(command(r, Path(args.out) / f"{n}.json"))
            print(f"  {n}: {r.what}\n    shape: {r.shape}\n    runs: {cmd}")
        if args.dry_run:
            overview = [[n, r.what, r.shape, "not run (dry run)", ""] for n, r in rows_.items()]
            save_both(args, {"rows": harness.table(["row", "measures", "shape", "status", "seconds"], overview,
                                                   "No GPU run yet: the rows list what the command measures.")},
                      {"dry_run": True})
        return
    save_both(args, *run_all(args, rows_))


def save_both(args, tables: dict, data: dict):
    """The result in --out (gpu.json, gpu.md) and at --json."""
    from train.docs import markdown
    out = Path(args.out)
    harness.save(args, tables, data, path=out / "gpu.json")
    (out / "gpu.md").write_text("\n".join(f"### {k}\n\n{markdown(t)}" for k, t in tables.items()))
    harness.save(args, tables, data, show_tables=False)
