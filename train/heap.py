"""glibc's malloc as it lays out the tensors of a training step on a CPU: the planner's heap model.

A CPU tensor's memory comes from c10's allocator, `posix_memalign(64, n)`, and goes back with
`free`. `GlibcHeap` follows what glibc's malloc (2.26 to 2.37, the main arena; 2.38 changed how an
aligned request picks its chunk) does with those calls when a run has set it up as train/run.py
does (train/glibc.py): the per-thread cache and the fastbins off, nothing mapped apart and nothing
trimmed. Its addresses are glibc's own: replaying the calls of a real process gives the same
address for every block (tests/test_heap.py checks this against the machine's glibc). The parts of
glibc it follows:

- chunks: a request of n bytes takes a chunk of n + 8 rounded up to 16 (32 at least); an aligned
  request asks malloc for n + 64 + 32 more, then gives the misaligned head and the spare tail back;
- a freed chunk merges with free neighbours at once and goes to the unsorted list (or back into
  the top of the heap when it borders it);
- malloc: an exact small bin first; then the unsorted list in order (an exact fit taken, the rest
  sorted into bins; a small request may split the last remainder); then the best fit in its own
  large bin; then the smallest chunk of the next non-empty bin, split (the rest to the unsorted
  list); then the top of the heap, which grows.

`heap_peak(events)` replays an `AllocTrace` (train/plan.py) from a heap whose top starts on a
64-byte boundary (as `train.glibc.fill_heap_holes` leaves it) and returns its high-water mark.
Standard library only.
"""
from __future__ import annotations

import bisect
from collections import OrderedDict

MINSIZE = 32            # the smallest chunk
SMALL = 1024            # chunks under this size sit in small bins (one size each)
ALIGNMENT = 64          # c10's CPU allocator: posix_memalign(64, n)
MMAP_THRESHOLD, MMAP_THRESHOLD_MAX = 128 * 1024, 32 * 2 ** 20  # glibc's defaults (when blocks may be mapped)


def chunk_size(n: int) -> int:
    """The chunk glibc carves for a request of n bytes (8 bytes of header, 16-byte granules)."""
    return max(MINSIZE, (n + 8 + 15) & ~15)


def bin_of(size: int) -> int:
    """glibc's bin index of a free chunk of `size` bytes (64-bit): small bins by 16 bytes, then large
    bins 64, 512, 4096, 32768 and 262144 bytes wide."""
    if size < SMALL:
        return size >> 4
    for shift, last, base in ((6, 48, 48), (9, 20, 91), (12, 10, 110), (15, 4, 119), (18, 2, 124)):
        if size >> shift <= last:
            return base + (size >> shift)
    return 126


