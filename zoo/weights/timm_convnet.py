"""timm weights in and out for the ConvNets: ResNet (and torchvision's), ConvNeXt V1 / V2 (and torchvision's V1),
EfficientNet, MobileNetV3.

Zoo uses timm's parameter names; this module reads the file, infers the architecture from the keys (or checks the timm
name given), checks every name and shape, and writes the same layout back.

    model = zoo.from_pretrained("resnet50.pth")                     # arch inferred from the keys
    model = zoo.from_pretrained("convnext_tiny.safetensors", arch="convnext_tiny", num_classes=10)
    zoo.save_pretrained(model, "out/model.safetensors")             # or .pth, or a folder
"""
from __future__ import annotations

import json
import math
import re
import warnings
from pathlib import Path

import torch

from ..config import (CONVNET_KINDS, CONVNEXT_ARCHS, RESNET_ARCHS, ConfigError, ConvNetConfig, ViTConfig, from_dict,
                      to_dict)
from .files import (WEIGHT_SUFFIXES as SUFFIXES, atomic_write, load_tensors, read_json, read_safetensors_header,
                    save_safetensors)

FOLDER_FILES = ("model.safetensors", "pytorch_model.bin")


def weight_file(path) -> Path | None:
    p = Path(path)
    if p.is_dir():
        return next((p / n for n in FOLDER_FILES if (p / n).is_file()), None)
    return p if p.is_file() and p.suffix.lower() in SUFFIXES else None


def read_state_dict(path, timm_names: bool = True) -> dict:
    """The tensors of a ConvNet weight file or folder (CPU, memory-mapped where possible), checked
    (zoo.weights.files.load_tensors), with DataParallel's "module." prefixes stripped and torchvision's ConvNeXt
    names made timm's (unless timm_names=False)."""
    f = weight_file(path)
    if f is None:
        raise FileNotFoundError(f"{path}: no ConvNet weight file ({', '.join(SUFFIXES)} or a folder with "
                                f"{' / '.join(FOLDER_FILES)})")
    sd = {(k[7:] if k.startswith("module.") else k): v for k, v in load_tensors(f).items()}
    return renamed(sd) if timm_names and is_torchvision_convnext(sd) else sd


# torchvision's ConvNeXt names <-> timm's, as templates: feature f = 2s + 1 holds stage s's blocks, feature d = 2s its
# downsampling (s >= 1); a block's layer scale (C, 1, 1) is timm's gamma (C,)
CONVNEXT_NAMES = [("features.0.{i}.", "stem.{i}."), ("features.{f}.{b}.layer_scale", "stages.{s}.blocks.{b}.gamma"),
                  *((f"features.{{f}}.{{b}}.block.{i}.", f"stages.{{s}}.blocks.{{b}}.{part}.")
                    for i, part in (("0", "conv_dw"), ("2", "norm"), ("3", "mlp.fc1"), ("5", "mlp.fc2"))),
                  ("features.{d}.{i}.", "stages.{s}.downsample.{i}."), ("classifier.0.", "head.norm."),
                  ("classifier.2.", "head.fc.")]


def _convnext_name(name: str, to_timm: bool) -> str:
    """A torchvision ConvNeXt name as timm's (to_timm) or back; other names unchanged."""
    for tv, timm in CONVNEXT_NAMES:
        src, dst = (tv, timm) if to_timm else (timm, tv)
        pattern = "^" + re.sub(r"\\{(\w)\\}", r"(?P<\1>\\d+)", re.escape(src))
        if m := re.match(pattern + ("$" if not src.endswith(".") else ""), name):
            n = {k: int(v) for k, v in m.groupdict().items()}
            n["s"] = n["s"] if "s" in n else n.get("f", n.get("d", 0)) // 2
            return dst.format(**{**n, "f": 2 * n["s"] + 1, "d": 2 * n["s"]}) + name[m.end():]
    return name


def is_torchvision_convnext(keys) -> bool:
    return {"features.0.0.weight", "features.1.0.block.0.weight", "features.1.0.layer_scale"} <= set(keys)


def renamed(sd: dict, to_timm: bool = True) -> dict:
    """A ConvNeXt state dict under timm's names from torchvision's (or back), layer scales reshaped."""
    out = {}
    for k, v in sd.items():
        name = _convnext_name(k, to_timm)
        out[name] = v.flatten() if name.endswith(".gamma") else v.view(-1, 1, 1) if name.endswith("layer_scale") else v
    return out


