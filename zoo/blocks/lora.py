"""LoRA and DoRA adapters on a linear layer, with one adapter per logical projection of a fused one.

Papers: Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models" (2021); Kalajdzievski, "A Rank Stabilization
Scaling Factor for Fine-Tuning with LoRA" (2023, rsLoRA); Liu et al., "DoRA: Weight-Decomposed Low-Rank Adaptation"
(2024); Dettmers et al., "QLoRA: Efficient Finetuning of Quantized LLMs" (2023).

`LoRALinear` replaces an nn.Linear (same `weight`, `bias`); its output rows split into parts (q, k, v of a fused `qkv`),
each with its own A_p (r, in), B_p (rows_p, r). With s = alpha / r (rsLoRA: alpha / sqrt(r)):
    LoRA:  y_p = W_p x + b_p + s * B_p A_p dropout(x)
    DoRA:  y_p = g_p * (W_p x' + s * B_p A_p x') + b_p + W_p (x - x'),   x' = dropout(x),
           g_p = m_p / ||W_p + s B_p A_p||_row   (norm detached; m_p starts at W_p's row norms)
A starts as nn.Linear's weights (init 'kaiming': kaiming-uniform) or N(0, 1/r^2) (init 'gaussian', PEFT's), B at 0;
`merge` / `unmerge`; `enabled = False` computes the base alone. The weight may be any tensor F.linear
accepts, e.g. torchao's NF4Tensor (QLoRA). Several named adapters (`add_adapter`, PEFT's "default" first): `active`
picks the one a forward uses; inside `with adapters_per_row(model, names)` row i of a batch uses names[i] (PEFT's
mixed-batch inference: rows grouped by adapter; a name a layer lacks, e.g. '__base__', computes its base alone).

Shapes: x (..., in) -> y (..., out); out = sum of the parts' rows.
"""
import contextlib
import math
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

LEGACY = ("lora_A", "lora_B", "magnitude")  # an adapter's tensors, once held by the layer itself
BASE = "__base__"  # PEFT's name, in per-row adapter lists, of the base model alone


def dense_weight(w: torch.Tensor) -> torch.Tensor:
    """A weight as a plain tensor (a quantised tensor subclass is dequantised)."""
    get = getattr(w, "get_original_weight", None)
    return get() if get is not None else w


