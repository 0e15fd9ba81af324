"""Deployment: quantization, QAT, pruning and distillation, what each costs and what it wins back.

    python train/bench.py quantized        # int8 / int4 weight-only and 8da4w LLMs vs bf16: generation speed, val loss
    python train/bench.py qat              # QAT vs post-training quantization of the same fine-tune, per seed
    python train/bench.py prune            # magnitude pruning: one-shot, recovered by a fine-tune, CSR matmul speed
    python train/bench.py distill          # peak memory of the chunked distillation loss vs the full logits
    python train/bench.py distill-quality  # a student trained with a teacher vs alone, per seed (--family)
    python train/bench.py convnet-ptq      # a ConvNet's int8 PT2E quantization vs fp32: accuracy and images/s

The LLM base is configs/llm/tiny.yaml trained once, or --trained; runs are read back from --out.
"""
from __future__ import annotations

import copy
import hashlib
import time
from pathlib import Path

import torch

import zoo
from train.benches import harness
from train.benches.harness import ROOT
from train.benches.llm_speed import packaged_file
from train.config import QAT_SCHEMES, load_run_config
from zoo.blocks.chunked_ce import chunked_distillation_loss, distillation_loss
from zoo.pruning import parse_pattern, prune as prune_model
from zoo.quantization import Int4FakeQuantizer, compile_frozen, quantize, targets
from zoo.weights.gguf_llm import config_from_gguf, load_tokenizer, read
from zoo.weights.zoo_folder import cast_weights

TINY = ROOT / "configs" / "llm" / "tiny.yaml"
SCHEMES, PATTERNS, SPARSITY = ("int8wo", "int4wo", "8da4w"), ("unstructured", "2:4"), 0.5  # quantized's, prune's
FAMILIES = {  # distill-quality: config, the teacher's overrides (None: a GGUF file), the student's, the metrics
    "convnet": ("configs/convnet/resnet-digits.yaml", "", "model.width=8", ("val_acc1", "val_loss")),
    "vit": ("configs/vit/vit-tiny-digits.yaml", "", "model.distilled=true", ("val_acc1", "val_loss")),  # DeiT
    "llm": ("configs/llm/tiny.yaml", "model.d_model=128 model.n_layers=2 model.n_heads=2 model.n_kv_heads=1 "
            "train.batch_size=8 train.average_last=0", "model.d_model=64 model.n_layers=1 model.n_heads=2 "
            "model.n_kv_heads=1 train.batch_size=8 train.average_last=0", ("val_loss",)),
    "llm-gguf": ("configs/llm/tiny.yaml", None, "model.d_model=128 model.n_layers=2 model.n_heads=2 model.n_kv_heads=1 "
                 "train.batch_size=4 train.average_last=0", ("val_loss",)),
}
TEACHER_CONFIG = {"vit": "configs/convnet/resnet-digits.yaml"}  # distill-quality: a teacher of another family
NO_EVAL = ["train.checkpoint_every=0", "train.eval_every=0"]


# ---------------------------------------------------------------- the LLM base and its fine-tunes
def base_model(args) -> Path:
    """--trained (a GGUF file converted once into --out as a Hugging Face folder with its tokenizer), or
    the embedded default (changed by --train-overrides) trained once into runs/bench-quantized/tiny[-hash]."""
    if args.trained and Path(args.trained).suffix == ".gguf":
        folder = Path(args.out) / Path(args.trained).stem
        if not (folder / "tokenizer.json").is_file():
            model = zoo.from_pretrained(args.trained)
            zoo.save_pretrained(model, folder, tokenizer=load_tokenizer(model))
        return folder
    if args.trained:
        return Path(args.trained)
    over = args.train_overrides.split()
    out = Path("runs/bench-quantized") / ("tiny-" + hashlib.sha1(" ".join(over).encode()).hexdigest()[:8] if over
                                          else "tiny")
    harness.run_loop(TINY, out, over)
    return out


