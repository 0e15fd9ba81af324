"""Sample quality on the embedded digits: flow matching against eps at equal steps, DiT against U-Net at equal FLOPs.

    python train/bench.py diffusion-quality --threads 1                 # 3 seeds, 300 U-Net steps, tables, JSON
    python train/bench.py diffusion-quality --steps 800 --seeds 0,1,2,3,4 --docs
    python train/bench.py diffusion-quality --render                    # docs tables from docs/diffusion_quality.json

Runs of the loop (train/run.py's) per seed, on the same digits, autoencoder, batch and seed:
  unet-eps:   configs/diffusion/digits.yaml (U-Net, eps, Min-SNR-5, DDIM) for --steps steps;
  unet-flow:  the same U-Net trained by flow matching (model.prediction=flow, logit-normal s, unweighted
              as SD3, model.min_snr_gamma=null), sampled by flow_euler, for the same --steps steps;
  dit-eps:    configs/diffusion/digits-dit.yaml (the tiny DiT, eps, Min-SNR-5, DDIM) for as many steps as
              use unet-eps's training FLOPs. The FLOPs of a training step (forward and backward of the
              denoiser's loss on a batch) are counted by torch.utils.flop_counter.FlopCounterMode,
              attention through SDPA's math kernel (whose matmuls it counts; the CPU's fused kernel it
              does not know); the forward alone is in the JSON too (forward + backward is ~3x it).
Every run keeps an EMA with decay 1 - 8 / its steps (so that the initial weights' share, e^-8, is gone
at any --steps; within [0.9, 0.999]) and samples from it. One autoencoder (the task's own, trained on the training digits
with seed 0) serves every run, so the seeds vary the denoiser's initialisation, batches and noise.

The judge (train/sample_quality.py): a ResNet-10 (configs/convnet/resnet-digits.yaml, on the same
train/val split of the digits as the diffusion runs) trained once into --out/classifier, or
--classifier RUN_DIR. Per run: --per-class guided samples of every digit (the config's sampler and
guidance, --sample-steps steps); "classifier FD" is the Frechet distance between the classifier's
penultimate features of those samples and of the real training digits, "sample accuracy" the
fraction the classifier labels as the digit asked for. Reference rows: the real held-out digits and
their autoencoder reconstructions (fewer images than the samples: the FD's bias grows as the count
falls, so compare FDs at equal counts only).

The tables: per side the mean over seeds with its 95% Student-t interval (harness.mean_interval),
and the paired difference (per seed) with its interval and verdict (inconclusive when the interval
holds zero). Validation loss only where comparable: unet-eps and dit-eps train the same weighted eps
loss on the same held-out latents; flow's loss has another target. Runs that finished in --out are
read back, not run again (delete the folder to redo them).
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

from train.benches import harness  # noqa: E402

DOCS_JSON = ROOT / "docs" / "diffusion_quality.json"
PAGE = ROOT / "docs" / "diffusion.md"
CONFIGS = ROOT / "configs" / "diffusion"
RUNS = {
    "unet-eps": ("digits.yaml", []),
    "unet-flow": ("digits.yaml", ["model.prediction=flow", "model.sampler=flow_euler", "model.min_snr_gamma=null"]),
    "dit-eps": ("digits-dit.yaml", []),
}


def shared_autoencoder(out: Path, steps: int, say) -> Path:
    """The digits autoencoder of configs/diffusion/digits.yaml (`steps` steps), trained once (seed 0) into `out`."""
    import zoo
    from train.config import load_run_config
    from train.tasks.diffusion import load_images, train_autoencoder
    from zoo.diffusion.latent import build_autoencoder
    path = out / "autoencoder" / "taesd-digits_encoder.safetensors"
    if not path.is_file():
        cfg = load_run_config(str(CONFIGS / "digits.yaml"), [f"data.ae_steps={steps}"])
        d = cfg.data
        torch.manual_seed(0)
        ae = train_autoencoder(build_autoencoder(cfg.model), load_images(d, cfg.model.image_size, cfg.source)[0],
                               d.ae_steps, d.ae_batch_size, d.ae_lr, d.ae_latent_noise, torch.device("cpu"), 0, say)
        zoo.save_pretrained(ae, path)
    return path


def run_config(name: str, seed: int, steps: int, args, ae: Path):
    from train.config import load_run_config
    config, extra = RUNS[name]
    return load_run_config(str(CONFIGS / config), extra + [
        f"train.out_dir={Path(args.out) / f'{name}-seed{seed}'}", f"train.max_steps={steps}", f"train.seed={seed}",
        f"train.ema_decay={ema_decay(steps):.6g}", f"train.eval_every={steps}", "train.checkpoint_every=0",
        f"train.precision={args.precision}", "train.samples=false", "train.plot=false", "train.export=false",
        "train.progress=false", "train.resume=false", f"model.autoencoder.weights={ae}"])


def ema_decay(steps: int) -> float:
    """1 - 8 / steps (the initial weights keep e^-8 of the EMA at the end), within [0.9, 0.999]."""
    return min(0.999, max(0.9, 1 - 8 / steps))


def step_flops(cfg) -> dict:
    """FLOPs of one training step of cfg's denoiser on a batch of cfg.train.batch_size latents:
    {"forward": ..., "train": forward + backward}, counted by FlopCounterMode."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    import zoo
    model = zoo.build(cfg.model)
    B, C, s = cfg.train.batch_size, model.latent_channels, model.latent_size
    z, noise = torch.randn(B, C, s, s), torch.randn(B, C, s, s)
    t = torch.rand(B) if cfg.model.prediction == "flow" else torch.randint(cfg.model.num_timesteps, (B,))
    labels = torch.randint(cfg.model.num_classes, (B,))
    out = {}
    with sdpa_kernel(SDPBackend.MATH):
        for what in ("forward", "train"):
            with FlopCounterMode(display=False) as counter:
                loss = model(z, labels, t, noise).mean()
                if what == "train":
                    loss.backward()
            out[what] = counter.get_total_flops()
    return out


