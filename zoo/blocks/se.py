"""Channel attention: reweight the channels of a feature map by a gate computed from their global averages.

    SqueezeExcite (Hu, Shen & Sun, "Squeeze-and-Excitation Networks", 2018):
        s = gate(expand(act(reduce(mean over H, W of x))))          out = x * s
    inside EfficientNet's (sigmoid gate) and MobileNetV3's (hard-sigmoid gate) MBConv blocks, and SE-ResNets.
    EfficientChannelAttention (Wang et al., "ECA-Net", 2020): s = sigmoid(conv1d_k(mean over H, W of x)) across
    the channels, k = the odd number nearest (log2(C) + 1) / 2, at least 3; ECA-ResNets.

Shapes: x (B, C, H, W) -> (B, C, H, W); the gate s is (B, C, 1, 1). Parameter names are timm's: SqueezeExcite's
convs are conv_reduce / conv_expand in MBConv blocks and fc1 / fc2 in ResNets (`names`).
"""
import math

from torch import nn


class SqueezeExcite(nn.Module):
    def __init__(self, channels: int, rd_channels: int, act=nn.ReLU, gate=nn.Sigmoid,
                 names: tuple = ("conv_reduce", "conv_expand")):
        super().__init__()
        self.names = names
        setattr(self, names[0], nn.Conv2d(channels, rd_channels, 1, bias=True))
        self.act1 = act()  # not in place: selective checkpointing keeps the reducing conv's output
        setattr(self, names[1], nn.Conv2d(rd_channels, channels, 1, bias=True))
        self.gate = gate()

    def forward(self, x):
        reduce, expand = (getattr(self, n) for n in self.names)
        return x * self.gate(expand(self.act1(reduce(x.mean((2, 3), keepdim=True)))))


class EfficientChannelAttention(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        t = int(abs(math.log(channels, 2) + 1) / 2)  # as the paper's and timm's code compute it
        k = max(t if t % 2 else t + 1, 3)
        self.conv = nn.Conv1d(1, 1, k, padding=k // 2, bias=False)
        self.gate = nn.Sigmoid()

    def forward(self, x):
        s = self.conv(x.mean((2, 3))[:, None])  # (B, 1, C): the channels are the 1-D conv's sequence
        return x * self.gate(s).view(x.shape[0], -1, 1, 1)
