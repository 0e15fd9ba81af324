"""The Vision Transformer family: ViT (tiny to huge, every patch size), DeiT (with its distillation token), DINOv2-style
ViTs with LayerScale and registers, DINOv3 (2-D RoPE, SwiGLU), SigLIP 2's encoder (NaFlex, attention pooling) and
EVA-02 (the table and 2-D RoPE, q and v biases, SwiGLU with sub-LN); one config (zoo/config.py's ViTConfig) whose
`arch`, a timm name, picks the preset.

    image (B, C, H, W) -> patch_embed (p x p conv) -> [class, distillation, register tokens] + position table (or
    RoPE on the patches, or both: EVA-02) -> blocks (pre-norm attention + MLP) -> norm -> class token (or mean of
    patch tokens -> fc_norm, or attention pooling) -> head -> logits
    NaFlex: patches (B, N, p*p*C) already cut, each image's grid in spatial_shapes (B, 2), padding masked out

Papers: Dosovitskiy et al., "An Image is Worth 16x16 Words" (2021); Touvron et al., "Training data-efficient image
transformers & distillation through attention" (2021); Darcet et al., "Vision Transformers Need Registers" (2024);
Fang et al., "EVA-02: A Visual Representation for Neon Genesis" (2023).
A file of its own beside the ConvNets (not in zoo/convnet/): its own config keys, one class for every variant.
Parameter names are timm's VisionTransformer's (and VisionTransformerDistilled's), so its weights map one to one.

    model = zoo.build({"family": "vit", "model": {"arch": "vit_tiny_patch16_224", "num_classes": 10}})
"""
from __future__ import annotations

import torch
from torch import nn

from .blocks.attention_pool import AttentionPool
from .blocks.drop_path import linear_drop_rates
from .blocks.patch import PatchEmbed
from .blocks.vit import (ViTBlock, add_prefix, drop_patches, naflex_pos_embed, patch_rope, resample_pos_embed,
                         vit_mlp)
from .config import ROPE_AUGMENT_KEYS, ConfigError, ViTConfig
from .convnet.base import ConvNetBase


