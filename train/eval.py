"""Evaluate a model: a language model on task files, a ConvNet on an image folder; a table and JSON.

    python train/eval.py DIR --task FILE [--task FILE ...] [--json OUT.json]
    python train/eval.py DIR --images FOLDER [--ema]     # a ConvNet run folder: accuracy, per class

A task file is jsonl: multiple choice (context, choices, answer) scored by log-likelihood as
lm-evaluation-harness does; generation (prompt, expected, until) greedy; loss rows by mean
cross-entropy; prompt (or messages) and answer rows by rewards (--reward; --samples: pass@k; docs/post-training.md);
image questions (image, question, answer; the image's path relative to the file) for a vision-language model:
chat.py's greedy answer with the image, exact match after lowercasing and removing punctuation, per answer.
Exit codes: 0 done; 2 a bad file, folder or option (one line).
"""
from __future__ import annotations

import argparse
import bisect
import contextlib
import json
import math
import re
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

from train.data import DataError  # noqa: E402
from train.data.conversations import token_offsets  # noqa: E402
from train.data.preference import (IGNORE, encode_prompt, encode_response, fit, prompt_messages,  # noqa: E402
                                   read_jsonl, response_text)
from train.data.prompts import prompt_row, reward_fn, score  # noqa: E402
from train.step import eval_mode  # noqa: E402
from zoo.weights.files import atomic_write  # noqa: E402


# ----------------------------------------------------------------------------- log-likelihoods
def token_logps(model, ids: torch.Tensor, labels: torch.Tensor, entropy: bool = False):
    """Log-probabilities of the labelled next tokens: ids, labels (B, T) (-100: not scored) -> (log-probs
    (B, T) fp32, 0 where not scored; the scored mask (B, T)[; the distributions' entropies (B, T), no grad])."""
    logits, valid = model(ids).float(), labels != IGNORE
    target, lse = labels.masked_fill(~valid, 0), torch.logsumexp(logits, dim=-1)
    logp = (logits.gather(-1, target[..., None]).squeeze(-1) - lse) * valid
    if not entropy:
        return logp, valid
    with torch.no_grad():
        ent = lse - (torch.softmax(logits, -1) * logits).sum(-1)
    return logp, valid, ent


