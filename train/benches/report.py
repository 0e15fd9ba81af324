"""The techniques report: every claim of the source notes measured against its baseline on this machine.

    python train/bench.py report --seeds 3 --out docs/report   # the committed report (docs/report/report.md)
    python train/bench.py report --quick --only precision,compile

The rule (a verdict from a 95% interval), the measurements and the page (report.md, report.json).
"""
from __future__ import annotations

import dataclasses
import json
import math
import shutil
import statistics
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

from train import plots
from train.benches import checkpointing, convnets, diffusion, harness, llm_quality, optimizers
from train.benches.harness import ROOT, llm_base

# ---------------------------------------------------------------- the rule
CONFIDENCE, MIN_SEEDS, APPROX = harness.LEVEL, 3, 0.9   # "~X" is met from 90% of X
NOMINAL, NOMINAL_QUALITY = 0.10, 0.01                   # "faster" / "less memory" / "better" without a number
EVIDENCE = ("seeds", "rounds", "repeats", "exact")
SHARED = 0.25   # the page says "shared" when other processes used more of the CPU time than this
RULE = " ".join(f"""
Every effect is in the claim's own units, positive in the claimed direction (speed-up - 1: the baseline's
step time over the technique's within a round; memory saved as a fraction of the baseline's; relative loss reduction;
compression - 1), with a {CONFIDENCE:.0%} interval: quality over at least {MIN_SEEDS} seeds (the mean and its
Student-t interval), speed over paired alternating rounds (the median ratio and its distribution-free interval
from the order statistics of the per-round ratios: 6 rounds or more), measured peak memory over at least
{MIN_SEEDS} repeats (t interval), counts (bytes of tensors, shapes, a deterministic difference) exactly. The
threshold is what the claim's words require: a number it states ("~X" is met from {APPROX:.0%} of X; "stateless"
only by zero state), else {NOMINAL:.0%} for speed and memory and {NOMINAL_QUALITY:.0%} lower loss. **holds**:
the interval lies on the claimed side of zero and the estimate meets the threshold (and no part of the claim
went unmeasured); **partly**: on the claimed side, short of the threshold (or a part unmeasured); **does not
hold**: on the other side (or exactly zero); **inconclusive**: it straddles zero. No verdict from fewer than
{MIN_SEEDS} seeds or repeats, nor without an interval (the row says why). A claimed equality holds when the
difference's interval is within the tolerance, does not beyond it, is inconclusive otherwise. **skipped** (with
the reason): this hardware lacks the feature, or the measurement failed. Ratio = estimate / threshold.""".split())


def estimate(samples: list, evidence: str) -> tuple[Optional[float], Optional[tuple], str]:
    """The effect's estimate and interval from its samples (one per seed, round or repeat; one value for an exact
    count), and without an interval, why not."""
    if evidence not in EVIDENCE:
        raise ValueError(f"evidence must be one of {EVIDENCE}, got {evidence!r}")
    xs = [float(x) for x in samples]
    if not xs or not all(math.isfinite(x) for x in xs):
        return None, None, "no finite measurement"
    if evidence == "exact":
        if len(set(xs)) != 1:
            raise ValueError(f"an exact count has one value, got {xs}")
        return xs[0], (xs[0], xs[0]), ""
    n, s = len(xs), sorted(xs)
    if evidence == "rounds":
        k = harness.median_rank(n, CONFIDENCE)
        if k is None:
            return statistics.median(xs), None, f"{n} rounds: too few for a {CONFIDENCE:.0%} interval"
        return statistics.median(xs), (s[k - 1], s[n - k]), ""
    m, half = harness.mean_interval(xs, CONFIDENCE)
    if n < MIN_SEEDS:
        what = "seed" if evidence == "seeds" else "measurement"
        return m, None, f"one {what}" if n == 1 else f"{n} {what}s (at least {MIN_SEEDS} needed)"
    return m, (m - half, m + half), ""


