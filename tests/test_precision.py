"""train.precision: auto on a CPU: decided by the CPU's bf16 instructions, confirmed by a timing
repeated until stable, so that every process on the same machine gets the same answer."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import train.step as step
from conftest import CPU

pytestmark = pytest.mark.cpu_only("train.precision: auto on a CPU, decided by the CPU's own instructions and timing")

ROOT = Path(__file__).resolve().parents[1]


def test_the_instructions_decide_and_the_timing_confirms(monkeypatch):
    logs = []
    monkeypatch.setattr(step, "cpu_has_bf16", lambda: False)
    monkeypatch.setattr(step, "measure_peak_flops", lambda *a, **k: 1 / 0)  # no timing without the instructions
    assert step.resolve_precision("auto", CPU, logs.append) == "fp32"
    assert logs[-1] == "precision: auto -> fp32 (this CPU has no bf16 instructions)"
    speed = {torch.bfloat16: 1.0, None: 1.5}  # bf16 a little slower than fp32: still the native choice
    monkeypatch.setattr(step, "measure_peak_flops", lambda device, dtype, **k: speed[dtype] * 1e11)
    monkeypatch.setattr(step, "cpu_has_bf16", lambda: True)
    assert step.resolve_precision("auto", CPU, logs.append) == "bf16"
    assert "this CPU has bf16 instructions" in logs[-1]
    speed[None] = 3.0  # under half fp32's speed: bf16 is emulated after all
    assert step.resolve_precision("auto", CPU) == "fp32"
    monkeypatch.setattr(step, "cpu_has_bf16", lambda: None)  # no flags to read: bf16 must be clearly faster
    speed.update({torch.bfloat16: 2.0, None: 1.5})
    assert step.resolve_precision("auto", CPU) == "fp32"
    speed[torch.bfloat16] = 3.0
    assert step.resolve_precision("auto", CPU) == "bf16"


def test_the_same_answer_in_every_process_beside_a_busy_neighbour():
    """Five processes resolve train.precision: auto while another process keeps a core busy."""
    code = "import torch; from train.step import resolve_precision; print(resolve_precision('auto', torch.device('cpu')))"
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        answers = [subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                                  timeout=300, check=True).stdout.strip() for _ in range(5)]
    finally:
        busy.kill()
    assert len(set(answers)) == 1 and answers[0] in ("bf16", "fp32"), answers
