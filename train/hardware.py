"""What the machine can do, measured the same way by the loop and the benchmarks (MFU's denominator, peak
memory), and glibc told to keep freed memory (train.cpu_keep_memory)."""
from __future__ import annotations

import ctypes
import functools
import platform
import resource
import sys
import time
from typing import Optional

import torch


def sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


# The matmul measured, chosen by its FLOPs alone (a slow first timing cannot pick one too small).
PEAK_SIZES, PEAK_SIZE_DEFAULT = {"cpu": 1024}, 8192


def measure_peak_flops(device: torch.device, dtype: Optional[torch.dtype], reps: int = 5, budget: float = 0.5) -> float:
    """Achieved FLOP/s of an n x n matmul in `dtype` (None: fp32), n by device type (`PEAK_SIZES`): 2 n^3 over
    the fastest of `reps` timed matmuls after a warm-up, stopping once `budget` seconds are spent (two at least)."""
    dt, n = dtype or torch.float32, PEAK_SIZES.get(device.type, PEAK_SIZE_DEFAULT)
    a, b = torch.randn(n, n, device=device, dtype=dt), torch.randn(n, n, device=device, dtype=dt)

    def timed() -> float:
        sync(device)
        t0 = time.perf_counter()
        a @ b
        sync(device)
        return time.perf_counter() - t0

    timed()  # warm-up
    best, spent = float("inf"), 0.0
    for i in range(max(2, reps)):
        t = timed()
        best, spent = min(best, t), spent + t
        if i >= 1 and spent > budget:
            break
    return 2 * n ** 3 / best


# Dense bf16/fp16 FLOP/s the vendor states (no sparsity), by a part of torch.cuda.get_device_name, more
# specific names first: the MFU denominator on those GPUs, as torchtitan reports MFU.
VENDOR_PEAKS = {"H100 80GB HBM3": 989e12, "H100 PCIe": 756e12, "H100 NVL": 835e12, "H100": 989e12,
                "H200": 989e12, "A100": 312e12, "L40S": 362e12, "L4": 121e12, "RTX 4090": 165e12}


def vendor_peak_flops(device: torch.device, dtype: Optional[torch.dtype]) -> Optional[tuple[str, float]]:
    """(GPU name, its vendor's dense 16-bit FLOP/s) of a known CUDA device in bf16 or fp16, else None."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16) or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    return next(((name, v) for k, v in VENDOR_PEAKS.items() if k.lower() in name.lower()), None)


def peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    # process peak resident set size (Linux reports KiB, macOS bytes)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4


@functools.lru_cache(maxsize=None)
def libc():
    """glibc, or None where the C library is another (or the platform not Linux)."""
    if sys.platform != "linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def keep_freed_memory() -> bool:
    """Serve every allocation from the heap, never trimmed (mallopt M_MMAP_MAX=0, M_TRIM_THRESHOLD=2 GiB), so a
    step's large tensors are not page-faulted in again every step; process-wide, as CUDA's caching allocator."""
    c = libc()
    return c is not None and c.mallopt(_M_MMAP_MAX, 0) == 1 and c.mallopt(_M_TRIM_THRESHOLD, 2 ** 31 - 1) == 1


def release_freed_memory() -> bool:
    """Undo keep_freed_memory(): glibc's default limits again, the kept memory returned; whether it applied."""
    c = libc()
    if c is None:
        return False
    ok = c.mallopt(_M_MMAP_MAX, 65536) == 1 and c.mallopt(_M_TRIM_THRESHOLD, 128 * 1024) == 1
    c.malloc_trim(0)
    return ok