def fine_tune(args, base: Path, name: str, seed: int, extra=()) -> dict:
    """The final row of a fine-tune of `base` (configs/llm/tiny.yaml's run settings) with `extra`."""
    return harness.final(harness.run_loop(TINY, Path(args.out) / f"{name}-seed{seed}", [
        f"train.init_from={base}", f"train.max_steps={args.steps}", f"train.seed={seed}",
        f"train.eval_batches={args.eval_batches}", *NO_EVAL, "train.average_last=0", f"optim.lr={args.lr}",
        "optim.warmup_fraction=0.1", f"train.precision={args.precision}", *args.fine_tune_overrides.split(), *extra],
        args.threads))


# ---------------------------------------------------------------- quantized
def quantized_copies(model, args, name: str) -> dict:
    return {name: model, **{s: zoo.quantize(copy.deepcopy(model), s, args.group_size) for s in SCHEMES}}


def quantized_speed(args) -> dict:
    """Generation of the SmolLM-135M shape (random weights) and its quantized copies, alternating rounds."""
    from torchao.utils import get_model_size_in_bytes
    base = args.precision
    torch.manual_seed(0)
    models = quantized_copies(cast_weights(zoo.build(ROOT / "configs" / "llm" / "smollm-135m.yaml"),
                                           harness.PRECISIONS[base]).eval(), args, base)
    prompt = torch.randint(0, models[base].config.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(1))
    calls, outs = {s: (lambda m=m: m.generate(prompt, args.new_tokens)) for s, m in models.items()}, {}
    sides = harness.inference_sides(calls, "fp32", outs)  # fp32: no autocast, each model in its own dtype
    first, r = harness.warm_up(sides), harness.run_rounds(sides, args.rounds)
    rows = [[s, f"{get_model_size_in_bytes(models[s], ignore_embeddings=False) / 2**20:.0f}",
             f"{args.new_tokens / r.best(s):.3g}", f"{args.new_tokens / r.best(s, 'cpu'):.3g}", str(r.paired(s, base)),
             f"{first[s]:.1f}", "yes" if torch.equal(outs[s], outs[base]) else "no"] for s in calls]
    return harness.table(["model", "weights MiB", "tokens/s (best round)", "tokens per CPU-second (best round)",
                          f"against {base}: paired median (range)", "first call s", f"same tokens as {base}"], rows)


def quantized_quality(args) -> dict:
    """The trained model's validation windows scored by fp32, the base precision and each quantized copy;
    the change against the base precision: the mean per-batch difference (the batches pair)."""
    folder, base = base_model(args), args.precision
    task = harness.run_task(folder)
    batches = list(task.data.val_batches(task.cfg.train.batch_size, args.eval_batches))
    models = {"fp32": zoo.from_pretrained(folder, dtype=torch.float32),
              **quantized_copies(zoo.from_pretrained(folder, dtype=harness.PRECISIONS[base]), args, base)}
    with torch.inference_mode():
        losses = {s: [m(x, y)[1].item() for x, y in batches] for s, m in models.items()}
    rows = [[s, f"{sum(v) / len(v):.4f}", "" if s == base else harness.interval_text(
        [a - b for a, b in zip(v, losses[base])], words="change")] for s, v in losses.items()]
    return harness.table(["model", "val loss", f"change against {base} (95% interval), verdict"], rows,
                         f"{folder}: {len(batches)} validation batches, {sum(y.numel() for _, y in batches)} tokens")


