"""The speedrun recipe at equal wall time: configs/llm/speedrun.yaml against tiny.yaml, and one ablation per idea.

    python train/bench.py speedrun --seeds 0,1,2 --seconds 300

Each run first trains --calibrate steps to measure its median step time, then as many steps as --seconds buy (the
same for every seed), on the embedded corpus with its sentencepiece tokenizer (one vocabulary: val losses compare).
The table: each run's final val loss over the seeds, and its difference to speedrun.yaml per seed with its interval.
"""
from __future__ import annotations

from pathlib import Path

from train.benches import harness
from train.benches.harness import ROOT

LLM = ROOT / "configs" / "llm"
RUNS = {  # run -> (config, overrides): the recipe, the baseline, then the recipe without one idea each
    "speedrun": ("speedrun.yaml", []), "tiny": ("tiny.yaml", []),
    "no relu2": ("speedrun.yaml", ["model.mlp=swiglu"]),
    "no value embeds": ("speedrun.yaml", ["model.value_embeds=0"]),
    "no unet skips": ("speedrun.yaml", ["model.unet_skips=false"]),
    "no zero init": ("speedrun.yaml", ["model.zero_init_out=false"]),
    "tied head": ("speedrun.yaml", ["model.tie_embeddings=true", "optim.head_lr=null"]),
    "adamw (no muon)": ("speedrun.yaml", ["optim.name=adamw"]),
}


def run(name: str, args, steps: int, seed: int, tag: str) -> list[dict]:
    config, extra = RUNS[name]
    over = [f"train.max_steps={steps}", f"train.seed={seed}", "train.eval_every=0", "train.log_every=5",
            "train.checkpoint_every=0",
            "train.average_last=0", f"train.eval_batches={args.eval_batches}", *extra]
    over += [f"train.precision={args.precision}"] if args.precision else []
    return harness.run_loop(LLM / config, Path(args.out) / f"{name.replace(' ', '-')}-{tag}", over, args.threads)


def main(argv=None):
    p = harness.parser("speedrun", __doc__, precision="", rounds=False, one_precision=True, out=True, seeds=3)
    harness.counts(p, seconds=(300, "wall time of each run's training"),
                   calibrate=(30, "steps that measure the step time"), eval_batches=20)
    p.add_argument("--runs", type=harness.name_list(RUNS, "run"), default=",".join(RUNS))
    args = p.setup(argv)
    step_s = {n: harness.median_of(run(n, args, args.calibrate, 0, "calibrate"), "step_time_s") for n in args.runs}
    steps = {n: max(1, int(args.seconds / s)) for n, s in step_s.items()}
    val = {n: [harness.last(run(n, args, steps[n], s, f"seed{s}"), "val_loss") for s in args.seeds] for n in args.runs}
    ref = val.get("speedrun")
    rows = [[n, f"{step_s[n]:.3f}", steps[n], harness.interval_text(v, ".4f"),
             harness.interval_text([a - b for a, b in zip(v, ref)], words="val loss") if ref and n != "speedrun"
             else "-"] for n, v in val.items()]
    table = harness.table(["run", "step s", "steps", "val loss", "minus speedrun's (per seed)"], rows,
                          f"equal wall time: {args.seconds} s of training per run; seeds {args.seeds}")
    harness.save(args, {"runs": table}, {"step_s": step_s, "steps": steps, "val_loss": val})
