"""Quantization-aware training against post-training quantization on the same fine-tune.

    python train/bench.py qat                         # 3 seeds x 2 runs, the table, runs/bench-qat/qat.json
    python train/bench.py qat --docs                  # also docs/deploy/qat.json and the tables in docs/deploy.md
    python train/bench.py qat --scheme int4 --seeds 0,1,2 --steps 100
    python train/bench.py qat --trained path/to/model.gguf --group-size 64 ...   # a real model (docs/deploy.md)

The base: the trained embedded default (train/benches/quantized.py's: configs/llm/tiny.yaml's
400 steps, trained once into runs/bench-quantized/tiny, changed by --train-overrides), or
--trained: a folder train.init_from takes (a Zoo run folder, a Hugging Face folder) or a GGUF
file, converted once into <--out>/<its name>/ (a Hugging Face folder and the file's tokenizer as
tokenizer.json). Per seed, two fine-tunes of it by train/run.py with the same data, steps,
schedule and seed (train.init_from):
  ptq:  a plain fine-tune with train.quantize=<the scheme's>: the loop evaluates the float model
        (val_loss), its bf16 copy (quant_ref_val_loss) and that copy post-training quantized
        (quant_val_loss) on the same windows;
  qat:  the same fine-tune with train.qat=<scheme>: the fake-quantized model (val_loss) and its
        converted model (quant_val_loss).
The reference of both increases is the PTQ run's bf16 copy (the deployed model without the
quantization): PTQ's increase is ptq.quant_val_loss - ptq.quant_ref_val_loss, QAT's
qat.quant_val_loss - ptq.quant_ref_val_loss; the recovered fraction is 1 - QAT's / PTQ's. Reported
per seed and as the mean over seeds with its 95% Student-t interval (harness.mean_interval). The
acceptance target (docs/deploy.md): QAT recovers at least half of PTQ's increase.
For int4, also the numerics on the base's weights (`numerics`): the share of the weights that a fake
quantizer puts on another int4 level than the converted bf16 model, for torchao's generic int4
fake quantizer (zero point stored as an int32, its default, as Zoo used it before), the same with
the zero point kept as a float, and Zoo's Int4FakeQuantizer.
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


def gguf_folder(path: Path, out: Path) -> Path:
    """A GGUF file converted once into out/<its name>/: a Hugging Face folder (train.init_from
    loads it) with the file's tokenizer as tokenizer.json."""
    import zoo
    from zoo.weights.gguf_llm import load_tokenizer
    folder = out / path.stem
    if not (folder / "tokenizer.json").is_file():
        model = zoo.from_pretrained(path)
        zoo.save_pretrained(model, folder)
        load_tokenizer(model).backend.save(str(folder / "tokenizer.json"))
    print(f"base: {path} as {folder}", flush=True)
    return folder


def fine_tune(args, base: Path, seed: int, qat: bool) -> dict:
    """The final row of one fine-tune (run, or read back when it finished before)."""
    out = Path(args.out) / f"{'qat' if qat else 'ptq'}-{args.scheme}-seed{seed}"
    row = fine_tune_row(args, base, out, seed, [
        f"train.quant_group_size={args.group_size}",
        f"train.qat={args.scheme}" if qat else f"train.quantize={QAT_SCHEMES[args.scheme]}"])
    if "quant_ref_val_loss" not in row:
        raise SystemExit(f"bench.py qat: {out} has no quant_ref_val_loss (made by an older Zoo); delete it to run it again")
    return row


def fine_tune_row(args, base: Path, out: Path, seed: int, extra: list[str]) -> dict:
    """The final row (its evaluation rows merged) of a fine-tune of `base` by train/run.py into
    `out` with --steps, --lr (10% warmup), --eval-batches, --precision, --threads,
    --fine-tune-overrides and `extra`; read back when `out` holds a finished run."""
    if not (out / "model.safetensors").is_file():
        cmd = [sys.executable, str(ROOT / "train" / "run.py"), str(ROOT / "configs" / "llm" / "tiny.yaml"),
               *fine_tune_overrides(args, base, out, seed), *extra]
        print(" ".join(cmd[1:]), flush=True)
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads)) if args.threads else None
        subprocess.run(cmd, check=True, cwd=ROOT, env=env)
    rows = read_rows(out)
    last = max(r["step"] for r in rows)
    return {k: v for r in rows if r["step"] == last for k, v in r.items()}


