"""The loop's training step under different settings: activation checkpointing policies, per family.

    python train/bench.py checkpointing                       # the three families, fp32
    python train/bench.py checkpointing --families llm --rounds 8 --no-measure

Per family one model per policy (none, selective, full on every 2nd block, full), alternating
rounds of the loop's own step: time against none, the planner's peak and the measured one.
"""
from __future__ import annotations

import statistics

import torch

from train.benches import harness
from train.benches.convnets import build_pair, side
from train.benches.memory import base_of
from train.config import load_run_config, task_class
from train.hardware import sync
from train.optim import build_optimizer
from train.step import autocast_for, optimizer_step

FAMILIES = {
    "llm": (harness.llm_base(4096, 256, 4, 4, 2, 8), []),
    "convnet": ("convnet/resnet-digits.yaml", ["model.width=32", "train.batch_size=64"]),
    "diffusion": ("diffusion/digits.yaml", ["train.batch_size=128"]),
}
POLICIES = {"none": [], "selective": ["train.activation_checkpointing=selective"],
            "full, every 2nd": ["train.activation_checkpointing=full", "train.activation_checkpointing_every=2"],
            "full": ["train.activation_checkpointing=full"]}


def model_and_task(cfg, device: torch.device):
    """The run's model (seed 0, training mode, on `device`) and its task."""
    from train.planner import build_model
    torch.manual_seed(0)
    return build_model(cfg).to(device).train(), task_class(cfg.family)(cfg, device, lambda m: None)


def step_fn(cfg, device: torch.device = torch.device("cpu")):
    """One training step of `cfg` as the loop runs it (train.step.optimizer_step: train.grad_accum micro-batches
    of Task.example_batch, autocast in train.precision with a GradScaler for fp16, clipping, the config's
    optimizer), compiled when train.compile. The step callable."""
    model, task = model_and_task(cfg, device)
    batch = task.example_batch(model, cfg.train.batch_size)
    opt = build_optimizer(model, cfg.optim, device, lambda m: None)
    params = [p for p in model.parameters() if p.requires_grad]
    fwd = torch.compile(model) if cfg.train.compile else model
    scaler, n = torch.amp.GradScaler(device.type, enabled=cfg.train.precision == "fp16"), cfg.train.grad_accum
    return lambda: optimizer_step(lambda b: task.loss(fwd, b), iter([batch] * n), n, opt, scaler, params, 1.0,
                                  autocast_for(device, cfg.train.precision))


def held(base: dict, over: list, device: torch.device, threads: int = 0) -> tuple[int, int]:
    """(peak bytes of a steady-state step, bytes held between steps: weights, optimizer state, batch): the
    planner's measurement in a fresh process on a CPU, max_memory_allocated across a step on CUDA."""
    from train.planner import measure_in_subprocess
    if device.type != "cuda":
        m = measure_in_subprocess(base, over, threads=threads)
        return m["peak"], m["live"]
    fn = step_fn(load_run_config(None, over, base=base), device)
    fn(), fn(), torch.cuda.synchronize(device), torch.cuda.reset_peak_memory_stats(device)
    live = torch.cuda.memory_allocated(device)
    fn(), torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device), live


def compare(base: dict, sides: dict, rounds: int, repeats: int = 0, device=torch.device("cpu"), warmup: int = 1,
            threads: int = 0) -> tuple[harness.Rounds, dict, dict]:
    """The step of `base` with each side's overrides in alternating rounds -> (Rounds, {side: `repeats`
    measured peaks}, {side: its first step's seconds})."""
    fns = {n: step_fn(load_run_config(None, o, base=base), device) for n, o in sides.items()}
    first = harness.warm_up(fns, say=lambda m: None)
    r = harness.run_rounds(fns, rounds, sync=lambda: sync(device), warmup=warmup - 1)
    return r, {n: [held(base, o, device, threads)[0] for _ in range(repeats)] for n, o in sides.items()}, first


def accumulation_diff(cfg, k: int, device=torch.device("cpu")) -> float:
    """max |g_accum - g_batch| / max |g_batch|: k micro-batches of the loop's optimizer_step against one batch
    k times larger, the same data (a recording optimizer keeps the gradients)."""
    from types import SimpleNamespace
    model, task = model_and_task(cfg, device)
    task.example_batch(model, 1)  # the task takes the model's settings, as before the loop's first step
    b, gen = cfg.train.batch_size, torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.model.vocab_size, (b, cfg.data.seq_len + 1), generator=gen).to(device)
    params, grads = [p for p in model.parameters() if p.requires_grad], []
    rec = SimpleNamespace(param_groups=[{"params": params}],
                          step=lambda: grads.append([p.grad.clone() for p in params]),
                          zero_grad=lambda set_to_none=True: [setattr(p, "grad", None) for p in params])
    scaler = torch.amp.GradScaler(device.type, enabled=False)
    for batches in ([(ids[:, :-1], ids[:, 1:])], [(ids[i::k, :-1], ids[i::k, 1:]) for i in range(k)]):
        optimizer_step(lambda bb: task.loss(model, bb), iter(batches), len(batches), rec, scaler, params, None)
    scale = max(float(w.abs().max()) for w in grads[0])
    return max(float((a - w).abs().max()) for a, w in zip(grads[1], grads[0])) / scale


