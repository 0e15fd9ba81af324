"""Tensor and pipeline parallelism's pieces in one process (train/model_parallel.py): the fused projections' rank-major
rows, the pipeline's stages, the refusals. The torchrun runs are tests/test_distributed.py's."""
import pytest
import torch

import zoo
from train.config import load_run_config
from train.distributed import unsupported
from train.model_parallel import Fused, Stage


def test_fused_rows_are_held_rank_major_and_saved_in_the_model_order():
    """qkv rows of 4 q heads, 2 k and 2 v heads (head_dim 3) over 2 ranks: chunk r holds q heads 2r, 2r+1, k head r and
    v head r; saved() puts model and optimizer states back, and leaves other names and shapes alone."""
    H, KV, D, n = 4, 2, 3, 2
    head = torch.cat([torch.full((D, 5), float(h)) for h in range(H + 2 * KV)])  # row value: the head's index
    fused = Fused(n)
    p = torch.nn.Parameter(head.clone())
    fused.hold("attn.qkv.weight", p, [H * D, KV * D, KV * D])
    for r, chunk in enumerate(p.detach().chunk(n)):
        heads = chunk[::D, 0].tolist()
        assert heads == [2 * r, 2 * r + 1, H + r, H + KV + r]
    state = {"attn.qkv.weight": p.detach(), "other": torch.arange(3.0)}
    back = fused.saved(state)
    assert torch.equal(back["attn.qkv.weight"], head) and torch.equal(back["other"], state["other"])
    osd = {"state": {"attn.qkv.weight": {"exp_avg": p.detach(), "step": torch.tensor(2.0)}}, "param_groups": []}
    assert torch.equal(fused.saved(osd)["state"]["attn.qkv.weight"]["exp_avg"], head)
    assert torch.equal(fused.saved(fused.saved(osd), back=False)["state"]["attn.qkv.weight"]["exp_avg"], p.detach())


def test_pipeline_stages_chained_are_the_model_trunk():
    """The stages of 2 (embedding and the first blocks; the last blocks, the final norm and the LM head) run one after
    the other give the model's own final hidden states; between them they hold the model's parameters."""
    cfg = zoo.config.LLMConfig(vocab_size=64, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=16)
    model = zoo.build(cfg).eval()
    ids = torch.randint(0, 64, (2, 16))
    first, last = Stage(model, 0, 2), Stage(model, 1, 2)
    torch.testing.assert_close(last(first(ids)), model.features(ids), rtol=0, atol=0)
    held = [{id(p) for p in s.parameters()} for s in (first, last)]
    assert held[0] | held[1] == {id(p) for p in model.parameters()}
    assert held[0] & held[1] == {id(model.embed.weight)}  # tied to the LM head: trained on both ends


@pytest.mark.parametrize("over, key", [
    (["train.parallel=tp", "model.moe.n_experts=4"], "model.moe"),
    (["train.parallel=tp", "model.qk_norm=true"], "model.qk_norm"),
    (["train.parallel=fsdp+tp", "adapter.method=lora"], "adapter.method"),
    (["train.parallel=tp", "model.d_model=384", "model.n_heads=6", "model.n_kv_heads=3"], "model.n_kv_heads=3"),
    (["train.parallel=tp", "model.n_kv_heads=1"], "model.n_kv_heads=1"),
    (["train.parallel=pp", "model.n_layers=3"], "model.n_layers=3"),
    (["train.parallel=pp", "train.batch_size=3"], "train.pp_microbatches=2"),
    (["train.parallel=fsdp+tp", "train.tp_size=3"], "train.tp_size=3"),
    (["train.parallel=pp", "train.ema_decay=0.9"], "train.ema_decay"),
    (["train.parallel=pp", "optim.name=muon"], "optim.name=muon"),
    (["train.parallel=tp", "family=convnet", "model.arch=resnet18"], "family=convnet"),
])
def test_what_tensor_and_pipeline_parallelism_do_not_cover_is_refused_in_one_line(over, key):
    why = unsupported(load_run_config(None, over), 2)
    assert why is not None and key in why and "\n" not in why, why


def test_the_dense_llm_is_covered():
    assert unsupported(load_run_config("configs/llm/tiny.yaml", ["train.parallel=tp"]), 2) is None
    assert unsupported(load_run_config("configs/llm/tiny.yaml", ["train.parallel=pp"]), 4) is None
