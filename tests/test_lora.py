"""LoRA / DoRA adapters (zoo/blocks/lora.py, zoo/adapters.py) against PEFT, in both directions.

Reference: a random-init transformers Llama / Qwen2 / Qwen2-MoE (weights redrawn at std 0.1 as in
test_hf_llm.py), wrapped by PEFT with LoRA or DoRA on several target modules, B and the DoRA
magnitudes redrawn non-zero; the adapter saved with PEFT's save_pretrained and loaded into Zoo
(zoo.from_pretrained on the adapter folder) must give PEFT's logits (fp32, max abs diff <= 1e-4);
Zoo's export (save_adapter) loaded by PEFT onto the transformers model must give Zoo's logits.
Merged weights give the unmerged logits (<= 1e-5).
"""
import json

import pytest
import torch

import zoo
from zoo.adapters import AdapterConfig, apply_adapters, merge_adapters, merged_model, unmerge_adapters
from zoo.blocks.lora import LoRALinear
from zoo.weights.peft_lora import save_adapter

from test_hf_llm import hf_model, randomize, tokens

import transformers
import peft

TOL = 1e-4
MERGE_TOL = 1e-5
TARGETS = ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]


def randomize_adapters(model, seed=3):
    """Non-zero B (and A, magnitudes) in every adapter, so each mapping shows in the logits."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name or "magnitude" in name:
                noise = torch.randn(p.shape, generator=g)
                p.copy_(p * (1 + 0.2 * noise) if "magnitude" in name else 0.1 * noise)


def peft_model(base, dora=False, targets=TARGETS, rslora=False, seed=3):
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, use_dora=dora, use_rslora=rslora)
    pm = peft.get_peft_model(base, cfg)
    randomize_adapters(pm, seed)
    return pm.eval()


def max_diff(a, b):
    return (a - b).abs().max().item()


@pytest.mark.parametrize("kind,dora,rslora", [("llama", False, False), ("llama", True, False),
                                              ("qwen2", True, True)])
def test_peft_adapter_loads_into_zoo(tmp_path, kind, dora, rslora):
    base = hf_model(kind, num_key_value_heads=2)
    base.save_pretrained(tmp_path / "base")
    pm = peft_model(base, dora, rslora=rslora)
    pm.save_pretrained(tmp_path / "adapter")
    x = tokens()
    with torch.no_grad():
        ref = pm(x).logits
    z = zoo.from_pretrained(tmp_path / "adapter", base=tmp_path / "base", dtype=torch.float32)
    n_adapted = sum(len(m.adapter.adapted) for m in z.modules() if isinstance(m, LoRALinear))
    assert n_adapted == 2 * len(TARGETS)
    with torch.no_grad():
        out = z(x)
        plain = zoo.from_pretrained(tmp_path / "base", dtype=torch.float32)(x)
    assert max_diff(ref, plain) > 100 * TOL  # the adapters change the logits
    assert max_diff(ref, out) <= TOL, max_diff(ref, out)
    # merged == unmerged, and back
    merge_adapters(z)
    with torch.no_grad():
        merged = z(x)
    assert max_diff(out, merged) <= MERGE_TOL
    unmerge_adapters(z)
    with torch.no_grad():
        assert max_diff(out, z(x)) <= MERGE_TOL


@pytest.mark.parametrize("dora", [False, True])
def test_zoo_adapter_loads_into_peft(tmp_path, dora):
    base = hf_model("llama", num_key_value_heads=2)
    base.save_pretrained(tmp_path / "base")
    z = zoo.from_pretrained(tmp_path / "base", dtype=torch.float32)
    apply_adapters(z, AdapterConfig(method="dora" if dora else "lora", r=4, alpha=8, targets=TARGETS))
    randomize_adapters(z)
    save_adapter(z, tmp_path / "adapter", base=tmp_path / "base")
    cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert cfg["use_dora"] is dora and sorted(cfg["target_modules"]) == sorted(TARGETS)
    x = tokens()
    pm = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    with torch.no_grad():
        ref, out = pm(x).logits, z(x)
    with pm.disable_adapter(), torch.no_grad():
        assert max_diff(ref, pm(x).logits) > 100 * TOL  # the adapters change the logits
    assert max_diff(ref, out) <= TOL, max_diff(ref, out)
    # the merged dense model, saved in the base's own format, is PEFT's merge_and_unload
    dense = merged_model(z)
    zoo.save_pretrained(dense, tmp_path / "merged")
    hf_merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    with torch.no_grad():
        assert max_diff(hf_merged(x).logits, ref) <= TOL


def test_moe_attention_and_shared_expert_adapters(tmp_path):
    """Qwen2-MoE: adapters on attention and the shared expert map onto PEFT's."""
    cfg = transformers.Qwen2MoeConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                                      num_experts_per_tok=2, moe_intermediate_size=32,
                                      shared_expert_intermediate_size=48, max_position_embeddings=128)
    cfg.bos_token_id = cfg.eos_token_id = cfg.pad_token_id = None
    base = randomize(transformers.Qwen2MoeForCausalLM(cfg)).eval()
    base.save_pretrained(tmp_path / "base")
    targets = ["q_proj", "k_proj", "gate_proj", "down_proj"]
    pm = peft_model(base, dora=False, targets=targets)
    names = [n for n, m in pm.named_modules() if hasattr(m, "lora_A") and "shared_expert" in n]
    assert names, "PEFT put no adapter on the shared expert"
    pm.save_pretrained(tmp_path / "adapter")
    x = tokens()
    with torch.no_grad():
        ref = pm(x).logits
    z = zoo.from_pretrained(tmp_path / "adapter", base=tmp_path / "base", dtype=torch.float32)
    with torch.no_grad():
        assert max_diff(ref, z(x)) <= TOL


