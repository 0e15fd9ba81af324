"""The techniques report: every claim of the source notes measured on this machine, beside its baseline.

    python train/bench.py report --out docs/report   # the full run: larger shapes, more rounds and steps
    python train/bench.py report --quick          # small shapes, few rounds and steps
    python train/bench.py report --quick --only precision,compile --seeds 5
    python train/bench.py report --precision bf16 --rounds 12   # comparisons not about precision in bf16
    python train/bench.py report --rejudge --out docs/report    # measure nothing: re-judge the stored numbers

Time: seeds are what costs (every quality comparison trains once per seed, every measured peak is
taken once per seed), so the loop runs are short: the full run with one seed took 27 min on 2 idle
CPU cores (--quick: 4 min); with the default 3 seeds and the full LLM runs cut from 600 to 400 steps
the per-part times of that run put the full run near 50 min, and --quick at most 3 x 4 = 12 min,
within the 60 and 15 minute bounds (estimates from those times, not yet timed on an idle machine).

Writes DIR/report.md (the hardware, library versions and date; the verdict rule, RULE, applied by
`verdict`; one row per claim: the claim, the baseline, what was measured on speed, memory and
quality, the estimate with its 95% interval and samples against the threshold the claim's words
set, their ratio and the verdict), DIR/report.json (every number
the rows were made from, the per-seed, per-round or per-repeat samples among them) and PNG plots (loss against step and wall time for each quality
comparison, memory bars, a speed-up bar chart).

Each measurement reuses the benchmark that owns it (train/benches/*.py, harness.run_rounds's
alternating rounds and paired medians; the memory planner's measured peak, train.plan.measure, in
a fresh process on the CPU, torch.cuda.max_memory_allocated on CUDA; short runs of the loop for
quality, read back from their metrics.jsonl). Nothing in the report is typed in: the claims are
fixed prose with the claimed effect as a number, and every measured figure comes from this run.
A measurement that fails is reported as skipped with its error, and the others still run.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import math
import os
import platform
import re
import resource
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from argparse import Namespace
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

ROOT = Path(__file__).resolve().parents[2]
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

from train import plots  # noqa: E402
from train.benches import harness  # noqa: E402
from train.metrics import read_rows  # noqa: E402

MiB = 2**20
NOMINAL_SPEED_MEMORY = 0.10   # a claim of "faster" / "less memory" without a number: 10%
NOMINAL_QUALITY = 0.01        # a claim of "better" / "lower loss" without a number: 1% lower
SHARED = 0.25                 # the page says "shared" when other processes used more of the CPU time than this


# ---------------------------------------------------------------- the verdict rule
CONFIDENCE = 0.95
MIN_SEEDS = 3                 # quality claims: at least this many seeds (and repeated measurements: this many repeats)
APPROX = 0.9                  # a claim of "~X" is met from 90% of X on
EVIDENCE = ("seeds", "rounds", "repeats", "exact")
RULE = (f"Every effect is in the claim's own units, positive in the claimed direction (speed-up - 1: the baseline's "
        f"step time over the technique's, within a round; memory saved as a fraction of the baseline's; relative loss "
        f"reduction; compression - 1), with a {CONFIDENCE:.0%} interval: quality over at least {MIN_SEEDS} seeds (the "
        f"mean and its t interval), speed over paired alternating rounds (the median ratio and its distribution-free "
        f"interval from the order statistics of the per-round ratios, which needs at least 6 rounds), measured peak "
        f"memory over at least {MIN_SEEDS} repeated measurements (t interval), counts (bytes of tensors, shapes, a "
        f"deterministic difference) exactly. Each claim has a threshold that its own words require: a number it "
        f"states (\"~X\" is met from {APPROX:.0%} of X; \"stateless\" only by zero state, i.e. 100% saved), or "
        f"{NOMINAL_SPEED_MEMORY:.0%} for speed and memory and {NOMINAL_QUALITY:.0%} lower loss where it states none. "
        f"**holds** when the interval lies on the claimed side of zero and the estimate meets the threshold (and no "
        f"part of the claim went unmeasured); **partly** when the interval lies on the claimed side but the estimate "
        f"falls short of the threshold (or part of the claim was not measured); **does not hold** when the interval "
        f"lies on the other side (or is exactly zero); **inconclusive** when it straddles zero. No verdict from a "
        f"single seed or measurement (**no verdict: one seed**), nor from numbers without an interval (the row says "
        f"why). For a claimed equality the effect is the measured difference: **holds** when its interval is within "
        f"the stated tolerance, **does not hold** when beyond it, **inconclusive** otherwise. **skipped** (with the "
        f"reason) when this hardware lacks the feature or the measurement failed. Ratio = estimate / threshold.")


def t_quantile(p: float, df: int) -> float:
    """The p-quantile (p > 0.5) of Student's t with `df` degrees of freedom: bisection on the
    CDF, integrated from the density with Simpson's rule (no scipy in the core install)."""
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)

    def cdf(x, n=400):
        h = x / n
        f = [c * (1 + (i * h) ** 2 / df) ** (-(df + 1) / 2) for i in range(n + 1)]
        return 0.5 + h / 3 * (f[0] + f[-1] + 4 * sum(f[1:-1:2]) + 2 * sum(f[2:-1:2]))
    lo, hi = 0.0, 1.0
    while cdf(hi) < p:
        lo, hi = hi, 2 * hi
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) < p else (lo, mid)
    return (lo + hi) / 2


