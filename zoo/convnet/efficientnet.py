"""EfficientNet-B0 to B7 built from zoo/blocks, and the stage builder MobileNetV3 shares.

    image (B, C, H, W) -> conv_stem 3x3/2, BN, SiLU -> 7 stages of MBConv blocks with
    squeeze-excitation -> conv_head 1x1, BN, SiLU -> pool -> dropout -> classifier -> logits (B, num_classes)

Paper: Tan & Le, "EfficientNet: Rethinking Model Scaling for Convolutional Neural Networks" (2019). B1-B7 scale B0
(EFFICIENTNET_ARCHS). Parameter names are timm's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from ..blocks.drop_path import linear_drop_rates
from ..blocks.mbconv import DepthwiseSeparable, MBConv
from ..config import ConvNetConfig
from .base import ConvNetBase


@dataclass(frozen=True)
class Blocks:
    """`repeats` blocks of one kind: ds (depthwise-separable), ir (MBConv) or cn (1x1 conv, BN, act)."""
    kind: str
    repeats: int
    kernel: int
    stride: int
    expand: float
    channels: int
    se: float = 0.0              # SE bottleneck as a fraction (0: none)
    act: Optional[str] = None    # "relu" where the model's default activation is not used


# B0: a stage per row (the paper's table 1, stages 2-8)
STAGES = [
    [Blocks("ds", 1, 3, 1, 1, 16, 0.25)],
    [Blocks("ir", 2, 3, 2, 6, 24, 0.25)],
    [Blocks("ir", 2, 5, 2, 6, 40, 0.25)],
    [Blocks("ir", 3, 3, 2, 6, 80, 0.25)],
    [Blocks("ir", 3, 5, 1, 6, 112, 0.25)],
    [Blocks("ir", 4, 5, 2, 6, 192, 0.25)],
    [Blocks("ir", 1, 3, 1, 6, 320, 0.25)],
]


def make_divisible(v: float, divisor: int = 8) -> int:
    """The multiple of `divisor` nearest to v, never below 90% of v (nor below divisor)."""
    new = max(divisor, int(v + divisor / 2) // divisor * divisor)
    return new + divisor if new < 0.9 * v else new


def scale_depth(stage: list, mult: float) -> list:
    """A stage's repeats times `mult`, rounded up over the stage and shared out over its rows from the
    last row back (so the first row, often the strided one, grows last), each row keeping >= 1."""
    total = sum(b.repeats for b in stage)
    left = math.ceil(total * mult)
    out = []
    for b in reversed(stage):
        n = max(1, round(b.repeats / total * left))
        out.append(n)
        total, left = total - b.repeats, left - n
    return out[::-1]


class ConvBnAct(nn.Module):
    """1x1 conv -> BN -> act (MobileNetV3's last stage): (B, c_in, H, W) -> (B, c_out, H, W)."""

    def __init__(self, c_in: int, c_out: int, act, bn_eps: float):
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out, eps=bn_eps)
        self.act = act(inplace=True)

    def forward(self, x):
        return self.act(self.bn1(self.conv(x)))


def build_stages(stages: list, c_in: int, width_mult: float, depth_mult: float, act, se_rd, se_act, se_gate,
                 drop_path_rate: float, bn_eps: float) -> tuple[nn.Sequential, int]:
    """The blocks of `stages` (lists of Blocks rows), scaled -> (nn.Sequential of stages, out channels).
    The first block of a stage takes its row's stride; se_rd(c_in, mid, ratio) gives an SE's bottleneck
    width; a row's act "relu" replaces the default `act` by nn.ReLU."""
    n_blocks = sum(sum(scale_depth(stage, depth_mult)) for stage in stages)
    rates = iter(linear_drop_rates(n_blocks, drop_path_rate))
    out = []
    for stage in stages:
        blocks = []
        for b, n in zip(stage, scale_depth(stage, depth_mult)):
            c_out = make_divisible(b.channels * width_mult)
            a = nn.ReLU if b.act == "relu" else act
            for _ in range(n):
                stride, rate = (b.stride if not blocks else 1), next(rates)
                if b.kind == "cn":
                    blocks.append(ConvBnAct(c_in, c_out, a, bn_eps))
                else:
                    mid = c_in if b.kind == "ds" else make_divisible(c_in * b.expand)
                    kw = dict(kernel=b.kernel, stride=stride, act=a, se_channels=se_rd(c_in, mid, b.se) if b.se else 0,
                              se_act=se_act, se_gate=se_gate, drop_path=rate, bn_eps=bn_eps)
                    blocks.append(DepthwiseSeparable(c_in, c_out, **kw) if b.kind == "ds" else
                                  MBConv(c_in, c_out, mid, **kw))
                c_in = c_out
        out.append(nn.Sequential(*blocks))
    return nn.Sequential(*out), c_in


def init_mobile(model: nn.Module):
    """Convs: normal with std sqrt(2 / fan_out), fan_out = k * k * c_out / groups (He init counted per
    group, as the EfficientNet reference); BN 1 / 0; biases 0."""
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            fan_out = m.kernel_size[0] * m.kernel_size[1] * m.out_channels // m.groups
            nn.init.normal_(m.weight, 0.0, math.sqrt(2.0 / fan_out))
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


class MobileNetBase(ConvNetBase):
    """What EfficientNet and MobileNetV3 share: timm's names (conv_stem, bn1, act1, blocks.i.j,
    classifier), init_mobile, and the blocks as the units."""
    classifier_name = "classifier"

    def reset_parameters(self):
        if self.conv_stem.weight.is_meta:  # built to be loaded or measured: nothing to draw
            return
        init_mobile(self)
        if self.config.zero_init_last:
            self.zero_init_last_bn()
        self.reset_classifier(self.config.num_classes)

    def units(self) -> list:
        return [block for stage in self.blocks for block in stage]

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """The stem and the blocks: (B, in_chans, H, W) -> (B, C, H / 32, W / 32) (imagenet stem) or / 16 (small)."""
        x = self.act1(self.bn1(self.conv_stem(x)))
        for block in self.units():
            x = block(x)
        return x


class EfficientNet(MobileNetBase):
    def __init__(self, cfg: ConvNetConfig):
        super().__init__(cfg)
        cfg = self.config
        wm, dm = cfg.resolved_width_mult, cfg.resolved_depth_mult
        stem = make_divisible(32 * wm)
        self.conv_stem = nn.Conv2d(cfg.in_chans, stem, 3, 2 if cfg.stem == "imagenet" else 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(stem, eps=cfg.bn_eps)
        self.act1 = nn.SiLU(inplace=True)
        self.blocks, c = build_stages(STAGES, stem, wm, dm, nn.SiLU, lambda c_in, mid, r: max(1, round(c_in * r)),
                                      nn.SiLU, nn.Sigmoid, cfg.drop_path_rate, cfg.bn_eps)
        self.num_features = make_divisible(1280 * wm)
        self.conv_head = nn.Conv2d(c, self.num_features, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(self.num_features, eps=cfg.bn_eps)
        self.act2 = nn.SiLU(inplace=True)
        self.head_drop = nn.Dropout(cfg.drop_rate) if cfg.drop_rate > 0 else nn.Identity()
        self.classifier = nn.Linear(self.num_features, cfg.num_classes)
        self.reset_parameters()

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """(B, in_chans, H, W) -> (B, num_features, H / 32, W / 32) (imagenet stem) or / 16 (small)."""
        return self.act2(self.bn2(self.conv_head(super().forward_features(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, in_chans, H, W) -> logits (B, num_classes)."""
        return self.classifier(self.head_drop(self.forward_features(x).mean((2, 3))))