def verdict(est, interval, threshold: float, kind: str = "gain", missing: str = "", unmeasured: str = "") -> str:
    """The rule, once: `threshold` what the claim's words require (kind 'gain') or the tolerance ('equal')."""
    if kind not in ("gain", "equal") or threshold is None or threshold <= 0:
        raise ValueError(f"kind must be 'gain' or 'equal', got {kind!r}" if kind not in ("gain", "equal")
                         else f"a claim's threshold must be > 0, got {threshold}")
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
    return "does not hold" if hi < 0 or lo == hi == 0 else "inconclusive"


SPEED, MEM, LOSS, ADAM = "speed-up - 1", "memory saved", "relative val-loss reduction", "AdamW (fp32 states)"
OWN = "Zoo's own"   # a row no note names (its cite says which note's words are nearest)
CLAIMS = {  # key: the claim (in our words), the note's words it tests, the baseline, the metric, the threshold its words set
    "bf16 autocast (speed)": ("mixed precision makes training ~2x faster", '000: "faster calculations (~2x)"', "fp32",
                              SPEED, APPROX * 2 - 1),
    "fp16 autocast (speed)": ("fp16 mixed precision makes training ~2x faster, on tensor cores",
                              '000: "faster calculations (~2x)"; "only faster on consumer cards due to Tensor cores"',
                              "fp32", SPEED, APPROX * 2 - 1),
    "precision (memory)": ("16-bit mixed precision cuts training memory 2-4x where activations dominate",
                           '004: "can reduce memory usage by 2-4x"; 002: "training memory is usually dominated by the '
                           'forward activations"', "fp32", MEM, 0.5),
    "torch.compile": ("compiling the model speeds training up (when it works)",
                      '001: "eventually accelerates the model training"', "eager", SPEED, NOMINAL),
    "fused AdamW": ("a fused AdamW update is faster than the unfused one", '004: "fuse multiple operations for faster '
                    'speed"', "AdamW for-each", SPEED, NOMINAL),
    "adamw8bit (state memory)": ("8-bit states: ~75% less optimizer-state memory than 32-bit Adam",
                                 '000: "2*8-bit vs 2*32-bit = ~75% less memory for optimizer states"', ADAM, MEM,
                                 APPROX * 0.75),
    "lion (state memory)": ("Lion keeps no second moment: stateless compared with Adam's two states",
                            '000: "SGD, Lion. In contrast to e.g. Adam these don\'t store additional '
                            'momentum variables"', ADAM, MEM, 1.0),
    "sgd (state memory)": ("SGD is stateless: none of Adam's two extra copies of the model",
                           '001: "SGD is simply stateless"', ADAM, MEM, 1.0),
    "adafactor (state memory)": ("Adafactor is more memory-efficient than AdamW",
                                 '004: "or adafactor can be more memory efficient"', ADAM, MEM, NOMINAL),
    "activation checkpointing": ("recomputing activations in backward cuts training memory a lot, for some extra "
                                 "compute", '003: "Significantly reduces memory usage at the cost of increased '
                                 'computation time"', "no checkpointing", MEM, NOMINAL),
    "chunked cross-entropy": ("computing the loss in chunks removes the memory spike at the end of the forward",
                              '000: "non-global Cross-Entropy calculation reduces memory usage spike at the end"',
                              "loss on the full logits", MEM, NOMINAL),
    "gradient accumulation (gradients)": ("k micro-batches accumulated give the gradient of one k-times larger batch "
                                          "(tolerance 1e-05, fp32 summation order)",
                                          '000: "calling opt.step() less frequently what results in effectively '
                                          'higher batch size"', "one batch", "max relative gradient difference", 1e-5),
    "gradient accumulation (memory)": ("accumulation trains a large batch in the memory of a micro-batch",
                                       '003: "Simulates larger batch sizes without increasing memory requirements"',
                                       "one batch", MEM, NOMINAL),
    "channels-last": ("NHWC memory format is sometimes faster for ConvNets",
                      '000: "(NCHW => NHWC), sometimes it\'s faster"', "contiguous NCHW", SPEED, NOMINAL),
    "LoRA (training state)": ("training a low-rank update instead of the weights gives huge memory savings",
                              '000: "matrices that gives huge memory savings"', "full fine-tuning (AdamW)", MEM,
                              NOMINAL),
    "QLoRA (base weights)": ("QLoRA keeps the frozen base in 4 bits (vs 16): ~75% less for the base weights",
                             '000: "base model is quantized (usually to 4-bit) but LoRA layers are kept in 16-bit"',
                             "LoRA on a 16-bit base (the stored fp32 base bytes halved)", MEM, APPROX * 0.75),
    "checkpoint averaging": ("a weighted average of the last checkpoints (newest weighted most) gives a lower loss at "
                             "equal steps", '000: "weighted average of previous checkpoints makes loss landscape more '
                             'smooth and convex which speeds up training + reduces overfitting"', "final weights",
                             LOSS, NOMINAL_QUALITY),
    "EMA of the weights": ("an exponential moving average of the weights evaluates better than the weights",
                           f'{OWN} (nearest, 000: "weighted average of previous checkpoints")', "final weights",
                           LOSS, NOMINAL_QUALITY),
    "MoE (equal compute)": ("a Mixture-of-Experts reaches a lower loss than a dense model on the same training FLOPs",
                            '000: "MoE faster achives same loss under the same computational budged compared to dense '
                            'models"', "dense (same active parameters)",
                            "relative val-loss reduction at equal training FLOPs", NOMINAL_QUALITY),
    "Mixture-of-Depths (equal FLOPs)": ("routing easy tokens around blocks spends compute where it helps: a better "
                                        "model for the same compute",
                                        '000: "model learns to not waste compute on easy tokens"',
                                        "dense, same training FLOPs",
                                        "relative val-loss reduction (MoD's causal routing)", NOMINAL_QUALITY),
    "TAESD latents": ("a tiny autoencoder compresses 3x512x512 images 12x (16x64x64 latents) at little cost",
                      '000: "=12× ... minimal computational overhead"', "pixel space", "compression - 1", 11.0),
    "Min-SNR-gamma weighting": ("weighting the loss by the timestep's SNR avoids conflicting gradients: faster "
                                "convergence (the paper's words), so better samples at equal steps",
                                '000: "prevents conflicting gradients from different deniosing phases"',
                                "uniform weighting", "relative classifier-FD reduction of samples at equal steps",
                                NOMINAL_QUALITY),
    "stochastic depth (speed)": ("dropping whole residual blocks at random makes training faster",
                                 '000: "Simply dropout whole layers (prevents vanishing gradients, faster training"',
                                 "no drop path", SPEED, NOMINAL),
    "stochastic depth (quality)": ("... and the deep ConvNet better", '000: "each layer in deep ConvNet have '
                                   'probability of not being dropped from 1.0 (for first layer) to 0.5 (for last '
                                   'layer)"; "better performance"', "no drop path", LOSS, NOMINAL_QUALITY),
    "TF32 matmuls": ("TF32 runs fp32 matmuls at near-16-bit speed on Ampere and newer",
                     '000: "at speeds similar to FP16. TF32 is supported on Ampere arch and newer"', "fp32 matmuls",
                     SPEED, NOMINAL),
    "cudnn.benchmark": ("letting cuDNN pick the fastest convolution algorithm speeds ConvNets up",
                        '000: "torch.backends.cudnn.benchmark = True"',
                        "cudnn.benchmark off", SPEED, NOMINAL),
}


