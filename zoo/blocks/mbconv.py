"""MBConv (the inverted residual) and its expansion-free form, the depthwise-separable block: EfficientNet's and
MobileNetV3's units.

Papers: Sandler et al., "MobileNetV2: Inverted Residuals and Linear Bottlenecks" (2018); with squeeze-excitation, Tan &
Le, "EfficientNet" (2019) and Howard et al., "Searching for MobileNetV3" (2019).

    MBConv:              1x1 expand -> BN, act -> kxk depthwise (stride) -> BN, act -> SE -> 1x1 project -> BN
    DepthwiseSeparable:  kxk depthwise (stride) -> BN, act -> SE -> 1x1 project -> BN
    out = shortcut + drop_path(branch)   when stride 1 and c_in == c_out, else the branch alone

Shapes: (B, c_in, H, W) -> (B, c_out, H / stride, W / stride); parameter names are timm's.
Needs: se.py, drop_path.py (copy them beside this file).
"""
from typing import Optional

from torch import nn

try:
    from .drop_path import DropPath
    from .se import SqueezeExcite
except ImportError:  # copied next to se.py and drop_path.py, outside the zoo package
    from drop_path import DropPath
    from se import SqueezeExcite


def _se(channels: int, rd_channels: int, se_act, se_gate) -> nn.Module:
    return SqueezeExcite(channels, rd_channels, se_act, se_gate) if rd_channels else nn.Identity()


class MBConv(nn.Module):
    """Inverted residual through `mid` channels: (B, c_in, H, W) -> (B, c_out, H / s, W / s); SE if se_channels."""

    def __init__(self, c_in: int, c_out: int, mid: int, kernel: int = 3, stride: int = 1, act=nn.SiLU,
                 se_channels: int = 0, se_act: Optional[type] = None, se_gate=nn.Sigmoid, drop_path: float = 0.0,
                 bn_eps: float = 1e-5):
        super().__init__()
        self.has_skip = stride == 1 and c_in == c_out
        self.conv_pw = nn.Conv2d(c_in, mid, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(mid, eps=bn_eps)
        self.act1 = act(inplace=True)
        self.conv_dw = nn.Conv2d(mid, mid, kernel, stride, kernel // 2, groups=mid, bias=False)
        self.bn2 = nn.BatchNorm2d(mid, eps=bn_eps)
        self.act2 = act(inplace=True)
        self.se = _se(mid, se_channels, se_act or act, se_gate)
        self.conv_pwl = nn.Conv2d(mid, c_out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(c_out, eps=bn_eps)
        self.drop_path = DropPath(drop_path if self.has_skip else 0.0)

    def last_bn(self) -> nn.BatchNorm2d:
        return self.bn3

    def forward(self, x):
        shortcut = x
        x = self.act1(self.bn1(self.conv_pw(x)))
        x = self.act2(self.bn2(self.conv_dw(x)))
        x = self.bn3(self.conv_pwl(self.se(x)))
        return self.drop_path(x) + shortcut if self.has_skip else x


class DepthwiseSeparable(nn.Module):
    """MBConv without the expansion: (B, c_in, H, W) -> (B, c_out, H / stride, W / stride)."""

    def __init__(self, c_in: int, c_out: int, kernel: int = 3, stride: int = 1, act=nn.SiLU, se_channels: int = 0,
                 se_act: Optional[type] = None, se_gate=nn.Sigmoid, drop_path: float = 0.0, bn_eps: float = 1e-5):
        super().__init__()
        self.has_skip = stride == 1 and c_in == c_out
        self.conv_dw = nn.Conv2d(c_in, c_in, kernel, stride, kernel // 2, groups=c_in, bias=False)
        self.bn1 = nn.BatchNorm2d(c_in, eps=bn_eps)
        self.act1 = act(inplace=True)
        self.se = _se(c_in, se_channels, se_act or act, se_gate)
        self.conv_pw = nn.Conv2d(c_in, c_out, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out, eps=bn_eps)
        self.drop_path = DropPath(drop_path if self.has_skip else 0.0)

    def last_bn(self) -> nn.BatchNorm2d:
        return self.bn2

    def forward(self, x):
        shortcut = x
        x = self.bn2(self.conv_pw(self.se(self.act1(self.bn1(self.conv_dw(x))))))
        return self.drop_path(x) + shortcut if self.has_skip else x
