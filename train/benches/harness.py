"""What every benchmark shares: alternating rounds and paired ratios, the statistics (scipy's), the
command line (shared options, one parser for LLM shapes), training sides, peak memory, runs of the
loop, and the result JSON that docs tables are rendered from (docs/results/NAME.json, train/docs.py).

The sides run in one process, in an order reversed every other round; a speed target is judged on
the median of the per-round paired ratio (DESIGN.md, "Benchmarks").
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import platform
import resource
import shlex
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, NamedTuple, Optional

import torch

import zoo
from train.config import OptimConfig, load_run_config
from train.docs import markdown
from train.hardware import keep_freed_memory, libc, measure_peak_flops
from train.metrics import read_rows
from train.optim import build_optimizer
from train.step import DTYPES as PRECISIONS, autocast_for  # PRECISIONS: train.precision's names (fp32, bf16, fp16)
from zoo.config import LLMConfig

ROOT = Path(__file__).resolve().parents[2]
MIN_ROUNDS = 8
FORMATS = {"contiguous": torch.contiguous_format, "channels_last": torch.channels_last}
RESULTS = ROOT / "docs" / "results"
LEVEL = 0.95


# ---------------------------------------------------------------- rounds
def schedule(names: Iterable[str], rounds: int) -> Iterator[tuple[int, str]]:
    """(round, side) in the order they run: every side once a round, the order reversed every other round."""
    names = list(names)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            yield r, name


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

    @classmethod
    def empty(cls, sides: Iterable[str]) -> "Rounds":
        return cls({s: [] for s in sides}, {s: [] for s in sides})

    def best(self, side: str, clock: str = "wall") -> float:
        return min(self.times(side, clock))

    def median(self, side: str, clock: str = "wall") -> float:
        return statistics.median(self.times(side, clock))

    def ratio(self, side: str, ref: str, clock: str = "wall") -> float:
        """How many times faster `side` is than `ref`, best round against best round."""
        return self.best(ref, clock) / self.best(side, clock)

    def paired(self, side: str, ref: str, clock: str = "wall") -> Paired:
        """How many times faster `side` is than `ref` within each round: the median and the range."""
        ratios = sorted(r / s for s, r in zip(self.times(side, clock), self.times(ref, clock), strict=True))
        return Paired(statistics.median(ratios), ratios[0], ratios[-1])

    def summary(self, side: str, ref: str, clock: str = "wall") -> str:
        n = len(self.times(side, clock))
        return (f"{side} / {ref}: best rounds {self.ratio(side, ref, clock):.2f}x, "
                f"paired median {self.paired(side, ref, clock)} over {n} rounds"
                + ("" if clock == "wall" else f" ({clock})"))


def run_rounds(sides: dict[str, Callable[[], object]], rounds: int, calls: int = 1,
               between: Optional[Callable[[int], object]] = None, sync: Callable[[], object] = lambda: None,
               clock: Callable[[], tuple[float, float]] = lambda: (time.perf_counter(), time.process_time()),
               warmup: int = 0) -> Rounds:
    """Seconds per call of `calls` calls of each side per round in `schedule`'s order (after `warmup` untimed calls
    of each) on the wall clock and this process's CPU time; `sync()` ends each side's turn before the clock is read,
    `between(round)` runs after each round, untimed."""
    if rounds < 1 or calls < 1:
        raise ValueError(f"rounds and calls must be >= 1, got {rounds} and {calls}")
    if warmup:
        warm_up(sides, warmup, say=lambda m: None)
        sync()
    out = Rounds.empty(sides)
    for i, (r, name) in enumerate(schedule(sides, rounds)):
        wall0, cpu0 = clock()
        for _ in range(calls):
            sides[name]()
        sync()
        wall1, cpu1 = clock()
        out.wall[name].append((wall1 - wall0) / calls)
        out.cpu[name].append((cpu1 - cpu0) / calls)
        if between is not None and (i + 1) % len(sides) == 0:  # the round's last side
            between(r)
    return out


def warm_up(sides: dict[str, Callable[[], object]], calls: int = 1, say=print) -> dict[str, float]:
    """`calls` untimed calls of each side (compilation happens here); their seconds per side."""
    out = {}
    for name, fn in sides.items():
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out[name] = time.perf_counter() - t0
        say(f"  warm-up {name}: {out[name]:.1f} s")
    return out


# ---------------------------------------------------------------- statistics (scipy's, for every bench and the report)
def mean_interval(values: Iterable[float], level: float = LEVEL) -> tuple[float, float]:
    """(mean, half-width of its Student-t interval) of independent measurements; inf for fewer than two."""
    from scipy.stats import t  # scipy comes with scikit-learn, a dependency of zoo
    v = [float(x) for x in values]
    m = statistics.fmean(v)
    if len(v) < 2:
        return m, float("inf")
    return m, float(t.ppf(0.5 + level / 2, len(v) - 1)) * statistics.stdev(v) / len(v) ** 0.5


def median_rank(n: int, level: float = LEVEL) -> Optional[int]:
    """The largest k with P(X_(k) <= median <= X_(n+1-k)) >= level for n samples (a binomial tail),
    or None when even the full range covers less (n <= 5 at 95%)."""
    from scipy.stats import binom
    ks = [k for k in range(1, n // 2 + 1) if 1 - 2 * binom.cdf(k - 1, n, 0.5) >= level - 1e-12]
    return max(ks, default=None)


def verdict(mean: float, half: float) -> str:
    """A difference with its interval in words: `inconclusive` when the interval holds zero, else lower or higher."""
    return "inconclusive" if abs(mean) <= half else "lower" if mean < 0 else "higher"


def interval_text(values: Iterable[float], fmt: str = "+.4f", words: str = "", half: str = ".4f", scale: float = 1,
                  unit: str = "", paren: bool = False) -> str:
    """'mean ± half' of the values (times `scale`, `unit` after the mean), then the verdict: after `words` (e.g.
    'recipe') when given, in parentheses with `paren`."""
    m, h = mean_interval(values)
    v = verdict(m, h)
    tail = f" ({v})" if paren else f" {v if v == 'inconclusive' else f'{words} {v}'}" if words else ""
    return f"{scale * m:{fmt}}{unit} ± {scale * h:{half}}" + tail


# ---------------------------------------------------------------- command line
class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are one line (`bench.py NAME: error: ...`, exit 2), and which records the
    command line as `args.command` (what a result JSON says made it)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")

    def parse_args(self, argv=None, namespace=None):
        argv = sys.argv[2:] if argv is None else list(argv)
        args = super().parse_args(argv, namespace)
        args.command, args.argv = shlex.join(["python", "train/bench.py", self.prog.split()[-1], *argv]), argv
        return args

    def setup(self, argv=None):
        """The arguments, with `setup` applied to them."""
        args = self.parse_args(argv)
        setup(args)
        return args


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


def counts(p: argparse.ArgumentParser, **options) -> argparse.ArgumentParser:
    """Positive-integer options in the order given: name=default, or name=(default, help); "_" in a name is "-"."""
    for name, spec in options.items():
        default, help_ = spec if isinstance(spec, tuple) else (spec, None)
        p.add_argument("--" + name.replace("_", "-"), type=positive_int, default=default, help=help_)
    return p


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def seed_list(at_least: int) -> Callable[[str], list[int]]:
    """An argparse type: a comma list of train.seed values, at least `at_least` of them."""
    def seeds(text: str) -> list[int]:
        if len(out := int_list(text)) < at_least:
            raise argparse.ArgumentTypeError(f"at least {at_least} seeds for an interval, got {len(out)}")
        return out
    return seeds


def parser(name: str, doc: str, precision: Optional[str] = "fp32,bf16", rounds: bool = True,
           keep_memory: bool = False, one_precision: bool = False, result: Optional[str] = "", out: bool = False,
           seeds: int = 0) -> ArgumentParser:
    """The parser of `bench.py NAME` with the shared options its arguments ask for (precision "": the config's
    train.precision; result None: no --json); each option's help says its default."""
    p = ArgumentParser(prog=f"bench.py {name}", description=doc.strip().split("\n")[0])
    if precision is not None:
        kind = precision_name if one_precision else name_list(PRECISIONS, "precision")
        p.add_argument("--precision", type=kind, default=precision or None,
                       help=f"{'one' if one_precision else 'comma list'} of {', '.join(PRECISIONS)} "
                            f"(default {precision or 'the config’s'})")
    if rounds:
        p.add_argument("--rounds", type=positive_int, default=MIN_ROUNDS,
                       help=f"alternating rounds (default {MIN_ROUNDS})")
    p.add_argument("--threads", type=positive_int, default=None, help="torch.set_num_threads (default: torch's)")
    if keep_memory:
        p.add_argument("--no-keep-memory", action="store_true", help="glibc's default instead of cpu_keep_memory")
    if result is not None:
        p.add_argument("--json", type=Path, default=RESULTS / f"{result or name}.json", help="where the result goes")
    if out:
        p.add_argument("--out", default=f"runs/bench-{name}", help="the runs' folder (finished runs are read back)")
    if seeds:
        p.add_argument("--seeds", type=seed_list(seeds), default=[0, 1, 2],
                       help=f"comma list of train.seed values (at least {seeds})")
    return p


