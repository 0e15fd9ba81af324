"""The memory planner against measured peaks: predicted and measured peak resident memory of training.

    python train/bench.py memory                     # every configuration below: table + JSON + docs table
    python train/bench.py memory --only "llm 28M"    # measure the configurations whose name starts with that;
                                                     # the others planned again, their measurements kept
                                                     # from memory.json (each row says when it was measured)
    python train/bench.py memory --calibrate         # measure the calibration configurations, fit the
                                                     # unseen-memory envelope, write memory_calibration.json
    python train/bench.py memory --calibrate --only "llm 76M"   # re-measure those, refit with the others' points
    python train/bench.py memory --calibrate --refit  # plan the calibration configurations again and refit
                                                     # on the measurements memory_calibration.json holds
                                                     # (after a change to the planner: the measured
                                                     # peaks do not depend on it)
    python train/bench.py memory --planner-time      # + how long the planner takes on the large presets

Measured (`train.plan.measure`, each configuration in --repeat fresh processes on the CPU, the
largest kept: the same step's peak differs from process to process, docs/memory.md, and a user
meets whichever their process draws; the table's `fresh processes` column gives the range): the growth of
the process's peak resident memory (VmHWM) from just before the model is built (interpreter,
torch and Zoo imported) to the end of `train.plan.MEASURE_STEPS` (16) steps of the loop's own
`optimizer_step` (the heap can still grow by a large block after the third), with glibc set as
train/run.py sets it (`train.cpu_keep_memory`). Predicted (`train.plan.plan`, fake tensors,
nothing allocated): the tensors' peak, the heap glibc makes of them (the traced allocations
replayed through a model of its malloc) and the unseen memory (the envelope of that heap for the
family, autocast dtype and checkpointing, measured by --calibrate: `train.plan.unseen_bytes`).

--calibrate measures the CALIBRATE configurations (--repeat fresh processes each, the largest
peak kept) and fits, per family, autocast dtype and activation checkpointing
(`train.plan.envelope_key`: "llm", "llm bf16", "llm bf16 ckpt", ...), the unseen memory a + b * heap
that brings its points' predicted / measured closest to the middle of [1.0, 1.15], a constant
where one keeps them all in that band (`fit_envelope`); it writes
train/benches/memory_calibration.json (the planner reads it).
The other configurations are not used to fit it (role `held out` in the table); a run takes the
calibration rows' measurements from that file (role `fit`) and measures the rest (OUTSIDE: configurations the envelope is known
not to cover, reported in a table of their own). A run writes train/benches/memory.json and
the tables in docs/memory.md between its markers. Linux only (/proc).
"""
from __future__ import annotations

import datetime
import json
import platform
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from train.benches import harness  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
RESULTS = Path(__file__).resolve().parent / "memory.json"
DOC = ROOT / "docs" / "memory.md"
BEGIN, END = "<!-- memory bench: begin -->", "<!-- memory bench: end -->"


def llm(vocab, d, layers, heads, kv, batch, seq=256):
    return {"family": "llm",
            "model": {"vocab_size": vocab, "d_model": d, "n_layers": layers, "n_heads": heads, "n_kv_heads": kv,
                      "max_seq_len": seq},
            "data": {"tokenizer": "bytes", "seq_len": seq}, "train": {"batch_size": batch, "precision": "fp32"}}


LLM = llm(4096, 256, 4, 4, 2, 16)             # 4.0M parameters
LLM30 = llm(8192, 512, 8, 8, 4, 8)            # 27.8M
LLM80 = llm(16384, 768, 10, 12, 4, 4)         # 75.5M
DEEP_THIN = llm(16384, 512, 24, 8, 4, 4)      # 79.2M: 24 blocks of width 512
LLM47 = llm(16384, 640, 8, 10, 5, 4)          # 46.9M
LLM100 = llm(32000, 768, 12, 12, 4, 2)        # 100M (tied embedding): GPT-2-small-sized, above the calibrated heaps
TINY = llm(4096, 128, 2, 4, 2, 16)            # 0.9M, full loss: the shape an earlier 15% test measured (421-625 MiB from process to process)
SMALLEST = llm(4096, 64, 2, 4, 2, 8, seq=64)  # 0.4M: tests/test_plan.py's settings-that-fit test (full loss)

