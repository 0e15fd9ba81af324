"""The small configs (the tiny LLM, the digits ResNet, the digits diffusion model, the digits VLM) run under
`torchrun --nproc-per-node 2 ... train.parallel=ddp|fsdp train.max_steps=20`, as shipped (a file of
its own, so that two test workers share the config runs)."""
import sys

import pytest

from test_configs import ROOT, RUN_PY, SMALL, STEPS, run


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
@pytest.mark.parametrize("config", SMALL)
def test_small_config_runs_under_torchrun(config, strategy, tmp_path):
    run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(RUN_PY),
         str(ROOT / "configs" / config), f"train.parallel={strategy}", STEPS], tmp_path / "out")
