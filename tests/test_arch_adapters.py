"""The newer architectures (test_hf_arch.py's cases) through what fine-tuning uses: LoRA, DoRA and QLoRA on
their default targets (Phi-3's fused qkv_proj / gate_up_proj, the latent attention's q_a / q_b / kv_a / kv_b, the
recurrent layers' projections of LFM2, Qwen3.5 and Qwen3-Next; Gemma 4's layers without k / v of their own),
one training step, the PEFT export, activation checkpointing and torch.compile.

Reference: transformers' random-init model of each case (test_hf_arch.hf_model), loaded into Zoo; after
Zoo's step (B and the DoRA magnitudes then redrawn, so every row shows) the adapter Zoo exports, loaded by
PEFT onto the transformers model, gives Zoo's logits (fp32, <= 1e-4). QLoRA's base is the NF4 weights
dequantised, exported before the step. Checkpointing (full or selective, by turns) gives the gradients of
none (<= 1e-6); the first repeated unit of DeepSeek-V3, Gemma 2, Gemma 3, LFM2 (a short convolution) and Qwen3.5 (a
Gated DeltaNet) under torch.compile (one graph, AOT autograd) gives the eager logits (<= 1e-4).
"""
import dataclasses

import pytest
import torch
from test_hf_arch import CASES, hf_model
from test_hf_llm import tokens
from test_lora import randomize_adapters

import zoo
from train.model import apply_runtime
from train.config import TrainConfig
from zoo.adapters import AdapterConfig, apply_adapters, known_targets, merged_model
from zoo.blocks.lora import dense_weight
from zoo.weights.peft_lora import save_adapter

import peft
import transformers

TOL = 1e-4
pytestmark = pytest.mark.usefixtures("one_thread")
METHODS = {"qwen3": "qlora", "smollm3": "dora", "olmo2": "lora", "phi3-window": "dora", "gemma2": "lora",
           "gemma3": "dora", "gpt-oss": "qlora", "deepseek-v3": "dora", "deepseek-v3-no-q-rank-yarn": "lora",
           "lfm2": "lora", "qwen3_5": "dora", "qwen3_next": "lora", "gemma4": "lora"}
# latent attention; soft-caps; local/global, sandwich norms; a short convolution; Gated DeltaNet
COMPILED = ("deepseek-v3", "gemma2", "gemma3", "lfm2", "qwen3_5")
RUNTIME = TrainConfig(chunked_loss=False)  # the final soft-cap needs the full logits
LLAMA = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
MLP = {"gate_proj", "up_proj", "down_proj"}
LATENT = {"kv_a_proj_with_mqa", "kv_b_proj", "o_proj"} | MLP
DEFAULTS = {"phi3-window": {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}, "gpt-oss": LLAMA - MLP,
            "deepseek-v3": LATENT | {"q_a_proj", "q_b_proj"}, "deepseek-v3-no-q-rank-yarn": LATENT | {"q_proj"},
            "lfm2": {"q_proj", "k_proj", "v_proj", "out_proj", "w1", "w3", "w2", "in_proj"},  # its own names
            "qwen3_5": LLAMA | {"in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"},  # recurrent layers too
            "qwen3_next": LLAMA | {"out_proj"}}  # not the projections its file fuses otherwise (in_proj_qkvz, _ba)
# PEFT reads gate_proj / up_proj / down_proj of a DeepSeek-V3 or Qwen3-Next as its routed experts' fused parameters
# (its conversion from transformers 4's layout), so the dense layers' and shared experts' adapters would not load there
ATTENTION_ONLY = ("deepseek-v3", "deepseek-v3-no-q-rank-yarn", "qwen3_next")


def loss(model, x):
    return model(x, targets=x.roll(-1, 1))[1]


def grads(model, x):
    model.zero_grad()
    loss(model, x).backward()
    return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("case", METHODS)
def test_adapters_step_peft_checkpointing_and_compile(tmp_path, case):
    kind, kw = CASES[case]
    hf = hf_model(kind, **kw)
    hf.save_pretrained(tmp_path / "in")
    method = METHODS[case]
    z = zoo.from_pretrained(tmp_path / "in")
    targets = DEFAULTS.get(case, LLAMA)
    assert set(known_targets(z)) == targets  # the default: all the model has
    if case in ATTENTION_ONLY:
        targets -= MLP
    cfg = AdapterConfig(method="lora" if method == "qlora" else method, r=4, alpha=8,
                        quantize_base="nf4" if method == "qlora" else "none",
                        **{"targets": sorted(targets)} if case in ATTENTION_ONLY else {})
    z = apply_runtime(apply_adapters(z, cfg), RUNTIME)
    base = tmp_path / "in"
    if method == "qlora":  # the base PEFT sees: the NF4 weights dequantised (B = 0: nothing merged)
        assert any(type(p).__name__ == "NF4Tensor" for p in z.parameters())
        base = zoo.save_pretrained(merged_model(apply_adapters(zoo.from_pretrained(base), cfg)), tmp_path / "nf4")
        hf = transformers.AutoModelForCausalLM.from_pretrained(base).eval()

    x = tokens(shape=(2, 24))  # windows of 6 and 8: shorter
    frozen = {n: p.detach().clone() for n, p in z.named_parameters()  # (NF4 weights: frozen by their type)
              if not p.requires_grad and dense_weight(p) is p}
    opt = torch.optim.AdamW([p for p in z.parameters() if p.requires_grad], lr=1e-2)
    before = loss(z, x)
    before.backward()
    opt.step()
    assert loss(z, x) < before  # one step on the adapters alone
    assert all(torch.equal(p, frozen[n]) for n, p in z.named_parameters() if n in frozen )

    randomize_adapters(z)
    out = save_adapter(z, tmp_path / "adapter", base=base)
    pm = peft.PeftModel.from_pretrained(hf, out).eval()
    assert set(pm.peft_config["default"].target_modules) == targets
    z.eval()
    with torch.no_grad():
        ref, got_logits = pm(x).logits, z(x)
        with pm.disable_adapter():
            assert (pm(x).logits - ref).abs().max() > 100 * TOL  # the adapters show
    assert (ref - got_logits).abs().max() <= TOL, (ref - got_logits).abs().max()

    z.train()
    want = grads(z, x)
    policy = ("full", "selective")[list(METHODS).index(case) % 2]
    got = grads(apply_runtime(z, dataclasses.replace(RUNTIME, activation_checkpointing=policy)), x)
    assert got.keys() == want.keys() and all(g is not None for g in got.values())
    assert max((got[k] - want[k]).abs().max().item() for k in want) <= 1e-6, policy

    if case in COMPILED:  # a repeated unit compiled in place, as FSDP2 compiles them; AOT autograd without
        apply_runtime(z, RUNTIME).eval()  # Inductor's code generation, which takes a minute on 2 cores
        z.repeated_units()[0].compile(backend="aot_eager", fullgraph=True)  # (the next: MoE, a CPU graph break)
        with torch.no_grad():
            assert (z(x) - got_logits).abs().max() <= TOL
