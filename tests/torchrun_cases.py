"""Several train/run.py runs one after another in one torchrun launch, so that tests pay torchrun's
and the interpreter's start-up once. The runs share one process group (made by the first): a group made
again through torchrun's store can meet the keys the previous one left there and hang.

    python -m torch.distributed.run --nproc-per-node 2 tests/torchrun_cases.py CASES.json

CASES.json: a list of steps, each a train/run.py argument list, or {"copy": [src, dst]} (a checkpoint
directory copied by rank 0 before the next run, whose collectives the other ranks wait in). The
launch stops at the first run that fails, with its exit code.
"""
import json
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from train.distributed import Parallel, exit_process  # noqa: E402
from train.run import main  # noqa: E402

if __name__ == "__main__":
    Parallel.close = Parallel.barrier  # keep the group for the next run; the ranks leave each run together
    code = 0
    for case in json.loads(Path(sys.argv[1]).read_text()):
        if isinstance(case, dict):
            if os.environ.get("RANK", "0") == "0":
                shutil.copytree(*case["copy"])
            continue
        code = main(case)
        if code:
            break
    exit_process(code)
