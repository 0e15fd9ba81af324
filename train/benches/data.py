"""Data preparation and batch assembly: speed against the tokenizer alone, peak memory, batch rate; tokenizers.

    python train/bench.py data                          # speed (16 MB corpus), memory at 100 MB, batches
    python train/bench.py data --rss-mb 100,1000        # + the 1 GB corpus
    python train/bench.py data --only speed --mb 32 --rounds 8
    python train/bench.py tokenizers                    # bpe vs superbpe tokens per byte; BPE training speed

speed: `zoo prepare` against the tokenizer's own batch encode (target: >= 0.8x); rss: the peak PSS
of preparing a corpus in a fresh process; batches: TokenData's assembly rate against the training rate.
tokenizers: tokens per byte of held-out text at equal vocabulary; Zoo's BPE training against `tokenizers` called
directly (target: within 10%).
"""
from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from train.benches import harness
from train.benches.harness import ROOT

SIDES = ("zoo prepare", "tokenizer alone")
BATCH_BYTES = 8 << 20


def generate(path: Path, n_bytes: int, seed: int = 0) -> Path:
    """A .jsonl corpus of about n_bytes: documents of 1-40 consecutive lines of stdlib sources."""
    from train.data import stdlib_files
    lines = [ln for f in stdlib_files() for ln in f.read_text(errors="replace").splitlines(keepends=True)]
    rng = random.Random(seed)
    written = 0
    with open(path, "w") as f:
        while written < n_bytes:
            i = rng.randrange(len(lines))
            row = json.dumps({"text": "".join(lines[i:i + rng.randint(1, 40)])}) + "\n"
            f.write(row)
            written += len(row)
    return path


def tokenizers(corpus: Path, folder: Path, vocab: int = 8192) -> dict:
    """{name: tokenizer} trained on a 4 MB sample of the corpus."""
    from train.data import (HFTokenizer, SentencePieceTokenizer, documents, sample_documents, train_bpe,
                            train_sentencepiece)
    sample = sample_documents((d.text for d in documents(str(corpus))), 4_000_000)
    sp = train_sentencepiece(sample, vocab, folder / "sp.model", log=lambda m: None)
    bpe = train_bpe(sample, vocab, folder / "tokenizer.json", log=lambda m: None)
    return {"sentencepiece": SentencePieceTokenizer(sp), "tokenizer.json": HFTokenizer(bpe)}


def tokenizer_alone(corpus: Path, tok, threads: int) -> int:
    """The documents of the corpus encoded in 8 MB batches by the tokenizer's own threads; the number of ids."""
    n, batch, size = 0, [], 0

    def encode(texts):
        if hasattr(tok, "sp"):
            return sum(map(len, tok.sp.encode(texts, num_threads=threads)))
        return sum(len(e.ids) for e in tok.tok.encode_batch(texts, add_special_tokens=False))
    with open(corpus) as f:
        for line in f:
            batch.append(json.loads(line)["text"])
            size += len(batch[-1])
            if size >= BATCH_BYTES:
                n += encode(batch)
                batch, size = [], 0
    return n + (encode(batch) if batch else 0)


def speed(args, folder: Path, out: dict):
    from train.data.shards import prepare
    corpus = generate(folder / "speed.jsonl", args.mb << 20)
    mb = corpus.stat().st_size / 1e6
    toks = tokenizers(corpus, folder)
    rows = []
    for name, tok in toks.items():
        counts = {}

        def zoo():
            shutil.rmtree(folder / "shards", ignore_errors=True)
            s = prepare(str(corpus), tok, folder / "shards", boundary=(None, tok.eos_id), workers=args.workers,
                        log=lambda m: None)
            counts["zoo"] = s.manifest["tokens"]

        def alone():
            counts["alone"] = tokenizer_alone(corpus, tok, args.workers)
        r = harness.run_rounds({SIDES[0]: zoo, SIDES[1]: alone}, args.rounds)
        paired = r.paired(SIDES[0], SIDES[1])
        res = {"corpus_mb": mb, "rounds": args.rounds, **{f"paired_{k}": v for k, v in paired._asdict().items()}}
        for side, key in zip(SIDES, ("zoo", "alone")):
            best = r.best(side)
            res[side] = {"best_s": best, "mb_per_s": mb / best, "tokens_per_s": counts[key] / best,
                         "tokens": counts[key], "wall_s": r.wall[side]}
            rows.append([name, side, f"{mb / best:.2f}", f"{counts[key] / best / 1e6:.2f}",
                         str(paired) if side == SIDES[0] else ""])
        out.setdefault("speed", {})[name] = res
    return harness.table(["tokenizer", "side", "MB/s", "M tokens/s", "zoo / tokenizer (paired median)"], rows,
                         f"{mb:.0f} MB jsonl, {args.workers} workers / threads, best of {args.rounds} alternating "
                         f"rounds (zoo also writes the shards; its tokens include one EOS per document)")