def qat(args, base) -> tuple[dict, dict]:
    """Per seed two int4 fine-tunes: ptq (train.quantize: the float model, its bf16 copy, that copy quantized)
    and qat (train.qat: fake-quantized, then converted). Both increases over the ptq run's bf16 copy."""
    seeds, group = [], f"train.quant_group_size={args.group_size}"
    for seed in args.seeds:
        p = fine_tune(args, base, "ptq-int4", seed, [group, f"train.quantize={QAT_SCHEMES['int4']}"])
        q, ref = fine_tune(args, base, "qat-int4", seed, [group, "train.qat=int4"]), p["quant_ref_val_loss"]
        seeds.append({"seed": seed, "float": p["val_loss"], "ref": ref, "ptq": p["quant_val_loss"],
                      "qat": q["quant_val_loss"], "qat_fake": q["val_loss"], "qat_ref": q["quant_ref_val_loss"],
                      "ptq_increase": p["quant_val_loss"] - ref, "qat_increase": q["quant_val_loss"] - ref,
                      "recovered": 1 - (q["quant_val_loss"] - ref) / (p["quant_val_loss"] - ref)})
    rows = [[s["seed"], f"{s['float']:.4f}", f"{s['ref']:.4f}", f"{s['ptq']:.4f} ({s['ptq_increase']:+.4f})",
             f"{s['qat_fake']:.4f} ({s['qat_fake'] - s['ref']:+.4f})", f"{s['qat']:.4f} ({s['qat_increase']:+.4f})",
             f"{s['recovered']:.2f}", f"{s['qat_ref']:.4f}"] for s in seeds]
    iv = {k: harness.interval_text([s[k] for s in seeds]) for k in ("ptq_increase", "qat_increase", "recovered")}
    rows.append(["mean (95% interval)", "", "", iv["ptq_increase"], "", iv["qat_increase"], iv["recovered"], ""])
    return {"seeds": harness.table(["seed", "float fine-tune val loss", "its bf16 copy (reference)",
                                    "int4 PTQ (increase)", "QAT, fake-quantized (vs reference)",
                                    "int4 QAT, converted (increase)", "increase recovered by QAT",
                                    "QAT's own bf16 copy"], rows),
            "numerics": numerics(base, args.group_size)}, {"seeds": seeds}


def numerics(folder: Path, group_size: int) -> dict:
    """On the base's int4 targets: the share of the weights each fake quantizer puts on another level than
    the converted bf16 model (off by more than half a step), and the largest distance in steps."""
    from torch import nn
    from torchao.quantization.qat import IntxFakeQuantizeConfig
    from torchao.quantization.qat.fake_quantizer import IntxFakeQuantizer
    from torchao.quantization.quant_primitives import ZeroPointDomain


    generic = lambda **kw: IntxFakeQuantizer(IntxFakeQuantizeConfig(  # noqa: E731
        torch.int4, group_size=group_size, is_symmetric=False, zero_point_domain=ZeroPointDomain.FLOAT, **kw))
    makers = {"torchao int4, int32 zero point": generic,
              "torchao int4, float32 zero point": lambda: generic(zero_point_precision=torch.float32),
              "Int4FakeQuantizer (bf16, tinygemm)": lambda: Int4FakeQuantizer(group_size)}
    model = zoo.from_pretrained(folder, dtype=torch.float32)
    mods, off, worst, n = dict(model.named_modules()), dict.fromkeys(makers, 0), dict.fromkeys(makers, 0.0), 0
    with torch.no_grad():
        for name in targets(model):
            w = mods[name].weight.detach()
            lin = nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=torch.bfloat16)
            lin.weight.data.copy_(w)
            q = quantize(nn.Sequential(lin), "int4wo", group_size, keep=())[0]
            deq = q(torch.eye(w.shape[1], dtype=torch.bfloat16)).float().T  # the kernel's weight
            g = deq.reshape(w.shape[0], -1, group_size)
            step = ((g.amax(-1) - g.amin(-1)) / 15).clamp_min(1e-12).repeat_interleave(group_size, 1)
            for k, make in makers.items():
                d = (make()(w) - deq).abs() / step
                off[k] += int((d > 0.5).sum())
                worst[k] = max(worst[k], float(d.max()))
            n += w.numel()
    return harness.table(["fake quantizer", "weights on another level than the converted model",
                          "largest distance (steps)"], [[k, f"{off[k] / n:.2%}", f"{worst[k]:.2f}"] for k in makers],
                         f"over {n} weights")


