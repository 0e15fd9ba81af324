"""ResNet family (ResNet-18/34/50/101/152, ResNeXt and wide variants) built from zoo/blocks.

    image (B, C, H, W) -> stem -> layer1..layer4 -> global average pool -> fc -> logits (B, num_classes)

Paper: He et al., "Deep Residual Learning for Image Recognition" (2015), stride on the 3x3 conv ("ResNet v1.5").
Stems "imagenet" (7x7/2 + max-pool), "small" (3x3/1, 32x32 images), and timm's "deep" / "deep_tiered" (three 3x3
convs + max-pool: resnet*c/d/t, Bag of Tricks, He et al. 2018) with `avg_down` (2x2 average pool before a strided
shortcut's 1x1 conv), and timm's channel attention after each block's last BN (`channel_attn`: SE-ResNet / ResNeXt,
Hu et al. 2018; ECA-ResNet, Wang et al. 2020). Parameter names are timm's and torchvision's.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..blocks.drop_path import DropPath, linear_drop_rates
from ..blocks.se import EfficientChannelAttention, SqueezeExcite
from ..config import RESNET_ARCHS, ConvNetConfig  # noqa: F401 (RESNET_ARCHS: the presets)
from .base import ConvNetBase


def conv_bn(c_in: int, c_out: int, k: int, stride: int = 1, groups: int = 1):
    """A conv that feeds a BatchNorm: no bias, 'same' padding for odd k."""
    return nn.Conv2d(c_in, c_out, k, stride=stride, padding=k // 2, groups=groups, bias=False)


def residual(block, x):
    """shortcut + the block's branch under stochastic depth: the dropped samples' rows computed and zeroed
    (`drop_path_mode: mask`) or never computed (`skip`, `batch`), see zoo/blocks/drop_path.py."""
    shortcut = x if block.downsample is None else block.downsample(x)
    dp = block.drop_path
    if dp.mode != "mask":
        return dp.residual(shortcut, block.branch, x)
    x = dp(block.branch(x))
    x += shortcut  # in place: BN's backward does not need its output
    return x


def channel_attention(kind: str, channels: int) -> Optional[nn.Module]:
    """timm's `attn_layer` of a ResNet block, after its last BN: SE (fc1 / fc2, a 16x reduction rounded to multiples
    of 8: seresnet*, seresnext*), ECA (ecaresnet*), or none."""
    if kind == "se":
        return SqueezeExcite(channels, max(8, (channels // 16 + 4) // 8 * 8), names=("fc1", "fc2"))
    return EfficientChannelAttention(channels) if kind == "eca" else None


class BasicBlock(nn.Module):
    """Two 3x3 convs: (B, c_in, H, W) -> (B, planes, H/stride, W/stride)."""
    expansion = 1

    def __init__(self, c_in: int, planes: int, stride: int = 1, downsample: Optional[nn.Module] = None,
                 groups: int = 1, width_per_group: int = 64, drop_path: float = 0.0, bn_eps: float = 1e-5,
                 drop_path_mode: str = "mask", channel_attn: str = "none"):
        super().__init__()
        if groups != 1 or width_per_group != 64:
            raise ValueError("BasicBlock supports only groups=1 and width_per_group=64")
        self.conv1 = conv_bn(c_in, planes, 3, stride)
        self.bn1 = nn.BatchNorm2d(planes, eps=bn_eps)
        self.act1 = nn.ReLU(inplace=True)
        self.conv2 = conv_bn(planes, planes, 3)
        self.bn2 = nn.BatchNorm2d(planes, eps=bn_eps)
        self.se = channel_attention(channel_attn, planes)
        self.act2 = nn.ReLU(inplace=True)
        self.downsample = downsample
        self.drop_path = DropPath(drop_path, drop_path_mode)

    def last_bn(self) -> nn.BatchNorm2d:
        return self.bn2

    def branch(self, x):
        x = self.bn2(self.conv2(self.act1(self.bn1(self.conv1(x)))))
        return x if self.se is None else self.se(x)

    def forward(self, x):
        return self.act2(residual(self, x))


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (grouped, strided), 1x1 expand: (B, c_in, H, W) -> (B, 4 * planes, H/s, W/s)."""
    expansion = 4

    def __init__(self, c_in: int, planes: int, stride: int = 1, downsample: Optional[nn.Module] = None,
                 groups: int = 1, width_per_group: int = 64, drop_path: float = 0.0, bn_eps: float = 1e-5,
                 drop_path_mode: str = "mask", channel_attn: str = "none"):
        super().__init__()
        width = int(planes * width_per_group / 64) * groups
        self.conv1 = conv_bn(c_in, width, 1)
        self.bn1 = nn.BatchNorm2d(width, eps=bn_eps)
        self.act1 = nn.ReLU(inplace=True)
        self.conv2 = conv_bn(width, width, 3, stride, groups)
        self.bn2 = nn.BatchNorm2d(width, eps=bn_eps)
        self.act2 = nn.ReLU(inplace=True)
        self.conv3 = conv_bn(width, planes * 4, 1)
        self.bn3 = nn.BatchNorm2d(planes * 4, eps=bn_eps)
        self.se = channel_attention(channel_attn, planes * 4)
        self.act3 = nn.ReLU(inplace=True)
        self.downsample = downsample
        self.drop_path = DropPath(drop_path, drop_path_mode)

    def last_bn(self) -> nn.BatchNorm2d:
        return self.bn3

    def branch(self, x):
        x = self.act1(self.bn1(self.conv1(x)))
        x = self.act2(self.bn2(self.conv2(x)))
        x = self.bn3(self.conv3(x))
        return x if self.se is None else self.se(x)

    def forward(self, x):
        return self.act3(residual(self, x))


