"""What a run tells glibc's allocator (Linux with glibc; elsewhere each function does nothing).

- `keep_freed_memory()` / `release_freed_memory()`: freed memory kept in the process for reuse,
  and glibc's defaults back (`train.cpu_keep_memory`).
- `steady_heap_env()` / `restart_with_steady_heap()`: glibc's per-thread cache of small freed
  chunks (tcache) off, so that the same run peaks at the same resident memory in every process.

Imports nothing but the standard library: train/run.py calls `restart_with_steady_heap` before
torch is imported.
"""
from __future__ import annotations

import ctypes
import os
import platform
import sys

_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
TCACHE = "glibc.malloc.tcache_count"


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
    c = libc()
    if c is None:
        return False
    return c.mallopt(_M_MMAP_MAX, 0) == 1 and c.mallopt(_M_TRIM_THRESHOLD, 2 ** 31 - 1) == 1


def release_freed_memory() -> bool:
    """Undo keep_freed_memory(): glibc's default limits again (mmap for blocks over 128 KiB,
    trim at 128 KiB) and the kept memory returned to the OS. glibc's dynamic mmap threshold,
    which any mallopt call turns off, stays off. Returns whether it applied."""
    c = libc()
    if c is None:
        return False
    ok = c.mallopt(_M_MMAP_MAX, 65536) == 1 and c.mallopt(_M_TRIM_THRESHOLD, 128 * 1024) == 1
    c.malloc_trim(0)
    return ok


def steady_heap_env(env=None) -> dict:
    """A copy of `env` (default os.environ) whose GLIBC_TUNABLES turns glibc's tcache off
    (glibc.malloc.tcache_count=0), unless it sets a tcache count already (the caller's choice
    stands). The tcache keeps up to 7 freed chunks of each small size (up to 1 KiB: the autograd
    graph's nodes, the tensors' own objects, tens of thousands a step) apart from the heap, never
    merged, and hands them out again in an order that follows the process's own randomness (its
    hash seed, its address layout). Where those small chunks land decides whether a large tensor's
    freed chunk merges with its neighbours and can take the next large block, so the same run's
    peak differed from process to process (a 0.9M LLM with full loss: 433-599 MiB over 16 steps).
    With the tcache off glibc merges small freed chunks before it serves a large request, and the
    processes peak alike (471.0 MiB four times; docs/memory.md, "Why processes differed")."""
    env = dict(os.environ if env is None else env)
    tunables = env.get("GLIBC_TUNABLES", "")
    if TCACHE not in tunables:
        env["GLIBC_TUNABLES"] = ":".join(t for t in (tunables, f"{TCACHE}=0") if t)
    return env


def steady_heap() -> bool:
    """Whether this process's environment sets glibc's tcache count (`steady_heap_env` set it, or
    the user chose one): glibc runs as that says, and no run restarts the process."""
    return TCACHE in os.environ.get("GLIBC_TUNABLES", "")


def restart_with_steady_heap() -> None:
    """Start this process again, same command line, with `steady_heap_env()`, where glibc runs
    without it: glibc reads its tunables only when a process starts. Returns where nothing is to
    do (not glibc, the tunable set already, or no command line to run again, as in an embedded
    interpreter); else does not return (os.execve: the same process id, so torchrun and job
    schedulers see one process). Call it first, before anything is imported or written."""
    if steady_heap() or not getattr(sys, "orig_argv", None) or libc() is None:  # the restarted process: one look at the environment
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, steady_heap_env())