SHAPE_ALIASES = {"n_layers": ["--layers"], "n_heads": ["--heads"], "n_kv_heads": ["--kv-heads"], "seq": ["--seq-len"],
                 "ffn": ["--expert-hidden"]}


def llm_args(p: argparse.ArgumentParser, **defaults) -> argparse.ArgumentParser:
    """The LLM shape options of every LLM bench (`--n-layers` and so on), with the bench's defaults."""
    for key, default in defaults.items():
        p.add_argument("--" + key.replace("_", "-"), *SHAPE_ALIASES.get(key, []), dest=key, default=default,
                       type=int if key in ("n_kv_heads", "ffn") else positive_int)
    return p


def llm_config(args, **over):
    """The LLMConfig of the shape options (and `over`)."""
    shape = dict(vocab_size=args.vocab, d_model=args.d_model, n_layers=args.n_layers, n_heads=args.n_heads,
                 n_kv_heads=getattr(args, "n_kv_heads", 0) or None, ffn_hidden=getattr(args, "ffn", 0) or None,
                 max_seq_len=getattr(args, "seq", None))
    return LLMConfig(**{k: v for k, v in {**shape, **over}.items() if v is not None})


def llm_base(vocab: int, d: int, layers: int, heads: int, kv: int, batch: int, seq: int = 256) -> dict:
    """A base run config of an LLM of that shape on bytes, fp32 (run_loop, train.planner, the report)."""
    return {"family": "llm", "model": {"vocab_size": vocab, "d_model": d, "n_layers": layers, "n_heads": heads,
                                       "n_kv_heads": kv, "max_seq_len": seq},
            "data": {"tokenizer": "bytes", "seq_len": seq}, "train": {"batch_size": batch, "precision": "fp32"}}