BLOCKS = {"basic": BasicBlock, "bottleneck": Bottleneck}


def deep_stem(c_in: int, width: int, tiered: bool, bn_eps: float) -> nn.Sequential:
    """timm's three 3x3 convs (the first strided), BN + ReLU between, no BN after the last (the model's bn1):
    widths width/2, width/2, width (`deep`) or 3*width/8, width/2, width (`deep_tiered`)."""
    half = width // 2
    mid = 3 * (half // 4) if tiered else half
    return nn.Sequential(conv_bn(c_in, mid, 3, 2), nn.BatchNorm2d(mid, eps=bn_eps), nn.ReLU(inplace=True),
                         conv_bn(mid, half, 3), nn.BatchNorm2d(half, eps=bn_eps), nn.ReLU(inplace=True),
                         conv_bn(half, width, 3))


def shortcut(c_in: int, c_out: int, stride: int, avg_down: bool, bn_eps: float) -> nn.Sequential:
    """The projection shortcut: a strided 1x1 conv + BN, or with `avg_down` a 2x2 average pool (when strided; timm's
    ceil mode, padding not counted) then a stride-1 1x1 conv + BN, under timm's indices (downsample.1 / .2)."""
    if not avg_down:
        return nn.Sequential(conv_bn(c_in, c_out, 1, stride), nn.BatchNorm2d(c_out, eps=bn_eps))
    pool = nn.AvgPool2d(2, stride, ceil_mode=True, count_include_pad=False) if stride != 1 else nn.Identity()
    return nn.Sequential(pool, conv_bn(c_in, c_out, 1), nn.BatchNorm2d(c_out, eps=bn_eps))


def stem_conv(cfg: ConvNetConfig, width: int) -> nn.Module:
    """conv1 of each stem: 7x7/2 (imagenet), 3x3/1 (small), or the three convs of deep / deep_tiered."""
    if cfg.stem == "imagenet":
        return conv_bn(cfg.in_chans, width, 7, stride=2)
    if cfg.stem == "small":
        return conv_bn(cfg.in_chans, width, 3)
    return deep_stem(cfg.in_chans, width, cfg.stem == "deep_tiered", cfg.bn_eps)


class ResNet(ConvNetBase):
    def __init__(self, cfg: ConvNetConfig):
        super().__init__(cfg)
        cfg = self.config
        block, layers, w = BLOCKS[cfg.resolved_block], cfg.resolved_layers, cfg.resolved_width
        self.conv1 = stem_conv(cfg, w)
        self.bn1 = nn.BatchNorm2d(w, eps=cfg.bn_eps)
        self.act1 = nn.ReLU(inplace=True)
        self.maxpool = nn.Identity() if cfg.stem == "small" else nn.MaxPool2d(3, stride=2, padding=1)

        rates = iter(linear_drop_rates(sum(layers), cfg.drop_path_rate))
        c_in = w
        for i, n in enumerate(layers):
            planes, stride = w * 2 ** i, 1 if i == 0 else 2
            c_out = planes * block.expansion
            blocks = []
            for j in range(n):
                s = stride if j == 0 else 1
                down = shortcut(c_in, c_out, s, cfg.avg_down, cfg.bn_eps) if s != 1 or c_in != c_out else None
                blocks.append(block(c_in, planes, s, down, cfg.resolved_groups, cfg.resolved_width_per_group,
                                    next(rates), cfg.bn_eps, cfg.drop_path_mode, cfg.channel_attn))
                c_in = c_out
            self.add_module(f"layer{i + 1}", nn.Sequential(*blocks))
        self.num_features = c_in
        self.head_drop = nn.Dropout(cfg.drop_rate) if cfg.drop_rate > 0 else nn.Identity()
        self.fc = nn.Linear(c_in, cfg.num_classes)
        self.reset_parameters()

    def stages(self):
        return [getattr(self, f"layer{i + 1}") for i in range(len(self.config.resolved_layers))]

    def reset_parameters(self):
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        if self.config.zero_init_last:
            self.zero_init_last_bn()
        self.reset_classifier(self.config.num_classes)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """(B, in_chans, H, W) -> (B, num_features, H / 32, W / 32) (imagenet, deep stems) or / 8 (small)."""
        x = self.maxpool(self.act1(self.bn1(self.conv1(x))))
        for block in self.units():
            x = block(x)
        return x

    def units(self) -> list:
        return [block for stage in self.stages() for block in stage]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, in_chans, H, W) -> logits (B, num_classes)."""
        x = self.forward_features(x).mean((2, 3))
        return self.fc(self.head_drop(x))
