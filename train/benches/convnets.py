"""ConvNets: training steps of Zoo's models against timm's, drop-path modes, and the classification recipe.

    python train/bench.py resnet          # ResNet-50 vs timm's, 16 x 3 x 224 x 224, fp32 and bf16, both memory formats
    python train/bench.py convnets        # ConvNeXt (V2), EfficientNet-B0, MobileNetV3 vs timm's, eager and compiled
    python train/bench.py drop-path       # stochastic depth computed and zeroed (mask) vs skipped (skip, batch)
    python train/bench.py convnet-recipe  # timm's augmentations on top of the digits preset, equal steps, 3 seeds
    python train/bench.py vit             # ViT-S/16 and DeiT-S (distilled) vs timm's, 16 x 3 x 224 x 224, fp32 and bf16

A step is forward, cross-entropy, backward, SGD-momentum and zero_grad; both models hold the same weights.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

import zoo
from train.benches import harness
from train.benches.harness import ROOT
from train.config import OptimConfig, load_run_config
from train.data.images import digits_dataset
from train.hardware import sync
from train.optim import build_optimizer
from zoo.config import ConvNetConfig

ARCHS = ["convnext_tiny", "convnextv2_tiny", "efficientnet_b0", "mobilenetv3_large_100"]
VITS = ["vit_small_patch16_224", "deit_small_distilled_patch16_224"]
MODES = ("mask", "skip", "batch")
RECIPE = "data.auto_augment=trivialaugment,data.random_erasing=0.25,data.mixup_alpha=0.8,data.cutmix_alpha=1.0"
SETTING = ("device", "batch", "size", "threads", "torch")


def build_pair(arch: str, num_classes: int):
    """Zoo's model and timm's (random init) with the same weights, fp32, training mode: timm's state dict read by
    zoo.from_pretrained, which knows the layout of each timm family."""
    import tempfile

    import timm
    torch.manual_seed(0)
    ref = timm.create_model(arch, pretrained=False, num_classes=num_classes)
    with tempfile.TemporaryDirectory() as tmp:
        torch.save(ref.state_dict(), Path(tmp) / f"{arch}.pth")
        model = zoo.from_pretrained(Path(tmp) / f"{arch}.pth", arch=arch)
    return model.float().train(), ref.train()


def side(model, batch: list, device=torch.device("cpu"), compile: bool = False) -> harness.Side:
    """A training step of `model` on batch[0], batch[1] (a list: the caller may swap the tensors)."""
    opt = build_optimizer(model, OptimConfig(name="sgd", lr=0.01, weight_decay=1e-4), device, log=lambda *a: None)
    loss = lambda m: torch.nn.functional.cross_entropy(m(batch[0]).float(), batch[1])  # noqa: E731
    return harness.Side(model, loss, opt, compile, device)


def step_rounds(models: dict, batch: int, size: int, classes: int, precision: str, rounds: int,
                device=torch.device("cpu"), fmt: dict = None) -> harness.Rounds:
    """Training steps of each model on one batch (in its memory format, `fmt`, channels-last by default) after a
    warm-up step, in alternating rounds."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 3, size, size, generator=g).to(device)
    y = torch.randint(0, classes, (batch,), generator=g).to(device)
    f = {n: (fmt or {}).get(n, torch.channels_last) for n in models}
    sides = {n: side(m.to(device, memory_format=f[n]), [x.contiguous(memory_format=f[n]), y], device)
             for n, m in models.items()}
    return harness.run_rounds(harness.step_calls(sides, precision), rounds, sync=lambda: sync(device), warmup=1)


def merged(old: dict, new: dict) -> dict:
    """The result after a run of some settings: new's rows replace old's of the same model, mode, memory
    format and precision, old's others stay, when both ran at the same shape, device, threads and torch."""
    if any(old.get(k) != new.get(k) for k in SETTING):
        return new
    key = lambda r: (r["arch"], r["mode"], r["format"], r["precision"])  # noqa: E731
    fresh = {key(r): r for r in new["results"]}
    return {**new, "results": [fresh.pop(key(r), r) for r in old["results"]] + list(fresh.values())}


