"""train.float8: which linears are converted, the run's float8 forward, exact resume, the key checks.
On a CPU torchao emulates the float8 matmul (the same casts and scales), so the code path is the GPU's."""
import shutil
from types import SimpleNamespace

import pytest
import torch
from torch import nn

pytest.importorskip("torchao")
from safetensors.torch import load_file  # noqa: E402
from zoo.config import ConfigError  # noqa: E402

from train.checkpoint import list_checkpoints  # noqa: E402
from train.config import load_run_config  # noqa: E402
from train.features.float8 import float8_targets  # noqa: E402
from train.loop import train  # noqa: E402
from conftest import TEST_DEVICE

pytestmark = pytest.mark.usefixtures("one_thread")

RUN = {
    "family": "llm",
    "model": dict(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128, max_seq_len=32),
    "data": {"tokenizer": "bytes", "seq_len": 32},
    "train": {"max_steps": 6, "batch_size": 4, "log_every": 1, "eval_every": 0, "eval_batches": 2, "precision": "bf16",
              "checkpoint_every": 3, "keep_checkpoints": 5, "progress": False, "samples": False, "plot": False,
              "export": False, "float8": True},
    "optim": {"lr": 3e-3, "warmup_steps": 1},
}


def keys(**kw):
    return SimpleNamespace(**{"float8_recipe": "tensorwise", "float8_keep": ["lm_head"], "float8_skip_small": False,
                              **kw})


def test_the_filter_keeps_the_named_the_odd_and_with_skip_small_the_small_linears():
    with torch.device("meta"):
        model = nn.ModuleDict({"big": nn.Linear(8192, 4096), "wide": nn.Linear(1024, 8192), "small": nn.Linear(64, 64),
                               "odd": nn.Linear(40, 64), "lm_head": nn.Linear(4096, 4096),
                               "block": nn.ModuleDict({"lm_head": nn.Linear(64, 64)})})
    assert float8_targets(model, keys()) == ["big", "wide", "small"]
    assert float8_targets(model, keys(float8_keep=[])) == ["big", "wide", "small", "lm_head", "block.lm_head"]
    assert float8_targets(model, keys(float8_keep=["block.lm_head"])) == ["big", "wide", "small", "lm_head"]
    # torchao's size rule per recipe: tensorwise gains once K > 4096 or N > 1024; rowwise needs both larger
    assert float8_targets(model, keys(float8_skip_small=True)) == ["big", "wide"]
    assert float8_targets(model, keys(float8_skip_small=True, float8_recipe="rowwise")) == ["big"]


def test_a_float8_run_converts_the_filtered_linears_and_resumes_bitwise(tmp_path, text_corpus):
    from torchao.float8.float8_linear import Float8Linear
    import train.builder as builder
    logs, built = [], {}
    real_build = builder.build_model

    def spy(*a, **kw):
        built["model"] = real_build(*a, **kw)
        return built["model"]
    cfg = load_run_config(None, [f"train.out_dir={tmp_path / 'full'}", f"data.path={text_corpus}"], base=RUN)
    builder.build_model = spy
    try:
        final = train(cfg, log=logs.append)
    finally:
        builder.build_model = real_build
    converted = sorted(n for n, m in built["model"].named_modules() if isinstance(m, Float8Linear))
    assert converted == sorted(n for n, m in built["model"].named_modules()
                               if isinstance(m, nn.Linear) and n != "lm_head") and len(converted) == 2 * 4
    assert any(m.startswith("float8: tensorwise scaling on 8 of 9 linears") for m in logs), logs
    assert final["val_loss"] < 5.0  # trained: below the 5.55 nats of a uniform guess over 256 bytes
    # killed after step 3's checkpoint: the resumed run ends with the same bits
    part = tmp_path / "part"
    shutil.copytree(tmp_path / "full", part)
    for c in list_checkpoints(part):
        if int(c.name.split("_")[1]) > 3:
            shutil.rmtree(c)
    (part / "model.safetensors").unlink()
    logs = []
    train(load_run_config(None, [f"train.out_dir={part}", f"data.path={text_corpus}"], base=RUN), log=logs.append)
    assert any(m.startswith("resumed from") and "(step 3)" in m for m in logs), logs
    a, b = load_file(tmp_path / "full" / "model.safetensors"), load_file(part / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_float8_keys_are_checked_in_one_line():
    for over, key in ((["train.float8_recipe=blockwise"], "train.float8_recipe"),
                      (["train.qat=int8"], "train.float8")):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as e:
            load_run_config(None, over, base=RUN)
        assert "\n" not in str(e.value)
    cfg = load_run_config(None, ["train.float8_keep=[layers, lm_head]"], base=RUN)
    from train.features.float8 import prepare
    import zoo
    with pytest.raises(ValueError, match="none of the 9 linears"):
        prepare(zoo.build(cfg.model), cfg.train, TEST_DEVICE, False, print)
