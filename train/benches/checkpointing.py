"""Activation checkpointing policies: step time and memory of each, per family.

    python train/bench.py checkpointing                       # the three families, fp32
    python train/bench.py checkpointing --families llm --rounds 8 --no-measure

Per family, one model per policy (none, selective, full on every 2nd block, full), the same weights and
batch; each side is one step of the loop's own step function, the sides alternating round by round.
The table: each policy's best step, how many times slower than none (paired median), the planner's
predicted peak and activations, and the peak measured in a fresh process (train.plan.measure).
"""
from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from train.benches import harness  # noqa: E402
from train.hardware import sync  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
FAMILIES = {
    "llm": ({"family": "llm", "model": {"vocab_size": 4096, "d_model": 256, "n_layers": 4, "n_heads": 4,
                                        "n_kv_heads": 2, "max_seq_len": 256},
             "data": {"tokenizer": "bytes", "seq_len": 256}, "train": {"batch_size": 8}}, []),
    "convnet": ("convnet/resnet-digits.yaml", ["model.width=32", "train.batch_size=64"]),
    "diffusion": ("diffusion/digits.yaml", ["train.batch_size=128"]),
}
POLICIES = {"none": [], "selective": ["train.activation_checkpointing=selective"],
            "full, every 2nd": ["train.activation_checkpointing=full", "train.activation_checkpointing_every=2"],
            "full": ["train.activation_checkpointing=full"]}


def step_fn(cfg, precision: str, device: torch.device = torch.device("cpu"), model=None):
    """One training step of `cfg` as the loop runs it (`train.step.optimizer_step`: train.grad_accum
    micro-batches of `Task.example_batch`, autocast in `precision` with a GradScaler for fp16,
    clipping, the config's optimizer), through torch.compile when train.compile. `model`: use this
    one (already built, on `device`) instead of building the config's. Returns the step callable."""
    from train.step import optimizer_step
    from train.optim import build_optimizer
    from train.plan import build_model
    from train.tasks import task_class
    torch.manual_seed(0)
    model = (build_model(cfg).to(device) if model is None else model).train()
    task = task_class(cfg.family)(cfg, device, lambda m: None)
    batch = task.example_batch(model, cfg.train.batch_size)
    opt = build_optimizer(model, cfg.optim, device, lambda m: None)
    params = [p for p in model.parameters() if p.requires_grad]
    fwd = torch.compile(model) if cfg.train.compile else model
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    autocast = (lambda: harness.autocast(precision, device.type)) if precision != "fp32" else contextlib.nullcontext
    n = cfg.train.grad_accum
    return lambda: optimizer_step(lambda b: task.loss(fwd, b), iter([batch] * n), n, opt, scaler, params, 1.0, autocast)


def measure_policies(family: str, precision: str, rounds: int, measure: bool = True, threads: int = 0,
                     policies=POLICIES, extra: tuple = (), device: torch.device = torch.device("cpu")) -> dict:
    """Each policy's step time (harness.Rounds over the policies), planned peak and activations,
    and measured peak (None without `measure`): {"rounds": Rounds, name: {"plan": Plan, "measured": bytes}}.
    `extra`: overrides of the family's config (e.g. a smaller shape)."""
    from train.config import load_run_config
    from train.plan import measure_in_subprocess, plan
    from train.benches.memory import base_of
    spec, over = FAMILIES[family]
    base, over = base_of(spec), over + list(extra) + [f"train.precision={precision}"]
    cfgs = {name: load_run_config(None, over + policies[name], base=base) for name in policies}
    sides = {name: step_fn(c, precision, device) for name, c in cfgs.items()}
    for fn in sides.values():
        fn()  # warm-up
    out = {"rounds": harness.run_rounds(sides, rounds, sync=lambda: sync(device))}
    for name, c in cfgs.items():
        out[name] = {"plan": plan(c), "measured": measure_in_subprocess(
            base, over + policies[name], threads=threads)["peak"] if measure else None}
    return out


def main(argv=None):
    p = harness.parser("checkpointing", __doc__, precision="fp32")
    tables = {}
    p.add_argument("--families", type=harness.name_list(FAMILIES, "family"), default=list(FAMILIES))
    p.add_argument("--no-measure", action="store_true", help="leave out the measured peaks (a process each)")
    args = p.parse_args(argv)
    harness.setup(args)
    from train.plan import MiB
    for precision in args.precision:
        for family in args.families:
            m = measure_policies(family, precision, args.rounds, not args.no_measure, args.threads or 0)
            r = m["rounds"]
            rows = []
            for name in POLICIES:
                q, measured = m[name]["plan"], m[name]["measured"]
                slower = r.paired("none", name) if name != "none" else None
                rows.append([name, f"{r.best(name) * 1e3:.1f}", "1.00x" if slower is None else str(slower),
                             f"{q.peak_bytes / MiB:.1f}", f"{q.breakdown['activations'] / MiB:.1f}",
                             "-" if measured is None else f"{measured / MiB:.1f}"])
            tables[f"{family} {precision}"] = harness.table(["policy", "best step ms", "step time / none (paired median)",
                                                             "predicted peak MiB", "predicted activations MiB",
                                                             "measured peak MiB"], rows)
    harness.save(args, tables, {})
    return 0


if __name__ == "__main__":
    sys.exit(main())