def sequence_logps(model, ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """token_logps summed: -> (sums (B,) fp32, scored tokens (B,))."""
    logp, valid = token_logps(model, ids, labels)
    return logp.sum(-1), valid.sum(-1)


def collate(seqs: list[tuple[list[int], list[int]]], device, pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """[(ids, labels), ...] -> inputs x (B, T) and next-token labels y (B, T), right-padded (not scored)."""
    T = max(len(ids) for ids, _ in seqs) - 1
    x = torch.full((len(seqs), T), pad, dtype=torch.long)
    y = torch.full((len(seqs), T), IGNORE, dtype=torch.long)
    for i, (ids, labels) in enumerate(seqs):
        n = len(ids) - 1
        x[i, :n] = torch.tensor(ids[:-1])
        y[i, :n] = torch.tensor(labels[1:])
    return x.to(device), y.to(device)


@torch.no_grad()
def score_sequences(model, seqs: list, device, batch_size: int = 16, autocast=None) -> list[tuple[float, int]]:
    """(summed log-likelihood, scored tokens) of every (ids, labels) sequence."""
    out = []
    for s in range(0, len(seqs), batch_size):
        x, y = collate(seqs[s:s + batch_size], device)
        with (autocast or contextlib.nullcontext)():
            lp, n = sequence_logps(model, x, y)
        out += list(zip(lp.tolist(), n.tolist()))
    return out


# ----------------------------------------------------------------------------- task files
def parse_row(row: dict, folder: Path = Path(".")) -> dict:
    """A task row, checked, by what it holds: an image question (its file under `folder`), choices, expected
    (generation), answer (reward) or a loss row."""
    if "image" in row:
        return image_row(row, folder)
    if "choices" in row:
        context, choices, answer = row["context"], row["choices"], row["answer"]
        if not isinstance(context, str) or not isinstance(choices, list) or len(choices) < 2 \
                or not all(isinstance(c, str) and c for c in choices):
            raise TypeError("context must be a string and choices a list of at least two non-empty strings")
        if isinstance(answer, str):
            if answer not in choices:
                raise ValueError(f"answer {answer!r} is not one of the choices")
            answer = choices.index(answer)
        if isinstance(answer, bool) or not isinstance(answer, int) or not 0 <= answer < len(choices):
            raise ValueError(f"answer must be a choice or its index in [0, {len(choices)}), got {answer!r}")
        return {"kind": "choice", "context": context, "choices": choices, "answer": answer}
    if "expected" in row:
        until = row.get("until")
        if until is not None and not (isinstance(until, list) and all(isinstance(u, str) and u for u in until)):
            raise TypeError("until must be a list of non-empty strings")
        if not isinstance(row["expected"], str):
            raise TypeError("expected must be a string")
        prompt_messages(row["prompt"])
        return {"kind": "generation", "prompt": row["prompt"], "expected": row["expected"], "until": until}
    if "answer" in row:
        return {"kind": "reward", **prompt_row(row)}
    if "messages" in row:
        msgs = prompt_messages(row["messages"])
        if msgs[-1]["role"] != "assistant":
            raise ValueError("the last message must be the assistant's")
        return {"kind": "loss", "prompt": msgs[:-1], "completion": msgs[-1]["content"]}
    if "completion" in row:
        prompt_messages(row["prompt"])
        return {"kind": "loss", "prompt": row["prompt"], "completion": response_text(row["completion"])}
    if not isinstance(row["text"], str) or not row["text"]:
        raise TypeError("text must be a non-empty string")
    return {"kind": "loss", "prompt": None, "completion": row["text"]}


def image_row(row: dict, folder: Path) -> dict:
    """An image question {"image", "question", "answer"}; a row that lacks one or whose image is not a file: a
    DataError (read_jsonl names the file and line)."""
    if missing := [k for k in ("image", "question", "answer") if not isinstance(row.get(k), str) or not row[k]]:
        raise DataError(f"an image question needs image, question and answer strings ({', '.join(missing)} missing)")
    path = folder / Path(row["image"]).expanduser()
    if not path.is_file():
        raise DataError(f"image {path}: no such file")
    return {"kind": "image", "image": str(path), "question": row["question"], "answer": row["answer"]}


def read_task(path, log=print) -> tuple[str, list[dict]]:
    """(kind, rows) of a task file; every row must be of one kind."""
    folder = Path(path).expanduser().parent
    rows = read_jsonl(path, lambda row: parse_row(row, folder), log, "task rows")
    kinds = sorted({r["kind"] for r in rows})
    if len(kinds) > 1:
        raise DataError(f"{path}: rows of several kinds ({', '.join(kinds)}); one task file holds one kind")
    return kinds[0], rows


# ----------------------------------------------------------------------------- scoring
def choice_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-evaluation-harness's split of (context, continuation) into token ids: the context's trailing
    spaces move to the continuation, whose tokens are those of the whole past the context's."""
    if n := len(context) - len(context.rstrip()):
        context, continuation = context[:-n], context[-n:] + continuation
    whole, ctx = tokenizer.encode(context + continuation), tokenizer.encode(context)
    return ctx, whole[len(ctx):]


def score_choices(model, tokenizer, rows, device, delimiter=" ", batch_size=16, autocast=None, max_len=None, **_):
    """acc (highest log-likelihood) and acc_norm (per character) of choice rows, ties to the first; each row's."""
    seqs = []
    for r in rows:
        for c in r["choices"]:
            ctx, cont = choice_pair(tokenizer, r["context"], delimiter + c)
            if not ctx:  # an empty context: the harness conditions on the end-of-text token
                if tokenizer.eos_id is None:
                    raise DataError(f"an empty context needs a tokenizer with an EOS token (choice {c!r})")
                ctx = [tokenizer.eos_id]
            ids = (ctx + cont)[-(max_len + 1):] if max_len is not None else ctx + cont  # as the harness cuts it
            seqs.append((ids, [IGNORE] * (len(ids) - len(cont)) + ids[len(ids) - len(cont):]))
    scores, details = iter(score_sequences(model, seqs, device, batch_size, autocast)), []
    for r in rows:
        lls = [next(scores)[0] for _ in r["choices"]]
        normed = [ll / len(c) for ll, c in zip(lls, r["choices"])]
        details.append({"loglikelihoods": lls, "pred": lls.index(max(lls)), "pred_norm": normed.index(max(normed)),
                        "answer": r["answer"]})
    n = len(rows)
    acc, acc_norm = (sum(d[pred] == d["answer"] for d in details) / n for pred in ("pred", "pred_norm"))
    return {"acc": acc, "acc_norm": acc_norm, "n": n}, details


def cut_at(text: str, until) -> str:
    """text up to the first occurrence of any string of `until`."""
    end = min((i for i in (text.find(u) for u in until or ()) if i >= 0), default=len(text))
    return text[:end]


def generate_answer(model, tokenizer, prompt, device, template=None, max_new_tokens=64, max_len=None) -> str:
    """The greedy reply to a prompt: ChatSession's with a template, else the plain prompt's continuation to EOS."""
    if template is not None:
        from train.chat import ChatSession
        return ChatSession(model, tokenizer, template, max_new_tokens=max_new_tokens).respond(prompt_messages(prompt))
    ids = encode_prompt(tokenizer, prompt)
    if max_len is not None:
        ids = ids[-max(1, max_len - max_new_tokens):]
    x = torch.tensor([ids], dtype=torch.long, device=device)
    out = model.generate(x, max_new_tokens=max_new_tokens, eos_token_id=tokenizer.eos_id)[0, len(ids):].tolist()
    if tokenizer.eos_id is not None and tokenizer.eos_id in out:
        out = out[:out.index(tokenizer.eos_id)]
    return tokenizer.decode(out)


def chat_prompt_ids(tokenizer, template, prompt) -> list[int]:
    """The tokens of a prompt: with a template its messages rendered with the generation prompt, else plain text."""
    if template is None:
        return encode_prompt(tokenizer, prompt)
    return token_offsets(tokenizer, template.render(prompt_messages(prompt), add_generation_prompt=True))[0]


def stop_tokens(tokenizer, template) -> tuple[list[int], "str | None"]:
    """(the ids a completion stops at: EOS, and the end of turn when it is one token; the end-of-turn text)."""
    stops = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
    if template is None:
        return stops, None
    for text in (template.special_tokens.get("eos_token"), template.end_of_turn):
        ids = token_offsets(tokenizer, text)[0] if isinstance(text, str) and text else []
        if len(ids) == 1 and ids[0] not in stops:
            stops.append(ids[0])
    return stops, template.end_of_turn or None


@torch.no_grad()
def complete(model, tokenizer, template, prompts, max_new_tokens: int, temperature: float = 0.0, top_p=None,
             generator=None, max_prompt: "int | None" = None, stop_early: bool = True, compile: bool = False):
    """Completions of many prompts in one batched generate (left-padded, a stop per row). Returns
    (prompt ids, completion ids up to and with the stop, completion texts without it, truncated flags:
    no stop within max_new_tokens). A multi-token end of turn is found in the text, and the ids cut after it."""
    device = next(model.parameters()).device
    enc = [chat_prompt_ids(tokenizer, template, p)[-(max_prompt or 0):] for p in prompts]
    stops, eot = stop_tokens(tokenizer, template)
    T = max(len(e) for e in enc)
    ids = torch.tensor([[0] * (T - len(e)) + e for e in enc], device=device)
    mask = torch.tensor([[0] * (T - len(e)) + [1] * len(e) for e in enc], device=device)
    out = model.generate(ids, max_new_tokens, temperature, top_p=top_p, eos_token_id=stops or None,
                         generator=generator, attention_mask=mask, stop_early=stop_early, compile=compile)
    done = []  # (completion ids, text, truncated) of each row
    for row in out[:, T:].tolist():
        n = next((i + 1 for i, t in enumerate(row) if t in stops), len(row))
        stopped, row = row[n - 1] in stops, row[:n]
        text = tokenizer.decode(row[:-1] if stopped else row)
        if eot and eot in text:  # an end of turn of several tokens: the shortest prefix holding it
            n = bisect.bisect_left(range(1, len(row)), True, key=lambda k: eot in tokenizer.decode(row[:k])) + 1
            row, text, stopped = row[:n], text[:text.index(eot)], True
        done.append((row, text, not stopped))
    return enc, *map(list, zip(*done))


def score_generation(model, tokenizer, rows, device, template=None, max_new_tokens=64, autocast=None, max_len=None,
                     **_):
    """exact_match and contains of generation rows (and each row's output)."""
    exact = contains = 0
    details = []
    for r in rows:
        with (autocast or contextlib.nullcontext)():
            out = generate_answer(model, tokenizer, r["prompt"], device, template, max_new_tokens, max_len)
        until = r["until"] if r["until"] is not None else ([] if template is not None else ["\n"])
        text, want = cut_at(out, until), r["expected"].strip()
        exact += text.strip() == want
        contains += want in text
        details.append({"output": text, "expected": r["expected"]})
    n = len(rows)
    return {"exact_match": exact / max(n, 1), "contains": contains / max(n, 1), "n": n}, details


def score_loss(model, tokenizer, rows, device, template=None, batch_size=16, autocast=None, max_len=None, **_):
    """Mean cross-entropy over the rows' trained tokens."""
    seqs = []
    for r in rows:
        if r["prompt"] is None:
            ids = tokenizer.encode(r["completion"])
            labels = list(ids)
        else:
            ids, labels = encode_response(tokenizer, r["prompt"], r["completion"], template)
        if max_len is not None:
            ids, labels, _ = fit(ids, labels, max_len + 1)
        seqs.append((ids, labels))
    scores = score_sequences(model, seqs, device, batch_size, autocast)
    total, tokens = sum(s for s, _ in scores), sum(n for _, n in scores)
    if tokens == 0:
        raise DataError("no tokens to score (every row is a single token)")
    loss = -total / tokens
    return {"loss": loss, "ppl": math.exp(min(loss, 50)), "tokens": tokens}, []


def score_rewards(model, tokenizer, rows, device, template=None, batch_size=16, max_new_tokens=64, autocast=None,
                  max_len=None, rewards=None, samples=1, temperature=1.0, **_):
    """reward (the mean weighted total) and pass@1 (the first reward >= 1) of greedy completions of prompt
    rows, scored by `rewards` [(name, weight, fn)] (default numeric); samples k > 1: also pass@k, the share of
    prompts one of whose k sampled completions (each row's generator seeded by its index) is solved."""
    rewards = rewards or [("numeric", 1.0, reward_fn("numeric"))]
    max_prompt = max(1, max_len - max_new_tokens) if max_len else None

    def values(rows, temp, seeded):
        out = []
        for s in range(0, len(rows), batch_size):
            part = rows[s:s + batch_size]
            gens = [torch.Generator(device).manual_seed(s + i) for i in range(len(part))] if seeded else None
            with (autocast or contextlib.nullcontext)():
                texts = complete(model, tokenizer, template, [r["prompt"] for r in part], max_new_tokens, temp,
                                 generator=gens, max_prompt=max_prompt)[2]
            got = score(rewards, texts, [r["answer"] for r in part], [r["prompt"] for r in part])
            out += [(t, [v[k] for v in got]) for k, t in enumerate(texts)]
        return out
    greedy = values(rows, 0.0, False)
    total = [sum(w * v for (_, w, _), v in zip(rewards, vals)) for _, vals in greedy]
    out = {"reward": sum(total) / len(rows), "pass@1": sum(v[0] >= 1 for _, v in greedy) / len(rows), "n": len(rows)}
    details = [{"output": t, "answer": r["answer"], "rewards": v} for (t, v), r in zip(greedy, rows)]
    if samples > 1:
        many = values([r for r in rows for _ in range(samples)], temperature, True)
        out[f"pass@{samples}"] = sum(any(v[0] >= 1 for _, v in many[i * samples:(i + 1) * samples])
                                     for i in range(len(rows))) / len(rows)
    return out, details


def normalised(answer: str) -> str:
    """An answer as exact match compares it: lowercase, punctuation removed, whitespace collapsed."""
    return " ".join(re.sub(r"[^\w\s]", "", answer.lower()).split())


def score_images(model, tokenizer, rows, device, template=None, max_new_tokens=64, autocast=None, model_dir=None,
                 **_):
    """exact_match of image questions: each answered greedily by chat.py's ChatSession with its image as the
    processor of model_dir (the folder the model came from) splits it, compared after `normalised`; per_answer: each
    reference answer's [rows, exact_match]."""
    from train.chat import ChatSession
    from train.data.images import image_processor, processed_image
    if template is None:
        raise DataError("image questions need a chat template that places <image> (--template)")
    details, per, processor = [], {}, image_processor(model, model_dir)
    for r in rows:
        pixels, text = processed_image(processor, r["image"])
        try:
            with (autocast or contextlib.nullcontext)():
                chat = ChatSession(model, tokenizer, template, max_new_tokens=max_new_tokens,
                                   images=(pixels.to(next(model.parameters())), [text]))
                out = chat.reply(r["question"])
        except ValueError as e:  # the tokenizer or template cannot place the image
            raise DataError(f"{r['image']}: {e}") from None
        hit = normalised(out) == normalised(r["answer"])
        per.setdefault(normalised(r["answer"]), []).append(hit)
        details.append({"image": r["image"], "output": out, "answer": r["answer"], "correct": hit})
    return {"exact_match": sum(d["correct"] for d in details) / len(rows), "n": len(rows),
            "per_answer": {a: [len(h), sum(h) / len(h)] for a, h in sorted(per.items())}}, details


SCORERS = {"choice": score_choices, "generation": score_generation, "loss": score_loss, "reward": score_rewards,
           "image": score_images}


def evaluate_files(model, tokenizer, files, device, template=None, batch_size=16, max_new_tokens=64,
                   delimiter=" ", autocast=None, log=print, **reward_options) -> dict[str, dict]:
    """{task (file stem): {metric: value, "kind", "details"}} of every task file, in eval mode."""
    max_len, results = getattr(getattr(model, "config", None), "max_seq_len", None), {}
    with eval_mode(model):
        for f in files:
            kind, rows = read_task(f, log)
            if kind == "image" and getattr(model, "family", None) != "vlm":
                raise DataError(f"{f}: image questions need a vision-language model, not {type(model).__name__}")
            try:
                m, d = SCORERS[kind](model, tokenizer, rows, device, template=template, batch_size=batch_size,
                                     max_new_tokens=max_new_tokens, delimiter=delimiter, autocast=autocast,
                                     max_len=max_len, **reward_options)
            except TypeError as e:  # a prompt of messages and no template
                raise DataError(f"{f}: {e}") from None
            name = Path(f).stem
            while name in results:
                name += "_"
            results[name] = {"kind": kind, **m, "details": d}
    return results


def metric_row(results: dict) -> dict[str, float]:
    """The results as flat numbers for metrics.jsonl: `eval_<task>_<metric>`."""
    return {f"eval_{name}_{k}": float(v) for name, r in results.items() for k, v in r.items()
            if isinstance(v, (int, float)) and k != "n"}


def per_class_table(pred: torch.Tensor, y: torch.Tensor, classes, weights: str):
    """Per-class accuracy of `pred` against `y` -> (rows (name, n, acc), table of `weights`, its head, its total)."""
    rows = [(name, int((y == c).sum()), (pred[y == c] == c).float().mean().item())
            for c, name in enumerate(classes) if (y == c).any()]
    head = f"weights: {weights}\n{'class':>24}  {'n':>5}  acc"
    total = f"{'all':>24}  {len(y):>5}  {(pred == y).float().mean().item():.3f}"
    text = "\n".join([head] + class_lines(rows) + [total])
    return rows, text, head, total


def class_lines(rows) -> list[str]:
    """(name, n, accuracy) rows as the per-class table's lines."""
    return [f"{n[:24]:>24}  {k:>5}  {a:.3f}" for n, k, a in rows]


def table(results: dict) -> str:
    """The results as a plain-text table: task, kind, rows, then its metrics."""
    lines = [f"{'task':<24} {'kind':<11} {'n':>6}  metrics"]
    for name, r in results.items():
        n = r.get("n", r.get("tokens", ""))
        metrics = "  ".join(f"{k} {v:.4f}" for k, v in r.items()
                            if k not in ("kind", "n", "tokens", "details") and isinstance(v, float))
        lines.append(f"{name:<24} {r['kind']:<11} {n:>6}  {metrics}")
    for name, r in results.items():  # image questions: each answer's rows and exact match
        if "per_answer" in r:
            lines += ["", f"{name}, per answer:", f"{'answer':>24}  {'n':>5}  exact_match",
                      *class_lines((a, k, acc) for a, (k, acc) in r["per_answer"].items())]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- command line
def parse_args(argv):
    p = argparse.ArgumentParser(prog="python train/eval.py", description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="a run folder, a Hugging Face folder, or anything zoo.from_pretrained takes")
    p.add_argument("--task", action="append", help="a task file (jsonl); repeat for several")
    p.add_argument("--images", help="a ConvNet run's test images: a folder of class folders")
    p.add_argument("--ema", action="store_true", help="--images: the EMA's weights")
    p.add_argument("--json", default=None, help="where the results go (default: MODEL/eval.json)")
    p.add_argument("--tokenizer", default=None, help="a tokenizer file or 'bytes' (default: the folder's)")
    p.add_argument("--template", default=None, help="chatml, a template file or folder, or none (default: the folder's)")
    p.add_argument("--device", default="auto")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--delimiter", default=" ")
    p.add_argument("--details", action="store_true", help="each row's scores in the JSON")
    p.add_argument("--reward", action="append", help="prompt/answer rows: a reward (as rl.rewards names them, "
                   "weight 1); repeat for several; default numeric")
    p.add_argument("--samples", type=int, default=1, help="prompt/answer rows: k sampled completions per prompt "
                   "for pass@k (1: greedy only)")
    p.add_argument("--temperature", type=float, default=1.0, help="the temperature of those samples")
    return p.parse_args(argv)


def main(argv=None) -> int:
    import zoo
    from zoo.config import ConfigError

    from train.data.conversations import choose_template, tokenizer_and_template
    from train.step import EXIT_CONFIG, RunStopped, autocast_for, resolve_device

    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.images:
        return evaluate_images(args)
    try:
        if not args.task:
            raise ConfigError("--task or --images is required")
        if args.batch_size <= 0 or args.max_new_tokens <= 0 or args.samples <= 0:
            raise ConfigError("--batch-size, --max-new-tokens and --samples must be > 0")
        device = resolve_device(args.device)
        tokenizer, own = tokenizer_and_template(args.model, args.tokenizer)
        template = choose_template(args.template, own)
        try:
            model = zoo.from_pretrained(args.model, dtype=torch.float32).to(device).eval()
        except (ValueError, OSError) as e:
            raise ConfigError(f"{args.model}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
        rewards = [(r, 1.0, reward_fn(r, "--reward")) for r in args.reward or ["numeric"]]
        results = evaluate_files(model, tokenizer, args.task, device, template=template, batch_size=args.batch_size,
                                 max_new_tokens=args.max_new_tokens, delimiter=args.delimiter,
                                 autocast=autocast_for(device, args.precision), log=print, rewards=rewards,
                                 samples=args.samples, temperature=args.temperature, model_dir=args.model)
    except (ConfigError, DataError, FileNotFoundError, RunStopped) as e:  # RunStopped: e.g. no CUDA
        print(f"error: {e}", file=sys.stderr)
        return getattr(e, "code", EXIT_CONFIG)
    print(table(results))
    out = Path(args.json or (Path(args.model) / "eval.json" if Path(args.model).is_dir() else "eval.json"))
    if not args.details:
        results = {k: {m: v for m, v in r.items() if m != "details"} for k, r in results.items()}
    atomic_write(out, json.dumps({"model": str(args.model), "tasks": results}, indent=2))
    print(f"results: {out}")
    return 0


def evaluate_images(args) -> int:
    """A ConvNet run folder on a folder of class folders: accuracy and the per-class table (JSON too)."""
    from train.data.images import scan_image_folder
    from train.predict import load, probabilities
    try:
        model, prep = load(args.model, args.ema)
        _, samples = scan_image_folder(args.images, prep.classes)
        probs = probabilities(model, prep, [p for p, _ in samples], args.batch_size)
    except (FileNotFoundError, ValueError, OSError) as e:
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    labels, pred = torch.tensor([y for _, y in samples]), probs.argmax(1)
    rows, text, _, _ = per_class_table(pred, labels, prep.classes, f"{'model_ema' if args.ema else 'model'}.safetensors")
    print(text)
    accuracy = float((pred == labels).float().mean())
    out = Path(args.json or Path(args.model) / "eval_images.json")
    atomic_write(out, json.dumps({"model": str(args.model), "images": str(args.images), "accuracy": accuracy,
                                  "per_class": {n: (k, a) for n, k, a in rows}}, indent=2))
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