def tree_pss(pid: int) -> tuple[int, int]:
    """(PSS, anonymous PSS) in bytes of a process and all its descendants (Linux /proc). The difference is
    file-backed: pages of files mapped (the token shards) or loaded (libraries), which the kernel can drop."""
    total, anon, todo = 0, 0, [pid]
    while todo:
        p = todo.pop()
        try:
            for line in open(f"/proc/{p}/smaps_rollup"):
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
                elif line.startswith("Pss_Anon:"):
                    anon += int(line.split()[1]) * 1024
            for t in os.listdir(f"/proc/{p}/task"):
                todo += [int(c) for c in open(f"/proc/{p}/task/{t}/children").read().split()]
        except (OSError, ValueError):
            continue
    return total, anon


CHILD = """
import sys, time
sys.path.insert(0, {root!r})
from train.data import SentencePieceTokenizer
from train.data.shards import prepare
tok = SentencePieceTokenizer({model!r})
t0 = time.perf_counter()
s = prepare({corpus!r}, tok, __import__("pathlib").Path({out!r}), boundary=(None, tok.eos_id), workers={workers},
            log=lambda m: None)
print(s.manifest["tokens"], time.perf_counter() - t0)
"""


def rss(args, folder: Path, out: dict):
    model = folder / "sp.model"
    if not model.is_file():
        tokenizers(generate(folder / "speed.jsonl", args.mb << 20), folder)
    rows = []
    for mb in args.rss_mb:
        corpus = generate(folder / f"rss-{mb}.jsonl", mb << 20)
        shutil.rmtree(folder / "rss-shards", ignore_errors=True)
        script = CHILD.format(root=str(ROOT), model=str(model), corpus=str(corpus), out=str(folder / "rss-shards"),
                              workers=args.workers)
        p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
        peak = peak_anon = 0
        while p.poll() is None:
            pss, anon = tree_pss(p.pid)
            peak, peak_anon = max(peak, pss), max(peak_anon, anon)
            time.sleep(0.05)
        tokens, secs = p.stdout.read().split()
        tokens, secs = int(tokens), float(secs)
        size = corpus.stat().st_size / 1e6
        out.setdefault("rss", {})[str(mb)] = {"corpus_mb": size, "peak_pss_bytes": peak,
                                              "peak_anon_pss_bytes": peak_anon, "seconds": secs, "tokens": tokens}
        rows.append([f"{size:,.0f}", harness.gib(peak), harness.gib(peak_anon), f"{secs:.0f}", f"{size / secs:.2f}",
                     f"{tokens:,}"])
        corpus.unlink()
    return harness.table(["corpus MB", "peak GiB", "of which anonymous", "seconds", "MB/s", "tokens"], rows,
                         f"sentencepiece, {args.workers} workers; PSS of the process and its workers")


def batches(args, folder: Path, out: dict):
    import torch
    from train.config import load_run_config
    from train.data import TextDataConfig, TokenData
    from train.planner import build_model
    corpus = folder / "speed.jsonl"
    if not corpus.is_file():
        generate(corpus, args.mb << 20)
    preset = load_run_config(str(ROOT / "configs" / "llm" / "smollm-135m.yaml"), ["train.compile=false"])
    B, T = preset.train.batch_size, preset.data.seq_len
    data = TokenData(TextDataConfig(path=str(corpus), tokenizer="bytes", seq_len=T, cache_dir=str(folder / "cache"),
                                    workers=args.workers), log=lambda m: None)
    g = torch.Generator().manual_seed(0)
    assemble = B * T / harness.run_rounds({"windows": lambda: data.windows("train", B, g)}, 1, calls=20,
                                          warmup=1).best("windows")
    torch.manual_seed(0)
    model = build_model(preset).train()
    x = torch.randint(0, preset.model.vocab_size, (1, T))

    def step():  # forward and backward, no optimizer
        with harness.autocast(args.precision):
            _, loss = model(x, x)
        loss.backward()
        model.zero_grad(set_to_none=True)
    trained = T / harness.run_rounds({"step": step}, 2, warmup=1).best("step")
    out["batches"] = {"batch": [B, T], "assembled_tokens_per_s": assemble, "trained_tokens_per_s": trained,
                      "precision": args.precision, "threads": torch.get_num_threads()}
    return harness.table(["assembled tokens/s", "trained tokens/s", "assembly / training"],
                         [[f"{assemble:,.0f}", f"{trained:,.0f}", f"{assemble / trained:,.0f}x"]],
                         f"SmolLM-135M preset ({B} x {T} windows; training: 1 x {T} forward and backward, "
                         f"{args.precision}, {torch.get_num_threads()} threads, best of 2)")