@dataclass
class Row:
    technique: str
    claim: str
    source: str
    baseline: str
    metric: str
    threshold: float             # what the claim's words require (kind equal: the tolerance)
    kind: str = "gain"
    evidence: str = "seeds"      # what the samples are: seeds, rounds, repeats or exact (RULE)
    samples: list = field(default_factory=list)
    speed: str = "-"
    memory: str = "-"
    quality: str = "-"
    numbers: dict = field(default_factory=dict)  # the measured values the texts come from
    reason: str = ""             # why skipped
    unmeasured: str = ""         # a part of the claim not measured (caps the verdict at partly)
    measurement: str = ""
    effect: Optional[float] = None
    interval: Optional[list] = None
    n: int = 0
    missing: str = ""
    verdict: str = ""
    ratio: Optional[float] = None

    def decide(self) -> "Row":
        if self.samples:
            self.effect, iv, self.missing = estimate(self.samples, self.evidence)
            self.interval, self.n = (list(iv) if iv else None), len(self.samples)
        self.verdict = verdict(self.effect, self.interval, self.threshold, self.kind, self.missing, self.unmeasured)
        self.ratio = None if self.effect is None or not math.isfinite(self.effect) else self.effect / self.threshold
        self.reason = self.reason or ("no measurement" if self.verdict == "skipped" else "")
        return self


