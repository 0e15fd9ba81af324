"""model.depth (one dial for the LLM's shape) and muP (model.mup_base_width): the shapes and parameter counts the
docs state, the conflicts, muP's multipliers, parameter groups and init, the coordinate check and the LR transfer
sweep's result."""
import json
import math
import re

import pytest
import torch

from conftest import CPU, ROOT
from train.benches.mup import best_lr, coord_check, growth, main as mup_bench
from train.config import OptimConfig, load_run_config
from train.docs import _count
from train.optim import build_optimizer, hidden_matrices, set_lr
from zoo.config import ConfigError, LLMConfig, from_dict, to_dict
from zoo.llm import LLM


def depth_reference(depth: int) -> tuple[int, int, int]:
    """(d_model, heads, parameters) of model.depth at the defaults, written out from nanochat's rule: d_model =
    64 depth rounded up to 128s, 128-wide heads; tied embeddings, q/k/v/o and a SwiGLU of 8/3 d_model in 64s, two
    norms per block and a final one."""
    c = LLMConfig()
    d = math.ceil(64 * depth / 128) * 128
    ffn = 64 * math.ceil(int(8 * d / 3) / 64)
    return d, d // 128, c.vocab_size * d + depth * (4 * d * d + 3 * d * ffn + 2 * d) + d


def test_the_depth_table_in_the_docs_states_the_built_models():
    text = (ROOT / "docs" / "llm.md").read_text()
    region = re.search(r"<!-- code:llm_depths -->\n(.*?)<!-- /code -->", text, re.S).group(1)
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in region.splitlines()
            if re.match(r"\| \d", line)]
    assert len(rows) >= 5
    for depth, shape, heads, ffn, params, non_embedding in rows:
        depth = int(depth)
        d, h, n = depth_reference(depth)
        with torch.device("meta"):
            model = LLM(LLMConfig(depth=depth))
        assert model.num_params() == n, depth
        assert (shape, heads, params) == (f"{depth} x {d}", str(h), _count(n)), depth
        assert (ffn, non_embedding) == (str(model.config.resolved_ffn_hidden), _count(n - LLMConfig().vocab_size * d))


def test_depth_against_explicit_shape_keys():
    # left null they take the dial's values; given equal they pass (a config written back reads again)
    cfg = from_dict(LLMConfig, {"depth": 12}, "x.yaml", "model.")
    assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.resolved_head_dim) == (12, 768, 6, 128)
    assert from_dict(LLMConfig, to_dict(cfg), "x.yaml", "model.") == cfg
    assert LLMConfig(depth=3, head_dim=32).d_model == 192 and LLMConfig(depth=3, head_dim=32).n_heads == 6
    assert (LLMConfig().d_model, LLMConfig().n_layers, LLMConfig().n_heads) == (512, 8, 8)  # no dial: as before
    with pytest.raises(ConfigError) as e:
        from_dict(LLMConfig, {"depth": 12, "d_model": 512}, "x.yaml", "model.")
    assert str(e.value) == ("x.yaml: model.d_model=512 conflicts with model.depth=12, which sets d_model=768 "
                            "(set one, the other null)")
    with pytest.raises(ConfigError, match=r"^command line: model.n_layers=4 conflicts with model.depth=2"):
        load_run_config(None, ["model.depth=2"], base={"model": {"n_layers": 4}})
    run = load_run_config(None, ["model.depth=2", "model.n_kv_heads=1", "model.vocab_size=256"])
    assert (run.model.d_model, run.model.n_heads, run.model.resolved_n_kv_heads) == (128, 1, 1)


def small(**kw) -> LLMConfig:
    return LLMConfig(**{**dict(vocab_size=64, d_model=128, n_layers=2, n_heads=2, max_seq_len=16), **kw})


def lr_scales(opt, key="lr_scale") -> dict:
    return {id(p): g.get(key, 1.0) for g in opt.param_groups for p in g["params"]}


