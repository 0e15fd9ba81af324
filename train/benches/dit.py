"""DiT training step: Zoo's DiT against diffusers' DiTTransformer2DModel with the same weights.

    python train/bench.py dit                                   # DiT-S/2 on 16 x 16 x 4 latents, batch 8
    python train/bench.py dit --preset B --size 32 --batch 16 --modes eager,compiled --precision fp32,bf16

One training step = forward + MSE against a fixed target + backward + AdamW step (torch's, fused where the
device has it, as the loop's `optim.name: adamw` runs it; `--adamw foreach` for the multi-tensor one) +
zero_grad(set_to_none), on the same batch of latents, timesteps and labels, in each precision (fp32,
or bf16 / fp16 autocast with fp32 master weights, as the loop runs it), each side eager and compiled
(torch.compile of the whole model, default mode), each at its best: the table compares eager with
eager, compiled with compiled, and Zoo's best mode with diffusers' best. The weights are diffusers'
random init (every tensor then drawn N(0, 0.02) so no branch is zero) with one timestep + class
embedder copied into every block, as every published DiT is stored (`--untied`: a different one per
block, which Zoo then keeps per block too); Zoo's model is loaded from that diffusers folder
(zoo.from_pretrained). diffusers' model is in training mode, where its label embedder drops labels
at random (p = 0.1, its classifier-free-guidance training); Zoo's DiT leaves that to the task.
Timing (train/benches/harness.py): after warm-up steps, the sides alternate, `--rounds` rounds of
`--steps` steps; images/s of each side's best round and the median of the paired ratios.
`--profile STEPS` also runs each side's steps under torch.profiler and splits its time by kind of work
(matmul, attention, compiled kernels, optimizer, other).
The numbers are written as JSON to `--json` beside the printed table; `--docs` also writes them to
train/benches/dit.json (dit-profile.json with `--profile`) and renders docs/diffusion.md's table from
it (`--render`: only that).
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from train.benches import harness  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "diffusion.md"
DOCS_JSON = Path(__file__).with_suffix(".json")  # the measurement docs/diffusion.md quotes
PROFILE_JSON = DOCS_JSON.with_name("dit-profile.json")  # and its --profile split

MODES = ("eager", "compiled")


def build_pair(preset: str, patch: int, size: int, classes: int, tied: bool, seed: int = 0):
    """(Zoo's DiT, diffusers' DiTTransformer2DModel) with the same weights, fp32, training mode."""
    import diffusers

    import zoo
    from zoo.config import DIT_PRESETS
    depth, width, heads = DIT_PRESETS[preset]
    torch.manual_seed(seed)
    ref = diffusers.DiTTransformer2DModel(num_attention_heads=heads, attention_head_dim=width // heads, in_channels=4,
                                          out_channels=8, num_layers=depth, sample_size=size, patch_size=patch,
                                          num_embeds_ada_norm=classes)
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.02)
        if tied:
            first = ref.transformer_blocks[0].norm1.emb.state_dict()
            for b in ref.transformer_blocks[1:]:
                b.norm1.emb.load_state_dict(first)
    with tempfile.TemporaryDirectory() as tmp:
        ref.save_pretrained(tmp)
        model = zoo.from_pretrained(tmp)
    return model.train(), ref.train()


class Side:
    def __init__(self, name, model, call, adamw: str = "fused"):
        self.name, self.model, self.call = name, model, call
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **{adamw: True})
        self.fn = model

    def compile(self, on: bool):
        self.fn = torch.compile(self.model) if on else self.model

    def step(self, batch, precision):
        x, t, y, target = batch
        with harness.autocast(precision):
            out = self.call(self.fn, x, t, y)
        loss = torch.nn.functional.mse_loss(out.float(), target)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.detach()


KINDS = {"matmul": ("aten::mm", "aten::addmm", "aten::bmm", "aten::mkldnn_convolution", "aten::convolution_backward"),
         "attention": ("aten::_scaled_dot_product_flash_attention_for_cpu",
                       "aten::_scaled_dot_product_flash_attention_for_cpu_backward")}


def profile_step(step, steps: int) -> dict[str, float]:
    """Milliseconds per step by kind of work, from torch.profiler's CPU self times over `steps` steps:
    matmul (GEMMs and the patch convolution), attention (SDPA forward and backward), compiled kernels
    (inductor's fused element-wise, norm and layout kernels: a compiled graph's self time), optimizer
    (the whole AdamW step) and other."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    kinds = dict.fromkeys([*KINDS, "compiled kernels", "optimizer", "other"], 0.0)
    events = prof.key_averages()
    for e in events:
        kind = next((k for k, names in KINDS.items() if e.key in names), None)
        if kind is None and "CompiledFxGraph" in e.key:
            kind = "compiled kernels"
        if kind is not None:
            kinds[kind] += e.self_cpu_time_total
        elif e.key.startswith("Optimizer.step"):
            kinds["optimizer"] += e.cpu_time_total  # its children (the fused AdamW kernel) included
    kinds["other"] = sum(e.self_cpu_time_total for e in events) - sum(kinds.values())
    kinds = {k: v / 1e3 / steps for k, v in kinds.items()}
    return dict(kinds, total=sum(kinds.values()))