def row(key: str, name: str = "", **kw) -> Row:
    claim, source, baseline, metric, threshold = CLAIMS[key]
    ps = kw.get("numbers", {}).get("per_seed")
    if ps:  # the means over the seeds beside them
        kw["numbers"].update({f"mean_{k}": statistics.fmean(p[k] for p in ps) for k in ps[0]
                              if all(type(p[k]) in (int, float) for p in ps)})
    return Row(name or key, claim, source, kw.pop("baseline", baseline), metric, threshold,
               kind="equal" if metric.startswith("max") else "gain", **kw)


# ---------------------------------------------------------------- the measurements
def _scale(name, rounds, llm, mem, opt, resnet, accum, loop, snr, sd, lora, taesd, compile=True, max_chars=6_000_000):
    opt = SimpleNamespace(**dict(zip(("d_model", "n_layers", "n_heads", "vocab"), opt)))  # optimizers.build_model's
    return SimpleNamespace(name=name, rounds=rounds, llm=llm, mem=mem, opt=opt, resnet=resnet, accum=accum,
                           loop_steps=loop[0], loop_batch=loop[1], loop_seq=loop[2], snr_steps=snr[0], ae_steps=snr[1],
                           snr_per_class=snr[2], judge_steps=snr[3], sd_steps=sd[0], sd_layers=sd[1], sd_width=sd[2],
                           lora_steps=lora[0], lora_layers=lora[1], taesd=taesd, compile=compile, max_chars=max_chars)


SCALES = {  # rounds, the step's LLM, the memory LLM (activations most of the peak), the optimizer model, ResNet (arch,
    # batch, size), accumulation, loop runs (steps, batch, seq), Min-SNR (steps, autoencoder steps, samples per class,
    # the judge's steps), stochastic depth (steps, ResNet blocks per stage, width), LoRA (steps, layers), TAESD size
    "test": _scale("test", 2, llm_base(512, 64, 2, 2, 1, 4, 32), llm_base(512, 64, 2, 2, 1, 4, 128), (64, 2, 2, 512),
                   ("resnet18", 2, 32), 2, (6, 2, 32), (4, 10, 2, 4), (4, [1, 1, 1, 1], 8), (2, 1), 64, False,
                   200_000),
    "quick": _scale("quick", 6, llm_base(8192, 128, 4, 4, 2, 8, 128), llm_base(512, 64, 2, 2, 1, 8, 256),
                    (256, 4, 4, 8192), ("resnet18", 8, 64), 4, (80, 8, 128), (100, 100, 5, 100),
                    (150, [2, 2, 2, 2], 8), (8, 2), 256, True, 2_000_000),
    "full": _scale("full", 8, llm_base(16384, 256, 4, 4, 2, 8, 256), llm_base(512, 64, 4, 2, 1, 8, 512),
                   (512, 8, 8, 32000), ("resnet50", 8, 128), 4, (400, 8, 256), (300, 300, 20, 200),
                   (600, [3, 4, 6, 3], 8), (20, 4), 512),
}