def median_rank(n: int, confidence: float = CONFIDENCE) -> Optional[int]:
    """The largest k with P(X_(k) <= median <= X_(n+1-k)) >= confidence for n samples (a binomial
    tail), or None when even the full range covers less (n <= 5 at 95%)."""
    best = None
    for k in range(1, n // 2 + 1):
        below = sum(math.comb(n, i) for i in range(k)) / 2 ** n
        if 1 - 2 * below >= confidence:
            best = k
    return best


def estimate(samples: list, evidence: str) -> tuple[Optional[float], Optional[tuple], str]:
    """The effect's estimate and CONFIDENCE interval from its samples (one per seed, round or
    repeat; one value for an exact count), and, without an interval, why not."""
    if evidence not in EVIDENCE:
        raise ValueError(f"evidence must be one of {EVIDENCE}, got {evidence!r}")
    xs = [float(x) for x in samples]
    if not xs or not all(math.isfinite(x) for x in xs):
        return None, None, "no finite measurement"
    if evidence == "exact":
        if len(set(xs)) != 1:
            raise ValueError(f"an exact count has one value, got {xs}")
        return xs[0], (xs[0], xs[0]), ""
    n = len(xs)
    if evidence == "rounds":
        k = median_rank(n)
        s = sorted(xs)
        if k is None:
            return statistics.median(xs), None, f"{n} rounds: too few for a {CONFIDENCE:.0%} interval"
        return statistics.median(xs), (s[k - 1], s[n - k]), ""
    m = statistics.fmean(xs)
    if n < MIN_SEEDS:
        what = "seed" if evidence == "seeds" else "measurement"
        return m, None, f"one {what}" if n == 1 else f"{n} {what}s (at least {MIN_SEEDS} needed)"
    half = t_quantile(1 - (1 - CONFIDENCE) / 2, n - 1) * statistics.stdev(xs) / math.sqrt(n)
    return m, (m - half, m + half), ""


def verdict(est: Optional[float], interval: Optional[tuple], threshold: float, kind: str = "gain",
            missing: str = "", unmeasured: str = "") -> str:
    """The rule above, once. `interval` the CONFIDENCE interval of the effect (None: no verdict,
    `missing` says why); `threshold` what the claim's words require (kind 'gain', > 0) or the
    tolerance (kind 'equal'); `unmeasured` a part of the claim not measured (caps at partly)."""
    if kind not in ("gain", "equal"):
        raise ValueError(f"kind must be 'gain' or 'equal', got {kind!r}")
    if threshold is None or threshold <= 0:
        raise ValueError(f"a claim's threshold must be > 0, got {threshold}")
    if est is None or not math.isfinite(est):
        return "skipped"
    if interval is None:
        return f"no verdict: {missing or 'no interval'}"
    lo, hi = interval
    if kind == "equal":
        lo, hi = (0.0, max(abs(lo), abs(hi))) if lo <= 0 <= hi else sorted((abs(lo), abs(hi)))
        return "holds" if hi <= threshold else "does not hold" if lo > threshold else "inconclusive"
    if lo > 0:
        return "holds" if est >= threshold and not unmeasured else "partly"
    if hi < 0 or lo == hi == 0:
        return "does not hold"
    return "inconclusive"


def ratio(effect: Optional[float], claimed: float) -> Optional[float]:
    return None if effect is None or not math.isfinite(effect) else effect / claimed


def approx(x: float) -> float:
    """The threshold of a claim of "~x" (a fraction): met from APPROX of it."""
    return APPROX * x


def approx_speedup(x: float) -> float:
    """The threshold, as speed-up - 1, of a claim of "~x times faster"."""
    return APPROX * x - 1


THRESHOLDS = {  # what a claim's words require where it is not the claimed number itself ("~X": APPROX of X)
    "bf16 autocast (speed)": approx_speedup(2.0), "fp16 autocast + GradScaler (speed)": approx_speedup(2.0),
    "adamw8bit (state memory)": approx(0.75), "QLoRA (base weights)": approx(0.75),
}


@dataclass
class Row:
    technique: str
    claim: str                   # the note's claim, in our words (fixed prose)
    source: str                  # which note (/work seeds 000-004 as numbered in the project's sources)
    baseline: str
    metric: str                  # what the effect measures, e.g. "speed-up - 1"
    claimed: float               # the claimed effect, in the metric's units (kind equal: the tolerance)
    kind: str = "gain"
    effect: Optional[float] = None   # the estimate: mean over seeds/repeats, median over rounds, or the exact count
    speed: str = "-"
    memory: str = "-"
    quality: str = "-"
    numbers: dict = field(default_factory=dict)   # the raw measured values the texts come from
    reason: str = ""             # why skipped
    verdict: str = ""
    ratio: Optional[float] = None
    measurement: str = ""        # the key of MEASUREMENTS that made the row
    threshold: Optional[float] = None  # what the claim's words require, in the metric's units (default: claimed)
    evidence: str = "seeds"      # what the samples are: seeds, rounds, repeats or exact (see RULE)
    samples: list = field(default_factory=list)   # the effect per seed / round / repeat (one value when exact)
    interval: Optional[list] = None   # the CONFIDENCE interval of the effect
    n: int = 0                   # how many samples
    missing: str = ""            # why there is no interval
    unmeasured: str = ""         # a part of the claim that was not measured

    def decide(self) -> "Row":
        if self.threshold is None:
            self.threshold = THRESHOLDS.get(self.technique, self.claimed)
        if self.samples:
            self.effect, iv, self.missing = estimate(self.samples, self.evidence)
            self.interval, self.n = (list(iv) if iv else None), len(self.samples)
        elif self.effect is not None and self.interval is None and not self.missing:
            self.missing = "no interval: a single value without seeds or rounds"
        self.verdict = verdict(self.effect, self.interval, self.threshold, self.kind, self.missing, self.unmeasured)
        self.ratio = ratio(self.effect, self.threshold)
        if self.verdict == "skipped" and not self.reason:
            self.reason = "no measurement"
        return self


# ---------------------------------------------------------------- scales
@dataclass(frozen=True)
class Scale:
    name: str
    rounds: int
    llm: dict              # the LLM of the step measurements (train config base)
    opt_model: dict        # the optimizer-state model: d_model, n_layers, n_heads, vocab
    resnet: tuple          # arch, batch, image size
    accum: int             # gradient accumulation micro-batches
    loop_steps: int        # MoE / MoD / averaging runs (the dense run's steps)
    loop_batch: int
    loop_seq: int
    snr_steps: int
    ae_steps: int
    sd_steps: int
    lora_steps: int
    lora_layers: int
    taesd_size: int
    compile: bool = True
    max_chars: int = 6_000_000   # the LLM loop runs' corpus (the embedded default's)


def _llm(vocab, d, layers, heads, kv, seq, batch):
    return {"family": "llm", "model": {"vocab_size": vocab, "d_model": d, "n_layers": layers, "n_heads": heads,
                                       "n_kv_heads": kv, "max_seq_len": seq},
            "data": {"tokenizer": "bytes", "seq_len": seq}, "train": {"batch_size": batch, "precision": "fp32"}}


SCALES = {
    "test": Scale("test", 2, _llm(512, 64, 2, 2, 1, 32, 4), dict(d_model=64, n_layers=2, n_heads=2, vocab=512),
                  ("resnet18", 2, 32), 2, 6, 2, 32, 4, 10, 6, 2, 1, 64, max_chars=200_000),
    "quick": Scale("quick", 6, _llm(8192, 128, 4, 4, 2, 128, 8), dict(d_model=256, n_layers=4, n_heads=4, vocab=8192),
                   ("resnet18", 8, 64), 4, 80, 8, 128, 100, 100, 80, 8, 2, 256, max_chars=2_000_000),
    "full": Scale("full", 8, _llm(16384, 256, 4, 4, 2, 256, 8), dict(d_model=512, n_layers=8, n_heads=8, vocab=32000),
                  ("resnet50", 8, 128), 4, 400, 8, 256, 300, 300, 200, 20, 4, 512),
}


# ---------------------------------------------------------------- shared measuring pieces
class Ctx:
    """What every measurement gets: the scale, the device, the output folder, a log, and the plots made."""

    def __init__(self, scale: Scale, out: Path, device: torch.device, say: Callable[[str], None],
                 precision: str = "fp32", rounds: Optional[int] = None, seeds: int = MIN_SEEDS):
        self.s, self.out, self.device, self.say, self.seeds = scale, out, device, say, seeds
        self.precision, self.n_rounds = precision, rounds or scale.rounds  # of every comparison not about precision
        self.work = Path(tempfile.mkdtemp(prefix="zoo-report-"))
        self.plots: list[tuple[str, str]] = []       # (title, file name)
        self.speed: dict[str, float] = {}            # row label -> paired-median speed-up, for the bar chart
        self.speed_claimed: dict[str, float] = {}
        self.memory: dict[str, dict[str, float]] = {}  # comparison -> {side: MiB}

    def sync(self):
        from train.hardware import sync
        sync(self.device)

    def cfg(self, base: dict, over: list):
        from train.config import load_run_config
        return load_run_config(None, [f"train.precision={self.precision}", *over], base=base)

    def rounds(self, sides: dict, calls: int = 1, warmup: int = 1) -> harness.Rounds:
        for fn in sides.values():
            for _ in range(warmup):
                fn()
        return harness.run_rounds(sides, self.n_rounds, calls=calls, sync=self.sync)

    def peaks(self, base: dict, over: list) -> list[int]:
        """`peak` measured `seeds` times (a fresh process each on the CPU): a memory row's repeats."""
        return [self.peak(base, over) for _ in range(self.seeds)]

    def peak(self, base: dict, over: list) -> int:
        """The peak bytes of one steady-state training step of the config: the memory planner's
        measurement (a fresh process, CPU) or, on CUDA, max_memory_allocated across a step."""
        if self.device.type != "cuda":
            from train.plan import measure_in_subprocess
            return measure_in_subprocess(base, [f"train.precision={self.precision}", *over])["peak"]
        from train.benches.checkpointing import step_fn
        cfg = self.cfg(base, over)
        fn = step_fn(cfg, cfg.train.precision, self.device)  # noqa: the config's, as the planner measures it
        fn(), fn()
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        fn()
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device)

    def plot_curves(self, key: str, title: str, runs: dict[str, list], value: str, ylabel: str) -> str:
        png = f"{key}.png"
        plots.loss_curves({n: plots.curves(rows, value) for n, rows in runs.items()}, self.out / png, title, ylabel)
        self.plots.append((title, png))
        return png

    def add_speed(self, label: str, speedup: float, claimed: Optional[float] = None):
        self.speed[label] = speedup
        if claimed is not None:
            self.speed_claimed[label] = claimed


def round_effects(r: harness.Rounds, side: str, ref: str) -> list[float]:
    """speed-up - 1 of `side` over `ref` in each round (ref's time over side's, back to back): a speed row's samples."""
    return [b / t - 1 for t, b in zip(r.times(side), r.times(ref), strict=True)]


def speed_text(p: harness.Paired, base_s: float, tech_s: float, unit: str = "step") -> str:
    return f"{p.median:.2f}x ({p.low:.2f}-{p.high:.2f}x); {unit} {base_s * 1e3:.1f} -> {tech_s * 1e3:.1f} ms"


def mem_text(base, tech, what: str = "peak") -> str:
    """Baseline -> technique bytes (lists of repeats: their medians and the repeats' count)."""
    if isinstance(base, list):
        n = f" (medians of {len(base)} repeats)"
        base, tech = statistics.median(base), statistics.median(tech)
    else:
        n = ""
    return f"{what} {base / MiB:.1f} -> {tech / MiB:.1f} MiB ({100 * (1 - tech / base):+.0f}% saved){n}"


def saved(base: list, tech: list) -> list[float]:
    """Memory saved in each repeat (the baseline and the technique measured in turn): a memory row's samples."""
    return [1 - t / b for b, t in zip(base, tech, strict=True)]


def loop_run(ctx: Ctx, name: str, config, over: list) -> list[dict]:
    """A short run of the loop (in this process) of `config` (a path or a base dict) with
    `over`; returns its metrics rows."""
    from train.config import load_run_config
    from train.loop import train
    out = ctx.work / name
    over = [f"train.out_dir={out}", "train.progress=false", "train.samples=false", "train.plot=false",
            "train.export=false", "train.resume=false", f"train.device={ctx.device}", *over]
    cfg = load_run_config(str(config), over) if not isinstance(config, dict) else load_run_config(None, over, base=config)
    t0 = time.perf_counter()
    train(cfg, log=lambda m: None)
    ctx.say(f"    {name}: {cfg.train.max_steps} steps in {time.perf_counter() - t0:.0f} s")
    return read_rows(out)


def last(rows: list[dict], key: str) -> float:
    return [r[key] for r in rows if key in r][-1]


def median_of(rows: list[dict], key: str) -> float:
    vals = [r[key] for r in rows if key in r]
    return statistics.median(vals[1:] if len(vals) > 2 else vals)  # the first window includes warm-up