# what tells each kind's keys apart (all of them present)
SIGNATURES = {
    "resnet": ("layer1.0.conv1.weight", "layer1.0.bn1.weight", "layer1.0.conv2.weight"),  # + a conv1 stem
    "convnext": ("stem.0.weight", "stages.0.blocks.0.conv_dw.weight", "stages.0.blocks.0.mlp.fc1.weight"),
    "efficientnet": ("conv_stem.weight", "blocks.0.0.conv_dw.weight", "conv_head.weight", "bn2.weight"),
    "mobilenetv3": ("conv_stem.weight", "blocks.0.0.conv_dw.weight", "conv_head.weight", "conv_head.bias"),
}


def kind_of(keys) -> str | None:
    """resnet, convnext, efficientnet or mobilenetv3: which layout a set of state-dict names has (None: none)."""
    keys = set(keys)
    kind = next((k for k, sig in SIGNATURES.items() if set(sig) <= keys), None)
    return None if kind == "resnet" and not any(k.startswith("conv1.") for k in keys) else kind  # a conv1 stem


def detect(path) -> bool:
    """A ConvNet state dict in timm's layout (not TAESD, not an HF LLM)."""
    f = weight_file(path)
    if f is None:
        return False
    try:  # a safetensors file's header only
        keys = read_safetensors_header(f)[0] if f.suffix.lower() == ".safetensors" else read_state_dict(f)
    except Exception:
        return False
    return kind_of(keys) is not None or is_torchvision_convnext(keys)


def config_from_state_dict(sd: dict, arch: str | None = None, source: str = "<state dict>", base: dict | None = None,
                           **overrides) -> ConvNetConfig:
    """Infer a ConvNetConfig from timm-layout keys and shapes: ResNet and ConvNeXt from their stages,
    EfficientNet and MobileNetV3 as the preset whose every shape matches; or the preset `arch` names.
    `base`: a saved Zoo config the file carries (Zoo's own exports)."""
    kind = kind_of(sd)
    if kind is None:
        raise ValueError(f"{source}: not a ConvNet state dict in timm's layout (none of {', '.join(SIGNATURES)}: "
                         f"e.g. no {SIGNATURES['resnet'][0]} or {SIGNATURES['convnext'][1]})")
    if arch is not None:
        if arch not in ConvNetConfig.all_archs():
            raise ValueError(f"{source}: unknown arch {arch!r} (known: {', '.join(ConvNetConfig.all_archs())})")
        want = next(k for k, archs in CONVNET_KINDS.items() if arch in archs)
        if want != kind:
            raise ValueError(f"{source}: holds {kind} weights, which do not load as arch={arch} (a {want}); "
                             f"pass one of {', '.join(CONVNET_KINDS[kind])}, or no arch")
    if base is not None and (arch is None or base.get("arch") == arch):
        cfg = dict(base)
    else:
        cfg = INFER[kind](sd, arch, source) if kind in INFER else {} if arch is None else {"arch": arch}
    stem = STEMS[kind] if STEMS[kind] in sd else "conv1.0.weight"  # a ResNet's deep stem: its first conv
    cfg.update(in_chans=sd[stem].shape[1])
    head = HEADS[kind] + ".weight"
    if head in sd:
        cfg["num_classes"] = sd[head].shape[0]
    if kind in ("efficientnet", "mobilenetv3") and "arch" not in cfg:
        cfg.update(_matching_preset(sd, kind, {**cfg, **overrides}, source))
    cfg.update(overrides)
    return from_dict(ConvNetConfig, cfg, source, "")


HEADS = {"resnet": "fc", "convnext": "head.fc", "efficientnet": "classifier", "mobilenetv3": "classifier"}
STEMS = {"resnet": "conv1.weight", "convnext": "stem.0.weight", "efficientnet": "conv_stem.weight",
         "mobilenetv3": "conv_stem.weight"}


def _resnet_stem(sd, source) -> dict:
    """{width, stem} from conv1: one 7x7 (imagenet) or 3x3 (small) conv, or timm's three (conv1.0 / .3 / .6: deep,
    or deep_tiered where the first is narrower than the second)."""
    if "conv1.0.weight" in sd:
        first, second, width = (sd[f"conv1.{i}.weight"].shape[0] for i in (0, 3, 6))
        out = sd.get("layer1.0.conv3.weight", sd["layer1.0.conv2.weight"]).shape[0]  # basic: width, bottleneck: 4x
        if out not in (width, 4 * width):
            raise ValueError(f"{source}: a deep stem of {width} channels before a first stage of {out}: timm's "
                             "resnet*s/e (a stem wider than the stages) do not load; resnet*c/d/t do")
        return dict(width=width, stem="deep" if first == second else "deep_tiered")
    stem_w = sd["conv1.weight"]
    if stem_w.ndim != 4 or stem_w.shape[-1] not in (3, 7):
        raise ValueError(f"{source}: conv1.weight has shape {tuple(stem_w.shape)}; expected a 7x7 (imagenet) "
                         "or 3x3 (small) stem conv")
    return dict(width=stem_w.shape[0], stem="imagenet" if stem_w.shape[-1] == 7 else "small")