# name -> (base config: a dict or a path under configs/, overrides)
CONFIGS = {
    "llm 0.4M fp32 adamw full-loss": (SMALLEST, ["train.chunked_loss=false"]),
    "llm 4M fp32 adamw chunked": (LLM, []),
    "llm 4M bf16 adamw chunked": (LLM, ["train.precision=bf16"]),
    "llm 28M fp32 adamw": (LLM30, []),
    "llm 28M bf16 adamw ckpt": (LLM30, ["train.precision=bf16", "train.activation_checkpointing=true"]),
    "llm 76M fp32 adamw": (LLM80, []),
    "llm 76M bf16 adamw ckpt": (LLM80, ["train.precision=bf16", "train.activation_checkpointing=true"]),
    "llm 79M deep-thin bf16 adamw": (DEEP_THIN, ["train.precision=bf16"]),
    "llm 100M fp32 adamw ckpt": (LLM100, ["train.activation_checkpointing=true"]),
    "llm 47M bf16 adamw selective": (LLM47, ["train.precision=bf16", "train.activation_checkpointing=selective"]),
    "convnet fp32 adamw (resnet-digits)": ("convnet/resnet-digits.yaml", []),
    "convnet fp32 adamw (width 64)": ("convnet/resnet-digits.yaml", ["model.width=64"]),
    "convnet bf16 adamw (width 64)": ("convnet/resnet-digits.yaml", ["model.width=64", "train.precision=bf16"]),
    "convnet bf16 adamw (resnet-digits)": ("convnet/resnet-digits.yaml", ["train.precision=bf16"]),
    "convnet fp32 adamw (width 32)": ("convnet/resnet-digits.yaml", ["model.width=32"]),
    "convnet bf16 adamw (width 32)": ("convnet/resnet-digits.yaml", ["model.width=32", "train.precision=bf16"]),
    "diffusion fp32 adamw": ("diffusion/digits.yaml", ["train.batch_size=256"]),
    "diffusion bf16 adamw": ("diffusion/digits.yaml", ["train.batch_size=256", "train.precision=bf16"]),
    "diffusion bf16 adamw (batch 64)": ("diffusion/digits.yaml", ["train.batch_size=64", "train.precision=bf16"]),
    "diffusion fp32 adamw (batch 16)": ("diffusion/digits.yaml", ["train.batch_size=16"]),
    "diffusion bf16 adamw (batch 16)": ("diffusion/digits.yaml", ["train.batch_size=16", "train.precision=bf16"]),
    "llm 0.9M fp32 adamw full-loss": (TINY, ["train.chunked_loss=false"]),
    "llm 4M fp32 adamw chunked ckpt": (LLM, ["train.activation_checkpointing=true"]),
    "llm 4M bf16 adamw full-loss ckpt": (LLM, ["train.precision=bf16", "train.chunked_loss=false",
                                              "train.activation_checkpointing=true"]),
    "llm 28M fp32 adamw ckpt": (LLM30, ["train.activation_checkpointing=true"]),
    "llm 0.9M fp32 adamw full-loss ckpt": (TINY, ["train.chunked_loss=false", "train.activation_checkpointing=true"]),
    "llm 4M bf16 adamw chunked ckpt": (LLM, ["train.precision=bf16", "train.activation_checkpointing=true"]),
    "llm 47M fp32 adamw selective": (LLM47, ["train.activation_checkpointing=selective"]),
}
# the configurations the unseen-memory envelopes are fitted on (--calibrate; one envelope per family and
# autocast dtype, `train.plan.envelope_key`); the rest check them
CALIBRATE = ["llm 0.4M fp32 adamw full-loss", "llm 4M fp32 adamw chunked", "llm 28M fp32 adamw", "llm 76M fp32 adamw",
             "llm 4M bf16 adamw chunked", "llm 76M bf16 adamw ckpt", "llm 79M deep-thin bf16 adamw",
             "llm 28M fp32 adamw ckpt", "llm 0.9M fp32 adamw full-loss ckpt", "llm 4M bf16 adamw chunked ckpt",
             "convnet fp32 adamw (resnet-digits)", "convnet fp32 adamw (width 64)", "convnet bf16 adamw (resnet-digits)",
             "convnet bf16 adamw (width 64)", "diffusion fp32 adamw", "diffusion bf16 adamw",
             "diffusion fp32 adamw (batch 16)", "diffusion bf16 adamw (batch 16)"]
