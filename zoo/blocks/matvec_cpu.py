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
    """Inside torch.compile on a CPU, turns F.linear on at most two rows (a decoding step at
    batch 1 or 2) into a multiply and a sum over the input dim, accumulated in fp32.

    Decoding is a chain of matrix-vector products that read every weight once per token, so
    its speed is the rate at which the weights are read. On a CPU the GEMV behind F.linear
    reads them well below the memory bandwidth, while inductor fuses the multiply-and-sum into
    one vectorised reduction that streams the weight at close to it (Zoo's docs/pretrained.md,
    "Benchmark", has the measurements). In eager mode the product would be materialised, so
    this is only for compiled code; on other devices F.linear is left alone (cuBLAS GEMV is
    bandwidth-bound)."""

    MAX_ROWS = 2  # from 4 rows on, the GEMM is as fast (docs/pretrained.md, "Benchmark")

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, w = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if w.device.type == "cpu" and x.dim() >= 2 and x.shape[:-1].numel() <= self.MAX_ROWS:
                if torch.is_autocast_enabled("cpu"):
                    dt = torch.get_autocast_dtype("cpu")
                    x, w, bias = x.to(dt), w.to(dt), None if bias is None else bias.to(dt)
                y = (x.unsqueeze(-2) * w).sum(-1, dtype=torch.float32).to(x.dtype)
                return y if bias is None else y + bias
        return func(*args, **kwargs)
