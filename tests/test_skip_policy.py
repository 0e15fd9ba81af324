"""The skip policy (tests/skip_policy.py): a run whose only failure is a skip off the allow-list
(a reference library that does not import) exits 1 and names that test; allowed skips pass."""
import os
import subprocess
import sys
from pathlib import Path

from skip_policy import disallowed


def test_a_skip_off_the_allow_list_fails_the_run(tmp_path):
    (tmp_path / "test_probe.py").write_text(
        "import pytest\n"
        "def test_parity():\n    pytest.importorskip('zoo_reference_library_that_is_not_installed')\n"
        "def test_gpu():\n    pytest.skip('needs CUDA')\n"
        "def test_passes():\n    assert True\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent)}
    # with pytest-xdist's workers, as the README's test command runs the suite
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "skip_policy", "-p", "no:cacheprovider",
                        str(tmp_path / "test_probe.py")], cwd=tmp_path, env=env, capture_output=True, text=True)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert "test_probe.py::test_parity: could not import" in out and "test_gpu:" not in out


def test_the_allow_list():
    skips = [("a", "/x/shared/weights/taef2.pth absent (the shared weights folder is not beside the checkout)"),
             ("b", "needs CUDA"), ("c", "needs Linux with glibc"), ("d", "could not import 'timm': No module")]
    assert disallowed(skips) == [skips[3]]