# measured and reported apart: configurations the envelope is known not to cover
OUTSIDE: list[str] = []
LARGE = ["llm/llama2-7b.yaml", "llm/mixtral-8x7b.yaml"]


def base_of(spec):
    from zoo.config import load_yaml
    return load_yaml(ROOT / "configs" / spec) if isinstance(spec, str) else spec


def key_of(name: str) -> str:
    """The envelope a configuration's unseen memory belongs to (`train.plan.envelope_key`)."""
    import torch
    from train.config import load_run_config
    from train.plan import envelope_key
    spec, over = CONFIGS[name]
    return envelope_key(load_run_config(None, over, base=base_of(spec)), torch.device("cpu"))


BAND = (1.0, 1.15)                    # the accepted predicted / measured
TARGET = (BAND[0] + BAND[1]) / 2      # where the calibration points are aimed


def fit_envelope(points) -> dict:
    """The unseen memory a + b * held (a >= 0, b >= 0) over one key's [(held, measured)]
    calibration points, aimed at the middle of the accepted band (TARGET): the (a, b) whose worst
    point is closest to it. The simplest that keeps every point in the band: a constant (b = 0)
    where one does, else a line. Why the middle and not the points themselves: the heap's layout
    is a chaotic function of the run's allocations, so configurations next to a calibration point
    peak a few percent above or below any smooth curve through the points (docs/memory.md), and
    the middle leaves that much room on both sides."""
    def centred(b):  # the a that brings the worst point closest to TARGET, for this b (a convex problem)
        def worst(a):
            return max(abs((h * (1 + b) + a) / m - TARGET) for h, m in points)
        lo, hi = 0.0, max(m for _, m in points)
        for _ in range(100):
            m1, m2 = lo + (hi - lo) / 3, hi - (hi - lo) / 3
            lo, hi = (lo, m2) if worst(m1) <= worst(m2) else (m1, hi)
        return worst(lo), lo

    err, a = centred(0.0)
    b = 0.0
    if err > TARGET - BAND[0]:
        err, a, b = min((*centred(i * 0.0025), i * 0.0025) for i in range(401))
    ratios = [(h * (1 + b) + a) / m for h, m in points]
    return {"a": round(a), "b": b, "ratios": [round(r, 4) for r in ratios]}


def measure_rows(names, threads, log=print, measured=None, repeat=1) -> list[dict]:
    """Plan and measure each configuration (`repeat` fresh processes, the largest peak kept: the
    same configuration moves by a few percent from run to run); `measured`: {name: measured
    bytes} already measured (by --calibrate), taken instead of measuring again."""
    from train.config import load_run_config
    from train.plan import MiB, measure_in_subprocess, plan
    rows = []
    for name in names:
        spec, over = CONFIGS[name]
        base = base_of(spec)
        cfg = load_run_config(None, over, base=base)
        t0 = time.perf_counter()
        p = plan(cfg)
        planner_s = time.perf_counter() - t0
        if measured and name in measured:
            m = {"peak": measured[name], "start_rss": None, "phases": None}
        else:
            runs = [measure_in_subprocess(base, over, threads=threads or 0) for _ in range(repeat)]
            m = max(runs, key=lambda r: r["peak"])
            m["runs"] = [r["peak"] for r in runs]
        b = p.breakdown
        held = p.peak_bytes - b["unseen"]
        row = {"name": name, "family": cfg.family, "key": key_of(name), "params": p.breakdown["params"] // 4,
               "predicted": p.peak_bytes, "measured": m["peak"], "ratio": p.peak_bytes / m["peak"],
               "tensors": held - b["allocator"], "allocator": b["allocator"], "unseen": b["unseen"],
               "held": held, "start_rss": m["start_rss"], "phases": m["phases"], "runs": m.get("runs"), "planner_s": planner_s,
               "calibration": name in CALIBRATE, "outside": name in OUTSIDE}
        rows.append(row)
        log(f"{name}: predicted {p.peak_bytes / MiB:.1f} MiB, measured {m['peak'] / MiB:.1f} MiB "
            f"({row['ratio']:.3f})", flush=True)
    return rows