def prune(args, base) -> tuple[dict, dict]:
    """Per pattern: the base pruned one-shot, a fine-tune with the masks held (recovered) against the same
    fine-tune dense, per seed; and torch's CSR matmul against the dense one on the pruned weights."""
    dense = [fine_tune(args, base, "dense", s)["val_loss"] for s in args.seeds]
    base_loss, speed, data = one_shot(args, base, []), [], {"dense": dense}
    rows = [["base (no pruning, no fine-tune)", "0", f"{base_loss:.4f}", "", "", ""]]
    for pattern in PATTERNS:
        tag = pattern.replace(":", "of") if parse_pattern(pattern) else f"unstructured{SPARSITY:g}"
        over = [f"train.prune={pattern}", f"train.prune_sparsity={SPARSITY}"]
        runs = [fine_tune(args, base, tag, s, over) for s in args.seeds]
        rec, shot = [r["val_loss"] for r in runs], one_shot(args, base, over)
        rows.append([pattern, f"{runs[0]['sparsity']:.2f}", f"{shot:.4f} ({shot - base_loss:+.4f})",
                     harness.interval_text(rec, ".4f"), harness.interval_text(dense, ".4f"),
                     harness.interval_text([a - b for a, b in zip(rec, dense)])])
        ratio = csr_speed(args, base, pattern)
        speed.append([pattern, *(f"{v:.2f}x" for v in ratio.values())])
        data[pattern] = {"recovered": rec, "one_shot": shot, "csr_speed": ratio}
    return {"loss": harness.table(["pattern", "sparsity of the pruned linears", "one-shot val loss (vs base)",
                                   f"pruned + {args.steps}-step fine-tune", "dense fine-tune, same steps",
                                   "pruned - dense (mean of seeds)"], rows),
            "speed": harness.table(["pattern", "CSR's speed / dense's, 1 token", "CSR's speed / dense's, 128 tokens"],
                                   speed)}, data


def one_shot(args, base: Path, over: list) -> float:
    """The validation loss of the base, pruned with `over` ([]: as it is), before any step."""
    return val_loss(TINY, [f"train.init_from={base}", f"train.out_dir={Path(args.out) / 'one-shot'}",
                           f"train.eval_batches={args.eval_batches}", f"train.precision={args.precision}",
                           *args.fine_tune_overrides.split(), *over])


def val_loss(config, overrides: list, teacher: bool = False) -> float:
    """The validation loss of a run's model (autocast in its precision), or of its teacher, before any step."""
    import contextlib

    from train.builder import build_run
    run = build_run(load_run_config(str(config), [*harness.QUIET, *overrides]))
    with torch.no_grad(), contextlib.nullcontext() if teacher else run.autocast():
        return run.task.evaluate(run.task.teacher if teacher else run.model)["val_loss"]


def csr_speed(args, base: Path, pattern: str) -> dict:
    """{tokens: paired median of the dense matmul's time over CSR's} on every linear the pattern prunes (fp32)."""
    from torch.nn.functional import linear
    weights = [w.detach() for w, _ in prune_model(zoo.from_pretrained(base).float().eval(), pattern, SPARSITY).values()]
    csr, out = [w.to_sparse_csr() for w in weights], {}
    with torch.no_grad():
        for n in (1, 128):
            xs = [torch.randn(n, w.shape[1]) for w in weights]
            sides = {"dense": lambda: [linear(x, w) for x, w in zip(xs, weights)],
                     "csr": lambda: [torch.sparse.mm(c, x.T) for x, c in zip(xs, csr)]}
            out[n] = harness.run_rounds(sides, args.rounds, calls=10, warmup=1).paired("csr", "dense").median
    return out


