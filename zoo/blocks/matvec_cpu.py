"""CPU speed path for decoding: F.linear on one or two rows as a multiply and a sum, which
inductor fuses into one reduction that streams the weight.

A torch function mode (no paper: a kernel-selection trick for memory-bound matrix-vector
products). Shapes: F.linear's, x (..., in) with at most MAX_ROWS rows, w (out, in) ->
(..., out), accumulated in fp32. Depends on torch only.
"""
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode


class MatvecAsReduction(TorchFunctionMode):
    """Inside torch.compile on a CPU, F.linear on at most two rows (a decoding step) becomes a multiply
    and a sum accumulated in fp32, which inductor fuses into one reduction that streams the weight
    faster than the GEMV behind F.linear. Other devices and tensor-subclass weights are left alone."""

    MAX_ROWS = 2  # from 4 rows on, the GEMM is as fast (docs/pretrained.md, "Benchmark")

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, w = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if type(w) in (torch.Tensor, torch.nn.Parameter) and w.device.type == "cpu" and x.dim() >= 2 and x.shape[:-1].numel() <= self.MAX_ROWS:
                if torch.is_autocast_enabled("cpu"):
                    dt = torch.get_autocast_dtype("cpu")
                    x, w, bias = x.to(dt), w.to(dt), None if bias is None else bias.to(dt)
                y = (x.unsqueeze(-2) * w).sum(-1, dtype=torch.float32).to(x.dtype)
                return y if bias is None else y + bias
        return func(*args, **kwargs)
