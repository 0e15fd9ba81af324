"""Soak test of clean exits under torchrun (not collected by pytest: run it by hand).

    python tests/soak_distributed.py --launches 50 [--strategies ddp fsdp lora-fsdp] [--keep DIR]

Launches the 2-process run of tests/test_distributed.py (its small LLM config: 6 steps, gloo,
CPU, one thread per process; `lora-fsdp`: with a LoRA adapter under FSDP2) `--launches` times per
strategy, one launch after the other, each into a fresh out_dir, and prints for each strategy how many launches exited with code 0 (and the
last lines of stderr of every launch that did not). A finished run must exit 0 every time: a
rank that aborts after writing its weights (e.g. `terminate called without an active exception`)
fails the job. Exit code: 0 when every launch exited 0, 1 otherwise.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from test_distributed import LLM, RUN_PY  # noqa: E402  (the test suite's small LLM config)


def write_config(d: Path) -> Path:
    """The config of tests/test_distributed.py's `configs` fixture for the LLM."""
    from train.data import stdlib_files
    corpus = d / "corpus.txt"
    corpus.write_text("".join(f.read_text(errors="replace") for f in stdlib_files()[:10])[:100_000])
    cfg = d / "llm.yaml"
    cfg.write_text(yaml.safe_dump({**LLM, "data": {**LLM["data"], "path": str(corpus)}}))
    return cfg


def launch(cfg: Path, out: Path, strategy: str, timeout: float) -> tuple[int, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(RUN_PY),
           str(cfg), f"train.out_dir={out}", f"train.parallel={strategy.split('-')[-1]}",
           *(["adapter.method=lora"] if strategy.startswith("lora") else [])]
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                           timeout=timeout)
        return p.returncode, p.stderr
    except subprocess.TimeoutExpired as e:
        return -1, f"timed out after {timeout:.0f} s\n{e.stderr or ''}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--launches", type=int, default=50, help="launches per strategy")
    ap.add_argument("--strategies", nargs="+", default=["ddp", "fsdp", "lora-fsdp"], choices=["ddp", "fsdp", "lora-fsdp"])
    ap.add_argument("--timeout", type=float, default=300, help="seconds one launch may take")
    ap.add_argument("--keep", type=Path, help="keep the out_dirs of failed launches under this folder")
    a = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="zoo-soak-"))
    os.environ.setdefault("ZOO_CACHE", str(work / "cache"))
    try:
        cfg = write_config(work)
        ok = {s: 0 for s in a.strategies}
        for i in range(a.launches):
            for s in a.strategies:  # alternated, so that both see the same load on the machine
                out = work / f"{s}-{i}"
                t0 = time.monotonic()
                code, err = launch(cfg, out, s, a.timeout)
                ok[s] += code == 0
                print(f"launch {i + 1}/{a.launches} {s}: exit {code} ({time.monotonic() - t0:.1f} s)", flush=True)
                if code != 0:
                    print("  " + "\n  ".join(err.strip().splitlines()[-15:]), flush=True)
                    if a.keep:
                        a.keep.mkdir(parents=True, exist_ok=True)
                        shutil.copytree(out, a.keep / out.name, dirs_exist_ok=True)
                        (a.keep / out.name / "stderr.txt").write_text(err)
                shutil.rmtree(out, ignore_errors=True)
        for s in a.strategies:
            print(f"{s}: {ok[s]}/{a.launches} launches exited 0")
        return 0 if all(v == a.launches for v in ok.values()) else 1
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