class LoRA(nn.Module):
    """One named adapter of a LoRALinear: A_p (r, in), B_p (rows_p, r) and DoRA's m_p (rows_p,) per adapted part."""

    def __init__(self, parts, adapted, in_features: int, r: int, alpha: float, dropout: float, dora: bool,
                 rslora: bool, init: str = "kaiming", device=None, dtype=None):
        super().__init__()
        self.adapted, self.r, self.alpha, self.dora, self.rslora, self.init = adapted, r, alpha, dora, rslora, init
        self.scaling = alpha / math.sqrt(r) if rslora else alpha / r
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        kw = dict(device=device, dtype=dtype)
        self.lora_A = nn.ParameterDict({n: nn.Parameter(torch.empty(r, in_features, **kw)) for n in adapted})
        self.lora_B = nn.ParameterDict({n: nn.Parameter(torch.zeros(rows, r, **kw)) for n, rows in parts if n in adapted})
        self.magnitude = nn.ParameterDict({n: nn.Parameter(torch.ones(rows, **kw))
                                           for n, rows in parts if n in adapted and dora})

    def delta_weight(self, name: str) -> torch.Tensor:
        """s * B_p A_p, (rows_p, in)."""
        return self.scaling * (self.lora_B[name] @ self.lora_A[name])

    def dora_scale(self, name: str, w: torch.Tensor) -> torch.Tensor:
        """g_p = m_p / ||W_p + s B_p A_p||_row (the norm detached), (rows_p,); w: the part's rows of W."""
        norm = torch.linalg.norm(w + self.delta_weight(name).detach().to(w.dtype), dim=1).detach()
        return self.magnitude[name] / norm


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, parts: Sequence = (), adapted: Sequence[str] = (), r: int = 8,
                 alpha: float = 16.0, dropout: float = 0.0, dora: bool = False, rslora: bool = False,
                 init: str = "kaiming", name: str = "default"):
        """base: the layer to wrap (its weight and bias are taken over, not copied). parts:
        [(name, rows), ...] covering the output rows in order; empty = one part named 'weight'.
        adapted: the parts that get an adapter (empty = all); name: the adapter's."""
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        parts = list(parts) or [("weight", self.out_features)]
        if sum(rows for _, rows in parts) != self.out_features:
            raise ValueError(f"parts {parts} do not cover the {self.out_features} output rows")
        self.parts = parts
        self.adapters = nn.ModuleDict()
        self.active = name
        self.rows = None  # {adapter name: row indices (LongTensor)} of the batch being computed, else None
        self.merged = False
        self.enabled = True  # False: the base alone (the adapters stay, unused)
        self._dora_scale: dict = {}  # g_p of a merged DoRA part, to unmerge
        self.add_adapter(name, adapted, r, alpha, dropout, dora, rslora, init)

    def add_adapter(self, name: str, adapted: Sequence[str] = (), r: int = 8, alpha: float = 16.0,
                    dropout: float = 0.0, dora: bool = False, rslora: bool = False, init: str = "kaiming"):
        """Another named adapter beside those there (the active one stays active)."""
        names = [n for n, _ in self.parts]
        adapted = list(adapted) or names
        if unknown := [n for n in adapted if n not in names]:
            raise ValueError(f"adapted parts {unknown} are not among the parts {names}")
        if r <= 0:
            raise ValueError(f"r must be > 0, got {r}")
        if init not in ("kaiming", "gaussian"):
            raise ValueError(f"init must be 'kaiming' or 'gaussian', got {init!r}")
        if name in self.adapters:
            raise ValueError(f"an adapter named {name!r} is already there")
        dt = self.weight.dtype if self.weight.is_floating_point() else torch.float32
        self.adapters[name] = LoRA(self.parts, [n for n in names if n in adapted], self.in_features, r, alpha,
                                   dropout, dora, rslora, init, self.weight.device, dt)
        self.reset_adapters(name)

    @property
    def adapter(self) -> LoRA:
        """The active adapter."""
        return self.adapters[self.active]

    def reset_adapters(self, name: str = None):
        """A as `init` says, B = 0; DoRA magnitudes = the rows' norms (the active adapter, or `name`)."""
        lora = self.adapters[name or self.active]
        for n in lora.adapted:
            if lora.init == "gaussian":
                nn.init.normal_(lora.lora_A[n], std=1 / lora.r)
            else:
                nn.init.kaiming_uniform_(lora.lora_A[n], a=math.sqrt(5))
            nn.init.zeros_(lora.lora_B[n])
        if lora.dora and self.weight.device.type != "meta":
            with torch.no_grad():
                for n, wp, _ in self._adapted_rows(dense_weight(self.weight), lora):
                    lora.magnitude[n].copy_(torch.linalg.norm(wp.to(lora.lora_A[n].dtype), dim=1))

    def slices(self) -> dict:
        """name -> (first row, rows) of every part."""
        out, start = {}, 0
        for n, rows in self.parts:
            out[n] = (start, rows)
            start += rows
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        if not self.enabled and self.merged:
            raise RuntimeError("a merged LoRA layer cannot be switched off; unmerge it first")
        if self.merged or not self.enabled:
            return y
        if self.rows is None:
            return y + self.delta(self.adapter, x, y) if self.active in self.adapters else y
        B = sum(len(i) for i in self.rows.values())  # rows grouped by adapter; a token-flat input (N, in) per row
        xs, ys = x.reshape(B, -1, x.shape[-1]), y.reshape(B, -1, y.shape[-1])
        out = ys.clone()
        for name, i in self.rows.items():
            if name in self.adapters:
                out[i] = ys[i] + self.delta(self.adapters[name], xs[i], ys[i])
        return out.reshape(y.shape)

    def delta(self, lora: LoRA, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """What `lora` adds to y = W x + b: (..., out)."""
        h = lora.dropout(x)
        A = torch.cat([lora.lora_A[n] for n in lora.adapted]) if len(lora.adapted) > 1 else lora.lora_A[lora.adapted[0]]
        z = F.linear(h.to(A.dtype), A).split(lora.r, dim=-1)  # (..., r) per adapted part
        w = dense_weight(self.weight) if lora.dora else None
        dropped = not isinstance(lora.dropout, nn.Identity) and self.training
        extra, k = [], 0
        for n, (start, rows) in self.slices().items():
            if n not in lora.adapted:
                extra.append(y.new_zeros(*y.shape[:-1], rows))
                continue
            out = F.linear(z[k], lora.lora_B[n]) * lora.scaling
            k += 1
            if lora.dora:
                wp = w[start:start + rows]
                g = lora.dora_scale(n, wp.to(out.dtype))
                base = F.linear(h, wp) if dropped else y[..., start:start + rows] - \
                    (0 if self.bias is None else self.bias[start:start + rows])
                extra.append(((g - 1) * base + g * out).to(y.dtype))
            else:
                extra.append(out.to(y.dtype))
        return torch.cat(extra, dim=-1) if len(extra) > 1 else extra[0]

    def _adapted_rows(self, w: torch.Tensor, lora: LoRA = None):
        """(name, the part's rows of w (a view), s B_p A_p) of every part the active adapter (or `lora`) adapts."""
        if lora is None and self.active not in self.adapters:
            return
        lora = lora or self.adapter
        for n, (start, rows) in self.slices().items():
            if n in lora.adapted:
                wp = w[start:start + rows]
                yield n, wp, lora.delta_weight(n).to(wp.dtype)

    def _merge_into(self, w: torch.Tensor) -> dict:
        """Merge the active adapter into the dense weight w in place; returns DoRA's g_p per part."""
        scales = {}
        for n, wp, delta in self._adapted_rows(w):
            if self.adapter.dora:
                scales[n] = self.adapter.dora_scale(n, wp)
                wp.copy_(scales[n][:, None] * (wp + delta))
            else:
                wp.add_(delta)
        return scales

    @torch.no_grad()
    def merge(self):
        """Write the active adapter into the weight (inference without the extra matmuls)."""
        if self.merged:
            return
        if dense_weight(self.weight) is not self.weight:
            raise ValueError("a quantised weight cannot be merged in place; merge into a dense copy instead")
        self._dora_scale = self._merge_into(self.weight)
        self.merged = True

    @torch.no_grad()
    def unmerge(self):
        """Take the adapter out of the weight again."""
        if not self.merged:
            return
        for n, wp, delta in self._adapted_rows(self.weight):
            if self.adapter.dora:
                wp.copy_(wp / self._dora_scale.pop(n)[:, None] - delta)
            else:
                wp.sub_(delta)
        self.merged = False

    @torch.no_grad()
    def merged_weight(self) -> torch.Tensor:
        """The dense (out, in) weight with the active adapter merged, without changing this module."""
        w = dense_weight(self.weight).clone()
        if not self.merged:
            self._merge_into(w)
        return w

    def _load_from_state_dict(self, state, prefix, *args):
        """A state written before named adapters (`lora_A.q` beside the weight) is the 'default' adapter's."""
        for key in [k for k in state if k.startswith(prefix) and k[len(prefix):].split(".")[0] in LEGACY]:
            state[f"{prefix}adapters.default.{key[len(prefix):]}"] = state.pop(key)
        super()._load_from_state_dict(state, prefix, *args)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, parts={[n for n, _ in self.parts]}, " + ", ".join(
            f"{name}: {'dora' if a.dora else 'lora'} r={a.r} alpha={a.alpha} on {a.adapted}"
            for name, a in self.adapters.items())


@contextlib.contextmanager
def adapters_per_row(model: nn.Module, names: Sequence[str]):
    """Inside the block row i of every batch through `model` computes with its LoRA / DoRA adapter names[i]
    ('__base__': none), PEFT's mixed-batch inference: each LoRALinear groups the rows by adapter."""
    layers = [m for m in model.modules() if isinstance(m, LoRALinear)]
    known = list(dict.fromkeys(n for m in layers for n in m.adapters))
    if unknown := [n for n in dict.fromkeys(names) if n not in known and n != BASE]:
        raise ValueError(f"adapter_names: {', '.join(map(repr, unknown))} not among the model's adapters "
                         f"({', '.join(known) or 'none'})")
    if any(m.merged for m in layers):
        raise ValueError("adapter_names: the adapters are merged into the weights; unmerge them first")
    dev = layers[0].weight.device if layers else None
    rows = {n: torch.tensor([i for i, m in enumerate(names) if m == n], device=dev) for n in dict.fromkeys(names)}
    for m in layers:
        m.rows = rows
    try:
        yield model
    finally:
        for m in layers:
            m.rows = None