def fine_tune_overrides(args, base: Path, out: Path, seed: int) -> list[str]:
    """The overrides of configs/llm/tiny.yaml that make it a fine-tune of `base` (fine_tune_row)."""
    return [f"train.init_from={base}", f"train.out_dir={out}", f"train.max_steps={args.steps}",
            f"train.seed={seed}", f"train.eval_batches={args.eval_batches}", "train.eval_every=0",
            "train.checkpoint_every=0", "train.average_last=0", "train.samples=false", "train.plot=false",
            "train.progress=false", "train.export=false", f"optim.lr={args.lr}", "optim.warmup_fraction=0.1",
            f"train.precision={args.precision}", *args.fine_tune_overrides.split()]


def seed_result(seed: int, ptq: dict, qat: dict) -> dict:
    """One seed's losses and the share of PTQ's increase that QAT recovers (both increases over
    the PTQ run's bf16 copy, unquantized)."""
    ref, pq, qq = ptq["quant_ref_val_loss"], ptq["quant_val_loss"], qat["quant_val_loss"]
    return {"seed": seed, "float": ptq["val_loss"], "ref": ref, "ptq": pq, "qat": qq,
            "qat_fake_val_loss": qat["val_loss"], "qat_ref": qat["quant_ref_val_loss"],
            "ptq_increase": pq - ref, "qat_increase": qq - ref, "recovered": 1 - (qq - ref) / (pq - ref)}


def numerics(folder: Path, group_size: int) -> dict:
    """On the base's weights (every linear int4wo quantizes): the share of the weights that each fake
    quantizer puts on another level than the converted bf16 model (off by more than half a step),
    and the largest distance in steps."""
    import torch
    from torch import nn
    from torchao.quantization.qat import IntxFakeQuantizeConfig
    from torchao.quantization.qat.fake_quantizer import IntxFakeQuantizer
    from torchao.quantization.quant_primitives import ZeroPointDomain

    import zoo
    from zoo.quantization import Int4FakeQuantizer, quantize, targets

    def generic(**kw):
        return IntxFakeQuantizer(IntxFakeQuantizeConfig(torch.int4, group_size=group_size, is_symmetric=False,
                                                        zero_point_domain=ZeroPointDomain.FLOAT, **kw))
    quantizers = {"torchao int4, int32 zero point": lambda: generic(),
                  "torchao int4, float32 zero point": lambda: generic(zero_point_precision=torch.float32),
                  "Int4FakeQuantizer (bf16, tinygemm)": lambda: Int4FakeQuantizer(group_size)}
    model = zoo.from_pretrained(folder, dtype=torch.float32)
    mods = dict(model.named_modules())
    off = {k: 0 for k in quantizers}
    worst = {k: 0.0 for k in quantizers}
    n = 0
    with torch.no_grad():
        for name in targets(model):
            w = mods[name].weight.detach()
            lin = nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=torch.bfloat16)
            lin.weight.data.copy_(w)
            q = quantize(nn.Sequential(lin), "int4wo", group_size, keep=())[0]
            deq = q(torch.eye(w.shape[1], dtype=torch.bfloat16)).float().T  # the kernel's weight
            g = deq.reshape(w.shape[0], -1, group_size)
            step = ((g.amax(-1) - g.amin(-1)) / 15).clamp_min(1e-12).repeat_interleave(group_size, 1)
            for k, make in quantizers.items():
                d = (make()(w) - deq).abs() / step
                off[k] += int((d > 0.5).sum())
                worst[k] = max(worst[k], float(d.max()))
            n += w.numel()
    return {k: {"off_level": off[k] / n, "max_steps": worst[k]} for k in quantizers} | {"weights": n}


