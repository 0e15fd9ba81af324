"""What a run tells the CPU allocators under torch: glibc's malloc and MKL's buffer cache (Linux
with glibc; elsewhere each function does nothing).

- `keep_freed_memory()` / `release_freed_memory()`: freed memory kept in the process for reuse,
  and glibc's defaults back (`train.cpu_keep_memory`).
- `steady_heap_env()` / `restart_with_steady_heap()`: the caches that place small and long-lived
  blocks by chance off (glibc's tcache and fastbins, MKL's buffer cache), so that the same run
  peaks at about the same resident memory in every process, and lower.
- `fill_heap_holes()`: the free chunks that the process left in the heap before the run filled,
  so that the run's blocks are laid out the same way in every process, as train/heap.py lays
  them out.

Imports nothing but the standard library: train/run.py calls `restart_with_steady_heap` before
torch is imported.
"""
from __future__ import annotations

import ctypes
import functools
import os
import platform
import sys

_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
TCACHE, MXFAST = "glibc.malloc.tcache_count", "glibc.malloc.mxfast"
MKL_FAST_MM = "MKL_DISABLE_FAST_MM"


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
    """Serve every allocation from the heap and never trim it (mallopt M_MMAP_MAX=0,
    M_TRIM_THRESHOLD=2 GiB). glibc otherwise maps each block over 32 MiB afresh and unmaps it
    when freed, so a step's large tensors (logits, activations, gradients) are page-faulted in
    again every step. Process-wide; memory freed stays with the process (its RSS stays at its
    peak, as with CUDA's caching allocator). Returns whether it applied."""
    global _kept
    c = libc()
    if c is None:
        return False
    _kept = c.mallopt(_M_MMAP_MAX, 0) == 1 and c.mallopt(_M_TRIM_THRESHOLD, 2 ** 31 - 1) == 1
    return _kept


def release_freed_memory() -> bool:
    """Undo keep_freed_memory(): glibc's default limits again (mmap for blocks over 128 KiB,
    trim at 128 KiB) and the kept memory returned to the OS, the blocks of `fill_heap_holes` too.
    glibc's dynamic mmap threshold, which any mallopt call turns off, stays off. Returns whether
    it applied."""
    global _kept
    c = libc()
    if c is None:
        return False
    _kept = False
    while _fillers:
        for p in _fillers.pop():
            c.free(ctypes.c_void_p(p))  # free(NULL) for the unused slots
    ok = c.mallopt(_M_MMAP_MAX, 65536) == 1 and c.mallopt(_M_TRIM_THRESHOLD, 128 * 1024) == 1
    c.malloc_trim(0)
    return ok


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


_fillers: list[list[int]] = []  # the blocks fill_heap_holes placed (0: none), kept until release_freed_memory
_kept = False  # keep_freed_memory() in effect
_MADV_DONTNEED, _PAGE = 4, 4096


def heap_end():
    """Where glibc's main heap ends (sbrk(0)): it only grows while keep_freed_memory() is in effect,
    so its growth over a run is the most the run's heap reached. None without glibc."""
    c = libc()
    if c is None:
        return None
    c.sbrk.restype, c.sbrk.argtypes = ctypes.c_void_p, [ctypes.c_long]
    return c.sbrk(0)


