"""Adapter folders in and out: PEFT's LoRA / DoRA and prompt tuning (adapter_config.json + adapter_model.safetensors),
Zoo's own for the methods PEFT has no format for, prefix and bottleneck (zoo_adapter.json + zoo_adapter.safetensors).

    model = zoo.from_pretrained("runs/x/adapter")                  # base from base_model_name_or_path
    model = zoo.from_pretrained("adapter/", base="path/to/hf_llm")  # or named here
    zoo.from_pretrained("other/", base=model, adapter_name="b")    # another LoRA adapter on the same model
    save_adapter(model, "out/adapter", base="path/to/hf_llm")

Key names are PEFT's (`zoo.adapters.lora_sites` maps them; Zoo's format: the state-dict names); a config asking for
anything Zoo computes differently is refused with an error naming the key.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch

from ..adapters import AdapterConfig, adapter_modules, adapter_slots, apply_adapters, lora_sites, peft_target
from ..config import from_dict, to_dict
from .files import atomic_write, load_tensors, mismatches, read_json, save_safetensors
from .hf_llm import inverse, record_for, row_orders
from .hf_vlm import CONNECTOR, VISION, text_name

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
ZOO_CONFIG, ZOO_WEIGHTS = "zoo_adapter.json", "zoo_adapter.safetensors"
PREFIX = "base_model.model."
VISION_MODULES = (VISION, CONNECTOR.rsplit(".", 2)[0])  # a VLM's encoder and connector: adapter.vision_targets

# adapter_config.json keys whose value must be the default for Zoo to compute what PEFT does
_MUST_BE = {"bias": ("none",), "fan_in_fan_out": (False, None), "modules_to_save": (None, []),
            "rank_pattern": ({}, None), "alpha_pattern": ({}, None), "layers_to_transform": (None,),
            "layer_replication": (None,), "use_qalora": (False, None), "lora_bias": (False, None),
            "target_parameters": (None, []), "trainable_token_indices": (None,), "use_bdlora": (None, False),
            "alora_invocation_tokens": (None,), "exclude_modules": (None, [])}


def detect(path) -> bool:
    p = Path(path)
    return (p / CONFIG).is_file() or (p / ZOO_CONFIG).is_file() if p.is_dir() else p.name in (CONFIG, ZOO_CONFIG)


def files(folder: Path) -> tuple[Path, Path]:
    """The folder's (config, weights): PEFT's or Zoo's."""
    return (folder / CONFIG, folder / WEIGHTS) if (folder / CONFIG).is_file() else \
        (folder / ZOO_CONFIG, folder / ZOO_WEIGHTS)


def read_config(folder: Path) -> AdapterConfig:
    """adapter_config.json (or zoo_adapter.json) -> AdapterConfig; anything Zoo would compute differently is an error."""
    src = files(folder)[0]
    hf = read_json(src)
    if src.name == ZOO_CONFIG:
        return from_dict(AdapterConfig, hf.get("adapter") or {}, str(src), "adapter.")
    if hf.get("peft_type") == "PROMPT_TUNING":
        if hf.get("task_type") != "CAUSAL_LM" or hf.get("num_transformer_submodules", 1) not in (1, None):
            raise ValueError(f"{src}: prompt tuning of task_type={hf.get('task_type')!r} is not supported (CAUSAL_LM)")
        return AdapterConfig(method="prompt", prefix_len=int(hf["num_virtual_tokens"]))
    return lora_config(hf, src)


def lora_config(hf: dict, src) -> AdapterConfig:
    """A PEFT LoraConfig's fields -> AdapterConfig; anything Zoo would compute differently is an error naming `src`."""
    if hf.get("peft_type") != "LORA":
        raise ValueError(f"{src}: peft_type={hf.get('peft_type')!r} is not supported (LORA, with use_dora for DoRA; "
                         f"PROMPT_TUNING)")
    for k, ok in _MUST_BE.items():
        if k in hf and hf[k] not in ok:
            raise ValueError(f"{src}: {k}={hf[k]!r} is not supported (supported: {ok[0]!r})")
    targets = hf.get("target_modules")
    if isinstance(targets, str) or not targets:
        raise ValueError(f"{src}: target_modules={targets!r} must be a list of module names")
    vision = {t for t in targets if t.startswith(VISION_MODULES)}  # a VLM's modules, named in full
    try:
        return AdapterConfig(method="dora" if hf.get("use_dora") else "lora", r=int(hf["r"]),
                             alpha=float(hf.get("lora_alpha", 8)), dropout=float(hf.get("lora_dropout", 0.0)),
                             targets=sorted({peft_target(t) for t in targets if t not in vision}),
                             vision_targets=sorted({peft_target(t) for t in vision}),
                             rslora=bool(hf.get("use_rslora", False)),
                             init="gaussian" if hf.get("init_lora_weights") == "gaussian" else "kaiming")
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{src}: r / lora_alpha / lora_dropout unreadable ({e})") from None