def role(r) -> str:
    """A row's part in the envelope: `fit` (a calibration point, its measurement the largest of the
    calibration's) or `held out` (never fitted on)."""
    return "fit" if r["calibration"] else "held out"


def table(rows) -> tuple[list, list]:
    from train.plan import MiB
    header = ["configuration", "role", "params", "tensors MiB", "+ allocator MiB", "+ unseen MiB", "predicted MiB",
              "measured MiB", "fresh processes MiB", "predicted / measured", "measured on"]
    out = [[r["name"], role(r), f"{r['params'] / 1e6:.1f}M",
            f"{r['tensors'] / MiB:.1f}", f"{r['allocator'] / MiB:.1f}", f"{r['unseen'] / MiB:.1f}",
            f"{r['predicted'] / MiB:.1f}", f"{r['measured'] / MiB:.1f}", spread(r.get("runs")), f"{r['ratio']:.3f}",
            r.get("measured_date", "-")] for r in rows]
    return header, out


def spread(runs) -> str:
    """The measured peaks of a row's fresh processes: "lowest-highest (n)", the highest being the row's."""
    from train.plan import MiB
    if not runs:
        return "-"
    return f"{min(runs) / MiB:.1f}-{max(runs) / MiB:.1f} ({len(runs)})" if len(runs) > 1 else f"{runs[0] / MiB:.1f} (1)"


