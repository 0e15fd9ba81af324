"""The Vision Transformer family: ViT (tiny to huge, every patch size), DeiT (with its distillation token), DINOv2-style
ViTs with LayerScale and registers; one config (zoo/config.py's ViTConfig) whose `arch`, a timm name, picks the preset.

    image (B, C, H, W) -> patch_embed (p x p conv) -> [class, distillation, register tokens] + position table
    -> blocks (pre-norm attention + MLP) -> norm -> class token (or mean of patch tokens -> fc_norm) -> head -> logits

Papers: Dosovitskiy et al., "An Image is Worth 16x16 Words" (2021); Touvron et al., "Training data-efficient image
transformers & distillation through attention" (2021); Darcet et al., "Vision Transformers Need Registers" (2024).
A file of its own beside the ConvNets (not in zoo/convnet/): its own config keys, one class for every variant.
Parameter names are timm's VisionTransformer's (and VisionTransformerDistilled's), so its weights map one to one.

    model = zoo.build({"family": "vit", "model": {"arch": "vit_tiny_patch16_224", "num_classes": 10}})
"""
from __future__ import annotations

import torch
from torch import nn

from .blocks.drop_path import linear_drop_rates
from .blocks.patch import PatchEmbed
from .blocks.vit import ViTBlock, add_prefix, resample_pos_embed
from .config import ViTConfig
from .convnet.base import ConvNetBase


class ViT(ConvNetBase):
    """(B, in_chans, H, W) -> logits (B, num_classes); H and W multiples of the patch size (a grid other than the
    config's resamples the position table, as timm's dynamic image size)."""
    family = "vit"
    classifier_name = "head"

    def __init__(self, cfg: ViTConfig):
        super().__init__(cfg)
        r = self.spec = self.config.resolved
        dim, self.grid = r["embed_dim"], r["img_size"] // r["patch_size"]
        self.patch_embed = PatchEmbed(self.config.in_chans, dim, r["patch_size"])
        token = lambda n: nn.Parameter(torch.zeros(1, n, dim))  # noqa: E731
        self.cls_token = token(1) if r["class_token"] else None
        self.dist_token = token(1) if r["distilled"] else None
        self.reg_token = token(r["reg_tokens"]) if r["reg_tokens"] else None
        self.num_prefix_tokens = r["class_token"] + r["distilled"] + r["reg_tokens"]
        self.pos_embed = token(self.grid ** 2 + (0 if r["no_embed_class"] else self.num_prefix_tokens))
        rates = linear_drop_rates(r["depth"], self.config.drop_path_rate)
        self.blocks = nn.Sequential(*[ViTBlock(dim, r["num_heads"], r["mlp_ratio"], self.config.qkv_bias,
                                               r["init_values"] or None, rate) for rate in rates])
        avg = r["global_pool"] == "avg"
        self.norm = nn.Identity() if avg else nn.LayerNorm(dim, eps=1e-6)
        self.fc_norm = nn.LayerNorm(dim, eps=1e-6) if avg else nn.Identity()
        self.head_drop = nn.Dropout(self.config.drop_rate)
        self.num_features = dim
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

    def reset_parameters(self):
        """timm's init: small normal linears, position table and registers, class tokens near zero (timm's
        truncation of the normal lies far outside its spread, so a plain normal draws the same)."""
        self.reset_classifier(self.config.num_classes)
        if self.pos_embed.is_meta:  # built to be loaded or measured: nothing to draw
            return
        for m in self.blocks.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)
                nn.init.zeros_(m.bias) if m.bias is not None else None
        for p in (self.pos_embed, self.dist_token, self.reg_token):
            if p is not None:
                nn.init.normal_(p, std=0.02)
        if self.cls_token is not None:
            nn.init.normal_(self.cls_token, std=1e-6)

    def units(self) -> list:
        return list(self.blocks)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """(B, in_chans, H, W) -> (B, prefix + H*W / p^2, embed_dim), normalised (token pool)."""
        p = self.spec["patch_size"]
        n_prefix = 0 if self.spec["no_embed_class"] else self.num_prefix_tokens
        pos = resample_pos_embed(self.pos_embed, (x.shape[-2] // p, x.shape[-1] // p), (self.grid, self.grid), n_prefix)
        tokens = [t for t in (self.cls_token, self.dist_token, self.reg_token) if t is not None]
        x = add_prefix(self.patch_embed(x), pos, tokens, not self.spec["no_embed_class"])
        return self.norm(self.blocks(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, in_chans, H, W) -> logits (B, num_classes); DeiT distilled: the two heads' mean."""
        x = self.forward_features(x)
        if self.spec["distilled"]:
            return (self.head(self.head_drop(x[:, 0])) + self.head_dist(self.head_drop(x[:, 1]))) / 2
        pooled = x[:, self.num_prefix_tokens:].mean(1) if self.spec["global_pool"] == "avg" else x[:, 0]
        return self.head(self.head_drop(self.fc_norm(pooled)))

    def flops_per_image(self, image_size: int) -> float:
        """Training FLOPs per image: the linears' and the patch conv's (ConvNetBase's count) plus attention's
        two token-by-token matmuls per block, forward and backward."""
        tokens = (image_size // self.spec["patch_size"]) ** 2 + self.num_prefix_tokens
        return super().flops_per_image(image_size) + 12.0 * tokens ** 2 * self.num_features * len(self.blocks)

