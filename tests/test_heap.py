"""train/heap.py, the planner's model of glibc's malloc, against glibc itself: the same calls replayed
in a fresh process (tcache and fastbins off, nothing mapped, as train/run.py runs) return the same
address for every block, and train.glibc.fill_heap_holes leaves the heap as the model starts it."""
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from train.glibc import libc, steady_heap_env
from train.heap import GlibcHeap, chunk_size, heap_peak

ROOT = Path(__file__).resolve().parents[1]

def _glibc_version():
    import platform
    name, version = platform.libc_ver()
    return tuple(int(x) for x in version.split(".")[:2]) if name == "glibc" and version else None


# fill_heap_holes needs mallinfo2 (2.33); the model follows memalign as it was up to 2.37
glibc_only = pytest.mark.skipif(libc() is None or not (2, 33) <= (_glibc_version() or (0, 0)) < (2, 38),
                                reason=f"needs Linux with glibc 2.33 to 2.37 (train/heap.py's glibc), not {_glibc_version()}")

# A fresh process: glibc set up as a run sets it up, its holes filled, then the calls replayed.
# Nothing else in it calls malloc while it replays (the events and the answers sit in arrays made
# before; Python's own small objects come from its arenas, which are mapped apart from the heap).
REPLAY = r"""
import array, ctypes, json, sys
from train.glibc import fill_heap_holes, keep_freed_memory, libc
calls = json.loads(sys.stdin.read())
kinds, sizes, ids = (array.array("q", [c[i] for c in calls]) for i in range(3))
out, live = array.array("q", bytes(8 * len(calls))), array.array("q", bytes(8 * len(calls)))
c = libc()
c.malloc.restype, c.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
c.free.argtypes = [ctypes.c_void_p]
c.posix_memalign.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_size_t]
p = ctypes.c_void_p()
for i in range(2):  # the calls made once first: whatever ctypes sets up on a first call is made now
    c.posix_memalign(ctypes.byref(p), 64, 100)
    c.free(c.malloc(100))
    c.free(p.value)
keep_freed_memory()
fill_heap_holes()
top = c.sbrk(0) - c.mallinfo2().keepcost
for i in range(len(calls)):
    if kinds[i] == 0:
        c.free(live[ids[i]])
    else:
        if kinds[i] == 1:
            a = c.malloc(sizes[i])
        else:
            c.posix_memalign(ctypes.byref(p), 64, sizes[i])
            a = p.value
        live[ids[i]] = a
        out[i] = a - 16 - top
print(json.dumps(list(out)))
"""


def glibc_replay(calls):
    """[(kind, size, id)]: kind 1 malloc(size), 2 posix_memalign(64, size), 0 free(id) -> for each
    allocation its chunk's offset from where the heap's top started, as glibc placed it."""
    out = subprocess.run([sys.executable, "-c", REPLAY], input=json.dumps(calls), capture_output=True, text=True,
                         cwd=ROOT, env=steady_heap_env(), timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def model_replay(calls):
    heap, live, out = GlibcHeap(), {}, []
    for kind, size, uid in calls:
        if kind == 0:
            heap.free(live.pop(uid))
            out.append(0)
        else:
            live[uid] = heap.malloc(chunk_size(size)) if kind == 1 else heap.memalign(size)
            out.append(live[uid])
    return out


def random_calls(n, seed):
    """Blocks of every size class (small objects of a few bytes to tensors of megabytes), freed in
    random order: every path of malloc (small and large bins, the unsorted list and its last
    remainder, splitting, the top) is taken many times."""
    rng = random.Random(seed)
    calls, live = [], []
    for uid in range(n):
        if live and rng.random() < 0.45:
            calls.append((0, 0, live.pop(rng.randrange(len(live)))))
            continue
        size = int(2 ** rng.uniform(0, 23))
        calls.append((rng.choice((1, 1, 2)), size, uid))
        live.append(uid)
    return calls


@glibc_only
@pytest.mark.parametrize("seed", [0, 1])
def test_the_model_places_every_block_where_glibc_does(seed):
    calls = random_calls(30_000, seed)
    got, want = model_replay(calls), glibc_replay(calls)
    wrong = [i for i, (a, b) in enumerate(zip(got, want)) if calls[i][0] and a != b]
    assert not wrong, f"{len(wrong)} of {sum(1 for c in calls if c[0])} blocks placed elsewhere, the first at call {wrong[0]}"


@glibc_only
def test_a_training_steps_trace_is_laid_out_as_glibc_lays_it_out():
    """The planner's own trace (a small LLM's construction and three training steps, fake tensors),
    through the model and through glibc: every tensor at the same place, so the same peak."""
    import torch
    from train.config import load_run_config
    from train.plan import simulate
    cfg = load_run_config(None, ["model.vocab_size=512", "model.d_model=64", "model.n_layers=2", "model.n_heads=2",
                                 "model.n_kv_heads=1", "data.seq_len=64", "train.batch_size=4",
                                 "train.chunked_loss=false"], base=load_base())
    events = simulate(cfg, torch.device("cpu")).events
    calls = [(2 if n > 0 else 0, abs(n), uid) for uid, n in events]
    assert model_replay(calls) == glibc_replay(calls)
    assert heap_peak(events) >= max(off + chunk_size(n) for off, (_, n) in zip(model_replay(calls), events) if n > 0)


def load_base():
    from zoo.config import load_yaml
    return load_yaml(ROOT / "configs" / "llm" / "tiny.yaml")


def test_a_freed_block_merges_with_its_free_neighbours():
    """What glibc does and the earlier no-merge model did not: two freed neighbours hold a block of
    their joint size."""
    heap = GlibcHeap()
    a, b, c = heap.memalign(1000), heap.memalign(1000), heap.memalign(1000)
    heap.free(a)
    heap.free(b)
    peak = heap.peak
    assert heap.memalign(1900) == a  # the merged chunk of a and b, not the top
    assert heap.peak == peak and c > a
