"""The benchmark harness (train/benches/harness.py) and the benchmarks' command lines.

No benchmark is run here: the harness is checked on a scripted clock, the command lines by
argument parsing only.
"""
import json
import statistics
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import torch

from train import bench, hardware, metrics
from train.benches import gate as bench_gate
from train.benches import harness
from train.config import TrainConfig
from conftest import CPU, CUDA


class ScriptedSides:
    """Sides whose calls take scripted seconds on a fake clock (wall and CPU time apart)."""

    def __init__(self, wall: dict, cpu: dict):
        self.wall, self.cpu = {k: list(v) for k, v in wall.items()}, {k: list(v) for k, v in cpu.items()}
        self.t_wall = self.t_cpu = 0.0
        self.log = []

    def clock(self):
        return self.t_wall, self.t_cpu

    def side(self, name):
        def call():
            self.log.append(name)
            self.t_wall += self.wall[name].pop(0)
            self.t_cpu += self.cpu[name].pop(0)
        return call


def test_rounds_alternate_and_give_best_and_paired_median():
    wall = {"zoo": [1.0, 2.0, 1.5, 3.0], "ref": [2.0, 2.0, 3.0, 3.3]}
    cpu = {"zoo": [0.5, 0.5, 0.9, 0.6], "ref": [0.4, 1.0, 0.8, 0.7]}
    s = ScriptedSides(wall, cpu)
    between = []
    r = harness.run_rounds({"zoo": s.side("zoo"), "ref": s.side("ref")}, rounds=4, clock=s.clock,
                           between=lambda i: between.append((i, len(s.log))))
    # the order reverses every other round; `between` runs after both sides of each round
    assert s.log == ["zoo", "ref", "ref", "zoo", "zoo", "ref", "ref", "zoo"]
    assert between == [(0, 2), (1, 4), (2, 6), (3, 8)]
    for clock, script in (("wall", wall), ("cpu", cpu)):
        for side in script:
            assert r.times(side, clock) == pytest.approx(script[side])
    assert r.best("zoo") == 1.0 and r.best("ref") == 2.0 and r.best("ref", "cpu") == 0.4
    assert r.ratio("zoo", "ref") == pytest.approx(2.0)
    # paired: ref's time over zoo's in each round = 2, 1, 2, 1.1 -> median 1.55, range 1-2
    ratios = [b / a for a, b in zip(wall["zoo"], wall["ref"])]
    assert r.paired("zoo", "ref") == pytest.approx((statistics.median(ratios), 1.0, 2.0))
    assert r.paired("zoo", "ref").median == pytest.approx(1.55)
    assert r.paired("ref", "zoo").median == pytest.approx(statistics.median([1 / x for x in ratios]))
    cpu_ratios = [b / a for a, b in zip(cpu["zoo"], cpu["ref"])]
    assert r.paired("zoo", "ref", "cpu") == pytest.approx(
        (statistics.median(cpu_ratios), min(cpu_ratios), max(cpu_ratios)))
    assert str(r.paired("zoo", "ref")) == "1.55x (1.00-2.00x)"


def test_rounds_divide_by_calls_and_order_more_sides():
    s = ScriptedSides({"a": [1.0] * 6, "b": [3.0] * 6, "c": [2.0] * 6}, {"a": [0] * 6, "b": [0] * 6, "c": [0] * 6})
    r = harness.run_rounds({n: s.side(n) for n in "abc"}, rounds=3, calls=2, clock=s.clock)
    assert s.log == list("aabbcc" "ccbbaa" "aabbcc")
    assert r.wall == {"a": [1.0] * 3, "b": [3.0] * 3, "c": [2.0] * 3}
    assert list(harness.schedule("ab", 3)) == [(0, "a"), (0, "b"), (1, "b"), (1, "a"), (2, "a"), (2, "b")]
    with pytest.raises(ValueError):
        harness.run_rounds({"a": s.side("a")}, rounds=0)