def fill_heap_holes() -> int:
    """Fill every free chunk of glibc's heap with a block that nothing uses, then give the heap's
    free top back to the OS and start it on a 64-byte boundary. Returns the bytes filled.

    Why: glibc serves a request from the best-fitting free chunk anywhere in the heap, so a run's
    blocks land in whatever holes the process left before it (imports, reading data), which
    differ from process to process; the same run then peaks at different resident memory (a
    ResNet-10 at width 32: 185.8-205.7 MiB in six processes, 204.9-207.0 with the holes filled;
    docs/memory.md). With the holes filled, the run's blocks come from the top of the heap, as
    train/heap.py (the planner's model of glibc) places them. The fillers cost no resident
    memory: their whole pages are given back to the OS (madvise) and never touched again.

    Call it just before the run builds its model. Does nothing (returns 0) unless
    keep_freed_memory() is in effect (with blocks mapped apart, glibc's default, the large fillers
    would not come from the heap), or without glibc 2.33 or later (mallinfo2)."""
    c = libc()
    if not _kept or c is None or not hasattr(c, "mallinfo2"):
        return 0
    c.mallinfo2.restype = _Mallinfo2
    c.malloc.restype, c.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    c.free.argtypes = [ctypes.c_void_p]
    c.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]

    def top() -> int:  # where the heap's free top chunk starts
        return heap_end() - c.mallinfo2().keepcost

    filled = 0
    for _ in range(8):  # again while anything is free below the top
        found, n, start = [0] * 16384, 0, top()  # made before the holes are filled: appending would free buffers
        for shift in range(20, 4, -1):  # chunks of 1 MiB, 512 KiB, ... 32 bytes: each hole filled, largest first
            size = (1 << shift) - 8
            while n < len(found) - 1:
                p = c.malloc(size)
                if not p or p >= start:  # from the top: no hole of this size is left
                    c.free(p)
                    break
                found[n], n, filled = p, n + 1, filled + size
                lo, hi = (p + _PAGE - 1) // _PAGE * _PAGE, (p + size) // _PAGE * _PAGE
                if hi > lo:
                    c.madvise(lo, hi - lo, _MADV_DONTNEED)
        c.malloc_trim(0)
        pad = {16: 40, 32: 24, 48: 72}.get(top() % 64)  # a chunk of 48, 32 or 80 bytes: the top on a 64-byte boundary
        if pad is not None:
            found[n], n = c.malloc(pad), n + 1
        _fillers.append(found)
        info = c.mallinfo2()
        if info.fordblks == info.keepcost and top() % 64 == 0:
            break
    return filled


def steady_heap_env(env=None) -> dict:
    """A copy of `env` (default os.environ) with what keeps a run's heap the same from process to
    process (docs/memory.md, "Why processes differed"); a setting the caller made stands:

    - GLIBC_TUNABLES glibc.malloc.tcache_count=0: glibc's per-thread cache of small freed chunks
      off. It keeps up to 7 freed chunks of each small size (up to 1 KiB: the autograd graph's
      nodes, the tensors' own objects, tens of thousands a step) apart from the heap, never merged,
      and hands them out in an order that follows the process's own randomness (its hash seed, its
      address layout). Where those small chunks land decides whether a large tensor's freed chunk
      merges with its neighbours and can take the next large block (a 0.9M LLM with full loss
      peaked at 433-599 MiB over 16 steps from process to process).
    - glibc.malloc.mxfast=0: glibc's fastbins off, so a small chunk freed merges with its free
      neighbours at once. A training step frees small objects in an order that differs from
      process to process (the 16-byte nodes of a hash set keyed by address are freed in the set's
      order); kept in fastbins, they were handed out again in that order (a ResNet-10 of width 32:
      190-241 MiB in six processes; 196-208 without them).
    - MKL_DISABLE_FAST_MM=1: MKL allocates its matmul buffers for each call and frees them, instead
      of keeping the first ones for the process's lifetime wherever the heap's top then was (after
      a 64 MiB logits block, they kept that block's freed chunk from merging: the 0.9M LLM peaked
      at 471 MiB with them, 409-410 without)."""
    env = dict(os.environ if env is None else env)
    tunables = env.get("GLIBC_TUNABLES", "")
    missing = [f"{key}=0" for key in (TCACHE, MXFAST) if key not in tunables]
    if missing:
        env["GLIBC_TUNABLES"] = ":".join(t for t in (tunables, *missing) if t)
    env.setdefault(MKL_FAST_MM, "1")
    return env


def steady_heap() -> bool:
    """Whether this process's environment has every setting of `steady_heap_env` (set by it or
    by the user): the allocators run as that says, and no run restarts the process."""
    return steady_heap_env() == dict(os.environ)


def restart_with_steady_heap() -> None:
    """Start this process again, same command line, with `steady_heap_env()`, where the environment
    lacks it: glibc and MKL read these settings only when a process starts. Returns where nothing is
    to do (not glibc, the settings there already, or no command line to run again, as in an
    embedded interpreter); else does not return (os.execve: the same process id, so torchrun and job
    schedulers see one process). Call it first, before anything is imported or written."""
    if steady_heap() or not getattr(sys, "orig_argv", None) or libc() is None:  # the restarted process: one look at the environment
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, steady_heap_env())