def table(data: dict) -> str:
    rows = [[s["seed"], f"{s['float']:.4f}", f"{s['ref']:.4f}", f"{s['ptq']:.4f} ({s['ptq_increase']:+.4f})",
             f"{s['qat_fake_val_loss']:.4f} ({s['qat_fake_val_loss'] - s['ref']:+.4f})",
             f"{s['qat']:.4f} ({s['qat_increase']:+.4f})", f"{s['recovered']:.2f}"] for s in data["seeds"]]
    (pm, ph), (qm, qh), (m, h) = data["ptq_increase"], data["qat_increase"], data["recovered"]
    rows.append(["mean (95% interval)", "", "", f"({pm:+.4f} ± {ph:.4f})", "", f"({qm:+.4f} ± {qh:.4f})",
                 f"{m:.2f} (±{h:.2f})"])
    return harness.table_text(["seed", "float fine-tune val loss", "its bf16 copy (reference)",
                               f"{data['scheme']} PTQ (increase)", "QAT, fake-quantized (vs reference)",
                               f"{data['scheme']} QAT, converted (increase)", "increase recovered by QAT"], rows)


def numerics_table(data: dict) -> str:
    num = data["numerics"]
    return harness.table_text(["fake quantizer", "weights on another level than the converted model",
                               "largest distance (steps)"],
                              [[k, f"{v['off_level']:.2%}", f"{v['max_steps']:.2f}"]
                               for k, v in num.items() if k != "weights"])


def render(data: dict, page: Path = PAGE, write: bool = True) -> list[str]:
    done = ["qat"] if harness.update_docs_table(page, "qat", table(data), write) else []
    if data.get("numerics"):
        done += ["qat-numerics"] if harness.update_docs_table(page, "qat-numerics", numerics_table(data), write) else []
    return done


def fine_tune_arguments(p, out: str):
    """The options of a bench of fine-tunes of one base (this one's and prune.py's)."""
    p.add_argument("--precision", type=harness.precision_name, default="fp32", help="the fine-tunes' train.precision")
    p.add_argument("--seeds", default="0,1,2", help="comma list of train.seed values")
    p.add_argument("--steps", type=harness.positive_int, default=100)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--eval-batches", type=harness.positive_int, default=20)
    p.add_argument("--trained", default=None, help="the LLM to fine-tune: a run or Hugging Face folder, a GGUF "
                                                   "file (default: the embedded default's run folder)")
    p.add_argument("--train-overrides", default="", help="as `quantized --train-overrides`: the base run changed")
    p.add_argument("--fine-tune-overrides", default="", help="key=value overrides of the fine-tunes")
    p.add_argument("--out", default=out)
    p.add_argument("--docs", action="store_true")
    p.add_argument("--render", action="store_true", help="only re-render the docs tables from the JSON")
    return p


def base_model(args) -> Path:
    """The folder the fine-tunes start from: --trained (a GGUF file converted once into --out), or
    the embedded default trained once."""
    if args.trained and Path(args.trained).suffix == ".gguf":
        return gguf_folder(Path(args.trained), Path(args.out))
    return trained_folder(args.trained, overrides=args.train_overrides.split())


def main(argv=None):
    p = harness.parser("qat", __doc__, precision=None, rounds=False)
    p.add_argument("--scheme", choices=sorted(QAT_SCHEMES), default="int4")
    p.add_argument("--group-size", type=harness.positive_int, default=32)
    args = fine_tune_arguments(p, "runs/bench-qat").parse_args(argv)
    if args.render:
        return harness.render_docs(DOCS_JSON, render)
    base = base_model(args)
    seeds = [seed_result(seed, fine_tune(args, base, seed, False), fine_tune(args, base, seed, True))
             for seed in (int(s) for s in args.seeds.split(","))]
    data = {"scheme": args.scheme, "base": str(base), "steps": args.steps, "lr": args.lr,
            "group_size": args.group_size, "eval_batches": args.eval_batches, "precision": args.precision,
            "fine_tune_overrides": args.fine_tune_overrides, "seeds": seeds,
            **{k: list(harness.mean_interval(s[k] for s in seeds)) for k in ("ptq_increase", "qat_increase", "recovered")},
            "numerics": numerics(base, args.group_size) if args.scheme == "int4" else None,
            "load_average": os.getloadavg()[0]}
    print(table(data))
    if data["numerics"]:
        print(numerics_table(data))
    harness.write_results(data, Path(args.out) / "qat.json", DOCS_JSON if args.docs else None, render)
    return 0


if __name__ == "__main__":
    sys.exit(main())
