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
accepts, e.g. torchao's NF4Tensor (QLoRA).

Shapes: x (..., in) -> y (..., out); out = sum of the parts' rows.
"""
import math
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn


def dense_weight(w: torch.Tensor) -> torch.Tensor:
    """A weight as a plain tensor (a quantised tensor subclass is dequantised)."""
    get = getattr(w, "get_original_weight", None)
    return get() if get is not None else w


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, parts: Sequence = (), adapted: Sequence[str] = (), r: int = 8,
                 alpha: float = 16.0, dropout: float = 0.0, dora: bool = False, rslora: bool = False,
                 init: str = "kaiming"):
        """base: the layer to wrap (its weight and bias are taken over, not copied). parts:
        [(name, rows), ...] covering the output rows in order; empty = one part named 'weight'.
        adapted: the parts that get an adapter (empty = all)."""
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        parts = list(parts) or [("weight", self.out_features)]
        if sum(rows for _, rows in parts) != self.out_features:
            raise ValueError(f"parts {parts} do not cover the {self.out_features} output rows")
        names = [n for n, _ in parts]
        adapted = list(adapted) or names
        if unknown := [n for n in adapted if n not in names]:
            raise ValueError(f"adapted parts {unknown} are not among the parts {names}")
        if r <= 0:
            raise ValueError(f"r must be > 0, got {r}")
        if init not in ("kaiming", "gaussian"):
            raise ValueError(f"init must be 'kaiming' or 'gaussian', got {init!r}")
        self.parts = parts
        self.adapted = [n for n in names if n in adapted]
        self.r, self.alpha, self.dora, self.rslora, self.init = r, alpha, dora, rslora, init
        self.scaling = alpha / math.sqrt(r) if rslora else alpha / r
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.merged = False
        self.enabled = True  # False: the base alone (the adapters stay, unused)
        dev = self.weight.device
        dt = self.weight.dtype if self.weight.is_floating_point() else torch.float32
        self.lora_A = nn.ParameterDict({n: nn.Parameter(torch.empty(r, self.in_features, device=dev, dtype=dt))
                                        for n in self.adapted})
        self.lora_B = nn.ParameterDict({n: nn.Parameter(torch.zeros(rows, r, device=dev, dtype=dt))
                                        for n, rows in parts if n in self.adapted})
        self.magnitude = nn.ParameterDict({n: nn.Parameter(torch.ones(rows, device=dev, dtype=dt))
                                           for n, rows in parts if n in self.adapted and dora})
        self._dora_scale: dict = {}  # g_p of a merged DoRA part, to unmerge
        self.reset_adapters()

    def reset_adapters(self):
        """A as `init` says, B = 0; DoRA magnitudes = the rows' norms."""
        for n in self.adapted:
            if self.init == "gaussian":
                nn.init.normal_(self.lora_A[n], std=1 / self.r)
            else:
                nn.init.kaiming_uniform_(self.lora_A[n], a=math.sqrt(5))
            nn.init.zeros_(self.lora_B[n])
        if self.dora and self.lora_A[self.adapted[0]].device.type != "meta":
            with torch.no_grad():
                for n, wp, _ in self._adapted_rows(dense_weight(self.weight)):
                    self.magnitude[n].copy_(torch.linalg.norm(wp.to(self.lora_A[n].dtype), dim=1))

    def slices(self) -> dict:
        """name -> (first row, rows) of every part."""
        out, start = {}, 0
        for n, rows in self.parts:
            out[n] = (start, rows)
            start += rows
        return out

    def delta_weight(self, name: str) -> torch.Tensor:
        """s * B_p A_p, (rows_p, in)."""
        return self.scaling * (self.lora_B[name] @ self.lora_A[name])

    def dora_scale(self, name: str, w: torch.Tensor) -> torch.Tensor:
        """g_p = m_p / ||W_p + s B_p A_p||_row (the norm detached), (rows_p,); w: the part's rows of W."""
        norm = torch.linalg.norm(w + self.delta_weight(name).detach().to(w.dtype), dim=1).detach()
        return self.magnitude[name] / norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        if not self.enabled and self.merged:
            raise RuntimeError("a merged LoRA layer cannot be switched off; unmerge it first")
        if self.merged or not self.adapted or not self.enabled:
            return y
        h = self.dropout(x)
        A = torch.cat([self.lora_A[n] for n in self.adapted]) if len(self.adapted) > 1 else self.lora_A[self.adapted[0]]
        z = F.linear(h.to(A.dtype), A).split(self.r, dim=-1)  # (..., r) per adapted part
        w = dense_weight(self.weight) if self.dora else None
        dropped = not isinstance(self.dropout, nn.Identity) and self.training
        extra, k = [], 0
        for n, (start, rows) in self.slices().items():
            if n not in self.adapted:
                extra.append(y.new_zeros(*y.shape[:-1], rows))
                continue
            lora = F.linear(z[k], self.lora_B[n]) * self.scaling
            k += 1
            if self.dora:
                wp = w[start:start + rows]
                g = self.dora_scale(n, wp.to(lora.dtype))
                base = F.linear(h, wp) if dropped else y[..., start:start + rows] - \
                    (0 if self.bias is None else self.bias[start:start + rows])
                extra.append(((g - 1) * base + g * lora).to(y.dtype))
            else:
                extra.append(lora.to(y.dtype))
        return y + (torch.cat(extra, dim=-1) if len(extra) > 1 else extra[0])

    def _adapted_rows(self, w: torch.Tensor):
        """(name, the part's rows of w (a view), s B_p A_p) of every adapted part."""
        for n, (start, rows) in self.slices().items():
            if n in self.adapted:
                wp = w[start:start + rows]
                yield n, wp, self.delta_weight(n).to(wp.dtype)

    def _merge_into(self, w: torch.Tensor) -> dict:
        """Merge the adapters into the dense weight w in place; returns DoRA's g_p per part."""
        scales = {}
        for n, wp, delta in self._adapted_rows(w):
            if self.dora:
                scales[n] = self.dora_scale(n, wp)
                wp.copy_(scales[n][:, None] * (wp + delta))
            else:
                wp.add_(delta)
        return scales

    @torch.no_grad()
    def merge(self):
        """Write the adapters into the weight (inference without the extra matmuls)."""
        if self.merged:
            return
        if dense_weight(self.weight) is not self.weight:
            raise ValueError("a quantised weight cannot be merged in place; merge into a dense copy instead")
        self._dora_scale = self._merge_into(self.weight)
        self.merged = True

    @torch.no_grad()
    def unmerge(self):
        """Take the adapters out of the weight again."""
        if not self.merged:
            return
        for n, wp, delta in self._adapted_rows(self.weight):
            if self.dora:
                wp.copy_(wp / self._dora_scale.pop(n)[:, None] - delta)
            else:
                wp.sub_(delta)
        self.merged = False

    @torch.no_grad()
    def merged_weight(self) -> torch.Tensor:
        """The dense (out, in) weight with the adapters merged, without changing this module."""
        w = dense_weight(self.weight).clone()
        if not self.merged:
            self._merge_into(w)
        return w

    def extra_repr(self) -> str:
        kind = "dora" if self.dora else "lora"
        return (f"in={self.in_features}, out={self.out_features}, {kind} r={self.r}, alpha={self.alpha}, "
                f"parts={[n for n, _ in self.parts]}, adapted={self.adapted}")
