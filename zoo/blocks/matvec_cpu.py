"""CPU speed paths for decoding: F.linear on a few rows, by the route a CPU runs fastest.

A torch function mode (no paper: kernel selection for memory-bound matrix-vector products).
Shapes: F.linear's, x (..., in) with a few rows, w (out, in) -> (..., out).
- compiled, at most two rows: a multiply and a sum accumulated in fp32, which inductor fuses into one reduction that
  streams the weight (`as_reduction`);
- eager fp32, at most eight rows and a weight as large as an output head: the weight on the left, (w @ x^T)^T, one
  row padded to two (`weight_on_the_left`); the BLAS streams it faster than F.linear's x @ w^T, while for the smaller
  weights of the layers F.linear's matrix-vector kernel is the faster (its threads need no synchronisation).
"""
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode


def as_reduction(x: torch.Tensor, w: torch.Tensor, bias=None) -> torch.Tensor:
    """F.linear as (x w) summed over `in`, accumulated in fp32, in autocast's dtype when it is on."""
    if torch.is_autocast_enabled("cpu"):
        dt = torch.get_autocast_dtype("cpu")
        x, w, bias = x.to(dt), w.to(dt), None if bias is None else bias.to(dt)
    y = (x.unsqueeze(-2) * w).sum(-1, dtype=torch.float32).to(x.dtype)
    return y if bias is None else y + bias


def weight_on_the_left(x: torch.Tensor, w: torch.Tensor, bias=None) -> torch.Tensor:
    """F.linear as (w @ x^T)^T over the rows of x; a single row is padded to two, which the BLAS
    runs as a small GEMM instead of its slower matrix-vector kernel."""
    rows = x.reshape(-1, x.shape[-1])
    n = rows.shape[0]
    if n == 1:
        rows = torch.cat([rows, rows.new_zeros(1, rows.shape[1])])
    y = (w @ rows.t()).t()[:n].reshape(*x.shape[:-1], w.shape[0])
    return y if bias is None else y + bias


def on_the_left(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether eager F.linear(x, w) runs faster as `weight_on_the_left`: a CPU, fp32 without autocast, not compiling,
    at most EAGER_ROWS rows and a weight of EAGER_NUMEL elements or more (MatvecCPU's)."""
    return (type(w) in (torch.Tensor, torch.nn.Parameter) and w.device.type == "cpu" and x.dim() >= 2
            and x.shape[:-1].numel() <= MatvecCPU.EAGER_ROWS and w.numel() >= MatvecCPU.EAGER_NUMEL
            and x.dtype == w.dtype == torch.float32 and not torch.is_autocast_enabled("cpu")
            and not torch.compiler.is_compiling())


class MatvecCPU(TorchFunctionMode):
    """Inside it, F.linear on a CPU takes `as_reduction` under torch.compile (at most COMPILED_ROWS rows) and
    `weight_on_the_left` in eager fp32 without autocast (at most EAGER_ROWS rows, weights of EAGER_NUMEL elements or
    more). Other devices, dtypes, tensor-subclass weights and larger batches are left alone (docs/pretrained.md, "Benchmark")."""

    COMPILED_ROWS = 2  # from 4 rows on, the GEMM is as fast
    EAGER_ROWS = 8  # from 12 rows on, F.linear is as fast
    EAGER_NUMEL = 1 << 23  # smaller weights (a layer's projections) are faster through F.linear

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, w = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if on_the_left(x, w):
                return weight_on_the_left(x, w, bias)
            if (torch.compiler.is_compiling() and type(w) in (torch.Tensor, torch.nn.Parameter)
                    and w.device.type == "cpu" and x.dim() >= 2 and x.shape[:-1].numel() <= self.COMPILED_ROWS):
                return as_reduction(x, w, bias)
        return func(*args, **kwargs)