def test_mup_lr_groups_hidden_matrices_only():
    torch.manual_seed(0)
    model = LLM(small(mup_base_width=32, tie_embeddings=False))
    hidden = hidden_matrices(model)
    assert len(hidden) == 2 * 4  # qkv, o, gate_up, down per block
    scales = lr_scales(build_optimizer(model, OptimConfig(), CPU, log=lambda m: None))
    assert {n: scales[id(p)] for n, p in model.named_parameters()} == {
        n: 32 / 128 if id(p) in hidden else 1.0 for n, p in model.named_parameters()}
    decay = lr_scales(build_optimizer(model, OptimConfig(weight_decay=0.1), CPU, log=lambda m: None), "weight_decay")
    assert {decay[i] for i in hidden} == {0.1 * 128 / 32}  # LR x decay as at the base width
    muon_opt = build_optimizer(model, OptimConfig(name="muon", lr=1e-3, weight_decay=0.1), CPU, log=lambda m: None)
    muon, muon_decay = lr_scales(muon_opt), lr_scales(muon_opt, "weight_decay")
    assert {muon[i] for i in hidden} == {0.02 / 1e-3}  # Muon's own LR on the hidden matrices, its scaling by shape
    assert {muon_decay[i] for i in hidden} == {0.1}  # and the run's weight decay
    off = build_optimizer(LLM(small()), OptimConfig(), CPU, log=lambda m: None)
    assert not any("lr_scale" in g for g in off.param_groups)


def test_mup_adamw_groups_equal_microsofts_mup():
    """Every parameter's LR and weight decay under muP equal what Microsoft's mup package (set_base_shapes against
    the base-width model, MuAdamW) gives the same parameters, from the same decay / no-decay groups. mup scales each
    matrix by its own fan-in's ratio, Zoo by d_model's: the same where the MLP's width scales with d_model exactly
    (8/3 d_model a multiple of ffn_multiple_of at both widths, as here)."""
    mup = pytest.importorskip("mup", reason="Microsoft's mup package (pip install mup) is the reference")
    torch.manual_seed(0)
    model, base = LLM(small(d_model=384, n_heads=4, mup_base_width=96)), LLM(small(d_model=96, n_heads=4))
    # do_assert=False: mup wants its MuReadout for the head; Zoo folds that multiplier into the final norm (the
    # forward test below checks it)
    mup.set_base_shapes(model, base, rescale_params=False, do_assert=False)
    opt = build_optimizer(model, OptimConfig(lr=3e-3, weight_decay=0.1), CPU, log=lambda m: None)
    set_lr(opt, 3e-3)
    names = {id(p): n for n, p in model.named_parameters()}

    def settings(optimizer):
        return {(names[id(p)], k): g[k] for g in optimizer.param_groups for p in g["params"]
                for k in ("lr", "weight_decay")}
    ours = settings(opt)
    groups = [{"params": [p for n, p in model.named_parameters() if ours[n, "weight_decay"]]},
              {"params": [p for n, p in model.named_parameters() if not ours[n, "weight_decay"]], "weight_decay": 0.0}]
    assert ours == pytest.approx(settings(mup.MuAdamW(groups, lr=3e-3, weight_decay=0.1)), rel=1e-12)
    assert ours["layers.0.mlp.down.weight", "lr"] == pytest.approx(3e-3 / 4)  # width 384 against 96: muP applied