def zoo_vs_timm(args) -> tuple[dict, dict]:
    device = torch.device(args.device)
    torch.backends.cudnn.benchmark = device.type == "cuda"
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(args.batch, 3, args.size, args.size, generator=g).to(device)
    batch = [x0, torch.randint(0, 1000, (args.batch,), generator=g).to(device)]
    data = {"device": str(device), "batch": args.batch, "size": args.size, "torch": torch.__version__,
            "threads": torch.get_num_threads(), "results": []}
    for mode in args.modes:  # every eager setting first: the compiled ones take far longer
        for arch in args.archs:
            models = build_pair(arch, 1000)
            flops = models[0].flops_per_image(args.size) if hasattr(models[0], "flops_per_image") else None
            for fmt in args.formats:
                batch[0] = x0.contiguous(memory_format=harness.FORMATS[fmt])
                sides = {n: side(m.to(device, memory_format=harness.FORMATS[fmt]), batch, device, mode == "compiled")
                         for n, m in zip(("zoo", "timm"), models)}
                for p in args.precision:
                    r = harness.run_rounds(harness.step_calls(sides, p), args.rounds, calls=args.steps,
                                           sync=lambda: sync(device), warmup=args.warmup)
                    w, c = r.paired("zoo", "timm"), r.paired("zoo", "timm", "cpu")
                    data["results"].append({
                        "arch": arch, "mode": mode, "format": fmt, "precision": p,
                        "zoo_img_s": args.batch / r.best("zoo"), "timm_img_s": args.batch / r.best("timm"),
                        "best_ratio": r.ratio("zoo", "timm"), "zoo_speed_over_timm_paired_median": w.median,
                        "range": [w.low, w.high], "cpu_time_paired_median": c.median, "cpu_time_range": [c.low, c.high],
                        "zoo_gflops": flops and args.batch * flops / r.best("zoo") / 1e9, "rounds": args.rounds,
                        "date": harness.now(), "load_average": os.getloadavg()[0], "wall": r.wall})
                    print(f"  {arch} {mode} {fmt} {p}: {r.summary('zoo', 'timm')}", flush=True)
            torch._dynamo.reset()
    if args.preset == "convnets":  # rows of other settings kept from the result before, and its command
        old, new = harness.load_result(args.json), data
        data = merged(old.get("data", {}), new)
        if len(data["results"]) > len(new["results"]):
            args.command = f"{old['command']}; {args.command}"
    return {"steps": convnets_table(data)}, data


def convnets_table(data: dict) -> dict:
    rows = [[r["arch"], r["mode"], r["format"], r["precision"], f"{r['zoo_img_s']:.1f}", f"{r['timm_img_s']:.1f}",
             f"{r['best_ratio']:.2f}x" if "best_ratio" in r else "-",
             str(harness.Paired(r["zoo_speed_over_timm_paired_median"], *r["range"])),
             str(harness.Paired(r["cpu_time_paired_median"], *r["cpu_time_range"])),
             f"{r['zoo_gflops']:.1f}" if r.get("zoo_gflops") else "-"] for r in data["results"]]
    notes = []
    for p in dict.fromkeys(r["precision"] for r in data["results"]):  # channels-last against contiguous, per side
        for arch, mode in dict.fromkeys((r["arch"], r["mode"]) for r in data["results"]):
            got = {r["format"]: r for r in data["results"] if (r["arch"], r["mode"], r["precision"]) == (arch, mode, p)}
            if len(got) == 2:
                gain = {s: got["channels_last"][f"{s}_img_s"] / got["contiguous"][f"{s}_img_s"]
                        for s in ("zoo", "timm")}
                notes.append(f"channels-last / contiguous, {arch} {mode} {p}: zoo {gain['zoo']:.2f}x, "
                             f"timm {gain['timm']:.2f}x (best rounds)")
    return harness.table(["model", "mode", "memory format", "precision", "zoo img/s", "timm img/s",
                          "zoo / timm (best rounds)", "zoo speed / timm, paired median (range)", "the same on CPU time",
                          "zoo GFLOP/s"], rows, "\n".join(notes))


