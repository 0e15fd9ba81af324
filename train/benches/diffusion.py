"""Latent diffusion: the autoencoder and DiT against diffusers, the latent cache, and sample quality.

    python train/bench.py taesd              # TAESD encode + decode vs diffusers' AutoencoderTiny, same weights
    python train/bench.py dit                # DiT-S/2 training step vs diffusers' DiTTransformer2DModel
    python train/bench.py flux2              # FLUX.2 training and guided sampling steps vs Flux2Transformer2DModel
    python train/bench.py latent-cache       # training from the latent cache vs encoding every step (TAEF2)
    python train/bench.py min-snr            # Min-SNR-5 vs uniform loss weighting on the digits, equal steps
    python train/bench.py diffusion-quality  # flow vs eps at equal steps, DiT vs U-Net at equal FLOPs, over seeds
    python train/bench.py prompt-adherence   # digits-text.yaml's samples of each digit's prompt, judged per seed
    python train/bench.py dreambooth         # a LoRA on five styled threes with a rare token, against the base

Quality: samples judged by a digits classifier (accuracy, Frechet distance of its features).
"""
from __future__ import annotations

import copy
import itertools
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import zoo
from train.benches import harness
from train.benches.harness import ROOT
from train.config import load_run_config
from train.data.images import digits_dataset, write_photo_tiles
from train.hardware import sync
from train.sample import generate_run
from train.sample_quality import Classifier, judge
from train.tasks.diffusion import DiffusionTask, load_images, sample_grid, save_grid, train_autoencoder
from train.tasks.text_to_image import DIGITS, load_captioned

CONFIGS = ROOT / "configs" / "diffusion"
TAEF2 = ROOT.parent / "shared" / "weights" / "taef2_encoder.pth"
DENOISERS = [("tiny", 1), ("S", 2)]  # latent-cache's DiTs: preset, patch
KINDS = {"matmul": ("aten::mm", "aten::addmm", "aten::bmm", "aten::mkldnn_convolution", "aten::convolution_backward"),
         "attention": ("aten::_scaled_dot_product_flash_attention_for_cpu",
                       "aten::_scaled_dot_product_flash_attention_for_cpu_backward")}
RUNS = {  # diffusion-quality's runs: config, overrides
    "unet-eps": ("digits.yaml", []),
    "unet-flow": ("digits.yaml", ["model.prediction=flow", "model.sampler=flow_euler", "model.min_snr_gamma=null"]),
    "dit-eps": ("digits-dit.yaml", []),
}


def versus(r, a="zoo", b="diffusers") -> list[str]:
    return [f"{r.ratio(a, b):.2f}x", str(r.paired(a, b))]


def taesd(args) -> tuple[dict, dict]:
    """One encode + decode of a batch per call through each library's API (diffusers takes [-1, 1], Zoo [0, 1])."""
    from diffusers import AutoencoderTiny
    device = torch.device(args.device)
    torch.manual_seed(0)
    ref = AutoencoderTiny(latent_channels=4).eval()
    ours, rows, data, g = harness.zoo_copy(ref).eval(), [], {}, torch.Generator().manual_seed(1)
    for prec in args.precision:
        for fmt in args.formats:
            mf, dt = harness.FORMATS[fmt], harness.PRECISIONS[prec]
            a, b = ours.to(device, dt, memory_format=mf), ref.to(device, dt, memory_format=mf)
            x = torch.rand(args.batch, 3, args.size, args.size, generator=g.manual_seed(1)).to(device, dt)
            x = x.contiguous(memory_format=mf)
            sides = {"zoo": lambda: a.decode(a.encode(x)),
                     "diffusers": lambda: b.decode(b.encode(x * 2 - 1).latents).sample}
            with torch.inference_mode():
                diff = (sides["zoo"]().float() * 2 - 1 - sides["diffusers"]().float()).abs().max().item()  # warm-up
                r = harness.run_rounds(sides, args.rounds, sync=lambda: sync(device))
            rows.append([prec, fmt, f"{args.batch / r.best('zoo'):.3f}", f"{args.batch / r.best('diffusers'):.3f}",
                         *versus(r), f"{diff:.2e}"])
            data[f"{prec} {fmt}"] = r.wall
    low = min(float(row[5].split("x")[0]) for row in rows)
    return {"speed": harness.table(["precision", "memory format", "zoo img/s", "diffusers img/s",
                                    "zoo / diffusers (best rounds)", "median of paired rounds (range)", "max abs diff"],
                                   rows, f"lowest paired median: {low:.2f}x (target >= 1.0x)")}, data


# ---------------------------------------------------------------- dit
def dit_pair(preset: str, size: int, patch: int = 2, classes: int = 1000):
    """Zoo's DiT loaded from diffusers' (random init redrawn N(0, 0.02); one timestep + class embedder copied
    into every block, as published DiTs are stored), fp32, training mode."""
    import diffusers

    from zoo.config import DIT_PRESETS
    depth, width, heads = DIT_PRESETS[preset]
    torch.manual_seed(0)
    ref = diffusers.DiTTransformer2DModel(num_attention_heads=heads, attention_head_dim=width // heads, in_channels=4,
                                          out_channels=8, num_layers=depth, sample_size=size, patch_size=patch,
                                          num_embeds_ada_norm=classes)
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.02)
        for b in ref.transformer_blocks[1:]:
            b.norm1.emb.load_state_dict(ref.transformer_blocks[0].norm1.emb.state_dict())
    return harness.zoo_copy(ref).train(), ref.train()


