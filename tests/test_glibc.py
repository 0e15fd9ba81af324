"""What a run tells the CPU allocators (train/glibc.py): glibc's tcache and fastbins and MKL's
buffer cache off from the process's start, so that the same run peaks at the same resident memory
in every process."""
import platform
import subprocess
import sys

import pytest

from train.glibc import MKL_FAST_MM, MXFAST, TCACHE, steady_heap_env

ON_GLIBC = sys.platform == "linux" and platform.libc_ver()[0] == "glibc"


def test_steady_heap_env_turns_the_caches_off_and_keeps_the_callers_choice():
    assert steady_heap_env({}) == {"GLIBC_TUNABLES": f"{TCACHE}=0:{MXFAST}=0", MKL_FAST_MM: "1"}
    assert steady_heap_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2", "X": "1"}) == {
        "GLIBC_TUNABLES": f"glibc.malloc.arena_max=2:{TCACHE}=0:{MXFAST}=0", MKL_FAST_MM: "1", "X": "1"}
    assert steady_heap_env({"GLIBC_TUNABLES": f"{TCACHE}=7"}) == {
        "GLIBC_TUNABLES": f"{TCACHE}=7:{MXFAST}=0", MKL_FAST_MM: "1"}
    mine = {"GLIBC_TUNABLES": f"{TCACHE}=7:{MXFAST}=128", MKL_FAST_MM: ""}
    assert steady_heap_env(mine) == mine


@pytest.mark.skipif(not ON_GLIBC, reason="needs Linux with glibc")
def test_a_process_restarts_once_with_the_caches_off_and_its_options_kept():
    """restart_with_steady_heap() runs the same command line again (interpreter options included)
    with the settings made, once; where the caller made them all it does nothing."""
    code = ("import os, sys; print('started', sys.flags.dont_write_bytecode, flush=True); "
            "from train.glibc import restart_with_steady_heap; restart_with_steady_heap(); "
            f"print(os.environ.get('GLIBC_TUNABLES'), os.environ.get('{MKL_FAST_MM}'))")
    env = {k: v for k, v in steady_heap_env().items() if k not in ("GLIBC_TUNABLES", MKL_FAST_MM)}
    out = subprocess.run([sys.executable, "-B", "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.split("\n")[:3] == ["started 1", "started 1", f"{TCACHE}=0:{MXFAST}=0 1"], out.stdout
    env.update({"GLIBC_TUNABLES": f"{TCACHE}=7:{MXFAST}=128", MKL_FAST_MM: ""})
    out = subprocess.run([sys.executable, "-B", "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.split("\n")[:2] == ["started 1", f"{TCACHE}=7:{MXFAST}=128 "], out.stdout


@pytest.mark.skipif(not ON_GLIBC, reason="needs Linux with glibc")
def test_the_same_run_peaks_alike_with_the_tcache_off_and_lower_with_the_caches_off(monkeypatch):
    """The 0.9M LLM with full loss (64 MiB logits), 6 steps in fresh processes. With glibc's tcache
    off (fastbins and MKL's buffer cache left on), three processes peak alike within 1%: with the
    tcache on, six processes of 16 steps peaked anywhere from 434 to 661 MiB, and this check, run
    with it on, measured 493, 436 and 469 MiB (docs/memory.md, "Why processes differed"). There
    MKL's first matmul buffers stay after the logits' chunk and keep it from merging: 471 MiB. As
    train/run.py starts (the three caches off) a process peaks more than 32 MiB lower (407-418 MiB
    in the processes measured so far: where MKL's per-call buffers land varies them by about 2%)."""
    from train.benches.memory import CONFIGS, base_of
    from train.plan import measure_in_subprocess
    spec, over = CONFIGS["llm 0.9M fp32 adamw full-loss"]
    steady = [measure_in_subprocess(base_of(spec), over, steps=6)["peak"] for _ in range(2)]
    monkeypatch.setenv("GLIBC_TUNABLES", f"{TCACHE}=0:{MXFAST}=128")
    monkeypatch.setenv(MKL_FAST_MM, "")
    tcache_off = [measure_in_subprocess(base_of(spec), over, steps=6)["peak"] for _ in range(3)]
    assert max(tcache_off) <= 1.01 * min(tcache_off), [p / 2**20 for p in tcache_off]
    assert max(steady) < min(tcache_off) - 32 * 2**20, ([p / 2**20 for p in steady], [p / 2**20 for p in tcache_off])


@pytest.mark.skipif(not ON_GLIBC, reason="needs Linux with glibc")
def test_train_run_starts_with_the_caches_off(tmp_path):
    """train/run.py from an environment without the settings: the run's process has them (the loop
    logs when a run's caches are on, and this run's log does not say so)."""
    import os
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", MKL_FAST_MM)}
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, str(root / "train" / "run.py"), str(root / "configs/convnet/resnet-digits.yaml"),
                           "train.max_steps=2", "train.progress=false", f"train.out_dir={out}"],
                          capture_output=True, text=True, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    log = (out / "log.txt").read_text()
    assert "backends: cpu, freed memory kept" in log and "caches are on" not in log, log


@pytest.mark.skipif(not ON_GLIBC, reason="needs Linux with glibc")
def test_fill_heap_holes_leaves_only_the_top_free():
    """In a process set up as a run sets it up, with holes made on purpose (blocks of every size,
    used, then every other one freed): afterwards glibc's only free chunk is the top of the heap
    (that it starts on a 64-byte boundary, as train/heap.py starts, tests/test_heap.py checks: its
    replays put every block where the model does), a second call finds nothing to fill, and the
    fillers hold no resident memory (their pages given back: the process is smaller after filling
    more than 128 MiB of holes than before)."""
    code = r"""
import ctypes, random
from train.glibc import fill_heap_holes, keep_freed_memory, libc
keep_freed_memory()
c = libc()
c.malloc.restype, c.malloc.argtypes, c.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
rng = random.Random(0)
sizes = [int(2 ** rng.uniform(3, 21)) for _ in range(2000)]
blocks = [c.malloc(n) for n in sizes]
for p, n in zip(blocks, sizes):
    ctypes.memset(p, 1, n)  # used, as a process's memory is before a run
for p in blocks[::2]:
    c.free(p)
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * 4096
before = rss()
filled = fill_heap_holes()
mi = c.mallinfo2()
print(filled, mi.fordblks == mi.keepcost, rss() - before, fill_heap_holes())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=steady_heap_env())
    assert out.returncode == 0, out.stderr
    filled, only_top, grown, again = out.stdout.split()
    assert int(filled) > 128 * 2**20 and only_top == "True" and int(again) == 0, out.stdout
    assert int(grown) < 0, out.stdout
