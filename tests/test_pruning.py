"""Magnitude pruning (zoo/pruning.py, train.prune): the masks against a direct reading of their
definition, which modules are pruned, the loop holding the masks through a recovery fine-tune and a
resume, the config's checks, and 2:4 sparse inference on a CUDA GPU."""
import shutil

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import zoo
from zoo.config import ConfigError, load_yaml, parse_overrides
from zoo.pruning import apply_masks, magnitude_mask, prune, sparsity_of, to_semi_structured
from conftest import CUDA

TINY = dict(vocab_size=256, d_model=64, n_layers=2, n_heads=2, n_kv_heads=1, ffn_hidden=128, max_seq_len=64)
RUN = {
    "family": "llm", "model": TINY, "data": {"tokenizer": "bytes", "seq_len": 32},
    "train": {"max_steps": 6, "batch_size": 4, "log_every": 1, "eval_every": 3, "eval_batches": 2,
              "checkpoint_every": 3, "keep_checkpoints": 5, "average_last": 0, "progress": False,
              "samples": False, "plot": False, "export": False},
    "optim": {"lr": 3e-3, "warmup_steps": 1},
}


def tiny(seed=0):
    torch.manual_seed(seed)
    return zoo.build({"family": "llm", "model": TINY})


@pytest.mark.parametrize("sparsity", [0.3, 0.5, 0.9])
def test_unstructured_mask_drops_the_smallest_share(sparsity):
    w = torch.randn(48, 80)
    mask = magnitude_mask(w, "unstructured", sparsity)
    assert (~mask).sum() == round(sparsity * w.numel())
    assert w[mask].abs().min() >= w[~mask].abs().max()  # every kept weight at least as large as every pruned one


@pytest.mark.parametrize("n,m", [(2, 4), (1, 4), (4, 8)])
def test_n_of_m_mask_keeps_the_largest_n_of_each_group(n, m):
    w = torch.randn(6, 4 * m)
    mask = magnitude_mask(w, f"{n}:{m}")
    for row, keep in zip(w.reshape(-1, m), mask.reshape(-1, m)):
        assert keep.sum() == n
        assert row[keep].abs().min() >= row[~keep].abs().max()


def test_prune_zeroes_the_linears_outside_keep_and_leaves_the_rest():
    model = tiny()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    masks = zoo.prune(model, "2:4")
    linears = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert set(masks) == {n for n in linears if n not in ("embed", "lm_head")} and masks
    after = model.state_dict()
    for k in after:
        name = k.rsplit(".", 1)[0]
        if name in masks and k.endswith("weight"):
            w, mask = masks[name]
            assert torch.equal(after[k], before[k] * mask) and sparsity_of({name: masks[name]}) == 0.5
        else:  # the embedding (tied LM head), norms and anything kept: untouched
            assert torch.equal(after[k], before[k]), k
    assert sparsity_of(masks) == 0.5


def test_prune_errors_name_the_pattern_and_the_module():
    with pytest.raises(ValueError, match="N:M"):
        prune(tiny(), "4:2")
    with pytest.raises(ValueError, match="nothing to prune"):
        prune(tiny(), "2:4", keep=["layers", "lm_head"])
    with pytest.raises(ValueError, match=r"multiple of 7: layers\.0\.attn\.\w+ \(\d+, 64\)"):
        prune(tiny(), "2:7")


def test_a_pruned_run_holds_its_masks_and_resumes_bitwise(tmp_path, text_corpus, one_thread):
    from train.config import load_run_config
    from train.loop import train
    from train.metrics import read_rows

    def run(name, *over):
        cfg = load_run_config(None, [f"train.out_dir={tmp_path / name}", f"data.path={text_corpus}", *over], base=RUN)
        train(cfg, log=lambda m: None)
        return load_file(tmp_path / name / "model.safetensors"), read_rows(tmp_path / name)

    cfg = load_run_config(None, [f"train.out_dir={tmp_path / 'x'}", f"data.path={text_corpus}"], base=RUN)
    torch.manual_seed(cfg.train.seed)
    init = zoo.build(cfg.model).state_dict()
    final, rows = run("full", "train.prune=unstructured", "train.prune_sparsity=0.75")
    pruned = 0
    for k, w in final.items():
        if k.endswith("weight") and w.ndim == 2 and not k.startswith(("embed", "lm_head")):
            mask = magnitude_mask(init[k], "unstructured", 0.75)  # the masks taken on the initial weights
            assert torch.equal(w[~mask], torch.zeros_like(w[~mask])), k   # held at zero through 6 AdamW steps
            assert (w[mask] != init[k][mask]).float().mean() > 0.9, k      # while the rest trained
            pruned += 1
    assert pruned == 8
    assert [r["sparsity"] for r in rows if "sparsity" in r] == [0.75, 0.75]
    # a resume from step 3 ends with the same bytes
    part = tmp_path / "part"
    shutil.copytree(tmp_path / "full", part)
    shutil.rmtree(part / "checkpoints" / "step_00000006")
    (part / "model.safetensors").unlink()
    resumed, _ = run("part", "train.prune=unstructured", "train.prune_sparsity=0.75")
    assert all(torch.equal(final[k], resumed[k]) for k in final)


def test_prune_keys_are_checked_in_one_line(tmp_path):
    from train.config import load_run_config
    from train.distributed import unsupported
    for over, key in ((["train.prune=4:2"], "train.prune"), (["train.prune=half"], "train.prune"),
                      (["train.prune_sparsity=1"], "train.prune_sparsity"),
                      (["train.prune=2:4", "adapter.method=lora"], "train.prune")):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as e:
            load_run_config(None, over, base=RUN)
        assert "\n" not in str(e.value)
    cfg = load_run_config(None, ["train.prune=2:4", "train.parallel=fsdp"], base=RUN)
    assert unsupported(cfg) is None  # FSDP2 shards each mask like its weight (tests/test_distributed.py)


def test_an_unquoted_n_of_m_is_a_string_in_files_and_overrides(tmp_path):
    """YAML 1.1 reads 2:4 as the base-60 number 124; configs read it as YAML 1.2 does, a string."""
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  prune: 2:4\n  lr: 1:30\n  n: 12\n")
    assert load_yaml(f)["train"] == {"prune": "2:4", "lr": "1:30", "n": 12}
    assert parse_overrides(["train.prune=2:4", "a.b=0x10"]) == {"train": {"prune": "2:4"}, "a": {"b": 16}}


def test_apply_masks_undoes_an_update():
    model = tiny()
    masks = prune(model, "unstructured", 0.5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    apply_masks(masks)
    assert sparsity_of(masks) == 0.5


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0),
                    reason="needs a CUDA GPU of compute capability 8.0+ (2:4 sparse kernels)")
def test_semi_structured_linears_match_the_dense_pruned_model_on_cuda():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256)).to("cuda", torch.half).eval()
    prune(model, "2:4", keep=[])
    x = torch.randn(128, 256, device=CUDA, dtype=torch.half)
    with torch.no_grad():
        dense = model(x).float()
        sparse = to_semi_structured(model, keep=[])(x).float()
    assert type(model[0].weight).__name__.startswith("SparseSemiStructured")
    # fp16 products summed in another order: within fp16's rounding of these sums
    assert (sparse - dense).abs().max() <= 2e-2


def test_semi_structured_refuses_a_cpu_model():
    model = nn.Sequential(nn.Linear(8, 8))
    prune(model, "2:4", keep=[])
    with pytest.raises(ValueError, match="CUDA GPU"):
        to_semi_structured(model, keep=[])
