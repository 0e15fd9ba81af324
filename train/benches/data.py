"""Data preparation and batch assembly: speed against the tokenizer alone, peak memory, resume; tokenizers.

    python train/bench.py data                          # all parts at the default sizes
    python train/bench.py data --only rss --rss-mb 300,1000
    python train/bench.py data --only speed --mb 32 --rounds 8 --forms text
    python train/bench.py tokenizers                    # bpe vs superbpe tokens per byte; BPE training speed

The bench writes the same documents as one text file, a .jsonl and a folder of Parquet shards (`--forms`).
speed: `zoo prepare` with N workers against the tokenizer's own N-thread batch encode of the same documents
(target: >= 0.9x), for sentencepiece and tokenizer.json, and whether the shards equal a one-worker preparation's;
rss: the peak PSS of preparing each form in a fresh process at each size; resume: a preparation SIGKILLed when half
its chunks are in the shards, run again, against an uninterrupted one, byte for byte; batches: TokenData's assembly
rate against the training rate.
tokenizers: tokens per byte of held-out text at equal vocabulary; Zoo's BPE training against `tokenizers` called
directly (target: within 10%).
"""
from __future__ import annotations

import json
import os
import random
from types import SimpleNamespace
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from train.benches import harness
from train.benches.harness import ROOT
from train.config import load_run_config
from train.data import (DataError, HFTokenizer, SentencePieceTokenizer, TextDataConfig, TokenData, documents,
                        sample_documents, stdlib_files, train_bpe, train_sentencepiece)
from train.data.shards import Shards, prepare, read_manifest
from train.data.text_tokenizers import bpe_trainer, byte_level

SIDES = ("zoo prepare", "tokenizer alone")
FORMS = ("text", "jsonl", "parquet")
PARTS = ("speed", "rss", "resume", "batches")
BATCH_BYTES = 8 << 20