# ---------------------------------------------------------------- the measurements, in priority order
def m_precision(ctx: Ctx) -> list[Row]:
    """bf16 autocast and fp16 autocast + GradScaler against fp32: the loop's step, and its peak memory."""
    from train.benches.checkpointing import step_fn
    base = ctx.s.llm
    fns = {p: step_fn(ctx.cfg(base, [f"train.precision={p}"]), p, ctx.device) for p in ("fp32", "bf16", "fp16")}
    r = ctx.rounds(fns)
    peaks = {p: ctx.peaks(base, [f"train.precision={p}"]) for p in fns}
    ctx.memory["precision (step peak)"] = {p: statistics.median(v) / MiB for p, v in peaks.items()}
    rows = []
    for p, label in (("bf16", "bf16 autocast"), ("fp16", "fp16 autocast + GradScaler")):
        pm = r.paired(p, "fp32")
        sp, mem = speed_text(pm, r.best("fp32"), r.best(p)), mem_text(peaks["fp32"], peaks[p])
        nums = {"speedup": pm.median, "base_s": r.best("fp32"), "tech_s": r.best(p),
                "base_peaks": peaks["fp32"], "tech_peaks": peaks[p]}
        ctx.add_speed(label, pm.median, 2.0)
        rows.append(Row(label + " (speed)", "mixed precision makes training ~2x faster", "000", "fp32",
                        "speed-up - 1", 1.0, evidence="rounds", samples=round_effects(r, p, "fp32"), speed=sp,
                        memory=mem, numbers=nums))
        rows.append(Row(label + " (memory)", "16-bit mixed precision cuts training memory 2-4x", "004", "fp32",
                        "memory saved", 0.5, evidence="repeats", samples=saved(peaks["fp32"], peaks[p]), speed=sp,
                        memory=mem, numbers=nums))
    return rows


def m_compile(ctx: Ctx) -> list[Row]:
    """torch.compile of the model in the loop's step: the first step (compilation) and the steady speed."""
    row = Row("torch.compile", "compiling the model speeds training up (when it works)", "000", "eager",
              "speed-up - 1", NOMINAL_SPEED_MEMORY)
    if not ctx.s.compile:
        row.reason = "left out at this scale (compilation takes tens of seconds)"
        return [row]
    from train.benches.checkpointing import step_fn
    base = ctx.s.llm
    fns, first = {}, {}
    for mode in ("eager", "compile"):
        fns[mode] = step_fn(ctx.cfg(base, [f"train.compile={mode == 'compile'}"]), ctx.precision, ctx.device)
        t0 = time.perf_counter()
        fns[mode]()
        ctx.sync()
        first[mode] = time.perf_counter() - t0
    r = ctx.rounds(fns, warmup=2)
    pm = r.paired("compile", "eager")
    row.evidence, row.samples = "rounds", round_effects(r, "compile", "eager")
    row.speed = (speed_text(pm, r.best("eager"), r.best("compile"))
                 + f"; first step {first['eager']:.2f} s eager, {first['compile']:.1f} s compiled (compilation; "
                    f"shorter when inductor's on-disk cache holds kernels of an earlier run)")
    row.numbers = {"speedup": pm.median, "first_step_eager_s": first["eager"], "first_step_compile_s": first["compile"],
                   "base_s": r.best("eager"), "tech_s": r.best("compile")}
    ctx.add_speed("torch.compile", pm.median, 1 + NOMINAL_SPEED_MEMORY)
    return [row]


def _opt_model(ctx: Ctx):
    from train.benches.optimizers import build_model, with_gradients
    return with_gradients(build_model(Namespace(**ctx.s.opt_model)).to(ctx.device))


def m_fused(ctx: Ctx) -> list[Row]:
    """Fused AdamW (one kernel for the whole update) against the for-each implementation: the optimizer step."""
    from train.benches.optimizers import time_optimizers
    from train.config import OptimConfig
    model = _opt_model(ctx)
    r, nbytes, _ = time_optimizers(model, {"foreach": OptimConfig(name="adamw", lr=1e-5, fused=False),
                                           "fused": OptimConfig(name="adamw", lr=1e-5, fused=True)},
                                   ctx.n_rounds, steps=2, say=lambda m: None)
    pm = r.paired("fused", "foreach")
    n = sum(p.numel() for p in model.parameters())
    ctx.add_speed("fused AdamW (optimizer step)", pm.median, 1 + NOMINAL_SPEED_MEMORY)
    return [Row("fused AdamW", "a fused AdamW update is faster than the unfused one", "004", "AdamW for-each",
                "speed-up - 1", NOMINAL_SPEED_MEMORY, evidence="rounds", samples=round_effects(r, "fused", "foreach"),
                speed=speed_text(pm, r.best("foreach"), r.best("fused"), f"optimizer step ({n / 1e6:.1f}M params)"),
                memory=f"state {nbytes['foreach'] / MiB:.1f} / {nbytes['fused'] / MiB:.1f} MiB",
                numbers={"speedup": pm.median, "base_s": r.best("foreach"), "tech_s": r.best("fused")})]


OPT_CLAIMS = {  # optimizer -> (claim, note, claimed fraction of AdamW's state saved)
    "adamw8bit": ("8-bit states: ~75% less optimizer-state memory than 32-bit Adam", "000", 0.75),
    "lion": ("Lion keeps no second moment: stateless compared with Adam's two states", "000", 1.0),
    "sgd": ("SGD is stateless: none of Adam's two extra copies of the model", "000/001", 1.0),
    "adafactor": ("Adafactor is more memory-efficient than AdamW", "004", NOMINAL_SPEED_MEMORY),
}


def m_optimizer_state(ctx: Ctx) -> list[Row]:
    """Optimizer-state bytes after a step (train.optim.state_bytes) of each optimizer against AdamW's."""
    from train.benches.optimizers import time_optimizers
    from train.config import OptimConfig
    model = _opt_model(ctx)
    names = ["adamw", *OPT_CLAIMS]
    r, nbytes, notes = time_optimizers(model, {n: OptimConfig(name=n, lr=1e-5) for n in names}, ctx.n_rounds,
                                       say=lambda m: None)
    n = sum(p.numel() for p in model.parameters())
    ctx.memory["optimizer state"] = {k: v / MiB for k, v in nbytes.items()}
    rows = []
    for name, (claim, src, claimed) in OPT_CLAIMS.items():
        pm = r.paired(name, "adamw")
        rows.append(Row(f"{name} (state memory)", claim, src, "AdamW (fp32 states)", "memory saved", claimed,
                        evidence="exact", samples=[1 - nbytes[name] / nbytes["adamw"]],
                        memory=f"state {nbytes['adamw'] / MiB:.1f} -> {nbytes[name] / MiB:.1f} MiB "
                               f"({nbytes[name] / n:.2f} bytes/param, {100 * (1 - nbytes[name] / nbytes['adamw']):.0f}% saved)",
                        speed=f"optimizer step {pm.median:.2f}x AdamW's speed ({r.best('adamw') * 1e3:.1f} -> "
                              f"{r.best(name) * 1e3:.1f} ms)",
                        numbers={"base_bytes": nbytes["adamw"], "tech_bytes": nbytes[name], "speedup": pm.median,
                                 "params": n}))
    return rows


def m_checkpointing(ctx: Ctx) -> list[Row]:
    """Full activation checkpointing against none: measured peak and step time (checkpointing bench)."""
    from train.benches.checkpointing import POLICIES, measure_policies
    s = ctx.s.llm
    extra = [f"model.{k}={v}" for k, v in s["model"].items()] + [f"data.seq_len={s['data']['seq_len']}",
                                                                 f"train.batch_size={s['train']['batch_size']}"]
    m = measure_policies("llm", ctx.precision, ctx.n_rounds, measure=False,
                         policies={k: POLICIES[k] for k in ("none", "full")}, extra=extra, device=ctx.device)
    r = m["rounds"]
    base, tech = (ctx.peaks(ctx.s.llm, POLICIES[k]) for k in ("none", "full"))
    pm = r.paired("full", "none")
    ctx.memory["activation checkpointing (step peak)"] = {"none": statistics.median(base) / MiB,
                                                          "full": statistics.median(tech) / MiB}
    ctx.add_speed("activation checkpointing (cost)", pm.median)
    return [Row("activation checkpointing", "recomputing activations in backward cuts training memory a lot, "
                "for some extra compute", "001/002/003", "no checkpointing", "memory saved", NOMINAL_SPEED_MEMORY,
                evidence="repeats", samples=saved(base, tech), memory=mem_text(base, tech),
                speed=f"slowdown: {speed_text(pm, r.best('none'), r.best('full'))}",
                numbers={"base_peaks": base, "tech_peaks": tech, "speedup": pm.median,
                         "planned_activations_none": m["none"]["plan"].breakdown["activations"],
                         "planned_activations_full": m["full"]["plan"].breakdown["activations"]})]


def m_chunked_ce(ctx: Ctx) -> list[Row]:
    """Chunked cross-entropy (the default) against the loss on the full logits: the step's peak."""
    base = ctx.s.llm
    full, chunked = ctx.peaks(base, ["train.chunked_loss=false"]), ctx.peaks(base, ["train.chunked_loss=true"])
    ctx.memory["chunked cross-entropy (step peak)"] = {"full logits": statistics.median(full) / MiB,
                                                       "chunked": statistics.median(chunked) / MiB}
    v = base["model"]["vocab_size"]
    logits = base["train"]["batch_size"] * base["data"]["seq_len"] * v * 4
    return [Row("chunked cross-entropy", "computing the loss in chunks removes the memory spike at the end of the "
                "forward", "000", "loss on the full logits", "memory saved", NOMINAL_SPEED_MEMORY,
                evidence="repeats", samples=saved(full, chunked),
                memory=mem_text(full, chunked) + f" (fp32 logits {logits / MiB:.1f} MiB)",
                numbers={"base_peaks": full, "tech_peaks": chunked, "logits_bytes": logits})]


class _Recorder:
    """An optimizer stand-in for train.step.optimizer_step that keeps the gradients it is given."""

    def __init__(self, params):
        self.params, self.param_groups, self.grads = params, [{"params": params}], None

    def step(self):
        self.grads = [p.grad.detach().clone() for p in self.params]

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None


