"""LoRA / DoRA adapters (zoo/blocks/lora.py, zoo/adapters.py) against PEFT, in both directions.

Reference: a random-init transformers Llama / Qwen2 / Qwen2-MoE / Gemma 4 MoE (weights redrawn at std 0.1 as in
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
from zoo.adapters import (AdapterConfig, adapters_disabled, adapters_per_row, apply_adapters, merge_adapters, merged_model, set_adapter,
                          unmerge_adapters)
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


def a_and_b(model):
    """Every adapter's A entries (one flat vector) and B tensors, of a Zoo or a PEFT model."""
    named = [(n, p) for n, p in model.named_parameters() if "lora_" in n]
    return torch.cat([p.detach().flatten() for n, p in named if "lora_A" in n]), [p for n, p in named if "lora_B" in n]


def test_gaussian_init_has_peft_s_statistics_and_exports_to_peft(tmp_path):
    """adapter.init=gaussian against PEFT's init_lora_weights="gaussian" on the same base, rank and targets: A's
    mean and standard deviation agree within 5 standard errors of their difference (from the numbers of entries,
    each side N(0, s^2) with s = 1/r: the mean's error s / sqrt(n), the standard deviation's s / sqrt(2n)), B is
    zero, and the adapter (B drawn) written by save_adapter loads in PEFT with Zoo's logits (1e-4)."""
    base = hf_model("llama", num_key_value_heads=2)
    base.save_pretrained(tmp_path / "base")
    z = zoo.from_pretrained(tmp_path / "base", dtype=torch.float32)
    torch.manual_seed(0)
    apply_adapters(z, AdapterConfig(method="lora", r=4, alpha=8, targets=TARGETS, init="gaussian"))
    torch.manual_seed(1)
    pm = peft.get_peft_model(hf_model("llama", num_key_value_heads=2),
                             peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights="gaussian"))
    (za, zb), (pa, pb) = a_and_b(z), a_and_b(pm)
    assert all(torch.equal(b, torch.zeros_like(b)) for b in zb + pb) and zb and pb
    s = 1 / 4
    se_mean = s * (1 / len(za) + 1 / len(pa)) ** 0.5
    se_std = s * (1 / (2 * len(za)) + 1 / (2 * len(pa))) ** 0.5
    assert abs(za.mean() - pa.mean()) < 5 * se_mean, (za.mean(), pa.mean(), se_mean)
    assert abs(za.std() - pa.std()) < 5 * se_std, (za.std(), pa.std(), se_std)
    kaiming, _ = a_and_b(apply_adapters(zoo.from_pretrained(tmp_path / "base"), AdapterConfig(method="lora", r=4,
                                                                                              targets=TARGETS)))
    assert abs(kaiming.std() - za.std()) > 20 * se_std  # the default init is another distribution
    with torch.no_grad():
        for b in zb:
            b.normal_(0, 0.1)
    save_adapter(z, tmp_path / "adapter", base=tmp_path / "base")
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["init_lora_weights"] == "gaussian"
    x = tokens()
    with torch.no_grad():
        ref, out = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()(x).logits, z(x)
    assert max_diff(ref, out) <= TOL, max_diff(ref, out)
    assert zoo.from_pretrained(tmp_path / "adapter", base=tmp_path / "base").adapter_config.init == "gaussian"


@pytest.mark.parametrize("kind", ["qwen2-moe", "gemma4-moe"])
def test_moe_attention_and_shared_expert_adapters(tmp_path, kind):
    """Qwen2-MoE and Gemma 4's experts (its MLP beside them Zoo's shared expert): adapters on attention and the
    shared expert map onto PEFT's."""
    if kind == "gemma4-moe":
        from test_hf_arch import CASES, hf_model as arch_model
        kind, kw = CASES["gemma4-moe-kv-same-softcap"]
        base, shared = arch_model(kind, **kw), ".mlp."
    else:
        cfg = transformers.Qwen2MoeConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                                          num_experts_per_tok=2, moe_intermediate_size=32,
                                          shared_expert_intermediate_size=48, max_position_embeddings=128)
        cfg.bos_token_id = cfg.eos_token_id = cfg.pad_token_id = None
        base, shared = randomize(transformers.Qwen2MoeForCausalLM(cfg)).eval(), "shared_expert"
    base.save_pretrained(tmp_path / "base")
    targets = ["q_proj", "k_proj", "gate_proj", "down_proj"]
    pm = peft_model(base, dora=False, targets=targets)
    names = [n for n, m in pm.named_modules() if hasattr(m, "lora_A") and shared in n]
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
    # a state written before named adapters (the tensors beside the weight) loads as the default adapter
    old = {k.replace("adapters.default.", ""): v for k, v in m.state_dict().items()}
    assert set(old) != set(m.state_dict())
    fresh = LoRALinear(torch.nn.Linear(16, 24, bias=True), [("a", 8), ("b", 8), ("c", 8)], ["a", "c"], r=2, alpha=4,
                       dora=True)
    fresh.load_state_dict(old)
    assert max_diff(fresh(x), m(x)) == 0


