"""The generated tables of docs/: config keys from the config dataclasses, numbers from results.

    python -m train.docs           # rewrite every marked region in docs/
    python -m train.docs --check   # exit 1 naming each region that disagrees with the code or its result

Markers: `<!-- keys:LLMConfig -->` ... `<!-- /keys -->`, `<!-- table:NAME[/KEY] -->` ... `<!-- /table -->`,
`<!-- code:NAME -->` ... `<!-- /code -->` (a table made from the code: CODE_TABLES).
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import json
import re
import sys
import textwrap
import tokenize
import types
import typing
from pathlib import Path
from typing import Literal, Optional, Union

from zoo.config import ConfigError, describe_bounds

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
RESULTS = DOCS / "results"
REGION = re.compile(r"(<!-- keys:(\w+) -->\n)(.*?)(<!-- /keys -->)", re.S)
TABLE = re.compile(r"(<!-- table:([\w.-]+)(?:/([\w. -]+?))? -->\n)(.*?)(<!-- /table -->)", re.S)
CODE = re.compile(r"(<!-- code:(\w+) -->\n)(.*?)(<!-- /code -->)", re.S)


def _presets(family: str):
    """(path, model) of each configs/<family>/*.yaml, the model built on the meta device."""
    import torch

    import zoo
    for path in sorted((ROOT / "configs" / family).glob("*.yaml")):
        with torch.device("meta"):
            yield path, zoo.build(path)


def pretrained_table() -> dict:
    """docs/pretrained.md's table from the records (zoo/archs): each Hugging Face class, the features it needs
    (bold) or may have, its GGUF architecture (read; written where it is), the configs/llm/ presets exported as it."""
    from zoo.archs import RECORDS
    from zoo.weights import hf_llm
    presets = {}
    for path, model in _presets("llm"):
        try:
            presets.setdefault(hf_llm.architecture_for(model.config), []).append(path.stem)
        except ValueError:
            pass
    rows = [[r.hf_class, ", ".join([f"**{f}**" for f in sorted(r.needs)] + sorted(r.may)) or "-", r.gguf or "-",
             r.gguf if r.gguf_writes else "-", ", ".join(presets.get(r.hf_class, [])) or "-"] for r in RECORDS.values()]
    return {"columns": ["architecture", "features (needed in bold)", "GGUF in", "GGUF out", "presets"], "rows": rows}


def features_table() -> dict:
    """docs/pretrained.md's legend of the feature names: the model keys that give each (zoo/archs/record.py)."""
    from zoo.archs import FEATURES
    return {"columns": ["feature", "model keys"], "rows": [[f"`{k}`", f"`{v}`"] for k, v in FEATURES.items()]}


# docs/distributed.md's table: per combination its overrides and, for DDP, FSDP2 and resuming a torchrun
# checkpoint, the tests that run it under torchrun against one process ("KEY[case], ...", KEY in
# PARALLEL_TESTS); a combination train.parallel refuses gets the refusal's reason instead
PARALLEL_TESTS = {"parity": "test_two_processes_match_one_with_the_same_global_batch",
                  "kill": "test_sigkill_and_sigterm_of_the_torchrun_job_then_relaunch_is_bitwise_identical",
                  "reshard": "test_fsdp_checkpoint_of_two_processes_resumes_in_one",
                  "adapters": "test_adapters_under_two_processes_match_one",
                  "optim": "test_optimizers_under_two_processes_match_one",
                  "post": "test_post_training_under_two_processes_matches_one",
                  "families": "test_diffusion_moe_and_mod_match_one_process",
                  "compress": "test_distill_qat_prune_and_adafactor_under_two_processes_match_one",
                  "lr_find": "test_lr_find_under_torchrun_matches_one_process",
                  "torchrun": "test_unfreezing_and_resuming_under_torchrun",
                  "fp16_drop": "test_fp16_and_whole_batch_drop_path_match_one_process",
                  "hooks": "test_grad_compression_hooks_against_plain_ddp",
                  "zero2": "test_zero2_matches_one_process_and_resumes"}
PARALLEL_COMBINATIONS = [  # (row, overrides, DDP, FSDP2, resume)
    ("full (AdamW)", [], "parity[ddp]", "parity[fsdp]", "kill, reshard, torchrun (1 -> 2 processes)"),
    ("LoRA", ["adapter.method=lora"], "adapters[lora]", "adapters[lora]", "adapters[lora], torchrun (SIGKILL)"),
    ("DoRA", ["adapter.method=dora"], "adapters[dora]", "adapters[dora]", ""),
    ("prefix tuning", ["adapter.method=prefix"], "adapters[prefix]", "adapters[prefix]", ""),
    ("prompt tuning", ["adapter.method=prompt"], "adapters[prompt]", "adapters[prompt]", ""),
    ("bottleneck adapters", ["adapter.method=bottleneck"], "adapters[bottleneck]", "adapters[bottleneck]", ""),
    ("QLoRA", ["adapter.method=lora", "adapter.quantize_base=nf4"], "adapters[qlora]", "adapters[qlora]", ""),
    ("train.unfreeze", ["train.unfreeze=[2]"], "torchrun", "torchrun", "torchrun"),
    ("Gemma 2/3 and GPT-OSS layers (windows, soft-caps, sinks)", ["model.sliding_window=8",
     "model.attn_pattern=[local,global]", "model.attn_softcap=20.0", "model.attn_sinks=true"],
     "families[newer-ddp]", "families[newer-fsdp]", ""),
    ("DeepSeek-V3 layers (latent attention, MoE)", ["model.mla.kv_rank=16", "model.moe.n_experts=4",
     "model.moe.scoring=sigmoid"], "", "families[moe-fsdp]", ""),
    ("Mixture-of-Depths (with MoE layers)", ["model.mod_capacity=0.25", "model.moe.n_experts=4"],
     "families[mod-ddp]", "families[mod-fsdp]", ""),
    ("optim.name=sgd", ["optim.name=sgd"], "families[rl-ddp]", "families[rl-fsdp]", "families[rl-fsdp]"),
    ("optim.name=adafactor", ["optim.name=adafactor"], "compress", "compress", ""),
    ("optim.name=lion", ["optim.name=lion"], "", "lr_find", ""),
    ("optim.name=muon", ["optim.name=muon"], "optim[muon]", "optim[muon]", "torchrun (SIGKILL)"),
    ("optim.name=adamw8bit", ["optim.name=adamw8bit"], "optim[adamw8bit]", "optim[adamw8bit]", ""),
    ("optim.name=adamw_offload", ["optim.name=adamw_offload"], "optim[adamw_offload]", "optim[adamw_offload]", ""),
    ("optim.name=galore", ["optim.name=galore"], "optim[galore]", "optim[galore]", ""),
    ("optim.name=adagrad", ["optim.name=adagrad"], "optim[adagrad]", "optim[adagrad]", ""),
    ("optim.name=rmsprop", ["optim.name=rmsprop"], "optim[rmsprop]", "optim[rmsprop]", ""),
    ("chat SFT", [], "post[sft]", "post[sft]", ""),
    ("DPO (LoRA)", [], "post[dpo]", "post[dpo]", ""),
    ("GRPO", [], "families[rl-ddp]", "families[rl-fsdp]", "families[rl-fsdp]"),
    ("train.teacher (distillation)", [], "compress", "compress", ""),
    ("train.qat", ["train.qat=int8"], "compress", "compress", ""),
    ("train.prune", ["train.prune=2:4"], "compress", "compress", ""),
    ("train.lr_find", ["train.lr_find=true"], "", "lr_find", "n/a (no checkpoints)"),
    ("train.batch_size: auto", ["train.batch_size=auto", "train.global_batch=16"], "parity[ddp]", "", ""),
    ("train.precision=fp16", ["train.precision=fp16"], "fp16_drop", "fp16_drop", ""),
    ("ViT (layer-wise LR decay)", ["family=vit", "optim.layer_decay=0.7"], "families[vit-ddp]", "families[vit-fsdp]",
     ""),
    ("VLM chat SFT (images in the rows)", ["family=vlm"], "families[vlm-ddp]", "families[vlm-fsdp]", ""),
    ("model.drop_path_mode=batch (ResNet)", ["family=convnet", "model.arch=resnet18", "model.drop_path_rate=0.1",
                                            "model.drop_path_mode=batch"], "fp16_drop", "fp16_drop", ""),
    ("train.grad_compression (fp16, bf16, PowerSGD)", ["train.grad_compression=powersgd"], "hooks", "", "hooks"),
    ("train.fsdp_reshard=false (ZeRO-2)", ["train.fsdp_reshard=false"], "", "zero2", "zero2"),
]


def refusal(over: list):
    """Why a config is refused under its train.parallel (the config's own check, else the optimizer's), or None."""
    from train.config import load_run_config
    from train.distributed import unsupported
    try:
        return unsupported(load_run_config(None, over))
    except ConfigError as e:
        return str(e).split(": ", 1)[-1]


def parallel_table() -> dict:
    """docs/distributed.md's table of what runs under torchrun: per combination and column the tests
    (tests/test_distributed*.py, numbered) that run it against one process, or train.parallel's refusal."""
    numbers = {key: str(i + 1) for i, key in enumerate(PARALLEL_TESTS)}
    reason = lambda why: why.split(" (", 1)[-1][:-1] if why else None  # noqa: E731
    rows = []
    for name, over, *cells in PARALLEL_COMBINATIONS:
        why = {s: reason(refusal([*over, f"train.parallel={s}"])) for s in ("ddp", "fsdp")}
        why["resume"] = why["ddp"] and why["fsdp"]
        rows.append([name] + [
            ("refused" if col != "ddp" and why[col] == why["ddp"] else f"refused: {why[col]}") if why[col] else
            re.sub(r"^\w+|(?<=, )\w+", lambda m: numbers.get(m.group(), m.group()), cell) or "-"
            for col, cell in zip(("ddp", "fsdp", "resume"), cells)])
    notes = ("Tests of tests/test_distributed.py and test_distributed_cases.py (`-`: no test runs it under "
             "torchrun):\n\n") + "\n".join(
        f"{n}. `{PARALLEL_TESTS[k]}`" for k, n in numbers.items())
    return {"columns": ["combination", "DDP", "FSDP2", "resumed from a torchrun checkpoint"], "rows": rows,
            "notes": notes}


def _count(n: int) -> str:
    """A parameter count as 3.48M, 1.24B (three significant digits)."""
    unit, div = ("B", 1e9) if n >= 0.9995e9 else ("M", 1e6)
    return f"{n / div:.3g}{unit}"


def _summary(path: Path) -> str:
    """The first line of a config's header comment, up to its first ':' or ' (' (what the file is)."""
    first = path.read_text().split("\n", 1)[0].lstrip("# ").strip()
    return re.sub(r" shape$", "", re.split(r":|\s\(", first, maxsplit=1)[0])


def llm_presets_table() -> dict:
    """docs/llm.md's presets: each configs/llm/*.yaml, what its header comment says, its shape and parameters."""
    rows = []
    for path, model in _presets("llm"):
        c = model.config
        shape = [f"{c.n_layers} x {c.d_model}", f"{c.n_heads} / {c.resolved_n_kv_heads} heads"
                 + (" (latent attention)" if c.mla else "")]
        if c.moe is not None:
            shape.append(f"{c.moe.n_experts} experts of {c.resolved_expert_hidden}, top-{c.moe.top_k}")
        if c.mod_capacity:
            shape.append(f"Mixture-of-Depths {c.mod_capacity:g} every {c.mod_every}")
        total, active = model.num_params(), model.num_params(active=True)
        rows.append([f"`{path.name}`", _summary(path), ", ".join(shape),
                     _count(total) + (f" ({_count(active)} active)" if active != total else "")])
    return {"columns": ["file", "what", "layers x d_model, query / key-value heads, experts", "parameters"],
            "rows": rows}


DEPTHS = (2, 4, 6, 8, 12, 16, 20, 26, 32)  # the rows of docs/llm.md's model.depth table


def llm_depths_table() -> dict:
    """docs/llm.md's `model.depth` table: the shape and parameters each depth gives, the other keys at their defaults
    (built on the meta device)."""
    import torch

    from zoo.config import DEPTH_ASPECT_RATIO, DEPTH_HEAD_DIM, LLMConfig
    from zoo.llm import LLM
    rows, c = [], LLMConfig()
    for depth in DEPTHS:
        with torch.device("meta"):
            m = LLM(LLMConfig(depth=depth))
        rows.append([str(depth), f"{m.config.n_layers} x {m.config.d_model}", str(m.config.n_heads),
                     str(m.config.resolved_ffn_hidden), _count(m.num_params()), _count(m.num_params(non_embedding=True))])
    return {"columns": ["`model.depth`", "layers x d_model", "heads", "ffn_hidden", "parameters", "non-embedding"],
            "rows": rows, "notes": f"`n_layers` = depth, `d_model` = depth x {DEPTH_ASPECT_RATIO} rounded up to a "
                                   f"multiple of the head size (`head_dim`, null: {DEPTH_HEAD_DIM}), `n_heads` = "
                                   f"`d_model` / head size. The other keys at their defaults: vocab_size {c.vocab_size},"
                                   f" {'tied' if c.tie_embeddings else 'untied'} embeddings, {c.mlp} MLP, as many "
                                   f"key-value heads as query heads."}


def convnet_presets_table() -> dict:
    """docs/convnet.md's presets: each configs/convnet/*.yaml, what its header comment says, its parameters."""
    rows = [[f"`{path.name}`", _summary(path), _count(model.num_params())] for path, model in _presets("convnet")]
    return {"columns": ["file", "what", "parameters"], "rows": rows}


def convnet_archs_table() -> dict:
    """docs/convnet.md's kinds: every `model.arch` of zoo/config.py's CONVNET_KINDS, per kind (zoo/convnet/KIND.py)."""
    from zoo.config import CONVNET_KINDS
    return {"columns": ["kind", "`model.arch`"],
            "rows": [[f"{kind} (`{kind}.py`)", ", ".join(archs)] for kind, archs in CONVNET_KINDS.items()]}


def vit_archs_table() -> dict:
    """docs/vit.md's presets: every `model.arch` of zoo/config.py's VIT_ARCHS and what sets it apart."""
    from zoo.config import VIT_ARCHS
    shape = ("embed_dim", "depth", "num_heads", "patch_size", "img_size")
    rows = [[f"`{arch}`", *(str(p[k]) for k in shape),
             ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in p.items() if k not in shape)
             or "-"] for arch, p in VIT_ARCHS.items()]
    return {"columns": ["`model.arch`", "width", "depth", "heads", "patch", "image", "tokens and scales"], "rows": rows}


def dit_presets_table() -> dict:
    """docs/diffusion.md's DiT presets (zoo/config.py's DIT_PRESETS) and their parameters at patch 2, 4 latent
    channels, learned sigma and 1000 classes (DiT-XL/2's setting; built on the meta device)."""
    import torch

    from zoo.config import DIT_PRESETS, DiTConfig
    from zoo.diffusion.dit import DiT
    with torch.device("meta"):
        rows = [[f"`{name}`", str(depth), str(width), str(heads),
                 _count(DiT(DiTConfig(preset=name, patch_size=2, learn_sigma=True), 4, 1000, 32).num_params())]
                for name, (depth, width, heads) in DIT_PRESETS.items()]
    return {"columns": ["preset", "depth", "width", "heads",
                        "parameters (patch 2, 4 channels, learned sigma, 1000 classes)"], "rows": rows}


def samplers_table() -> dict:
    """docs/diffusion.md's samplers: what runs each and the predictions check_sampler accepts."""
    from zoo.config import DiffusionConfig
    from zoo.diffusion.samplers import DIFFUSERS, SAMPLERS, check_sampler
    predictions, rows = typing.get_args(typing.get_type_hints(DiffusionConfig)["prediction"]), []
    for name in SAMPLERS:
        if name in DIFFUSERS:
            cls, extra, _ = DIFFUSERS[name]
            what = f"diffusers `{cls}`" + (f" ({', '.join(f'{k}={v}' for k, v in extra.items())})" if extra else "")
        else:
            what = "Zoo (zoo/diffusion/schedule.py), torch only"
        rows.append([f"`{name}`", what, ", ".join(p for p in predictions if check_sampler(name, p) is None)])
    return {"columns": ["`model.sampler`", "implementation", "predictions"], "rows": rows}


CODE_TABLES = {"pretrained": pretrained_table, "features": features_table, "parallel": parallel_table,
               "llm_presets": llm_presets_table, "llm_depths": llm_depths_table, "convnet_presets": convnet_presets_table,
               "convnet_archs": convnet_archs_table, "vit_archs": vit_archs_table, "dit_presets": dit_presets_table,
               "samplers": samplers_table}


def config_classes() -> dict[str, type]:
    """Name -> every config dataclass a run config is made of (model, data, train, optim, adapter)."""
    from zoo import config as zc
    from zoo.adapters import AdapterConfig
    from .config import OptimConfig, TrainConfig, task_class
    from zoo.config import load_class
    classes = [zc.RopeScaling, zc.MoEConfig, zc.MLAConfig, zc.RecurrentConfig, *(f.config for f in zc.FAMILIES.values()),
               zc.AutoencoderConfig, zc.DiTConfig, zc.VLMConfig, TrainConfig, OptimConfig, AdapterConfig]
    tasks = [task_class(f) for f in zc.FAMILIES]
    formats = [load_class(s) for t in tasks for s in t.formats.values()]
    classes += [t.DataConfig for t in tasks] + [f.DataConfig for f in formats]
    classes += [c for f in formats for c in getattr(f, "sections", ())]  # a task's own sections (rl:), their parts
    from .data import SourceConfig  # an entry of data.sources
    classes.append(SourceConfig)
    return {c.__name__: c for c in classes}


def _sources(cls):
    """The dedented source of cls and its dataclass bases, base first (a field's comment is its last declarer's)."""
    for c in reversed(cls.__mro__):
        if dataclasses.is_dataclass(c):
            yield textwrap.dedent("".join(inspect.getsourcelines(c)[0]))


def field_comments(cls) -> dict[str, str]:
    """Field name -> its comment in the source: the trailing `# ...` of the field's line(s) and the
    comment-only lines right below it indented past the field. A section comment `# -- concern` at
    the field's own indentation heads the fields after it: `field_groups`."""
    out = {}
    for src in _sources(cls):
        comments = {}
        for tok in tokenize.generate_tokens(io.StringIO(src).readline):
            if tok.type == tokenize.COMMENT:
                comments[tok.start[0]] = (tok.start[1], tok.string.lstrip("#").strip())
        body = src.splitlines()
        for node in ast.parse(src).body[0].body:
            if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
                continue
            indent = node.col_offset
            parts = [comments[n][1] for n in range(node.lineno, node.end_lineno + 1) if n in comments]
            n = node.end_lineno + 1
            while n in comments and not body[n - 1][:comments[n][0]].strip() and comments[n][0] > indent:
                parts.append(comments[n][1])
                n += 1
            out[node.target.id] = " ".join(p for p in parts if p)
    return out


def field_groups(cls) -> dict[str, str]:
    """Field name -> the concern it is grouped under (the section comment `# -- concern` above it)."""
    out = {}
    for src in _sources(cls):
        group = ""
        for line in src.splitlines():
            if m := re.match(r"\s+# -- (.+)$", line):
                group = m.group(1).strip()
            elif m := re.match(r"\s+(\w+)\s*:", line):
                out[m.group(1)] = group
    return out


def doc_type(tp) -> str:
    """A type annotation as the docs show it (no '|' characters: they are table cells)."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return ", ".join(str(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        # a fixed order (typing caches equal Unions, so Union[str, int] may come back as Union[int, str])
        args = sorted((a for a in typing.get_args(tp) if a is not type(None)),
                      key=lambda a: (typing.get_origin(a) is Literal, doc_type(a)))
        text = " or ".join(doc_type(a) for a in args)
        return text + " or null" if len(args) < len(typing.get_args(tp)) else text
    if origin in (list, tuple):
        args = [a for a in typing.get_args(tp) if a is not Ellipsis]
        if origin is tuple and len(args) > 1:
            return f"{len(args)} {doc_type(args[0])}s"
        return f"list of {doc_type(args[0])}" if args else "list"
    if dataclasses.is_dataclass(tp):
        return f"mapping (`{tp.__name__}`)"
    return getattr(tp, "__name__", str(tp))


def doc_value(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return json.dumps([doc_value(x) if isinstance(x, float) else dataclasses.asdict(x) if dataclasses.is_dataclass(x)
                           else x for x in v]).replace('"', "")
    if dataclasses.is_dataclass(v):
        return f"`{type(v).__name__}` defaults"
    return str(v) if v != "" else "''"


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else None


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render(cls) -> str:
    """The markdown table of cls's keys (without the markers)."""
    hints = typing.get_type_hints(cls)
    comments, groups = field_comments(cls), field_groups(cls)
    rows, group = ["| key | type | default | bounds | meaning |", "|---|---|---|---|---|"], ""
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if groups.get(f.name, "") != group:  # the fields of one concern under a row naming it
            group = groups[f.name]
            rows.append(f"| **{_cell(group)}** | | | | |")
        bounds = describe_bounds(f.metadata.get("bounds", {}))
        rows.append(f"| `{f.name}` | {_cell(doc_type(hints[f.name]))} | {_cell(doc_value(_default(f)))} | "
                    f"{_cell(bounds)} | {_cell(comments.get(f.name, ''))} |")
    return "\n".join(rows) + "\n"


def markdown(t: dict) -> str:
    """A result's table (columns, rows, notes) as markdown."""
    lines = ["| " + " | ".join(t["columns"]) + " |", "|" + "---|" * len(t["columns"])]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in t["rows"]]
    return "\n".join(lines) + "\n" + (f"\n{t['notes'].strip()}\n" if t.get("notes") else "")


def made_by(command: str, result: dict) -> str:
    return f"\nMade by `{command}` on {result['machine']}, {result['date']}.\n"


def render_result(name: str, key: Optional[str] = None, results: Path = RESULTS) -> str:
    """The region <!-- table:NAME[/KEY] -->: the result's tables (or the one named KEY), each followed by
    the command that made it where it has one of its own, then the result's command."""
    path = results / f"{name}.json"
    if not path.is_file():
        raise ValueError(f"<!-- table:{name} -->: no result {path}")
    result = json.loads(path.read_text())
    if key is not None and key not in result["tables"]:
        raise ValueError(f"<!-- table:{name}/{key} -->: {path.name} has no table {key!r} "
                         f"(it has {', '.join(result['tables'])})")
    tables = [result["tables"][key]] if key else list(result["tables"].values())
    parts = [markdown(t) + (made_by(t["command"], result) if "command" in t else "") for t in tables]
    if any("command" not in t for t in tables):
        parts[-1] += made_by(result["command"], result)
    return "\n".join(parts)


def update(text: str, classes: dict, source: str = "docs", results: Path = RESULTS) -> tuple[str, list[str]]:
    """text with every marked region re-rendered; and the names of the regions that changed."""
    changed = []

    def keys(name):
        if name not in classes:
            raise ValueError(f"<!-- keys:{name} --> names no config dataclass (known: {', '.join(sorted(classes))})")
        return render(classes[name])

    def code(name):
        if name not in CODE_TABLES:
            raise ValueError(f"<!-- code:{name} --> names no table (known: {', '.join(CODE_TABLES)})")
        return markdown(CODE_TABLES[name]())

    def region(make, label):  # a region's sub(): (opening marker, names..., old text, closing marker)
        def sub(m):
            opening, *names, old, closing = m.groups()
            try:
                new = make(*names)
            except ValueError as e:
                raise ValueError(f"{source}: {e}") from None
            if old != new:
                changed.append(label(*names))
            return opening + new + closing
        return sub

    text = REGION.sub(region(keys, lambda name: name), text)
    text = CODE.sub(region(code, lambda name: "code:" + name), text)
    return TABLE.sub(region(lambda name, key: render_result(name, key, results),
                            lambda name, key: "table:" + name + (f"/{key}" if key else "")), text), changed


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true",
                   help="only report the regions that disagree with the code or results")
    args, classes = p.parse_args(argv), config_classes()
    stale = []
    for page in sorted(DOCS.glob("*.md")):
        new, changed = update(page.read_text(), classes, str(page))
        stale += [f"{page.relative_to(ROOT)}: {n if n.startswith(('table:', 'code:')) else 'keys:' + n}" for n in changed]
        if changed and not args.check:
            page.write_text(new)
    if args.check and stale:
        print("stale tables (run python -m train.docs): " + ", ".join(stale), file=sys.stderr)
        return 1
    if not args.check:
        print(f"rewrote {len(stale)} table(s)" + (": " + ", ".join(stale) if stale else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
