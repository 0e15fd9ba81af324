"""Zoo's own LLM format: a folder holding `config.yaml` (`family: llm` and a `model:` section) and `model.safetensors`
(Zoo's state-dict names), plus the tokenizer file when there is one.

Every LLM run folder is one, and `zoo.save_pretrained` writes one for an LLM no Hugging Face architecture holds
(hf_llm.holds: Mixture-of-Depths, ideas no one class has, a trained routing bias), so it loads with
`zoo.from_pretrained(folder)` and fine-tunes with `train.init_from=folder`. Every name and shape is checked first.
"""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Optional, Union

import torch
import yaml

from ..config import ConfigError, load_yaml, model_config_from, to_dict
from .files import atomic_write, load_tensors, mismatches, save_safetensors

CONFIG, WEIGHTS = "config.yaml", "model.safetensors"
TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json")


def _folder(path, weights: str = WEIGHTS) -> Path:
    p = Path(path)
    return p.parent if p.is_file() and p.name in (CONFIG, weights) else p


def folder_config(path, weights: str = WEIGHTS) -> Optional[dict]:
    """The mapping config.yaml holds in a folder (or beside a file of it) that holds it and `weights`, else None."""
    f = _folder(path, weights)
    if not (f.is_dir() and (f / CONFIG).is_file() and (f / weights).is_file()):
        return None
    try:
        data = yaml.safe_load((f / CONFIG).read_text())
    except (yaml.YAMLError, UnicodeDecodeError, OSError):
        return None
    return data if isinstance(data, dict) else None


def detect(path) -> bool:
    """A folder with config.yaml (family llm or vlm) and model.safetensors, and no Hugging Face config.json."""
    data = folder_config(path)
    return (data is not None and not (_folder(path) / "config.json").is_file()
            and data.get("family", "llm") in ("llm", "vlm") and isinstance(data.get("model"), dict))


def tokenizer_of(path) -> Optional[str]:
    """The tokenizer the folder's model was trained with: its file, 'bytes' per config.yaml, or None."""
    f = _folder(path)
    for name in TOKENIZER_FILES:
        if (f / name).is_file():
            return str(f / name)
    tok = (load_yaml(f / CONFIG).get("data") or {}).get("tokenizer")
    return "bytes" if tok == "bytes" else None


def load(path, dtype: Union[torch.dtype, str, None] = None, device: Union[torch.device, str, None] = None):
    """Build the LLM (or vision-language model) of config.yaml and load model.safetensors; dtype None keeps the
    file's."""
    from ..config import FAMILIES, LLMConfig, load_class, without_moved
    from .hf_llm import _resolve_dtype
    f = _folder(path)
    data = load_yaml(f / CONFIG)
    family, model = data.get("family", "llm"), data.get("model") or {}
    cfg = model_config_from(without_moved(LLMConfig, model) if family == "llm" else model, family, str(f / CONFIG))
    state = load_tensors(f / WEIGHTS)
    floats = [t.dtype for t in state.values() if t.is_floating_point()]
    dtype = floats[0] if dtype in (None, "auto") and floats else _resolve_dtype(dtype, {}, str(f / CONFIG))
    with torch.device(device or "cpu"):
        model = load_class(FAMILIES[family].model)(cfg)
    pre, text = ("", cfg) if family == "llm" else ("llm.", cfg.text)
    tied = {pre + a: pre + b for a, b in (("lm_head.weight", "embed.weight"), ("embed.weight", "lm_head.weight"))} \
        if text.tie_embeddings else {}
    state.update({k: state[other] for k, other in tied.items() if k not in state and other in state})  # stored once
    if problems := mismatches(state, model.state_dict(), limit=3):
        raise ValueError(f"{f / WEIGHTS}: weights do not match {f / CONFIG} ({text.n_layers} layers): {problems}")
    model.load_state_dict(state, strict=True)
    return cast_weights(model, dtype).eval()


def cast_weights(model, dtype: torch.dtype):
    """Cast the model's parameters to `dtype` in place (buffers stay float32); returns the model."""
    kept = {(m, n): b for m in model.modules() for n, b in m._buffers.items() if b is not None}
    model.to(dtype=dtype)
    for (m, n), b in kept.items():
        m._buffers[n] = b
    return model


def exports(model) -> bool:
    """An LLM no Hugging Face class holds (hf_llm.holds: Mixture-of-Depths, ideas no one class has, a trained
    routing bias where the class has none)."""
    from .hf_llm import holds
    model = getattr(model, "_orig_mod", model)
    return getattr(model, "family", None) == "llm" and bool(holds(model))


def save(model, path, tokenizer=None, **_) -> Path:
    """Write `model` (an LLM) as a Zoo folder: config.yaml, model.safetensors and, if given, the
    tokenizer file (tokenizer.model / tokenizer.json, or a folder holding one). Returns the folder."""
    model = getattr(model, "_orig_mod", model)
    if getattr(model, "family", None) != "llm":
        raise ValueError(f"a Zoo LLM folder holds LLMs, not a {type(model).__name__}")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    save_safetensors(model, out / WEIGHTS)
    return write_config(out, {"family": "llm", "model": to_dict(model.config)}, tokenizer)


def write_config(out: Path, data: dict, tokenizer=None) -> Path:
    """The folder's config.yaml (`data`, plus `data: {tokenizer: bytes}` for the bytes tokenizer) and
    its tokenizer file (copied from a file or a folder holding one). Returns the folder."""
    src = _tokenizer_file(tokenizer)
    if src is not None:
        shutil.copyfile(src, out / ("tokenizer.json" if src.suffix == ".json" else "tokenizer.model"))
    elif tokenizer == "bytes":
        data = {**data, "data": {"tokenizer": "bytes"}}
    atomic_write(out / CONFIG, yaml.safe_dump(data, sort_keys=False))
    return out


def _tokenizer_file(tokenizer) -> Optional[Path]:
    if tokenizer is None or tokenizer == "bytes":
        return None
    p = Path(tokenizer)
    if p.is_dir():
        for name in TOKENIZER_FILES:
            if (p / name).is_file():
                return p / name
        raise ConfigError(f"{p}: no {' or '.join(TOKENIZER_FILES)} in this folder")
    if not p.is_file():
        raise ConfigError(f"{p}: tokenizer file not found")
    return p
