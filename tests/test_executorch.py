"""ExecuTorch export (zoo/weights/executorch_pte.py): a Zoo LLM written as a .pte runs in ExecuTorch's own runtime
with Zoo's logits (max abs difference 1e-3, fp32), at several sequence lengths of one program; without the package,
a one-line error naming it."""
import sys

import pytest
import torch

import zoo
from test_numerics import tiny_llm
from test_tracking import _Absent


@pytest.mark.slow
def test_pte_runs_in_the_executorch_runtime_with_zoos_logits(tmp_path):
    pytest.importorskip("executorch.runtime", reason="the executorch package is not installed (pip install -e '.[executorch]')")
    from executorch.runtime import Runtime
    model = tiny_llm(bias=True)  # grouped kv heads, tied head, qkv bias
    model.train()
    path = zoo.save_pretrained(model, tmp_path / "m.pte")
    assert model.training and {m.backend for m in model.modules() if hasattr(m, "backend")} == {"auto"}  # restored
    forward = Runtime.get().load_program(path).load_method("forward")
    model.eval()
    g = torch.Generator().manual_seed(0)
    for T in (2, 7, model.config.max_seq_len):
        ids = torch.randint(0, model.config.vocab_size, (1, T), generator=g)
        (got,) = forward.execute([ids])
        with torch.no_grad():
            want = model(ids)
        assert got.shape == want.shape and (got - want).abs().max() <= 1e-3, (T, (got - want).abs().max())


def test_without_executorch_the_export_is_one_line_naming_the_package(tmp_path, monkeypatch):
    for name in [n for n in sys.modules if n.partition(".")[0] == "executorch"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [_Absent("executorch")] + sys.meta_path)
    with pytest.raises(ImportError) as e:
        zoo.save_pretrained(tiny_llm(), tmp_path / "m.pte")
    assert len(str(e.value).splitlines()) == 1 and "needs the executorch package: pip install -e '.[executorch]'" in str(e.value)
    assert not (tmp_path / "m.pte").exists()
