"""Rotary position embedding (RoPE) with optional 'linear', 'llama3', 'yarn', 'longrope' and 'proportional' scaling.

Paper: Su et al., "RoFormer: Enhanced Transformer with Rotary Position Embedding" (2021). Scaling: 'linear' = Chen et
al., "Extending Context Window of Large Language Models via Positional Interpolation" (2023); 'llama3' = the
wavelength-dependent rule of Llama 3.1 (Meta, "The Llama 3 Herd of Models", 2024); 'yarn' = Peng et al., "YaRN:
Efficient Context Window Extension of Large Language Models" (2023); 'longrope' = Ding et al., "LongRoPE" (2024, Phi-3:
per-channel factors, the long ones past original_max_position_embeddings); 'proportional' = Gemma 4's partial RoPE over a
whole head (the first `rotated` share of its angles turn as in a full head, the rest stay still). yarn and longrope
scale cos and sin by an attention factor. Hugging Face's "rotate-half" layout (channel i paired with i + D/2): no weight permutation. A table
narrower than a head rotates only its first channels (partial rotary: `apply_rope`'s caller splits them off).
`apply_rope_pairs`: the interleaved layout instead (channel 2i paired with 2i + 1, each angle repeated for its pair:
timm's EVA-02), for weights trained that way.

Shapes: inv_freq (D/2,); cos, sin (T, D), or (B, T, D) for a row of positions per sequence (`RotaryEmbedding.at`);
x (B, H, T, D) -> (B, H, T, D) (or (B, T, H, D) with cos, sin (T, 1, D)).
"""
import math
from typing import Optional

import torch
from torch import nn


def rope_inv_freq(head_dim: int, theta: float = 10000.0, scaling: Optional[dict] = None,
                  long: bool = False) -> torch.Tensor:
    """Inverse frequencies theta^(-2i/D), i < D/2, in fp32, with the scaling rule applied. scaling: None,
    or {'type': 'linear' | 'llama3' | 'yarn' | 'longrope', 'factor'}, for llama3 'low_freq_factor',
    'high_freq_factor', 'original_max_position_embeddings', for yarn 'beta_fast', 'beta_slow', 'truncate',
    for longrope 'short_factor', 'long_factor' (D/2 each; `long` picks the second), for proportional 'rotated'."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta ** exponent)
    if not scaling:
        return inv_freq
    kind, factor = scaling["type"], float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor
    if kind == "proportional":  # angles past the rotated ones at frequency zero: cos 1, sin 0
        turning = torch.arange(head_dim // 2) < int(scaling.get("rotated", 1.0) * head_dim // 2)
        return torch.where(turning, inv_freq, 0.0) / factor
    if kind == "longrope":
        return 1.0 / (torch.tensor(scaling["long_factor" if long else "short_factor"]).float() * theta ** exponent)
    if kind == "yarn":  # channels that turn fewer than beta_slow times in the old context: interpolated
        old = float(scaling["original_max_position_embeddings"])

        def channel(turns):  # the channel that turns `turns` times over the old context
            return head_dim * math.log(old / (turns * 2 * math.pi)) / (2 * math.log(theta))
        low, high = channel(scaling.get("beta_fast", 32.0)), channel(scaling.get("beta_slow", 1.0))
        if scaling.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        ramp = ((torch.arange(head_dim // 2).float() - low) / max(high - low, 0.001)).clamp(0, 1)
        return inv_freq / factor * ramp + inv_freq * (1 - ramp)
    if kind == "llama3":
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        # long wavelengths divided by factor, short ones kept, the band between interpolated
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_mid, mid, scaled)
    raise ValueError(f"unknown rope scaling type {kind!r} (supported: 'linear', 'llama3', 'yarn', 'longrope', "
                     f"'proportional')")


def rope_attention_factor(scaling: Optional[dict]) -> float:
    """The factor yarn and longrope multiply cos and sin by: scaling['attention_factor'], else from the
    factor (yarn: 0.1 ln(factor) + 1; longrope: sqrt(1 + ln(factor) / ln(original length))); else 1."""
    if not scaling or scaling["type"] not in ("yarn", "longrope"):
        return 1.0
    factor = float(scaling["factor"])
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    if factor <= 1:
        return 1.0
    if scaling["type"] == "yarn":
        return 0.1 * math.log(factor) + 1.0
    return math.sqrt(1 + math.log(factor) / math.log(scaling["original_max_position_embeddings"]))


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor):
    """cos, sin tables of shape (T, D) for integer positions (T,), computed in fp32."""
    freqs = torch.outer(positions.float(), inv_freq.float())  # (T, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (T, D)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (..., T, D) by the angles in cos/sin (T, D) (or anything broadcasting, e.g. (T, 1, D) for
    x (B, T, H, D)); returns x's dtype. Eagerly x * cos + roll(x, D/2) * [-sin, sin] (fewer kernels);
    under torch.compile the two halves as one (..., 2, D/2) view, which inductor vectorises."""
    half = x.shape[-1] // 2
    if torch.compiler.is_compiling():
        x1, x2 = x.unflatten(-1, (2, half)).unbind(-2)
        c, s = cos[..., :half], sin[..., :half]  # both halves use the same angles
        return torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-2).flatten(-2).to(x.dtype)
    signed_sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)  # tiny: (T, D)
    return torch.addcmul(x * cos, x.roll(half, dims=-1), signed_sin).to(x.dtype)