def _resnet(sd, arch, source) -> dict:
    """Depth from the blocks per stage, bottleneck from conv3, groups / width from conv2, stem from conv1,
    avg_down from a shortcut's conv at downsample.1 (its BN then at .2), channel attention from a block's se."""
    cfg = _resnet_stem(sd, source)
    width = cfg["width"]
    cfg["avg_down"] = any(k.startswith("layer") and ".downsample.2." in k for k in sd)
    cfg["channel_attn"] = "se" if "layer1.0.se.fc1.weight" in sd else "eca" if "layer1.0.se.conv.weight" in sd else \
        "none"
    if arch is not None:
        return {**cfg, "arch": arch}
    depths = _depths(sd, "layer{}.", ".conv1.weight", start=1)
    block = "bottleneck" if "layer1.0.conv3.weight" in sd else "basic"
    groups, wpg = 1, 64
    if block == "bottleneck":
        c2 = sd["layer1.0.conv2.weight"]  # (group width, group width / groups, 3, 3)
        groups = c2.shape[0] // c2.shape[1]
        wpg = c2.shape[0] // groups * 64 // width
    if match := [n for n, a in RESNET_ARCHS.items() if a == (block, depths, groups, wpg)]:
        return {**cfg, "arch": match[0]}
    return {**cfg, "arch": "resnet50" if block == "bottleneck" else "resnet18", "block": block, "layers": depths,
            "groups": groups, "width_per_group": wpg}


def _convnext(sd, arch, source) -> dict:
    """Version 2 where the MLPs have a GRN, MLP weights as 1x1 convs' (timm's small sizes), depths from the
    blocks per stage, width and stem from stem.0: the preset so built, else one of its version and MLP
    layout reshaped by `layers` and `width`."""
    stem_w = sd["stem.0.weight"]  # (width, in_chans, patch, patch)
    cfg = dict(stem="imagenet" if stem_w.shape[-1] == 4 else "small")
    if arch is not None:
        return {**cfg, "arch": arch}
    version = 2 if any(k.endswith(".mlp.grn.weight") for k in sd) else 1
    conv_mlp = sd["stages.0.blocks.0.mlp.fc1.weight"].ndim == 4
    depths, width = _depths(sd, "stages.{}.blocks.", ".conv_dw.weight", start=0), stem_w.shape[0]
    alike = [n for n, a in CONVNEXT_ARCHS.items() if (a[0], a[3]) == (version, conv_mlp)]
    if match := [n for n in alike if CONVNEXT_ARCHS[n][1:3] == (depths, width)]:
        return {**cfg, "arch": match[0]}
    if not alike:
        raise ValueError(f"{source}: ConvNeXt V{version} weights{' with 1x1-conv MLPs' if conv_mlp else ''}: no "
                         f"preset of that kind to reshape")
    return {**cfg, "arch": alike[0], "layers": depths, "width": width}


INFER = {"resnet": _resnet, "convnext": _convnext}  # EfficientNet, MobileNetV3: _matching_preset


def _depths(sd, stage: str, block_key: str, start: int) -> list:
    """Blocks per stage: the distinct block indices under stage.format(i) with a `block_key` tensor."""
    depths = []
    while any(k.startswith(stage.format(len(depths) + start)) for k in sd):
        prefix = stage.format(len(depths) + start)
        depths.append(len({k[len(prefix):].split(".")[0] for k in sd if k.startswith(prefix) and k.endswith(block_key)}))
    return depths