def machine() -> dict:
    import torch
    return {"torch": torch.__version__, "python": platform.python_version(), "threads": torch.get_num_threads(),
            "cpu": platform.processor() or platform.machine(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}


def summary(what: str, ratios: list) -> str:
    inside = sum(1.0 <= x <= 1.15 for x in ratios)
    return (f"predicted / measured over the {len(ratios)} {what}: {min(ratios):.3f} to {max(ratios):.3f}, "
            f"{inside} of {len(ratios)} in [1.0, 1.15]." if ratios else f"no {what}.")


def write_docs(result: dict):
    """docs/memory.md's table, between its markers, from memory.json."""
    inside = [r for r in result["rows"] if not r.get("outside")]
    outside = [r for r in result["rows"] if r.get("outside")]
    header, rows = table(inside)
    lines = [f"`python train/bench.py memory` (planned {result['machine']['date']}, torch {result['machine']['torch']}, "
             f"{result['machine']['threads']} threads; calibration of {result['calibration']['date']}). "
             f"role `fit`: a calibration point, its measured peak the largest of the calibration's "
             f"measurements; `held out`: never fitted on, measured on the date shown:",
             "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    lines += [""] + [summary(f"{name} rows", [r["ratio"] for r in inside if role(r) == name])
                     for name in ("held out", "fit")]
    if outside:
        _, rows = table(outside)
        lines += ["", "Outside the envelope (measured by the same command, not fitted on):", "",
                  "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
    text = DOC.read_text()
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        text = head + BEGIN + "\n" + "\n".join(lines) + "\n" + END + rest.split(END, 1)[1]
        DOC.write_text(text)


def main(argv=None):
    p = harness.parser("memory", __doc__, precision="fp32,bf16", rounds=False)
    p.add_argument("--only", default="", help="run the configurations whose name starts with this")
    p.add_argument("--calibrate", action="store_true", help="measure the calibration configurations and fit "
                                                            "the unseen-memory envelope (memory_calibration.json)")
    p.add_argument("--repeat", type=int, default=3, help="measurements per configuration, each in a fresh "
                                                           "process (the largest kept: the user meets the worst)")
    p.add_argument("--refit", action="store_true", help="--calibrate: keep the measurements of "
                                                        "memory_calibration.json, plan again and refit")
    p.add_argument("--planner-time", action="store_true", help="also time the planner on the large presets")
    args = p.parse_args(argv)
    from train.config import load_run_config
    from train.plan import CALIBRATION, GiB, MiB, plan
    if args.calibrate:
        import train.plan as planner
        planner._calibration.clear()
        planner._calibration["none"] = {}  # fit on the modelled heap alone
        names = [n for n in CALIBRATE if n.startswith(args.only)]
        points = {}  # --only, --refit: the points as the last calibration measured them
        if (args.only or args.refit) and CALIBRATION.exists():
            points = {pt["name"]: dict(pt, key=key_of(pt["name"])) for c in json.loads(CALIBRATION.read_text())[
                "families"].values() for pt in c["points"]}
        if args.refit:
            rows = measure_rows(names, args.threads, measured={n: points[n]["measured"] for n in names})
            for r in rows:
                points[r["name"]]["held"] = r["held"]
        else:
            for r in measure_rows(names, args.threads, repeat=args.repeat):
                points[r["name"]] = {"name": r["name"], "key": r["key"], "held": r["held"],
                                     "measured": r["measured"], "runs": r["runs"], "date": machine()["date"]}
        families = {}
        for key in sorted({pt["key"] for pt in points.values()}):
            pts = [pt for n, pt in points.items() if pt["key"] == key and n in CALIBRATE]
            families[key] = {**fit_envelope([(pt["held"], pt["measured"]) for pt in pts]),
                             "points": [{k: v for k, v in pt.items() if k != "key"} for pt in pts]}
            c = families[key]
            print(f"{key}: unseen = {c['a'] / MiB:.1f} MiB + {c['b']:.4f} x heap (predicted / measured on its "
                  f"points: {', '.join(f'{r:.3f}' for r in c['ratios'])})")
        command = "python train/bench.py memory --calibrate" + (" --refit" if args.refit else "")
        CALIBRATION.write_text(json.dumps({"command": command, **machine(),
                                           "families": families}, indent=1) + "\n")
        print(f"wrote {CALIBRATION}")
        return 0
    names = [n for n in CONFIGS if n.startswith(args.only) and any(f" {pr} " in f" {n} " for pr in args.precision)]
    if not names:
        p.error(f"no configuration starts with {args.only!r} (names: {', '.join(CONFIGS)})")
    cal = json.loads(CALIBRATION.read_text())
    known = {pt["name"]: pt["measured"] for c in cal["families"].values() for pt in c["points"]}
    when = {pt["name"]: pt.get("date", cal["date"]) for c in cal["families"].values() for pt in c["points"]}
    runs_of = {pt["name"]: pt.get("runs") for c in cal["families"].values() for pt in c["points"]}
    now = machine()["date"]
    rows = measure_rows(names, args.threads, measured=known,  # the calibration rows: as --calibrate measured them
                        repeat=args.repeat)
    for r in rows:
        r["measured_date"] = when[r["name"]] if r["calibration"] else now
        r["runs"] = runs_of.get(r["name"], r["runs"])
    old = {r["name"]: r for r in json.loads(RESULTS.read_text())["rows"]} if RESULTS.exists() else {}
    rest = [n for n in CONFIGS if n not in names and n in old]
    if rest:  # --only: the other rows planned again, their measurements as memory.json recorded them
        print(f"re-planned, measurements from {RESULTS.name}: {', '.join(rest)}")
        for r in measure_rows(rest, args.threads, log=lambda *a, **k: None,
                              measured={n: known.get(n, old[n]["measured"]) for n in rest}):
            was = old[r["name"]]
            r.update({k: was.get(k) for k in ("start_rss", "phases")}, runs=runs_of.get(r["name"], was.get("runs")),
                     measured_date=when[r["name"]] if r["calibration"] else
                     was.get("measured_date", json.loads(RESULTS.read_text())["machine"]["date"]))
            rows.append(r)
        rows.sort(key=lambda r: list(CONFIGS).index(r["name"]))
    harness.print_table(*table(rows))
    result = {"machine": machine(), "calibration": {k: v for k, v in cal.items() if k != "families"}
              | {"families": {f: {k: c[k] for k in ("a", "b")} for f, c in cal["families"].items()}},
              "rows": rows}
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    write_docs(result)
    print(f"wrote {RESULTS} and the table in {DOC}")
    if args.planner_time:
        rows = []
        for spec in LARGE:
            t0 = time.perf_counter()
            q = plan(load_run_config(str(ROOT / "configs" / spec)))
            rows.append([spec, f"{time.perf_counter() - t0:.1f}", f"{q.peak_bytes / GiB:.1f}",
                         f"{q.breakdown['params'] / GiB:.1f}"])
        harness.print_table(["preset", "planner seconds", "predicted peak GiB", "params GiB"], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
