"""timm / torchvision ResNet weights in and out.

Zoo's ResNet uses their parameter names (conv1, bn1, layer1.0.conv1, ..., downsample.0/1, fc),
so the key map is the identity; this module reads the file, infers the architecture from the
keys, checks every key and shape, and writes the same layout back.

    model = zoo.from_pretrained("resnet50.pth")                     # arch inferred from the keys
    model = zoo.from_pretrained("resnet50.safetensors", arch="resnet50", num_classes=10)
    zoo.save_pretrained(model, "out/resnet50.safetensors")          # or .pth, or a folder

Accepted files: .safetensors, or .pth/.pt/.bin/.ckpt read with torch.load(weights_only=True)
(a bare state dict, or one wrapped as {"state_dict": ...} / {"model": ...}, "module." prefixes
stripped), or a folder holding model.safetensors or pytorch_model.bin (timm's hub layout).
"""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch

from ..config import RESNET_ARCHS, ConvNetConfig, from_dict, to_dict
from .files import atomic_write, load_tensors, read_safetensors_header, save_safetensors

SUFFIXES = (".safetensors", ".pth", ".pt", ".bin", ".ckpt")
FOLDER_FILES = ("model.safetensors", "pytorch_model.bin")


def weight_file(path) -> Path | None:
    p = Path(path)
    if p.is_dir():
        return next((p / n for n in FOLDER_FILES if (p / n).is_file()), None)
    return p if p.is_file() and p.suffix.lower() in SUFFIXES else None


def read_state_dict(path) -> dict:
    """The tensors of a ResNet weight file or folder (CPU, memory-mapped where possible), checked
    (zoo.weights.files.load_tensors), with DataParallel's "module." prefixes stripped."""
    f = weight_file(path)
    if f is None:
        raise FileNotFoundError(f"{path}: no ResNet weight file ({', '.join(SUFFIXES)} or a folder with "
                                f"{' / '.join(FOLDER_FILES)})")
    return {(k[7:] if k.startswith("module.") else k): v for k, v in load_tensors(f).items()}


def _keys(f: Path) -> set:
    if f.suffix.lower() == ".safetensors":
        return set(read_safetensors_header(f)[0])  # the header only
    return set(read_state_dict(f))


def detect(path) -> bool:
    """A ResNet state dict: a conv1 stem and layer1.0.conv1 / bn1 / conv2 keys (not TAESD, not an HF LLM)."""
    f = weight_file(path)
    if f is None:
        return False
    try:
        keys = _keys(f)
    except Exception:
        return False
    return ({"layer1.0.conv1.weight", "layer1.0.bn1.weight", "layer1.0.conv2.weight"} <= keys
            and any(k.startswith("conv1.") for k in keys))


def config_from_state_dict(sd: dict, arch: str | None = None, source: str = "<state dict>", **overrides) -> ConvNetConfig:
    """Infer a ConvNetConfig from ResNet keys: depth from the blocks per stage, bottleneck from conv3,
    groups / width from conv2, stem from the conv1 kernel, in_chans and num_classes from shapes.
    With `arch`, the preset fixes block, depths, groups and width; a mismatch shows when loading."""
    if "conv1.0.weight" in sd:
        raise ValueError(f"{source}: deep stem (conv1.0/conv1.3/conv1.6, timm's resnet*c/d/t variants) "
                         "is not supported; only the plain conv1 stem is")
    if "conv1.weight" not in sd or "layer1.0.conv1.weight" not in sd:
        raise ValueError(f"{source}: not a ResNet state dict (no conv1.weight / layer1.0.conv1.weight)")
    stem_w = sd["conv1.weight"]
    if stem_w.ndim != 4 or stem_w.shape[-1] not in (3, 7):
        raise ValueError(f"{source}: conv1.weight has shape {tuple(stem_w.shape)}; expected a 7x7 (imagenet) "
                         "or 3x3 (small) stem conv")
    width, in_chans = stem_w.shape[0], stem_w.shape[1]
    cfg = dict(width=width, in_chans=in_chans, stem="imagenet" if stem_w.shape[-1] == 7 else "small")
    if "fc.weight" in sd:
        cfg["num_classes"] = sd["fc.weight"].shape[0]
    if arch is not None:
        if arch not in RESNET_ARCHS:
            raise ValueError(f"{source}: unknown arch {arch!r} (known: {', '.join(RESNET_ARCHS)})")
        cfg["arch"] = arch
    else:
        depths = []
        while any(k.startswith(f"layer{len(depths) + 1}.") for k in sd):
            i = len(depths) + 1
            depths.append(len({k.split(".")[1] for k in sd if k.startswith(f"layer{i}.") and k.endswith(".conv1.weight")}))
        block = "bottleneck" if "layer1.0.conv3.weight" in sd else "basic"
        groups, wpg = 1, 64
        if block == "bottleneck":
            c2 = sd["layer1.0.conv2.weight"]  # (group width, group width / groups, 3, 3)
            groups = c2.shape[0] // c2.shape[1]
            wpg = c2.shape[0] // groups * 64 // width
        match = [n for n, a in RESNET_ARCHS.items() if a == (block, depths, groups, wpg)]
        if match:
            cfg["arch"] = match[0]
        else:
            cfg.update(arch="resnet50" if block == "bottleneck" else "resnet18", block=block, layers=depths,
                       groups=groups, width_per_group=wpg)
    cfg.update(overrides)
    return from_dict(ConvNetConfig, cfg, source, "")


