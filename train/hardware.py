"""What the machine can do, measured the same way by the loop and the benchmarks.

- `measure_peak_flops(device, dtype)`: the FLOP/s of a large square matmul in the compute dtype,
  the denominator of every MFU figure Zoo prints (metrics.jsonl and the benchmark tables).
- `sync(device)`, `peak_memory_gb(device)`.
"""
from __future__ import annotations

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


_PEAK_SIZES: dict = {}  # (device, dtype, threads) -> the matmul size measure_peak_flops chose


def measure_peak_flops(device: torch.device, dtype: Optional[torch.dtype], reps: int = 5,
                       budget: float = 0.25) -> float:
    """Achieved FLOP/s of an n x n matmul in the run's compute dtype (None: float32): the MFU
    denominator of the training loop and of every benchmark.

    n is the largest of 256, 512, ..., 8192 whose matmul takes at most ~50 ms: large enough to
    reach the device's matmul speed, small enough to stay cheap in a dtype the device only
    emulates. It is chosen at the first call (each size timed twice, growing while 8x the faster
    time stays under 50 ms) and kept for the process, device, dtype and thread count, so that
    every later call measures the same matmul. The result is 2 n^3 over the fastest of `reps`
    timed matmuls after a warm-up one, stopping early once `budget` seconds are spent (at least
    two): the fastest is the least disturbed by other work on the machine. A call costs at most
    about 0.4 s. The loop measures once at the start; a benchmark may keep the largest of
    several calls made between its rounds."""
    dt = dtype or torch.float32
    key = (str(device), dt, torch.get_num_threads())

    def timed(a, b) -> float:
        sync(device)
        t0 = time.perf_counter()
        a @ b
        sync(device)
        return time.perf_counter() - t0

    n = _PEAK_SIZES.get(key)
    if n is None:
        n = 256
        while True:
            a = torch.randn(n, n, device=device, dtype=dt)
            b = torch.randn(n, n, device=device, dtype=dt)
            once = min(timed(a, b), timed(a, b))
            if once * 8 > 0.05 or n >= 8192:
                break
            n *= 2
        _PEAK_SIZES[key] = n
    else:
        a = torch.randn(n, n, device=device, dtype=dt)
        b = torch.randn(n, n, device=device, dtype=dt)
        timed(a, b)  # warm-up
    best, spent = float("inf"), 0.0
    for i in range(max(2, reps)):
        t = timed(a, b)
        best, spent = min(best, t), spent + t
        if i >= 1 and spent > budget:
            break
    return 2 * n ** 3 / best


def peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    # process peak resident set size (Linux reports KiB, macOS bytes)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (2**30 if sys.platform == "darwin" else 2**20)
