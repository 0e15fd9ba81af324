"""Config errors are one line naming the key and the file; good configs load."""
import pytest
from hypothesis import given, settings, strategies as st

import zoo
from train.config import load_run_config
from train.run import main as run_main
from zoo.config import ConfigError, LLMConfig, from_dict, parse_overrides

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


def write(tmp_path, text, name="cfg.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return p


BASE = "family: llm\nmodel:\n  d_model: 64\n  n_heads: 4\n  n_layers: 1\n  vocab_size: 256\n  max_seq_len: 64\n" \
       "data:\n  tokenizer: bytes\n  seq_len: 32\n"

CASES = [
    # (yaml appended / replaced, overrides, fragments the message must contain)
    (BASE + "  bogus: 1\n", [], ["data.bogus"]),
    (BASE, ["model.n_heads=5"], ["model.n_heads", "model.d_model"]),
    (BASE, ["model.n_kv_heads=3"], ["model.n_kv_heads", "model.n_heads"]),
    (BASE, ["model.d_model=sixty"], ["model.d_model", "int"]),
    (BASE, ["train.max_steps=0"], ["train.max_steps"]),
    (BASE, ["train.precision=fp8"], ["train.precision"]),
    (BASE, ["optim.lr=-1"], ["optim.lr"]),
    (BASE, ["optim.betas=[0.9]"], ["optim.betas"]),
    (BASE, ["data.seq_len=128"], ["data.seq_len", "model.max_seq_len"]),
    (BASE, ["model.rope_scaling.type=yarn"], ["model.rope_scaling.type"]),
    (BASE, ["train.device=tpu"], ["train.device"]),
    (BASE, ["colour=red"], ["colour"]),
    (BASE.replace("family: llm", "family: gan"), [], ["family", "gan"]),
    ("model: [1, 2\n", [], ["invalid YAML"]),
    ("- a\n- b\n", [], ["mapping"]),
]


@pytest.mark.parametrize("text,overrides,fragments", CASES)
def test_config_error_is_one_line_naming_key_and_file(tmp_path, capsys, text, overrides, fragments):
    p = write(tmp_path, text)
    code = run_main([str(p), *overrides, f"train.out_dir={tmp_path / 'out'}"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1, err
    assert str(p) in err
    for frag in fragments:
        assert frag in err, (frag, err)
    assert not (tmp_path / "out" / "checkpoints").exists()


def test_missing_config_file(capsys, tmp_path):
    assert run_main([str(tmp_path / "nope.yaml")]) == 2
    err = capsys.readouterr().err.strip()
    assert "nope.yaml" in err and len(err.splitlines()) == 1


def test_override_syntax_error():
    with pytest.raises(ConfigError, match="key=value"):
        parse_overrides(["train.max_steps"])


def test_every_shipped_config_loads():
    for p in sorted((ROOT / "configs").rglob("*.yaml")):
        load_run_config(str(p), [])


def test_build_from_yaml_with_overrides():
    m = zoo.build(str(ROOT / "configs/llm/tiny.yaml"), n_layers=1)
    assert len(m.layers) == 1 and m.config.d_model == 256
    with pytest.raises(ConfigError, match="n_heads"):
        zoo.build(str(ROOT / "configs/llm/tiny.yaml"), n_heads=3)


def test_nested_overrides_and_types(tmp_path):
    p = write(tmp_path, BASE)
    cfg = load_run_config(str(p), ["model.rope_scaling.type=llama3", "model.rope_scaling.factor=8",
                                   "optim.betas=[0.9, 0.99]", "train.clip_grad=null"])
    assert cfg.model.rope_scaling.type == "llama3" and cfg.model.rope_scaling.factor == 8.0
    assert cfg.optim.betas == (0.9, 0.99) and cfg.train.clip_grad is None


# property: any mapping of LLMConfig keys to arbitrary scalars yields a valid config or a one-line ConfigError
_scalars = st.one_of(st.none(), st.booleans(), st.integers(-5, 5000), st.floats(allow_nan=True, allow_infinity=True),
                     st.text(max_size=8), st.lists(st.integers(0, 3), max_size=3))
_keys = st.sampled_from([f.name for f in __import__("dataclasses").fields(LLMConfig)] + ["unknown_key"])


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(_keys, _scalars, max_size=6))
def test_config_parsing_property(data):
    try:
        cfg = from_dict(LLMConfig, data, "prop.yaml", "model.")
    except ConfigError as e:
        msg = str(e)
        assert "\n" not in msg and msg.startswith("prop.yaml: ")
        return
    cfg.validate()
    assert cfg.d_model % cfg.n_heads == 0 or cfg.head_dim