def setup(args):
    """Applies --threads, keeps freed memory unless --no-keep-memory (every side alike), and says so."""
    if args.threads:
        torch.set_num_threads(args.threads)
    kept = not getattr(args, "no_keep_memory", True) and keep_freed_memory()
    print(f"{args.command}: torch {torch.__version__}, {torch.get_num_threads()} threads, freed memory "
          f"{'kept' if kept else 'returned to the OS'}", flush=True)


def autocast(precision: str, device_type: str = "cpu"):
    """The loop's autocast context for the precision (train.step.autocast_for; none in fp32)."""
    return autocast_for(torch.device(device_type), precision)()


def step_calls(sides: dict, precision: str) -> dict[str, Callable[[], object]]:
    """{name: a call of that Side's training step in `precision`}."""
    return {n: (lambda s=s: s.step(precision)) for n, s in sides.items()}


def best_peak_flops(device: torch.device, precision: str, peak: float = 0.0) -> float:
    """The larger of `peak` and a new `measure_peak_flops` (the loop's MFU denominator)."""
    return max(peak, measure_peak_flops(device, PRECISIONS[precision]))


def inference_sides(calls: dict[str, Callable[[], object]], precision: str, outs: dict) -> dict:
    """Each call under inference_mode and autocast(precision), its output kept in outs[name]."""
    def side(name):
        def run():
            with torch.inference_mode(), autocast(precision):
                outs[name] = calls[name]()
        return run
    return {k: side(k) for k in calls}


