"""Zoo: efficient reference implementations of LLMs, ConvNets and latent diffusion models.

    model = zoo.build("configs/llm/tiny.yaml", n_layers=2)
    model = zoo.from_pretrained("path/to/hf_checkpoint")
    zoo.save_pretrained(model, "out/")
    model = zoo.quantize(model, "int4wo")     # int8wo, int4wo, 8da4w; a ConvNet: "int8", calibration= (torchao)
    masks = zoo.prune(model, "2:4")           # magnitude pruning of the linears: "unstructured" or "N:M"
"""
from __future__ import annotations

from pathlib import Path

from .config import FAMILIES, ConfigError, load_class, load_yaml, model_config_from, to_dict

__all__ = ["build", "from_pretrained", "save_pretrained", "quantize", "prune", "ConfigError", "FAMILIES"]


def build(config, **overrides):
    """Build a model from a YAML path (a full run config or just the model keys), a dict, or a model
    config dataclass. Keyword overrides replace model keys: build("tiny.yaml", n_layers=2)."""
    prefix = "model."
    if isinstance(config, (str, Path)):
        source, data = str(config), load_yaml(config)
        family = data.get("family", "llm")
        if "model" in data:
            data = data["model"]
        elif any(k in data for k in ("train", "data", "optim")):
            data = {}
        model_data = dict(data or {})
    elif isinstance(config, dict):
        source, family = "<dict>", config.get("family", "llm")
        model_data = dict(config.get("model", {k: v for k, v in config.items() if k != "family"}))
    else:
        family = next((name for name, fam in FAMILIES.items() if type(config) is fam.config), None)
        if family is None:
            raise ConfigError(f"not a model config: {type(config).__name__}")
        if not overrides:
            return load_class(FAMILIES[family].model)(config)
        source, prefix, model_data = "<overrides>", "", to_dict(config)
    cfg = model_config_from({**model_data, **overrides}, family, source, prefix)
    return load_class(FAMILIES[family].model)(cfg)


def from_pretrained(path, **kwargs):
    """Load pretrained weights from a Hugging Face folder or another supported file; a PEFT LoRA /
    DoRA adapter folder loads onto its base (`base=` or its base_model_name_or_path)."""
    from .weights import load_pretrained
    return load_pretrained(path, **kwargs)


def save_pretrained(model, path, **kwargs):
    """Write a model back in the format its family's pretrained weights come in."""
    from .weights import save_pretrained as _save
    return _save(model, path, **kwargs)


def quantize(model, scheme: str, group_size: int = 32, keep=("embed", "lm_head"), calibration=None):
    """Quantize a model for inference through torchao and return it: an LLM's linears in place
    (`int8wo`, `int4wo`, `8da4w`; `keep` stays 16-bit), or a ConvNet as a new static `int8` module
    calibrated on `calibration` (zoo/quantization.py)."""
    from .quantization import CONVNET_SCHEMES, quantize as _quantize, quantize_convnet
    if scheme in CONVNET_SCHEMES:
        if calibration is None:
            raise ValueError(f"scheme {scheme!r}: calibration= (image batches) is required")
        return quantize_convnet(model, calibration, scheme)
    return _quantize(model, scheme, group_size, keep)


def prune(model, pattern: str = "unstructured", sparsity: float = 0.5, keep=("embed", "lm_head")) -> dict:
    """Magnitude-prune the model's linears outside `keep` in place (`unstructured` or `N:M` such as
    "2:4"); returns the masks that zoo.pruning.apply_masks re-applies after each optimizer step."""
    from .pruning import prune as _prune
    return _prune(model, pattern, sparsity, keep)