def test_precision_names_are_the_configs():
    # every explicit train.precision name ('auto' chooses one per machine: a benchmark names its own; bf16-pure is
    # bf16 autocast on bf16 weights, a way of training rather than a dtype)
    names = typing.get_args(typing.get_type_hints(TrainConfig)["precision"])
    assert tuple(harness.PRECISIONS) == tuple(n for n in names if n not in ("auto", "bf16-pure"))
    p = harness.parser("x", "doc", precision="bf16,fp32")
    assert p.parse_args([]).precision == ["bf16", "fp32"]
    assert p.parse_args(["--precision", "fp16"]).precision == ["fp16"]
    assert p.parse_args([]).rounds == harness.MIN_ROUNDS >= 8


@pytest.mark.parametrize("name", sorted(set(bench.BENCHES) - {"gpu", "float8", "bf16-pure", "gate"}))  # their rows fix
# their precisions
@pytest.mark.parametrize("value", ["bfloat16", "fp32,float16", ","])
def test_every_bench_rejects_a_bad_precision_in_one_line(name, value, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main([name, "--precision", value])
    assert e.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"bench.py {name}: error: argument --precision") and "fp32, bf16, fp16" in err


def test_a_missing_model_folder_is_one_line(tmp_path, capsys):
    """sft-quality without runs/tiny (its default --base): exit 2 and one line naming the folder, no traceback."""
    assert bench.main(["sft-quality", "--base", str(tmp_path / "nope"), "--runs", str(tmp_path / "nope2")]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {tmp_path / 'nope'}: no such file or folder\n"


def test_bad_precision_from_the_command_line():
    """The whole command, in a fresh interpreter: exit 2 and one line, no traceback."""
    out = subprocess.run([sys.executable, "train/bench.py", "llm-generate", "--precision", "bfloat16"],
                         cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "bench.py llm-generate: error: argument --precision: unknown precision 'bfloat16' (choose from fp32, bf16, fp16)"]


def test_loop_and_benches_share_one_peak_flops(monkeypatch):
    assert harness.measure_peak_flops is hardware.measure_peak_flops
    assert metrics.measure_peak_flops is hardware.measure_peak_flops  # the loop's MFU denominator
    # a bench keeps the best of its calls, each made in the precision's dtype
    calls = []
    measured = iter([3.0, 5.0, 4.0])
    monkeypatch.setattr(harness, "measure_peak_flops", lambda device, dtype: calls.append(dtype) or next(measured))
    peak = 0.0
    for _ in range(3):
        peak = harness.best_peak_flops(CPU, "bf16", peak)
    assert peak == 5.0 and calls == [torch.bfloat16] * 3


def test_the_vendors_peak_names_the_gpu_by_its_most_specific_name(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    gpu = CUDA
    for name, want in (("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12), ("NVIDIA L40S", 362e12),
                       ("NVIDIA L4", 121e12), ("NVIDIA A100-SXM4-80GB", 312e12), ("Tesla T4", None)):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, n=name: n)
        assert hardware.vendor_peak_flops(gpu, torch.bfloat16) == (None if want is None else (name, want)), name
    assert hardware.vendor_peak_flops(gpu, None) is None  # fp32: measured, never the 16-bit figure
    assert hardware.vendor_peak_flops(CPU, torch.bfloat16) is None


def test_peak_rss_sees_an_allocation():
    if harness.rss() is None:
        pytest.skip("no /proc/self/statm: the resident set size is unavailable here")
    with harness.PeakRSS() as m:
        x = torch.ones(64 * 2**20 // 4)  # 64 MiB, written
        del x
    assert 48 * 2**20 < m.peak < 1 * 2**30


def test_every_name_is_an_entry_point_of_its_module(capsys):
    """Every name of bench.BENCHES (the public interface) builds its parser, merged modules through their preset."""
    for name in bench.BENCHES:
        with pytest.raises(SystemExit) as e:
            bench.main([name, "--help"])
        assert e.value.code == 0, name
        assert capsys.readouterr().out.startswith(f"usage: bench.py {name} "), name


def test_one_parser_for_llm_shapes(capsys):
    p = harness.llm_args(harness.parser("x", "doc"), d_model=64, n_layers=2, n_heads=2, n_kv_heads=1, vocab=512, seq=32)
    args = p.parse_args(["--layers", "3", "--seq-len", "16", "--n-kv-heads", "0"])
    cfg = harness.llm_config(args, tie_embeddings=False)
    assert (cfg.n_layers, cfg.max_seq_len, cfg.d_model, cfg.vocab_size, cfg.tie_embeddings) == (3, 16, 64, 512, False)
    assert cfg.resolved_n_kv_heads == 2  # 0: as many as heads
    assert args.command == "python train/bench.py x --layers 3 --seq-len 16 --n-kv-heads 0"
    for name in ("llm-train", "llm-moe", "llm-mod", "doc-mask", "llm-generate", "optimizers", "distributed", "sft-packing",
                 "distill", "lr-find"):
        with pytest.raises(SystemExit):
            bench.main([name, "--help"])
        assert "--d-model" in capsys.readouterr().out, name


def test_the_entry_point_leaves_the_process_alone():
    """train/bench.py runs in the interpreter it was started in (no re-execution, no environment set)."""
    source = (Path(__file__).resolve().parents[1] / "train" / "bench.py").read_text()
    assert "restart" not in source and "environ" not in source and "execv" not in source
    out = subprocess.run([sys.executable, "train/bench.py"], cwd=Path(__file__).resolve().parents[1], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.count("benchmarks: ") == 1


def test_gpu_dry_run_lists_every_row_with_its_shape_and_a_command_that_exists(tmp_path, capsys):
    from train.benches import gpu
    assert bench.main(["gpu", "--dry-run", "--out", str(tmp_path), "--json", str(tmp_path / "docs.json")]) == 0
    out = capsys.readouterr().out
    result = json.loads((tmp_path / "gpu.json").read_text())
    assert result == json.loads((tmp_path / "docs.json").read_text())
    assert {"command", "machine", "date", "tables", "data"} <= set(result) and result["data"] == {"dry_run": True}
    table = result["tables"]["rows"]
    assert table["columns"] == ["row", "measures", "shape", "status", "seconds"]
    rows = gpu.rows()
    core = [n for n, r in rows.items() if r.core]
    assert [r[0] for r in table["rows"]] == core and all(r[2] and r[3] == "not run (dry run)" for r in table["rows"])
    assert {"llm-train", "generate", "planner", "cuda-tests"} <= set(core)
    assert sum(rows[n].limit_s for n in core) <= gpu.LEASE_S == 8 * 60  # the core rows fit one lease
    assert f"the core rows' limits add up to {sum(rows[n].limit_s for n in core) / 60:.1f} of one lease's 8" in out
    assert all(r.limit_s <= 10 * 60 for r in rows.values())  # each row fits one 10-minute command on a GPU
    for name, row in rows.items():
        cmd = gpu.command(row, tmp_path / "x.json")
        if "--row" in cmd:
            assert cmd[cmd.index("--row") + 1] in gpu.OWN
        elif cmd[1].endswith("bench.py"):  # another bench, with options its parser takes
            check_options(cmd[2], cmd[3:])
        else:
            assert "torch.distributed.run" in cmd and "configs/llm/smollm-135m.yaml" in cmd
        assert row.tiny, name  # what --rehearse runs it with
    assert "| llm-train |" in (tmp_path / "gpu.md").read_text()
    for name in core:
        assert f"  {name}: {rows[name].what}\n    shape: {rows[name].shape}\n    limit: {rows[name].limit_s} s\n" in out
    # without CUDA the plain command prints the same plan and writes nothing
    if not torch.cuda.is_available():
        assert bench.main(["gpu", "--out", str(tmp_path / "plain")]) == 0
        assert "no CUDA device here" in capsys.readouterr().out and not (tmp_path / "plain").exists()


def check_options(name: str, args: list):
    """`bench.py NAME ARGS` parses: NAME's own parser reads ARGS, and nothing runs."""
    import argparse
    seen = {}
    real = argparse.ArgumentParser.parse_args

    def record(self, a=None, ns=None):
        seen["args"] = real(self, args, ns)
        raise SystemExit(0)
    argparse.ArgumentParser.parse_args = record
    try:
        with pytest.raises(SystemExit):
            bench.main([name])
    finally:
        argparse.ArgumentParser.parse_args = real
    assert "args" in seen, name


def test_gate_rehearses_every_eager_check_and_judges_by_its_noise(tmp_path):
    """`bench.py gate --rehearse`: each check's benchmark runs at tiny shapes and its paired ratio is read
    back from the benchmark's own result data (Inductor's compilations are the full run's); a rehearsal
    judges and writes nothing. A check fails when its ratio is below the committed one by more than its noise."""
    for check in (c for c in bench_gate.CHECKS if "compiled" not in c):
        m = bench_gate.measure(check, rehearse=True, threads=None)
        assert m["ratio"] > 0 and m["noise"] >= 0, check
    gate = tmp_path / "gate.json"
    assert bench.main(["gate", "--rehearse", "--update", "--gate", str(gate), "--checks", "data-prepare"]) == 0
    assert not gate.exists()
    assert bench_gate.falls({"ratio": 1.2, "noise": 0.1}, {"ratio": 1.5}) and \
        not bench_gate.falls({"ratio": 1.45, "noise": 0.1}, {"ratio": 1.5}) and \
        not bench_gate.falls({"ratio": 0.5, "noise": 0.0}, None)


@pytest.mark.slow
def test_gpu_rehearsal_runs_every_row_at_tiny_shapes_on_the_cpu(tmp_path):
    """Every row of `bench.py gpu` (its own process, its code path, compiled calls traced by dynamo) at tiny shapes
    on the CPU: a GPU lease never finds a broken row. Nothing goes to docs/results."""
    from train.benches import gpu
    docs = Path(harness.RESULTS) / "gpu.json"
    before = docs.read_bytes() if docs.exists() else None
    code = bench.main(["gpu", "--rehearse", "--out", str(tmp_path)])
    table = json.loads((tmp_path / "gpu.json").read_text())["tables"]["rows"]
    assert [(r[0], r[3]) for r in table["rows"]] == [(n, "ok") for n in gpu.rows()] and code == 0, table["rows"]
    assert (docs.read_bytes() if docs.exists() else None) == before


def test_interval_text_forms_and_positive_integer_options(capsys):
    """The harness's one 'mean ± half' cell: words after the verdict, in parentheses, scaled with a unit; and the
    positive-integer options, with and without help, in the order given."""
    m, h = harness.mean_interval([0.5, 0.6, 0.7])
    assert harness.interval_text([0.5, 0.6, 0.7]) == f"{m:+.4f} ± {h:.4f}"
    assert harness.interval_text([0.5, 0.6, 0.7], words="recipe").endswith(" recipe higher")
    assert harness.interval_text([-0.1, 0.1], words="recipe").endswith(" ± 1.2706 inconclusive")
    assert harness.interval_text([0.5, 0.6, 0.7], ".1f", half=".1f", scale=100, unit="%") == f"60.0% ± {100 * h:.1f}"
    assert harness.interval_text([-0.5, -0.6, -0.7], "+.3f", half=".3f", paren=True) == f"-0.600 ± {h:.3f} (lower)"
    p = harness.counts(harness.parser("x", "doc"), steps=3, new_tokens=(4, "tokens per row"))
    assert vars(p.parse_args(["--new-tokens", "7"]))["new_tokens"] == 7 and p.parse_args([]).steps == 3
    with pytest.raises(SystemExit):
        p.parse_args(["--steps", "0"])
    assert capsys.readouterr().err == "bench.py x: error: argument --steps: must be >= 1, got 0\n"
    help_ = " ".join(p.format_help().split())
    assert help_.index("--steps STEPS --new-tokens NEW_TOKENS tokens per row") > help_.index("--threads")


def test_distributed_launches_parse_under_torchrun(monkeypatch):
    """The DDP / FSDP2 sides' torchrun commands parse with the bench's own --nproc among the script's options (which
    torchrun's parser once read as an ambiguous abbreviation of its --nproc-per-node, exit 2)."""
    import types
    from torch.distributed.run import get_args_parser
    from train.benches import distributed
    seen = []
    monkeypatch.setattr(distributed.subprocess, "run", lambda cmd, **kw: seen.append(cmd) or types.SimpleNamespace(
        returncode=0, stdout="{}\n", stderr=""))
    args = types.SimpleNamespace(argv=["--steps", "2", "--nproc", "2", "--nproc=2"], nproc=2, worker_tune="full")
    distributed.launch("ddp", args, "fp32")
    torchrun = get_args_parser().parse_args(seen[0][seen[0].index("torch.distributed.run") + 1:])
    assert torchrun.nproc_per_node == "2" and torchrun.training_script_args[:3] == ["distributed", "--steps", "2"]
