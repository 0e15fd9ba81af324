"""TAESD weights in and out: original .pth / .safetensors pairs and diffusers AutoencoderTiny folders.

Original (madebyollin/taesd): `<name>_encoder.pth` and `<name>_decoder.pth` (or .safetensors),
keys without the `encoder.` / `decoder.` prefix. diffusers: a folder with config.json
(`_class_name: AutoencoderTiny`), decoder layers shifted by one. The variant is read from the tensors.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from zoo.diffusion.taesd import TAESD

from .files import (atomic_write, check_weight_file, diffusers_folder, load_shards, load_tensors,
                    read_safetensors_header, save_safetensors)

DIFFUSERS_WEIGHTS = "diffusion_pytorch_model.safetensors"
# the AutoencoderTiny config.json keys TAESD has one value of
_DIFFUSERS_FIXED = {"in_channels": 3, "out_channels": 3, "act_fn": "relu", "upsample_fn": "nearest",
                    "upsampling_scaling_factor": 2, "num_encoder_blocks": [1, 3, 3, 3],
                    "num_decoder_blocks": [3, 3, 3, 1]}
_PAIR = re.compile(r"^(?P<stem>.*)_(?P<part>encoder|decoder)\.(?P<ext>pth|pt|safetensors)$")
_MAX_PTH_BYTES = 256 << 20   # TAESD files are a few MB; never unpickle big unrelated files to look


def _pair_paths(p: Path):
    """(encoder path, decoder path) of the original-format pair that `p` belongs to, or None."""
    if p.is_dir():
        encs = sorted(q for q in p.iterdir() if (m := _PAIR.match(q.name)) and m["part"] == "encoder")
        return _pair_paths(encs[0]) if len(encs) == 1 else None
    m = _PAIR.match(p.name)
    if not m:
        return None
    return p.with_name(f"{m['stem']}_encoder.{m['ext']}"), p.with_name(f"{m['stem']}_decoder.{m['ext']}")


def _keys(path: Path) -> list[str]:
    if path.suffix == ".safetensors":
        return list(read_safetensors_header(path)[0])  # the header only
    if path.stat().st_size > _MAX_PTH_BYTES:
        return []
    return list(load_tensors(path))


def detect(path) -> bool:
    p = Path(path)
    if diffusers_folder(p, "AutoencoderTiny", DIFFUSERS_WEIGHTS, "") is not None:
        return True
    pair = _pair_paths(p)
    if pair is None or not pair[0].is_file():
        return False
    try:
        keys = _keys(pair[0])
    except (ValueError, OSError):
        return False
    # the encoder's first layer is a plain conv "0.weight"; its blocks are "<i>.conv.<j>.weight"
    return "0.weight" in keys and any(re.fullmatch(r"\d+\.conv\.0\.weight", k) for k in keys)


def variant_of(sd: dict, source) -> dict:
    """Read the TAESD variant from a zoo-keyed state dict."""
    try:
        channels, latent = sd["encoder.0.weight"].shape[0], sd["encoder.14.weight"].shape[0]
    except KeyError as e:
        raise ValueError(f"{source}: not TAESD weights (missing {e.args[0]})") from None
    return {"latent_channels": latent, "midblock_gn": any(".pool." in k for k in sd), "channels": channels}


def from_state_dict(sd: dict, source, dtype=torch.float32, **expected) -> TAESD:
    """A TAESD with the zoo-keyed weights `sd`; `expected` (latent_channels=..., midblock_gn=...,
    channels=...) is checked against the variant the tensors say."""
    found = variant_of(sd, source)
    for k, v in expected.items():
        if k in found and v is not None and found[k] != v:
            raise ValueError(f"{source}: these weights are the TAESD variant {k}={found[k]}, but {k}={v} "
                             f"was asked for")
    model = TAESD(**found)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    if missing or unexpected:
        what = f"missing {missing[:3]}" if missing else f"unexpected {unexpected[:3]}"
        raise ValueError(f"{source}: weights do not fit the TAESD architecture ({what})")
    return model.to(dtype)


def _load_diffusers(p: Path) -> tuple[dict, dict]:
    cfg = json.loads((p / "config.json").read_text())
    for k, v in _DIFFUSERS_FIXED.items():
        if k in cfg and cfg[k] != v:
            raise ValueError(f"{p / 'config.json'}: {k}={cfg[k]!r} is not supported (TAESD has {v!r})")
    for k in ("encoder_block_out_channels", "decoder_block_out_channels"):
        if k in cfg and len(set(cfg[k])) != 1:
            raise ValueError(f"{p / 'config.json'}: {k}={cfg[k]} is not supported (TAESD has one width)")
    sd = {}
    for k, v in load_shards(p, DIFFUSERS_WEIGHTS).items():
        m = re.fullmatch(r"(encoder|decoder)\.layers\.(\d+)\.(.+)", k)
        if not m:
            raise ValueError(f"{p / DIFFUSERS_WEIGHTS}: unexpected key '{k}' for an AutoencoderTiny")
        i = int(m[2]) + (1 if m[1] == "decoder" else 0)
        sd[f"{m[1]}.{i}.{m[3]}"] = v
    return sd, cfg


def load(path, dtype=torch.float32, latent_channels=None, midblock_gn=None, channels=None, **_) -> TAESD:
    """TAESD from an original pair (either file, or a folder holding one) or a diffusers folder; the
    variant keywords, when given, must match the weights'. It remembers `pretrained_format` for save()."""
    p = Path(path)
    expected = {"latent_channels": latent_channels, "midblock_gn": midblock_gn, "channels": channels}
    if diffusers_folder(p, "AutoencoderTiny", DIFFUSERS_WEIGHTS, "") is not None:
        sd, cfg = _load_diffusers(p)
        model = from_state_dict(sd, p, dtype, **expected)
        model.scaling_factor = float(cfg.get("scaling_factor", 1.0))
        model.shift_factor = float(cfg.get("shift_factor", 0.0) or 0.0)
        model.pretrained_format = {"format": "diffusers", "dtype": next(iter(sd.values())).dtype}
        return model
    pair = _pair_paths(p)
    if pair is None:
        raise ValueError(f"{path}: not TAESD weights (expected <name>_encoder.pth and <name>_decoder.pth, "
                         f"or a diffusers AutoencoderTiny folder)")
    for q in pair:
        if not q.is_file():
            raise FileNotFoundError(f"{q}: missing (TAESD weights come as an encoder and decoder pair)")
    check_weight_file(pair[1])  # load_pretrained checked the file it was given, not its partner
    sd = {f"encoder.{k}": v for k, v in load_tensors(pair[0]).items()}
    sd.update({f"decoder.{k}": v for k, v in load_tensors(pair[1]).items()})
    model = from_state_dict(sd, pair[0], dtype, **expected)
    m = _PAIR.match(pair[0].name)
    model.pretrained_format = {"format": "taesd", "name": m["stem"], "ext": m["ext"],
                               "dtype": next(iter(sd.values())).dtype}
    return model


