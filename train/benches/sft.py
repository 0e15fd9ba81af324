"""Chat fine-tuning on the embedded conversations: packed against padded rows, and what fine-tuning taught.

    python train/bench.py sft-packing   # padding and training tokens/s: packed, padded by length, padded at random
    python train/bench.py sft-quality   # exact-match answers to held-out conversations: runs/tiny against runs/tiny-sft
    python train/bench.py vlm-quality   # held-out digits named by configs/vlm/digits-vqa.yaml: with the image, without
"""
from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import torch

import zoo
from train.benches import harness
from train.benches.harness import ROOT
from train.data import ByteTokenizer, load_tokenizer_file
from train.data.chat_data import ChatData
from train.data.chat_example import KINDS, conversations
from train.data.conversations import ChatDataConfig, ChatTemplate

SIDES = {"packed": dict(pack=True), "padded-bucketed": dict(pack=False),
         "padded-random": dict(pack=False, bucket_batches=1)}


def packing(args) -> dict:
    tok = load_tokenizer_file(args.tokenizer) if Path(args.tokenizer).is_file() else ByteTokenizer()
    rows = [(m, ("synthetic", i + 1)) for i, m in enumerate(conversations("train", args.conversations))]
    torch.manual_seed(0)
    base = zoo.build(harness.llm_config(args, vocab_size=max(args.vocab, tok.vocab_size), tie_embeddings=True))
    sides, info = {}, {}
    for name, keys in SIDES.items():
        data = ChatData(rows, rows[:1], tok, ChatTemplate.builtin("chatml"),
                        dataclasses.replace(ChatDataConfig(seq_len=args.seq), **keys), log=lambda m: None)
        batches = [data.batch(i, args.batch) for i in range(len(data._epoch_batches(0, args.batch)))]
        real, cells = sum(n for _, _, n, _ in batches), sum(x.numel() for x, *_ in batches)
        info[name] = {"rows": sum(x.shape[0] for x, *_ in batches), "padding": 1 - real / cells, "tokens": real}
        side = harness.Side(copy.deepcopy(base), lambda model, x, y, _, docs: model(x, y, **docs)[1])

        def one_pass(side=side, batches=batches):
            for batch in batches:
                side.step(args.precision, *batch)
        sides[name] = one_pass
    harness.warm_up(sides)
    r, ref = harness.run_rounds(sides, args.rounds), info["padded-bucketed"]["tokens"]
    out = []  # tokens/s against tokens/s: a pass's last batch is filled from its start, so passes differ a little
    for name, i in info.items():
        paired = harness.Paired(*(v * i["tokens"] / ref for v in r.paired(name, "padded-bucketed")))
        out.append([name, i["rows"], f"{100 * i['padding']:.1f}%", f"{r.best(name):.2f}", f"{r.median(name):.2f}",
                    f"{i['tokens'] / r.best(name):.0f}", "-" if name == "padded-bucketed" else str(paired)])
    return harness.table(["side", "rows", "padding", "best s", "median s", "real tokens/s (best)",
                          "tokens/s vs padded-bucketed (paired median, range)"], out,
                         f"one pass over {args.conversations} conversations (forward, loss, backward, AdamW); "
                         f"tokenizer {getattr(tok, 'model_path', None) or 'bytes'}; {args.batch} rows, {args.seq} "
                         f"tokens when packed")


def quality(args) -> dict:
    from train.chat import ChatSession, load
    convs = conversations("val", args.conversations)
    dtype, res = str(harness.PRECISIONS[args.precision]).removeprefix("torch."), {}
    for run in [args.base, *args.runs.split(",")]:  # a folder without a template answers in ChatML
        chat, hits = ChatSession(*load(run, dtype=dtype), max_new_tokens=40), {k: [] for k in KINDS}
        for i, c in enumerate(convs):
            last = max(j for j, m in enumerate(c) if m["role"] == "assistant")
            hits[KINDS[i % len(KINDS)]].append(chat.respond(c[:last]).strip() == c[last]["content"].strip())
        res[run] = {**{k: sum(v) / len(v) for k, v in hits.items()}, "all": sum(map(sum, hits.values())) / len(convs)}
    kinds = list(res[args.base])
    rows = [[name, *(f"{100 * r[k]:.1f}%" for k in kinds)] for name, r in res.items()]
    runs = [r for n, r in res.items() if n != args.base]
    if len(runs) >= 2:
        rows.append([f"{len(runs)} runs: mean ± 95% interval", *(harness.interval_text(
            (r[k] for r in runs), ".1f", half=".1f", scale=100, unit="%") for k in kinds)])
    return harness.table(["model", *kinds], rows,
                         f"exact match of the greedy answers to {args.conversations} held-out conversations")


def vlm_quality(args) -> dict:
    """The final val_exact_match (held-out digit images named greedily) of each seed's run, with the image and with
    the image parts removed (the text-only baseline), and their difference seed by seed with its 95% interval."""
    sides = {"image + question": "false", "question only (data.drop_images=true)": "true"}
    acc = {side: [harness.final(harness.run_loop(args.config, Path(args.out) / f"images-{drop}-seed{s}",
                                                 [f"train.seed={s}", f"data.drop_images={drop}",
                                                  f"train.precision={args.precision}", "train.checkpoint_every=0",
                                                  *args.override]))["val_exact_match"]
                  for s in args.seeds] for side, drop in sides.items()}
    rows = [[side, *(f"{100 * a:.1f}%" for a in v), harness.interval_text(v, ".1f", half=".1f", scale=100, unit="%")]
            for side, v in acc.items()]
    diff = [a - b for a, b in zip(*acc.values())]
    rows.append(["difference", *(f"{100 * d:+.1f}" for d in diff),
                 harness.interval_text(diff, "+.1f", half=".1f", scale=100, paren=True)])
    return harness.table(["rows", *(f"seed {s}" for s in args.seeds), "mean ± 95% interval"], rows,
                         f"exact match of the greedy answers about the held-out digit images; {args.config} with "
                         f"{' '.join(args.override) or 'no overrides'}")


def main(argv=None, preset: str = "sft-packing"):
    if preset == "vlm-quality":
        p = harness.parser(preset, __doc__, precision="fp32", rounds=False, out=True, seeds=2, one_precision=True)
        p.add_argument("--config", default="configs/vlm/digits-vqa.yaml")
        p.add_argument("override", nargs="*", help="key=value overrides of the config")
        args = p.setup(argv)
        return harness.save(args, {"answers": vlm_quality(args)}, {})
    packs = preset == "sft-packing"
    p = harness.parser(preset, __doc__, precision="fp32", rounds=packs, keep_memory=packs, one_precision=True)
    if packs:
        harness.llm_args(p, d_model=256, n_layers=4, n_heads=4, n_kv_heads=2, vocab=2048, seq=256, batch=16)
        p.add_argument("--tokenizer", default=str(ROOT / "runs" / "tiny" / "tokenizer.model"), help="bytes when absent")
    else:
        p.add_argument("--base", default=str(ROOT / "runs" / "tiny"), help="the model before fine-tuning")
        p.add_argument("--runs", default=str(ROOT / "runs" / "tiny-sft"), help="comma list of fine-tuned run folders")
    p.add_argument("--conversations", type=harness.positive_int, default=256 if packs else 200)
    args = p.setup(argv)
    harness.save(args, {"sides" if packs else "answers": (packing if packs else quality)(args)}, {})