def test_lora_block_merge_and_grads():
    """The block alone: a fused layer with two of three parts adapted; merge/unmerge round trip;
    only the adapters get gradients; a fresh adapter changes nothing."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 24, bias=True)
    ref_w = lin.weight.detach().clone()
    m = LoRALinear(lin, [("a", 8), ("b", 8), ("c", 8)], ["a", "c"], r=2, alpha=4, dora=True)
    x = torch.randn(3, 16)
    assert torch.allclose(m(x), lin(x), atol=1e-6)  # B = 0: unchanged
    for p in m.adapter.lora_B.values():
        torch.nn.init.normal_(p)
    y = m(x)
    assert (y[:, 8:16] - lin(x)[:, 8:16]).abs().max() == 0  # part b not adapted
    assert (y[:, :8] - lin(x)[:, :8]).abs().max() > 1e-3
    m.merge()
    assert max_diff(m(x), y) <= MERGE_TOL
    m.unmerge()
    assert max_diff(m.weight, ref_w) <= 1e-6
    m.weight.requires_grad_(False)
    m(x).sum().backward()
    assert m.weight.grad is None and all(p.grad is not None for p in m.adapter.lora_A.values())


def test_prefix_tuning_with_kv_cache_matches_full_forward():
    """Prefixes are seen by every query, in one forward and step by step on the KV cache alike,
    and only they train."""
    torch.manual_seed(0)
    model = zoo.build("configs/llm/tiny.yaml", n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, vocab_size=256)
    x = torch.randint(0, 256, (2, 10))
    with torch.no_grad():
        plain = model(x)
    apply_adapters(model, AdapterConfig(method="prefix", prefix_len=3))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "prefix" in name:
                p.normal_(0, 1.0)
        full = model(x)
        caches = model.new_caches(2, 10)
        steps = [model(x[:, i:i + 1], caches=caches, start_pos=i) for i in range(10)]
    assert max_diff(full, plain) > 1e-2
    assert max_diff(torch.cat(steps, 1), full) <= TOL
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".prefix." in n for n in trainable)