def base_of(folder) -> Optional[str]:
    """base_model_name_or_path of an adapter folder."""
    return read_json(files(Path(folder))[0]).get("base_model_name_or_path")


def load(path, base=None, dtype=None, device=None, adapter_name: str = "default", **kw):
    """Load the adapter folder `path` onto its base model (`base`: a folder or a loaded Zoo model, which may hold
    LoRA adapters already: this one joins them as `adapter_name`; default: base_model_name_or_path of the folder's
    config). Returns the model in eval mode with the adapters unmerged (merge with zoo.adapters.merge_adapters)."""
    import zoo
    folder = Path(path)
    folder = folder.parent if folder.is_file() else folder
    cfg, (config, weights) = read_config(folder), files(folder)
    if base is None:
        base = base_of(folder)
        if not base or not Path(base).exists():
            raise ValueError(f"{config}: base_model_name_or_path={base!r} is not a local folder; "
                             f"pass base=<folder of the base model>")
    model = base if isinstance(base, torch.nn.Module) else zoo.from_pretrained(base, dtype=dtype, device=device, **kw)
    apply_adapters(model, cfg, str(config), name=adapter_name)
    load_adapter_weights(model, weights, adapter_name)
    return model.eval()


def peft_names(model, name: Optional[str] = None) -> dict[tuple[str, str], str]:
    """(Zoo LoRALinear name, part) -> PEFT module name, for the parts the adapter `name` (default: the active) adapts."""
    mods, name = adapter_modules(model), name or model.active_adapter
    return {(site, part): hf for site, parts in lora_sites(model).items()
            if site in mods and name in mods[site].adapters for part, _, hf in parts
            if part in mods[site].adapters[name].adapted}


def adapter_state(model, to_file: bool = False, name: Optional[str] = None) -> dict[str, torch.Tensor]:
    """The adapter `name` (default: the active) of `model` under its file's key names: Zoo's own tensors, or with
    `to_file` as the file holds them (the rows of a module whose RoPE channels the base's file interleaves, in its
    order)."""
    orders = file_orders(model) if to_file else {}
    return {k: t[inverse(orders[hf])] if hf in orders else t for k, (hf, t) in _adapter_tensors(model, name).items()}


def _adapter_tensors(model, name: Optional[str] = None) -> dict[str, tuple[str, torch.Tensor]]:
    """File key -> (the base file's weight name where the tensor runs over its module's output rows, else '';
    Zoo's tensor)."""
    name = name or model.active_adapter
    method = model.adapter_configs[name].method
    if method == "prompt":
        return {"prompt_embeddings": ("", model.prompt.weight)}
    if method not in ("lora", "dora"):  # Zoo's format: the adapters' parameters under their state-dict names
        ids = {id(p) for _, _, m in adapter_slots(model) for p in m.parameters()}
        return {k: ("", p) for k, p in model.named_parameters() if id(p) in ids}
    mods = adapter_modules(model)
    state = {}
    for (site, part), hf in peft_names(model, name).items():
        lora = mods[site].adapters[name]
        state[f"{PREFIX}{hf}.lora_A.weight"] = "", lora.lora_A[part]
        state[f"{PREFIX}{hf}.lora_B.weight"] = hf + ".weight", lora.lora_B[part]
        if lora.dora:
            state[f"{PREFIX}{hf}.lora_magnitude_vector"] = hf + ".weight", lora.magnitude[part]
    return state