def generate(folder: Path, n_bytes: int, forms=FORMS, seed: int = 0) -> tuple[dict, int]:
    """({form: path}, UTF-8 bytes of text) of the same documents (1-40 consecutive lines of stdlib sources, about
    n_bytes in all): one text file (documents joined by blank lines), a .jsonl, a folder of four Parquet shards."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    lines = [ln for f in stdlib_files() for ln in f.read_text(errors="replace").splitlines(keepends=True)]
    rng, folder = random.Random(seed), Path(folder)
    paths = {k: v for k, v in {"text": folder / "corpus.txt", "jsonl": folder / "corpus.jsonl",
                               "parquet": folder / "parquet"}.items() if k in forms}
    shutil.rmtree(folder / "parquet", ignore_errors=True)
    (folder / "parquet").mkdir(parents=True)
    files = {k: open(paths[k], "w") for k in ("text", "jsonl") if k in paths}
    written, shard, rows, writer = 0, 0, [], None
    while written < n_bytes:
        i = rng.randrange(len(lines))
        rows.append("".join(lines[i:i + rng.randint(1, 40)]))
        if "text" in files:
            files["text"].write(("\n\n" if written else "") + rows[-1])
        if "jsonl" in files:
            files["jsonl"].write(json.dumps({"text": rows[-1]}) + "\n")
        written += len(rows[-1].encode()) + 2
        if len(rows) == 1024 or written >= n_bytes:  # a row group
            if "parquet" in paths:
                if writer is None or (shard < 3 and written > (shard + 1) * n_bytes / 4):
                    shard += writer is not None
                    if writer:
                        writer.close()
                    writer = pq.ParquetWriter(paths["parquet"] / f"part-{shard:05d}.parquet",
                                              pa.schema([("text", pa.string())]))
                writer.write_table(pa.table({"text": rows}))
            rows = []
    for f in [*files.values(), *([writer] if writer else [])]:
        f.close()
    return paths, written


def tokenizers(corpus: Path, folder: Path, vocab: int = 8192) -> dict:
    """{name: tokenizer} trained on a 4 MB sample of the corpus."""
    sample = sample_documents((d.text for d in documents(str(corpus))), 4_000_000)
    sp = train_sentencepiece(sample, vocab, folder / "sp.model", log=lambda m: None)
    bpe = train_bpe(sample, vocab, folder / "tokenizer.json", log=lambda m: None)
    return {"sentencepiece": SentencePieceTokenizer(sp), "tokenizer.json": HFTokenizer(bpe)}


def tokenizer_alone(corpus: Path, tok, threads: int) -> int:
    """The corpus's documents (text files in pieces, as Zoo reads them) encoded in 8 MB batches by the tokenizer's own
    threads; the number of ids."""
    n, batch, size = 0, [], 0
    encode = (lambda texts: sum(map(len, tok.sp.encode(texts, num_threads=threads)))) if hasattr(tok, "sp") else (
        lambda texts: sum(len(e.ids) for e in tok.tok.encode_batch(texts, add_special_tokens=False)))
    for d in documents(str(corpus)):
        batch.append(d.text)
        size += len(d.text)
        if size >= BATCH_BYTES:
            n += encode(batch)
            batch, size = [], 0
    return n + (encode(batch) if batch else 0)


def shard_bytes(folder: Path) -> dict:
    """{name: bytes} of the prepared files (the manifest aside)."""
    return {f.name: f.read_bytes() for f in sorted(Path(folder).iterdir()) if f.name != "manifest.json"}


def prepare_into(args, corpus: Path, tok, out: Path, workers: int, shard_tokens: int = 0, fresh: bool = True):
    if fresh:
        shutil.rmtree(out, ignore_errors=True)
    return prepare(str(corpus), tok, out, boundary=(None, tok.eos_id), workers=workers,
                   shard_tokens=shard_tokens or args.shard_tokens, log=lambda m: None)


def speed(args, folder: Path, out: dict):
    corpora, size = generate(folder, args.mb << 20, args.forms)
    mb, toks, rows = size / 1e6, tokenizers(next(iter(corpora.values())), folder), []
    for form, corpus in corpora.items():
        for name, tok in toks.items():
            counts = {}
            r = harness.run_rounds({
                SIDES[0]: lambda: counts.update(zoo=prepare_into(args, corpus, tok, folder / "shards",
                                                                 args.workers).manifest["tokens"]),
                SIDES[1]: lambda: counts.update(alone=tokenizer_alone(corpus, tok, args.workers))}, args.rounds)
            prepare_into(args, corpus, tok, folder / "one", 1)
            same, paired = shard_bytes(folder / "shards") == shard_bytes(folder / "one"), r.paired(SIDES[0], SIDES[1])
            res = {"rounds": args.rounds, "identical_to_one_worker": same, "measured": harness.measured(),
                   **{f"paired_{k}": v for k, v in paired._asdict().items()}}
            for side, key in zip(SIDES, ("zoo", "alone")):
                best = r.best(side)
                res[side] = {"best_s": best, "mb_per_s": mb / best, "tokens_per_s": counts[key] / best,
                             "tokens": counts[key], "wall_s": r.wall[side]}
            out.setdefault("speed", {}).setdefault(form, {})[name] = res
            rows.append([form, name, f"{res[SIDES[0]]['mb_per_s']:.2f}", f"{res[SIDES[1]]['mb_per_s']:.2f}",
                         f"{counts['zoo'] / r.best(SIDES[0]) / 1e6:.2f}", str(paired), "yes" if same else "NO"])
    return harness.table(["input", "tokenizer", "zoo MB/s", "tokenizer MB/s", "zoo M tokens/s",
                          "zoo / tokenizer (paired median)", "= 1 worker"], rows,
                         f"{mb:.0f} MB of text, {args.workers} workers / threads, best of {args.rounds} alternating "
                         f"rounds (zoo also reads, writes the shards and adds one EOS per document; the tokenizer "
                         f"reads the same documents); = 1 worker: the shards equal a one-worker preparation's, byte "
                         f"for byte")


def tree_pss(pid: int) -> tuple[int, int]:
    """(PSS, anonymous PSS) in bytes of a process and all its descendants (Linux /proc). The difference is
    file-backed: pages of files mapped (the token shards) or loaded (libraries), which the kernel can drop."""
    total, anon, todo = 0, 0, [pid]
    while todo:
        p = todo.pop()
        try:
            for line in open(f"/proc/{p}/smaps_rollup"):
                total += int(line.split()[1]) * 1024 if line.startswith("Pss:") else 0
                anon += int(line.split()[1]) * 1024 if line.startswith("Pss_Anon:") else 0
            for t in os.listdir(f"/proc/{p}/task"):
                todo += [int(c) for c in open(f"/proc/{p}/task/{t}/children").read().split()]
        except (OSError, ValueError):
            continue
    return total, anon


CHILD = """
import sys, time
sys.path.insert(0, {root!r})
from train.data import load_tokenizer_file
from train.data.shards import prepare
tok = load_tokenizer_file({model!r})
t0 = time.perf_counter()
s = prepare({corpus!r}, tok, __import__("pathlib").Path({out!r}), boundary=(None, tok.eos_id), workers={workers},
            shard_tokens={shard_tokens}, log=lambda m: None)
