"""ConvNet int8 post-training quantization on this CPU: accuracy and images/s against fp32.

    python train/bench.py convnet-ptq                       # resnet-digits, 3 seeds, runs/bench-convnet-ptq/
    python train/bench.py convnet-ptq --docs                # also docs/deploy/convnet_ptq.json, the table in docs/deploy.md
    python train/bench.py convnet-ptq --seeds 0,1,2 --steps 100 --rounds 8 --threads 2

Per seed: the digits preset (--config, configs/convnet/resnet-digits.yaml) trained by train/run.py
for --steps steps with train.seed=seed (a finished run in --out is read back), then
`zoo.quantize(model, "int8", calibration=...)` (zoo/quantization.py: PT2E, torchao's
X86InductorQuantizer, static int8 activations per tensor and weights per output channel) calibrated
on --calib-batches training batches (the task's own train_batch: shifted training images,
normalized as in training). Accuracy: top-1 and loss of the fp32 model and of the int8 graph
(PT2E's reference quantize / dequantize numerics, run eagerly) on the whole validation set;
the drop per seed, and its mean over seeds with a 95% Student-t interval (harness.mean_interval).

Speed (on --speed-seeds, the first seed by default: the architecture, not the weights, sets it):
a batch of --batch validation images through fp32 eager, fp32 compiled and int8 compiled
(torch.compile, inductor with `freezing` on, zoo.quantization.compile_frozen: what lowers the
int8 graph to oneDNN's int8 convolutions; the fp32 side gets the same compiler), after one
warm-up call each (the compile, timed apart), alternating for --rounds rounds (harness.run_rounds):
images/s of each side's best round and the paired median (range) against fp32 eager. The int8
compiled logits are checked against the reference graph's on that batch (argmax agreement).
"""
from __future__ import annotations

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
from train.benches.quantized import PAGE  # noqa: E402

DOCS_JSON = ROOT / "docs" / "deploy" / "convnet_ptq.json"