def m_grad_accum(ctx: Ctx) -> list[Row]:
    """Gradient accumulation: the loop's step over k micro-batches against one batch k times larger:
    the gradients (same data), the step time and the step's peak memory."""
    from train.benches.checkpointing import step_fn
    from train.step import optimizer_step
    from train.plan import build_model
    from train.tasks import task_class
    k, base = ctx.s.accum, ctx.s.llm
    b = base["train"]["batch_size"]
    big = ctx.cfg(base, [])
    torch.manual_seed(0)
    model = build_model(big).to(ctx.device).train()
    task = task_class("llm")(big, ctx.device, lambda m: None)
    task.example_batch(model, 1)  # the task takes the model's settings, as before the loop's first step
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, base["model"]["vocab_size"], (b, base["data"]["seq_len"] + 1), generator=g).to(ctx.device)
    batch = (ids[:, :-1], ids[:, 1:])
    params = [p for p in model.parameters() if p.requires_grad]
    scaler = torch.amp.GradScaler(ctx.device.type, enabled=False)
    rec = _Recorder(params)
    optimizer_step(lambda bb: task.loss(model, bb), iter([batch]), 1, rec, scaler, params, None)
    whole = rec.grads
    micro = [(x[i::k], y[i::k]) for x, y in [batch] for i in range(k)]
    optimizer_step(lambda bb: task.loss(model, bb), iter(micro), k, rec, scaler, params, None)
    diff = max(float((a - w).abs().max()) for a, w in zip(rec.grads, whole)) / max(float(w.abs().max()) for w in whole)
    small = [f"train.batch_size={b // k}", f"train.grad_accum={k}"]
    fns = {"one batch": step_fn(big, ctx.precision, ctx.device),
           "accumulated": step_fn(ctx.cfg(base, small), ctx.precision, ctx.device)}
    r = ctx.rounds(fns)
    pm = r.paired("accumulated", "one batch")
    peak_big, peak_acc = ctx.peaks(base, []), ctx.peaks(base, small)
    ctx.memory[f"gradient accumulation (step peak, batch {b})"] = {f"1 x {b}": statistics.median(peak_big) / MiB,
                                                                   f"{k} x {b // k}": statistics.median(peak_acc) / MiB}
    ctx.add_speed(f"grad accumulation {k} x {b // k} (cost)", pm.median)
    speed = speed_text(pm, r.best("one batch"), r.best("accumulated"))
    mem = mem_text(peak_big, peak_acc)
    tol = 1e-5
    nums = {"max_rel_grad_diff": diff, "speedup": pm.median, "base_peaks": peak_big, "tech_peaks": peak_acc}
    return [Row("gradient accumulation (gradients)", f"k micro-batches accumulated give the gradient of one k-times "
                f"larger batch (tolerance {tol:g}, fp32 summation order)", "000/001",
                f"one batch of {b}", "max relative gradient difference", tol, kind="equal", evidence="exact", samples=[diff],
                quality=f"max abs(g_accum - g_batch) / max abs(g_batch) = {diff:.2e} ({k} x {b // k} vs 1 x {b})",
                speed=speed, memory=mem, numbers=nums),
            Row("gradient accumulation (memory)", "accumulation trains a large batch in the memory of a micro-batch",
                "000/001", f"one batch of {b}", "memory saved", NOMINAL_SPEED_MEMORY, evidence="repeats",
                samples=saved(peak_big, peak_acc),
                speed=speed, memory=mem, numbers=nums)]


def m_channels_last(ctx: Ctx) -> list[Row]:
    """Channels-last against contiguous: a ResNet training step (the resnet bench's step), two models
    with the same weights, paired in the same rounds."""
    from train.benches.resnet import Side, build_pair
    arch, batch, size = ctx.s.resnet
    sides = {}
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(batch, 3, size, size, generator=g).to(ctx.device)
    y = torch.randint(0, 1000, (batch,), generator=g).to(ctx.device)
    rows = []
    precisions = [ctx.precision] + (["bf16"] if ctx.s.name != "test" and ctx.precision != "bf16" else [])
    for prec in precisions:
        for fmt in ("contiguous", "channels_last"):
            mf = harness.FORMATS[fmt]
            side = Side(fmt, build_pair(arch, 1000)[0].to(ctx.device, memory_format=mf))
            x = x0.contiguous(memory_format=mf)
            sides[fmt] = (lambda side=side, x=x, prec=prec: side.step(x, y, prec))
        r = ctx.rounds(sides)
        pm = r.paired("channels_last", "contiguous")
        ctx.add_speed(f"channels-last {arch} {prec}", pm.median, 1 + NOMINAL_SPEED_MEMORY)
        rows.append(Row(f"channels-last ({arch}, {prec})", "NHWC memory format is sometimes faster for ConvNets",
                        "000", "contiguous NCHW", "speed-up - 1", NOMINAL_SPEED_MEMORY, evidence="rounds",
                        samples=round_effects(r, "channels_last", "contiguous"),
                        speed=speed_text(pm, r.best("contiguous"), r.best("channels_last"), f"step ({batch}x3x{size}x{size})"),
                        numbers={"speedup": pm.median, "base_s": r.best("contiguous"), "tech_s": r.best("channels_last")}))
    return rows


def m_lora(ctx: Ctx) -> list[Row]:
    """Full fine-tuning against LoRA and QLoRA (the peft bench's runs, its state bytes)."""
    from train.benches import finetune
    shared = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"
    args = Namespace(config="configs/llm/tiny.yaml", layers=ctx.s.lora_layers, steps=ctx.s.lora_steps, batch=4,
                     seq=64, eval_batches=2, lr_full=3e-4, lr_adapter=3e-3, precision=[ctx.precision], threads=0,
                     data=str(shared) if shared.is_file() else None, out=str(ctx.work / "peft"))
    base = finetune.make_base(args)
    res = {}
    for name in ("full", "lora", "qlora"):
        rows = finetune.run(name, base, args)
        trainable, total, nbytes = finetune.state_bytes(base, finetune.RUNS[name])
        steps = [r for r in rows if "loss" in r]
        res[name] = {"trainable": trainable, "total": total, "state": nbytes, "weights": nbytes - 12 * trainable,
                     "peak_rss": max(r["peak_mem_gb"] for r in steps) * 2**30, "val": last(rows, "val_loss"),
                     "step_s": median_of(steps, "step_time_s"), "rows": rows}
    ctx.memory["fine-tuning (weights + grads + AdamW state)"] = {n: v["state"] / MiB for n, v in res.items()}
    ctx.plot_curves("lora_loss", f"full fine-tuning vs LoRA vs QLoRA ({ctx.s.lora_steps} steps)",
                    {n: v["rows"] for n, v in res.items()}, "loss", "training loss")
    f, lo, q = res["full"], res["lora"], res["qlora"]

    def desc(v):
        return (f"trainable {v['trainable'] / 1e6:.3f}M of {v['total'] / 1e6:.2f}M "
                f"({100 * v['trainable'] / v['total']:.2f}%); state {v['state'] / MiB:.1f} MiB; peak RSS "
                f"{v['peak_rss'] / 2**30:.2f} GiB")
    nums = {n: {k: v[k] for k in ("trainable", "total", "state", "weights", "peak_rss", "val", "step_s")}
            for n, v in res.items()}
    rows = [Row("LoRA (training state)", "training a low-rank update instead of the weights gives huge memory savings",
                "000/002", "full fine-tuning (AdamW)", "memory saved", NOMINAL_SPEED_MEMORY,
                memory=f"full: {desc(f)}; LoRA: {desc(lo)}",
                speed=f"step {f['step_s']:.3f} -> {lo['step_s']:.3f} s (median)",
                quality=f"val loss {f['val']:.3f} -> {lo['val']:.3f} after {ctx.s.lora_steps} steps", numbers=nums),
            Row("QLoRA (base weights)", "QLoRA keeps the frozen base in 4 bits (vs 16): ~75% less for the base weights",
                "000", "LoRA on a 16-bit base", "memory saved", 0.75,
                memory=f"weights {lo['weights'] / MiB:.1f} (fp32 base) -> {q['weights'] / MiB:.1f} MiB; QLoRA: {desc(q)}",
                speed=f"step {lo['step_s']:.3f} -> {q['step_s']:.3f} s (median)",
                quality=f"val loss {lo['val']:.3f} -> {q['val']:.3f}", numbers=nums)]
    for row in rows:
        lora_evidence(row)
    return rows


