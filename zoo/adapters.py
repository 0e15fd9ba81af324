"""Parameter-efficient fine-tuning on any Zoo model: apply, quantise, merge and list adapters.

    cfg = AdapterConfig(method="lora", r=8, alpha=16, targets=["q_proj", "v_proj"])
    apply_adapters(model, cfg)          # freezes the model, wraps the targets (blocks/lora.py)
    merge_adapters(model); unmerge_adapters(model)
    with adapters_disabled(model): ...  # the base model alone (e.g. DPO's reference), no copy
    dense = merged_model(model)         # a plain model with the adapters merged (and NF4 dequantised)
    apply_adapters(model, cfg2, name="b"); set_adapter(model, "b")  # named LoRA adapters, one active
    with adapters_per_row(model, ["default", "b", "__base__"]): model(x)  # row i on adapter i

Targets are named as in PEFT checkpoints (q_proj, ..., down_proj; `lora_sites` maps them onto Zoo's fused layers; a
recurrent layer's projections by its class's names: in_proj_qkv, in_proj_z, in_proj, out_proj, ...); on a
vision-language model `targets` name the decoder's, `vision_targets` the encoder's and the connector's (SmolVLM's names).
method 'prefix': learned keys/values, 'prompt': learned input embeddings (blocks/prefix.py); 'bottleneck': Houlsby
adapters after each attention and MLP (blocks/bottleneck.py); quantize_base 'nf4': QLoRA.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Literal, Optional

import torch
from torch import nn

from .blocks.bottleneck import BottleneckAdapter
from .blocks.lora import BASE, LoRALinear, adapters_per_row, dense_weight  # noqa: F401  (adapters_per_row: the API)
from .blocks.prefix import KVPrefix, PromptEmbedding
from .config import ConfigError, bounded, first_broken
from .tensors import tensor_bytes

LLM_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FLUX2_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "to_qkv_mlp_proj", "to_out")  # diffusers' names (to_out.0: the
                                                                                  # double blocks', to_out: the single)
NF4_BLOCK = 64
VISION_SITES = ("vision.", "connector.")  # a VLM's modules whose sites adapter.vision_targets names
SLOTS = ("prefix", "prompt", "attn_adapter", "mlp_adapter")  # where the adapters that are modules of their own sit


@dataclass
class AdapterConfig:
    method: Literal["none", "lora", "dora", "prefix", "prompt", "bottleneck"] = "none"  # `none`, `lora`, `dora`,
                                            # `prefix`, `prompt` (learned input embeddings) or `bottleneck` (Houlsby
                                            # adapters); only the adapters train, and checkpoints hold only them
    r: int = bounded(8, gt=0)               # LoRA / DoRA rank; `bottleneck`: the adapters' hidden width
    alpha: float = bounded(16.0, gt=0)      # the adapters' output is scaled by `alpha / r` (`alpha / sqrt(r)` with
                                            # `rslora`)
    dropout: float = bounded(0.0, ge=0, lt=1)  # dropout on the adapters' input, in [0, 1)
    targets: list[str] = field(default_factory=lambda: list(LLM_TARGETS))  # the projections to adapt, by their
                                            # Hugging Face / PEFT names (a MoE layer: its shared expert's gate/up/down);
                                            # the default on an LLM (a VLM's decoder): all it has (Phi-3: qkv_proj, gate_up_proj; latent
                                            # attention: q_a_proj, q_b_proj or q_proj, kv_a_proj_with_mqa, kv_b_proj);
                                            # on a FLUX.2 transformer diffusers' module names (the default: its
                                            # attention's, to_q, to_k, to_v, to_out.0, to_qkv_mlp_proj, to_out)
    vision_targets: list[str] = field(default_factory=list)  # a vision-language model: also these projections of
                                            # its encoder and connector, by SmolVLM's names (q_proj, k_proj, v_proj,
                                            # out_proj, fc1, fc2; the connector's proj); [] = the decoder alone
    rslora: bool = False                    # rank-stabilised scaling `alpha / sqrt(r)`
    init: Literal["kaiming", "gaussian"] = "kaiming"  # LoRA / DoRA A at the start (PEFT's names): `kaiming`
                                            # (kaiming-uniform, nn.Linear's) or `gaussian` (N(0, 1/r^2)); B starts at 0
    quantize_base: Literal["none", "nf4"] = "none"  # `nf4`: the frozen linear weights stored in torchao's NF4
                                            # (QLoRA; `pip install -e '.[qlora]'`); not with `train.ema_decay`
    prefix_len: int = bounded(16, gt=0)     # `prefix`: learned key/value vectors per layer (not with
                                            # `model.sliding_window`); `prompt`: the virtual tokens
    init_from: Optional[str] = None         # LoRA / DoRA: the adapter starts from this one (diffusers' LoRA file of a
                                            # FLUX.2 transformer, or a PEFT adapter folder), which must have its r,
                                            # alpha and targets
    export_merged: bool = False             # at the end, also merge the adapters into the weights and export them as
                                            # `train.export` does; LoRA and DoRA only

    def validate(self, source, prefix="adapter."):
        first_broken(source, prefix, [
            (self.mergeable and not self.targets, "targets", "must name at least one module"),
            *((getattr(self, k) and not self.mergeable, k, "needs adapter.method lora or dora")
              for k in ("vision_targets", "init_from")),
            (self.quantize_base != "none" and self.method == "none", "quantize_base",
             f"={self.quantize_base} needs adapter.method lora, dora or prefix (the base must be frozen)")])

    @property
    def enabled(self) -> bool:
        return self.method != "none"

    @property
    def mergeable(self) -> bool:
        return self.method in ("lora", "dora")


def lora_sites(model: nn.Module) -> dict[str, list[tuple[str, int, str]]]:
    """Zoo module name -> [(part name, rows, PEFT module name), ...] of the linear layers adapters
    may wrap, parts in row order; `peft_target` of the PEFT name is what adapter.targets name. For an
    LLM the PEFT names are those of the Hugging Face class it exports as (Phi-3's fused qkv_proj and
    gate_up_proj, DeepSeek-V3's latent attention); for a FLUX.2 transformer (or a model holding one)
    diffusers'; for a vision-language model SmolVLM's (_vlm_sites); else Zoo's own."""
    if getattr(model, "family", None) == "vlm":
        return _vlm_sites(model)
    if getattr(model, "family", None) == "llm":
        cfg, rec = model.config, _record(model)
        sites = {}
        for i, (wrapper, layer) in enumerate(zip(model.layers, model.blocks())):
            z, h = f"layers.{i}." + ("block." if layer is not wrapper else ""), f"model.layers.{i}."  # MoD: its block
            if layer.recurrent:  # its projections, by the file's names; none the file fuses otherwise (split_rows)
                x = h + rec.mixers.get(cfg.layer_type(i), "mixer") + "."
                split = {k.rsplit(".", 2)[-2] for k in rec.split_rows(cfg)}
                sites.update({z + "mixer." + n: [(n, m.out_features, x + n)] for n, m in layer.mixer.named_children()
                              if hasattr(m, "out_features") and n not in split})
            for m, n, rows in [] if layer.recurrent else _attention_sites(cfg, rec, layer.attn):
                sites.setdefault(z + "attn." + m, []).append((n, rows, h + "self_attn." + n))
            mlp = layer.mlp
            if hasattr(mlp, "router"):  # MoE: the shared expert only
                if getattr(mlp, "shared", None) is not None:
                    s, F = rec.experts(cfg, h)["shared"], mlp.shared.hidden
                    sites[z + "mlp.shared.gate_up"] = [(n, F, s + n) for n in ("gate_proj", "up_proj")]
                    sites[z + "mlp.shared.down"] = [("down_proj", cfg.d_model, s + "down_proj")]
                continue
            F = mlp.hidden
            sites[z + "mlp.gate_up"] = [("gate_up_proj", 2 * F, h + "mlp.gate_up_proj")] if "gate_up_proj" in rec.fused \
                else [(n, F, h + f"mlp.{n}") for n in ("gate_proj", "up_proj")]
            sites[z + "mlp.down"] = [("down_proj", cfg.d_model, h + "mlp.down_proj")]
        return {site: [(rec.renamed(p).rsplit(".", 1)[-1], rows, rec.renamed(p)) for _, rows, p in parts]
                for site, parts in sites.items()}  # the class's own names (LFM2's out_proj, w1, w3, w2)
    from .weights.diffusers_flux2 import module_names  # a FLUX.2 transformer's linear layers by diffusers' names
    names = module_names(model)
    return {name: [(name.rsplit(".", 1)[-1], m.out_features, names.get(name, name))]
            for name, m in model.named_modules() if isinstance(m, (nn.Linear, LoRALinear))}


def _vlm_sites(vlm: nn.Module) -> dict[str, list[tuple[str, int, str]]]:
    """lora_sites of a VLM: its decoder's (the PEFT names those of the text model in SmolVLM's file), then its
    encoder blocks' linear layers (hf_vit's SigLIP key map) and its connector, the sites of adapter.vision_targets."""
    from .weights.hf_vit import key_map
    from .weights.hf_vlm import CONNECTOR, VISION, text_name
    sites = {"llm." + s: [(n, rows, text_name(hf)) for n, rows, hf in parts] for s, parts in lora_sites(vlm.llm).items()}
    linear = {n: m for n, m in vlm.vision.named_modules() if isinstance(m, (nn.Linear, LoRALinear))}
    for zs, hs in key_map("smolvlm_vision", vlm.vision):
        z = zs[0].removesuffix(".weight")
        if z in linear and z.startswith("blocks."):  # a fused qkv: its rows in equal parts
            sites["vision." + z] = [(h.split(".")[-2], linear[z].out_features // len(hs), VISION + h[:-len(".weight")])
                                    for h in hs]
    sites["connector.proj"] = [("proj", vlm.connector.proj.out_features, CONNECTOR[:-len(".weight")])]
    return sites


def peft_target(name: str) -> str:
    """A module's target name, as PEFT matches it: the last part of its name, the last two where that is an index
    (`to_out.0`)."""
    parts = name.split(".")
    return ".".join(parts[-2:] if parts[-1].isdigit() else parts[-1:])


def _record(model: nn.Module):
    """The record of the Hugging Face class an LLM exports as (zoo/archs); where none holds it (e.g.
    Mixture-of-Depths), the base record: the names most classes share."""
    from .archs import Record
    from .weights.hf_llm import record_for
    try:
        return record_for(model.config, getattr(model, "hf_architecture", None))
    except ValueError:
        return Record()


def _attention_sites(cfg, rec, attn) -> list[tuple[str, str, int]]:
    """[(Zoo module under attn., PEFT name, rows), ...] of one attention layer `attn`, a fused module's parts
    in row order (no k / v where it projects none: KV sharing, values its keys)."""
    if cfg.mla:
        a, H = cfg.mla, cfg.n_heads
        q = [("q_a", "q_a_proj", a.q_rank), ("q_b", "q_b_proj", H * (a.nope_dim + a.rope_dim))] if a.q_rank else \
            [("q_b", "q_proj", H * (a.nope_dim + a.rope_dim))]
        return q + [("kv_a", "kv_a_proj_with_mqa", a.kv_rank + a.rope_dim),
                    ("kv_b", "kv_b_proj", H * (a.nope_dim + a.v_dim)), ("proj", "o_proj", cfg.d_model)]
    D = attn.head_dim
    q, k, v = cfg.n_heads * D * (1 + cfg.attn_gate), attn.k_rows * D, attn.v_rows * D  # a gate: q_proj's rows doubled
    qkv = [("qkv", "qkv_proj", q + k + v)] if "qkv_proj" in rec.fused else \
        [("qkv", n, rows) for n, rows in (("q_proj", q), ("k_proj", k), ("v_proj", v)) if rows]
    return qkv + [("proj", "o_proj", cfg.d_model)]


def known_targets(model: nn.Module) -> list[str]:
    return sorted({peft_target(hf) for parts in lora_sites(model).values() for _, _, hf in parts})


def _set_module(model: nn.Module, name: str, module: nn.Module):
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


def apply_adapters(model: nn.Module, cfg: AdapterConfig, source: str = "adapter", log=None,
                   name: str = "default") -> nn.Module:
    """Freeze `model` and add the adapters `cfg` describes (in place; returns the model): only they train afterwards.
    With quantize_base 'nf4' the frozen linear weights are stored in NF4 (torchao). A model with LoRA / DoRA adapters
    takes more under other names (the active one stays active: `set_adapter`)."""
    if not cfg.enabled:
        return model
    named = getattr(model, "adapter_configs", {})
    if name in named or (named and not (cfg.mergeable and all(c.mergeable for c in named.values()))):
        raise ConfigError(f"{source}: adapter {name!r}: a model holds several adapters only when all are LoRA / DoRA "
                          f"under distinct names (it has: {', '.join(f'{k} ({c.method})' for k, c in named.items())})")
    model.requires_grad_(False)
    if cfg.mergeable:
        sites = lora_sites(model)
        chosen = chosen_targets(model, cfg, sites, source)
        for site, parts in sites.items():
            targets = chosen[site.startswith(VISION_SITES)]
            adapted = [n for n, _, hf in parts if peft_target(hf) in targets]
            if not adapted:
                continue
            args = adapted, cfg.r, cfg.alpha, cfg.dropout, cfg.method == "dora", cfg.rslora, cfg.init
            if isinstance(base := model.get_submodule(site), LoRALinear):
                base.add_adapter(name, *args)
            else:
                _set_module(model, site, LoRALinear(base, [(n, rows) for n, rows, _ in parts], *args, name=name))
    elif cfg.method == "prefix":
        attns = [m for m in model.modules() if hasattr(m, "prefix") and hasattr(m, "n_kv_heads")]
        if not attns:
            raise ConfigError(f"{source}: adapter.method=prefix needs attention layers (an LLM)")
        if getattr(getattr(model, "config", None), "sliding_window", None) is not None:
            raise ConfigError(f"{source}: adapter.method=prefix with model.sliding_window is not supported "
                              f"(the window would count the prefix)")
        p = next(model.parameters())
        for a in attns:
            a.prefix = KVPrefix(a.n_kv_heads, cfg.prefix_len, a.head_dim, device=p.device, dtype=p.dtype)
    else:
        _add_module_adapters(model, cfg, source)
    if cfg.quantize_base == "nf4" and not named:
        quantize_nf4(model, log)
    model.adapter_configs = {**named, name: cfg}
    if not named:
        model.adapter_config, model.active_adapter = cfg, name
    return model


def chosen_targets(model: nn.Module, cfg: AdapterConfig, sites: dict, source: str) -> dict[bool, list[str]]:
    """{False: adapter.targets (the default resolved), True: adapter.vision_targets}, each checked against the names
    of the sites it chooses among (True: a VLM's encoder and connector; False: the rest)."""
    chosen = {False: default_targets(model, cfg.targets), True: list(cfg.vision_targets)}
    for vision, key in ((False, "targets"), (True, "vision_targets")):
        known = sorted({peft_target(hf) for s, parts in sites.items() if s.startswith(VISION_SITES) == vision
                        for _, _, hf in parts})
        if unknown := [t for t in chosen[vision] if t not in known]:
            raise ConfigError(f"{source}: adapter.{key}: {', '.join(unknown)} not in this model "
                              f"(known: {', '.join(known) or 'none'})")
    return chosen


def default_targets(model: nn.Module, targets) -> list[str]:
    """`targets`, or where they are adapter.targets' default: all an LLM has; a FLUX.2 transformer's attention
    (diffusers' training scripts' choice)."""
    if list(targets) != list(LLM_TARGETS):
        return list(targets)
    model = model.llm if getattr(model, "family", None) == "vlm" else model  # a VLM's decoder
    if getattr(model, "family", None) == "llm":
        return known_targets(model)
    from .weights.diffusers_flux2 import module_names
    return list(FLUX2_TARGETS) if module_names(model) else list(targets)


def differences(a: AdapterConfig, b: AdapterConfig) -> str:
    """What of `a` (an adapter file's config) the adapter `b` computes differently: '' when nothing."""
    keys = [k for k in ("method", "r", "alpha", "rslora") if getattr(a, k) != getattr(b, k)]
    return ", ".join([f"{k}={getattr(a, k)} (the adapter's: {getattr(b, k)})" for k in keys] +
                     [f"target {t} not adapted" for t in a.targets if t not in b.targets] +
                     [f"vision target {t} not adapted" for t in a.vision_targets if t not in b.vision_targets])


def _add_module_adapters(model: nn.Module, cfg: AdapterConfig, source: str):
    """Prompt tuning (the virtual tokens drawn from the vocabulary's embeddings, as Lester et al. start them) or
    bottleneck adapters after every block's attention and MLP: on an LLM."""
    if getattr(model, "family", None) != "llm":
        raise ConfigError(f"{source}: adapter.method={cfg.method} needs an LLM")
    E, d = model.embed.weight, model.config.d_model
    if cfg.method == "prompt":
        model.prompt = PromptEmbedding(cfg.prefix_len, d, device=E.device, dtype=E.dtype)
        with torch.no_grad():
            ids = torch.randint(E.shape[0], (cfg.prefix_len,), device=E.device)
            model.prompt.weight.copy_(model.embed_tokens(ids))
        return
    for b in model.blocks():
        b.attn_adapter, b.mlp_adapter = (BottleneckAdapter(d, cfg.r, cfg.dropout, device=E.device, dtype=E.dtype)
                                         for _ in range(2))


def nf4_scaler_block(numel: int, shards: int = 8) -> Optional[int]:
    """torchao's second-level block for a weight of numel elements: the largest power of two up to 256 dividing its
    number of 64-element blocks, where possible leaving a number of blocks that splits evenly into `shards` (FSDP2
    shards the NF4 tensor's parts over 2, 4 or 8 ranks); None if numel is not a multiple of 64 (stays dense)."""
    if numel % NF4_BLOCK:
        return None
    n = numel // NF4_BLOCK
    return math.gcd(n // shards if n % shards == 0 else n, 256)


def quantize_nf4(model: nn.Module, log=None) -> int:
    """Replace the weight of every linear layer (plain or LoRA-wrapped; not the LM head, not a
    weight shared with an embedding) by a frozen torchao NF4Tensor. Returns how many were."""
    try:
        from torchao.quantization import to_nf4
    except ImportError:
        raise ConfigError("adapter.quantize_base=nf4 needs torchao (pip install -e '.[qlora]')") from None
    shared = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    n, kept = 0, []
    for name, m in model.named_modules():
        if not isinstance(m, (nn.Linear, LoRALinear)) or name.endswith("lm_head") or id(m.weight) in shared:
            continue
        w = m.weight
        block = nf4_scaler_block(w.numel())
        if block is None or not w.is_floating_point() or w.dim() != 2:
            kept.append(name)
            continue
        m.weight = nn.Parameter(to_nf4(w.detach(), NF4_BLOCK, block), requires_grad=False)
        n += 1
    if log is not None:
        log(f"adapter: {n} linear weights in NF4" + (f"; kept dense (size not a multiple of {NF4_BLOCK}): "
                                                     f"{', '.join(kept)}" if kept else ""))
    return n


def adapter_modules(model: nn.Module) -> dict[str, LoRALinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


def adapter_slots(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """(module, attribute, adapter) of every prefix, prompt and bottleneck adapter in `model`."""
    return [(m, a, getattr(m, a)) for m in list(model.modules()) for a in SLOTS
            if isinstance(getattr(m, a, None), nn.Module)]


def set_adapter(model: nn.Module, name: str):
    """Make the LoRA / DoRA adapter `name` the one every layer computes with (PEFT's set_adapter; a layer
    without it computes its base)."""
    lora = adapter_modules(model).values()
    known = list(getattr(model, "adapter_configs", {}))
    if name not in known:
        raise ValueError(f"set_adapter: {name!r} not among the model's adapters ({', '.join(known) or 'none'})")
    if any(m.merged for m in lora):
        raise ValueError("set_adapter: the adapters are merged into the weights; unmerge_adapters first")
    for m in lora:
        m.active = name
    model.adapter_config, model.active_adapter = model.adapter_configs[name], name


def merge_adapters(model: nn.Module):
    for m in adapter_modules(model).values():
        m.merge()


def unmerge_adapters(model: nn.Module):
    for m in adapter_modules(model).values():
        m.unmerge()


@contextlib.contextmanager
def adapters_disabled(model: nn.Module):
    """Inside the block `model` computes as its base: every LoRA/DoRA layer without its adapter, no prefix,
    prompt or bottleneck adapter. Nothing is copied; the adapters come back on exit. A merged
    adapter cannot be taken out this way (a one-line error)."""
    lora = list(adapter_modules(model).values())
    if any(m.merged for m in lora):
        raise ValueError("adapters_disabled: the adapters are merged into the weights; unmerge_adapters first")
    slots = adapter_slots(model)
    for m in lora:
        m.enabled = False
    for m, a, _ in slots:
        setattr(m, a, None)
    try:
        yield model
    finally:
        for m in lora:
            m.enabled = True
        for m, a, p in slots:
            setattr(m, a, p)


@torch.no_grad()
def merged_model(model: nn.Module) -> nn.Module:
    """The model with every LoRA/DoRA layer replaced by a plain nn.Linear holding the merged dense
    weight (its active adapter's) and every NF4 weight dequantised (in place; returns the model)."""
    if adapter_slots(model):
        raise ValueError("prefix, prompt and bottleneck adapters have no merged form: they are not weights of the base")
    for name, m in adapter_modules(model).items():
        lin = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None, device="meta")
        lin.weight = nn.Parameter(m.merged_weight(), requires_grad=False)
        if m.bias is not None:
            lin.bias = m.bias
        _set_module(model, name, lin)
    for m in model.modules():
        if isinstance(m, nn.Linear) and dense_weight(m.weight) is not m.weight:
            m.weight = nn.Parameter(dense_weight(m.weight).clone(), requires_grad=False)
    return model


def trainable_keys(model: nn.Module) -> set[str]:
    """State-dict names of what an adapter run changes: the trainable parameters and the
    persistent buffers (e.g. BatchNorm statistics, MoE routing load)."""
    params = {id(p) for p in model.parameters() if p.requires_grad}
    buffers = {id(b) for b in model.buffers()}
    return {k for k, v in model.state_dict(keep_vars=True).items() if id(v) in params or id(v) in buffers}


def count_params(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameters; NF4 weights count their logical elements."""
    params = list(model.parameters())  # a shared parameter once
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


def param_bytes(model: nn.Module) -> int:
    """Bytes the parameters occupy (an NF4 weight: its codes, scales and their scales)."""
    return tensor_bytes(list(model.parameters()))