def profile_step(step, steps: int) -> dict[str, float]:
    """Milliseconds per step by kind of work (torch.profiler's CPU self times): matmul, attention, compiled
    kernels (a compiled graph's self time), optimizer (the whole AdamW step) and other."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    kinds, events = dict.fromkeys([*KINDS, "compiled kernels", "optimizer", "other"], 0.0), prof.key_averages()
    for e in events:
        kind = next((k for k, names in KINDS.items() if e.key in names),
                    "compiled kernels" if "CompiledFxGraph" in e.key else None)
        if kind is not None:
            kinds[kind] += e.self_cpu_time_total
        elif e.key.startswith("Optimizer.step"):
            kinds["optimizer"] += e.cpu_time_total  # its children (the fused AdamW kernel) included
    kinds["other"] = sum(e.self_cpu_time_total for e in events) - sum(kinds.values())
    kinds = {k: v / 1e3 / steps for k, v in kinds.items()}
    return dict(kinds, total=sum(kinds.values()))


def dit(args) -> tuple[dict, dict]:
    """A step: forward, MSE against a fixed target, backward, torch's fused AdamW, zero_grad, on the same
    latents, timesteps and labels; diffusers' label embedder drops labels at random in training (p = 0.1)."""
    models = dict(zip(("zoo", "diffusers"), dit_pair(args.preset_dit, args.size)))
    g, B, S = torch.Generator().manual_seed(0), args.batch, args.size
    x, t = torch.randn(B, 4, S, S, generator=g), torch.randint(0, 1000, (B,), generator=g)
    y, target = torch.randint(0, 1000, (B,), generator=g), torch.randn(B, 8, S, S, generator=g)

    def loss(name):
        return lambda f: F.mse_loss((f(x, t, y) if name == "zoo" else f(x, t, y).sample).float(), target)
    opts = {n: torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True) for n, m in models.items()}
    rows, profiles, data = [], [], {}
    for p in args.precision:
        for mode in args.modes:
            calls = harness.step_calls({n: harness.Side(m, loss(n), opts[n], compile=mode == "compiled")
                                        for n, m in models.items()}, p)
            r = harness.run_rounds(calls, args.rounds, calls=args.steps, warmup=args.warmup)
            rows.append([p, mode, f"{B / r.best('zoo'):.2f}", f"{B / r.best('diffusers'):.2f}", *versus(r)])
            data[f"{p} {mode}"] = r.wall
            print(f"  {p} {mode}: {r.summary('zoo', 'diffusers')}", flush=True)
            for n, fn in calls.items() if args.profile else ():
                kinds = profile_step(fn, args.profile)
                profiles.append([f"{p} {mode}", n, *(f"{v:.0f}" for v in kinds.values())])
    notes = []
    for p in args.precision:  # each side at its best mode: its best round against the other's
        at = [row for row in rows if row[0] == p]
        z, d = max(at, key=lambda row: float(row[2])), max(at, key=lambda row: float(row[3]))
        notes.append(f"Each at its best, {p}: zoo {z[1]} {z[2]} img/s, diffusers {d[1]} {d[3]} img/s: "
                     f"{float(z[2]) / float(d[3]):.2f}x (best rounds).")
    tables = {"speed": harness.table(["precision", "mode", "zoo img/s", "diffusers img/s",
                                      "zoo / diffusers (best rounds)", "median of paired rounds (range)"], rows,
                                     "\n\n".join(notes))}
    if profiles:
        kinds = [*KINDS, "compiled kernels", "optimizer", "other", "total"]
        tables["profile"] = harness.table(["setting", "side", *(f"{k} ms" for k in kinds)], profiles)
    return tables, data