def test_mup_forward_is_the_standard_model_with_its_multipliers():
    """muP's forward equals the standard model's with the logits times base / width (logit_scale) and the
    attention scaled 1 / head_dim (query_pre_attn_scalar = head_dim^2), on the same weights (tolerance 1e-6)."""
    torch.manual_seed(0)
    mup = LLM(small(mup_base_width=32)).eval()
    twin = LLM(small(logit_scale=0.25, query_pre_attn_scalar=64.0 ** 2)).eval()
    twin.load_state_dict(mup.state_dict())
    ids = torch.randint(64, (2, 12))
    torch.testing.assert_close(mup(ids), twin(ids), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(mup(ids, ids)[1], twin(ids, ids)[1], rtol=1e-6, atol=1e-6)  # the chunked loss too
    with pytest.raises(ValueError, match=r"model.mup_base_width=32: no Hugging Face class holds muP's multipliers"):
        from zoo.weights.hf_llm import record_for
        record_for(mup.config)


def test_mup_init_scales_the_hidden_matrices():
    torch.manual_seed(0)
    model = LLM(small(d_model=512, n_heads=4, mup_base_width=64, tie_embeddings=False, vocab_size=512))
    hidden = 0.02 * math.sqrt(64 / 512)
    for name, want in (("embed.weight", 0.02), ("lm_head.weight", 0.02), ("layers.0.attn.qkv.weight", hidden),
                       ("layers.1.mlp.gate_up.weight", hidden), ("layers.0.attn.proj.weight", hidden / 2)):
        std = dict(model.named_parameters())[name].std().item()
        assert abs(std / want - 1) < 0.05, (name, std, want)  # 65k+ draws: a few 0.1% of sampling noise


def test_mup_off_and_at_its_base_width_trains_as_the_standard_parametrization():
    """At d_model = mup_base_width every muP multiplier is one: with the attention's scale put back the model and
    three AdamW steps equal the standard model's bit for bit; off, no group has an LR scale and the attention none."""
    def trained(cfg, standard_attention=False):
        torch.manual_seed(0)
        model = LLM(cfg)
        if standard_attention:
            for b in model.blocks():
                b.attn.q_scale = None
        opt = build_optimizer(model, OptimConfig(lr=1e-2), CPU, log=lambda m: None)
        set_lr(opt, 1e-2)
        for step in range(3):
            ids = torch.randint(64, (2, 12), generator=torch.Generator().manual_seed(step))
            model(ids, ids)[1].backward()
            opt.step()
            opt.zero_grad()
        return model, opt
    sp, opt = trained(small())
    at_base, _ = trained(small(mup_base_width=128), standard_attention=True)
    assert all(b.attn.q_scale is None for b in sp.blocks()) and not any("lr_scale" in g for g in opt.param_groups)
    for (name, a), b in zip(sp.state_dict().items(), at_base.state_dict().values()):
        assert torch.equal(a, b), name


def test_mup_refusals_are_one_line():
    with pytest.raises(ConfigError, match=r"model.mup_base_width covers dense attention layers"):
        from_dict(LLMConfig, {"mup_base_width": 64, "moe": {}}, "x.yaml", "model.")
    with pytest.raises(ConfigError, match=r"model.mup_base_width scales the hidden matrices' LR by Adam's rule"):
        load_run_config(None, ["model.mup_base_width=64", "optim.name=sgd"])


def check_coordinates(widths, **kw):
    """Under muP every layer's mean |x| changes by at most 2x from the smallest width to the largest; under the
    standard parametrization some layer's grows by more than that."""
    mup, standard = (growth(coord_check(widths, side, **kw)) for side in (True, False))
    assert all(0.5 <= g <= 2.0 for g in mup.values()), mup
    assert max(standard.values()) > 2.0, standard


def test_coordinate_check_at_small_widths():
    check_coordinates((32, 128), steps=3, batch=4, seq=32)


@pytest.mark.slow
def test_coordinate_check_from_64_to_1024():
    check_coordinates((64, 128, 256, 512, 1024))


def test_lr_transfer_sweep_result_at_toy_size(tmp_path):
    """The sweep's JSON: a table per parametrization (a column per LR, a row per width, the best LR last) whose best
    LR is the seed-mean's argmin, the shift table, the plot; a diverged LR never counts as the best."""
    out = tmp_path / "transfer.json"
    mup_bench(["--widths", "32,64", "--log2-lrs=-8,-6", "--seeds", "0", "--steps", "2", "--batch", "2", "--seq", "16",
               "--json", str(out)], "mup-transfer")
    r = json.loads(out.read_text())
    assert list(r["tables"]) == ["standard", "muP", "shift"] and out.with_suffix(".png").stat().st_size > 0
    for side in ("standard", "muP"):
        table, losses, best = r["tables"][side], r["data"]["loss"][side], r["data"]["best_log2_lr"][side]
        assert table["columns"] == ["width", "lr 2^-8", "lr 2^-6", "best lr"]
        assert [row[0] for row in table["rows"]] == ["32", "64"] and set(losses) == {"32", "64"}
        for row in table["rows"]:
            mean = {int(k): v[0] for k, v in losses[row[0]].items()}
            assert best[row[0]] == min(mean, key=mean.get) and row[-1].startswith(f"2^{best[row[0]]}")
    shift = {row[0]: row[-2:] for row in r["tables"]["shift"]["rows"]}
    assert shift == {side: [f"{b['64'] - b['32']:+d}", str(abs(b["64"] - b["32"]))]
                     for side, b in r["data"]["best_log2_lr"].items()}
    assert best_lr({-8: [float("nan")], -6: [3.0, 2.0], -4: [2.4, 2.8]}) == -6