def table(data: dict) -> str:
    """The bench's Markdown table (docs/diffusion.md quotes it) and, with both modes run, each side at its best."""
    text = harness.table_text(
        ["precision", "mode", "zoo img/s", "diffusers img/s", "zoo / diffusers (best rounds)", "median of paired rounds (range)"],
        [[w["precision"], w["mode"], f"{w['zoo_images_per_s']:.2f}", f"{w['diffusers_images_per_s']:.2f}",
          f"{w['best_rounds_ratio']:.2f}x", f"{w['paired_median']:.2f}x ({w['paired_low']:.2f}-{w['paired_high']:.2f}x)"]
         for w in data["rows"]])
    for p in dict.fromkeys(w["precision"] for w in data["rows"]):
        rows = [w for w in data["rows"] if w["precision"] == p]
        if len(rows) > 1:  # each side's best mode: its best round against the other's
            z, d = (max(rows, key=lambda w: w[f"{side}_images_per_s"]) for side in ("zoo", "diffusers"))
            zi, di = z["zoo_images_per_s"], d["diffusers_images_per_s"]
            text += (f"\nEach at its best, {p}: zoo {z['mode']} {zi:.2f} img/s, diffusers {d['mode']} {di:.2f} img/s: "
                     f"{zi / di:.2f}x (best rounds).\n")
    return text


def profile_table(data: dict) -> str:
    """`--profile`'s split of each side's step (ms per step by kind of work), one row per setting and side."""
    rows = [[setting, side] + [f"{v:.0f}" for v in kinds.values()]
            for setting, sides in data["profile"].items() for side, kinds in sides.items()]
    kinds = next(iter(next(iter(data["profile"].values())).values()))
    return harness.table_text(["setting", "side", *(f"{k} ms" for k in kinds)], rows)


def render(data: dict, page: Path = PAGE, write: bool = True) -> list[str]:
    """docs/diffusion.md's `bench:dit` table made from the JSON, or its `bench:dit-profile` table
    when the JSON holds a `--profile` split."""
    name, text = ("dit-profile", profile_table(data)) if "profile" in data else ("dit", table(data))
    return [name] if harness.update_docs_table(page, name, text, write) else []