def bound(rate: float) -> float:
    """About the most skipping gives at a last-block rate: the linear rule's mean rate over the blocks is
    rate / 2, that share of the branches' work saved (a bound when the blocks do equal work)."""
    return 1.0 / (1.0 - rate / 2)


def crossover(data: dict, mode: str, precision: str = "fp32"):
    """The lowest rate from which on (every higher rate measured too) `mode`'s paired median speed over
    mask's is above 1; None when there is no such rate."""
    rows = sorted((r for r in data["results"] if r["precision"] == precision), key=lambda r: r["rate"])
    above = [r[f"{mode}_over_mask"]["median"] > 1.0 for r in rows]
    first = next((i for i in range(len(rows)) if all(above[i:])), None)
    return None if first is None else rows[first]["rate"]


def drop_path(args) -> tuple[dict, dict]:
    """Each rate is the last block's (linear from 0 at the first, as in Huang et al. 2016); every mode has
    the same weights, batch and rate, channels-last."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch, 3, args.size, args.size, generator=g)
    batch = [x.contiguous(memory_format=torch.channels_last), torch.randint(0, 10, (args.batch,), generator=g)]
    data = {"arch": args.arch, "load_before": os.getloadavg()[0], "results": []}
    for p in args.precision:
        for rate in args.rates:
            sides = {}
            for mode in MODES:
                torch.manual_seed(0)
                cfg = ConvNetConfig(arch=args.arch, num_classes=10, drop_path_rate=rate, drop_path_mode=mode)
                sides[mode] = side(zoo.build(cfg).to(memory_format=torch.channels_last), batch)
                sides[mode].step(p)
            r = harness.run_rounds(harness.step_calls(sides, p), args.rounds, calls=args.steps)
            data["results"].append({"precision": p, "rate": rate,
                                    **{f"{m}_img_s": args.batch / r.best(m) for m in MODES},
                                    **{f"{m}_over_mask": r.paired(m, "mask")._asdict() for m in ("skip", "batch")},
                                    "seconds": r.wall})
            print(f"  {p} rate {rate}: {r.summary('skip', 'mask')}; {r.summary('batch', 'mask')}", flush=True)
    data["load_after"] = os.getloadavg()[0]
    rows = [[r["precision"], r["rate"], *(f"{r[f'{m}_img_s']:.1f}" for m in MODES),
             *(str(harness.Paired(**r[f"{m}_over_mask"])) for m in ("skip", "batch")), f"{bound(r['rate']):.2f}x"]
            for r in data["results"]]
    notes = []
    for p in args.precision:
        at = [r for r in data["results"] if r["precision"] == p]
        for mode in ("skip", "batch"):
            rate = crossover(data, mode, p)
            every = ", ".join(str(r["rate"]) for r in at if r[f"{mode}_over_mask"]["low"] > 1.0) or "no rate"
            beyond = ", ".join(str(r["rate"]) for r in at if r[f"{mode}_over_mask"]["median"] > bound(r["rate"])) \
                or "no rate"
            notes.append(f"{mode} / mask ({p}): paired median above 1.00x "
                         f"{'at no rate measured' if rate is None else f'from a last-block rate of {rate} on'}; "
                         f"every round faster at {every}; median beyond the bound (noise) at {beyond}.")
    notes.append(f"Load average (1 min): {data['load_before']:.1f} before, {data['load_after']:.1f} after.")
    return {"rates": harness.table(["precision", "last block's rate", "mask img/s", "skip img/s", "batch img/s",
                                    "skip / mask (paired median, range)", "batch / mask", "bound 1 / (1 - rate / 2)"],
                                   rows, "\n".join(notes))}, data


def recipe(args) -> tuple[dict, dict]:
    """Per seed, the digits preset as shipped (baseline) and with RECIPE's overrides: final validation top-1,
    loss and confidence (the mean highest softmax probability of the final weights)."""
    metrics, res = ("val_acc1", "val_loss", "val_confidence"), {"baseline": [], "recipe": []}
    for seed in args.seeds:
        for name, extra in (("baseline", []), ("recipe", RECIPE.split(","))):
            out = Path(args.out) / f"{name}-{seed}"
            rows = harness.run_loop(ROOT / "configs" / "convnet" / "resnet-digits.yaml", out, [
                f"train.max_steps={args.steps}", f"train.seed={seed}", f"train.precision={args.precision}", *extra],
                args.threads or 1)
            r = harness.last_with(rows, "val_acc1")
            res[name].append({"seed": seed, "val_acc1": r["val_acc1"], "val_loss": r["val_loss"],
                              "val_confidence": confidence(out)})
    rows = [[k, " ".join(f"{a[k]:.4f}" for a in res["baseline"]), " ".join(f"{b[k]:.4f}" for b in res["recipe"]),
             harness.interval_text([b[k] - a[k] for a, b in zip(res["baseline"], res["recipe"])], words="recipe")]
            for k in metrics]
    return {"recipe": harness.table(["metric", "baseline (per seed)", "recipe (per seed)",
                                     "recipe - baseline, mean ± 95% interval, verdict"], rows)}, res


def confidence(out: Path) -> float:
    return harness.run_task(out).predict(zoo.from_pretrained(out))[0].softmax(-1).max(-1).values.mean().item()


def main(argv=None, preset: str = "resnet"):
    runs = preset == "convnet-recipe"  # loop runs, not timed steps
    p = harness.parser(preset, __doc__, precision={"convnets": "bf16"}.get(preset, "fp32,bf16" if preset in
                                                                          ("resnet", "vit") else "fp32"),
                       rounds=not runs, keep_memory=not runs, one_precision=runs, seeds=3 if runs else 1)
    p.add_argument("--batch", type=harness.positive_int, default={"resnet": 16, "vit": 16, "drop-path": 32}.get(preset, 64))
    p.add_argument("--size", type=harness.positive_int, default=64 if preset == "drop-path" else 224, help="image size")
    p.add_argument("--steps", type=harness.positive_int, default={"convnets": 5, "convnet-recipe": 200}.get(preset, 2),
                   help="timed steps per round (convnet-recipe: training steps)")
    p.add_argument("--warmup", type=int, default=3 if preset == "convnets" else 1,
                   help="untimed steps per side and setting")
    resnets = ["resnet18", "resnet34", "resnet50", "resnet101", "resnet152"]
    p.add_argument("--archs", "--arch", type=harness.name_list(ARCHS + resnets + VITS, "arch"),
                   default="resnet50" if preset in ("resnet", "drop-path") else ",".join(VITS if preset == "vit" else ARCHS))
    p.add_argument("--modes", type=harness.name_list(("eager", "compiled"), "mode"),
                   default="eager,compiled" if preset == "convnets" else "eager")
    p.add_argument("--formats", type=harness.name_list(harness.FORMATS, "memory format"),
                   default="contiguous" if preset == "vit" else "contiguous,channels_last")
    p.add_argument("--device", default="cuda" if preset == "convnets" and torch.cuda.is_available() else "cpu")
    p.add_argument("--rates", type=float, nargs="+", default=[0.1, 0.3, 0.5], help="drop-path: last block's rates")
    p.add_argument("--out", default="runs/bench/convnet-recipe")
    args = p.parse_args(argv)
    args.preset, args.arch = preset, args.archs[0]
    harness.setup(args)
    harness.save(args, *(drop_path if preset == "drop-path" else recipe if runs else zoo_vs_timm)(args))


# ---------------------------------------------------------------- the techniques report's claims
def claim_channels_last(ctx) -> list[dict]:
    """Channels-last against contiguous: the resnet bench's training step, the same weights, paired rounds."""
    arch, batch, size = ctx.s.resnet
    rows = []
    for p in [ctx.precision] + (["bf16"] if ctx.s.name != "test" and ctx.precision != "bf16" else []):
        models = {f: build_pair(arch, 1000)[0] for f in harness.FORMATS}
        r = step_rounds(models, batch, size, 1000, p, ctx.n_rounds, ctx.device, harness.FORMATS)
        rows.append(ctx.speed("channels-last", r, "channels_last", "contiguous", f"channels-last ({arch}, {p})",
                              unit=f"step ({batch}x3x{size}x{size})"))
    return rows