def m_averaging(ctx: Ctx) -> list[Row]:
    """Loop runs of the embedded default with an EMA and checkpoint averaging, one per seed: their val loss beside the final weights'."""
    steps = ctx.s.loop_steps
    decay = round(max(0.5, 1 - 10 / steps), 4)  # an averaging horizon of about a tenth of the run
    runs = [loop_run(ctx, f"averaging_s{seed}", ROOT / "configs" / "llm" / "tiny.yaml",
                     [f"train.max_steps={steps}", f"train.batch_size={ctx.s.loop_batch}", f"data.seq_len={ctx.s.loop_seq}",
                      "data.tokenizer=bytes", f"data.max_chars={ctx.s.max_chars}", f"train.ema_decay={decay}",
                      f"train.eval_every={max(1, steps // 4)}", f"train.checkpoint_every={max(1, steps // 4)}",
                      "train.average_last=2", "train.keep_checkpoints=2", "train.eval_batches=4",
                      f"optim.warmup_steps={max(1, steps // 10)}", f"train.precision={ctx.precision}",
                      f"train.log_every={max(1, steps // 20)}", f"train.seed={seed}"])
            for seed in range(ctx.seeds)]
    rows = runs[0]
    ctx.plot_curves("averaging_loss", f"final weights vs EMA (decay {decay}) during training (seed 0)",
                    {"weights (val)": rows, "EMA (val)": [dict(r, val_loss=r["ema_val_loss"]) if "ema_val_loss" in r
                                                          else r for r in rows]}, "val_loss", "validation loss")
    vals = {k: [last(r, k) for r in runs] for k in ("val_loss", "ema_val_loss", "avg_val_loss")}
    base, ema, avg = vals["val_loss"], vals["ema_val_loss"], vals["avg_val_loss"]
    q = (f"val loss (mean of {len(runs)} seeds): final weights {statistics.fmean(base):.4f}, EMA "
         f"{statistics.fmean(ema):.4f}, average of last 2 checkpoints {statistics.fmean(avg):.4f}")
    nums = {"val_loss": base, "ema_val_loss": ema, "avg_val_loss": avg, "ema_decay": decay, "steps": steps}
    return [Row("checkpoint averaging", "averaging the last checkpoints smooths the loss landscape: lower loss, "
                "less overfitting", "000", "final weights", "relative val-loss reduction", NOMINAL_QUALITY,
                samples=[(b - a) / b for b, a in zip(base, avg)], quality=q, numbers=nums),
            Row("EMA of the weights", "an exponential moving average of the weights evaluates better than the weights",
                "000", "final weights", "relative val-loss reduction", NOMINAL_QUALITY,
                samples=[(b - e) / b for b, e in zip(base, ema)], quality=q, numbers=nums)]


def _llm_runs_args(ctx: Ctx, other: str, seed: int):
    """The moe-quality / mod-quality benches' arguments and runs for one seed: one out folder per
    seed, so that the dense run is made once and read by the second comparison (the benches reuse
    a finished run)."""
    from train.benches import mod_quality, moe_quality
    runs = {n: (cfg, [*extra, f"train.seed={seed}"]) for n, (cfg, extra) in {**moe_quality.RUNS, **mod_quality.RUNS}.items()}
    return Namespace(steps=ctx.s.loop_steps, batch=ctx.s.loop_batch, seq=ctx.s.loop_seq, evals=8, eval_every=0,
                     eval_batches=4 if ctx.s.name != "full" else 20, precision=ctx.precision, threads=0,
                     out=str(ctx.work / f"llm_s{seed}"), runs=["dense", other]), runs


def _wall(rows):
    return sum(r["step_time_s"] * (r["step"] - p) for r, p in
               zip([r for r in rows if "step_time_s" in r], [0] + [r["step"] for r in rows if "step_time_s" in r]))


def lm_rows(runs: dict[str, list]) -> dict[str, list]:
    """The runs' metrics rows with `loss` the cross-entropy alone (`lm_loss`, where a run adds auxiliary losses)."""
    return {n: [dict(r, loss=r["lm_loss"]) if "lm_loss" in r else r for r in rows] for n, rows in runs.items()}


def wall_to(rows: list[dict], step: int) -> float:
    """Training seconds of a run up to `step` (its logged step times)."""
    return _wall([r for r in rows if r.get("step", 0) <= step])


def time_to_loss(rows: list[dict], target: float) -> tuple[Optional[int], float]:
    """The first evaluated step whose val loss is at or below `target` and the training seconds to
    it; (None, the whole run's seconds) when the run never gets there."""
    hit = next((r["step"] for r in rows if "val_loss" in r and r["val_loss"] <= target), None)
    return hit, (wall_to(rows, hit) if hit is not None else _wall(rows))


def m_moe(ctx: Ctx) -> list[Row]:
    """Dense against MoE (the same active parameters per token, so the same FLOPs per token): the
    training time MoE takes to reach the dense run's final val loss, per seed (the moe-quality bench's runs)."""
    from train.benches import moe_quality
    per_seed, samples = [], []
    for seed in range(ctx.seeds):
        args, runs = _llm_runs_args(ctx, "moe", seed)
        res = {n: moe_quality.run(n, args, runs) for n in ("dense", "moe")}
        if seed == 0:
            ctx.plot_curves("moe_loss", "dense vs MoE (same active parameters and tokens): training cross-entropy (seed 0)",
                            lm_rows(res), "loss", "training loss (cross-entropy)")
            ctx.plot_curves("moe_val", "dense vs MoE: validation loss (seed 0)", res, "val_loss", "validation loss")
        d, m = (moe_quality.summary(n, res[n]) for n in ("dense", "moe"))
        step, t_moe = time_to_loss(res["moe"], d["val_loss"])
        t_dense = _wall(res["dense"])
        per_seed.append({"dense_val": d["val_loss"], "moe_val": m["val_loss"], "dense_s": t_dense, "moe_s_to_dense_loss": t_moe,
                         "moe_step_to_dense_loss": step, "dense_steps": args.steps, "dense_tok_s": d["tok_s"],
                         "moe_tok_s": m["tok_s"]})
        samples.append(t_dense / t_moe - 1)
    reached = sum(p["moe_step_to_dense_loss"] is not None for p in per_seed)
    sp = statistics.fmean(p["moe_tok_s"] / p["dense_tok_s"] for p in per_seed)
    ctx.add_speed("MoE tokens/s (median)", sp)
    steps_txt = ", ".join(str(p["moe_step_to_dense_loss"] or f"> {p['dense_steps']}") for p in per_seed)
    return [Row("MoE (equal compute)", "a Mixture-of-Experts reaches a given loss sooner than a dense model of the "
                "same compute", "000", "dense (same active parameters)", "speed-up - 1 (time to dense's final val loss)",
                NOMINAL_SPEED_MEMORY, samples=samples,
                quality=f"MoE reached dense's final val loss ({ctx.s.loop_steps} steps) at step {steps_txt} "
                        f"(evaluated every {max(1, args.steps // args.evals)} steps; equal FLOPs per token, so the "
                        f"FLOPs ratio is the steps ratio) in {reached} of {len(per_seed)} seeds; where it did not, the "
                        f"sample is dense's time over MoE's whole run, an upper bound",
                speed=f"tokens/s ratio {sp:.2f}x (medians of separate runs, not paired)",
                numbers={"per_seed": per_seed})]


def m_mod(ctx: Ctx) -> list[Row]:
    """Dense against Mixture-of-Depths at equal training FLOPs, per seed, judged on MoD's causal
    validation loss (every MoD layer routing by the causal decision, as decoding does; the top-k
    routing of the loop's evaluation looks at later tokens): the mod-quality bench's runs."""
    from train.benches import mod_quality
    per_seed = []
    for seed in range(ctx.seeds):
        args, runs = _llm_runs_args(ctx, "mod", seed)
        budget, fpt, steps, res = mod_quality.equal_flops_runs(args, runs)
        if seed == 0:
            ctx.plot_curves("mod_loss", f"dense vs Mixture-of-Depths at equal training FLOPs ({budget:.2g}): training "
                            f"cross-entropy (seed 0)", lm_rows(res), "loss", "training loss (cross-entropy)")
            ctx.plot_curves("mod_val", "dense vs Mixture-of-Depths at equal training FLOPs: validation loss (top-k, seed 0)",
                            res, "val_loss", "validation loss")
        per_seed.append({"dense_val": last(res["dense"], "val_loss"), "mod_val_topk": last(res["mod"], "val_loss"),
                         "mod_val_causal": last(res["mod"], "val_loss_causal"),
                         "dense_tok_s": median_of(res["dense"], "tokens_per_s"),
                         "mod_tok_s": median_of(res["mod"], "tokens_per_s"), "steps": steps})
    mean = lambda k: statistics.fmean(p[k] for p in per_seed)  # noqa: E731
    sp = mean("mod_tok_s") / mean("dense_tok_s")
    ctx.add_speed("MoD tokens/s (median)", sp)
    return [Row("Mixture-of-Depths (equal FLOPs)", "routing easy tokens around blocks spends compute where it helps: "
                "a better model for the same compute", "000", "dense, same training FLOPs",
                "relative val-loss reduction (MoD's causal routing)", NOMINAL_QUALITY,
                samples=[(p["dense_val"] - p["mod_val_causal"]) / p["dense_val"] for p in per_seed],
                quality=f"val loss (mean of {len(per_seed)} seeds) {mean('dense_val'):.4f} ({steps['dense']} steps) -> "
                        f"{mean('mod_val_causal'):.4f} causal, {mean('mod_val_topk'):.4f} top-k ({steps['mod']} steps)",
                speed=f"tokens/s {mean('dense_tok_s'):.0f} -> {mean('mod_tok_s'):.0f} ({sp:.2f}x; medians of separate runs, "
                      f"not paired); FLOPs/token {fpt['dense'] / 1e6:.1f}M -> {fpt['mod'] / 1e6:.1f}M",
                numbers={"per_seed": per_seed})]


