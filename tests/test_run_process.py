"""train/run.py leaves the user's process alone: one interpreter from start to end (no restart),
the environment the user gave it, and a debugger that keeps its breakpoints."""
import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from tests.test_loop import TINY

ROOT = Path(__file__).resolve().parents[1]

# every interpreter that starts appends its pid and argv; at exit it writes what /proc says its environment is
COUNTER = """
import atexit, json, os, sys
_log = os.environ["ZOO_TEST_STARTS"]
with open(_log, "a") as f:
    f.write(json.dumps({"pid": os.getpid(), "argv": sys.argv}) + "\\n")
def _environ():
    with open("/proc/self/environ", "rb") as f:
        names = sorted(v.split(b"=", 1)[0].decode() for v in f.read().split(b"\\0") if v)
    with open(_log + ".environ", "w") as f:
        json.dump(names, f)
if sys.argv and sys.argv[0].endswith("run.py"):
    atexit.register(_environ)
"""


def tiny_config(tmp_path, corpus) -> Path:
    cfg = json.loads(json.dumps(TINY))
    cfg["train"].update(max_steps=2, out_dir=str(tmp_path / "out"))
    cfg["optim"]["warmup_steps"] = 1
    cfg["data"]["path"] = str(corpus)
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_one_interpreter_and_the_users_environment(tmp_path, text_corpus):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(COUNTER)
    starts = tmp_path / "starts.jsonl"
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "MKL_DISABLE_FAST_MM")}
    env.update(PYTHONPATH=str(site), ZOO_TEST_STARTS=str(starts), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "train/run.py", str(tiny_config(tmp_path, text_corpus))], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    runs = [r for r in map(json.loads, starts.read_text().splitlines()) if r["argv"][0].endswith("run.py")]
    assert len(runs) == 1, runs
    seen = json.loads(Path(str(starts) + ".environ").read_text())
    assert set(seen) <= set(env), set(seen) - set(env)


def test_pdb_keeps_a_breakpoint_set_before_main(tmp_path, text_corpus):
    line = next(i for i, s in enumerate((ROOT / "train/run.py").read_text().splitlines(), 1)
                if s.startswith("def main("))
    commands = f"break train/run.py:{line + 1}\ncontinue\np 'stopped in main'\nquit\n"
    out = subprocess.run([sys.executable, "-m", "pdb", "train/run.py", str(tiny_config(tmp_path, text_corpus))],
                         cwd=ROOT, input=commands, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert "'stopped in main'" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]
