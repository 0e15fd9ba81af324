"""Quantized inference and quantization-aware training (zoo/quantization.py, zoo/weights/quantized.py,
train/features/quantize.py) on a tiny LLM: what is quantized, the numerics against torchao's own
dequantization, the round trip through a saved folder, the device check, and the loop's keys."""
import pytest
import torch
from torch import nn

import torchao  # noqa: F401

import zoo  # noqa: E402
from zoo.quantization import SCHEMES, convert_qat, prepare_qat, targets  # noqa: E402
from zoo.weights.zoo_folder import cast_weights  # noqa: E402
from conftest import TEST_DEVICE

TINY = dict(vocab_size=256, d_model=64, n_layers=2, n_heads=2, n_kv_heads=1, ffn_hidden=128, max_seq_len=64)


def tiny(seed=0, dtype=torch.bfloat16):
    torch.manual_seed(seed)
    return cast_weights(zoo.build({"family": "llm", "model": TINY}), dtype).eval()


def dequantized(w):
    """The weight (out, in) a quantized linear multiplies by, read through its own kernel: the
    products with the identity (the CPU int4 layout has no dequantize of its own)."""
    eye = torch.eye(w.shape[1], dtype=torch.bfloat16)
    with torch.no_grad():
        return torch.nn.functional.linear(eye, w).float().T