print(s.manifest["tokens"], time.perf_counter() - t0)
"""


def child(args, model: Path, corpus: Path, out: Path, shard_tokens: int = 0) -> subprocess.Popen:
    """A fresh process (its own process group) preparing `corpus` into `out` with the tokenizer file `model`."""
    script = CHILD.format(root=str(ROOT), model=str(model), corpus=str(corpus), out=str(out), workers=args.workers,
                          shard_tokens=shard_tokens or args.shard_tokens)
    return subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, start_new_session=True)


def sp_model(args, folder: Path) -> Path:
    model = folder / "sp.model"
    if not model.is_file():
        tokenizers(generate(folder / "sample", 8 << 20, ("jsonl",))[0]["jsonl"], folder)
    return model


def rss(args, folder: Path, out: dict):
    model, rows = sp_model(args, folder), []
    for mb in args.rss_mb:
        corpora, size = generate(folder / "rss", mb << 20, args.forms)
        for form, corpus in corpora.items():
            shutil.rmtree(folder / "rss-shards", ignore_errors=True)
            p, peak, peak_anon = child(args, model, corpus, folder / "rss-shards"), 0, 0
            while p.poll() is None:
                pss, anon = tree_pss(p.pid)
                peak, peak_anon = max(peak, pss), max(peak_anon, anon)
                time.sleep(0.05)
            tokens, secs = (f(v) for f, v in zip((int, float), p.stdout.read().split()))
            first = out.setdefault("rss", {}).setdefault(form, {}).get(str(args.rss_mb[0]), {}).get("peak_pss_bytes")
            out["rss"][form][str(mb)] = {"corpus_mb": size / 1e6, "peak_pss_bytes": peak,
                                         "peak_anon_pss_bytes": peak_anon, "seconds": secs, "tokens": tokens}
            rows.append([form, f"{size / 1e6:,.0f}", harness.gib(peak), f"{peak / (first or peak):.2f}",
                         harness.gib(peak_anon), f"{secs:.0f}", f"{size / 1e6 / secs:.2f}", f"{tokens:,}"])
        shutil.rmtree(folder / "rss")
    return harness.table(["input", "text MB", "peak GiB", "vs the smallest", "of which anonymous", "seconds", "MB/s",
                          "tokens"], rows, f"sentencepiece, {args.workers} workers; PSS of the process and its workers, "
                                           f"sampled every 50 ms")


def resume(args, folder: Path, out: dict):
    """Each form prepared whole, and in a fresh process SIGKILLed once half its chunks are in the shards (shards of
    about a tenth of the tokens), then prepared again: the shards of the two, byte for byte."""
    model, rows = sp_model(args, folder), []
    tok = SentencePieceTokenizer(model)
    corpora, size = generate(folder / "resume", args.mb << 20, args.forms)
    shard = size // 32
    for form, corpus in corpora.items():
        t0 = time.perf_counter()
        chunks = prepare_into(args, corpus, tok, folder / "whole", args.workers, shard).manifest["chunks"]
        whole_s, killed = time.perf_counter() - t0, folder / "killed"
        shutil.rmtree(killed, ignore_errors=True)
        p = child(args, model, corpus, killed, shard)
        while p.poll() is None and ((read_manifest(killed) or {}).get("chunks") or 0) < chunks / 2:
            time.sleep(0.01)
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        at, looks_complete = read_manifest(killed) or {"chunks": 0, "shards": []}, True
        try:
            Shards(killed)
        except DataError:
            looks_complete = False
        t0 = time.perf_counter()
        prepare_into(args, corpus, tok, killed, args.workers, shard, fresh=False)
        again_s, same = time.perf_counter() - t0, shard_bytes(killed) == shard_bytes(folder / "whole")
        out.setdefault("resume", {})[form] = {"chunks": chunks, "killed_after_chunks": at["chunks"],
                                              "shards_at_kill": len(at["shards"]), "looked_complete": looks_complete,
                                              "whole_s": whole_s, "resumed_s": again_s, "identical": same}
        rows.append([form, f"{at['chunks']} / {chunks}", len(at["shards"]), "yes" if looks_complete else "no",
                     f"{whole_s:.1f}", f"{again_s:.1f}", "yes" if same else "NO"])
    shutil.rmtree(folder / "resume")
    return harness.table(["input", "chunks at the kill", "shards at the kill", "looked complete", "whole s",
                          "resumed s", "identical"], rows,
                         f"{size / 1e6:.0f} MB of text, sentencepiece, {args.workers} workers, shards of {shard:,} "
                         f"tokens; SIGKILL to the preparing process and its workers")


def batches(args, folder: Path, out: dict):
    import torch
    from train.planner import build_model
    corpus = folder / "corpus.jsonl"
    if not corpus.is_file():
        generate(folder, args.mb << 20, ("jsonl",))
    preset = load_run_config(str(ROOT / "configs" / "llm" / "smollm-135m.yaml"), ["train.compile=false"])
    B, T = preset.train.batch_size, preset.data.seq_len
    data = TokenData(TextDataConfig(path=str(corpus), tokenizer="bytes", seq_len=T, cache_dir=str(folder / "cache"),
                                    workers=args.workers), log=lambda m: None)
    g = torch.Generator().manual_seed(0)
    assemble = B * T / harness.run_rounds({"windows": lambda: data.windows("train", B, g)}, 1, calls=20,
                                          warmup=1).best("windows")
    torch.manual_seed(0)
    model, x = build_model(preset).train(), torch.randint(0, preset.model.vocab_size, (1, T))
    side = harness.Side(model, lambda m: m(x, x)[1], optimizer=SimpleNamespace(step=lambda: None,  # no optimizer
                                                                               zero_grad=model.zero_grad))
    trained = T / harness.run_rounds({"step": lambda: side.step(args.precision)}, 2, warmup=1).best("step")
    out["batches"] = {"batch": [B, T], "assembled_tokens_per_s": assemble, "trained_tokens_per_s": trained,
                      "precision": args.precision, "threads": torch.get_num_threads()}
    return harness.table(["assembled tokens/s", "trained tokens/s", "assembly / training"],
                         [[f"{assemble:,.0f}", f"{trained:,.0f}", f"{assemble / trained:,.0f}x"]],
                         f"SmolLM-135M preset ({B} x {T} windows; training: 1 x {T} forward and backward, "
                         f"{args.precision}, {torch.get_num_threads()} threads, best of 2)")


def direct_bpe(docs: list[str], vocab: int, path: Path):
    """The byte-level BPE of data.tokenizer=bpe (its pre-tokenizer and trainer), trained by calling `tokenizers`
    directly: none of train_bpe's checks, logging or atomic write."""
    tok = byte_level()
    tok.train_from_iterator(docs, bpe_trainer(vocab))
    tok.save(str(path))