@pytest.mark.parametrize("method", ["prefix", "prompt", "bottleneck"])
def test_module_adapters_on_the_kv_cache_padded_rows_and_disk(tmp_path, method, one_thread):
    """Prefix, prompt and bottleneck adapters: one forward and step by step on the KV cache agree, a left-padded row
    generates the tokens it generates alone, only they train, adapters_disabled is the base, and the saved adapter
    (PEFT's format for prompt tuning, else Zoo's) loads back onto its base with the same logits."""
    torch.manual_seed(0)
    model = zoo.build("configs/llm/tiny.yaml", n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, vocab_size=256)
    base = zoo.save_pretrained(model, tmp_path / "base")
    x = torch.randint(0, 256, (2, 10))
    with torch.no_grad():
        plain = model(x)
    apply_adapters(model, AdapterConfig(method=method, prefix_len=3, r=4))
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.normal_(0, 1.0)
        full = model(x)
        caches = model.new_caches(2, 10)
        steps = [model(x[:, i:i + 1], caches=caches, start_pos=i) for i in range(10)]
        with adapters_disabled(model):
            assert torch.equal(model(x), plain)
    assert max_diff(full, plain) > 1e-2
    assert max_diff(torch.cat(steps, 1), full) <= TOL
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    where = {"prefix": ".prefix.", "prompt": "prompt.", "bottleneck": "_adapter."}[method]
    assert trainable and all(where in n for n in trainable)
    padded = torch.cat([torch.zeros(1, 4, dtype=torch.long), x[:1, :6]], 1)
    mask = torch.cat([torch.zeros(1, 4), torch.ones(1, 6)], 1).long()
    rows, real = torch.cat([padded, x[1:]]), torch.cat([mask, torch.ones_like(mask)]).bool()
    with torch.no_grad():  # the prompt's forward as generate runs it, and the row alone
        last = model(rows, caches=model.new_caches(2, 10, masked=True), key_mask=real,
                     position_ids=(real.long().cumsum(1) - 1).clamp(min=0))[0, -1]
        assert max_diff(last, model(x[:1, :6])[0, -1]) <= TOL
    both = model.generate(rows, 6, attention_mask=real.long())
    assert torch.equal(both[0, 10:], model.generate(x[:1, :6], 6)[0, 6:]) and torch.equal(both[1:], model.generate(x[1:], 6))
    save_adapter(model, tmp_path / "adapter", base=base)
    with torch.no_grad():
        assert max_diff(zoo.from_pretrained(tmp_path / "adapter")(x), full) <= MERGE_TOL


def test_prompt_tuning_in_and_out_of_peft(tmp_path, one_thread):
    """Prompt tuning both ways: Zoo's export loaded by PEFT, and PEFT's adapter loaded by Zoo, give the same
    logits on the real positions (PEFT's output holds the virtual ones in front): fp32, max abs diff <= 1e-5."""
    k, tol = 5, 1e-5
    base = hf_model("llama", num_key_value_heads=2)
    base.save_pretrained(tmp_path / "base")
    x = tokens(shape=(2, 20))
    z = zoo.from_pretrained(tmp_path / "base", dtype=torch.float32)
    apply_adapters(z, AdapterConfig(method="prompt", prefix_len=k))
    with torch.no_grad():
        z.prompt.weight.normal_(0, 1.0)
        out, plain = z(x), base(x).logits
    save_adapter(z, tmp_path / "zoo_prompt", base=tmp_path / "base")
    pm = peft.PeftModel.from_pretrained(base, tmp_path / "zoo_prompt").eval()
    with torch.no_grad():
        ref = pm(x).logits[:, k:]
    assert max_diff(ref, plain) > 100 * tol  # the virtual tokens change the logits
    assert max_diff(ref, out) <= tol, max_diff(ref, out)

    pm = peft.get_peft_model(hf_model("llama", num_key_value_heads=2),
                             peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=k)).eval()
    with torch.no_grad():
        pm.prompt_encoder["default"].embedding.weight.normal_(0, 1.0, generator=torch.Generator().manual_seed(4))
        ref = pm(x).logits[:, k:]
    pm.save_pretrained(tmp_path / "peft_prompt")
    z = zoo.from_pretrained(tmp_path / "peft_prompt", base=tmp_path / "base", dtype=torch.float32)
    with torch.no_grad():
        assert max_diff(ref, z(x)) <= tol, max_diff(ref, z(x))


def test_named_lora_adapters_switch_and_mix_per_row_as_peft_does(tmp_path, one_thread):
    """Two PEFT LoRA adapters (different targets and ranks) on one Zoo model: set_adapter gives each one's PEFT
    logits, a batch with rows on `a`, `b` and the base gives PEFT's mixed-batch logits (max abs diff <= 1e-4), and
    batched greedy generation with per-row adapters gives each row's tokens generated alone on its adapter."""
    base = hf_model("llama", num_key_value_heads=2)
    base.save_pretrained(tmp_path / "base")
    pm = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"]), "math")
    pm.add_adapter("chat", peft.LoraConfig(r=2, lora_alpha=4, target_modules=["v_proj", "o_proj", "gate_proj"]))
    randomize_adapters(pm)
    pm.eval().save_pretrained(tmp_path / "ad")  # each in ad/<name>/
    z = zoo.from_pretrained(tmp_path / "ad" / "math", base=tmp_path / "base", dtype=torch.float32, adapter_name="math")
    zoo.from_pretrained(tmp_path / "ad" / "chat", base=z, adapter_name="chat")
    x = tokens(shape=(3, 16))
    names = ["chat", "__base__", "math"]
    with torch.no_grad():
        for name in ("math", "chat"):
            pm.set_adapter(name)
            set_adapter(z, name)
            assert max_diff(pm(x).logits, z(x)) <= TOL, name
        ref = pm(x, adapter_names=names).logits
        with adapters_per_row(z, names):
            assert max_diff(ref, z(x)) <= TOL
        assert max_diff(ref[0], pm(x[:1]).logits[0]) <= TOL and max_diff(ref[0], ref[1]) > 100 * TOL
    together = z.generate(x[:, :6], 8, adapter_names=names)
    for i, name in enumerate(names):
        with adapters_per_row(z, [name]):
            assert torch.equal(together[i:i + 1], z.generate(x[i:i + 1, :6], 8)), name
    with pytest.raises(ValueError, match="'c' not among the model's adapters"):
        set_adapter(z, "c")