def load_into(model, sd: dict, source: str = "<state dict>") -> None:
    """Copy a timm/torchvision-layout state dict into a zoo ResNet. Missing, unexpected and
    mis-shaped keys are one error listing them; a classifier of another size (or none) leaves
    the model's own freshly initialised head, with a warning."""
    own = model.state_dict()
    sd = dict(sd)
    head = [k for k in ("fc.weight", "fc.bias") if k in own]
    if any(k not in sd or sd[k].shape != own[k].shape for k in head):
        got = f"classifier {tuple(sd['fc.weight'].shape)}" if "fc.weight" in sd else "no classifier in the file;"
        warnings.warn(f"{source}: {got} replaced by a new {model.config.num_classes}-class head "
                      f"(fc is freshly initialised; train it)", stacklevel=3)
        for k in head:
            sd.pop(k, None)
            sd[k] = own[k]
    tracked = ".num_batches_tracked"
    missing = [k for k in own if k not in sd and not k.endswith(tracked)]
    unexpected = [k for k in sd if k not in own]
    shapes = [f"{k} {tuple(sd[k].shape)} vs {tuple(own[k].shape)}" for k in own
              if k in sd and sd[k].shape != own[k].shape]
    if missing or unexpected or shapes:
        parts = []
        for name, items in (("missing", missing), ("unexpected", unexpected), ("mis-shaped (file vs model)", shapes)):
            if items:
                parts.append(f"{len(items)} {name}: {', '.join(items[:8])}{', ...' if len(items) > 8 else ''}")
        raise ValueError(f"{source}: weights do not fit {model.config.arch}-style ResNet "
                         f"(layers={model.config.resolved_layers}, block={model.config.resolved_block}): {'; '.join(parts)}")
    model.load_state_dict(sd, strict=False)


def load(path, arch: str | None = None, num_classes: int | None = None, **overrides):
    """A zoo ResNet (eval mode) with the weights of `path`; see the module docstring. The model
    remembers the file name it came from (`pretrained_format`), so that save() to a folder writes
    it back in the same file type."""
    from ..convnet import ResNet
    sd = read_state_dict(path)
    if num_classes is not None:
        overrides["num_classes"] = num_classes
    cfg = config_from_state_dict(sd, arch, str(path), **overrides)
    model = ResNet(cfg)
    load_into(model, sd, str(path))
    f = weight_file(path)
    model.pretrained_format = {"format": "resnet", "layout": "folder" if Path(path).is_dir() else "file",
                               "file": f.name}
    return model.eval()


def exports(model) -> bool:
    from ..convnet import ResNet
    return isinstance(model, ResNet)


def save(model, path, **kwargs) -> Path:
    """Write the timm/torchvision key layout: a path ending .safetensors, or .pth/.pt/.bin
    (torch.save), is that file. Any other path is a folder: a model loaded from a single file
    goes back as that file's name inside it (resnet50.pth -> folder/resnet50.pth); otherwise the
    folder gets model.safetensors (or the weight file it was loaded with) and a config.json with
    the zoo config. Returns the weight file written."""
    if kwargs:
        raise TypeError(f"save_pretrained for a ResNet takes no options, got {', '.join(kwargs)}")
    p = Path(path)
    sd = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    if p.suffix.lower() not in SUFFIXES:  # a folder
        source = getattr(model, "pretrained_format", None) or {}
        if source.get("layout") == "file":
            p = p / source["file"]
        else:
            cfg = {"architecture": model.config.arch, "num_classes": model.config.num_classes,
                   "zoo": to_dict(model.config)}
            atomic_write(p / "config.json", json.dumps(cfg, indent=2))
            p = p / source.get("file", "model.safetensors")
    if p.suffix.lower() == ".safetensors":
        save_safetensors(sd, p, {"arch": model.config.arch})
    else:
        atomic_write(p, lambda t: torch.save(sd, t))
    return p