KINDS = ("bpe", "superbpe")


def stdlib_split(files: int = 0) -> tuple[list[str], list[str]]:
    """The standard library's .py files (the first `files`; 0: all): all but every tenth (training text), and
    every tenth (held out)."""
    texts = [f.read_text(errors="replace") for f in stdlib_files()[:files or None]]
    return [t for i, t in enumerate(texts) if i % 10], texts[::10]


def subwords(kind: str, vocab: int):
    """The SuperBPE transition of data.tokenizer=`kind` (data.superbpe_transition of the vocabulary; bpe: None)."""
    return int(vocab * TextDataConfig().superbpe_transition) if kind == "superbpe" else None


def tokens_per_byte(tok, docs: list[str]) -> float:
    return sum(map(len, tok.encode_many(docs))) / sum(len(d.encode()) for d in docs)


def tokenizer_bench(args, folder: Path) -> tuple[dict, dict]:
    """bpe and superbpe trained on the standard library's sources but every tenth file, their tokens per byte on
    that tenth; and Zoo's BPE training against calling `tokenizers` directly on the same sample."""
    docs, held = stdlib_split()
    sample = sample_documents(docs, args.train_chars)
    mb, quiet, out, rows, speed = sum(len(d.encode()) for d in sample) / 1e6, lambda m: None, {}, [], []
    for vocab in args.vocabs:
        per_byte = {}
        for kind in KINDS:
            t0, transition = time.perf_counter(), subwords(kind, vocab)
            tok = HFTokenizer(train_bpe(sample, vocab, folder / f"{kind}.json", transition, log=quiet))
            secs = time.perf_counter() - t0
            per_byte[kind] = tokens_per_byte(tok, held)
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
             f"that tenth ({sum(len(d.encode()) for d in held) / 1e6:.1f} MB, {len(held)} files)")
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
        ap.add_argument("--only", type=harness.name_list(PARTS, "part"), default=",".join(PARTS))
        ap.add_argument("--forms", type=harness.name_list(FORMS, "input"), default=",".join(FORMS))
        ap.add_argument("--mb", type=harness.positive_int, default=16, help="MB of text for speed and resume")
        ap.add_argument("--rss-mb", type=harness.int_list, default=[50, 150],
                        help="comma list of corpus sizes in MB for the memory part (default 50,150)")
        ap.add_argument("--shard-tokens", type=harness.positive_int, default=1 << 21, help="tokens per shard")
    args = ap.setup(argv)
    os.environ.setdefault("RAYON_NUM_THREADS", str(args.workers))  # the tokenizers library's threads
    out, tables = {"workers": args.workers, "cpus": os.cpu_count()}, {}
    with tempfile.TemporaryDirectory(prefix="zoo-bench-data-") as folder:
        if preset == "tokenizers":
            tables, data = tokenizer_bench(args, Path(folder))
            out.update(data)
        for part in getattr(args, "only", ()):
            tables[part] = {**globals()[part](args, Path(folder), out), "command": args.command}
    if preset == "data":  # read at the end: a part another run wrote meanwhile is kept
        tables, out = kept(args, tables, out)
    harness.save(args, tables, out)