def int4_reference(w, group):
    """Asymmetric int4 of groups along the input dim with the zero point in the float domain
    (tinygemm's numerics), written out in the weight's dtype: scale = (max - min) / 15, level
    q = round((w - min) / scale) in 0..15, weight (q - 8) * scale + (min + 8 * scale)."""
    g = w.reshape(w.shape[0], -1, group)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    scale = (hi - lo) / 15
    q = ((g - lo) / scale).float().round().clamp(0, 15)
    return ((q - 8) * scale.float() + (lo + scale * 8).float()).to(w.dtype).float().reshape(w.shape)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_quantize_swaps_the_linears_but_keeps_embedding_and_head(scheme):
    model = tiny()
    ref = {n: m.weight.detach().float().clone() for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    zoo.quantize(model, scheme)
    mods = dict(model.named_modules())
    names = [n for n in ref if n != "lm_head"]
    assert set(targets(zoo.build({"family": "llm", "model": TINY}))) == set(names)
    for n in names:
        w = mods[n].weight
        assert type(w) is not nn.Parameter and type(w) is not torch.Tensor, n
        # the quantized weight is close to the original: int8 per row within half a step, int4 coarser
        err = (dequantized(w) - ref[n]).abs().max().item()
        step = ref[n].abs().amax(-1).max().item() / (127 if scheme == "int8wo" else 7)
        assert 0 < err <= step, (n, err, step)
    assert type(model.lm_head.weight) is nn.Parameter and model.lm_head.weight is model.embed.weight
    assert model.quantization["scheme"] == scheme


@pytest.mark.parametrize("scheme", SCHEMES)
def test_quantized_forward_matches_dequantized_weights(scheme):
    """The kernels compute what the dequantized weights give (int4 on a CPU: torch's tinygemm CPU
    kernel in bf16; 8da4w also rounds the activations to int8, hence its looser bound)."""
    model = tiny()
    x = torch.randint(0, 256, (2, 16))
    zoo.quantize(model, scheme)
    with torch.no_grad():
        got = model(x).float()
        plain = tiny()
        for n, m in plain.named_modules():
            if isinstance(m, nn.Linear) and n != "lm_head":
                m.weight = nn.Parameter(dequantized(dict(model.named_modules())[n].weight).to(torch.bfloat16))
        want = plain(x).float()
    tol = 0.15 if scheme == "8da4w" else 0.06  # bf16 logits of magnitude ~1: rounding of the activations
    assert (got - want).abs().max().item() < tol


def test_int4wo_weights_are_the_tinygemm_grid():
    """int4wo on this device packs the grid an independent computation of tinygemm's asymmetric
    int4 gives (all but a few weights exactly; those at most one level apart, where rounding differs at a midpoint)."""
    model = tiny()
    w = model.layers[0].mlp.gate_up.weight.detach().clone()
    zoo.quantize(model, "int4wo", group_size=32)
    got, want = dequantized(model.layers[0].mlp.gate_up.weight), int4_reference(w, 32)
    step = ((w.float().reshape(w.shape[0], -1, 32).amax(-1) - w.float().reshape(w.shape[0], -1, 32).amin(-1)) / 15).max()
    diff = (got - want).abs()
    assert diff.max() <= 1.01 * step and (diff == 0).float().mean() > 0.99


@pytest.mark.parametrize("scheme", SCHEMES)
def test_saved_quantized_folder_loads_back_exactly(tmp_path, scheme):
    model = zoo.quantize(tiny(), scheme)
    x = torch.randint(0, 256, (1, 12))
    zoo.save_pretrained(model, tmp_path / "q", tokenizer="bytes")
    back = zoo.from_pretrained(tmp_path / "q")
    assert back.quantization == model.quantization
    with torch.no_grad():
        assert torch.equal(back(x), model(x))
    assert torch.equal(back.generate(x, 6), model.generate(x, 6))


def test_file_of_another_device_is_a_one_line_error(tmp_path):
    import yaml
    zoo.save_pretrained(zoo.quantize(tiny(), "int4wo"), tmp_path / "q")
    cfg = yaml.safe_load((tmp_path / "q" / "config.yaml").read_text())
    assert cfg["quantization"]["layout"] == ["Int4OpaqueTensor"]  # the CPU packing
    cfg["quantization"].update(layout=["Int4TilePackedTo4dTensor"], device="cuda")  # a device as data; as CUDA writes it
    (tmp_path / "q" / "config.yaml").write_text(yaml.safe_dump(cfg))
    with pytest.raises(ValueError) as e:
        zoo.from_pretrained(tmp_path / "q")
    msg = str(e.value)
    assert "\n" not in msg and "model.pt" in msg and "int4wo" in msg and "cpu" in msg


def test_bad_arguments_are_one_line_errors():
    with pytest.raises(ValueError, match="unknown quantization scheme 'int3'"):
        zoo.quantize(tiny(), "int3")
    with pytest.raises(ValueError, match="does not divide the input size of layers.0.attn.qkv"):
        zoo.quantize(tiny(), "8da4w", group_size=48)
    with pytest.raises(ValueError, match="packs groups of 32, 64, 128"):
        zoo.quantize(tiny(), "int4wo", group_size=16)
    with pytest.raises(ValueError, match="already quantized"):
        zoo.quantize(zoo.quantize(tiny(), "int8wo"), "int8wo")


@pytest.mark.parametrize("scheme", SCHEMES)
def test_qat_fake_quantizes_as_the_scheme_quantizes(scheme):
    """After prepare_qat the forward sees the weights the conversion produces: fake-quantized logits
    equal the converted model's up to the kernels' bf16 rounding, and gradients reach the weights."""
    model = tiny(dtype=torch.float32).train()
    prepare_qat(model, scheme)
    x = torch.randint(0, 256, (2, 16))
    _, loss = model(x, x)
    loss.backward()
    assert model.layers[0].mlp.down.weight.grad is not None and model.layers[0].mlp.down.weight.grad.abs().sum() > 0
    with torch.no_grad():
        fake = model.eval()(x).float()
        plain = tiny(dtype=torch.float32)(x).float()
        conv = convert_qat(cast_weights(model, torch.bfloat16))(x).float()
    assert type(model.layers[0].mlp.down.weight) is not nn.Parameter
    # the fake quantization moves the logits as much as the real one does, and the same way
    assert (fake - conv).abs().max() < 0.5 * (fake - plain).abs().max() + 0.05


def test_int4_fake_quantization_rounds_as_the_conversion():
    """QAT trains the model that is deployed: after prepare_qat(int4wo) every fake-quantized weight
    is the converted bf16 model's weight (read through its kernel) up to the kernel's own rounding of
    (level - 8) * scale + zero, at most 1/8 of a quantization step: the same level everywhere.
    (torchao's generic int4 fake quantizer, its zero point stored as an int32, puts many weights on
    another level, up to several steps away: `python train/bench.py qat` measures it.)"""
    from torchao.quantization.qat import FakeQuantizedLinear
    model = tiny(dtype=torch.float32)
    prepare_qat(model, "int4wo", group_size=32)
    fake = {n: m.weight_fake_quantizer(m.weight).detach() for n, m in model.named_modules()
            if isinstance(m, FakeQuantizedLinear)}
    assert fake and all(w.dtype == torch.float32 for w in fake.values())
    mods = dict(convert_qat(cast_weights(model, torch.bfloat16)).named_modules())
    for n, w in fake.items():
        ref = dequantized(mods[n].weight)
        groups = ref.reshape(ref.shape[0], -1, 32)
        step = ((groups.amax(-1) - groups.amin(-1)) / 15).repeat_interleave(32, 1)
        assert ((w - ref).abs() / step).max() <= 0.125, n


RUN = {
    "family": "llm", "model": TINY, "data": {"tokenizer": "bytes", "seq_len": 32},
    "train": {"max_steps": 3, "batch_size": 4, "log_every": 1, "eval_every": 0, "eval_batches": 2,
              "checkpoint_every": 0, "progress": False, "samples": False, "plot": False, "export": False},
    "optim": {"lr": 3e-3, "warmup_steps": 1},
}


def test_qat_run_writes_and_evaluates_the_converted_model(tmp_path, text_corpus, one_thread):
    from safetensors.torch import load_file

    from train.config import load_run_config
    from train.loop import train
    from train.tasks.lm import LMTask
    cfg = load_run_config(None, [f"train.out_dir={tmp_path / 'r'}", f"data.path={text_corpus}", "train.qat=int4"],
                          base=RUN)
    final = train(cfg, log=lambda m: None)
    assert final["quant_val_loss"] > 0 and final["val_loss"] > 0
    q = zoo.from_pretrained(tmp_path / "r" / "quantized")
    assert q.quantization["scheme"] == "int4wo"
    # the folder's model is the final float weights (model.safetensors, same names as without QAT) quantized
    plain = cast_weights(zoo.build({"family": "llm", "model": TINY}), torch.bfloat16)
    plain.load_state_dict(load_file(tmp_path / "r" / "model.safetensors"), strict=False)
    task = LMTask(cfg, TEST_DEVICE, lambda m: None)
    task.setup()
    assert task.evaluate(q)["val_loss"] == pytest.approx(final["quant_val_loss"], rel=1e-6)
    # the reference of the quantization's cost: the same bf16 weights, unquantized
    assert task.evaluate(plain)["val_loss"] == pytest.approx(final["quant_ref_val_loss"], rel=1e-6)
    assert task.evaluate(zoo.quantize(plain, "int4wo"))["val_loss"] == pytest.approx(final["quant_val_loss"], rel=1e-3)


def test_run_keys_are_checked_in_one_line(tmp_path):
    from zoo.config import ConfigError

    from train.config import load_run_config
    for over, key in ((["train.qat=int4", "train.quantize=int8wo"], "train.quantize"),
                      (["train.quantize=int5"], "train.quantize"),
                      (["train.qat=int8", "adapter.method=lora"], "train.qat")):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as e:
            load_run_config(None, over, base=RUN)
        assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="quantizes LLMs"):
        load_run_config(None, ["train.quantize=int8wo"], base={"family": "convnet"})


