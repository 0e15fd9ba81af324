"""The end of a run: the final weights written as one process would hold them, the adapter or the
export in the pretrained format, the loss plot and the samples.

    <out_dir>/model.safetensors (+ model_ema.safetensors, the task's files such as tokenizer.model)
    <out_dir>/adapter/          an adapter run: LoRA / DoRA in PEFT's format (a FLUX.2 transformer's: diffusers'
                                LoRA file), prefixes as Zoo tensors
    <out_dir>/quantized/        train.qat / train.quantize: the quantized model (zoo/weights/quantized.py)
    <out_dir>/loss.png          train.plot
    the task's export           train.export (e.g. a Hugging Face folder; adapter.export_merged for adapters)
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Optional

import torch

from zoo.adapters import merged_model
from zoo.config import to_dict
from zoo.weights.files import save_safetensors


def finish(run, out: Path, metrics, say):
    """Write what the run produced (rank 0; the other ranks only take part in gathering FSDP2's shards)."""
    t, task = run.cfg.train, run.task
    model, ema_model = consolidated(run)
    if not run.par.main:
        return
    task.save_files(out)  # what the folder needs to be used alone (tokenizer, chat template, classes)
    if run.keys is None:
        config = getattr(model, "config", None)  # beside the weights: what their shapes cannot tell (a ViT's RoPE)
        meta = {"zoo": json.dumps(to_dict(config))} if dataclasses.is_dataclass(config) else None
        save_safetensors(model, out / "model.safetensors", meta)
        if ema_model is not None:
            save_safetensors(ema_model, out / "model_ema.safetensors", meta)
        say(f"weights: {out / 'model.safetensors'}")
    else:
        say(f"adapter: {export_adapter(model, out, t.init_from)}")
    if t.plot and metrics.plot():
        say(f"loss curve: {out / 'loss.png'}")
    if t.samples and (text := task.samples(ema_model if ema_model is not None else model, out)):
        say("samples:\n" + text)
    if run.quantized is not None:
        import zoo
        path = zoo.save_pretrained(run.quantized, out / "quantized")
        task.save_files(path)
        say(f"quantized: {path} ({run.quantized.quantization['scheme']})")
    if t.export and run.keys is not None and not run.cfg.adapter.export_merged:
        say("export: adapter run; set adapter.export_merged=true for the merged weights in the base's format")
    elif t.export and (path := task.export(merged_model(model) if run.keys is not None else model, out)):
        say(f"exported: {path}")


def consolidated(run):
    """(model, EMA model) as one process holds them on rank 0, else (None, None); FSDP2's rebuilt from its shards."""
    par, ema = run.par, run.ema
    if not par.active or par.strategy == "ddp":
        return run.model, ema.model if ema is not None else None
    full, full_ema = par.full_state(run.model), par.full_state(ema.model) if ema is not None else None
    if not par.main:
        return None, None

    def plain(sd):
        m = run.plain_model()
        m.load_state_dict(sd)
        return m.to(memory_format=torch.channels_last) if run.cfg.train.channels_last else m

    return plain(full), plain(full_ema).eval().requires_grad_(False) if full_ema is not None else None


def export_adapter(model, out: Path, base: Optional[str]) -> Path:
    """The trained adapter in <out>/adapter/: a FLUX.2 transformer's LoRA / DoRA as diffusers' LoRA file
    (pytorch_lora_weights.safetensors), else PEFT's format (LoRA, DoRA, prompt tuning), else Zoo's (peft_lora.py)."""
    from zoo.weights.diffusers_flux2 import module_names
    from zoo.weights.diffusers_lora import save_lora
    from zoo.weights.peft_lora import save_adapter
    if module_names(model) and model.adapter_config.mergeable:
        return save_lora(model, out / "adapter")
    return save_adapter(model, out / "adapter", base=base)
