"""MobileNetV3 small and large built from zoo/blocks.

    image (B, C, H, W) -> conv_stem 3x3/2, BN, hard-swish -> stages of MBConv blocks (ReLU early,
    hard-swish later; SE with a hard-sigmoid gate) -> 1x1 conv, BN, hard-swish -> pool ->
    conv_head 1x1, hard-swish -> dropout -> classifier -> logits (B, num_classes)

Paper: Howard et al., "Searching for MobileNetV3" (2019). `model.width_mult` scales every stage (timm's
mobilenetv3_*_100/075/050). Parameter names are timm's.
"""
from __future__ import annotations

import torch
from torch import nn

from ..blocks.hard_swish import HardSigmoid, HardSwish
from ..config import MOBILENETV3_ARCHS, ConvNetConfig
from .efficientnet import Blocks, MobileNetBase, build_stages, make_divisible

R = "relu"
STAGES = {
    "large": [
        [Blocks("ds", 1, 3, 1, 1, 16, act=R)],
        [Blocks("ir", 1, 3, 2, 4, 24, act=R), Blocks("ir", 1, 3, 1, 3, 24, act=R)],
        [Blocks("ir", 3, 5, 2, 3, 40, 0.25, act=R)],
        [Blocks("ir", 1, 3, 2, 6, 80), Blocks("ir", 1, 3, 1, 2.5, 80), Blocks("ir", 2, 3, 1, 2.3, 80)],
        [Blocks("ir", 2, 3, 1, 6, 112, 0.25)],
        [Blocks("ir", 3, 5, 2, 6, 160, 0.25)],
        [Blocks("cn", 1, 1, 1, 1, 960)],
    ],
    "small": [
        [Blocks("ds", 1, 3, 2, 1, 16, 0.25, act=R)],
        [Blocks("ir", 1, 3, 2, 4.5, 24, act=R), Blocks("ir", 1, 3, 1, 3.67, 24, act=R)],
        [Blocks("ir", 1, 5, 2, 4, 40, 0.25), Blocks("ir", 2, 5, 1, 6, 40, 0.25)],
        [Blocks("ir", 2, 5, 1, 3, 48, 0.25)],
        [Blocks("ir", 3, 5, 2, 6, 96, 0.25)],
        [Blocks("cn", 1, 1, 1, 1, 576)],
    ],
}
HEAD_FEATURES = {"large": 1280, "small": 1024}


class MobileNetV3(MobileNetBase):
    def __init__(self, cfg: ConvNetConfig):
        super().__init__(cfg)
        cfg = self.config
        size = MOBILENETV3_ARCHS[cfg.arch][0]
        wm, dm = cfg.resolved_width_mult, cfg.resolved_depth_mult
        stem = 16 if wm < 0.75 else make_divisible(16 * wm)
        self.conv_stem = nn.Conv2d(cfg.in_chans, stem, 3, 2 if cfg.stem == "imagenet" else 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(stem, eps=cfg.bn_eps)
        self.act1 = HardSwish()
        self.blocks, c = build_stages(STAGES[size], stem, wm, dm, HardSwish,
                                      lambda c_in, mid, r: make_divisible(mid * r), nn.ReLU, HardSigmoid,
                                      cfg.drop_path_rate, cfg.bn_eps)
        self.num_features = HEAD_FEATURES[size]
        self.conv_head = nn.Conv2d(c, self.num_features, 1, bias=True)  # no BatchNorm follows
        self.act2 = HardSwish()
        self.head_drop = nn.Dropout(cfg.drop_rate) if cfg.drop_rate > 0 else nn.Identity()
        self.classifier = nn.Linear(self.num_features, cfg.num_classes)
        self.reset_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, in_chans, H, W) -> logits (B, num_classes)."""
        x = self.act2(self.conv_head(self.forward_features(x).mean((2, 3), keepdim=True))).flatten(1)
        return self.classifier(self.head_drop(x))
