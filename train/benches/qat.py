"""Quantization-aware training against post-training quantization on the same fine-tune.

    python train/bench.py qat                         # 3 seeds x 2 runs, the table, runs/bench-qat/qat.json
    python train/bench.py qat --docs                  # also docs/deploy/qat.json and the table in docs/deploy.md
    python train/bench.py qat --scheme int4 --seeds 0,1,2 --steps 100

The base: the trained embedded default (train/benches/quantized.py's: configs/llm/tiny.yaml's
400 steps, trained once into runs/bench-quantized/tiny, changed by --train-overrides; or --trained). Per seed, two fine-tunes
of it by train/run.py with the same data, steps, schedule and seed (train.init_from):
  ptq:  a plain fine-tune with train.quantize=<the scheme's> : the loop evaluates the float model
        (val_loss) and its post-training quantized copy (quant_val_loss) on the same windows;
  qat:  the same fine-tune with train.qat=<scheme>: its converted model (quant_val_loss).
PTQ's increase is ptq.quant_val_loss - ptq.val_loss; QAT's is qat.quant_val_loss - ptq.val_loss
(the same float reference); the recovered fraction is 1 - QAT's / PTQ's. Reported per seed and as
the mean over seeds with its 95% Student-t interval (harness.mean_interval). The acceptance target
(docs/deploy.md): QAT recovers at least half of PTQ's increase.
Runs that finished in --out are read back, not run again.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

from train.benches import harness  # noqa: E402
from train.benches.quantized import PAGE, trained_folder  # noqa: E402
from train.config import QAT_SCHEMES  # noqa: E402
from train.metrics import read_rows  # noqa: E402

DOCS_JSON = ROOT / "docs" / "deploy" / "qat.json"


def fine_tune(args, base: Path, seed: int, qat: bool) -> dict:
    """The final row of one fine-tune (run, or read back when it finished before)."""
    out = Path(args.out) / f"{'qat' if qat else 'ptq'}-{args.scheme}-seed{seed}"
    if not (out / "model.safetensors").is_file():
        cmd = [sys.executable, str(ROOT / "train" / "run.py"), str(ROOT / "configs" / "llm" / "tiny.yaml"),
               f"train.init_from={base}", f"train.out_dir={out}", f"train.max_steps={args.steps}",
               f"train.seed={seed}", f"train.eval_batches={args.eval_batches}", "train.eval_every=0",
               "train.checkpoint_every=0", "train.average_last=0", "train.samples=false", "train.plot=false",
               "train.progress=false", "train.export=false", f"optim.lr={args.lr}", "optim.warmup_fraction=0.1",
               f"train.quant_group_size={args.group_size}", f"train.precision={args.precision}",
               f"train.qat={args.scheme}" if qat else f"train.quantize={QAT_SCHEMES[args.scheme]}",
               *args.fine_tune_overrides.split()]
        print(" ".join(cmd[1:]), flush=True)
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads)) if args.threads else None
        subprocess.run(cmd, check=True, cwd=ROOT, env=env)
    rows = read_rows(out)
    last = max(r["step"] for r in rows)
    return {k: v for r in rows if r["step"] == last for k, v in r.items()}  # its evaluation rows, merged


def table(data: dict) -> str:
    rows = [[s["seed"], f"{s['float']:.4f}", f"{s['ptq']:.4f} ({s['ptq'] - s['float']:+.4f})",
             f"{s['qat_fake_val_loss']:.4f} ({s['qat_fake_val_loss'] - s['float']:+.4f})",
             f"{s['qat']:.4f} ({s['qat'] - s['float']:+.4f})", f"{s['recovered']:.2f}"] for s in data["seeds"]]
    m, h = data["recovered"]
    rows.append(["mean (95% interval)", "", "", "", "", f"{m:.2f} (±{h:.2f})"])
    return harness.table_text(["seed", "float fine-tune val loss", f"{data['scheme']} PTQ (increase)",
                               "QAT, fake-quantized (increase)", f"{data['scheme']} QAT, converted (increase)",
                               "increase recovered by QAT"], rows)


def render(data: dict, page: Path = PAGE, write: bool = True) -> list[str]:
    return ["qat"] if harness.update_docs_table(page, "qat", table(data), write) else []


def main(argv=None):
    p = harness.parser("qat", __doc__, precision=None, rounds=False)
    p.add_argument("--precision", type=harness.precision_name, default="fp32", help="the fine-tunes' train.precision")
    p.add_argument("--scheme", choices=sorted(QAT_SCHEMES), default="int4")
    p.add_argument("--seeds", default="0,1,2", help="comma list of train.seed values")
    p.add_argument("--steps", type=harness.positive_int, default=100)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--group-size", type=harness.positive_int, default=32)
    p.add_argument("--eval-batches", type=harness.positive_int, default=20)
    p.add_argument("--trained", default=None, help="the LLM run folder to fine-tune (default: the embedded default's)")
    p.add_argument("--train-overrides", default="", help="as `quantized --train-overrides`: the base run changed")
    p.add_argument("--fine-tune-overrides", default="", help="key=value overrides of the fine-tunes")
    p.add_argument("--out", default="runs/bench-qat")
    p.add_argument("--docs", action="store_true")
    p.add_argument("--render", action="store_true", help="only re-render the docs table from the JSON")
    args = p.parse_args(argv)
    if args.render:
        return harness.render_docs(DOCS_JSON, render)
    base = trained_folder(args.trained, overrides=args.train_overrides.split())
    seeds = []
    for seed in (int(s) for s in args.seeds.split(",")):
        ptq, qat = fine_tune(args, base, seed, False), fine_tune(args, base, seed, True)
        f, pq, qq = ptq["val_loss"], ptq["quant_val_loss"], qat["quant_val_loss"]
        seeds.append({"seed": seed, "float": f, "ptq": pq, "qat": qq, "qat_fake_val_loss": qat["val_loss"],
                      "recovered": 1 - (qq - f) / (pq - f)})
    data = {"scheme": args.scheme, "base": str(base), "steps": args.steps, "lr": args.lr,
            "group_size": args.group_size, "eval_batches": args.eval_batches, "seeds": seeds,
            "recovered": list(harness.mean_interval(s["recovered"] for s in seeds)),
            "load_average": os.getloadavg()[0]}
    print(table(data))
    harness.write_results(data, Path(args.out) / "qat.json", DOCS_JSON if args.docs else None, render)
    return 0


if __name__ == "__main__":
    sys.exit(main())