def classifier(args, say):
    from train.sample_quality import Classifier
    if args.classifier:
        return Classifier.from_run(args.classifier), args.classifier
    from train.config import load_run_config
    from train.loop import train
    run = Path(args.out) / "classifier"
    if not (run / "model.safetensors").is_file():
        cfg = load_run_config(str(ROOT / "configs" / "convnet" / "resnet-digits.yaml"), [
            f"train.out_dir={run}", "data.val_fraction=0.1", "train.seed=0", f"train.max_steps={args.classifier_steps}",
            "train.samples=false", "train.plot=false", "train.export=false", "train.progress=false",
            "train.resume=false", "train.checkpoint_every=0"])
        say(f"== classifier: {cfg.train.max_steps} steps of configs/convnet/resnet-digits.yaml into {run}")
        train(cfg, log=lambda m: None)
    return Classifier.from_run(run), str(run)


def trained(cfg, say) -> tuple:
    """(EMA model, final evaluation row, seconds) of the run cfg describes, run unless it finished."""
    from safetensors.torch import load_model

    import zoo
    from train.loop import train
    from train.metrics import read_rows
    out = Path(cfg.train.out_dir)
    done = out / "model_ema.safetensors"
    seconds = None
    if not done.is_file():
        say(f"== {out.name}: {cfg.train.max_steps} steps")
        t0 = time.perf_counter()
        train(cfg, log=lambda m: None)
        seconds = time.perf_counter() - t0
    model = zoo.build(cfg.model)
    load_model(model, str(done))
    return model.eval(), [r for r in read_rows(out) if "val_loss" in r][-1], seconds