class ViT(ConvNetBase):
    """(B, in_chans, H, W) -> logits (B, num_classes); H and W multiples of the patch size (a grid other than the
    config's resamples the position table, as timm's dynamic image size). Or NaFlex: (B, N, p*p*C) patches with
    spatial_shapes (B, 2) and mask (B, N), true on real patches."""
    family = "vit"
    classifier_name = "head"

    def __init__(self, cfg: ViTConfig):
        super().__init__(cfg)
        r = self.spec = self.config.resolved
        dim, self.grid = r["embed_dim"], r["img_size"] // r["patch_size"]
        self.patch_embed = PatchEmbed(self.config.in_chans, dim, r["patch_size"], bias=not r["pre_norm"])
        token = lambda n: nn.Parameter(torch.zeros(1, n, dim))  # noqa: E731
        self.cls_token = token(1) if r["class_token"] else None
        self.dist_token = token(1) if r["distilled"] else None
        self.reg_token = token(r["reg_tokens"]) if r["reg_tokens"] else None
        self.num_prefix_tokens = r["class_token"] + r["distilled"] + r["reg_tokens"]
        self.table_prefix = 0 if r["no_embed_class"] else self.num_prefix_tokens  # prefix rows in the table
        keep_table = not r["rope_theta"] or r["rope_ref_grid"]  # EVA-02: both
        self.pos_embed = token(self.grid ** 2 + self.table_prefix) if keep_table else None
        if not r["rope_theta"] and (on := [k for k in ROPE_AUGMENT_KEYS if getattr(self.config, k)]):
            raise ConfigError(f"model.{on[0]}={getattr(self.config, on[0])} moves RoPE's patch centres: needs "
                             f"model.rope_theta > 0")
        rates = linear_drop_rates(r["depth"], self.config.drop_path_rate)
        eps, hidden = r["norm_eps"], int(dim * r["mlp_ratio"])
        self.blocks = nn.Sequential(*[ViTBlock(dim, r["num_heads"], r["mlp_ratio"], self.config.qkv_bias,
                                               r["init_values"] or None, rate, eps, r["mlp"], r["k_bias"],
                                               bool(r["rope_ref_grid"]), r["mlp_norm"]) for rate in rates])
        self.norm_pre = nn.LayerNorm(dim, eps=eps) if r["pre_norm"] else nn.Identity()
        self.norm = nn.Identity() if r["fc_norm"] else nn.LayerNorm(dim, eps=eps)
        self.fc_norm = nn.LayerNorm(dim, eps=eps) if r["fc_norm"] else nn.Identity()
        self.attn_pool = AttentionPool(dim, r["num_heads"], vit_mlp(dim, hidden, r["mlp"]), eps) \
            if r["global_pool"] == "map" else None
        self.head_drop = nn.Dropout(self.config.drop_rate)
        self.num_features = dim
        self.distilled_training = False  # DeiT's training with a teacher: forward returns both heads in training
        self.reset_parameters()

    def classifier_names(self) -> list:
        return ["head", "head_dist"] if self.spec["distilled"] else ["head"]

    def reset_classifier(self, num_classes: int):
        """Fresh heads (the class head and DeiT's distillation head) with num_classes outputs; 0: none."""
        for name in self.classifier_names():
            setattr(self, name, nn.Linear(self.num_features, num_classes) if num_classes else nn.Identity())
            if num_classes:
                nn.init.normal_(getattr(self, name).weight, std=0.02)
                nn.init.zeros_(getattr(self, name).bias)
        self.config.num_classes = num_classes

    def set_distilled_training(self, enable: bool = True):
        """DeiT trained with a teacher (timm's switch): in training mode `forward` returns the class head's and the
        distillation head's logits apart, (B, num_classes) each; in eval mode still their mean."""
        if enable and not self.spec["distilled"]:
            raise ValueError("set_distilled_training: this ViT has no distillation token (model.distilled)")
        self.distilled_training = enable

    def reset_parameters(self):
        """timm's init: small normal linears, position table and registers, class tokens near zero (timm's
        truncation of the normal lies far outside its spread, so a plain normal draws the same)."""
        self.reset_classifier(self.config.num_classes)
        if self.patch_embed.proj.weight.is_meta:  # built to be loaded or measured: nothing to draw
            return
        for m in [*self.blocks.modules(), *(self.attn_pool.modules() if self.attn_pool else ())]:
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)
                nn.init.zeros_(m.bias) if m.bias is not None else None
        for p in (self.pos_embed, self.dist_token, self.reg_token):
            if p is not None:
                nn.init.normal_(p, std=0.02)
        if self.cls_token is not None:
            nn.init.normal_(self.cls_token, std=1e-6)
        if self.attn_pool is not None:
            nn.init.normal_(self.attn_pool.latent, std=self.num_features ** -0.5)

    def units(self) -> list:
        return list(self.blocks)

    def no_weight_decay(self) -> set:
        """The parameters trained without weight decay besides biases and norms (timm's): the table and tokens."""
        return {"pos_embed", "cls_token", "dist_token", "reg_token"}

    def embed(self, x: torch.Tensor, spatial_shapes=None, mask=None) -> tuple:
        """Images (B, C, H, W), or NaFlex patches (B, N, p*p*C) with their grids `spatial_shapes` (B, 2) and
        `mask` (B, N) -> tokens (B, P + N, D), the RoPE table or None, the attention mask (B, 1, 1, P + N) or None."""
        p, rope, pos = self.spec["patch_size"], None, None
        if x.dim() == 3:  # NaFlex
            if spatial_shapes is None or self.pos_embed is None or self.table_prefix or self.spec["rope_theta"]:
                raise ValueError("patches (B, N, p*p*C) need spatial_shapes and a position table of the patches only")
            patches = self.patch_embed.embed_patches(x)
            pos = naflex_pos_embed(self.pos_embed, (self.grid, self.grid), spatial_shapes, x.shape[1],
                                   self.spec["pos_interp"])
        else:
            patches, hw = self.patch_embed(x), (x.shape[-2] // p, x.shape[-1] // p)
            if self.spec["rope_theta"]:
                rope = patch_rope(self.num_features // self.spec["num_heads"], *hw, self.spec["rope_theta"],
                                  self.num_prefix_tokens, x.device, self.spec["rope_ref_grid"], **self.rope_augment())
            if self.pos_embed is not None:
                pos = resample_pos_embed(self.pos_embed, hw, (self.grid, self.grid), self.table_prefix,
                                         self.spec["pos_interp"])
        tokens = [t for t in (self.cls_token, self.dist_token, self.reg_token) if t is not None]
        x = add_prefix(patches, pos, tokens, not self.spec["no_embed_class"])
        return x, rope, None if mask is None else self.token_mask(mask)[:, None, None]

    def rope_augment(self) -> dict:
        """DINOv3's patch-centre augmentation (model.pos_embed_shift / _jitter / _rescale) in training; none in eval."""
        c = self.config
        return dict(shift=c.pos_embed_shift, jitter=c.pos_embed_jitter, rescale=c.pos_embed_rescale) \
            if self.training else {}

    def token_mask(self, mask: torch.Tensor) -> torch.Tensor:
        """(B, N) patch mask (true, or 1, on real patches) -> (B, P + N) bool, the prefix tokens true."""
        return torch.cat([mask.new_ones(mask.shape[0], self.num_prefix_tokens), mask], 1).bool()

    def forward_features(self, x: torch.Tensor, spatial_shapes=None, mask=None) -> torch.Tensor:
        """(B, in_chans, H, W) (or NaFlex patches, see embed) -> (B, prefix + patches, embed_dim), normalised
        (token and attention pooling)."""
        x, rope, mask = self.embed(x, spatial_shapes, mask)
        if self.training and self.config.patch_drop_rate:
            if mask is not None:
                raise ValueError("model.patch_drop_rate drops patches of whole images, not of NaFlex patch rows")
            x, rope = drop_patches(x, self.config.patch_drop_rate, self.num_prefix_tokens, rope)
        x = self.norm_pre(x)
        for block in self.blocks:
            x = block(x, rope, mask)
        return self.norm(x)

    def pool(self, x: torch.Tensor, mask=None) -> torch.Tensor:
        """(B, prefix + N, D) -> (B, D): the class token, the mean of the (unmasked) patch tokens, or attention
        pooling over them (as timm's, the prefix tokens left out)."""
        kind, n = self.spec["global_pool"], self.num_prefix_tokens
        if kind == "map":
            return self.attn_pool(x[:, n:], None if mask is None else mask.bool())
        if kind == "avg":
            if mask is None:
                return x[:, n:].mean(1)
            w = mask[:, :, None].to(x.dtype)
            return (x[:, n:] * w).sum(1) / w.sum(1)
        return x[:, 0]

    def forward(self, x: torch.Tensor, spatial_shapes=None, mask=None) -> torch.Tensor:
        """(B, in_chans, H, W) (or NaFlex patches, see embed) -> logits (B, num_classes), or the pooled features
        (num_classes 0); DeiT distilled: the two heads' mean, or both apart in distilled training."""
        x = self.forward_features(x, spatial_shapes, mask)
        if self.spec["distilled"]:
            x, x_dist = self.head(self.head_drop(x[:, 0])), self.head_dist(self.head_drop(x[:, 1]))
            return (x, x_dist) if self.distilled_training and self.training else (x + x_dist) / 2
        return self.head(self.head_drop(self.fc_norm(self.pool(x, mask))))

    def flops_per_image(self, image_size: int) -> float:
        """Training FLOPs per image: the linears' and the patch conv's (ConvNetBase's count) plus attention's
        two token-by-token matmuls per block, forward and backward."""
        tokens = (image_size // self.spec["patch_size"]) ** 2 + self.num_prefix_tokens
        return super().flops_per_image(image_size) + 12.0 * tokens ** 2 * self.num_features * len(self.blocks)

