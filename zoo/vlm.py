"""A vision-language model as SmolVLM and Idefics3 build it, from Zoo's own parts: the ViT encoder (zoo/vit.py, a
SigLIP encoder: learned position table, no class token, no head), the pixel-shuffle connector
(blocks/pixel_shuffle.py) and a Zoo LLM decoder; each image's tokens replace the prompt's `<image>` placeholders.

    pixel_values (B, I, C, H, W) (all-zero images: padding), pixel_attention_mask (B, I, H, W) true on real pixels
      -> per real image: patches + position table rows (each patch's fraction of its image's real grid, bucketed
         onto the table, as Idefics2 / NaViT) -> encoder blocks (padding patches masked as keys) -> norm
      -> pixel shuffle by scale_factor -> linear -> (grid / scale_factor)^2 tokens of the LLM's width
    input_ids (B, T) -> token embeddings, the image tokens written where input_ids == image_token_id, in order
      -> the LLM -> logits (B, T, V)

Papers: Laurencon et al., "Building and better understanding vision-language models" (Idefics3, 2024); Marafioti et
al., "SmolVLM: Redefining small and efficient multimodal models" (2025).

    model = zoo.from_pretrained("SmolVLM-256M-Instruct/")     # a folder transformers' save_pretrained wrote
    logits = model(input_ids, pixel_values=pixel_values, pixel_attention_mask=mask)
    ids = model.generate(input_ids, pixel_values=pixel_values, max_new_tokens=32)
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .blocks.pixel_shuffle import PixelShuffleProjector
from .config import VLMConfig, check
from .llm import LLM
from .vit import ViT


def bucket_positions(patch_mask: torch.Tensor, side: int) -> torch.Tensor:
    """(N, h, w) bool, true on real patches (a top-left block) -> (N, h*w) rows of a side x side table: each real
    patch's fraction of its image's real rows and columns, bucketed onto the table's (padding: its first row)."""
    N, h, w = patch_mask.shape
    dev = patch_mask.device
    bounds = torch.arange(1 / side, 1.0, 1 / side, device=dev)

    def buckets(n_real, n):  # in the float32 steps transformers takes, so the buckets agree at their edges
        frac = torch.arange(n, device=dev, dtype=torch.float32)[None] * (1.0 / n_real)[:, None]
        return torch.bucketize(frac.clamp(max=1 - 1e-6), bounds, right=True)

    rows, cols = buckets(patch_mask[:, :, 0].sum(1), h), buckets(patch_mask[:, 0, :].sum(1), w)
    ids = (rows[:, :, None] * side + cols[:, None, :]).reshape(N, -1)
    return torch.where(patch_mask.reshape(N, -1), ids, 0)


class VLM(nn.Module):
    """model(input_ids, pixel_values=, pixel_attention_mask=) -> logits (B, T, V), as transformers'
    SmolVLMForConditionalGeneration is called; `generate` decodes greedily or samples on the LLM's KV cache."""
    family = "vlm"

    def __init__(self, cfg: VLMConfig):
        super().__init__()
        check(cfg)
        self.config = cfg
        self.vision = ViT(cfg.vision)
        self.connector = PixelShuffleProjector(self.vision.num_features, cfg.text.d_model, cfg.scale_factor)
        self.llm = LLM(cfg.text)
        if not self.connector.proj.weight.is_meta:
            nn.init.normal_(self.connector.proj.weight, std=0.02)

    @property
    def image_tokens(self) -> int:
        """The tokens one image of the encoder's size becomes."""
        return self.tile_tokens(self.vision.spec["img_size"])

    def tile_tokens(self, side: int) -> int:
        """The tokens one square image of `side` pixels becomes."""
        return (side // self.vision.spec["patch_size"] // self.config.scale_factor) ** 2

    def repeated_units(self) -> list:
        """The encoder's blocks and the decoder's layers: what FSDP2 shards one by one."""
        return self.vision.repeated_units() + self.llm.repeated_units()

    def image_features(self, pixel_values: torch.Tensor, pixel_attention_mask=None) -> torch.Tensor:
        """(B, I, C, H, W) images (or (N, C, H, W)) -> (real images, tokens, d_model): the all-zero images (a
        batch's padding) dropped, at least one kept."""
        v, p = self.vision, self.vision.spec["patch_size"]
        x = pixel_values.flatten(0, 1) if pixel_values.dim() == 5 else pixel_values
        real = x.flatten(1).ne(0).any(1)
        real[0] |= ~real.any()
        x = x[real].to(v.patch_embed.proj.weight.dtype)
        if x.shape[-2] % p or x.shape[-1] % p:
            raise ValueError(f"pixel_values {tuple(pixel_values.shape)}: height and width must be multiples of the "
                             f"patch size {p}")
        mask = torch.ones(x.shape[0], *x.shape[-2:], dtype=torch.bool, device=x.device) if pixel_attention_mask \
            is None else pixel_attention_mask.reshape(-1, *pixel_attention_mask.shape[-2:])[real].bool()
        patches = mask.unfold(1, p, p).unfold(2, p, p).any(-1).any(-1)  # (N, h, w): a patch with a real pixel
        pos = F.embedding(bucket_positions(patches, v.grid), v.pos_embed[0])
        h = v.patch_embed(x) + pos
        keys = None if bool(patches.all()) else patches.flatten(1)[:, None, None]
        for block in v.blocks:
            h = block(h, None, keys)
        return self.connector(v.norm(h), *patches.shape[1:])

    def embed(self, input_ids: torch.Tensor, pixel_values=None, pixel_attention_mask=None) -> torch.Tensor:
        """input_ids (B, T) -> the LLM's input (B, T, D): token embeddings, the image tokens at the placeholders."""
        x = self.llm.embed_tokens(input_ids)
        if pixel_values is None:
            return x
        feats = self.image_features(pixel_values, pixel_attention_mask)
        where = input_ids == self.config.image_token_id
        if int(where.sum()) != feats.shape[0] * feats.shape[1]:
            raise ValueError(f"input_ids hold {int(where.sum())} image tokens (id {self.config.image_token_id}) for "
                             f"{feats.shape[0]} images of {feats.shape[1]} tokens each")
        return x.masked_scatter(where[..., None], feats.to(x.dtype))

    def forward(self, input_ids: torch.Tensor, pixel_values: Optional[torch.Tensor] = None,
                pixel_attention_mask: Optional[torch.Tensor] = None, targets: Optional[torch.Tensor] = None, **kw):
        """input_ids (B, T) and their images -> logits (B, T, V); with targets: the LLM's (logits, loss). kw: the
        LLM's (caches, start_pos, key_mask, ...)."""
        return self.llm(input_ids, targets, inputs_embeds=self.embed(input_ids, pixel_values, pixel_attention_mask),
                        **kw)

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, pixel_values: Optional[torch.Tensor] = None,
                 pixel_attention_mask: Optional[torch.Tensor] = None, **kw) -> torch.Tensor:
        """input_ids (B, T) and their images -> (B, T + max_new_tokens), LLM.generate's keywords."""
        embeds = self.embed(input_ids, pixel_values, pixel_attention_mask)
        return self.llm.generate(input_ids, max_new_tokens, inputs_embeds=embeds, **kw)
