"""Config errors are one line naming the key and the file; good configs load."""
from pathlib import Path

import pytest
import yaml
from hypothesis import example, given, settings, strategies as st

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
    (BASE, ["model.rope_scaling.type=dynamic"], ["model.rope_scaling.type"]),
    (BASE, ["train.device=tpu"], ["train.device"]),
    (BASE, ["train.device=cuda:x"], ["train.device"]),  # a device as data
    (BASE, ["train.seed=99999999999999999999999"], ["train.seed", "64 bits"]),
    (BASE, ["optim.betas=[0.9, 0.95, 0.99]"], ["optim.betas"]),
    (BASE, ["colour=red"], ["colour"]),
    (BASE, ["train.max_step=3"], ["train.max_step", "did you mean 'train.max_steps'?"]),
    (BASE, ["trian.max_steps=3"], ["trian", "did you mean 'train'?"]),
    (BASE, ["train.init_from=README.md"], ["train.init_from=README.md", "is a file", "folder", ".gguf"]),
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


@pytest.mark.parametrize("path", sorted((ROOT / "configs").rglob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads(path, tmp_path):
    import re
    text = path.read_text()
    if "../shared/" in text and not (ROOT.parent / "shared").is_dir():
        pytest.skip(f"{path.name} uses weights from ../shared, which is not beside this checkout")
    over = []
    for key in ("init_from", "teacher"):
        given = (yaml.safe_load(text).get("train") or {}).get(key)
        if given and not Path(given).exists():  # a placeholder for the user's weights: named in a one-line error
            with pytest.raises(ConfigError, match=rf"train.{key}={re.escape(given)}: no such file or folder"):
                load_run_config(str(path), over)
            weights = tmp_path / f"{key}.safetensors"  # an LLM's weights come in a folder (or a .gguf file)
            weights.mkdir() if "family: llm" in text else weights.write_bytes(b"")
            over.append(f"train.{key}={weights}")
    load_run_config(str(path), over)


def test_build_from_yaml_with_overrides():
    m = zoo.build(str(ROOT / "configs/llm/tiny.yaml"), n_layers=1)
    assert len(m.layers) == 1 and m.config.d_model == 256
    with pytest.raises(ConfigError, match="n_heads"):
        zoo.build(str(ROOT / "configs/llm/tiny.yaml"), n_heads=3)


def test_nested_overrides_and_types(tmp_path):
    p = write(tmp_path, BASE)
    cfg = load_run_config(str(p), ["model.rope_scaling.type=llama3", "model.rope_scaling.factor=8",
                                   "optim.betas=[0.9, 0.99]", "train.clip_grad=null", "optim.lr=3e-3"])
    assert cfg.optim.lr == 0.003  # YAML 1.1 reads 3e-3 as a string; float keys accept it
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


# property: the whole run config (every section of every family) gives a valid config or a one-line ConfigError
def _families():
    from zoo.config import FAMILIES
    return list(FAMILIES)


def _section_fields(family):
    """section -> {key: default} of the run config's four dataclasses, plus an unknown key."""
    import dataclasses
    from train.config import OptimConfig, TrainConfig
    from train.config import task_class
    from zoo.config import FAMILIES
    classes = {"model": FAMILIES[family].config, "data": task_class(family).DataConfig, "train": TrainConfig,
               "optim": OptimConfig}
    out = {}
    for sec, cls in classes.items():
        out[sec] = {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
                    for f in dataclasses.fields(cls)}
        out[sec]["bogus"] = None
    return out


def _near(default):
    """Values of the default's type, around it and at the edges (0, negative, huge, tiny)."""
    if isinstance(default, bool):
        return st.booleans()
    if isinstance(default, int):
        return st.one_of(st.integers(-2, 70), st.sampled_from([default, 4096, -2**70, 2**70]))
    if isinstance(default, float):
        return st.one_of(st.floats(-1.0, 2.0), st.sampled_from([default, 0.0, 1e-12, 1e12, 1e308]))
    if isinstance(default, str):
        return st.sampled_from([default, "", "x", "cpu", "cuda:x", "fp8"])
    if isinstance(default, (list, tuple)):
        return st.lists(st.one_of(st.integers(-1, 70), st.floats(-1, 2)), max_size=4)
    return st.one_of(st.none(), st.integers(-2, 70), st.floats(-1.0, 2.0), st.text(max_size=6),
                     st.dictionaries(st.sampled_from(["type", "factor", "weights", "latent_channels", "x"]),
                                     _scalars, max_size=2))


@st.composite
def _run_configs(draw):
    """Mostly plausible configs (a few keys of each section set near their defaults or to odd values),
    now and then a wrong family, a section that is not a mapping or an unknown top-level key."""
    fams = _families()
    family = draw(st.sampled_from(fams)) if draw(st.integers(0, 9)) != 7 else draw(st.sampled_from(["nope", 3, None]))
    data = {"family": family}
    for sec, fields in _section_fields(family if family in fams else "llm").items():
        roll = draw(st.integers(0, 19))
        if roll == 7:
            data[sec] = draw(_scalars)
        elif roll < 16:
            keys = draw(st.lists(st.sampled_from(sorted(fields)), max_size=3, unique=True))
            data[sec] = {k: draw(_near(fields[k]) if draw(st.integers(0, 5)) != 3 else _scalars) for k in keys}
    if draw(st.integers(0, 19)) == 7:
        data[draw(st.text(max_size=5))] = draw(_scalars)
    return data


@settings(max_examples=300, deadline=None)
@given(_run_configs())
@example({"family": "vit", "model": {"mlp_ratio": 2.4e16}})  # an MLP too wide to allocate: once an overflow in torch
@example({"family": "vit", "model": {"pos_embed_jitter": 1}})  # RoPE's augmentation on a ViT without RoPE
def test_run_config_parsing_property(data):
    """Any run config: a valid RunConfig whose model builds (on the meta device, no memory) and whose
    schedule gives finite LRs, or a one-line ConfigError naming the source (or, from the build, the key: one that
    needs what pretrained weights may give, as RoPE's augmentation needs rope_theta)."""
    import math
    import torch
    from train.config import run_config_from_dict
    from train.optim import lr_multiplier
    try:
        cfg = run_config_from_dict(data, "prop.yaml")
    except ConfigError as e:
        msg = str(e)
        assert "\n" not in msg and msg.startswith("prop.yaml: "), msg
        return
    again = run_config_from_dict(cfg.to_dict(), "again.yaml")  # a valid config round-trips
    assert again.to_dict() == cfg.to_dict()
    try:
        with torch.device("meta"):
            zoo.build(cfg.model)
    except ConfigError as e:
        assert "\n" not in str(e) and str(e).startswith("model."), e
        return
    t = cfg.train
    if t.device != "auto":
        torch.device(t.device)
    torch.Generator().manual_seed(t.seed)
    for step in {0, t.max_steps // 2, t.max_steps - 1}:
        assert math.isfinite(lr_multiplier(step, t.max_steps, cfg.optim))


# field bounds: declared on the dataclasses (zoo.config.bounded), checked in one place
@pytest.mark.parametrize("over, msg", [
    ("model.n_layers=0", "model.n_layers must be > 0 or null, got 0"),
    ("model.n_kv_heads=-2", "model.n_kv_heads must be > 0 or null, got -2"),
    ("model.mod_capacity=1.5", "model.mod_capacity must be in [0, 1], got 1.5"),
    ("train.moe_router_jitter=1", "train.moe_router_jitter must be in [0, 1), got 1.0"),
    ("train.ema_decay=1", "train.ema_decay must be in (0, 1) or null, got 1.0"),
    ("train.activation_checkpointing_every=0", "train.activation_checkpointing_every must be >= 1, got 0"),
    ("optim.adafactor_beta2_decay=0", "optim.adafactor_beta2_decay must be < 0, got 0.0"),
    ("data.seq_len=1", "data.seq_len must be >= 2, got 1"),
    ("adapter.dropout=-0.1", "adapter.dropout must be in [0, 1), got -0.1"),
])
def test_declared_bounds_are_one_line_errors_naming_file_and_key(over, msg):
    with pytest.raises(ConfigError) as e:
        load_run_config(None, [over], base={"family": "llm", "model": {"moe": {}}})
    assert str(e.value) == f"command line: {msg}"


@pytest.mark.parametrize("key, new", [(f"moe.{k}", f"train.moe_{k}") for k in (
    "aux_loss_coef", "z_loss_coef", "bias_update_rate", "capacity_factor", "router_jitter", "dispatch")] + [
    (k, f"train.{k}") for k in ("mod_aux_loss_coef", "mod_threshold_rate", "init_std")])
def test_a_training_setting_under_model_is_a_one_line_error_naming_its_new_place(tmp_path, key, new):
    """The model config holds the architecture only: an old key, in a file or an override, names its train: key."""
    with pytest.raises(ConfigError) as e:
        load_run_config(None, [f"model.{key}=0.1"], base={"family": "llm"})
    assert str(e.value) == f"command line: model.{key} moved to {new}"
    cfg = tmp_path / "old.yaml"
    outer, _, inner = key.rpartition(".")
    cfg.write_text(yaml.safe_dump({"model": {outer: {inner: 0.1}} if outer else {inner: 0.1}}))
    with pytest.raises(ConfigError) as e:
        load_run_config(str(cfg))
    assert str(e.value) == f"{cfg}: model.{key} moved to {new}"


def test_bounds_hold_for_a_config_built_in_code_and_validate_keeps_only_cross_field_rules():
    import dataclasses
    import inspect
    from zoo.config import bounded, check_bounds, describe_bounds
    with pytest.raises(ConfigError, match=r"^<config>: n_layers must be > 0 or null, got 0$"):
        zoo.build(LLMConfig(n_layers=0))
    assert describe_bounds({"gt": 0, "le": 1}) == "in (0, 1]" and describe_bounds({"ge": 2}) == ">= 2"

    @dataclasses.dataclass
    class C:
        a: int = bounded(1, ge=1)
        b: object = bounded("auto", gt=0)  # a non-number (a Union's 'auto') is not range-checked
    check_bounds(C())
    with pytest.raises(ConfigError, match=r"^x.yaml: s.a must be >= 1, got 0$"):
        check_bounds(C(a=0), "x.yaml", "s.")
    # a declared bound is not checked again by hand in validate()
    src = inspect.getsource(LLMConfig.validate)
    assert "self.n_layers <= 0" not in src and "self.mod_every <= 0" not in src and "must be > 0" not in src


def test_keys_of_the_files_format_do_not_apply_to_another_format():
    """tiny.yaml sets data.max_chars (the text format's); data.format=messages on the command line
    leaves it out instead of calling it an unknown key. A key of the new format's own still applies."""
    cfg = load_run_config(str(ROOT / "configs/llm/tiny.yaml"), ["data.format=messages", "data.seq_len=64"])
    assert cfg.data.format == "messages" and cfg.data.seq_len == 64
    with pytest.raises(ConfigError, match="data.max_chars"):  # typed by the user: still an error
        load_run_config(str(ROOT / "configs/llm/tiny.yaml"), ["data.format=messages", "data.max_chars=5"])


def test_help_lists_the_sections_and_keys_and_leaves_a_closed_pipe_quietly():
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "train/run.py", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0 and "  train: out_dir, max_steps" in out.stdout and "  optim: name, lr" in out.stdout
    head = subprocess.run(f"{sys.executable} train/run.py --help | head -1", shell=True, cwd=ROOT,
                          capture_output=True, text=True)
    assert head.stdout.startswith("Train or fine-tune") and head.stderr == "", head.stderr