def trained(args, seed: int) -> Path:
    out = Path(args.out) / f"seed{seed}"
    if not (out / "model.safetensors").is_file():
        cmd = [sys.executable, str(ROOT / "train" / "run.py"), str(ROOT / "configs" / "convnet" / args.config),
               f"train.out_dir={out}", f"train.max_steps={args.steps}", f"train.seed={seed}", "train.eval_every=0",
               "train.precision=fp32", "train.progress=false", "train.samples=false", "train.plot=false",
               "train.export=false"]
        print(" ".join(cmd[1:]), flush=True)
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads or 1))  # one thread: runs side by side on a shared machine
        subprocess.run(cmd, check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    return out


def task_of(folder: Path):
    from train.config import load_run_config
    from train.tasks.classify import ClassifyTask
    cfg = load_run_config(str(folder / "config.yaml"))
    task = ClassifyTask(cfg, torch.device("cpu"), lambda m: None)
    task.setup()
    return task


@torch.no_grad()
def scores(fn, batches) -> dict:
    """Top-1 accuracy and cross-entropy of `fn` (normalized images -> logits) over (x, y) batches."""
    logits = torch.cat([fn(x).float() for x, _ in batches])
    y = torch.cat([y for _, y in batches])
    return {"acc1": (logits.argmax(1) == y).float().mean().item(),
            "loss": torch.nn.functional.cross_entropy(logits, y).item()}


def one_seed(args, seed: int, speed: bool) -> dict:
    import zoo
    from zoo.quantization import compile_frozen
    folder = trained(args, seed)
    task = task_of(folder)
    model = zoo.from_pretrained(folder).float().eval()
    calib = [task.normalize(task.train_batch(s, 0)[0]) for s in range(args.calib_batches)]
    t0 = time.perf_counter()
    int8 = zoo.quantize(model, "int8", calibration=calib)
    quant_s = time.perf_counter() - t0
    val = [(task.normalize(x), y) for x, y in task._val_batches()]
    row = {"seed": seed, "images": sum(len(y) for _, y in val), "quantize_s": quant_s,
           "fp32": scores(model, val), "int8": scores(int8, val)}
    row["drop"] = row["fp32"]["acc1"] - row["int8"]["acc1"]
    print(f"seed {seed}: fp32 acc {row['fp32']['acc1']:.4f} loss {row['fp32']['loss']:.4f}, "
          f"int8 acc {row['int8']['acc1']:.4f} loss {row['int8']['loss']:.4f} (quantized in {quant_s:.0f} s)", flush=True)
    if not speed:
        return row
    x = torch.cat([x for x, _ in val])[:args.batch]
    x = torch.cat([x] * -(-args.batch // len(x)))[:args.batch]   # --batch images (repeated when val is smaller)
    sides = {"fp32 eager": model, "fp32 compiled": compile_frozen(model), "int8 compiled": compile_frozen(int8)}
    first = {}
    with torch.no_grad():
        for name, fn in sides.items():
            t0 = time.perf_counter()
            fn(x)
            first[name] = time.perf_counter() - t0
            print(f"  {name}: first call {first[name]:.0f} s", flush=True)
        same = (sides["int8 compiled"](x).argmax(1) == int8(x).argmax(1)).float().mean().item()
        rounds = harness.run_rounds({k: (lambda f=f: f(x)) for k, f in sides.items()}, args.rounds)
    row["speed"] = {"batch": args.batch, "rounds": args.rounds, "threads": torch.get_num_threads(),
                    "int8_compiled_argmax_equal_reference": same,
                    "rows": [{"side": s, "images_s": args.batch / rounds.best(s), "first_call_s": first[s],
                              "paired": list(rounds.paired(s, "fp32 eager")),
                              "paired_compiled": list(rounds.paired(s, "fp32 compiled")), "wall_s": rounds.wall[s]}
                             for s in sides]}
    return row


def in_words(what: str, change: float, half: float) -> str:
    v = harness.verdict(change, half)
    return v if v == "inconclusive" else f"int8 {what} {v}"


def paired(p: list) -> str:
    return f"{p[0]:.2f}x ({p[1]:.2f}-{p[2]:.2f}x)"


def tables(data: dict) -> str:
    rows = [[s["seed"], f"{s['fp32']['acc1']:.4f}", f"{s['int8']['acc1']:.4f}", f"{s['drop']:+.4f}",
             f"{s['fp32']['loss']:.4f}", f"{s['int8']['loss']:.4f}"] for s in data["seeds"]]
    m, h = data["drop"]
    lm, lh = data["loss_change"]
    rows.append(["mean (95% interval)", "", "", f"{m:+.4f} (±{h:.4f}) " + in_words("top-1", -m, h), "",
                 f"{lm:+.4f} (±{lh:.4f}) " + in_words("loss", lm, lh)])
    acc = harness.table_text(["seed", "fp32 top-1", "int8 top-1", "drop (fp32 - int8)", "fp32 val loss",
                              "int8 val loss"], rows)
    speed = [s for s in data["seeds"] if "speed" in s]
    out = acc
    for s in speed:
        sp = s["speed"]
        out += "\n" + harness.table_text(
            [f"seed {s['seed']}, batch {sp['batch']}", "images/s (best round)", "against fp32 eager: paired median (range)",
             "against fp32 compiled: paired median (range)", "first call s (compile)"],
            [[r["side"], f"{r['images_s']:.0f}", paired(r["paired"]), paired(r["paired_compiled"]),
              f"{r['first_call_s']:.0f}"] for r in sp["rows"]])
    return out


def render(data: dict, page: Path = PAGE, write: bool = True) -> list[str]:
    return ["convnet-ptq"] if harness.update_docs_table(page, "convnet-ptq", tables(data), write) else []


def main(argv=None):
    p = harness.parser("convnet-ptq", __doc__, precision="fp32")
    p.add_argument("--config", default="resnet-digits.yaml", help="a file of configs/convnet/")
    p.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1, 2])
    p.add_argument("--speed-seeds", type=lambda s: [int(x) for x in s.split(",")], default=None,
                   help="the seeds whose models are timed (default: the first seed)")
    p.add_argument("--steps", type=harness.positive_int, default=200, help="training steps of each seed's model (the preset's)")
    p.add_argument("--calib-batches", type=harness.positive_int, default=8)
    p.add_argument("--batch", type=harness.positive_int, default=64, help="images per timed call")
    p.add_argument("--out", default="runs/bench-convnet-ptq")
    p.add_argument("--docs", action="store_true")
    p.add_argument("--render", action="store_true", help="only re-render the docs table from the JSON")
    args = p.parse_args(argv)
    if args.render:
        return harness.render_docs(DOCS_JSON, render)
    if len(args.seeds) < 2:
        p.error("--seeds: at least two seeds for an interval")
    if args.precision != ["fp32"]:
        p.error("--precision: fp32 only (the float model int8 is measured against, and its training)")
    harness.setup(args)
    timed = set(args.speed_seeds if args.speed_seeds is not None else args.seeds[:1])
    seeds = [one_seed(args, s, s in timed) for s in args.seeds]
    from train.benches.report import hardware
    data = {"config": args.config, "steps": args.steps, "calib_batches": args.calib_batches, "seeds": seeds,
            "drop": list(harness.mean_interval(s["drop"] for s in seeds)),
            "loss_change": list(harness.mean_interval(s["int8"]["loss"] - s["fp32"]["loss"] for s in seeds)),
            "hardware": hardware(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "load_average": os.getloadavg()[0]}
    print(tables(data))
    harness.write_results(data, Path(args.out) / "convnet_ptq.json", DOCS_JSON if args.docs else None, render)
    return 0


if __name__ == "__main__":
    sys.exit(main())