def m_taesd(ctx: Ctx) -> list[Row]:
    """TAESD with 16 latent channels (the note's case): compression from the latent's shape, encode and decode time."""
    from zoo.diffusion.taesd import TAESD
    size = ctx.s.taesd_size
    torch.manual_seed(0)
    ae = TAESD(latent_channels=16).to(ctx.device).eval()
    x = torch.rand(1, 3, size, size, generator=torch.Generator().manual_seed(0)).to(ctx.device)
    with torch.inference_mode():
        z = ae.encode(x)
        r = ctx.rounds({"encode": lambda: ae.encode(x), "decode": lambda: ae.decode(z)})
    comp = x.numel() / z.numel()
    params = sum(p.numel() for p in ae.parameters())
    return [Row("TAESD latents", "a tiny autoencoder compresses 3x512x512 images 12x (16x64x64 latents) at little cost",
                "000", "pixel space", "compression - 1", 11.0, evidence="exact", samples=[comp - 1],
                unmeasured="the cost (reconstruction quality)",
                memory=f"{tuple(x.shape[1:])} -> {tuple(z.shape[1:])}: {comp:.1f}x fewer values",
                speed=f"encode {r.best('encode') * 1e3:.1f} ms, decode {r.best('decode') * 1e3:.1f} ms per "
                      f"{size}x{size} image ({params / 1e6:.2f}M params)",
                numbers={"compression": comp, "encode_s": r.best("encode"), "decode_s": r.best("decode")})]


def m_min_snr(ctx: Ctx) -> list[Row]:
    """Min-SNR-5 against uniform weighting at equal steps, per seed (the min-snr bench's runs)."""
    from train.benches import min_snr
    steps, per_seed = ctx.s.snr_steps, []
    for seed in range(ctx.seeds):
        res = min_snr.train_settings(str(ROOT / "configs" / "diffusion" / "digits.yaml"), "5,none",
                                     ctx.work / f"min_snr_s{seed}", steps, ctx.precision,
                                     [f"train.eval_every={max(1, steps // 4)}", f"data.ae_steps={ctx.s.ae_steps}",
                                      f"train.log_every={max(1, steps // 20)}", "train.checkpoint_every=0",
                                      f"optim.warmup_steps={max(1, steps // 16)}", f"train.device={ctx.device}",
                                      f"train.seed={seed}"],
                                     per_class=2 if ctx.s.name == "test" else 5, say=lambda m: None)
        g, u = res["gamma=5"], res["uniform"]
        if seed == 0:
            ctx.plot_curves("min_snr_val", "Min-SNR-5 vs uniform weighting: unweighted validation MSE (seed 0)",
                            {"min-snr-5": g["rows"], "uniform": u["rows"]}, "val_mse", "validation MSE (unweighted)")
        per_seed.append({"uniform_val_mse": u["curve"][-1][1], "min_snr_val_mse": g["curve"][-1][1],
                         "uniform_acc": u["accuracy"], "min_snr_acc": g["accuracy"]})
    mean = lambda k: statistics.fmean(p[k] for p in per_seed)  # noqa: E731
    return [Row("Min-SNR-gamma weighting", "weighting the loss by the timestep's SNR avoids conflicting gradients: "
                "faster convergence", "000", "uniform weighting", "relative val-MSE reduction", NOMINAL_QUALITY,
                samples=[(p["uniform_val_mse"] - p["min_snr_val_mse"]) / p["uniform_val_mse"] for p in per_seed],
                quality=f"val MSE {mean('uniform_val_mse'):.4f} -> {mean('min_snr_val_mse'):.4f} after {steps} steps; "
                        f"sample accuracy {mean('uniform_acc'):.2f} -> {mean('min_snr_acc'):.2f} (digits classifier; "
                        f"means of {len(per_seed)} seeds)",
                numbers={"per_seed": per_seed})]


SD_RATE = 0.5   # the last block's drop rate, linear from 0 at the first (Huang et al. 2016)


def m_stochastic_depth(ctx: Ctx) -> list[Row]:
    """Stochastic depth. Speed: training steps of the report's ResNet without drop path against
    blocks skipped for the whole batch (drop_path_mode=batch, as in Huang et al. 2016) and against
    the dropped samples' rows skipped (skip), at the paper's linear-decay rates (0 to 0.5), paired
    rounds. Quality: the digits ResNet with and without drop_path_rate 0.1, loop runs per seed."""
    import zoo
    from train.benches.resnet import Side
    from zoo.config import ConvNetConfig
    arch, batch, size = ctx.s.resnet
    size = max(size, 64)  # per-sample skip may leave one sample: the last stage's batch norm then needs 2x2 maps
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 3, size, size, generator=g).to(ctx.device).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (batch,), generator=g).to(ctx.device)
    sides = {}
    for name, rate, mode in (("none", 0.0, "mask"), ("batch", SD_RATE, "batch"), ("skip", SD_RATE, "skip")):
        torch.manual_seed(0)
        model = zoo.build(ConvNetConfig(arch=arch, num_classes=10, drop_path_rate=rate, drop_path_mode=mode))
        side = Side(name, model.train().to(ctx.device, memory_format=torch.channels_last))
        sides[name] = lambda side=side: side.step(x, y, ctx.precision)
    r = ctx.rounds(sides)
    pb, ps = r.paired("batch", "none"), r.paired("skip", "none")
    ctx.add_speed("stochastic depth (batch skip)", pb.median, 1 + NOMINAL_SPEED_MEMORY)
    speed = (f"{arch} {batch}x3x{size}x{size}, rates 0 -> {SD_RATE}: whole-batch skip "
             f"{speed_text(pb, r.best('none'), r.best('batch'))}; per-sample skip {ps}")
    steps, per_seed = ctx.s.sd_steps, []
    common = [f"train.max_steps={steps}", f"train.eval_every={max(1, steps // 4)}", f"train.log_every={max(1, steps // 20)}",
              f"optim.warmup_steps={max(1, steps // 10)}", f"train.precision={ctx.precision}", "train.ema_decay=null"]
    for seed in range(ctx.seeds):
        res = {name: loop_run(ctx, f"sd_{rate}_s{seed}", ROOT / "configs" / "convnet" / "resnet-digits.yaml",
                              common + [f"model.drop_path_rate={rate}", f"train.seed={seed}"])
               for name, rate in (("none", 0.0), ("0.1", 0.1))}
        if seed == 0:
            ctx.plot_curves("stochastic_depth_val", "ResNet on digits: stochastic depth 0.1 vs none (seed 0)", res,
                            "val_loss", "validation loss")
        b, t = res["none"], res["0.1"]
        per_seed.append({"base_val": last(b, "val_loss"), "tech_val": last(t, "val_loss"),
                         "base_acc": last(b, "val_acc1"), "tech_acc": last(t, "val_acc1")})
    mean = lambda k: statistics.fmean(p[k] for p in per_seed)  # noqa: E731
    q = (f"val loss {mean('base_val'):.4f} -> {mean('tech_val'):.4f}, top-1 {mean('base_acc'):.3f} -> "
         f"{mean('tech_acc'):.3f} after {steps} steps (means of {len(per_seed)} seeds)")
    return [Row("stochastic depth (speed)", "dropping whole residual blocks at random makes training faster", "000",
                "no drop path", "speed-up - 1", NOMINAL_SPEED_MEMORY, evidence="rounds",
                samples=round_effects(r, "batch", "none"), speed=speed, quality=q,
                numbers={"speedup": pb.median, "skip_speedup": ps.median, "rate": SD_RATE,
                         "base_s": r.best("none"), "tech_s": r.best("batch")}),
            Row("stochastic depth (quality)", "... and the model better", "000", "no drop path",
                "relative val-loss reduction", NOMINAL_QUALITY,
                samples=[(p["base_val"] - p["tech_val"]) / p["base_val"] for p in per_seed], speed=speed, quality=q,
                numbers={"per_seed": per_seed})]


def m_cuda_flags(ctx: Ctx) -> list[Row]:
    """TF32 matmuls (an fp32 LLM step) and cudnn.benchmark (a ResNet step): CUDA only."""
    tf32 = Row("TF32 matmuls", "TF32 runs fp32 matmuls at near-16-bit speed on Ampere and newer", "000", "fp32 matmuls",
               "speed-up - 1", NOMINAL_SPEED_MEMORY)
    bench = Row("cudnn.benchmark", "letting cuDNN pick the fastest convolution algorithm speeds ConvNets up", "000",
                "cudnn.benchmark off", "speed-up - 1", NOMINAL_SPEED_MEMORY)
    if ctx.device.type != "cuda":
        tf32.reason = bench.reason = f"no CUDA device here ({ctx.device.type})"
        return [tf32, bench]
    from train.benches.checkpointing import step_fn
    from train.benches.resnet import Side, build_pair
    fn = step_fn(ctx.cfg(ctx.s.llm, []), ctx.precision, ctx.device)

    def with_tf32(on):
        def call():
            old = torch.backends.cuda.matmul.allow_tf32
            torch.backends.cuda.matmul.allow_tf32 = on
            try:
                fn()
                ctx.sync()
            finally:
                torch.backends.cuda.matmul.allow_tf32 = old
        return call
    r = ctx.rounds({"off": with_tf32(False), "on": with_tf32(True)})
    pm = r.paired("on", "off")
    tf32.evidence, tf32.samples, tf32.speed = "rounds", round_effects(r, "on", "off"), speed_text(pm, r.best("off"), r.best("on"))
    tf32.numbers = {"speedup": pm.median}
    ctx.add_speed("TF32", pm.median, 1 + NOMINAL_SPEED_MEMORY)
    arch, batch, size = ctx.s.resnet
    side = Side("resnet", build_pair(arch, 1000)[0].to(ctx.device))
    x = torch.randn(batch, 3, size, size, device=ctx.device)
    y = torch.randint(0, 1000, (batch,), device=ctx.device)

    def with_bench(on):
        def call():
            old = torch.backends.cudnn.benchmark
            torch.backends.cudnn.benchmark = on
            try:
                side.step(x, y, ctx.precision)
                ctx.sync()
            finally:
                torch.backends.cudnn.benchmark = old
        return call
    r = ctx.rounds({"off": with_bench(False), "on": with_bench(True)}, warmup=2)
    pm = r.paired("on", "off")
    bench.evidence, bench.samples, bench.speed = "rounds", round_effects(r, "on", "off"), speed_text(pm, r.best("off"), r.best("on"))
    bench.numbers = {"speedup": pm.median}
    ctx.add_speed("cudnn.benchmark", pm.median, 1 + NOMINAL_SPEED_MEMORY)
    return [tf32, bench]