class GlibcHeap:
    """The main arena of glibc's malloc, tcache and fastbins off, never trimmed: `malloc`,
    `memalign` and `free` return and take addresses; `peak` is the highest the top of the heap
    has been."""

    def __init__(self, start: int = 0):
        self.start = self.top = self.peak = start
        self.used: dict[int, int] = {}            # address -> chunk size, in use
        self.free_at: dict[int, int] = {}         # address -> chunk size, free
        self.free_end: dict[int, int] = {}        # end address -> address, free
        self.bin: dict[int, object] = {}          # address of a free chunk -> its bin ("unsorted" or an index)
        self.unsorted: OrderedDict = OrderedDict()  # address -> size, oldest first
        self.small: dict[int, OrderedDict] = {}   # bin -> addresses, oldest first
        self.large: dict[int, tuple] = {}         # bin -> (sizes ascending, {size: addresses})
        self.nonempty: list[int] = []             # bins holding chunks, ascending
        self.last_remainder = None

    # ---- the bins
    def _binned(self, addr: int, size: int):
        i = bin_of(size)
        self.bin[addr] = i
        if size < SMALL:
            self.small.setdefault(i, OrderedDict())[addr] = None
        else:
            sizes, group = self.large.setdefault(i, ([], {}))
            if size in group:
                group[size].insert(1, addr)  # glibc: a chunk of a size already there goes second
            else:
                bisect.insort(sizes, size)
                group[size] = [addr]
        j = bisect.bisect_left(self.nonempty, i)
        if j == len(self.nonempty) or self.nonempty[j] != i:
            self.nonempty.insert(j, i)

    def _unlink(self, addr: int, size: int):
        where = self.bin.pop(addr)
        del self.free_at[addr], self.free_end[addr + size]
        if where == "unsorted":
            del self.unsorted[addr]
            return
        if size < SMALL:
            chunks = self.small[where]
            del chunks[addr]
            empty = not chunks
        else:
            sizes, group = self.large[where]
            group[size].remove(addr)
            if not group[size]:
                del group[size]
                sizes.pop(bisect.bisect_left(sizes, size))
            empty = not sizes
        if empty:
            self.nonempty.pop(bisect.bisect_left(self.nonempty, where))

    def _put_free(self, addr: int, size: int, where="unsorted"):
        self.free_at[addr], self.free_end[addr + size] = size, addr
        if where == "unsorted":
            self.bin[addr] = where
            self.unsorted[addr] = size
        else:
            self._binned(addr, size)

    # ---- malloc and free
    def _take(self, addr: int, size: int, nb: int, small_request: bool) -> int:
        """A free chunk, unlinked, serves nb bytes: split when the rest is a chunk of its own."""
        if size - nb < MINSIZE:
            self.used[addr] = size
            return addr
        self.used[addr] = nb
        self._put_free(addr + nb, size - nb)
        if small_request:
            self.last_remainder = addr + nb
        return addr

    def malloc(self, nb: int) -> int:
        """The address of a chunk of nb bytes (a `chunk_size`)."""
        small_request = nb < SMALL
        if small_request and self.small.get(nb >> 4):
            addr = next(iter(self.small[nb >> 4]))
            self._unlink(addr, nb)
            self.used[addr] = nb
            return addr
        while self.unsorted:
            addr, size = next(iter(self.unsorted.items()))
            self._unlink(addr, size)
            if small_request and not self.unsorted and addr == self.last_remainder and size > nb + MINSIZE:
                return self._take(addr, size, nb, True)
            if size == nb:
                self.used[addr] = size
                return addr
            self._put_free(addr, size, where="bin")
        if not small_request and self.large.get(bin_of(nb), ((),))[0] and self.large[bin_of(nb)][0][-1] >= nb:
            sizes, group = self.large[bin_of(nb)]
            size = sizes[bisect.bisect_left(sizes, nb)]  # the best fit; of several, the second
            addr = group[size][1] if len(group[size]) > 1 else group[size][0]
            self._unlink(addr, size)
            return self._take(addr, size, nb, False)
        j = bisect.bisect_right(self.nonempty, bin_of(nb))
        if j < len(self.nonempty):  # the next bin that holds chunks: its smallest, oldest one
            i = self.nonempty[j]
            if i < SMALL >> 4:
                addr, size = next(iter(self.small[i])), i << 4
            else:
                sizes, group = self.large[i]
                size = sizes[0]
                addr = group[size][-1]
            self._unlink(addr, size)
            return self._take(addr, size, nb, small_request)
        addr, self.top = self.top, self.top + nb
        self.peak = max(self.peak, self.top)
        self.used[addr] = nb
        return addr

    def free(self, addr: int):
        self._release(addr, self.used.pop(addr))

    def _release(self, addr: int, size: int):
        before = self.free_end.get(addr)
        if before is not None:
            self._unlink(before, addr - before)
            addr, size = before, size + addr - before
        if addr + size == self.top:
            self.top = addr
            return
        after = self.free_at.get(addr + size)
        if after is not None:
            self._unlink(addr + size, after)
            size += after
        self._put_free(addr, size)

    def memalign(self, n: int, alignment: int = ALIGNMENT) -> int:
        """posix_memalign(alignment, n): the chunk's address (its memory starts 16 bytes in)."""
        nb = chunk_size(n)
        p = self.malloc(chunk_size(nb + alignment + MINSIZE))
        size = self.used.pop(p)
        if (p + 16) % alignment:
            aligned = ((p + 16 + alignment - 1) // alignment) * alignment - 16
            if aligned - p < MINSIZE:
                aligned += alignment
            self._release(p, aligned - p)
            p, size = aligned, size - (aligned - p)
        if size > nb + MINSIZE:
            self._release(p + nb, size - nb)
            size = nb
        self.used[p] = size
        return p


def heap_peak(events, keep: bool = True) -> int:
    """The high-water mark of glibc's heap (bytes above where its top started, on a 64-byte
    boundary) for the blocks of `events` ([(uid, +bytes) or (uid, -bytes)], an AllocTrace's),
    each from posix_memalign(64, bytes). keep (train.cpu_keep_memory): everything on the heap;
    else blocks at or over glibc's mmap threshold are mapped apart (unmapped when freed; the
    threshold rises to a freed mapped block's size, at most 32 MiB) and counted with the heap."""
    heap, where = GlibcHeap(), {}
    mapped = peak = 0
    threshold = MMAP_THRESHOLD
    for uid, n in events:
        if n > 0:
            if not keep and n >= threshold:
                where[uid] = -chunk_size(n)
                mapped += chunk_size(n)
                peak = max(peak, heap.top + mapped)
            else:
                highest = heap.peak
                where[uid] = heap.memalign(n)
                peak = max(peak, (heap.peak if heap.peak > highest else heap.top) + mapped)
        elif uid in where:
            addr = where.pop(uid)
            if addr < 0:
                mapped += addr
                if -addr <= MMAP_THRESHOLD_MAX:
                    threshold = max(threshold, -addr)
            else:
                heap.free(addr)
    return peak
