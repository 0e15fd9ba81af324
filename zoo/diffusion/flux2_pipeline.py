"""What diffusers' Flux2KleinPipeline does around the FLUX.2 transformer: a Zoo LLM as the text encoder, the latents'
2x2 patches packed into normalised tokens, and flow-matching sampling with the resolution-dependent shift and
classifier-free guidance.

    prompt_embeds(llm, ids, mask, layers)  (B, L) tokens -> (B, L, len(layers) * d_model): the chosen layers' hidden
                                           states side by side per token (FLUX.2 [klein]: Qwen3's 9, 18 and 27)
    pack(z, mean, std) / unpack(x, h, w, mean, std)   (B, C, 2h, 2w) autoencoder latents <-> (B, h * w, 4C) tokens
    sample(model, cond, uncond, h, w, steps, scale)   Euler from noise to the latents (B, C, 2h, 2w)
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from ..blocks.mmdit import positions
from .schedule import flow_sample, guided

LAYERS = (9, 18, 27)  # FLUX.2 [klein]'s text-encoder layers


@torch.no_grad()
def prompt_embeds(llm, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                  layers=LAYERS) -> torch.Tensor:
    """(B, L) token ids (right-padded; attention_mask 0 on the padding) -> (B, L, len(layers) * D)."""
    key_mask = None if attention_mask is None or bool(attention_mask.all()) else attention_mask.bool()
    hs = llm.hidden_states(input_ids, layers, key_mask)
    return torch.stack(hs, 2).flatten(2)


def pack(z: torch.Tensor, mean: Optional[torch.Tensor] = None, std: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(B, C, 2h, 2w) latents -> (B, h * w, 4C) tokens: 2x2 patches (channel-major), normalised by mean, std (4C,)."""
    B, C, H, W = z.shape
    x = z.view(B, C, H // 2, 2, W // 2, 2).permute(0, 1, 3, 5, 2, 4).reshape(B, 4 * C, H // 2, W // 2)
    if mean is not None:
        x = (x - mean.view(1, -1, 1, 1)) / std.view(1, -1, 1, 1)
    return x.flatten(2).transpose(1, 2)


def unpack(x: torch.Tensor, h: int, w: int, mean: Optional[torch.Tensor] = None,
           std: Optional[torch.Tensor] = None) -> torch.Tensor:
    """pack's inverse: (B, h * w, 4C) tokens -> (B, C, 2h, 2w) latents."""
    B, _, C4 = x.shape
    x = x.transpose(1, 2).reshape(B, C4, h, w)
    if mean is not None:
        x = x * std.view(1, -1, 1, 1) + mean.view(1, -1, 1, 1)
    return x.view(B, C4 // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3).reshape(B, C4 // 4, 2 * h, 2 * w)


def empirical_mu(image_tokens: int, steps: int) -> float:
    """FLUX.2's shift for `image_tokens` latent tokens sampled in `steps` steps (fit by Black Forest Labs)."""
    a1, b1, a2, b2 = 8.73809524e-05, 1.89833333, 0.00016927, 0.45666666
    if image_tokens > 4300:
        return a2 * image_tokens + b2
    m200, m10 = a2 * image_tokens + b2, a1 * image_tokens + b1
    a = (m200 - m10) / 190.0
    return a * steps + m200 - 200.0 * a


def sigmas(steps: int, image_tokens: int, shift="auto") -> torch.Tensor:
    """(steps + 1,) noise levels: linspace(1, 1/steps) shifted to k / (k + 1/s - 1), then 0; k = `shift`, or for
    "auto" FLUX.2's exp(empirical_mu) (diffusers' FlowMatchEulerDiscreteScheduler: `shift`, or `mu` with dynamic
    shifting)."""
    s = torch.linspace(1.0, 1.0 / steps, steps, dtype=torch.float64).float()
    k = math.exp(empirical_mu(image_tokens, steps)) if shift == "auto" else shift
    return torch.cat([k / (k + (1 / s - 1)), torch.zeros(1)])


@torch.no_grad()
def sample(model, cond: torch.Tensor, uncond: Optional[torch.Tensor], h: int, w: int, steps: int = 4,
           scale: float = 4.0, generator: Optional[torch.Generator] = None, mean: Optional[torch.Tensor] = None,
           std: Optional[torch.Tensor] = None, shift="auto") -> torch.Tensor:
    """Latents (B, C, 2h, 2w) for prompt embeddings cond (B, L, text_dim): Euler flow matching from noise drawn as
    (B, in_channels, h, w) with `generator` over `sigmas` (`shift` None: flow_sigmas, unshifted); guided by `scale`
    against uncond (the empty prompt's) when the model has no guidance embedder, else that embedder gets `scale`."""
    B, L, _ = cond.shape
    x = torch.randn(B, model.config.in_channels, h, w, generator=generator, device=cond.device, dtype=cond.dtype)
    txt, img = (p.to(cond.device) for p in positions(L, h, w))
    if model.config.guidance:
        g = torch.full((B,), scale, device=cond.device)
        fn = lambda x, t: model(x, cond, t / 1000, img, txt, g)  # noqa: E731
    else:
        fn = lambda x, t: guided(lambda x, t, c: model(x, c, t / 1000, img, txt), x, t, cond, uncond, scale)  # noqa: E731
    grid = None if shift is None else sigmas(steps, h * w, shift)
    out = flow_sample(fn, x.flatten(2).transpose(1, 2), steps, sigmas=grid)
    return unpack(out, h, w, mean, std)