def measure(args, say=print) -> dict:
    from train.data.images import digits_dataset
    from train.sample_quality import judge
    from train.tasks.diffusion import sample_grid

    out = Path(args.out)
    judge_model, judge_run = classifier(args, say)
    ae = shared_autoencoder(out, args.ae_steps, say)
    x_tr, _ = digits_dataset("train", 32, 3, 0.1)      # the diffusion task's split (data.val_fraction 0.1)
    x_va, y_va = digits_dataset("val", 32, 3, 0.1)
    real = judge_model(x_tr)[0]

    cfg0 = {n: run_config(n, 0, args.steps, args, ae) for n in RUNS}
    flops = {n: step_flops(c) for n, c in cfg0.items()}
    budget = flops["unet-eps"]["train"] * args.steps
    steps = {n: args.steps if n.startswith("unet") else max(1, round(budget / flops[n]["train"])) for n in RUNS}
    say(f"training FLOPs per step: " + ", ".join(f"{n} {f['train'] / 1e9:.2f}G" for n, f in flops.items())
        + f"; steps: {steps}")

    import zoo
    model = zoo.build(cfg0["unet-eps"].model)     # the autoencoder's reconstructions: the ceiling it sets
    with torch.no_grad():
        recon = model.autoencoder(x_va).clamp(0, 1)
    reference = {"real held-out digits": judge(judge_model, x_va, y_va, real),
                 "their autoencoder reconstructions": judge(judge_model, recon, y_va, real)}
    reference = {k: dict(v, images=len(x_va)) for k, v in reference.items()}
    del model

    per_seed = {}
    labels = torch.arange(10).repeat_interleave(args.per_class)
    for seed in args.seeds:
        per_seed[seed] = {}
        for name in RUNS:
            cfg = run_config(name, seed, steps[name], args, ae)
            model, ev, seconds = trained(cfg, say)
            images = sample_grid(model, args.per_class, torch.device("cpu"), seed=seed, steps=args.sample_steps)
            res = {"val_loss": ev["val_loss"], "val_mse": ev["val_mse"], "steps": steps[name],
                   "train_seconds": seconds, **judge(judge_model, images, labels, real)}
            per_seed[seed][name] = res
            say(f"   {name} seed {seed}: classifier FD {res['classifier_fd']:.2f}, sample accuracy "
                f"{res['sample_accuracy']:.3f}, val loss {res['val_loss']:.4f}")
    return {"steps": steps, "flops_per_step": flops, "budget_flops": budget, "per_seed": per_seed,
            "reference": reference, "classifier": judge_run, "autoencoder": str(ae),
            "args": {k: v for k, v in vars(args).items() if k not in ("render", "docs")},
            "samples": len(labels), "real_reference_images": len(x_tr), "threads": torch.get_num_threads(),
            "load_average": os.getloadavg()[0], "torch": torch.__version__}


def _cell(values) -> str:
    m, h = harness.mean_interval(values)
    return f"{m:.3f} ± {h:.3f}" if h < float("inf") else f"{m:.3f}"


def _diff(data, metric, side, ref, better) -> tuple[str, str]:
    seeds = data["per_seed"].values()
    m, h = harness.mean_interval(s[side][metric] - s[ref][metric] for s in seeds)
    word = harness.verdict(m, h, lower_is="lower")
    good = word == better
    return f"{m:+.3f} ± {h:.3f}", "inconclusive" if word == "inconclusive" else (
        f"{side} {word} ({'better' if good else 'worse'})")