def test_docs_tables_are_rendered_from_the_benchmarks_json():
    """docs/deploy.md's tables equal what train/docs.py renders from the deploy benches' committed results
    (docs/results/*.json; tables in docs/ are never typed in); tests/test_docs.py checks the rewriting."""
    import json

    from train.docs import RESULTS, ROOT, render_result
    page = (ROOT / "docs" / "deploy.md").read_text()
    names = ["quantized", "qat", "prune", "distill", "convnet-ptq", "gguf"] + sorted(
        p.stem for p in RESULTS.glob("distill-quality-*.json") if p.stem != "distill-quality-llm-more")
    for name in names:
        for key in json.loads((RESULTS / f"{name}.json").read_text())["tables"]:
            region = f"<!-- table:{name}/{key} -->\n"
            if region not in page:  # the whole result in one region
                region = f"<!-- table:{name} -->\n"
                assert region + render_result(name) in page, name
            else:
                assert region + render_result(name, key) in page, (name, key)


# ------------------------------------------------------------------ ConvNets: PT2E static int8
def tiny_convnet(seed=0):
    torch.manual_seed(seed)
    return zoo.build({"family": "convnet", "model": dict(arch="resnet18", layers=[1, 1, 1, 1], width=4, stem="small",
                                                         in_chans=1, num_classes=10)}).eval()


def test_convnet_int8_quantizes_every_conv_and_stays_close_to_fp32():
    """PT2E with the x86 inductor quantizer: every convolution and the classifier read int8 weights
    (one scale per output channel) and int8 activations (one scale per tensor, from calibration);
    the reference graph's logits stay within 2% of the fp32 logits' range (8-bit steps on inputs
    and weights of 6 layers; an unquantized or uncalibrated graph would fail the node counts or
    the closeness), on a batch size other than calibration's (the batch dim is dynamic)."""
    model = tiny_convnet()
    g = torch.Generator().manual_seed(1)
    calib = [torch.randn(8, 1, 16, 16, generator=g) for _ in range(2)]
    q = zoo.quantize(model, "int8", calibration=calib)
    assert q.quantization["calibration_batches"] == 2 and not hasattr(model, "quantization")
    convs = sum(isinstance(m, nn.Conv2d) for m in model.modules()) + 1  # + the classifier's linear
    targets_ = [str(n.target) for n in q.graph.nodes if n.op == "call_function"]
    assert sum("dequantize_per_channel" in t for t in targets_) == convs
    assert sum("quantize_per_tensor" in t and "dequantize" not in t for t in targets_) >= convs
    x = torch.randn(5, 1, 16, 16, generator=g)
    with torch.no_grad():
        ref, out = model(x), q(x)
    assert out.shape == ref.shape
    assert (out - ref).abs().max() <= 0.02 * (ref.max() - ref.min())
    assert not torch.equal(out, ref)


def test_convnet_quantization_errors_are_one_line():
    model = tiny_convnet()
    for call, words in [(lambda: zoo.quantize(model, "int4wo"), "a ConvNet takes 'int8'"),
                        (lambda: zoo.quantize(model, "int8"), "calibration= (image batches) is required"),
                        (lambda: zoo.quantize(model, "int8", calibration=[torch.zeros(1, 1, 16, 16)]), "B >= 2"),
                        (lambda: zoo.quantize(tiny(), "int8", calibration=[torch.zeros(2, 1, 16, 16)]), "has no nn.Conv2d"),
                        (lambda: zoo.quantize(model, "int2", calibration=[]), "unknown quantization scheme")]:
        with pytest.raises(ValueError) as e:
            call()
        assert words in str(e.value) and "\n" not in str(e.value), str(e.value)