def main(argv=None):
    from train.planner import MiB, plan
    p = harness.parser("checkpointing", __doc__, precision="fp32")
    p.add_argument("--families", type=harness.name_list(FAMILIES, "family"), default=list(FAMILIES))
    p.add_argument("--no-measure", action="store_true", help="leave out the measured peaks (a process each)")
    args, tables = p.setup(argv), {}
    for precision in args.precision:
        for family in args.families:
            spec, over = FAMILIES[family]
            base, over = base_of(spec), [*over, f"train.precision={precision}"]
            sides = {k: over + v for k, v in POLICIES.items()}
            r, measured, _ = compare(base, sides, args.rounds, 0 if args.no_measure else 1, threads=args.threads or 0)
            rows = []
            for name, o in sides.items():
                q = plan(load_run_config(None, o, base=base))
                slower = "1.00x" if name == "none" else str(r.paired("none", name))
                rows.append([name, f"{r.best(name) * 1e3:.1f}", slower,
                             f"{q.peak_bytes / MiB:.1f}", f"{q.breakdown['activations'] / MiB:.1f}",
                             f"{measured[name][0] / MiB:.1f}" if measured[name] else "-"])
            tables[f"{family} {precision}"] = harness.table(
                ["policy", "best step ms", "step time / none (paired median)", "predicted peak MiB",
                 "predicted activations MiB", "measured peak MiB"], rows)
    harness.save(args, tables, {})


# ---------------------------------------------------------------- the techniques report's claims on the loop's step
def steps(ctx, sides: dict, memory=False, warmup=1):
    """`compare` on the report's LLM (ctx: train/benches/report.py's Ctx): rounds, `ctx.seeds` peaks, first steps."""
    return compare(ctx.s.llm, {n: [f"train.precision={ctx.precision}", *o] for n, o in sides.items()}, ctx.n_rounds,
                   ctx.seeds if memory else 0, ctx.device, warmup)


def fp16_missing(device: torch.device) -> str:
    """Why `device` has no fast fp16 matmuls ("" where it has them: tensor cores, or a CPU's AVX512-FP16/AMX-FP16)."""
    if device.type == "cuda":
        return "" if torch.cuda.get_device_capability(device) >= (7, 0) else "this GPU has no fp16 tensor cores"
    if device.type == "cpu" and not torch.ops.mkldnn._is_mkldnn_fp16_supported():
        return "this CPU has no fp16 matmul kernels (no AVX512-FP16/AMX-FP16); the claim needs tensor cores"
    return ""


def claim_precision(ctx) -> list[dict]:
    """bf16 autocast and fp16 autocast + GradScaler against fp32. Speed: the loop's step on the report's LLM, paired
    rounds (fp16 only on hardware with fp16 matmul kernels). Memory: the step's measured peak on a narrow LLM at a long
    sequence, where activations are most of it (their share: fp32's peak less the tensors kept between steps)."""
    no_fp16 = fp16_missing(ctx.device)
    r = steps(ctx, {p: [f"train.precision={p}"] for p in ("fp32", "bf16", "fp16")[:2 if no_fp16 else 3]})[0]
    fp16 = "fp16 autocast + GradScaler"
    rows = [ctx.speed("bf16 autocast (speed)", r, "bf16", "fp32"),
            dict(key="fp16 autocast (speed)", name=f"{fp16} (speed)", reason=no_fp16) if no_fp16 else
            ctx.speed("fp16 autocast (speed)", r, "fp16", "fp32", f"{fp16} (speed)")]
    m = {p: [held(ctx.s.mem, [f"train.precision={p}"], ctx.device) for _ in range(ctx.seeds)]
         for p in ("fp32", "bf16", "fp16")}
    peak, kept = (statistics.median(x[i] for x in m["fp32"]) for i in (0, 1))
    mo, b, t = ctx.s.mem["model"], ctx.s.mem["train"]["batch_size"], ctx.s.mem["data"]["seq_len"]
    share = (f"; d_model {mo['d_model']}, {mo['n_layers']} layers, {b} x {t} tokens: activations and step transients "
             f"{1 - kept / peak:.0%} of fp32's peak")
    return rows + [ctx.saved("precision (memory)", [x[0] for x in m["fp32"]], [x[0] for x in m[p]],
                             f"{label} (memory)", numbers={"fp32_kept": kept, "activation_share": 1 - kept / peak},
                             memory_note=share) for p, label in (("bf16", "bf16 autocast"), ("fp16", fp16))]


