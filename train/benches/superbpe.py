"""SuperBPE against BPE in a trained model: val_bpb at equal compute on the same held-out text.

    python train/bench.py superbpe --vocab 4096 --steps 400 --seeds 0,1,2

Both tokenizers are trained as `python train/bench.py tokenizers` trains them (a sample of the standard library's
.py files but every tenth; SuperBPE's transition at data.superbpe_transition), and configs/llm/tiny.yaml (its
vocabulary set to --vocab) trains with each on those files for the same steps x batch x seq_len tokens: the same
FLOPs, while SuperBPE's tokens cover more bytes. val_bpb is measured on the held-out tenth, all of it, for both.
The table: each tokenizer's tokens per byte of that text and val_bpb per seed, and their difference seed by seed.
"""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from train.benches import harness
from train.benches.data import KINDS, stdlib_split, subwords, tokens_per_byte
from train.benches.harness import ROOT
from train.config import load_run_config
from train.data import HFTokenizer, TextDataConfig, sample_documents, train_bpe


def jsonl(path: Path, docs: list[str]) -> Path:
    """The documents as a .jsonl (written once: a rerun reads the same file and its prepared tokens back)."""
    if not path.is_file():
        path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path


def tokenizer(kind: str, vocab: int, docs: list[str], out: Path) -> Path:
    path = out / f"{kind}.json"
    if not path.is_file():
        train_bpe(sample_documents(docs, TextDataConfig().sp_train_chars), vocab, path, subwords(kind, vocab), print)
    return path


def val_bpb(args, kind: str, tok: Path, corpus: dict, seed: int) -> float:
    over = [f"train.max_steps={args.steps}", f"train.seed={seed}", f"model.vocab_size={args.vocab}",
            f"data.tokenizer={tok}", f"data.path={corpus['train']}", f"data.val_path={corpus['val']}",
            "data.max_chars=null", "train.eval_every=0", "train.checkpoint_every=0", "train.average_last=0",
            "train.eval_batches=1000000", *([f"train.precision={args.precision}"] if args.precision else []),
            *args.override]  # every validation window: the whole held-out text
    out = tok.parent / f"{kind}-{args.steps}steps-seed{seed}"
    return harness.final(harness.run_loop(ROOT / "configs/llm/tiny.yaml", out, over, args.threads))["val_bpb"]


def compare(bpb: dict, per_byte: dict, seeds: list[int], notes: str) -> dict:
    """Per tokenizer its tokens per byte and val_bpb per seed; then superbpe - bpe seed by seed, with its verdict."""
    rows = [[k, f"{per_byte[k]:.4f}", *(f"{b:.4f}" for b in v), harness.interval_text(v, ".4f")] for k, v in bpb.items()]
    diff = [s - b for s, b in zip(bpb["superbpe"], bpb["bpe"])]
    rows.append(["superbpe - bpe", f"{per_byte['superbpe'] - per_byte['bpe']:+.4f}", *(f"{d:+.4f}" for d in diff),
                 harness.interval_text(diff, words="superbpe")])
    return harness.table(["tokenizer", "tokens / byte", *(f"val_bpb seed {s}" for s in seeds), "mean ± 95% interval"],
                         rows, notes)


def main(argv=None):
    p = harness.parser("superbpe", __doc__, precision="", rounds=False, one_precision=True, out=True, seeds=2)
    harness.counts(p, vocab=(4096, "both tokenizers' and the model's"), steps=(400, "training steps of every run"))
    p.add_argument("--files", type=int, default=0, help="the first N of the standard library's .py files (0: all)")
    p.add_argument("--jobs", type=harness.positive_int, default=1, help="runs at a time (with --threads each)")
    p.add_argument("override", nargs="*", help="key=value overrides of configs/llm/tiny.yaml for every run")
    args = p.setup(argv)
    out = Path(args.out) / f"vocab{args.vocab}-files{args.files}"  # its text, tokenizers and runs
    out.mkdir(parents=True, exist_ok=True)
    docs, held = stdlib_split(args.files)
    corpus = {"train": jsonl(out / "train.jsonl", docs), "val": jsonl(out / "val.jsonl", held)}
    toks = {k: tokenizer(k, args.vocab, docs, out) for k in KINDS}
    per_byte = {k: tokens_per_byte(HFTokenizer(t), held) for k, t in toks.items()}
    with ThreadPoolExecutor(args.jobs) as pool:  # each run is a process of its own
        runs = {k: [pool.submit(val_bpb, args, k, t, corpus, s) for s in args.seeds] for k, t in toks.items()}
    bpb = {k: [r.result() for r in v] for k, v in runs.items()}
    cfg = load_run_config(str(ROOT / "configs/llm/tiny.yaml"), args.override)
    tokens = args.steps * cfg.train.batch_size * cfg.train.grad_accum * cfg.data.seq_len
    notes = (f"configs/llm/tiny.yaml {' '.join(args.override)} at vocab {args.vocab:,}: {args.steps} steps x "
             f"{tokens // args.steps:,} tokens ({tokens:,} tokens, the same FLOPs) on {len(docs)} standard library "
             f".py files; val_bpb on the other {len(held)} ({sum(len(d.encode()) for d in held):,} bytes), "
             f"which tokens / byte counts too")
    harness.save(args, {"val_bpb": compare(bpb, per_byte, args.seeds, notes)},
                 {"vocab": args.vocab, "steps": args.steps, "tokens": tokens, "tokens_per_byte": per_byte,
                  "val_bpb": bpb})