def tables(data: dict) -> dict[str, str]:
    seeds = list(data["per_seed"].values())
    n = len(seeds)
    col = lambda name, k: [s[name][k] for s in seeds]  # noqa: E731
    ref = [[name, "-", "-", f"{r['classifier_fd']:.3f}", f"{r['sample_accuracy']:.3f}", f"({r['images']} images)"]
           for name, r in data["reference"].items()]
    head = ["run", "steps", "training FLOPs", "classifier FD (lower is better)", "sample accuracy"]

    def side(name, extra):
        st = data["steps"][name]
        return [name, st, f"{data['flops_per_step'][name]['train'] * st:.3g}", _cell(col(name, "classifier_fd")),
                _cell(col(name, "sample_accuracy")), extra(name)]

    flow_rows = [side(n, lambda n: _cell(col(n, "val_mse")) + " (not comparable)") for n in ("unet-eps", "unet-flow")]
    d_fd, v_fd = _diff(data, "classifier_fd", "unet-flow", "unet-eps", "lower")
    d_acc, v_acc = _diff(data, "sample_accuracy", "unet-flow", "unet-eps", "higher")
    flow_rows.append(["flow - eps (paired by seed)", "", "", f"{d_fd}: {v_fd}", f"{d_acc}: {v_acc}", ""])
    dit_rows = [side(n, lambda n: _cell(col(n, "val_loss"))) for n in ("unet-eps", "dit-eps")]
    d_fd, v_fd = _diff(data, "classifier_fd", "dit-eps", "unet-eps", "lower")
    d_acc, v_acc = _diff(data, "sample_accuracy", "dit-eps", "unet-eps", "higher")
    d_vl, v_vl = _diff(data, "val_loss", "dit-eps", "unet-eps", "lower")
    dit_rows.append(["DiT - U-Net (paired by seed)", "", "", f"{d_fd}: {v_fd}", f"{d_acc}: {v_acc}", f"{d_vl}: {v_vl}"])
    note = f"mean ± 95% interval over {n} seeds; {data['samples']} samples per run"
    return {"diffusion-quality-flow": harness.table_text(head + [f"val MSE of the prediction ({note})"],
                                                         flow_rows + ref),
            "diffusion-quality-dit": harness.table_text(head + [f"val loss, weighted eps ({note})"], dit_rows + ref)}


def render(data: dict, page: Path = PAGE, write: bool = True) -> list[str]:
    return [name for name, text in tables(data).items() if harness.update_docs_table(page, name, text, write)]


def main(argv=None):
    ap = harness.parser("diffusion-quality", __doc__, precision=None, rounds=False)
    ap.add_argument("--precision", type=harness.precision_name, default="fp32", help="the runs' train.precision")
    ap.add_argument("--steps", type=harness.positive_int, default=300, help="the U-Net runs' steps (config: 800)")
    ap.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1, 2],
                    help="comma list of train.seed values (at least 2 for an interval; 3 for a claim)")
    ap.add_argument("--per-class", type=harness.positive_int, default=20, help="samples per digit and run")
    ap.add_argument("--sample-steps", type=harness.positive_int, default=25, help="sampler steps (config: 50)")
    ap.add_argument("--classifier", default=None, help="a finished convnet run folder to judge with (default: "
                                                        "train configs/convnet/resnet-digits.yaml into --out/classifier)")
    ap.add_argument("--ae-steps", type=harness.positive_int, default=300, help="the shared autoencoder's "
                                                                                "steps (config: 300)")
    ap.add_argument("--classifier-steps", type=harness.positive_int, default=200)
    ap.add_argument("--out", default="runs/bench-diffusion-quality")
    ap.add_argument("--docs", action="store_true", help=f"also write {DOCS_JSON.name} and the tables in docs/diffusion.md")
    ap.add_argument("--render", action="store_true", help="only re-render the docs tables from the docs JSON")
    args = ap.parse_args(argv)
    if args.render:
        return harness.render_docs(DOCS_JSON, render)
    if len(args.seeds) < 2:
        ap.error("--seeds: at least two seeds for an interval")
    harness.setup(args)
    data = measure(args, say=lambda m: print(m, flush=True))
    for name, text in tables(data).items():
        print(f"\n{name}\n{text}", end="")
    harness.write_results(data, Path(args.out) / "diffusion_quality.json", DOCS_JSON if args.docs else None, render)
    return 0


if __name__ == "__main__":
    sys.exit(main())