class Ctx:
    """What each bench's claim_* function gets: the scale, device, seeds, precision, rounds, a work folder, and
    helpers that make a row's fields from rounds or peaks; it adds plots and the bar charts' numbers."""

    def __init__(self, scale, out: Path, device, precision="fp32", rounds=None, seeds=MIN_SEEDS):
        self.s, self.out, self.device, self.precision, self.seeds = scale, out, device, precision, seeds
        self.n_rounds, self.work = rounds or scale.rounds, Path(tempfile.mkdtemp(prefix="zoo-report-"))
        self.plots, self.speeds, self.claimed, self.memory = [], {}, {}, {}

    def speed(self, key, r: harness.Rounds, side, ref, name="", unit="step", **kw) -> dict:
        """A speed row: the per-round speed-ups of `side` over `ref`."""
        p = r.paired(side, ref)
        self.speeds[name or key], self.claimed[name or key] = p.median, 1 + CLAIMS[key][4]
        samples = [b / t - 1 for t, b in zip(r.times(side), r.times(ref))]
        return dict(key=key, name=name, evidence="rounds", samples=samples,
                    speed=kw.pop("speed", "") + f"{p}; {unit} {r.best(ref) * 1e3:.1f} -> {r.best(side) * 1e3:.1f} ms",
                    numbers={"speedup": p.median, "base_s": r.best(ref), "tech_s": r.best(side)}, **kw)

    def saved(self, key, base: list, tech: list, name="", **kw) -> dict:
        """A memory row: the memory saved in each repeat (baseline and technique measured in turn)."""
        b, t = statistics.median(base), statistics.median(tech)
        self.memory[name or key] = {"baseline": b / 2**20, "technique": t / 2**20}
        return dict(key=key, name=name, evidence="repeats", samples=[1 - y / x for x, y in zip(base, tech)],
                    memory=f"peak {b / 2**20:.1f} -> {t / 2**20:.1f} MiB ({100 * (1 - t / b):+.0f}%, medians)"
                    + kw.pop("memory_note", ""),
                    numbers={"base_peaks": base, "tech_peaks": tech, "base_median": b, "tech_median": t,
                             **kw.pop("numbers", {})}, **kw)

    def plot(self, key, title, runs: dict, value, ylabel):
        """A plot of each run's `value` against the step, listed on the page."""
        plots.loss_curves({n: plots.curves(r, value) for n, r in runs.items()}, self.out / f"{key}.png", title, ylabel)
        self.plots.append((title, f"{key}.png"))

    def loop(self, name, config, over, seed) -> list[dict]:
        """A run of the loop in this process (its metrics rows)."""
        return harness.run_loop(config, self.work / f"{name}_s{seed}", [
            f"train.device={self.device}", "train.resume=false", f"train.precision={self.precision}",
            f"train.seed={seed}", *over], inproc=True)


MEASUREMENTS = {  # the report's key: the bench function that measures its claims against their baselines
    "precision": checkpointing.claim_precision, "compile": checkpointing.claim_compile, "fused": optimizers.claim_fused,
    "optimizers": optimizers.claim_state, "checkpointing": checkpointing.claim_checkpointing,
    "chunked-ce": checkpointing.claim_chunked_ce, "grad-accum": checkpointing.claim_grad_accum,
    "channels-last": convnets.claim_channels_last, "lora": llm_quality.claim_lora,
    "averaging": llm_quality.claim_averaging, "moe": llm_quality.claim_moe, "mod": llm_quality.claim_mod,
    "taesd": diffusion.claim_taesd, "min-snr": diffusion.claim_min_snr,
    "stochastic-depth": convnets.claim_stochastic_depth, "cuda-flags": checkpointing.claim_cuda_flags}