MEASUREMENTS: dict[str, Callable[[Ctx], list[Row]]] = {
    "precision": m_precision, "compile": m_compile, "fused": m_fused, "optimizers": m_optimizer_state,
    "checkpointing": m_checkpointing, "chunked-ce": m_chunked_ce, "grad-accum": m_grad_accum,
    "channels-last": m_channels_last, "lora": m_lora, "averaging": m_averaging, "moe": m_moe, "mod": m_mod,
    "taesd": m_taesd, "min-snr": m_min_snr, "stochastic-depth": m_stochastic_depth, "cuda-flags": m_cuda_flags,
}


# ---------------------------------------------------------------- the page
def hardware() -> dict:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    info = {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "python": platform.python_version(), "platform": platform.platform()}
    import importlib.metadata as md
    versions = {}
    for pkg in ("torch", "transformers", "torchao", "peft", "timm", "diffusers", "numpy", "matplotlib"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            versions[pkg] = "not installed"
    info["versions"] = versions
    return info


def load() -> Optional[tuple]:
    with contextlib.suppress(OSError, AttributeError):
        return os.getloadavg()
    return None


def busy_cpu_s() -> Optional[float]:
    """CPU seconds every process of the machine has used since boot (Linux /proc/stat: all but
    idle and iowait), or None elsewhere."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        fields = Path("/proc/stat").read_text().splitlines()[0].split()
        ticks = [int(v) for v in fields[1:9]]   # user nice system idle iowait irq softirq steal
        return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")
    return None


def own_cpu_s() -> float:
    """CPU seconds of this process and its finished children (the measurements' subprocesses)."""
    return sum(getattr(resource.getrusage(w), f) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
               for f in ("ru_utime", "ru_stime"))


def others_share(start: tuple, end: tuple, cores: int) -> Optional[float]:
    """The fraction of the machine's CPU time (wall x cores) that processes other than the report
    used between two (wall, machine busy CPU s, own CPU s) samples; None without /proc/stat."""
    if start[1] is None or end[1] is None or end[0] <= start[0]:
        return None
    others = (end[1] - start[1]) - (end[2] - start[2])
    return max(0.0, others / ((end[0] - start[0]) * max(1, cores)))


def fmt_value(row: Row, v: float) -> str:
    if row.kind == "equal":
        return f"{v:.1e}"
    if row.metric.startswith("speed-up") or row.metric.startswith("compression"):
        return f"{v + 1:.2f}x"
    return f"{100 * v:+.1f}%"


def fmt_effect(row: Row) -> str:
    """The estimate, its interval and what it rests on, and the threshold the claim's words set."""
    if row.effect is None:
        return "-"
    need = (f"tolerance {row.threshold:g}" if row.kind == "equal" else
            f"claim needs {fmt_value(row, row.threshold)}" if row.threshold is not None else "")
    if row.interval:
        lo, hi = row.interval
        basis = ("exact" if row.evidence == "exact" else
                 f"{CONFIDENCE:.0%} interval {fmt_value(row, lo)} to {fmt_value(row, hi)}, {row.n} {row.evidence}")
    else:
        basis = f"no interval: {row.missing}"
    return f"{fmt_value(row, row.effect)} ({basis}; {need})"


def page_meta(ctx: Ctx, started: str) -> dict:
    """What the page says about the run besides the rows (kept in report.json, so a re-judging can rewrite the page)."""
    return {"scale": ctx.s.name, "precision": ctx.precision, "rounds": ctx.n_rounds, "seeds": ctx.seeds,
            "device": str(ctx.device), "started": started, "plots": [list(p) for p in ctx.plots]}


def write_page(out: Path, rows: list[Row], meta: dict, info: dict, timing: dict, loads: tuple) -> Path:
    busy = [l for l in loads if l is not None]
    others = timing.get("others_share")
    shared = others is not None and others > SHARED
    s = SCALES[meta["scale"]]
    lines = ["# Techniques report", "",
             f"Measured by `python train/bench.py report{' --quick' if s.name == 'quick' else ''}` "
             f"(scale: {s.name}) on {meta['started']}; every number below comes from that run.", ""]
    if meta.get("rejudged"):
        lines += [f"Verdicts re-judged by `python train/bench.py report --rejudge` on {meta['rejudged']} from the "
                  f"numbers stored in report.json under the rule below (nothing re-measured); " + meta["rejudge_note"], ""]
    lines += [f"- CPU: {info['cpu']}, {info['cores']} logical cores, torch threads {info['torch_threads']}",
              f"- GPU: {info['gpu'] or 'none'}; device used: {meta['device']}",
              f"- Python {info['python']}, {info['platform']}",
              "- " + ", ".join(f"{k} {v}" for k, v in info["versions"].items()),
              f"- load average (1 min) at start {busy[0][0]:.2f}, at end {busy[-1][0]:.2f} (the report's own threads "
              f"included)" if busy else "- load average: unavailable",
              f"- total wall time {timing['total']:.0f} s; CPU time of the report's processes {timing['cpu']:.0f} s"
              + ("" if others is None else f"; other processes used {100 * others:.0f}% of the machine's CPU time "
                                           f"meanwhile (/proc/stat)")]
    if shared:
        lines.append(f"- **the machine was shared**: other processes used more than {100 * SHARED:.0f}% of its CPU "
                     f"time while the report ran, so speed figures are noisy; they are paired medians of alternating "
                     f"rounds (harness.py), which a slow spell moves least")
    lines += ["", "## The verdict rule", "", RULE, "",
              "Claims paraphrase the source notes (000: tips and tricks list, 001: long optimizer/memory discussion, "
              "002: LLM speed-ups, 003: cookbook, 004: trainer techniques); notes are not papers, and a claim made for "
              "GPUs (tensor cores) is measured here on whatever this machine is.", "",
              "## Results", "",
              "| technique | claim (note) | baseline | speed | memory | quality | effect: estimate (interval, samples; threshold) | ratio | verdict |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio_s = "-" if r.ratio is None else f"{r.ratio:.2f}"
        v = r.verdict if r.verdict != "skipped" else f"skipped: {r.reason}"
        if r.unmeasured:
            v += f" (not measured: {r.unmeasured})"
        cells = [r.technique, f"{r.claim} ({r.source})", r.baseline, r.speed, r.memory, r.quality, fmt_effect(r), ratio_s,
                 f"**{v}**"]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    kinds = ("holds", "partly", "does not hold", "inconclusive", "no verdict", "skipped")
    counts = {k: sum(r.verdict.startswith(k) for r in rows) for k in kinds}
    lines += ["", "Verdicts: " + ", ".join(f"{k} {v}" for k, v in counts.items()), "", "## Plots", ""]
    for title, png in meta["plots"]:
        lines += [f"**{title}**", "", f"![{title}]({png})", ""]
    lines += ["## How each was measured", ""]
    for key, fn in MEASUREMENTS.items():
        if key in timing["parts"]:
            doc = " ".join((fn.__doc__ or "").split())
            lines.append(f"- **{key}** ({timing['parts'][key]:.0f} s): {doc}")
    lines += ["", f"Scale `{s.name}`, comparisons not about precision in {meta['precision']}: LLM step d_model {s.llm['model']['d_model']}, {s.llm['model']['n_layers']} layers, "
              f"vocab {s.llm['model']['vocab_size']}, batch {s.llm['train']['batch_size']} x {s.llm['data']['seq_len']}; "
              f"optimizer model d_model {s.opt_model['d_model']}, {s.opt_model['n_layers']} layers, vocab "
              f"{s.opt_model['vocab']}; {meta['rounds']} alternating rounds per timing; {meta['seeds']} seed(s) per quality "
              f"comparison and repeat(s) per measured peak; ResNet {s.resnet[0]} batch {s.resnet[1]} "
              f"at {s.resnet[2]}px; loop runs: LLM {s.loop_steps} steps of {s.loop_batch} x {s.loop_seq}, diffusion "
              f"{s.snr_steps} steps, ResNet {s.sd_steps} steps, fine-tuning {s.lora_steps} steps. Memory: "
              + ("the planner's measured step peak in a fresh process (train.plan.measure: high-water mark over the "
                 "process at rest, plus the tensors at rest)." if not meta["device"].startswith("cuda") else
                 "torch.cuda.max_memory_allocated across a steady-state step.")]
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def write_json(out: Path, rows: list[Row], meta: dict, info: dict, timing: dict, loads) -> None:
    (out / "report.json").write_text(json.dumps({"scale": meta["scale"], "page": meta, "hardware": info, "loads": loads,
                                                 "timing": timing, "rows": [dataclasses.asdict(r) for r in rows]},
                                                indent=1, default=str) + "\n")


def run_report(out: Path, scale: Scale, only: Optional[list[str]] = None, say=print, precision: str = "fp32",
               rounds: Optional[int] = None, seeds: int = MIN_SEEDS) -> tuple[list[Row], Path]:
    """Runs the measurements (all, or `only`), writes out/report.md, report.json and the plots.
    `precision`: of every comparison not about precision; `rounds`: alternating rounds per timing
    (default: the scale's); `seeds`: of every quality comparison, and repeats of every measured
    peak. Returns the rows and the page's path."""
    from train.hardware import keep_freed_memory, release_freed_memory
    from train.step import resolve_device
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.png"):
        old.unlink()
    device = resolve_device("auto")
    ctx = Ctx(scale, out, device, say, precision, rounds, seeds)
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    info, loads = hardware(), [load()]
    cpu_start = (time.perf_counter(), busy_cpu_s(), own_cpu_s())
    kept = device.type == "cpu" and keep_freed_memory()  # as the loop and the step benchmarks run (cpu_keep_memory)
    rows, timing, t_all = [], {"parts": {}}, time.perf_counter()
    try:
        for key, fn in MEASUREMENTS.items():
            if only and key not in only:
                continue
            say(f"report: {key} ...")
            t0 = time.perf_counter()
            try:
                got = fn(ctx)
            except Exception as e:  # one failed measurement is reported as such; the others still run
                say(f"report: {key} failed: {type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}")
                got = [Row(key, "-", "-", "-", "-", 1.0, reason=f"failed: {type(e).__name__}: {str(e)[:160]}")]
            for r in got:
                r.measurement = key
                r.decide()
                say(f"  {r.technique}: {fmt_effect(r)} -> {r.verdict}" + (f" ({r.reason})" if r.reason else ""))
            rows += got
            timing["parts"][key] = time.perf_counter() - t0
            say(f"report: {key} took {timing['parts'][key]:.0f} s ({time.perf_counter() - t_all:.0f} s so far)")
    finally:
        if kept:
            release_freed_memory()
        shutil.rmtree(ctx.work, ignore_errors=True)  # the runs' folders (their numbers are in the rows)
    loads.append(load())
    if ctx.speed:
        plots.speed_bars(ctx.speed, ctx.speed_claimed, out / "speed.png", "speed-up of each technique over its baseline")
        ctx.plots.insert(0, ("speed-up over the baseline", "speed.png"))
    if ctx.memory:
        plots.memory_bars(ctx.memory, out / "memory.png", "memory: baseline (grey) and technique")
        ctx.plots.insert(1 if ctx.speed else 0, ("memory", "memory.png"))
    timing["total"] = time.perf_counter() - t_all
    timing["cpu"] = own_cpu_s()
    timing["others_share"] = others_share(cpu_start, (time.perf_counter(), busy_cpu_s(), timing["cpu"]),
                                          info["cores"] or 1)
    meta = page_meta(ctx, started)
    page = write_page(out, rows, meta, info, timing, tuple(loads))
    write_json(out, rows, meta, info, timing, loads)
    return rows, page


ROUND_RANGE = re.compile(r"([0-9.]+)x \(([0-9.]+)-([0-9.]+)x\)")


def stored_evidence(row: Row, rounds: int) -> Row:
    """A row of a report measured before the rule above, made judgeable from its stored numbers alone:
    what its effect rests on (an exact count, the range of its paired rounds, one seed, one
    measurement), and the threshold its claim's words set (THRESHOLDS)."""
    n, text = row.numbers, row.speed
    row.threshold = THRESHOLDS.get(row.technique, row.claimed)
    row.interval, row.samples, row.missing = None, [], ""
    if row.effect is None:
        return row
    m = ROUND_RANGE.search(text) if row.metric == "speed-up - 1" else None
    if row.kind == "equal" or ("base_bytes" in n and "tech_bytes" in n) or row.metric.startswith("compression"):
        row.evidence, row.samples = "exact", [row.effect]          # counted bytes, shapes, a deterministic difference
    elif row.measurement == "lora":
        lora_evidence(row)
    elif m and median_rank(rounds):
        lo, hi = float(m.group(2)), float(m.group(3))
        n["round_range"], n["rounds"] = [lo, hi], rounds
        # the range of n >= 6 paired rounds holds the order-statistic interval of the median ratio
        row.evidence, row.n, row.interval = "rounds", rounds, [lo - 1, hi - 1]
    elif row.metric == "speed-up - 1":
        row.evidence, row.n, row.missing = "rounds", 0, "medians of two separate runs, not paired rounds"
    elif "base_peak" in n:
        row.evidence, row.n, row.missing = "repeats", 1, "one measurement of each peak"
    else:
        row.evidence, row.n, row.missing = "seeds", 1, "one seed"
    if row.measurement == "taesd":
        row.unmeasured = "the cost (reconstruction quality)"
    return row


def lora_evidence(row: Row) -> None:
    """LoRA and QLoRA from the counted bytes: the claims are about training memory, whose measured
    peak (each run's peak RSS, one run each at a shape where weights do not dominate) is not yet a
    sample; QLoRA against LoRA on a 16-bit base (the fp32 base bytes halved, the adapters kept in fp32)."""
    full, lora, q = (row.numbers[k] for k in ("full", "lora", "qlora"))
    row.evidence, row.unmeasured = "exact", (f"measured peak memory (peak RSS {full['peak_rss'] / 2**30:.2f} / "
                                             f"{lora['peak_rss'] / 2**30:.2f} / {q['peak_rss'] / 2**30:.2f} GiB "
                                             f"full / LoRA / QLoRA, one run each, at a shape where the weights do not dominate)")
    row.effect = None
    if row.technique.startswith("QLoRA"):
        adapters = 4 * lora["trainable"]
        half = (lora["weights"] - adapters) / 2 + adapters
        row.numbers["lora_16bit_weights"] = half
        row.baseline = "LoRA on a 16-bit base (the stored fp32 base bytes halved)"
        row.samples = [1 - q["weights"] / half]
    else:
        row.samples = [1 - lora["state"] / full["state"]]


def rejudge(out: Path) -> list[Row]:
    """Recomputes every verdict of out/report.json from its stored numbers under the rule above and
    rewrites report.json and report.md (the plots stay). Returns the rows."""
    data = json.loads((out / "report.json").read_text())
    page = (out / "report.md").read_text()
    meta = data.get("page")
    if meta is None:   # a report written before report.json kept the page's settings: read them off the page
        got = re.search(r"\) on (.+?); every number below", page), re.search(r"(\d+) alternating rounds per timing", page)
        prec = re.search(r"comparisons not about precision in (\w+)", page)
        if not all(got) or not prec:
            raise SystemExit(f"{out / 'report.md'}: cannot read the run's date and rounds off the page")
        meta = {"scale": data["scale"], "precision": prec.group(1), "rounds": int(got[1].group(1)), "seeds": 1,
                "device": "cuda" if data["hardware"]["gpu"] else "cpu", "started": got[0].group(1),
                "plots": [list(t) for t in re.findall(r"\*\*([^*]+)\*\*\n\n!\[[^\]]*\]\(([^)]+\.png)\)", page)]}
    fields = {f.name for f in dataclasses.fields(Row)}
    rows = []
    for d in data["rows"]:
        old = d.get("verdict", "")
        row = Row(**{k: v for k, v in d.items() if k in fields})
        if "samples" not in d or not d["samples"]:
            stored_evidence(row, meta["rounds"])
        row.decide()
        if old != row.verdict:
            row.numbers.setdefault("verdicts_before", []).append(old)
        rows.append(row)
    meta["rejudged"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    meta["rejudge_note"] = ("rows that rest on one seed or one measurement have no verdict until re-measured over "
                            "seeds; a row whose verdict changed keeps the earlier one in numbers.verdicts_before "
                            "(report.json).")
    write_page(out, rows, meta, data["hardware"], data["timing"], tuple(data["loads"]))
    write_json(out, rows, meta, data["hardware"], data["timing"], data["loads"])
    return rows


def main(argv=None):
    ap = harness.parser("report", __doc__, precision="fp32", rounds=False)
    ap.add_argument("--quick", action="store_true", help="small shapes, few rounds and steps (under 15 minutes)")
    ap.add_argument("--scale", choices=list(SCALES), default=None, help=argparse.SUPPRESS)  # test: the test suite's tiny size
    ap.add_argument("--out", default="runs/report", help="folder for report.md, report.json and the PNGs")
    ap.add_argument("--only", type=harness.name_list(MEASUREMENTS, "measurement"), default=None,
                    help=f"comma list of {', '.join(MEASUREMENTS)} (default: all)")
    ap.add_argument("--rounds", type=harness.positive_int, default=None,
                    help="alternating rounds per timing (default: 6 with --quick, 8 without; at least 6 for a 95%% interval)")
    ap.add_argument("--seeds", type=harness.positive_int, default=MIN_SEEDS,
                    help=f"seeds of every quality comparison, and repeats of every measured peak (default {MIN_SEEDS}; "
                         f"fewer than {MIN_SEEDS} gives those rows no verdict)")
    ap.add_argument("--rejudge", action="store_true",
                    help="measure nothing: recompute every verdict of OUT/report.json from its stored numbers under "
                         "the current rule, rewrite report.json and report.md")
    args = ap.parse_args(argv)
    if args.rejudge:
        rows = rejudge(Path(args.out))
        for r in rows:
            print(f"{r.technique}: {fmt_effect(r)} -> {r.verdict}")
        return 0
    if len(args.precision) != 1:
        ap.error("--precision: one precision, for every comparison not about precision")
    if args.threads:
        torch.set_num_threads(args.threads)
    scale = SCALES[args.scale or ("quick" if args.quick else "full")]
    t0 = time.perf_counter()
    rows, page = run_report(Path(args.out), scale, args.only, say=lambda m: print(m, flush=True),
                            precision=args.precision[0], rounds=args.rounds, seeds=args.seeds)
    print(f"\n{page} ({len(rows)} rows, {time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
