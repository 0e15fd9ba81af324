"""Pretrained weights in and out: one module per external format.

`load_pretrained(path, **kw)` looks at what `path` is and hands it to the format that claims it. Each format module
provides `detect(path) -> bool`, `load(path, **kw)` and, for export, `save(model, path, **kw)`; a family's default
format also `exports(model) -> bool`. A single-file format that any model of a family can be written to (GGUF;
ExecuTorch's .pte, export only) is chosen by the file name's suffix (`SUFFIXES`) instead; PEFT adapters are written
by peft_lora.save_adapter, a FLUX.2 transformer's LoRA in diffusers' file by diffusers_lora.
"""
from __future__ import annotations

import importlib
from pathlib import Path

from .files import check_weights, read_json

# Tried in order; the first whose detect() is true loads the path.
# Saving: the first whose exports(model) is true writes it (a Zoo folder for LLMs no external format holds).
FORMATS: list[str] = ["zoo.weights.quantized", "zoo.weights.peft_lora", "zoo.weights.taesd", "zoo.weights.diffusers_dit",
                      "zoo.weights.diffusers_flux2", "zoo.weights.zoo_folder", "zoo.weights.hf_llm",
                      "zoo.weights.hf_vlm", "zoo.weights.hf_vit", "zoo.weights.timm_convnet", "zoo.weights.timm_vit",
                      "zoo.weights.gguf_llm"]
# Saving to a path with one of these suffixes: that format, whatever the model family's default.
SUFFIXES: dict[str, str] = {".gguf": "zoo.weights.gguf_llm", ".pte": "zoo.weights.executorch_pte"}


def _modules():
    return [importlib.import_module(name) for name in FORMATS]


def load_pretrained(path, **kwargs):
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{path}: no such file or directory")
    if any((p / "adapter" / f).is_file() for f in ("adapter_config.json", "zoo_adapter.json")) \
            and not (p / "model.safetensors").is_file():
        p = p / "adapter"  # an adapter run's folder: its adapter on the base it names
    check_weights(p)  # truncated / corrupt files: a one-line error before any loader reads them
    for mod in _modules():
        if mod.detect(p):
            return mod.load(p, **kwargs)
    raise _unrecognised(path, p)


def _unrecognised(path, p: Path) -> Exception:
    """Why no format claims `path`: a run folder before its final weights, a training checkpoint (weights without
    config.yaml), a config.json that is not JSON, else the formats known."""
    if p.is_dir() and (p / "config.yaml").is_file() and not (p / "model.safetensors").is_file():
        return FileNotFoundError(f"{path}: config.yaml but no model.safetensors (a run writes it when it ends; "
                                 f"its checkpoints/ folders hold the weights before)")
    run_config = p.parent.parent / "config.yaml"
    if p.is_dir() and (p / "manifest.json").is_file() and run_config.is_file():
        return FileNotFoundError(f"{path}: a training checkpoint, no config.yaml beside its model.safetensors: copy "
                                 f"{run_config} (and the run's tokenizer) into it to load it")
    if p.is_dir() and (p / "config.json").is_file():
        try:
            read_json(p / "config.json")
        except ValueError as e:
            return e
    return ValueError(f"{path}: not a recognised pretrained format (known: {', '.join(FORMATS)})")


def save_pretrained(model, path, **kwargs):
    from ..adapters import adapter_modules, adapter_slots
    if any(not m.merged for m in adapter_modules(model).values()) or adapter_slots(model):
        raise ValueError("the model has adapters: save them with zoo.weights.peft_lora.save_adapter, or the "
                         "merged model with save_pretrained(zoo.adapters.merged_model(model), ...)")
    if by_suffix := SUFFIXES.get(Path(path).suffix.lower()):
        return importlib.import_module(by_suffix).save(model, path, **kwargs)
    for mod in _modules():
        if hasattr(mod, "exports") and mod.exports(model):
            return mod.save(model, path, **kwargs)
    raise ValueError(f"no exporter for a {type(model).__name__}")
