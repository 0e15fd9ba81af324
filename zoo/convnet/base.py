"""What every ConvNet of the family shares: the classifier head's reset, the parameter count, the training-FLOPs count,
and the repeated units that activation checkpointing and data-parallel wrappers apply to (train/, from outside)."""
from __future__ import annotations

import copy
import math

import torch
from torch import nn

from ..config import check


class ConvNetBase(nn.Module):
    """A subclass sets `classifier_name` (the dotted name of its final nn.Linear) and defines `units()`; it
    builds from `self.config`, a copy of the checked config (reset_classifier() edits it, not the caller's)."""
    family = "convnet"
    classifier_name = "fc"

    def __init__(self, cfg):
        super().__init__()
        check(cfg)
        self.config = copy.deepcopy(cfg)

    def units(self) -> list:
        raise NotImplementedError

    def classifier_names(self) -> list:
        """The dotted names of the model's classifier heads (reset_classifier() replaces them all)."""
        return [self.classifier_name]

    def repeated_units(self) -> list:
        """The residual blocks in order (not the stages): what a data-parallel wrapper shards, and activation
        checkpointing applies to."""
        return self.units()

    checkpoint_units = repeated_units

    def reset_classifier(self, num_classes: int):
        """A fresh head with num_classes outputs (fine-tuning on another label set)."""
        parent_name, _, name = self.classifier_name.rpartition(".")
        parent = self.get_submodule(parent_name) if parent_name else self
        old = getattr(parent, name)
        fc = nn.Linear(old.in_features, num_classes, device=old.weight.device, dtype=old.weight.dtype)
        bound = 1.0 / math.sqrt(old.in_features)
        nn.init.uniform_(fc.weight, -bound, bound)
        nn.init.zeros_(fc.bias)
        setattr(parent, name, fc)
        self.config.num_classes = num_classes

    def zero_init_last_bn(self):
        """The last BatchNorm of each residual branch starts at gamma = 0: every block starts as the
        identity (Goyal et al., "Accurate, Large Minibatch SGD", 2017)."""
        for block in self.units():
            if getattr(block, "has_skip", True) and hasattr(block, "last_bn"):
                nn.init.zeros_(block.last_bn().weight)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def flops_per_image(self, image_size: int) -> float:
        """Training FLOPs per image: 3 x (forward multiply-adds of every conv and linear layer) x 2. Counted
        on a meta-device twin of the model, so nothing is computed and the model is untouched."""
        macs = 0

        def count(m, inp, out):
            nonlocal macs
            if isinstance(m, nn.Conv2d):
                macs += out[0].numel() * (m.in_channels // m.groups) * m.kernel_size[0] * m.kernel_size[1]
            else:
                macs += out[0].numel() // m.out_features * m.in_features * m.out_features

        with torch.device("meta"):
            twin = type(self)(copy.deepcopy(self.config)).eval()
            for m in twin.modules():
                if isinstance(m, (nn.Conv2d, nn.Linear)):
                    m.register_forward_hook(count)
            twin(torch.empty(1, self.config.in_chans, image_size, image_size))
        return 6.0 * macs
