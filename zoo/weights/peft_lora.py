"""PEFT LoRA / DoRA adapter folders in and out (adapter_config.json + adapter_model.safetensors).

    model = zoo.from_pretrained("runs/x/adapter")                  # base from base_model_name_or_path
    model = zoo.from_pretrained("adapter/", base="path/to/hf_llm")  # or named here
    save_adapter(model, "out/adapter", base="path/to/hf_llm")

Key names are PEFT's (`zoo.adapters.lora_sites` maps them); a config asking for anything LoRALinear computes
differently is refused with an error naming the key.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch

from ..adapters import AdapterConfig, adapter_modules, apply_adapters, lora_sites
from ..blocks.lora import LoRALinear
from .files import atomic_write, load_tensors, mismatches, read_json, save_safetensors
from .hf_llm import inverse, record_for, row_orders

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."

# adapter_config.json keys whose value must be the default for Zoo to compute what PEFT does
_MUST_BE = {"bias": ("none",), "fan_in_fan_out": (False, None), "modules_to_save": (None, []),
            "rank_pattern": ({}, None), "alpha_pattern": ({}, None), "layers_to_transform": (None,),
            "layer_replication": (None,), "use_qalora": (False, None), "lora_bias": (False, None),
            "target_parameters": (None, []), "trainable_token_indices": (None,), "use_bdlora": (None, False),
            "alora_invocation_tokens": (None,), "exclude_modules": (None, [])}


def detect(path) -> bool:
    p = Path(path)
    return (p / CONFIG).is_file() if p.is_dir() else p.name == CONFIG


def read_config(folder: Path) -> AdapterConfig:
    """adapter_config.json -> AdapterConfig; anything Zoo would compute differently is an error."""
    src = folder / CONFIG
    hf = read_json(src)
    if hf.get("peft_type") != "LORA":
        raise ValueError(f"{src}: peft_type={hf.get('peft_type')!r} is not supported (LORA, with use_dora for DoRA)")
    for k, ok in _MUST_BE.items():
        if k in hf and hf[k] not in ok:
            raise ValueError(f"{src}: {k}={hf[k]!r} is not supported (supported: {ok[0]!r})")
    targets = hf.get("target_modules")
    if isinstance(targets, str) or not targets:
        raise ValueError(f"{src}: target_modules={targets!r} must be a list of module names")
    try:
        return AdapterConfig(method="dora" if hf.get("use_dora") else "lora", r=int(hf["r"]),
                             alpha=float(hf.get("lora_alpha", 8)), dropout=float(hf.get("lora_dropout", 0.0)),
                             targets=sorted(targets), rslora=bool(hf.get("use_rslora", False)),
                             init="gaussian" if hf.get("init_lora_weights") == "gaussian" else "kaiming")
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{src}: r / lora_alpha / lora_dropout unreadable ({e})") from None


def load(path, base=None, dtype=None, device=None, **kw):
    """Load the adapter folder `path` onto its base model (`base`: a folder or a loaded Zoo model;
    default: base_model_name_or_path of adapter_config.json). Returns the model in eval mode with
    the adapters unmerged (merge with zoo.adapters.merge_adapters)."""
    import zoo
    folder = Path(path)
    folder = folder.parent if folder.is_file() else folder
    cfg = read_config(folder)
    if base is None:
        base = read_json(folder / CONFIG).get("base_model_name_or_path")
        if not base or not Path(base).exists():
            raise ValueError(f"{folder / CONFIG}: base_model_name_or_path={base!r} is not a local folder; "
                             f"pass base=<folder of the base model>")
    model = base if isinstance(base, torch.nn.Module) else zoo.from_pretrained(base, dtype=dtype, device=device, **kw)
    apply_adapters(model, cfg, str(folder / CONFIG))
    load_adapter_weights(model, folder / WEIGHTS)
    return model.eval()


def peft_names(model) -> dict[tuple[str, str], str]:
    """(Zoo LoRALinear name, part) -> PEFT module name, for the adapted parts."""
    mods = adapter_modules(model)
    return {(name, part): hf for name, parts in lora_sites(model).items() if name in mods
            for part, _, hf in parts if part in mods[name].adapted}


def adapter_state(model, to_file: bool = False) -> dict[str, torch.Tensor]:
    """The adapters of `model` under PEFT's key names: Zoo's own tensors, or with `to_file` as the file
    holds them (the rows of a module whose RoPE channels the base's file interleaves, in its order)."""
    orders = file_orders(model) if to_file else {}
    return {k: t[inverse(orders[hf])] if hf in orders else t for k, (hf, t) in _adapter_tensors(model).items()}


def _adapter_tensors(model) -> dict[str, tuple[str, torch.Tensor]]:
    """PEFT key -> (the base file's weight name where the tensor runs over its module's output rows, else '';
    Zoo's tensor)."""
    mods = adapter_modules(model)
    state = {}
    for (name, part), hf in peft_names(model).items():
        m: LoRALinear = mods[name]
        state[f"{PREFIX}{hf}.lora_A.weight"] = "", m.lora_A[part]
        state[f"{PREFIX}{hf}.lora_B.weight"] = hf + ".weight", m.lora_B[part]
        if m.dora:
            state[f"{PREFIX}{hf}.lora_magnitude_vector"] = hf + ".weight", m.magnitude[part]
    return state


def file_orders(model) -> dict:
    """The base file's tensor name -> Zoo's order of its rows (hf_llm.row_orders), for the Hugging Face class
    an LLM exports as; {} for other models."""
    if getattr(model, "family", None) != "llm":
        return {}
    try:
        rec = record_for(model.config, getattr(model, "hf_architecture", None))
    except ValueError:
        return {}
    return row_orders(model.config, rec, getattr(model, "hf_config", None))


@torch.no_grad()
def load_adapter_weights(model, path: Path):
    """Read PEFT-named adapter tensors into `model`; any mismatch is one error naming the file."""
    found = load_tensors(path)
    if problems := mismatches(found, adapter_state(model), limit=4):
        raise ValueError(f"{path}: does not match adapter_config.json and the base model: {problems}")
    orders = file_orders(model)
    for k, (hf, t) in _adapter_tensors(model).items():
        t.copy_(found[k][orders[hf]] if hf in orders else found[k])


def save_adapter(model, path, base: Optional[str] = None, dtype: Optional[torch.dtype] = None) -> Path:
    """Write the adapters of `model` as a PEFT folder (adapter_config.json, adapter_model.safetensors)."""
    model = getattr(model, "_orig_mod", model)
    cfg: AdapterConfig = getattr(model, "adapter_config", None)
    if cfg is None or cfg.method not in ("lora", "dora"):
        raise ValueError("save_adapter: the model has no LoRA/DoRA adapters (PEFT's format holds those)")
    if any(m.merged for m in adapter_modules(model).values()):
        raise ValueError("save_adapter: unmerge the adapters first")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu", dtype or v.dtype).contiguous().clone()
             for k, v in adapter_state(model, to_file=True).items()}
    save_safetensors(state, out / WEIGHTS)
    targets = sorted({part for _, part in peft_names(model)})
    hf = {"peft_type": "LORA", "task_type": "CAUSAL_LM" if getattr(model, "family", None) == "llm" else None,
          "base_model_name_or_path": str(Path(base).resolve()) if base else None,
          "r": cfg.r, "lora_alpha": cfg.alpha, "lora_dropout": cfg.dropout, "target_modules": targets,
          "use_dora": cfg.method == "dora", "use_rslora": cfg.rslora, "bias": "none", "fan_in_fan_out": False,
          "init_lora_weights": True if cfg.init == "kaiming" else cfg.init, "modules_to_save": None,
          "rank_pattern": {}, "alpha_pattern": {}, "inference_mode": True}
    atomic_write(out / CONFIG, json.dumps(hf, indent=2) + "\n")
    return out