def claim_stochastic_depth(ctx) -> list[dict]:
    """Stochastic depth. Speed: the report's ResNet without drop path against whole blocks skipped for the batch
    (drop_path_mode=batch, Huang et al. 2016) and the dropped rows skipped (skip), rates 0 to 0.5, paired rounds.
    Quality: a deep, thin ResNet on the digits without drop path and with the note's rates (1.0 kept at the first
    block to 0.5 at the last: drop_path_rate 0.5), loop runs per seed, no EMA."""
    arch, batch, size = ctx.s.resnet
    models = {}
    for name, rate, mode in (("none", 0.0, "mask"), ("batch", 0.5, "batch"), ("skip", 0.5, "skip")):
        torch.manual_seed(0)
        models[name] = zoo.build(ConvNetConfig(arch=arch, num_classes=10, drop_path_rate=rate, drop_path_mode=mode))
    r = step_rounds(models, batch, max(size, 64), 10, ctx.precision, ctx.n_rounds, ctx.device)  # skip: >= 1 sample
    steps, layers, ps = ctx.s.sd_steps, ctx.s.sd_layers, []
    for seed in range(ctx.seeds):
        res = {n: ctx.loop(f"sd_{rate}", ROOT / "configs" / "convnet" / "resnet-digits.yaml", [
            f"train.max_steps={steps}", f"train.eval_every={max(1, steps // 4)}",
            f"train.log_every={max(1, steps // 20)}", f"optim.warmup_steps={max(1, steps // 10)}",
            "train.ema_decay=null", f"model.drop_path_rate={rate}", f"model.layers={layers}".replace(" ", ""),
            f"model.width={ctx.s.sd_width}"], seed) for n, rate in (("none", 0.0), ("0.5", 0.5))}
        if seed == 0:
            ctx.plot("stochastic_depth_val", "deep ResNet on digits: stochastic depth 0.5 vs none (seed 0)", res,
                     "val_loss", "validation loss")
        ps.append({f"{n}_{k}": harness.last(res[n], f"val_{k}") for n in res for k in ("loss", "acc1")})
    m = {k: sum(p[k] for p in ps) / len(ps) for k in ps[0]}
    cfg = load_run_config(str(ROOT / "configs" / "convnet" / "resnet-digits.yaml"))
    n = len(digits_dataset("train", 8, 1, cfg.data.val_fraction)[1])
    net = (f"{2 * sum(layers) + 2}-layer ResNet, width {ctx.s.sd_width}, {steps * cfg.train.batch_size / n:.1f} epochs "
           f"of {n} digits")
    q = (f"val loss {m['none_loss']:.4f} -> {m['0.5_loss']:.4f}, top-1 {m['none_acc1']:.3f} -> {m['0.5_acc1']:.3f} "
         f"({net})")
    speed = ctx.speed("stochastic depth (speed)", r, "batch", "none", unit=f"{arch} step, rates 0 -> 0.5, batch skip",
                      speed=f"per-sample skip {r.paired('skip', 'none')}; ")
    speed["numbers"]["skip_speedup"] = r.paired("skip", "none").median
    return [speed, dict(key="stochastic depth (quality)", quality=q, numbers={"per_seed": ps},
                        samples=[(p["none_loss"] - p["0.5_loss"]) / p["none_loss"] for p in ps],
                        unmeasured=f"the depth and length the claim is about (Huang et al. 2016: 110 layers, 500 "
                                   f"epochs; here a {net})")]