class Side:
    """A model, its optimizer (the loop's AdamW by default) and one training step:
    loss(model or its compiled self, *batch) -> loss; backward; step; zero_grad(set_to_none)."""

    def __init__(self, model, loss, optimizer=None, compile: bool = False, device=torch.device("cpu")):
        self.model, self.loss_fn, self.device = model.train(), loss, device
        self.fwd = torch.compile(model) if compile else model
        self.opt = optimizer or build_optimizer(model, OptimConfig(), device, log=lambda *a: None)

    def step(self, precision: str = "fp32", *batch):
        with autocast(precision, self.device.type):
            loss = self.loss_fn(self.fwd, *batch)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.loss = loss.detach()
        return self.loss


# ---------------------------------------------------------------- memory
def rss() -> Optional[int]:
    """The process's resident set size in bytes (Linux); None where /proc is unavailable."""
    with contextlib.suppress(OSError, ValueError):
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return None


class PeakRSS:
    """Context manager: the peak resident set size above the level at entry (garbage collected and freed heap
    memory handed back first), sampled by a thread every `every` seconds (`peak` in bytes, None where RSS is
    unavailable)."""

    def __init__(self, every: float = 0.002):
        self.every, self.peak = every, None

    def __enter__(self):
        gc.collect()
        if libc() is not None:
            libc().malloc_trim(0)
        self.base = rss()
        if self.base is not None:
            self.peak, self._stop = 0, threading.Event()
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, rss() - self.base)
            time.sleep(self.every)

    def __exit__(self, *exc):
        if self.base is not None:
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, rss() - self.base)