# ---------------------------------------------------------------- the page
def fmt_effect(r) -> str:
    """The estimate, its interval and what it rests on, and the threshold the claim's words set."""
    def v(x):
        if r.kind == "equal":
            return f"{x:.1e}"
        return f"{x + 1:.2f}x" if r.metric.startswith(("speed", "compr")) else f"{100 * x:+.1f}%"
    if r.effect is None:
        return "-"
    basis = (("exact" if r.evidence == "exact" else f"{CONFIDENCE:.0%} interval {v(r.interval[0])} to "
              f"{v(r.interval[1])}, {r.n} {r.evidence}") if r.interval else f"no interval: {r.missing}")
    need = f"tolerance {r.threshold:g}" if r.kind == "equal" else f"claim needs {v(r.threshold)}"
    return f"{v(r.effect)} ({basis}; {need})"


def write_page(out: Path, rows: list, meta: dict) -> Path:
    """report.md and report.json (every row with its samples, the hardware, the timing) from the rows."""
    h, t = meta["hardware"], meta["timing"]
    others = t.get("others_share")
    lines = ["# Techniques report", "",
             f"Measured by `{meta['command']}` (scale {meta['scale']}, {meta['seeds']} seeds, {meta['rounds']} rounds, "
             f"comparisons not about precision in {meta['precision']}) on {meta['started']}; "
             f"every number below comes from that run.", "", *([meta["note"], ""] if meta.get("note") else []),
             f"- CPU: {h['cpu']}, {h['cores']} logical cores, torch threads {h['torch_threads']}; "
             f"GPU: {h['gpu'] or 'none'}; device used: {meta['device']}", f"- Python {h['python']}, {h['platform']}",
             "- " + ", ".join(f"{k} {v}" for k, v in h["versions"].items()),
             f"- total wall time {t['total']:.0f} s; CPU time of the report's processes {t['cpu']:.0f} s"
             + ("" if others is None else f"; other processes used {100 * others:.0f}% of the machine's CPU time")]
    if others is not None and others > SHARED:
        lines.append("- **the machine was shared**: speed figures are noisy (paired medians move least)")
    lines += ["", "## The verdict rule", "", RULE, "", "Each claim is in our words, beside the words of the source note it tests (000: tips and tricks "
              "list, 001: optimizer/memory discussion, 002: LLM speed-ups, 003: cookbook, 004: trainer techniques; "
              f"{OWN}: no note names it); a claim made for a GPU feature is skipped on hardware without it.", "",
              "## Results", "", "| technique | claim (note: its words) | baseline | speed | memory | quality | effect: estimate (interval, samples; "
              "threshold) | ratio | verdict |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        v = (r.verdict if r.verdict != "skipped" else f"skipped: {r.reason}") + (
            f" (not measured: {r.unmeasured})" if r.unmeasured else "")
        cells = [r.technique, f"{r.claim} ({r.source})", r.baseline, r.speed, r.memory, r.quality, fmt_effect(r),
                 "-" if r.ratio is None else f"{r.ratio:.2f}", f"**{v}**"]
        lines.append("| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |")
    kinds = ("holds", "partly", "does not hold", "inconclusive", "no verdict", "skipped")
    lines += ["", "Verdicts: " + ", ".join(f"{k} {sum(r.verdict.startswith(k) for r in rows)}" for k in kinds), "",
              "## Plots", "", *(x for t_, png in meta["plots"] for x in (f"**{t_}**", "", f"![{t_}]({png})", "")),
              "## How each was measured", ""]
    lines += [f"- **{k}** ({t['parts'][k]:.0f} s): {' '.join((fn.__doc__ or '').split())}"
              for k, fn in MEASUREMENTS.items() if k in t["parts"]]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    rows = [dataclasses.asdict(r) for r in rows]
    (out / "report.json").write_text(json.dumps({**meta, "rows": rows}, indent=1, default=str) + "\n")
    return out / "report.md"