def _matching_preset(sd, kind: str, cfg: dict, source: str) -> dict:
    """The first of `kind`'s presets whose model (on the meta device) has every tensor of sd's shape, else
    the multipliers that rebuild them on the preset of sd's stage count (_multipliers): {arch, ...}."""
    from ..convnet import build
    head = HEADS[kind] + "."
    shapes = {k: tuple(v.shape) for k, v in sd.items() if not k.startswith(head)}
    stages = _depths(sd, "blocks.{}.", ".bn1.weight", start=0)
    candidates = [{"arch": name} for name in CONVNET_KINDS[kind]] + _multipliers(sd, kind, stages)
    refused = []
    for c in candidates:
        try:
            with torch.device("meta"):
                own = build(from_dict(ConvNetConfig, {**cfg, **c}, source, "")).state_dict()
        except ConfigError as e:
            refused.append(e)
            continue
        if {k: tuple(v.shape) for k, v in own.items() if not k.startswith(head)} == shapes:
            return c
    if refused and len(refused) == len(candidates):  # every one refused: a key given (num_classes=0), not the shapes
        raise refused[0]
    raise ValueError(f"{source}: {kind} weights that match no preset ({', '.join(CONVNET_KINDS[kind])}) nor "
                     f"one reshaped by width_mult / depth_mult: pass arch= and the model keys that reshape it")


def _multipliers(sd, kind: str, stages: list) -> list:
    """Candidate {arch, width_mult, depth_mult} for EfficientNet / MobileNetV3 weights of any size: the preset of that
    many stages, each stage's output channels over the preset's as a width multiplier, and the largest depth
    multiplier giving every stage its blocks (timm rounds a stage's blocks up; the ratio is rounded down)."""
    from ..convnet.efficientnet import STAGES
    from ..convnet.mobilenetv3 import STAGES as MOBILE
    tables = {"efficientnet": {"efficientnet_b0": STAGES},
              "mobilenetv3": {f"mobilenetv3_{size}_100": MOBILE[size] for size in MOBILE}}[kind]
    found = []
    for arch, table in tables.items():
        if len(table) != len(stages):
            continue
        depth = math.floor(min(n / sum(b.repeats for b in stage) for n, stage in zip(stages, table)) * 1e4) / 1e4
        for i, stage in enumerate(table):
            last = f"blocks.{i}.{stages[i] - 1}."
            out = next(sd[f"{last}{c}.weight"].shape[0] for c in ("conv_pwl", "conv_pw", "conv")
                       if f"{last}{c}.weight" in sd)
            found.append({"arch": arch, "width_mult": round(out / stage[-1].channels, 4), "depth_mult": depth})
    return found


def load_into(model, sd: dict, source: str = "<state dict>") -> None:
    """Copy a timm-layout state dict into a Zoo ConvNet: key and shape mismatches are one error listing
    them; a classifier of another size (or none) leaves the model's fresh head, with a warning."""
    own = model.state_dict()
    sd = dict(sd)
    name = model.classifier_name
    head = [k for n in model.classifier_names() for k in (f"{n}.weight", f"{n}.bias") if k in own]
    if any(k not in sd or sd[k].shape != own[k].shape for k in head):
        got = f"classifier {tuple(sd[head[0]].shape)}" if head[0] in sd else "no classifier in the file;"
        warnings.warn(f"{source}: {got} replaced by a new {model.config.num_classes}-class head "
                      f"({name} is freshly initialised; train it)", stacklevel=3)
        model.reset_classifier(model.config.num_classes)
        own = model.state_dict()
        for k in head:
            sd.pop(k, None)
            sd[k] = own[k]
    tracked = ".num_batches_tracked"
    missing = [k for k in own if k not in sd and not k.endswith(tracked)]
    unexpected = [k for k in sd if k not in own]
    shapes = [f"{k} {tuple(sd[k].shape)} vs {tuple(own[k].shape)}" for k in own
              if k in sd and sd[k].shape != own[k].shape]
    if missing or unexpected or shapes:
        parts = [f"{len(items)} {what}: {', '.join(items[:8])}{', ...' if len(items) > 8 else ''}" for what, items in
                 (("missing", missing), ("unexpected", unexpected), ("mis-shaped (file vs model)", shapes)) if items]
        raise ValueError(f"{source}: weights do not fit {describe(model.config)}: {'; '.join(parts)}")
    for k in own:  # BatchNorm batch counts a file may lack (torchvision's): 0
        if k.endswith(tracked) and k not in sd:
            sd[k] = torch.zeros_like(own[k])
    model.load_state_dict(sd, strict=True)


