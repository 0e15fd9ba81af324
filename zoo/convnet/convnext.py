"""ConvNeXt V1 and V2 (atto to xxlarge, timm's sizes) built from zoo/blocks.

    image (B, C, H, W) -> stem (4x4/4 patchify conv, LayerNorm2d) -> 4 stages of ConvNeXt blocks
    (downsampling between them) -> global average pool -> LayerNorm -> fc -> logits (B, num_classes)

    block:  x + drop_path(gamma * fc2(act(fc1(LayerNorm(dwconv7x7(x))))))       (V1, layer scale gamma)
            x + drop_path(fc2(GRN(act(fc1(LayerNorm(dwconv7x7(x)))))))           (V2, no layer scale)

Papers: Liu et al., "A ConvNet for the 2020s" (2022); Woo et al., "ConvNeXt V2" (2023). The `small` stem is a 1x1
patchify for 32x32 inputs. Parameter names and shapes are timm's: its atto to nano sizes hold the MLP's weights as 1x1
convs' (PointwiseConv, the same computation).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..blocks.drop_path import DropPath, linear_drop_rates
from ..blocks.grn import GRN
from ..blocks.layernorm2d import LayerNorm2d
from ..config import CONVNEXT_ARCHS, ConvNetConfig
from .base import ConvNetBase

LAYER_SCALE_INIT = 1e-6  # V1: the residual branches start scaled by 1e-6 (the paper's value)
NORM_EPS = {"convnext_xxlarge": 1e-5}  # timm's LayerNorm epsilon where it is not 1e-6


class PointwiseConv(nn.Conv2d):
    """A 1x1 conv's weights (c_out, c_in, 1, 1) applied to (B, H, W, C) as the linear layer they are."""

    def __init__(self, c_in: int, c_out: int):
        super().__init__(c_in, c_out, 1)

    def forward(self, x):
        return F.linear(x, self.weight.flatten(1), self.bias)


class Mlp(nn.Module):
    """fc1 -> GELU (-> GRN, V2) -> fc2 over (B, H, W, C); `conv`: the weights held as 1x1 convs'."""

    def __init__(self, dim: int, hidden: int, grn: bool, conv: bool = False):
        super().__init__()
        fc = PointwiseConv if conv else nn.Linear
        self.fc1 = fc(dim, hidden)
        self.act = nn.GELU()
        self.grn = GRN(hidden) if grn else nn.Identity()
        self.fc2 = fc(hidden, dim)

    def forward(self, x):
        return self.fc2(self.grn(self.act(self.fc1(x))))


class ConvNeXtBlock(nn.Module):
    """(B, C, H, W) -> (B, C, H, W)."""

    def __init__(self, dim: int, version: int, drop_path: float = 0.0, conv_mlp: bool = False, eps: float = 1e-6):
        super().__init__()
        self.conv_dw = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=eps)
        self.mlp = Mlp(dim, 4 * dim, grn=version == 2, conv=conv_mlp)
        self.gamma = nn.Parameter(torch.full((dim,), LAYER_SCALE_INIT)) if version == 1 else None
        self.drop_path = DropPath(drop_path)

    def forward(self, x):
        shortcut = x
        x = self.mlp(self.norm(self.conv_dw(x).permute(0, 2, 3, 1)))  # (B, H, W, C)
        if self.gamma is not None:
            x = x * self.gamma
        return self.drop_path(x.permute(0, 3, 1, 2)) + shortcut


class Stage(nn.Module):
    def __init__(self, c_in: int, c_out: int, version: int, rates: list, downsample: bool, conv_mlp: bool,
                 eps: float):
        super().__init__()
        self.downsample = nn.Sequential(LayerNorm2d(c_in, eps), nn.Conv2d(c_in, c_out, 2, stride=2)) if downsample \
            else nn.Identity()
        self.blocks = nn.Sequential(*[ConvNeXtBlock(c_out, version, r, conv_mlp, eps) for r in rates])


class Head(nn.Module):
    def __init__(self, dim: int, num_classes: int, drop_rate: float, eps: float):
        super().__init__()
        self.norm = nn.LayerNorm(dim, eps=eps)
        self.drop = nn.Dropout(drop_rate) if drop_rate > 0 else nn.Identity()
        self.fc = nn.Linear(dim, num_classes)

    def forward(self, x):
        """(B, C, H, W) -> logits (B, num_classes)."""
        return self.fc(self.drop(self.norm(x.mean((2, 3)))))


class ConvNeXt(ConvNetBase):
    classifier_name = "head.fc"

    def __init__(self, cfg: ConvNetConfig):
        super().__init__(cfg)
        cfg = self.config
        version, conv_mlp = CONVNEXT_ARCHS[cfg.arch][0], CONVNEXT_ARCHS[cfg.arch][3]
        eps = NORM_EPS.get(cfg.arch, 1e-6)
        depths, w = cfg.resolved_layers, cfg.resolved_width
        dims = [w * 2 ** i for i in range(len(depths))]
        patch = 4 if cfg.stem == "imagenet" else 1
        self.stem = nn.Sequential(nn.Conv2d(cfg.in_chans, w, patch, stride=patch), LayerNorm2d(w, eps))
        rates = linear_drop_rates(sum(depths), cfg.drop_path_rate)
        self.stages = nn.Sequential(*[
            Stage(dims[max(i - 1, 0)], dims[i], version, rates[sum(depths[:i]):sum(depths[:i + 1])], i > 0, conv_mlp,
                  eps) for i in range(len(depths))])
        self.num_features = dims[-1]
        self.head = Head(dims[-1], cfg.num_classes, cfg.drop_rate, eps)
        self.reset_parameters()

    def reset_parameters(self):
        """Normal (std 0.02) weights and zero biases for convs and linears, as the paper."""
        if self.stem[0].weight.is_meta:  # built to be loaded or measured: nothing to draw
            return
        for m in self.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                nn.init.normal_(m.weight, std=0.02)
                nn.init.zeros_(m.bias)
        self.reset_classifier(self.config.num_classes)

    def units(self) -> list:
        return [block for stage in self.stages for block in stage.blocks]

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """(B, in_chans, H, W) -> (B, num_features, H / 32, W / 32) (imagenet stem) or / 8 (small)."""
        x = self.stem(x)
        for stage in self.stages:
            x = stage.downsample(x)
            for block in stage.blocks:
                x = block(x)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, in_chans, H, W) -> logits (B, num_classes)."""
        return self.head(self.forward_features(x))
