"""Squeeze-and-Excitation: reweight the channels of a feature map by a gate computed from their global averages.

Paper: Hu, Shen & Sun, "Squeeze-and-Excitation Networks" (2018); inside EfficientNet's (sigmoid gate) and MobileNetV3's
(hard-sigmoid gate) MBConv blocks.

    s = gate(conv_expand(act(conv_reduce(mean over H, W of x))))      out = x * s

Shapes: x (B, C, H, W) -> (B, C, H, W); the gate s is (B, C, 1, 1). Parameter names are timm's.
"""
from torch import nn


class SqueezeExcite(nn.Module):
    def __init__(self, channels: int, rd_channels: int, act=nn.ReLU, gate=nn.Sigmoid):
        super().__init__()
        self.conv_reduce = nn.Conv2d(channels, rd_channels, 1, bias=True)
        self.act1 = act()  # not in place: selective checkpointing keeps conv_reduce's output
        self.conv_expand = nn.Conv2d(rd_channels, channels, 1, bias=True)
        self.gate = gate()

    def forward(self, x):
        s = x.mean((2, 3), keepdim=True)
        return x * self.gate(self.conv_expand(self.act1(self.conv_reduce(s))))