def describe(cfg) -> str:
    """'resnet18-style ResNet (layers=[1, 1], block=basic)', 'convnext_tiny', ...: what a model was built as."""
    if isinstance(cfg, ViTConfig):
        r = cfg.resolved
        return f"{cfg.arch}-style ViT (embed_dim={r['embed_dim']}, depth={r['depth']}, patch_size={r['patch_size']})"
    if cfg.kind == "resnet":
        return f"{cfg.arch}-style ResNet (layers={cfg.resolved_layers}, block={cfg.resolved_block})"
    if cfg.kind == "convnext":
        return f"{cfg.arch}-style ConvNeXt (layers={cfg.resolved_layers}, width={cfg.resolved_width})"
    return f"{cfg.arch} (width_mult={cfg.resolved_width_mult}, depth_mult={cfg.resolved_depth_mult})"


def saved_config(path, archs=None) -> tuple[str | None, dict | None]:
    """(the architecture a timm folder's config.json names, if one of `archs` (default: the ConvNets'), the Zoo
    config a Zoo export carries): the "zoo" entry of the safetensors metadata or of the folder's config.json."""
    p, f = Path(path), weight_file(path)
    meta = {}
    if p.is_dir() and (p / "config.json").is_file():
        meta = read_json(p / "config.json")
    if "zoo" not in meta and f is not None and f.suffix.lower() == ".safetensors":
        extra = read_safetensors_header(f)[1] or {}
        if "zoo" in extra:
            meta["zoo"] = json.loads(extra["zoo"])
    arch = meta.get("architecture")
    if isinstance(arch, str) and arch.startswith("tf_"):  # the plain model's names, other arithmetic
        raise ValueError(f"{p}: {arch} is a TensorFlow port (SAME padding, BatchNorm eps 1e-3), which Zoo's "
                         f"models do not compute")
    known = archs or ConvNetConfig.all_archs()
    return (arch if arch in known else None), meta.get("zoo")


def load(path, arch: str | None = None, num_classes: int | None = None, **overrides):
    """A Zoo ConvNet (eval mode) with the weights of `path`; it remembers the file name it came from
    (`pretrained_format`), so save() to a folder writes the same file type back."""
    from ..convnet import build
    sd = read_state_dict(path, timm_names=False)
    torchvision = is_torchvision_convnext(sd)
    sd = renamed(sd) if torchvision else sd
    if num_classes is not None:
        overrides["num_classes"] = num_classes
    named, base = saved_config(path)
    cfg = config_from_state_dict(sd, arch or named, str(path), base, **overrides)
    with torch.device("meta"):  # every tensor comes from the file (or a fresh head): no initialisation to pay for
        model = build(cfg)
    model.to_empty(device="cpu")
    load_into(model, sd, str(path))
    f = weight_file(path)
    model.pretrained_format = {"format": "timm", "layout": "folder" if Path(path).is_dir() else "file",
                               "file": f.name, "torchvision": torchvision}
    return model.eval()


def exports(model) -> bool:
    """A ConvNet (a ViT, a ConvNetBase too, is timm_vit's: its names differ from timm's in places)."""
    from ..convnet import ConvNetBase
    return isinstance(model, ConvNetBase) and model.family != "vit"


def save(model, path, **kwargs) -> Path:
    """Write timm's key layout: to a .safetensors or .pth/.pt/.bin path as that file; to a folder as the
    file the model was loaded from, else model.safetensors with a config.json carrying the zoo config.
    Returns the weight file written."""
    if kwargs:
        raise TypeError(f"save_pretrained for a timm model takes no options, got {', '.join(kwargs)}")
    return write(model, model.state_dict(), path)


def write(model, state: dict, path) -> Path:
    """save()'s file or folder of `state`, the model's tensors already under timm's names (a ViT's: timm_vit)."""
    p = Path(path)
    sd = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
    if (getattr(model, "pretrained_format", None) or {}).get("torchvision"):  # back under torchvision's names
        sd = renamed(sd, to_timm=False)
    if p.suffix.lower() not in SUFFIXES:  # a folder: timm's, config.json beside the weights in the source's type
        name = (getattr(model, "pretrained_format", None) or {}).get("file", "model.safetensors")
        cfg = {"architecture": model.config.arch, "num_classes": model.config.num_classes,
               "zoo": to_dict(model.config)}
        atomic_write(p / "config.json", json.dumps(cfg, indent=2))
        p = p / (name if name in FOLDER_FILES else FOLDER_FILES[not name.lower().endswith(".safetensors")])
    if p.suffix.lower() == ".safetensors":
        save_safetensors(sd, p, {"arch": model.config.arch, "zoo": json.dumps(to_dict(model.config))})
    else:
        atomic_write(p, lambda t: torch.save(sd, t))
    return p
