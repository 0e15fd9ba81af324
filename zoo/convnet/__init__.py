"""The ConvNet family: ResNet, ConvNeXt (V1, V2, atto to xxlarge), EfficientNet (B0-B7) and MobileNetV3
(small, large), one config (zoo/config.py's ConvNetConfig) whose `arch`, a timm name, picks the class.

    model = zoo.build({"family": "convnet", "model": {"arch": "convnext_tiny", "num_classes": 10}})
    model = zoo.convnet.build(ConvNetConfig(arch="efficientnet_b0"))
"""
from __future__ import annotations

from ..config import RESNET_ARCHS, ConvNetConfig  # noqa: F401 (RESNET_ARCHS: the ResNet presets)
from .base import ConvNetBase
from .convnext import ConvNeXt
from .efficientnet import EfficientNet
from .mobilenetv3 import MobileNetV3
from .resnet import BasicBlock, Bottleneck, ResNet, conv_bn  # noqa: F401

CLASSES = {"resnet": ResNet, "convnext": ConvNeXt, "efficientnet": EfficientNet, "mobilenetv3": MobileNetV3}


def build(cfg: ConvNetConfig) -> ConvNetBase:
    """The model `cfg.arch` names (its kind: resnet, convnext, efficientnet or mobilenetv3)."""
    return CLASSES[cfg.kind](cfg)
