"""Evaluate a language model on task files: a printed table and a JSON file.

    python train/eval.py DIR --task FILE [--task FILE ...] [--json OUT.json]

DIR: a run folder (train/run.py's out_dir), a Hugging Face folder, or anything zoo.from_pretrained
takes. Task files are jsonl: multiple choice (context, choices, answer), generation (prompt,
expected) or loss rows (text, prompt/completion, messages); train/evaluation.py has the formats and
how each is scored (multiple choice as lm-evaluation-harness scores HellaSwag, ARC and MMLU).

Options: --json OUT (default: DIR/eval.json when DIR is a folder, else eval.json), --tokenizer (a
tokenizer file or `bytes`; default: the folder's own), --template (the chat template chat prompts and
messages are rendered with: a built-in name, a path, or `none`; default: the folder's own, else none),
--device (auto, cpu, cuda, ...),
--precision (fp32, bf16, fp16), --batch-size, --max-new-tokens, --delimiter (multiple choice:
between context and choice, default " "), --details (each row's scores in the JSON).
Exit codes: 0 done; 2 a bad file, folder or option (one line).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python train/eval.py", description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="a run folder, a Hugging Face folder, or anything zoo.from_pretrained takes")
    p.add_argument("--task", action="append", required=True, help="a task file (jsonl); repeat for several")
    p.add_argument("--json", default=None, help="where the results go (default: MODEL/eval.json)")
    p.add_argument("--tokenizer", default=None, help="a tokenizer file or 'bytes' (default: the folder's)")
    p.add_argument("--template", default=None, help="chatml, a template file or folder, or none (default: the folder's)")
    p.add_argument("--device", default="auto")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--delimiter", default=" ")
    p.add_argument("--details", action="store_true", help="each row's scores in the JSON")
    return p.parse_args(argv)


def main(argv=None) -> int:
    import torch

    import zoo
    from zoo.config import ConfigError

    from train.data import DataError
    from train.data.conversations import BUILTIN, ChatTemplate, find_template
    from train.evaluation import evaluate_files, table, tokenizer_of
    from train.step import EXIT_CONFIG, RunStopped, autocast_for, resolve_device

    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if args.batch_size <= 0 or args.max_new_tokens <= 0:
            raise ConfigError("--batch-size and --max-new-tokens must be > 0")
        device = resolve_device(args.device)
        tokenizer = tokenizer_of(args.tokenizer or args.model)
        t = args.template
        template = (None if t == "none" else ChatTemplate.builtin(t) if t in BUILTIN else
                    ChatTemplate.from_pretrained(t) if t is not None else find_template(args.model))
        try:
            model = zoo.from_pretrained(args.model, dtype=torch.float32).to(device).eval()
        except (ValueError, OSError) as e:
            raise ConfigError(f"{args.model}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
        results = evaluate_files(model, tokenizer, args.task, device, template=template, batch_size=args.batch_size,
                                 max_new_tokens=args.max_new_tokens, delimiter=args.delimiter,
                                 autocast=autocast_for(device, args.precision), log=print)
    except (ConfigError, DataError, FileNotFoundError, RunStopped) as e:  # RunStopped: e.g. no CUDA
        print(f"error: {e}", file=sys.stderr)
        return getattr(e, "code", EXIT_CONFIG)
    print(table(results))
    out = Path(args.json) if args.json else (Path(args.model) / "eval.json" if Path(args.model).is_dir()
                                                 else Path("eval.json"))
    if not args.details:
        results = {k: {m: v for m, v in r.items() if m != "details"} for k, r in results.items()}
    from zoo.weights.files import atomic_write
    atomic_write(out, json.dumps({"model": str(args.model), "tasks": results}, indent=2))
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