def direct_bpe(docs: list[str], vocab: int, path: Path):
    """The byte-level BPE of data.tokenizer=bpe, trained by calling `tokenizers` directly."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from train.data.text_tokenizers import WORDS
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(WORDS), "isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                      show_progress=False))
    tok.save(str(path))


def tokenizer_bench(args, folder: Path) -> tuple[dict, dict]:
    """bpe and superbpe trained on the standard library's sources but every tenth file, their tokens per byte on
    that tenth; and Zoo's BPE training against calling `tokenizers` directly on the same sample."""
    from train.data import HFTokenizer, TextDataConfig, sample_documents, stdlib_files, train_bpe
    files = stdlib_files()
    sample = sample_documents((f.read_text(errors="replace") for i, f in enumerate(files) if i % 10), args.train_chars)
    held = [f.read_text(errors="replace") for f in files[::10]]
    mb, held_bytes = sum(len(d.encode()) for d in sample) / 1e6, sum(len(d.encode()) for d in held)
    share, quiet, out, rows, speed = TextDataConfig().superbpe_transition, lambda m: None, {}, [], []
    for vocab in args.vocabs:
        per_byte = {}
        for kind, transition in (("bpe", None), ("superbpe", int(vocab * share))):
            t0 = time.perf_counter()
            tok = HFTokenizer(train_bpe(sample, vocab, folder / f"{kind}.json", transition, log=quiet))
            secs = time.perf_counter() - t0
            per_byte[kind] = sum(map(len, tok.encode_many(held))) / held_bytes
            out[f"{kind}-{vocab}"] = {"vocab": tok.vocab_size, "transition": transition, "tokens_per_byte":
                                      per_byte[kind], "train_s": secs}
            rows.append([f"{vocab:,}", kind + (f" (t = {transition:,})" if transition else ""), f"{per_byte[kind]:.4f}",
                         f"{1 / per_byte[kind]:.2f}", f"{per_byte[kind] / per_byte['bpe'] - 1:+.1%}", f"{secs:.1f}"])
        r = harness.run_rounds({"zoo": lambda: train_bpe(sample, vocab, folder / "zoo.json", log=quiet),
                                "tokenizers": lambda: direct_bpe(sample, vocab, folder / "direct.json")}, args.rounds)
        paired = {clock: r.paired("zoo", "tokenizers", clock) for clock in ("wall", "cpu")}
        out[f"speed-{vocab}"] = {"zoo_best_s": r.best("zoo"), "tokenizers_best_s": r.best("tokenizers"),
                                 **{f"paired_{c}_{k}": v for c, p in paired.items() for k, v in p._asdict().items()}}
        speed.append([f"{vocab:,}", f"{mb / r.best('zoo'):.2f}", f"{mb / r.best('tokenizers'):.2f}",
                      str(paired["wall"]), str(paired["cpu"])])
    where = (f"trained on {mb:.1f} MB sampled from the standard library's .py files but every tenth, measured on "
             f"that tenth ({held_bytes / 1e6:.1f} MB, {len(held)} files)")
    tables = {"tokens per byte": harness.table(["vocab", "tokenizer", "tokens / byte", "bytes / token", "vs bpe",
                                                "training s"], rows, where),
              "training speed": harness.table(
                  ["vocab", "zoo MB/s", "tokenizers MB/s", "zoo / tokenizers (paired median)", "on the CPU clock"],
                  speed, f"the same {mb:.1f} MB sample, {args.workers} threads, best of {args.rounds} alternating rounds"
                         f" (CPU clock: this process's CPU seconds, all its threads)")}
    return tables, out


def main(argv=None, preset: str = "data"):
    ap = harness.parser(preset, __doc__, precision="fp32", one_precision=True)
    ap.add_argument("--workers", type=harness.positive_int, default=2, help="processes / threads (default 2)")
    if preset == "tokenizers":
        ap.add_argument("--vocabs", type=harness.int_list, default=[2048, 8192], help="comma list of vocabulary sizes")
        ap.add_argument("--train-chars", type=harness.positive_int, default=4_000_000, help="characters to train on")
    else:
        ap.add_argument("--only", type=harness.name_list(("speed", "rss", "batches"), "part"),
                        default="speed,rss,batches")
        ap.add_argument("--mb", type=harness.positive_int, default=16, help="size of the speed corpus in MB")
        ap.add_argument("--rss-mb", type=harness.int_list, default=[100],
                        help="comma list of corpus sizes in MB for the memory part (default 100)")
    args = ap.parse_args(argv)
    harness.setup(args)
    os.environ.setdefault("RAYON_NUM_THREADS", str(args.workers))  # the tokenizers library's threads
    out, tables = {"workers": args.workers, "cpus": os.cpu_count()}, {}
    with tempfile.TemporaryDirectory(prefix="zoo-bench-data-") as folder:
        if preset == "tokenizers":
            tables, data = tokenizer_bench(args, Path(folder))
            out.update(data)
        for part, fn in (("speed", speed), ("rss", rss), ("batches", batches)):
            if part in getattr(args, "only", ()):
                tables[part] = fn(args, Path(folder), out)
    harness.save(args, tables, out)