def flux2(args) -> tuple[dict, dict]:
    """Zoo's Flux2 against diffusers' Flux2Transformer2DModel with the same weights (diffusers' init, its folder
    loaded by zoo.from_pretrained), batch B of `--size`^2 latent tokens and `--text` text tokens. A training step:
    forward, MSE against a fixed velocity target, backward, fused AdamW, zero_grad. A sampling step: the forward
    of the prompts and the empty prompt together (2B rows, classifier-free guidance), no gradient."""
    import diffusers
    from diffusers.pipelines.flux2.pipeline_flux2 import Flux2Pipeline
    torch.manual_seed(0)
    ref = diffusers.Flux2Transformer2DModel(
        num_layers=args.double, num_single_layers=args.single, num_attention_heads=args.heads, attention_head_dim=128,
        axes_dims_rope=(32, 32, 32, 32), in_channels=128, joint_attention_dim=args.text_dim, guidance_embeds=False)
    models = {"zoo": harness.zoo_copy(ref), "diffusers": ref}
    g, B, n = torch.Generator().manual_seed(0), args.batch, args.size
    x, c = torch.randn(B, n * n, 128, generator=g), torch.randn(B, args.text, args.text_dim, generator=g)
    t, target = torch.rand(B, generator=g), torch.randn(B, n * n, 128, generator=g)
    ids = dict(img_ids=Flux2Pipeline._prepare_latent_ids(torch.zeros(B, 1, n, n)),
               txt_ids=Flux2Pipeline._prepare_text_ids(c))
    guided = dict(hidden_states=x.repeat(2, 1, 1), encoder_hidden_states=torch.cat([c, torch.zeros_like(c)]),
                  timestep=t.repeat(2), img_ids=ids["img_ids"].repeat(2, 1, 1), txt_ids=ids["txt_ids"].repeat(2, 1, 1))
    out = lambda f, name, **a: f(**a) if name == "zoo" else f(**a).sample  # noqa: E731
    rows, data = [], {}
    for p in args.precision:
        sides = {n_: harness.Side(m, lambda f, n_=n_: F.mse_loss(out(f, n_, hidden_states=x, encoder_hidden_states=c,
                                                                      timestep=t, **ids).float(), target),
                                  torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True)) for n_, m in models.items()}

        def sample(name, p=p):
            with torch.no_grad(), harness.autocast(p):
                return out(models[name].eval(), name, **guided)
        for kind, calls in (("training step", harness.step_calls(sides, p)),
                            ("sampling step (CFG)", {n_: (lambda n_=n_: sample(n_)) for n_ in models})):
            r = harness.run_rounds(calls, args.rounds, calls=args.steps, warmup=1)
            rows.append([kind, p, f"{r.best('zoo') * 1e3:.0f}", f"{r.best('diffusers') * 1e3:.0f}", *versus(r)])
            data[f"{kind} {p}"] = r.wall
            print(f"  {kind} {p}: {r.summary('zoo', 'diffusers')}", flush=True)
            for m in models.values():
                m.train()
    shape = (f"{args.double} double + {args.single} single blocks, width {args.heads * 128}, batch {B}, {n * n} "
             f"latent + {args.text} text tokens")
    return {"speed": harness.table(["step", "precision", "zoo ms", "diffusers ms", "zoo speed / diffusers (best "
                                    "rounds)", "median of paired rounds (range)"], rows, shape)}, data