def apply_rope_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent channel pairs (x0, x1), (x2, x3), ... of x (..., T, D) by cos/sin (T, D) in the pair layout
    (angle i at channels 2i and 2i + 1), or anything broadcasting; returns x's dtype. x * cos + (-x1, x0, -x3, x2, ...)
    * sin, timm's apply_rot_embed(half=False) term for term."""
    turned = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    return (x * cos + turned * sin).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """Holds inv_freq and a cos/sin cache for positions [0, max_seq_len); under longrope a second one
    (`long_*`) for sequences longer than original_max_position_embeddings."""

    def __init__(self, head_dim: int, max_seq_len: int, theta: float = 10000.0, scaling: Optional[dict] = None):
        super().__init__()
        self.head_dim, self.theta, self.scaling = head_dim, theta, scaling
        self.attention_factor = rope_attention_factor(scaling)
        self.long_after = scaling["original_max_position_embeddings"] \
            if scaling and scaling["type"] == "longrope" else None
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta, scaling), persistent=False)
        if self.long_after is not None:
            self.register_buffer("long_inv_freq", rope_inv_freq(head_dim, theta, scaling, long=True), persistent=False)
        self._build(max_seq_len)

    def _build(self, n: int, device=None):
        for prefix in ("", "long_") if self.long_after is not None else ("",):
            inv = getattr(self, prefix + "inv_freq")
            inv = inv if device is None else inv.to(device)
            cos, sin = rope_cos_sin(inv, torch.arange(n, device=inv.device))
            self.register_buffer(prefix + "cos", cos * self.attention_factor, persistent=False)
            self.register_buffer(prefix + "sin", sin * self.attention_factor, persistent=False)

    def _tables(self, end: int):
        if end > self.cos.shape[0]:
            self._build(max(end, 2 * self.cos.shape[0]), self.inv_freq.device)
        if self.long_after is not None and end > self.long_after:
            return self.long_cos, self.long_sin
        return self.cos, self.sin

    def forward(self, start: int, length: int, dtype: torch.dtype):
        """cos, sin of shape (length, D) for positions [start, start + length), in `dtype`."""
        cos, sin = self._tables(start + length)
        return cos[start:start + length].to(dtype), sin[start:start + length].to(dtype)

    def at(self, positions: torch.Tensor, dtype: torch.dtype):
        """cos, sin of shape (*positions.shape, D) for integer positions of any shape (e.g. (B, T), restarting
        per document), in `dtype`; positions must be below max(cache length, T) (no host sync to check)."""
        cos, sin = self._tables(positions.shape[-1] if positions.dim() else 1)
        return cos[positions].to(dtype), sin[positions].to(dtype)
