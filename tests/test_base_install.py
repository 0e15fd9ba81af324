"""The base install (`pip install -e .`, no extras) is enough for every default the README
advertises: each runs in a fresh process in which torchvision, timm, diffusers and transformers
cannot be imported (a sitecustomize on PYTHONPATH blocks them), so nothing has to be uninstalled."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OPTIONAL = ("torchvision", "timm", "diffusers", "transformers")

BLOCKER = f"""
import importlib.abc, sys
class _Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {OPTIONAL!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked: not part of the base install)")
sys.meta_path.insert(0, _Absent())
"""


@pytest.fixture(scope="module")
def blocked_env(tmp_path_factory):
    d = tmp_path_factory.mktemp("blocked")
    (d / "sitecustomize.py").write_text(BLOCKER)
    env = {**os.environ, "PYTHONPATH": str(d), "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg"}
    probe = "import importlib\nfor m in {!r}:\n    try:\n        importlib.import_module(m)\n" \
            "    except ImportError:\n        continue\n    raise SystemExit(m + ' is importable')\n".format(OPTIONAL)
    subprocess.run([sys.executable, "-c", probe], env=env, check=True)
    return env


# the defaults the README advertises, each shortened to a few steps; `expect`: what it must write
DEFAULTS = {
    "llm (train/run.py with no config)": (
        [], ["train.max_steps=3", "optim.warmup_steps=1", "train.eval_every=0", "train.eval_batches=2", "train.log_every=1",
             "train.checkpoint_every=0"],
        ["model.safetensors", "metrics.jsonl", "loss.png", "samples.txt", "checkpoints"]),
    "convnet (configs/convnet/resnet-digits.yaml)": (
        ["configs/convnet/resnet-digits.yaml"], ["train.max_steps=3", "optim.warmup_steps=1", "train.eval_every=0", "train.log_every=1"],
        ["model.safetensors", "model_ema.safetensors", "metrics.jsonl", "loss.png", "per_class.txt"]),
    "diffusion (configs/diffusion/digits.yaml)": (
        ["configs/diffusion/digits.yaml"], ["train.max_steps=3", "optim.warmup_steps=1", "train.eval_every=0", "train.log_every=1",
                                            "data.ae_steps=3", "model.sample_steps=2", "data.samples_per_class=2"],
        ["model.safetensors", "model_ema.safetensors", "metrics.jsonl", "loss.png", "samples.png"]),
}


@pytest.mark.parametrize("name", DEFAULTS)
def test_readme_defaults_run_on_the_base_install(name, blocked_env, tmp_path):
    config, overrides, expect = DEFAULTS[name]
    out = tmp_path / "out"
    cmd = [sys.executable, str(ROOT / "train" / "run.py"), *config, f"train.out_dir={out}",
           "train.progress=false", *overrides]
    p = subprocess.run(cmd, cwd=ROOT, env=blocked_env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    missing = [f for f in expect if not (out / f).exists()]
    assert not missing, (missing, sorted(x.name for x in out.iterdir()))
    rows = (out / "metrics.jsonl").read_text().splitlines()
    assert any('"loss"' in r for r in rows) and any('"val_loss"' in r for r in rows)