def main(argv=None):
    ap = harness.parser("dit", __doc__, precision="fp32,bf16", keep_memory=True)
    ap.add_argument("--preset", default="S", choices=["tiny", "S", "B", "L", "XL"], help="DiT shape (default S)")
    ap.add_argument("--patch", type=harness.positive_int, default=2, help="patch size (default 2)")
    ap.add_argument("--size", type=harness.positive_int, default=16, help="latent height and width (default 16)")
    ap.add_argument("--batch", type=harness.positive_int, default=8)
    ap.add_argument("--classes", type=harness.positive_int, default=1000)
    ap.add_argument("--untied", action="store_true", help="a different timestep + class embedder in every block")
    ap.add_argument("--modes", type=harness.name_list(MODES, "mode"), default="eager,compiled",
                    help="comma list of eager, compiled")
    ap.add_argument("--adamw", choices=["fused", "foreach"], default="fused",
                    help="torch AdamW implementation for both sides (default fused, as the loop uses on CPU)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per side and setting (compilation included)")
    ap.add_argument("--steps", type=harness.positive_int, default=2, help="timed steps per round")
    ap.add_argument("--profile", type=int, default=0, metavar="STEPS",
                    help="also profile STEPS steps of each side per setting (after the rounds): ms per step by kind of work")
    ap.add_argument("--json", default="runs/bench/dit.json", help="where the numbers are written")
    ap.add_argument("--docs", action="store_true", help=f"also write {DOCS_JSON.relative_to(ROOT)} ({PROFILE_JSON.name} "
                    "with --profile) and docs/diffusion.md's table from it")
    ap.add_argument("--render", action="store_true", help=f"only re-render docs/diffusion.md's tables from {DOCS_JSON.name} "
                    f"and {PROFILE_JSON.name}")
    args = ap.parse_args(argv)
    if args.render:
        found = [f for f in (DOCS_JSON, PROFILE_JSON) if f.is_file()]
        if not found:
            ap.error(f"{DOCS_JSON}: no measurement to render (run with --docs first)")
        print("rewrote: " + (", ".join(n for f in found for n in render(json.loads(f.read_text()))) or "nothing (up to date)"))
        return 0
    load0 = os.getloadavg()[0]
    kept = harness.setup(args)

    zoo_model, ref_model = build_pair(args.preset, args.patch, args.size, args.classes, not args.untied)
    sides = [Side("zoo", zoo_model, lambda f, x, t, y: f(x, t, y), args.adamw),
             Side("diffusers", ref_model, lambda f, x, t, y: f(x, t, y).sample, args.adamw)]
    g = torch.Generator().manual_seed(0)
    B, S = args.batch, args.size
    batch = (torch.randn(B, 4, S, S, generator=g), torch.randint(0, 1000, (B,), generator=g),
             torch.randint(0, args.classes, (B,), generator=g), torch.randn(B, 8, S, S, generator=g))
    tokens = (S // args.patch) ** 2
    print(f"dit: DiT-{args.preset}/{args.patch}, {zoo_model.num_params() / 1e6:.1f}M params (Zoo; "
          f"{sum(p.numel() for p in ref_model.parameters()) / 1e6:.1f}M diffusers), batch {B} x 4 x {S} x {S} "
          f"({tokens} tokens), embedders {'per block' if args.untied else 'shared (tied)'}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {args.adamw} AdamW, freed memory {'kept' if kept else 'returned to the OS'}; "
          f"{args.rounds} alternating rounds of {args.steps} steps", flush=True)

    results = {}  # (precision, mode) -> harness.Rounds
    profiles = {}  # "precision mode" -> side -> kind of work -> ms per step
    for p in args.precision:
        for mode in args.modes:
            for s in sides:
                s.compile(mode == "compiled")
                for _ in range(args.warmup):
                    s.step(batch, p)
            r = results[p, mode] = harness.run_rounds({s.name: (lambda s=s: s.step(batch, p)) for s in sides},
                                                      args.rounds, calls=args.steps)
            print(f"  {p:>4} {mode:<8} zoo {B / r.best('zoo'):7.2f} img/s   diffusers "
                  f"{B / r.best('diffusers'):7.2f} img/s   {r.summary('zoo', 'diffusers')}", flush=True)
            if args.profile:
                prof = profiles[f"{p} {mode}"] = {s.name: profile_step(lambda s=s: s.step(batch, p), args.profile)
                                                  for s in sides}
                for name, kinds in prof.items():
                    print(f"       {name:>9} ms/step: " + ", ".join(f"{k} {v:.0f}" for k, v in kinds.items()), flush=True)

    rows = []
    for (p, mode), r in results.items():
        paired = r.paired("zoo", "diffusers")
        rows.append({"precision": p, "mode": mode, "zoo_images_per_s": B / r.best("zoo"),
                     "diffusers_images_per_s": B / r.best("diffusers"), "best_rounds_ratio": r.ratio("zoo", "diffusers"),
                     "paired_median": paired.median, "paired_low": paired.low, "paired_high": paired.high,
                     "zoo_s": r.wall["zoo"], "diffusers_s": r.wall["diffusers"]})
    data = {"bench": "dit", "args": vars(args),
            "torch": torch.__version__, "threads": torch.get_num_threads(), "load_average": [load0, os.getloadavg()[0]],
            "rows": rows, **({"profile": profiles} if profiles else {})}
    print("\n" + table(data), end="")
    if profiles:
        print("\n" + profile_table(data), end="")
    harness.write_results(data, Path(args.json), (PROFILE_JSON if profiles else DOCS_JSON) if args.docs else None, render)
    return 0


if __name__ == "__main__":
    sys.exit(main())