def exports(model) -> bool:
    return isinstance(model, TAESD)


def save(model: TAESD, path, format: str | None = None, dtype=None, name: str | None = None, **_) -> Path:
    """Write `model` as an original pair (format="taesd"; a path ending _encoder.pth / _decoder.pth or
    .safetensors) or a diffusers AutoencoderTiny folder (format="diffusers"); by default as it was
    loaded (`pretrained_format`, else diffusers). Returns the encoder file or the folder."""
    p = Path(path)
    source = getattr(model, "pretrained_format", None) or {}
    if format is None:
        format = "taesd" if _PAIR.match(p.name) else source.get("format", "diffusers")
    if format not in ("taesd", "diffusers"):
        raise ValueError(f"format must be 'taesd' or 'diffusers', got {format!r}")
    dtype = dtype or source.get("dtype")
    sd = {k: v.detach().to("cpu", dtype or v.dtype).contiguous() for k, v in model.state_dict().items()}
    if format == "taesd":
        if _PAIR.match(p.name):
            enc, dec = _pair_paths(p)
        else:
            stem, ext = name or source.get("name", "taesd"), source.get("ext", "pth")
            enc, dec = p / f"{stem}_encoder.{ext}", p / f"{stem}_decoder.{ext}"
        for part, out in (("encoder", enc), ("decoder", dec)):
            tensors = {k.split(".", 1)[1]: v for k, v in sd.items() if k.startswith(part + ".")}
            if out.suffix == ".safetensors":
                save_safetensors(tensors, out)
            else:
                atomic_write(out, lambda tmp: torch.save(tensors, tmp))
        return enc
    if model.midblock_gn:
        raise ValueError(f"{path}: diffusers' AutoencoderTiny has no FLUX.2 mid-block branch; "
                         f"export this variant with format='taesd'")
    out = {}
    for k, v in sd.items():
        part, i, rest = k.split(".", 2)
        out[f"{part}.layers.{int(i) - (part == 'decoder')}.{rest}"] = v
    c = model.channels
    config = {"_class_name": "AutoencoderTiny", **_DIFFUSERS_FIXED, "encoder_block_out_channels": [c] * 4,
              "decoder_block_out_channels": [c] * 4, "latent_channels": model.latent_channels,
              "latent_magnitude": 3, "latent_shift": 0.5, "force_upcast": False,
              "scaling_factor": model.scaling_factor, "shift_factor": model.shift_factor}
    save_safetensors(out, p / DIFFUSERS_WEIGHTS)
    atomic_write(p / "config.json", json.dumps(config, indent=2) + "\n")
    return p