def distill_memory(args) -> tuple[dict, dict]:
    """One loss + backward of a student head against a teacher's hidden states: chunked_distillation_loss
    against distillation_loss on the full logits; the peak RSS each adds (best of alternating rounds)."""
    g, N, V = torch.Generator().manual_seed(0), args.tokens, args.vocab
    h = torch.randn(N, args.d_model, generator=g).requires_grad_()
    w = (torch.randn(V, args.d_model, generator=g) * 0.02).requires_grad_()
    th, tw = torch.randn(N, 512, generator=g), torch.randn(V, 512, generator=g) * 0.02  # a teacher of d_model 512
    y, peaks, losses = torch.randint(0, V, (N,), generator=g), {"chunked": [], "full logits": []}, {}
    with harness.autocast(args.precision):
        for _, side in harness.schedule(peaks, args.rounds):
            with harness.PeakRSS() as m:
                loss = (chunked_distillation_loss(h, w, y, th, tw, 0.5, 2.0, 256) if side == "chunked"
                        else distillation_loss(h @ w.t(), th @ tw.t(), y, 0.5, 2.0))
                loss.backward()
                h.grad = w.grad = None
            peaks[side].append(m.peak or 0)
            losses[side] = loss.item()
    full = N * V * 4 / 2**20
    rows = [[s, f"{min(v) / 2**20:.0f}", f"{min(v) / 2**20 / full:.1f}x of {full:.0f} MiB", f"{losses[s]:.6f}"]
            for s, v in peaks.items()]
    return {"memory": harness.table(["loss", "peak memory MiB (best round)", "against the full logits' size",
                                     "loss value"], rows)}, {"peaks": peaks}


def distill_quality(args) -> tuple[dict, dict]:
    """Per seed two runs from scratch, the student alone and with the teacher (train.teacher, kd_kind, kd_alpha,
    kd_temperature), both judged by their own cross-entropy on the same validation set."""
    config, teacher_over, student_over, metrics = FAMILIES[args.family]
    out, llm = Path(args.out), args.family.startswith("llm")
    extra = [f"train.eval_batches={args.eval_batches}"] if llm else []
    common = [f"train.precision={args.precision}", *NO_EVAL]
    teacher = Path(args.teacher) if args.teacher else out / "teacher"
    if teacher_over is None:  # a GGUF teacher: the student on its vocabulary, the data tokenized by its tokenizer
        teacher, tok = Path(args.teacher) if args.teacher else packaged_file(), out / "tokenizer.json"
        if not tok.is_file():
            out.mkdir(parents=True, exist_ok=True)
            load_tokenizer(teacher).backend.save(str(tok))
        reader, meta = read(teacher)
        vocab = config_from_gguf(meta, {t.name: t for t in reader.tensors}, str(teacher))[0].vocab_size
        extra += [f"data.tokenizer={tok.resolve()}", f"model.vocab_size={vocab}"]
    elif not args.teacher:
        harness.run_loop(ROOT / TEACHER_CONFIG.get(args.family, config), teacher, [*common, *teacher_over.split(),
                                                  "train.max_steps=200", *extra], args.threads or 1)
    student = (args.student if args.student is not None else student_over).split()
    seeds, kd = [], [f"train.teacher={teacher}", f"train.kd_alpha={args.kd_alpha}",
                     f"train.kd_temperature={args.kd_temperature}", f"train.kd_kind={args.kd_kind}"]
    for seed in args.seeds:
        over = [*common, *student, f"train.max_steps={args.steps}", f"train.seed={seed}", *extra]
        got = {side: harness.final(harness.run_loop(ROOT / config, out / f"{side}-seed{seed}", over + o,
                                                    args.threads or 1)) for side, o in (("alone", []), ("teacher", kd))}
        seeds.append({"seed": seed, **{side: {k: r[k] for k in metrics} for side, r in got.items()}})
    rows = [[s["seed"], *(f"{s[side][k]:.4f}" for side in ("alone", "teacher") for k in metrics),
             *(f"{s['teacher'][k] - s['alone'][k]:+.4f}" for k in metrics)] for s in seeds]
    rows.append(["mean (95% interval)", *([""] * 2 * len(metrics)),
                 *(harness.interval_text([s["teacher"][k] - s["alone"][k] for s in seeds], words="teacher")
                   for k in metrics)])
    if teacher_over is None:  # the teacher's own loss on the same windows, for scale
        loss = val_loss(ROOT / config, [f"train.out_dir={out / 'teacher-eval'}", f"train.precision={args.precision}",
                                        *student, f"train.teacher={teacher}", *extra], teacher=True)
        rows.append(["the teacher itself", f"{loss:.4f}", *([""] * (3 * len(metrics) - 1))])
    columns = ["seed", *(f"{side} {k}" for side in ("alone", "with teacher") for k in metrics),
               *(f"teacher - alone {k}" for k in metrics)]
    return {"seeds": harness.table(columns, rows)}, {"seeds": seeds, "teacher": str(teacher)}


