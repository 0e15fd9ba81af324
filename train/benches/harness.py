"""What every benchmark shares: alternating rounds, paired ratios, the command line, tables, memory.

Timing (DESIGN.md, "Benchmarks"): the sides of a comparison run in one process, one after the
other in each round, the order reversed every other round (A B, B A, A B, ...), so that a slow
spell of the machine, the allocator's state or a warm cache favours no side. `run_rounds` gives
each side's seconds per call round by round, on the wall clock and on the process's CPU clock
(which leaves out the time the process waited for a core). From them:
  - each side's best round: the least disturbed one;
  - the paired ratio of two sides in a round (one side's time over the other's, measured back to
    back), and its median over the rounds with the range: the figure a speed target is judged on,
    least moved by a slow spell that hits one side's best round.
At least `MIN_ROUNDS` rounds by default (`--rounds`).

Command line: `parser()` makes each benchmark's parser with the options they share: `--precision`
(the names configs use for `train.precision`: fp32, bf16, fp16), `--rounds`, `--threads` and,
for the training benchmarks, `--no-keep-memory` (by default the process keeps freed memory, as
`train.cpu_keep_memory` does in the loop, for every side alike). A bad value is a one-line error
(exit 2).

Also: `PeakRSS` (the peak resident set size a piece of code adds, sampled by a thread) and
`print_table` (a Markdown table, as docs/ quotes them).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import re
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, NamedTuple, Optional

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from train.hardware import keep_freed_memory, libc  # noqa: E402
from train.hardware import measure_peak_flops  # noqa: E402
from train.step import DTYPES as PRECISIONS  # noqa: E402  (fp32, bf16, fp16: train.precision's names)

MIN_ROUNDS = 8
FORMATS = {"contiguous": torch.contiguous_format, "channels_last": torch.channels_last}


# ---------------------------------------------------------------- rounds
def round_order(names: Iterable[str], r: int) -> list[str]:
    """The order of the sides in round r (from 0): as given, reversed every other round."""
    names = list(names)
    return names if r % 2 == 0 else names[::-1]


def schedule(names: Iterable[str], rounds: int) -> Iterator[tuple[int, str]]:
    """(round, side) in the order they run: every side once a round."""
    for r in range(rounds):
        for name in round_order(names, r):
            yield r, name


def now() -> tuple[float, float]:
    """(wall clock, this process's CPU time) in seconds."""
    return time.perf_counter(), time.process_time()


class Paired(NamedTuple):
    """The median over rounds of a paired ratio, with its range."""
    median: float
    low: float
    high: float

    def __str__(self):
        return f"{self.median:.2f}x ({self.low:.2f}-{self.high:.2f}x)"


@dataclass
class Rounds:
    """Seconds per call of each side, one entry per round, on the wall and CPU clocks."""
    wall: dict[str, list[float]] = field(default_factory=dict)
    cpu: dict[str, list[float]] = field(default_factory=dict)

    def times(self, side: str, clock: str = "wall") -> list[float]:
        return getattr(self, clock)[side]

    def best(self, side: str, clock: str = "wall") -> float:
        """The side's fastest round, in seconds per call."""
        return min(self.times(side, clock))

    def ratio(self, side: str, ref: str, clock: str = "wall") -> float:
        """How many times faster `side` is than `ref`, best round against best round."""
        return self.best(ref, clock) / self.best(side, clock)

    def paired(self, side: str, ref: str, clock: str = "wall") -> Paired:
        """How many times faster `side` is than `ref` within each round (ref's time over side's,
        measured back to back): the median over rounds and the range."""
        ratios = sorted(r / s for s, r in zip(self.times(side, clock), self.times(ref, clock), strict=True))
        return Paired(statistics.median(ratios), ratios[0], ratios[-1])

    def summary(self, side: str, ref: str, clock: str = "wall") -> str:
        n = len(self.times(side, clock))
        return (f"{side} / {ref}: best rounds {self.ratio(side, ref, clock):.2f}x, "
                f"paired median {self.paired(side, ref, clock)} over {n} rounds")


def run_rounds(sides: dict[str, Callable[[], object]], rounds: int, calls: int = 1,
               between: Optional[Callable[[int], object]] = None, sync: Callable[[], object] = lambda: None,
               clock: Callable[[], tuple[float, float]] = now) -> Rounds:
    """Times `calls` calls of each side per round, the sides alternating as `round_order` orders
    them; `sync()` (e.g. a CUDA synchronize) ends each side's turn before the clock is read, and
    `between(round)` runs after each round, untimed. Returns the seconds per call."""
    if rounds < 1 or calls < 1:
        raise ValueError(f"rounds and calls must be >= 1, got {rounds} and {calls}")
    out = Rounds({s: [] for s in sides}, {s: [] for s in sides})
    for r in range(rounds):
        for name in round_order(sides, r):
            fn = sides[name]
            wall0, cpu0 = clock()
            for _ in range(calls):
                fn()
            sync()
            wall1, cpu1 = clock()
            out.wall[name].append((wall1 - wall0) / calls)
            out.cpu[name].append((cpu1 - cpu0) / calls)
        if between is not None:
            between(r)
    return out


# ---------------------------------------------------------------- command line
class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are one line, `bench.py NAME: error: ...`, exit 2 (no usage block)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def name_list(choices: Iterable[str], what: str) -> Callable[[str], list[str]]:
    """An argparse type: a comma-separated list of names from `choices`, in the order given."""
    choices = list(choices)

    def parse(text: str) -> list[str]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        bad = [n for n in names if n not in choices]
        if bad or not names:
            raise argparse.ArgumentTypeError(f"unknown {what} {bad[0]!r} (choose from {', '.join(choices)})"
                                             if bad else f"no {what} given (choose from {', '.join(choices)})")
        return names
    return parse


def precision_name(text: str) -> str:
    """An argparse type: one precision name (fp32, bf16, fp16)."""
    names = name_list(PRECISIONS, "precision")(text)
    if len(names) != 1:
        raise argparse.ArgumentTypeError(f"one precision, got {text!r}")
    return names[0]


def positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def parser(name: str, doc: str, precision: Optional[str] = "fp32,bf16", rounds: bool = True,
           keep_memory: bool = False) -> ArgumentParser:
    """The parser of `bench.py NAME` with the shared options; `precision` is the default list
    (None: no --precision option). `setup(args)` applies --threads and --no-keep-memory."""
    p = ArgumentParser(prog=f"bench.py {name}", description=doc.split("\n")[0])
    if precision is not None:
        p.add_argument("--precision", type=name_list(PRECISIONS, "precision"), default=precision,
                       help=f"comma list of {', '.join(PRECISIONS)} (as train.precision; default {precision})")
    if rounds:
        p.add_argument("--rounds", type=positive_int, default=MIN_ROUNDS,
                       help=f"alternating rounds of the sides (default {MIN_ROUNDS})")
    p.add_argument("--threads", type=positive_int, default=None, help="torch.set_num_threads (default: torch's)")
    if keep_memory:
        p.add_argument("--no-keep-memory", action="store_true",
                       help="leave glibc's default (mmap and unmap large blocks) instead of the loop's cpu_keep_memory")
    return p


def setup(args) -> bool:
    """Applies --threads, and keeps freed memory in the process unless --no-keep-memory (for
    every side alike). Returns whether freed memory is kept."""
    if args.threads:
        torch.set_num_threads(args.threads)
    if getattr(args, "no_keep_memory", True):
        return False
    return keep_freed_memory()


def autocast(precision: str, device_type: str = "cpu"):
    """Autocast to the precision's dtype; fp32 runs without autocast (fp32 master weights either way)."""
    if precision == "fp32":
        return torch.autocast(device_type, enabled=False)
    return torch.autocast(device_type, dtype=PRECISIONS[precision])


def best_peak_flops(device: torch.device, precision: str, peak: float = 0.0) -> float:
    """The larger of `peak` and a new `measure_peak_flops` (the loop's MFU denominator): a
    benchmark calls it between rounds and keeps the least disturbed measurement."""
    return max(peak, measure_peak_flops(device, PRECISIONS[precision]))


# ---------------------------------------------------------------- memory
def rss() -> Optional[int]:
    """The process's resident set size in bytes (Linux); None where /proc is unavailable."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return None


def trim():
    """Collect garbage and hand freed heap memory back to the OS (glibc), so the next peak is measured from a low base."""
    gc.collect()
    c = libc()
    if c is not None:
        c.malloc_trim(0)


class PeakRSS:
    """Context manager: the peak resident set size above the level at entry, sampled by a
    background thread every `every` seconds (`peak` in bytes, None where RSS is unavailable)."""

    def __init__(self, every: float = 0.002):
        self.every, self.peak = every, None

    def __enter__(self):
        trim()
        self.base = rss()
        if self.base is not None:
            self.peak = 0
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def _sample(self):
        self.peak = max(self.peak, rss() - self.base)

    def _run(self):
        while not self._stop.is_set():
            self._sample()
            time.sleep(self.every)

    def __exit__(self, *exc):
        if self.base is not None:
            self._stop.set()
            self._thread.join()
            self._sample()


def gib(n: Optional[int]) -> str:
    return "unavailable" if n is None else f"{n / 2**30:.2f}"


# ---------------------------------------------------------------- quality
def mean_interval(values: Iterable[float], level: float = 0.95) -> tuple[float, float]:
    """(mean, half-width of its `level` Student-t interval) of independent measurements (seeds,
    batches); the half-width is inf for fewer than two."""
    from scipy.stats import t  # scipy comes with scikit-learn, a dependency of zoo
    v = list(values)
    m = statistics.fmean(v)
    if len(v) < 2:
        return m, float("inf")
    return m, float(t.ppf(0.5 + level / 2, len(v) - 1)) * statistics.stdev(v) / len(v) ** 0.5


def verdict(mean: float, half: float, lower_is: str = "lower") -> str:
    """A difference with its interval in words: `inconclusive` when the interval holds zero."""
    if abs(mean) <= half:
        return "inconclusive"
    return lower_is if mean < 0 else ("higher" if lower_is == "lower" else "lower")


# ---------------------------------------------------------------- output
def table_text(header: list[str], rows: Iterable[Iterable[object]]) -> str:
    """A Markdown table, one line per row."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]) + "\n"


def print_table(header: list[str], rows: Iterable[Iterable[object]]):
    """A Markdown table (docs/ quotes them as printed)."""
    print(table_text(header, rows), end="", flush=True)


DOCS_TABLE = re.compile(r"(<!-- bench:([\w-]+) -->\n)(.*?)(<!-- /bench -->)", re.S)


def update_docs_table(page: Path, name: str, table: str, write: bool = True) -> bool:
    """The table between `<!-- bench:NAME -->` and `<!-- /bench -->` in `page` made `table` (tables
    in docs/ are rendered from a benchmark's JSON, never typed in). Returns whether it differed;
    write=False only checks. A page without the markers is a one-line error."""
    text = page.read_text()
    found = [m for m in DOCS_TABLE.finditer(text) if m.group(2) == name]
    if not found:
        raise ValueError(f"{page}: no <!-- bench:{name} --> ... <!-- /bench --> markers")
    new = DOCS_TABLE.sub(lambda m: m.group(1) + table + m.group(4) if m.group(2) == name else m.group(0), text)
    if new != text and write:
        page.write_text(new)
    return new != text


def write_results(data: dict, out: Path, docs_json: Optional[Path] = None,
                  render: Optional[Callable[[dict], list[str]]] = None):
    """A benchmark's JSON at `out`; with docs_json also there, and `render(data)` rewrites the docs
    tables made from it (the names it rewrote are printed)."""
    for path in [out] + ([docs_json] if docs_json is not None else []):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=1))
        print(f"json: {path}")
    if docs_json is not None and render is not None:
        print(f"docs tables rewritten: {', '.join(render(data)) or 'none (up to date)'}")


def render_docs(docs_json: Path, render: Callable[[dict], list[str]]) -> int:
    """`--render`: rewrite the docs tables from the committed JSON alone (no measurement)."""
    print("rewrote: " + (", ".join(render(json.loads(docs_json.read_text()))) or "nothing (up to date)"))
    return 0
