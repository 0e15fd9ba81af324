"""Hugging Face vision-language checkpoints in and out: SmolVLMForConditionalGeneration and
Idefics3ForConditionalGeneration (one architecture under two names) as Zoo's VLM (zoo/vlm.py).

One record per class (`RECORDS`): its config.json model_type, its encoder's, and its defaults. The three parts go
through the machinery of their own formats: the encoder through hf_vit.py's SigLIP key map (under
`model.vision_model.`), the decoder through hf_llm.py's records (config.json's text_config, tensors under
`model.text_model.`), the connector is one matrix. save() writes the class the model came from (SmolVLM for a
Zoo-built one), the source config.json's other keys kept.

    model = zoo.from_pretrained("SmolVLM-256M-Instruct/")
    zoo.save_pretrained(model, "out/")        # SmolVLMForConditionalGeneration.from_pretrained("out/") loads it
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

import torch

from ..config import VLMConfig, from_dict
from . import hf_llm, hf_vit
from .files import atomic_write, config_folder, read_json, save_safetensors


class VLMRecord(NamedTuple):
    hf_class: str
    vision_type: str
    defaults: dict


_DEFAULTS = dict(scale_factor=2, image_token_id=128257, tie_word_embeddings=False)
RECORDS = {"smolvlm": VLMRecord("SmolVLMForConditionalGeneration", "smolvlm_vision", _DEFAULTS),
           "idefics3": VLMRecord("Idefics3ForConditionalGeneration", "idefics3_vision", _DEFAULTS)}
VISION, TEXT, CONNECTOR = "model.vision_model.", "model.text_model.", "model.connector.modality_projection.proj.weight"


def text_name(name: str) -> str:
    """An LLM file's tensor name -> its name in the VLM's file."""
    return TEXT + name.removeprefix("model.") if name.startswith("model.") else name


def detect(path) -> bool:
    try:
        return read_json(config_folder(path) / "config.json").get("model_type") in RECORDS
    except (ValueError, OSError):
        return False


def configs(hf: dict, source: str) -> tuple[dict, dict, VLMConfig]:
    """(the encoder's config, the decoder's config.json, the VLMConfig) of a VLM config.json, defaults filled in."""
    rec = RECORDS[hf["model_type"]]
    hf = {**rec.defaults, **hf}
    vision = {**hf_vit.DEFAULTS[rec.vision_type], **(hf.get("vision_config") or {}), "model_type": rec.vision_type}
    text = {**(hf.get("text_config") or {}), "tie_word_embeddings": hf["tie_word_embeddings"]}
    cfg = from_dict(VLMConfig, dict(vision=hf_vit.zoo_config(vision, source + " vision_config"),
                                    text=hf_llm.config_from_hf(text, source + " text_config")[0],
                                    scale_factor=hf["scale_factor"], image_token_id=hf["image_token_id"]), source)
    return vision, text, cfg


def load(path, dtype=None, device=None):
    """A Zoo VLM (eval mode) of an HF SmolVLM / Idefics3 folder; dtype None / "auto": the checkpoint's (else fp32)."""
    from ..vlm import VLM
    folder = config_folder(path)
    source = str(folder / "config.json")
    hf = read_json(folder / "config.json")
    vision_hf, text_hf, cfg = configs(hf, source)
    dtype = hf_llm._resolve_dtype(dtype, hf, source)
    with torch.device("meta"):
        model = VLM(cfg)
    model.llm = hf_llm.load_llm(text_hf, folder, source, dtype, device, text_name,
                                lambda n: n.startswith(VISION) or n == CONNECTOR)
    sd = hf_vit.prefixed(folder, "")
    model.vision = hf_vit.build(vision_hf, {k[len(VISION):]: v for k, v in sd.items() if k.startswith(VISION)}, source)
    proj = sd.get(CONNECTOR)
    want = model.connector.proj.weight.shape
    if proj is None or proj.shape != want:
        raise ValueError(f"{folder}: {CONNECTOR} {'missing' if proj is None else tuple(proj.shape)} (expected "
                         f"{tuple(want)})")
    model.connector.proj.weight = torch.nn.Parameter(proj)
    model.hf_config = hf
    return model.to(device or "cpu", dtype).eval()


def exports(model) -> bool:
    return getattr(model, "family", None) == "vlm"


def save(model, path, dtype=None) -> Path:
    """Write the model as an HF folder (config.json, model.safetensors) of the class it came from; returns it."""
    cfg: VLMConfig = model.config
    hf = dict(getattr(model, "hf_config", None) or {"model_type": "smolvlm"})
    kind, llm = hf["model_type"], model.llm
    rec = RECORDS[kind]
    hf = {**rec.defaults, **hf}
    dtype = dtype or model.connector.proj.weight.dtype
    if why := hf_llm.holds(llm):
        raise ValueError(why)
    text_rec = hf_llm.record_for(llm.config, getattr(llm, "hf_architecture", None))
    text = hf_llm.config_to_hf(llm.config, text_rec.hf_class, dtype, hf.get("text_config"))
    vision = {**(hf.get("vision_config") or {}), **hf_vit.hf_keys(model.vision, rec.vision_type, path),
              "model_type": rec.vision_type}
    hf.update(architectures=[rec.hf_class], text_config=text, vision_config=vision, scale_factor=cfg.scale_factor,
              image_token_id=cfg.image_token_id, tie_word_embeddings=llm.config.tie_embeddings,
              dtype=str(dtype).removeprefix("torch."))
    state = text_rec.layout(llm.state_dict(), llm.config, to_file=True)
    out = {text_name(k): v for k, v in hf_llm.file_tensors(llm.config, text_rec, state)}
    out.update({VISION + k: v for k, v in hf_vit.hf_state(model.vision, rec.vision_type).items()})
    out[CONNECTOR] = model.connector.proj.weight
    p = Path(path)
    save_safetensors({k: v.detach().to("cpu", dtype).contiguous() for k, v in out.items()}, p / "model.safetensors")
    atomic_write(p / "config.json", json.dumps(hf, indent=2) + "\n")
    return p