def latent_cache(args) -> tuple[dict, dict]:
    """Per DiT denoiser, two copies trained on the same rows: `cache` (task.train_batch reads the latent cache,
    the loop's path) against `encode` (the rows as decoded pixels in memory, encoded by the frozen TAEF2
    every step, which leaves PNG decoding out in its favour). The first denoiser's setup builds the cache."""
    device, B, rows, data = torch.device(args.device), args.batch, [], {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        n_images = write_photo_tiles(tmp / "tiles")
        for preset, patch in DENOISERS:
            cfg = load_run_config(None, [], base={
                "family": "diffusion", "data": {"dataset": str(tmp / "tiles"), "cache_dir": str(tmp / "cache")},
                "model": {"image_size": args.size, "num_classes": 4, "denoiser": "dit",
                          "dit": {"preset": preset, "patch_size": patch},
                          "autoencoder": {"weights": str(args.weights), "latent_channels": 32, "midblock_gn": True}},
                "train": {"out_dir": str(tmp / "run"), "batch_size": B, "device": args.device, "progress": False}})
            logs, t0 = [], time.perf_counter()
            task = DiffusionTask(cfg, device, log=logs.append)
            task.setup()
            setup_s = time.perf_counter() - t0
            cache = "reused" if any(m.startswith("latents: reusing") for m in logs) else "built"
            images = load_images(cfg.data, args.size, cfg.source)
            pixels = images.read("train", 0, len(images.labels["train"])).to(device)
            ae, base = task.autoencoder.to(device).eval(), task.build_model().to(device)

            def encoded(step):  # train_batch's rows, as pixels, encoded now
                gen = task.batch_generator(step, 0)
                idx = torch.randint(len(pixels), (B,), generator=gen).to(device)
                with torch.no_grad():
                    z = task._normalised(ae.encode(pixels[idx]))
                return task._noised(z, task.y_tr["train"][idx], gen, cfg.model.class_dropout)
            batches = {"cache": lambda step: task.train_batch(step, 0), "encode": encoded}
            steps = {n: itertools.count(1) for n in batches}  # each side's own step count
            loss = lambda n: lambda model: task.loss(model, batches[n](next(steps[n])))[0]  # noqa: E731
            for p in args.precision:
                models = {n: copy.deepcopy(base) for n in batches}
                calls = harness.step_calls({n: harness.Side(m, loss(n), torch.optim.AdamW(
                    m.denoiser.parameters(), lr=1e-4), device=device) for n, m in models.items()}, p)
                r = harness.run_rounds(calls, args.rounds, calls=args.steps, sync=lambda: sync(device), warmup=1)
                rows.append([f"DiT-{preset}/{patch}", f"{base.num_params() / 1e6:.1f}M", p, *(f"{B / r.best(n):.2f}"
                             for n in batches), str(r.paired("cache", "encode")), f"{cache} ({setup_s:.1f})"])
                data[f"DiT-{preset}/{patch} {p}"] = r.wall
    return {"speed": harness.table(["denoiser", "params", "precision", "cache img/s", "encode-every-step img/s",
                                    "speed-up, paired median (range)", "setup: latent cache (s)"], rows,
                                   f"{n_images} photo tiles, latents of shape {tuple(task.latents.shape)}")}, data


# ---------------------------------------------------------------- min-snr
def digits_classifier(size: int):
    """Logistic regression on the training digits, seen as generated images are: size x size RGB in [0, 1]
    pooled back to 8x8 grey. Returns predict_proba(images) -> (N, 10)."""
    from sklearn.linear_model import LogisticRegression
    features = lambda x: F.adaptive_avg_pool2d(x.float().mean(1, keepdim=True), 8).flatten(1).cpu().numpy()  # noqa
    x, y = digits_dataset("train", size, 3)
    clf = LogisticRegression(max_iter=3000, C=1.0).fit(features(x), y.numpy())
    return lambda images: clf.predict_proba(features(images))


def digits_judge(out: Path, steps: int = 200):
    """The judge of samples: the digits ResNet-10 trained `steps` steps through the loop into out/classifier, and its
    features of the training digits (the Frechet distance's reference). (Classifier, features)."""
    run = Path(out) / "classifier"
    harness.run_loop(ROOT / "configs" / "convnet" / "resnet-digits.yaml", run, [
        "data.val_fraction=0.1", "train.seed=0", f"train.max_steps={steps}", "train.resume=false",
        "train.checkpoint_every=0"], inproc=True)
    model = Classifier.from_run(run)
    return model, model(digits_dataset("train", 32, 3, 0.1)[0])[0]


def score(proba, labels) -> dict:
    pred, conf, labels = proba.argmax(1), proba.max(1), labels.cpu().numpy()
    return {"accuracy": float((pred == labels).mean()), "confidence": float(conf.mean()),
            "confident": float(((pred == labels) & (conf > 0.5)).mean())}


def train_settings(out: Path, steps=None, precision=None, overrides=(), per_class: int = 20, say=print,
                   judge=None) -> dict:
    """The digits preset trained through the loop with Min-SNR-5 and with uniform weighting, all else equal:
    {setting: {"curve": [(step, val_mse, ema_val_mse)], "rows", accuracy, confidence, confident (, classifier_fd:
    with `judge`, digits_judge's)}}; a samples PNG per setting in `out`."""
    from train.sample_quality import judge as judged
    results, classify, config = {}, None, str(CONFIGS / "digits.yaml")
    for name, gamma in (("gamma=5", 5.0), ("uniform", "null")):
        over = [f"model.min_snr_gamma={gamma}", "train.resume=false", *([f"train.max_steps={steps}"] if steps else []),
                *([f"train.precision={precision}"] if precision else []), *overrides]
        run = Path(out) / name.replace("=", "")
        say(f"== {name}")
        rows = harness.run_loop(config, run, over, inproc=True, done=None)
        cfg, model = ema_model(run, config, over)
        if classify is None:
            classify = digits_classifier(cfg.model.image_size)
            xv, yv = digits_dataset("val", cfg.model.image_size, 3)
            with torch.no_grad():
                recon = model.autoencoder(xv).clamp(0, 1)
            say(f"classifier ceiling: real val digits {score(classify(xv), yv)['accuracy']:.3f}, "
                f"their autoencoder reconstructions {score(classify(recon), yv)['accuracy']:.3f}")
        images = sample_grid(model, per_class, torch.device("cpu"), seed=0)
        save_grid(images, Path(out) / f"samples_{name.replace('=', '')}.png", nrow=per_class)
        labels = torch.arange(cfg.model.num_classes).repeat_interleave(per_class)
        results[name] = {"curve": [(r["step"], r["val_mse"], r.get("ema_val_mse")) for r in rows if "val_mse" in r],
                         "rows": rows, **score(classify(images), labels),
                         **(judged(judge[0], images, None, judge[1]) if judge else {})}
    return results


def ema_model(run: Path, config, over: list):
    """(`config` with `over`, its model with the run's EMA weights, else its final ones, in eval mode)."""
    from safetensors.torch import load_model
    cfg = load_run_config(str(config), over)
    model, ema = zoo.build(cfg.model), run / "model_ema.safetensors"
    load_model(model, str(ema if ema.is_file() else run / "model.safetensors"))
    return cfg, model.eval()


def min_snr(args) -> tuple[dict, dict]:
    from train.plots import line_plot
    res = train_settings(Path(args.out), args.steps, args.precision, args.overrides, args.per_class)
    names, cell = list(res), lambda pt: f"{pt[1]:.4f}" + (f" ({pt[2]:.4f})" if pt[2] is not None else "")  # (EMA's)
    curve = [[s, *(cell(res[n]["curve"][i]) for n in names)] for i, (s, *_) in enumerate(res[names[0]]["curve"])]
    line_plot({n: [(s, v) for s, v, _ in r["curve"]] for n, r in res.items()}, Path(args.out) / "loss_curves.png",
              "step", "validation MSE (unweighted)", title="validation MSE of each weighting", markers=set(res))
    samples = [[n, *(f"{r[k]:.3f}" for k in ("accuracy", "confidence", "confident"))] for n, r in res.items()]
    return {"curves": harness.table(["step", *(f"{n} val MSE (EMA)" for n in names)], curve),
            "samples": harness.table(["setting", "accuracy", "mean confidence", "correct & confidence > 0.5"], samples,
                                     f"{args.per_class} samples per class from the EMA model, a digits classifier")}, \
        {n: {k: v for k, v in r.items() if k != "rows"} for n, r in res.items()}


# ---------------------------------------------------------------- diffusion-quality
def step_flops(cfg) -> dict:
    """FLOPs of one training step of cfg's denoiser on a batch (FlopCounterMode; attention through SDPA's
    math kernel, whose matmuls it counts): {"forward", "train": forward + backward}."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode
    model = zoo.build(cfg.model)
    B, C, s = cfg.train.batch_size, model.latent_channels, model.latent_size
    z, noise = torch.randn(B, C, s, s), torch.randn(B, C, s, s)
    t = torch.rand(B) if cfg.model.prediction == "flow" else torch.randint(cfg.model.num_timesteps, (B,))
    labels, out = torch.randint(cfg.model.num_classes, (B,)), {}
    with sdpa_kernel(SDPBackend.MATH):
        for what in ("forward", "train"):
            with FlopCounterMode(display=False) as counter:
                loss = model(z, labels, t, noise).mean()
                if what == "train":
                    loss.backward()
            out[what] = counter.get_total_flops()
    return out


def diffusion_quality(args) -> tuple[dict, dict]:
    """Per seed: the U-Net with eps and with flow matching for --steps steps, the DiT (eps) for the U-Net's
    training FLOPs; one shared autoencoder; each run's EMA (decay 1 - 8 / steps, within [0.9, 0.999])
    sampled --per-class times per digit and judged by a ResNet-10 digits classifier."""
    from zoo.diffusion.latent import build_autoencoder
    out = Path(args.out)
    judge_model, real = digits_judge(out)
    ae = out / "autoencoder" / "taesd-digits_encoder.safetensors"
    if not ae.is_file():  # the digits autoencoder, trained once (seed 0)
        cfg = load_run_config(str(CONFIGS / "digits.yaml"), ["data.ae_steps=300"])
        d = cfg.data
        torch.manual_seed(0)
        images = load_images(d, cfg.model.image_size, cfg.source)
        pixels = images.read("train", 0, len(images.labels["train"]))
        zoo.save_pretrained(train_autoencoder(build_autoencoder(cfg.model), pixels, d.ae_steps, d.ae_batch_size,
                                              d.ae_lr, d.ae_latent_noise, torch.device("cpu"), 0, print), ae)
    x_va, y_va = digits_dataset("val", 32, 3, 0.1)

    def overrides(name, seed, steps):
        decay = min(0.999, max(0.9, 1 - 8 / steps))
        return RUNS[name][1] + [f"train.max_steps={steps}", f"train.seed={seed}", f"train.eval_every={steps}",
                                f"train.ema_decay={decay:.6g}", "train.checkpoint_every=0", "train.resume=false",
                                f"train.precision={args.precision}", f"model.autoencoder.weights={ae}"]

    def config(name, seed, steps):
        return load_run_config(str(CONFIGS / RUNS[name][0]), overrides(name, seed, steps))
    flops = {n: step_flops(config(n, 0, args.steps)) for n in RUNS}
    budget = flops["unet-eps"]["train"] * args.steps
    steps = {n: args.steps if n.startswith("unet") else max(1, round(budget / flops[n]["train"])) for n in RUNS}
    with torch.no_grad():
        recon = zoo.build(config("unet-eps", 0, args.steps).model).autoencoder(x_va).clamp(0, 1)
    reference = {k: dict(judge(judge_model, x, y_va, real), images=len(x_va))
                 for k, x in (("real held-out digits", x_va), ("their autoencoder reconstructions", recon))}
    per_seed, labels = {}, torch.arange(10).repeat_interleave(args.per_class)
    for seed in args.seeds:
        for name in RUNS:
            run, over = out / f"{name}-seed{seed}", overrides(name, seed, steps[name])
            rows = harness.run_loop(CONFIGS / RUNS[name][0], run, over, inproc=True, done="model_ema.safetensors")
            model = ema_model(run, CONFIGS / RUNS[name][0], over)[1]
            images = sample_grid(model, args.per_class, torch.device("cpu"), seed=seed, steps=25)
            ev = harness.last_with(rows, "val_loss")
            per_seed.setdefault(seed, {})[name] = {"val_loss": ev["val_loss"], "val_mse": ev["val_mse"],
                                                   "steps": steps[name], **judge(judge_model, images, labels, real)}
            print(f"   {name} seed {seed}: classifier FD {per_seed[seed][name]['classifier_fd']:.2f}", flush=True)
    data = {"per_seed": per_seed, "steps": steps, "flops_per_step": flops, "reference": reference,
            "samples": len(labels)}
    return diffusion_tables(data), data


def prompt_adherence(args) -> tuple[dict, dict]:
    """Per seed: configs/diffusion/digits-text.yaml trained (--steps, default the config's), then each digit's prompt
    sampled from --per-class noise seeds, unguided and with the config's guidance, judged by the digits classifier:
    the share labelled as the prompt asked (chance 0.1) and the classifier FD to the training digits. Beside it the
    unconditional baseline: the same run with every caption dropped (data.caption_dropout=1), as many samples of
    the empty prompt from the same sampler and noise seeds."""
    out, config = Path(args.out), CONFIGS / "digits-text.yaml"
    clf, real = digits_judge(out)
    prompts, labels = [f"a handwritten digit {d}" for d in DIGITS], torch.arange(10).repeat(args.per_class)
    over = [f"train.max_steps={args.steps}"] if args.steps else []
    guidances, per_seed = (1.0, load_run_config(str(config)).model.guidance), {}

    def samples(run, ps, g):
        return torch.cat([generate_run(run, ps, guidance=g, seed=s) for s in range(args.per_class)])
    for seed in args.seeds:
        runs = {k: out / f"{k}-seed{seed}" for k in ("digits-text", "uncond")}
        for k, run in runs.items():
            harness.run_loop(config, run, [*over, f"train.seed={seed}", "train.resume=false",
                                           *(["data.caption_dropout=1"] if k == "uncond" else [])],
                             inproc=True, done="model_ema.safetensors")
        per_seed[seed] = {g: judge(clf, samples(runs["digits-text"], prompts, g), labels, real) for g in guidances}
        per_seed[seed]["uncond"] = judge(clf, samples(runs["uncond"], [""] * len(prompts), 1.0), None, real)
        print(f"   seed {seed}: {per_seed[seed]}", flush=True)
    x_va, y_va = digits_dataset("val", 32, 3, 0.1)
    real_va = judge(clf, x_va, y_va, real)
    rows = [[f"guidance {g:g}", *(mean_cell(per_seed[s][g][k] for s in per_seed)
                                      for k in ("sample_accuracy", "classifier_fd"))]
            for g in guidances]
    rows += [["unconditional baseline (every caption dropped; the empty prompt)", "-",
              mean_cell(per_seed[s]["uncond"]["classifier_fd"] for s in per_seed)]]
    rows += [[f"guidance {g:g} - unconditional (paired by seed)", "", harness.interval_text(
        (per_seed[s][g]["classifier_fd"] - per_seed[s]["uncond"]["classifier_fd"] for s in per_seed), "+.3f", "FD")]
        for g in guidances if len(per_seed) > 1]
    rows.append([f"real held-out digits ({len(x_va)})", f"{real_va['sample_accuracy']:.3f}",
                 f"{real_va['classifier_fd']:.3f}"])
    note = f"mean ± 95% interval over {len(per_seed)} training seeds; 10 prompts x {args.per_class} noise seeds each"
    head = ["samples", f"prompt adherence (sample accuracy; {note})", "classifier FD (lower is better)"]
    return {"adherence": harness.table(head, rows)}, {"per_seed": per_seed, "steps": args.steps or "config's",
                                                      "real_held_out": real_va}


STYLE = "a sks digit three"  # dreambooth's prompt: a rare token for the style


def styled_threes(folder: Path, n: int = 6) -> Path:
    """n held-out threes of the digits moved to the right edge (a style the digits never show) as PNGs captioned
    STYLE; a run holds one out, so it trains on n - 1."""
    from PIL import Image
    x, y = digits_dataset("val", 32, 3, 0.1)
    folder.mkdir(parents=True, exist_ok=True)
    for i, im in enumerate(F.pad(x[y == 3][:n], (6, 0))[..., :32]):
        Image.fromarray((im * 255).round().byte().permute(1, 2, 0).numpy()).save(folder / f"{i}.png")
        (folder / f"{i}.txt").write_text(STYLE)
    return folder


def dreambooth(args) -> tuple[dict, dict]:
    """DreamBooth-style LoRA (Ruiz et al., "DreamBooth", 2023) on the trained digits-text run (seed 0): per LoRA seed a
    LoRA trained --steps steps on five shifted threes captioned STYLE, then STYLE sampled from --per-class noise
    seeds (the config's guidance) by the LoRA and by the base alone (and the base's "a handwritten digit three"): the
    share the digits classifier calls a three and the RMS pixel distance from each sample to the nearest of the five
    training images."""
    out, config = Path(args.out), CONFIGS / "digits-text.yaml"
    clf, base = digits_judge(out)[0], out / "digits-text-seed0"
    harness.run_loop(config, base, ["train.seed=0", "train.resume=false"], inproc=True, done="model_ema.safetensors")
    ae = out / "autoencoder-text" / "taesd-digits_encoder.safetensors"
    if not ae.is_file():  # the base's autoencoder, so that the LoRA run's latents are the base's
        zoo.save_pretrained(ema_model(base, base / "config.yaml", [])[1].autoencoder, ae)
    over = [f"data.dataset={styled_threes(out / 'sks-threes')}", f"model.autoencoder.weights={ae}",
            f"train.init_from={base / 'model_ema.safetensors'}", "adapter.method=lora", f"train.max_steps={args.steps}",
            "train.batch_size=8", "optim.lr=1e-3", "data.caption_dropout=0", "train.ema_decay=null",
            "train.eval_every=0", "train.checkpoint_every=0", "data.sample_prompts=[]"]
    data = load_captioned(load_run_config(str(config), over[:1]).data, 32, str(config), lambda m: None)[0]
    five = data.read("train", 0, len(data.labels["train"])).mean(1).flatten(1)

    def measure(run, prompt=STYLE):
        images = torch.cat([generate_run(run, [prompt] * 10, seed=s) for s in range(args.per_class)])
        dist = torch.cdist(images.mean(1).flatten(1), five).min(1).values / five.shape[1] ** 0.5
        return {"three": float((clf(images)[1].argmax(1) == 3).float().mean()), "distance": float(dist.mean())}
    per_seed, base_side, plain = {}, measure(base), measure(base, "a handwritten digit three")
    for seed in args.seeds:
        run = out / f"dreambooth-seed{seed}"
        harness.run_loop(config, run, [*over, f"train.seed={seed}", "train.resume=false"], inproc=True,
                         done="adapter/pytorch_lora_weights.safetensors")
        per_seed[seed] = measure(run)
        print(f"   LoRA seed {seed}: {per_seed[seed]} (base {base_side})", flush=True)

    diff = lambda k: harness.interval_text(  # noqa: E731
        (per_seed[s][k] - base_side[k] for s in per_seed), "+.3f", half=".3f", paren=True)
    note = f"{10 * args.per_class} samples per row"
    rows = [[f"base (digits-text, seed 0), {p!r}", f"{side['three']:.3f}", f"{side['distance']:.3f}"]
            for p, side in (("a handwritten digit three", plain), (STYLE, base_side))]
    rows += [[f"base + LoRA ({len(per_seed)} seeds, {args.steps} steps), {STYLE!r}",
              *(mean_cell(per_seed[s][k] for s in per_seed) for k in ("three", "distance"))],
             [f"LoRA - base (both {STYLE!r})", diff("three"), diff("distance")]]
    head = ["model", f"called a three by the classifier (mean ± 95% interval over LoRA seeds; {note})",
            "RMS pixel distance to the nearest of the five images (lower: more of the style)"]
    return {"dreambooth": harness.table(head, rows)}, {"per_seed": per_seed, "base": base_side, "base_plain": plain,
                                                       "steps": args.steps, "train_images": len(five)}


def mean_cell(values) -> str:
    """'mean ± half-width of its 95% interval' (the mean alone for one value)."""
    m, h = harness.mean_interval(values)
    return f"{m:.3f}" + (f" ± {h:.3f}" if h < float("inf") else "")


def diffusion_tables(data: dict) -> dict:
    """Per run the mean over seeds with its 95% interval, and the paired difference (per seed) with its verdict."""
    seeds = list(data["per_seed"].values())
    col = lambda name, k: [s[name][k] for s in seeds]  # noqa: E731

    def diff(metric, side, better):
        m, h = harness.mean_interval(s[side][metric] - s["unet-eps"][metric] for s in seeds)
        w = harness.verdict(m, h)
        return f"{m:+.3f} ± {h:.3f}: " + (w if w == "inconclusive" else
                                          f"{side} {w} ({'better' if w == better else 'worse'})")

    def row(name, last):
        st = data["steps"][name]
        return [name, st, f"{data['flops_per_step'][name]['train'] * st:.3g}", mean_cell(col(name, "classifier_fd")),
                mean_cell(col(name, "sample_accuracy")), last]
    ref = [[k, "-", "-", f"{r['classifier_fd']:.3f}", f"{r['sample_accuracy']:.3f}", f"({r['images']} images)"]
           for k, r in data["reference"].items()]
    head = ["run", "steps", "training FLOPs", "classifier FD (lower is better)", "sample accuracy"]
    note = f"mean ± 95% interval over {len(seeds)} seeds; {data['samples']} samples per run"
    flow = [row(n, mean_cell(col(n, "val_mse")) + " (not comparable)") for n in ("unet-eps", "unet-flow")]
    flow.append(["flow - eps (paired by seed)", "", "", diff("classifier_fd", "unet-flow", "lower"),
                 diff("sample_accuracy", "unet-flow", "higher"), ""])
    dit_rows = [row(n, mean_cell(col(n, "val_loss"))) for n in ("unet-eps", "dit-eps")]
    dit_rows.append(["DiT - U-Net (paired by seed)", "", "", diff("classifier_fd", "dit-eps", "lower"),
                     diff("sample_accuracy", "dit-eps", "higher"), diff("val_loss", "dit-eps", "lower")])
    return {"flow": harness.table(head + [f"val MSE of the prediction ({note})"], flow + ref),
            "dit": harness.table(head + [f"val loss, weighted eps ({note})"], dit_rows + ref)}


def main(argv=None, preset: str = "taesd"):
    speed = preset in ("taesd", "dit", "flux2", "latent-cache")
    precision = {"taesd": "fp32,bf16", "dit": "fp32,bf16", "flux2": "fp32,bf16", "min-snr": ""}.get(preset, "fp32")
    p = harness.parser(preset, __doc__, precision, rounds=speed, keep_memory=preset in ("dit", "latent-cache"),
                       one_precision=not speed, out=True,
                       seeds={"diffusion-quality": 2, "prompt-adherence": 1, "dreambooth": 2}.get(preset, 0))
    harness.counts(p, batch={"taesd": 1}.get(preset, 8), size=({"taesd": 512, "latent-cache": 64}.get(preset, 16),
                   "image (taesd, latent-cache) or latent (dit) size; flux2: latent tokens per side"))
    p.add_argument("--device", default="cpu")
    p.add_argument("--steps", type=harness.positive_int, help="timed steps per round (training steps for min-snr, "
                   "diffusion-quality, dreambooth)", default={"min-snr": None, "diffusion-quality": 300,
                                                             "prompt-adherence": None, "dreambooth": 300}.get(preset, 2))
    if preset == "taesd":
        p.add_argument("--formats", type=harness.name_list(harness.FORMATS, "memory format"),
                       default="contiguous,channels_last")
    if preset == "dit":
        p.add_argument("--preset", dest="preset_dit", default="S", choices=["tiny", "S", "B", "L", "XL"],
                       help="DiT shape")
        p.add_argument("--modes", type=harness.name_list(("eager", "compiled"), "mode"), default="eager,compiled")
        p.add_argument("--warmup", type=int, default=2, help="untimed steps per side and setting")
        p.add_argument("--profile", type=int, default=0, metavar="STEPS",
                       help="also profile STEPS steps per side and setting")
    if preset == "flux2":
        for name, default in (("double", 2), ("single", 4), ("heads", 4), ("text", 32), ("text-dim", 768)):
            p.add_argument(f"--{name}", type=harness.positive_int, default=default,
                           help="double-stream blocks, single-stream blocks, heads of 128, text tokens, text width")
    if preset == "latent-cache":
        p.add_argument("--weights", type=Path, default=TAEF2, help="the TAEF2 encoder")
    if preset == "min-snr":
        p.add_argument("overrides", nargs="*", help="key=value overrides of every run")
    if preset in ("min-snr", "diffusion-quality", "prompt-adherence", "dreambooth"):
        p.add_argument("--per-class", type=harness.positive_int,
                       default=20 if preset in ("min-snr", "diffusion-quality") else 10,
                       help="samples per digit and run (dreambooth: x 10 of its prompt)")
    args = p.parse_args(argv)
    if preset == "latent-cache" and not args.weights.is_file():
        return print(f"latent-cache: skipped: {args.weights} is absent (the TAEF2 weights; pass --weights)")
    harness.setup(args)
    harness.save(args, *globals()[preset.replace("-", "_")](args))  # each preset's function bears its name


# ---------------------------------------------------------------- the techniques report's claims
def claim_taesd(ctx) -> list[dict]:
    """TAESD with 16 latent channels (the note's case): compression from the latent's shape, encode and decode time."""
    from zoo.diffusion.taesd import TAESD
    torch.manual_seed(0)
    ae, size = TAESD(latent_channels=16).to(ctx.device).eval(), ctx.s.taesd
    x = torch.rand(1, 3, size, size, generator=torch.Generator().manual_seed(0)).to(ctx.device)
    with torch.inference_mode():
        z = ae.encode(x)
        r = harness.run_rounds({"encode": lambda: ae.encode(x), "decode": lambda: ae.decode(z)}, ctx.n_rounds, warmup=1)
    c = x.numel() / z.numel()
    return [dict(key="TAESD latents", evidence="exact", samples=[c - 1], unmeasured="the cost (reconstruction quality)",
                 memory=f"{tuple(x.shape[1:])} -> {tuple(z.shape[1:])}: {c:.1f}x fewer values",
                 speed=f"encode {r.best('encode') * 1e3:.1f} ms, decode {r.best('decode') * 1e3:.1f} ms per "
                       f"{size}x{size} image",
                 numbers={"compression": c, "encode_s": r.best("encode"), "decode_s": r.best("decode")})]


def claim_min_snr(ctx) -> list[dict]:
    """Min-SNR-5 against uniform weighting at equal steps, per seed (the min-snr bench's runs): the Frechet distance
    of each EMA model's samples to the training digits in the features of a digits ResNet-10 (digits_judge; lower is
    better), beside the unweighted validation MSE (what uniform weighting optimises) and the sample accuracy."""
    n, ps, judge = ctx.s.snr_steps, [], digits_judge(ctx.work / "judge", ctx.s.judge_steps)
    for seed in range(ctx.seeds):
        res = train_settings(ctx.work / f"min_snr_s{seed}", n, ctx.precision, [
            f"train.eval_every={max(1, n // 4)}", f"data.ae_steps={ctx.s.ae_steps}",
            f"train.log_every={max(1, n // 20)}", "train.checkpoint_every=0", f"optim.warmup_steps={max(1, n // 16)}",
            f"train.device={ctx.device}", f"train.seed={seed}"], per_class=ctx.s.snr_per_class, say=lambda m: None,
            judge=judge)
        if seed == 0:
            ctx.plot("min_snr_val", "Min-SNR-5 vs uniform: unweighted validation MSE (seed 0)",
                     {k: v["rows"] for k, v in res.items()}, "val_mse", "validation MSE (unweighted)")
        ps.append({f"{k} {m}": v[key] if key != "curve" else v[key][-1][1] for k, v in res.items()
                   for m, key in (("fd", "classifier_fd"), ("mse", "curve"), ("acc", "accuracy"))})
    m = {k: sum(p[k] for p in ps) / len(ps) for k in ps[0]}
    return [dict(key="Min-SNR-gamma weighting",
                 samples=[(p["uniform fd"] - p["gamma=5 fd"]) / p["uniform fd"] for p in ps],
                 quality=f"classifier FD {m['uniform fd']:.2f} -> {m['gamma=5 fd']:.2f} ({10 * ctx.s.snr_per_class} "
                         f"samples each) after {n} steps; val MSE {m['uniform mse']:.4f} -> {m['gamma=5 mse']:.4f}; "
                         f"sample accuracy {m['uniform acc']:.2f} -> {m['gamma=5 acc']:.2f}",
                 numbers={"per_seed": ps})]