def busy_cpu_s() -> Optional[float]:
    """CPU seconds every process of the machine has used since boot (/proc/stat: all but idle and iowait)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        ticks = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:9]]
        return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")
    return None


def own_cpu_s() -> float:
    """CPU seconds of this process and its finished children (the measurements' subprocesses)."""
    return sum(getattr(resource.getrusage(w), f) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
               for f in ("ru_utime", "ru_stime"))


def others_share(start: tuple, end: tuple, cores: int) -> Optional[float]:
    """The share of the machine's CPU time (wall x cores) other processes used between two (wall, busy, own) samples."""
    if start[1] is None or end[1] is None or end[0] <= start[0]:
        return None
    return max(0.0, ((end[1] - start[1]) - (end[2] - start[2])) / ((end[0] - start[0]) * max(1, cores)))


def gib(n: Optional[int]) -> str:
    return "unavailable" if n is None else f"{n / 2**30:.2f}"


# ---------------------------------------------------------------- runs of the loop
QUIET = ["train.progress=false", "train.samples=false", "train.plot=false", "train.export=false"]


def run_loop(config, out, overrides: Iterable[str] = (), threads: Optional[int] = None, inproc: bool = False,
             done: Optional[str] = "model.safetensors") -> list[dict]:
    """The metrics rows of a run of `config` (a path or a base dict) with `overrides` into `out`: read
    back when `out/done` exists (done=None: never), else run by train/run.py in a process of its own
    (`threads` OMP threads) or in this one (`inproc`)."""
    out = Path(out)
    over = [f"train.out_dir={out}", *QUIET, *overrides]
    if done is None or not (out / done).exists():
        if inproc or isinstance(config, dict):
            from train.loop import train
            cfg = (load_run_config(None, over, base=config) if isinstance(config, dict)
                   else load_run_config(str(config), over))
            train(cfg, log=lambda m: None)
        else:
            cmd = [sys.executable, str(ROOT / "train" / "run.py"), str(config), *over]
            print(" ".join(cmd[1:]), flush=True)
            env = dict(os.environ, OMP_NUM_THREADS=str(threads)) if threads else None
            subprocess.run(cmd, check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    return read_rows(out)


def zoo_copy(ref, **kw):
    """Zoo's model as zoo.from_pretrained reads the folder `ref` (a diffusers or transformers model) saves."""
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        ref.save_pretrained(tmp)
        return zoo.from_pretrained(tmp, **kw)


def run_task(folder):
    """The task of the run in `folder` (its config.yaml) with its data read, on the CPU."""
    from train.builder import new_task
    return new_task(load_run_config(str(Path(folder) / "config.yaml")), torch.device("cpu"), "fp32", lambda m: None)


def last_with(rows: list[dict], key: str) -> dict:
    """The last metrics row that holds `key`."""
    return [r for r in rows if key in r][-1]


def last(rows: list[dict], key: str) -> float:
    return last_with(rows, key)[key]


def final(rows: list[dict]) -> dict:
    """The last step's rows merged (its training and evaluation rows)."""
    step = max(r["step"] for r in rows)
    return {k: v for r in rows if r["step"] == step for k, v in r.items()}


def median_of(rows: list[dict], key: str) -> float:
    vals = [r[key] for r in rows if key in r]
    return statistics.median(vals[1:] if len(vals) > 2 else vals)  # the first window includes warm-up


# ---------------------------------------------------------------- results: tables and their JSON
def hardware() -> dict:
    import importlib.metadata as md
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError, StopIteration):
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    versions = {}
    for pkg in ("torch", "transformers", "torchao", "peft", "timm", "diffusers", "numpy", "matplotlib"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            versions[pkg] = "not installed"
    return {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "python": platform.python_version(), "platform": platform.platform(), "versions": versions}


def now() -> str:
    """The date and time (UTC) a result says it was measured at."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def load(prefix: str = ", ") -> str:
    """`prefix` and the load average now ("" where the OS has none)."""
    return f"{prefix}load average {os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else ""


def machine() -> str:
    """One line: the CPU, cores, torch threads, the GPU, torch, and the load average now."""
    h = hardware()
    gpu = f", {h['gpu']}" if h["gpu"] else ""
    return f"{h['cpu']}, {h['cores']} cores, {h['torch_threads']} torch threads{gpu}, torch {torch.__version__}{load()}"


def measured() -> str:
    """When and under what load a number was taken, for a table that keeps numbers of other runs."""
    return f"measured {now()}{load()}"


def table(columns: list[str], rows: Iterable[Iterable[object]], notes: str = "") -> dict:
    """A table as a result JSON holds it: column names, rows of cells (text), lines below it."""
    return {"columns": list(columns), "rows": [[str(c) for c in r] for r in rows],
            **({"notes": notes} if notes else {})}


def show(tables: dict):
    """Print each table as markdown (as docs/ shows it)."""
    for key, t in tables.items():
        print(f"\n{key}:\n" if key else "", markdown(t), sep="", end="", flush=True)


def load_result(path: Path) -> dict:
    return json.loads(Path(path).read_text()) if Path(path).is_file() else {}


def save(args, tables: dict, data: dict, path: Optional[Path] = None, show_tables: bool = True) -> None:
    """Prints the tables and writes the result JSON (args.json); under docs/results/ the docs made from it too."""
    if show_tables:
        show(tables)
    path = Path(path or args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    result = {"command": args.command, "machine": machine(), "date": now(), "tables": tables, "data": data}
    path.write_text(json.dumps(result, indent=1, default=lambda o: getattr(o, "__dict__", str(o))) + "\n")
    print(f"\nresult: {path}")
    if path.resolve().parent == RESULTS.resolve():
        from train.docs import main as docs
        docs([])