def run_report(out: Path, scale, only=None, say=print, precision="fp32", rounds=None, seeds=MIN_SEEDS,
               command="") -> tuple:
    """Runs the measurements (all, or `only`) and writes the page. Returns the rows and the page's path."""
    from train.hardware import keep_freed_memory, release_freed_memory
    from train.step import resolve_device
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.png"):
        old.unlink()
    ctx = Ctx(scale, out, resolve_device("auto"), precision, rounds, seeds)
    started, t_all = harness.now(), time.perf_counter()
    cpu0, rows, parts = (t_all, harness.busy_cpu_s(), harness.own_cpu_s()), [], {}
    kept = ctx.device.type == "cpu" and keep_freed_memory()  # as the loop runs (cpu_keep_memory)
    try:
        for key, fn in MEASUREMENTS.items():
            if only and key not in only:
                continue
            say(f"report: {key} ...")
            t0 = time.perf_counter()
            try:
                got = [row(**d) for d in fn(ctx)]
            except Exception as e:  # reported as such; the others still run
                say(f"report: {key} failed: {type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}")
                got = [Row(key, "-", "-", "-", "-", 1.0, reason=f"failed: {type(e).__name__}: {str(e)[:160]}")]
            for r in got:
                r.measurement = key
                say(f"  {r.technique}: {fmt_effect(r.decide())} -> {r.verdict} {r.reason}")
            rows, parts[key] = rows + got, time.perf_counter() - t0
    finally:
        if kept:
            release_freed_memory()
        shutil.rmtree(ctx.work, ignore_errors=True)
    if ctx.speeds:
        plots.speed_bars(ctx.speeds, ctx.claimed, out / "speed.png", "speed-up of each technique over its baseline")
        ctx.plots.insert(0, ("speed-up over the baseline", "speed.png"))
    if ctx.memory:
        plots.memory_bars(ctx.memory, out / "memory.png", "memory: baseline (grey) and technique")
        ctx.plots.insert(1 if ctx.speeds else 0, ("memory", "memory.png"))
    h, timing = harness.hardware(), {"parts": parts, "total": time.perf_counter() - t_all, "cpu": harness.own_cpu_s()}
    end = (time.perf_counter(), harness.busy_cpu_s(), timing["cpu"])
    timing["others_share"] = harness.others_share(cpu0, end, h["cores"] or 1)
    meta = {"command": command or "python train/bench.py report", "scale": scale.name, "precision": precision,
            "rounds": ctx.n_rounds, "seeds": seeds, "device": str(ctx.device), "started": started,
            "plots": [list(p) for p in ctx.plots], "hardware": h, "timing": timing}
    return rows, write_page(out, rows, meta)


def main(argv=None):
    ap = harness.parser("report", __doc__, precision="fp32", rounds=False, one_precision=True, result=None)
    ap.add_argument("--quick", action="store_true", help="small shapes, few rounds and steps")
    ap.add_argument("--out", default=str(ROOT / "docs" / "report"), help="folder of report.md, report.json, the PNGs")
    ap.add_argument("--only", type=harness.name_list(MEASUREMENTS, "measurement"), default=None, help="default: all")
    ap.add_argument("--rounds", type=harness.positive_int, default=None, help="rounds per timing (6+: an interval)")
    ap.add_argument("--seeds", type=harness.positive_int, default=MIN_SEEDS,
                    help="seeds of each quality comparison, repeats of each measured peak")
    args = ap.setup(argv)
    rows, page = run_report(Path(args.out), SCALES["quick" if args.quick else "full"], args.only,
                            lambda m: print(m, flush=True), args.precision, args.rounds, args.seeds, args.command)
    print(f"\n{page} ({len(rows)} rows)")