def convnet_ptq(args) -> tuple[dict, dict]:
    """Per seed: the digits preset trained, then zoo.quantize(model, "int8") (PT2E, x86 inductor quantizer,
    calibrated on training batches): top-1 and loss on the whole validation set. Speed on the first seed's
    model: fp32 eager, fp32 and int8 compiled with freezing (compile_frozen), alternating rounds."""
    seeds, tables = [], {}
    for seed in args.seeds:
        folder = Path(args.out) / f"seed{seed}"
        harness.run_loop(ROOT / "configs" / "convnet" / "resnet-digits.yaml", folder, [
            f"train.max_steps={args.steps}", f"train.seed={seed}", "train.eval_every=0", "train.precision=fp32"],
            args.threads or 1)
        task, model, t0 = harness.run_task(folder), zoo.from_pretrained(folder).float().eval(), time.perf_counter()
        int8 = zoo.quantize(model, "int8", calibration=[task.normalize(task.train_batch(s, 0)[0]) for s in range(8)])
        val = [(task.normalize(x), y) for x, y in task._val_batches()]
        s = {"seed": seed, "quantize_s": time.perf_counter() - t0, "fp32": scores(model, val), "int8": scores(int8, val)}
        seeds.append(s)
        if seed == args.seeds[0]:
            x = torch.cat([x for x, _ in val])[:args.batch]
            x = torch.cat([x] * -(-args.batch // len(x)))[:args.batch]   # --batch images (repeated when val is smaller)
            sides = {"fp32 eager": model, "fp32 compiled": compile_frozen(model), "int8 compiled": compile_frozen(int8)}
            calls = {k: (lambda f=f: f(x)) for k, f in sides.items()}
            with torch.no_grad():
                first = harness.warm_up(calls)
                same = (sides["int8 compiled"](x).argmax(1) == int8(x).argmax(1)).float().mean().item()
                r = harness.run_rounds(calls, args.rounds)
            tables[f"speed seed {seed}"] = harness.table(
                [f"seed {seed}, batch {args.batch}", "images/s (best round)",
                 "against fp32 eager: paired median (range)", "against fp32 compiled: paired median (range)",
                 "first call s (compile)"],
                [[k, f"{args.batch / r.best(k):.0f}", str(r.paired(k, "fp32 eager")), str(r.paired(k, "fp32 compiled")),
                  f"{first[k]:.0f}"] for k in sides],
                f"int8 compiled argmax equal to the reference graph's: {same:.2%}")
            s["speed"] = {"wall": r.wall, "argmax_equal": same}
    rows = [[s["seed"], f"{s['fp32']['acc1']:.4f}", f"{s['int8']['acc1']:.4f}",
             f"{s['fp32']['acc1'] - s['int8']['acc1']:+.4f}", f"{s['fp32']['loss']:.4f}", f"{s['int8']['loss']:.4f}",
             f"{s['quantize_s']:.0f}"] for s in seeds]
    rows.append(["mean (95% interval)", "", "",
                 harness.interval_text([s["fp32"]["acc1"] - s["int8"]["acc1"] for s in seeds], words="drop"), "",
                 harness.interval_text([s["int8"]["loss"] - s["fp32"]["loss"] for s in seeds], words="int8 loss"), ""])
    acc = harness.table(["seed", "fp32 top-1", "int8 top-1", "drop (fp32 - int8)", "fp32 val loss", "int8 val loss",
                         "quantize s"], rows)
    return {"accuracy": acc, **tables}, {"seeds": seeds}


@torch.no_grad()
def scores(fn, batches) -> dict:
    logits, y = torch.cat([fn(x).float() for x, _ in batches]), torch.cat([y for _, y in batches])
    return {"acc1": (logits.argmax(1) == y).float().mean().item(),
            "loss": torch.nn.functional.cross_entropy(logits, y).item()}


def main(argv=None, preset: str = "quantized"):
    p = harness.parser(preset, __doc__, precision="bf16" if preset == "quantized" else "fp32",
                       rounds=preset in ("quantized", "prune", "distill", "convnet-ptq"), one_precision=True,
                       result=None if preset == "distill-quality" else "", out=True,
                       seeds=2 if preset in ("distill-quality", "convnet-ptq") else 1)
    if preset in ("quantized", "qat", "prune"):
        p.add_argument("--trained", default=None, help="the LLM: a run or Hugging Face folder, a GGUF file "
                                                       "(default: the embedded default, trained once)")
        p.add_argument("--train-overrides", default="", help="key=value overrides of the embedded default's run")
        harness.counts(p, group_size=32, eval_batches=40 if preset == "quantized" else 20)
    if preset in ("qat", "prune"):
        p.add_argument("--steps", type=harness.positive_int, default=100)
        p.add_argument("--lr", type=float, default=5e-4)
        p.add_argument("--fine-tune-overrides", default="", help="key=value overrides of the fine-tunes")
    if preset == "quantized":
        p.add_argument("--parts", type=harness.name_list(("speed", "quality"), "part"), default="speed,quality")
        harness.counts(p, prompt=16, new_tokens=128)
    if preset == "distill":
        harness.llm_args(p, vocab=32000, d_model=256)
        p.add_argument("--tokens", type=harness.positive_int, default=1024)
        p.set_defaults(rounds=3)
    if preset == "distill-quality":
        p.add_argument("--family", choices=sorted(FAMILIES), default="convnet")
        p.add_argument("--steps", type=harness.positive_int, default=100, help="the student's steps, both sides")
        p.add_argument("--teacher", default=None, help="the teacher's run folder or GGUF file (default: trained once)")
        p.add_argument("--student", default=None, help="the student's overrides (default: the family's)")
        p.add_argument("--kd-alpha", type=float, default=0.5)
        p.add_argument("--kd-temperature", type=float, default=2.0)
        p.add_argument("--kd-kind", choices=("soft", "hard"), default="soft")
        p.add_argument("--eval-batches", type=harness.positive_int, default=20, help="LLM: train.eval_batches")
        p.add_argument("--json", type=Path, default=None, help="default docs/results/distill-quality-FAMILY.json")
    if preset == "convnet-ptq":
        harness.counts(p, steps=200, batch=(64, "images per timed call"))
    args = p.parse_args(argv)
    if preset == "convnet-ptq" and args.precision != "fp32":
        p.error("--precision: fp32 only (the float model int8 is measured against, and its training)")
    harness.setup(args)
    if preset == "distill-quality":
        args.json = args.json or harness.RESULTS / f"distill-quality-{args.family}.json"
    run = {"qat": lambda: qat(args, base_model(args)), "prune": lambda: prune(args, base_model(args)),
           "distill": lambda: distill_memory(args), "convnet-ptq": lambda: convnet_ptq(args),
           "distill-quality": lambda: distill_quality(args), "quantized": lambda: quantized(args)}[preset]
    harness.save(args, *run())


def quantized(args) -> tuple[dict, dict]:
    """The parts run now (speed, quality); a part not run keeps its earlier table (and command)."""
    old = harness.load_result(args.json)
    tables = {k: {"command": old["command"], **old["tables"][k]} for k in ("speed", "quality")
              if k not in args.parts and k in old.get("tables", {})}
    for k in args.parts:
        tables[k] = {**(quantized_speed(args) if k == "speed" else quantized_quality(args)), "command": args.command}
    return tables, {}