def file_orders(model) -> dict:
    """The base file's tensor name -> Zoo's order of its rows (hf_llm.row_orders), for the Hugging Face class
    an LLM exports as (a VLM: its decoder's, under the VLM file's names); {} for other models."""
    if getattr(model, "family", None) == "vlm":
        return {text_name(k): v for k, v in file_orders(model.llm).items()}
    if getattr(model, "family", None) != "llm":
        return {}
    try:
        rec = record_for(model.config, getattr(model, "hf_architecture", None))
    except ValueError:
        return {}
    return row_orders(model.config, rec, getattr(model, "hf_config", None))


@torch.no_grad()
def load_adapter_weights(model, path: Path, name: Optional[str] = None, found: Optional[dict] = None):
    """Read the adapter tensors of `path` (or `found`, read from it, under PEFT's key names) into the adapter `name`
    of `model`; any mismatch is one error naming the file. With `found` given, a LoRA module it leaves out keeps
    its A and gets B = 0: it adds nothing (diffusers' files adapt the modules they list)."""
    expected, partial = adapter_state(model, name=name), found is not None
    found = load_tensors(path) if found is None else found
    module = lambda k: k.rsplit(".lora_", 1)[0]  # noqa: E731
    listed = {module(k) for k in found}
    if problems := mismatches(found, {k: v for k, v in expected.items() if not partial or module(k) in listed},
                              limit=4):
        raise ValueError(f"{path}: does not match {'the adapter' if partial else files(path.parent)[0].name} and "
                         f"the base model: {problems}")
    orders = file_orders(model)
    for k, (hf, t) in _adapter_tensors(model, name).items():
        if k in found:
            t.copy_(found[k][orders[hf]] if hf in orders else found[k])
        elif ".lora_B." in k:
            t.zero_()


def save_adapter(model, path, base: Optional[str] = None, dtype: Optional[torch.dtype] = None) -> Path:
    """Write the active adapter of `model` as a PEFT folder (adapter_config.json, adapter_model.safetensors), or
    for prefix and bottleneck adapters, which PEFT has no format for, as Zoo's (zoo_adapter.json and .safetensors)."""
    model = getattr(model, "_orig_mod", model)
    cfg: AdapterConfig = getattr(model, "adapter_config", None)
    if cfg is None:
        raise ValueError("save_adapter: the model has no adapters")
    if any(m.merged for m in adapter_modules(model).values()):
        raise ValueError("save_adapter: unmerge the adapters first")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu", dtype or v.dtype).contiguous().clone()
             for k, v in adapter_state(model, to_file=True).items()}
    base = str(Path(base).resolve()) if base else None
    if cfg.method in ("prefix", "bottleneck"):
        save_safetensors(state, out / ZOO_WEIGHTS)
        atomic_write(out / ZOO_CONFIG, json.dumps({"base_model_name_or_path": base, "adapter": to_dict(cfg)},
                                                  indent=2) + "\n")
        return out
    save_safetensors(state, out / WEIGHTS)
    hf = {"task_type": "CAUSAL_LM" if getattr(model, "family", None) == "llm" else None,
          "base_model_name_or_path": base, "inference_mode": True}
    if cfg.method == "prompt":
        c = model.config
        hf.update(peft_type="PROMPT_TUNING", num_virtual_tokens=cfg.prefix_len, token_dim=c.d_model,
                  num_transformer_submodules=1, num_attention_heads=c.n_heads, num_layers=c.n_layers,
                  prompt_tuning_init="SAMPLE_VOCAB")
    else:  # a VLM's modules named in full: PEFT matches a short name in the encoder too (q_proj, k_proj, v_proj)
        names = peft_names(model).values()
        hf.update(lora_fields(cfg, set(names) if getattr(model, "family", None) == "vlm" else
                              {peft_target(n) for n in names}))
    atomic_write(out / CONFIG, json.dumps(hf, indent=2) + "\n")
    return out


def lora_fields(cfg: AdapterConfig, targets) -> dict:
    """The PEFT LoraConfig fields of a LoRA / DoRA adapter with these target_modules."""
    return dict(peft_type="LORA", r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                target_modules=sorted(targets), use_dora=cfg.method == "dora", use_rslora=cfg.rslora, bias="none",
                fan_in_fan_out=False, init_lora_weights=True if cfg.init == "kaiming" else cfg.init,
                modules_to_save=None, rank_pattern={}, alpha_pattern={})