def kept(args, tables: dict, out: dict) -> tuple[dict, dict]:
    """Every part in order: those run now, and the others' tables (with their command and date) and numbers from the
    result there is."""
    old = harness.load_result(args.json)
    when = f"measured {old.get('date')}, load average {old.get('machine', '').rsplit(' ', 1)[-1]}"
    if "speed" in tables and "speed" in old.get("tables", {}):
        _kept_forms(args, tables["speed"], old, out, when)
    for part in set(PARTS) - set(args.only):
        if part in old.get("tables", {}):
            t = {"command": old["command"], **old["tables"][part]}
            tables[part] = {**t, "notes": t.get("notes", "") + ("" if "measured " in t.get("notes", "") else f"; {when}")}
            out[part] = old.get("data", {}).get(part)
    return {k: tables[k] for k in PARTS if k in tables}, out


def _kept_forms(args, table: dict, old: dict, out: dict, when: str):
    """The speed rows and numbers of the forms not run now, at the same size, kept from the result there is (a
    large size is measured a form at a time), each form's date in the notes."""
    prev = old["tables"]["speed"]
    forms = [f for f in FORMS if f not in args.forms and f in old.get("data", {}).get("speed", {})]
    if not forms or prev["notes"].split(" MB")[0] != table["notes"].split(" MB")[0]:
        return
    table["rows"] = sorted([r for r in prev["rows"] if r[0] in forms] + table["rows"], key=lambda r: FORMS.index(r[0]))
    dates = {f: next(iter(old["data"]["speed"][f].values())).get("measured", f"{when} ({old['command']})")
             for f in forms}
    table["notes"] += "".join(f"; {f}: {d}" for f, d in dates.items())
    out["speed"] = {f: {**old["data"]["speed"], **out["speed"]}[f] for f in FORMS if f in forms or f in args.forms}