def claim_compile(ctx) -> list[dict]:
    """torch.compile of the model in the loop's step: the first step (compilation) and the steady speed."""
    if not ctx.s.compile:
        return [dict(key="torch.compile", reason="left out at this scale (compilation takes tens of seconds)")]
    r, _, first = steps(ctx, {m: [f"train.compile={m == 'compile'}"] for m in ("eager", "compile")}, warmup=2)
    return [ctx.speed("torch.compile", r, "compile", "eager",
                      speed=f"first step {first['eager']:.2f} s eager, {first['compile']:.1f} s compiled; ")]


def claim_checkpointing(ctx) -> list[dict]:
    """Full activation checkpointing against none: measured peak and step time (this bench's)."""
    r, peaks, _ = steps(ctx, {"none": [], "full": ["train.activation_checkpointing=full"]}, memory=True)
    p = r.paired("full", "none")
    return [ctx.saved("activation checkpointing", peaks["none"], peaks["full"], speed=f"slowdown {p}",
                      numbers={"speedup": p.median})]


def claim_chunked_ce(ctx) -> list[dict]:
    """Chunked cross-entropy (the default) against the loss on the full logits: the step's peak."""
    r, peaks, _ = steps(ctx, {k: [f"train.chunked_loss={k == 'chunked'}"] for k in ("full", "chunked")}, memory=True)
    return [ctx.saved("chunked cross-entropy", peaks["full"], peaks["chunked"], speed=str(r.paired("chunked", "full")))]


def claim_grad_accum(ctx) -> list[dict]:
    """Gradient accumulation: k micro-batches against one batch k times larger, the same data: the gradients (the
    loop's optimizer_step), the step time and the step's peak."""
    k, b = ctx.s.accum, ctx.s.llm["train"]["batch_size"]
    diff = accumulation_diff(load_run_config(None, [f"train.precision={ctx.precision}"], base=ctx.s.llm), k, ctx.device)
    r, peaks, _ = steps(ctx, {"one": [], "acc": [f"train.batch_size={b // k}", f"train.grad_accum={k}"]}, memory=True)
    speed = ctx.speed("gradient accumulation (memory)", r, "acc", "one",
                      f"grad accumulation {k} x {b // k} (cost)")["speed"]
    return [dict(key="gradient accumulation (gradients)", baseline=f"one batch of {b}", evidence="exact",
                 samples=[diff], speed=speed, numbers={"max_rel_grad_diff": diff},
                 quality=f"max abs(g_accum - g_batch) / max abs(g_batch) = {diff:.2e} ({k} x {b // k} vs 1 x {b})"),
            ctx.saved("gradient accumulation (memory)", peaks["one"], peaks["acc"], baseline=f"one batch of {b}",
                      speed=speed)]


def claim_cuda_flags(ctx) -> list[dict]:
    """TF32 matmuls (an fp32 LLM step) and cudnn.benchmark (a ResNet step): CUDA only."""
    if ctx.device.type != "cuda":
        return [dict(key=k, reason=f"this hardware has no CUDA device ({ctx.device.type})")
                for k in ("TF32 matmuls", "cudnn.benchmark")]
    arch, batch, size = ctx.s.resnet
    data = [torch.randn(batch, 3, size, size, device=ctx.device), torch.randint(0, 1000, (batch,), device=ctx.device)]
    res = side(build_pair(arch, 1000)[0].to(ctx.device), data, ctx.device)
    llm = step_fn(load_run_config(None, [f"train.precision={ctx.precision}"], base=ctx.s.llm), ctx.device)

    def flag(obj, attr, on, fn):
        def call():
            old = getattr(obj, attr)
            setattr(obj, attr, on)
            try:
                fn()
            finally:
                setattr(obj, attr, old)
        return call
    out = []
    for key, obj, attr, fn in (("TF32 matmuls", torch.backends.cuda.matmul, "allow_tf32", llm),
                               ("cudnn.benchmark", torch.backends.cudnn, "benchmark", lambda: res.step(ctx.precision))):
        calls = {k: flag(obj, attr, k == "on", fn) for k in ("off", "on")}
        out.append(ctx.speed(key, harness.run_rounds(calls, ctx.n_rounds, sync=torch.cuda.synchronize, warmup=2),
                             "on", "off"))
    return out
