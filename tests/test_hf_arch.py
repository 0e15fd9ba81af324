"""Today's decoder architectures in and out of Hugging Face folders (zoo/weights/hf_llm.py, the records of zoo/archs):
Qwen3, SmolLM3, OLMo 2 and 3, Phi-3 / Phi-4-mini, Gemma 2, Gemma 3 (text), Gemma 4 (text: per-layer inputs,
KV-sharing layers, wider global heads, keys as values, proportional RoPE, layer scalars, experts beside the MLP),
GLM-4, Cohere 2, GPT-OSS, DeepSeek-V3, DeepSeek-V3.2 (its lightning indexer keeping fewer keys than the sequence
has), GLM-5 (its indexer's RoPE interleaved, layers reusing an earlier indexer's keys), Mistral 4, LFM2, Qwen3.5,
Qwen3.5-MoE and Qwen3-Next (DeltaNet rows its file fuses per key head, split on load and joined on save; a gated
shared expert, sparse steps, dense layers), Granite 4.0-H (Mamba-2 layers past one chunk, dense or with experts,
muP's multipliers), each at two small shapes, the second with its features at non-default values (windows shorter
than the sequence, soft-caps, head_dim != d_model / heads, MQA, partial rotary, LongRoPE / YaRN / linear scaling,
NoPE layers, clamped experts, no query bottleneck, a query temperature past a short original context, logit scales,
biases, state sizes, groups, kernels); the presets of their families against transformers' classes.
Reference: transformers' random-init model (std 0.1, gains around 1, as in tests/test_hf_llm.py) saved by
transformers. One test per case checks: fp32 logits within 1e-4 and the same 20 greedy tokens (Zoo on its
KV cache); the same logits from a 4.x config.json (rope_theta / rope_scaling / rope_local_base_freq /
partial_rotary_factor at the top level, torch_dtype); Zoo's export loads back in transformers as the same
class with the same logits; Gemma 4, which has no 4.x dialect: the multimodal class's folder wrapping it instead.
"""
import copy
import dataclasses
import json

import pytest
import torch
from test_hf_llm import assert_same_generation, assert_same_logits, randomize, tokens

import zoo

import transformers

# transformers 5.24 has Mistral 4 but no Auto class entry for it
transformers.AutoModelForCausalLM.register(transformers.Mistral4Config, transformers.Mistral4ForCausalLM, exist_ok=True)

SMALL = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5)
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 32,
            "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5], "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]}
YARN = {"rope_type": "yarn", "rope_theta": 20000.0, "factor": 4.0, "original_max_position_embeddings": 32}
SLIDING, FULL, CONV, LINEAR = "sliding_attention", "full_attention", "conv", "linear_attention"
DROP = object()  # a SMALL key the class does not have
GDN = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=6)

CASES = {
    "qwen3": ("Qwen3", dict(head_dim=24, tie_word_embeddings=True)),
    "qwen3-mqa-window-bias-yarn": ("Qwen3", dict(num_key_value_heads=1, use_sliding_window=True, sliding_window=8,
                                                 max_window_layers=2, attention_bias=True, rope_parameters=YARN)),
    "smollm3": ("SmolLM3", dict(tie_word_embeddings=True)),
    "smollm3-nope-window-mqa": ("SmolLM3", dict(num_key_value_heads=1, no_rope_layers=[1, 0, 0, 1], head_dim=24,
                                                use_sliding_window=True, sliding_window=8)),
    "olmo2": ("Olmo2", dict()),
    "olmo2-mqa-head-dim-linear": ("Olmo2", dict(num_key_value_heads=1, head_dim=24, rope_parameters={
        "rope_type": "linear", "rope_theta": 5e4, "factor": 2.0})),
    "phi3-window": ("Phi3", dict(sliding_window=8)),
    "phi4mini-partial-longrope": ("Phi3", dict(partial_rotary_factor=0.75, tie_word_embeddings=True,
                                               num_key_value_heads=1, rope_parameters=LONGROPE,
                                               original_max_position_embeddings=32)),
    "gemma2": ("Gemma2", dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=8)),
    "gemma2-softcaps-scalar-mqa": ("Gemma2", dict(head_dim=24, num_key_value_heads=1, query_pre_attn_scalar=10,
                                                  attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
                                                  sliding_window=6)),
    "gemma3": ("Gemma3Text", dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                                  layer_types=[SLIDING, SLIDING, FULL, SLIDING])),
    "gemma3-scaled-global-softcaps-mqa": ("Gemma3Text", dict(
        head_dim=24, num_key_value_heads=1, query_pre_attn_scalar=20, sliding_window=6, final_logit_softcapping=4.0,
        attn_logit_softcapping=3.0, layer_types=[SLIDING, FULL, SLIDING, FULL], rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e5},
            "sliding_attention": {"rope_type": "default", "rope_theta": 500.0}})),
    "gemma4": ("Gemma4Text", dict(head_dim=16, global_head_dim=32, sliding_window=8, layer_types=[SLIDING, FULL] * 2,
                                  hidden_size_per_layer_input=8, vocab_size_per_layer_input=300, num_kv_shared_layers=2)),
    "gemma4-kv-same-mqa-wide-mlp-proportional-half-softcap-untied": ("Gemma4Text", dict(
        num_hidden_layers=6, head_dim=24, global_head_dim=40, attention_k_eq_v=True, num_global_key_value_heads=1,
        sliding_window=6, layer_types=[SLIDING, SLIDING, FULL, SLIDING, FULL, FULL], hidden_size_per_layer_input=12,
        vocab_size_per_layer_input=300, num_kv_shared_layers=3, use_double_wide_mlp=True, final_logit_softcapping=4.0,
        tie_word_embeddings=False, rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 500.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5, "factor": 2.0,
                               "rope_theta": 1e5}})),
    "gemma4-moe-kv-same-softcap": ("Gemma4Text", dict(
        head_dim=16, global_head_dim=32, sliding_window=8, layer_types=[SLIDING, FULL] * 2, hidden_size_per_layer_input=0,
        attention_k_eq_v=True, num_global_key_value_heads=1, final_logit_softcapping=4.0, enable_moe_block=True,
        num_experts=4, top_k_experts=2, moe_intermediate_size=40)),
    "gpt-oss": ("GptOss", dict(num_local_experts=4, num_experts_per_tok=2, head_dim=16, sliding_window=8,
                               swiglu_limit=0.3, rope_parameters=dict(YARN, truncate=False))),
    "gpt-oss-mqa-window-all-layers": ("GptOss", dict(num_local_experts=3, num_experts_per_tok=1, head_dim=24,
                                                     num_key_value_heads=1, sliding_window=6, layer_types=[SLIDING] * 4,
                                                     rope_parameters={"rope_type": "default", "rope_theta": 1e4})),
    "olmo3": ("Olmo3", dict(sliding_window=8, layer_types=[SLIDING, SLIDING, SLIDING, FULL])),
    "olmo3-mqa-head-dim-local-rope-yarn": ("Olmo3", dict(
        num_key_value_heads=1, head_dim=24, sliding_window=6, layer_types=[SLIDING, FULL, SLIDING, FULL],
        rope_parameters={"full_attention": YARN, "sliding_attention": {"rope_type": "default", "rope_theta": 500.0}})),
    "glm4": ("Glm4", dict(head_dim=16, pad_token_id=None)),
    "glm4-mqa-no-bias-linear-partial": ("Glm4", dict(num_key_value_heads=1, head_dim=24, attention_bias=False,
                                                     pad_token_id=None, rope_parameters={
                                                         "rope_type": "linear", "rope_theta": 5e4, "factor": 2.0,
                                                         "partial_rotary_factor": 0.75})),
    "cohere2": ("Cohere2", dict(sliding_window=8, layer_types=[SLIDING, SLIDING, SLIDING, FULL], logit_scale=4.0)),
    "cohere2-bias-mqa-pattern-scale-untied": ("Cohere2", dict(
        num_key_value_heads=1, attention_bias=True, sliding_window=6, layer_types=[SLIDING, FULL, SLIDING, FULL],
        logit_scale=0.5, tie_word_embeddings=False, rope_parameters={"rope_type": "linear", "rope_theta": 5e4,
                                                                     "factor": 2.0})),
    "mistral4": ("Mistral4", dict(num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                                  first_k_dense_replace=1, moe_intermediate_size=32, q_lora_rank=24, kv_lora_rank=16,
                                  qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10)),
    "mistral4-groups-no-q-rank-temperature": ("Mistral4", dict(
        num_key_value_heads=4, n_routed_experts=6, n_shared_experts=2, num_experts_per_tok=2, n_group=3, topk_group=2,
        first_k_dense_replace=0, moe_intermediate_size=24, q_lora_rank=None, kv_lora_rank=12, qk_rope_head_dim=6,
        qk_nope_head_dim=10, v_head_dim=14, norm_topk_prob=False, routed_scaling_factor=1.5,
        rope_parameters=dict(YARN, original_max_position_embeddings=16, mscale=0.7, mscale_all_dim=0.9,
                             llama_4_scaling_beta=0.3))),
    "deepseek-v3": ("DeepseekV3", dict(num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                                       n_group=4, topk_group=2, first_k_dense_replace=1, moe_intermediate_size=32,
                                       q_lora_rank=24, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=12,
                                       v_head_dim=10, routed_scaling_factor=2.5)),
    "deepseek-v3-no-q-rank-yarn": ("DeepseekV3", dict(
        num_key_value_heads=4, n_routed_experts=6, n_shared_experts=2, num_experts_per_tok=3, n_group=1, topk_group=1,
        first_k_dense_replace=0, moe_intermediate_size=24, q_lora_rank=None, kv_lora_rank=12, qk_rope_head_dim=6,
        qk_nope_head_dim=10, v_head_dim=14, norm_topk_prob=False, routed_scaling_factor=1.5,
        rope_parameters=dict(YARN, mscale=0.7, mscale_all_dim=0.9))),
    "deepseek-v3-no-shared-top1-dense2-tied": ("DeepseekV3", dict(  # transformers keeps empty shared-expert tensors
        num_key_value_heads=4, n_routed_experts=5, n_shared_experts=0, num_experts_per_tok=1, n_group=1, topk_group=1,
        first_k_dense_replace=2, moe_intermediate_size=24, q_lora_rank=20, kv_lora_rank=12, qk_rope_head_dim=6,
        qk_nope_head_dim=10, v_head_dim=14, tie_word_embeddings=True)),
    "deepseek-v32": ("DeepseekV32", dict(num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1,
                                         num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1,
                                         moe_intermediate_size=32, q_lora_rank=24, kv_lora_rank=16, qk_rope_head_dim=8,
                                         qk_nope_head_dim=12, v_head_dim=10, index_topk=8, index_head_dim=16,
                                         index_n_heads=2)),
    "deepseek-v32-top5-heads3-yarn-raw-topk": ("DeepseekV32", dict(
        num_key_value_heads=4, n_routed_experts=6, n_shared_experts=2, num_experts_per_tok=3, n_group=1, topk_group=1,
        first_k_dense_replace=0, moe_intermediate_size=24, q_lora_rank=20, kv_lora_rank=12, qk_rope_head_dim=6,
        qk_nope_head_dim=10, v_head_dim=14, norm_topk_prob=False, routed_scaling_factor=1.5, index_topk=5,
        index_head_dim=12, index_n_heads=3, rope_parameters=dict(YARN, mscale=0.7, mscale_all_dim=0.9))),
    "glm5": ("GlmMoeDsa", dict(num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                               first_k_dense_replace=1, moe_intermediate_size=32, q_lora_rank=24, kv_lora_rank=16,
                               qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10, index_topk=8, index_head_dim=16,
                               index_n_heads=2)),
    "glm5-shared-index-groups-top5-heads3-yarn-raw-topk": ("GlmMoeDsa", dict(
        num_key_value_heads=4, n_routed_experts=6, n_shared_experts=2, num_experts_per_tok=3, n_group=3, topk_group=2,
        first_k_dense_replace=0, moe_intermediate_size=24, q_lora_rank=20, kv_lora_rank=12, qk_rope_head_dim=6,
        qk_nope_head_dim=10, v_head_dim=14, norm_topk_prob=False, routed_scaling_factor=1.5, index_topk=5,
        index_head_dim=12, index_n_heads=3, indexer_types=["full", "shared", "full", "shared"], rms_norm_eps=1e-6,
        rope_parameters=dict(YARN, mscale=0.7, mscale_all_dim=0.9))),
    "lfm2": ("Lfm2", dict(layer_types=[CONV, FULL, CONV, FULL])),
    "lfm2-kernel5-bias-mqa-untied-ffn-rounding": ("Lfm2", dict(
        num_key_value_heads=1, conv_L_cache=5, conv_bias=True, tie_word_embeddings=False,
        layer_types=[CONV, CONV, FULL, CONV], block_ffn_dim_multiplier=1.5, block_multiple_of=32)),
    "qwen3_5": ("Qwen3_5Text", dict(head_dim=16, **GDN)),
    "qwen3_5-kernel3-half-rotary-mqa-tied": ("Qwen3_5Text", dict(
        head_dim=24, num_key_value_heads=1, linear_num_key_heads=1, linear_num_value_heads=3, linear_key_head_dim=12,
        linear_value_head_dim=10, linear_conv_kernel_dim=3, tie_word_embeddings=True,
        layer_types=[FULL, LINEAR, LINEAR, FULL], rope_parameters={"rope_type": "default", "rope_theta": 5e4, "partial_rotary_factor": 0.5})),
    "qwen3_next": ("Qwen3Next", dict(head_dim=16, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
                                     shared_expert_intermediate_size=48, **GDN)),
    "qwen3_next-kernel3-mqa-sparse-step-dense-raw-topk": ("Qwen3Next", dict(
        head_dim=24, num_key_value_heads=1, linear_num_key_heads=1, linear_num_value_heads=3, linear_key_head_dim=12,
        linear_value_head_dim=10, linear_conv_kernel_dim=3, layer_types=[FULL, LINEAR, LINEAR, FULL], num_experts=5,
        num_experts_per_tok=3, moe_intermediate_size=24, shared_expert_intermediate_size=40, decoder_sparse_step=2,
        mlp_only_layers=[3], norm_topk_prob=False, num_attention_heads=2,
        rope_parameters={"rope_type": "default", "rope_theta": 5e4, "partial_rotary_factor": 0.5})),
    "qwen3_5_moe": ("Qwen3_5MoeText", dict(intermediate_size=DROP, head_dim=16, num_experts=6, num_experts_per_tok=2,
                                          moe_intermediate_size=24, shared_expert_intermediate_size=40, **GDN)),
    "qwen3_5_moe-kernel3-half-rotary-mqa-tied-top3": ("Qwen3_5MoeText", dict(
        intermediate_size=DROP, head_dim=24, num_key_value_heads=1, linear_num_key_heads=1, linear_num_value_heads=3,
        linear_key_head_dim=12, linear_value_head_dim=10, linear_conv_kernel_dim=3, tie_word_embeddings=True,
        num_experts=5, num_experts_per_tok=3, moe_intermediate_size=24, shared_expert_intermediate_size=40,
        num_attention_heads=2, layer_types=[FULL, LINEAR, LINEAR, FULL],
        rope_parameters={"rope_type": "default", "rope_theta": 5e4, "partial_rotary_factor": 0.5})),
    "granite-h": ("GraniteMoeHybrid", dict(layer_types=["mamba", "attention", "mamba", "mamba"], mamba_n_heads=8,
                                           mamba_d_state=16, mamba_chunk_size=64, num_local_experts=4,
                                           shared_intermediate_size=48)),
    "granite-h-dense-rope-groups-kernel3-multipliers-bias-mqa-tied": ("GraniteMoeHybrid", dict(
        layer_types=["attention", "mamba", "mamba", "attention"], num_key_value_heads=1, mamba_n_heads=6,
        mamba_n_groups=3, mamba_expand=3, mamba_d_state=12, mamba_chunk_size=32, mamba_d_conv=3, mamba_conv_bias=False,
        mamba_proj_bias=True, num_local_experts=0, shared_intermediate_size=80, attention_bias=True,
        position_embedding_type="rope", embedding_multiplier=3.0, residual_multiplier=0.4, attention_multiplier=0.3,
        logits_scaling=2.5, tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 5e4},
        time_step_limit=(0.05, 0.4))),
}


def hf_model(kind, **kw):
    cfg = getattr(transformers, kind + "Config")(**{k: v for k, v in {**SMALL, **kw}.items() if v is not DROP})
    cfg.bos_token_id = cfg.eos_token_id = cfg.pad_token_id = None  # generate() must never stop early
    cfg._experts_implementation = "eager"
    model_cls = getattr(transformers, kind.removesuffix("Text") + "ForCausalLM")
    model = randomize(model_cls(cfg)).eval()
    for name, b in model.named_buffers():  # DeepSeek's routing bias, Gemma 4's layer scalars: not their init
        if name.endswith(("e_score_correction_bias", "layer_scalar")):
            b.copy_(0.1 * torch.randn(b.shape, generator=torch.Generator().manual_seed(3)) + name.endswith("scalar"))
    if kind == "Gemma4Text":  # scores unscaled by the head size: the q gains carry it, as a trained model's, so that
        with torch.no_grad():  # fp32 rounding (sdpa against eager in transformers alone) stays well inside 1e-4
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.mul_(layer.self_attn.head_dim ** -0.5)
                if layer.enable_moe_block:  # router gains that spread its logits (choices well apart) and unequal,
                    g = torch.Generator().manual_seed(4)  # positive per-expert scales
                    d = cfg.hidden_size
                    layer.router.scale.copy_(2 * d ** 0.5 * (1 + 0.5 * torch.randn(d, generator=g)))
                    layer.router.per_expert_scale.copy_(torch.rand(cfg.num_experts, generator=g) * 1.5 + 0.25)
    return model


def to_4x(cfg: dict) -> dict:
    """A 5.x config.json rewritten in transformers 4.x's dialect."""
    cfg = dict(cfg)
    params = cfg.pop("rope_parameters")
    if "full_attention" in params:
        cfg["rope_local_base_freq"] = params["sliding_attention"]["rope_theta"]
        params = params["full_attention"]
    params = dict(params)
    cfg["rope_theta"] = params.pop("rope_theta")
    if "partial_rotary_factor" in params:
        cfg["partial_rotary_factor"] = params.pop("partial_rotary_factor")
    if params.get("rope_type", "default") != "default":
        params["type"] = params.pop("rope_type")
        cfg["rope_scaling"] = params
    cfg["torch_dtype"] = cfg.pop("dtype")
    if cfg["model_type"] == "granitemoehybrid":  # 4.x's names of its layer kinds
        cfg["layer_types"] = [{LINEAR: "mamba", FULL: "attention"}[t] for t in cfg["layer_types"]]
    return cfg


SLOW_CASES = {"gemma4-kv-same-mqa-wide-mlp-proportional-half-softcap-untied", "deepseek-v32-top5-heads3-yarn-raw-topk",
              "gemma4-moe-kv-same-softcap"}  # Gemma 4's experts: also in the quick tier's test_lora (logits, adapters)


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW_CASES else c for c in CASES])
def test_parity_dialects_and_export(tmp_path, case):
    kind, kw = CASES[case]
    hf = hf_model(kind, **kw)
    hf.save_pretrained(tmp_path / "in")
    arch = type(hf).__name__
    z = zoo.from_pretrained(tmp_path / "in")
    assert z.hf_architecture == arch
    if "sliding_window" in kw:  # the window is shorter than the 48 tokens compared: it shows
        assert z.config.sliding_window == kw["sliding_window"]
    x = tokens(shape=(2, 80)) if z.config.layer_types else None  # recurrent layers: past one chunk of 64
    assert_same_logits(hf, z, x)
    if x is not None:  # Zoo's chunked scans at another chunk size, boundaries inside transformers' chunks
        cfg = copy.deepcopy(z.config)
        cfg.recurrent = dataclasses.replace(cfg.resolved_recurrent, chunk=24)
        other = zoo.build(cfg).eval()
        other.load_state_dict(z.state_dict())
        assert_same_logits(hf, other, x)
    assert_same_generation(hf, z)

    zoo.save_pretrained(z, tmp_path / "out")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(back).__name__ == arch
    assert_same_logits(back, z, x)

    if kind == "Gemma4Text":  # no 4.x dialect: the multimodal class's folder, its text model inside, instead
        return assert_same_wrapped(hf, tmp_path / "wrapped", x)
    old = tmp_path / "4x"
    old.mkdir()
    (old / "model.safetensors").symlink_to(tmp_path / "in" / "model.safetensors")
    (old / "config.json").write_text(json.dumps(to_4x(json.loads((tmp_path / "in" / "config.json").read_text()))))
    assert "rope_parameters" not in json.loads((old / "config.json").read_text())
    assert_same_logits(hf, zoo.from_pretrained(old), x)


def assert_same_wrapped(hf, folder, x):
    """Gemma4ForConditionalGeneration's folder (config.json's text_config, the text model's tensors under
    model.language_model.) of the same weights loads as the text model, with the same logits."""
    tied = hf.config.tie_word_embeddings  # the outer config's key ties the head
    wrapped = transformers.Gemma4ForConditionalGeneration(transformers.Gemma4Config(
        text_config=hf.config, tie_word_embeddings=tied)).eval()
    wrapped.model.language_model.load_state_dict(hf.model.state_dict())
    wrapped.lm_head.load_state_dict(hf.lm_head.state_dict())
    wrapped.save_pretrained(folder)
    assert "text_config" in json.loads((folder / "config.json").read_text())
    z = zoo.from_pretrained(folder)
    assert z.hf_architecture == "Gemma4ForCausalLM"
    assert_same_logits(hf, z, x)


def test_features_refused_together(tmp_path):
    """A model whose ideas no single Hugging Face class holds is refused on export, in one line."""
    from zoo.weights import hf_llm
    z = zoo.build(dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, norm_placement="post", attn_softcap=5.0))
    with pytest.raises(ValueError, match="no Hugging Face architecture here holds .*attn_softcap.*post_norm"):
        hf_llm.save(z, tmp_path)
    from zoo.config import ConfigError  # combinations that cannot work: one line naming both keys
    for key in ("attn_sinks", "mla"):
        with pytest.raises(ConfigError, match=f"mod_capacity does not combine with model.{key}"):
            zoo.build(dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, mod_capacity=0.5,
                           **{key: True if key == "attn_sinks" else {"kv_rank": 8}}))


def test_hybrid_refusals(tmp_path):
    """A config.json whose layer_types name a layer kind Zoo lacks, a hybrid model no class holds, and one whose class
    cannot hold a combination (RoPE on some attention layers of a Granite), are refused in one line."""
    hf = hf_model("Lfm2", layer_types=[CONV, FULL, CONV, FULL])
    hf.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "layer_types": [CONV, "rwkv", CONV, FULL]}))
    from zoo.config import ConfigError
    with pytest.raises(ConfigError, match=r"config.json: layer_types\[1\] must be .*got 'rwkv'"):
        zoo.from_pretrained(tmp_path)
    from zoo.weights import hf_llm
    z = zoo.build(dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, layer_types=["mamba", "conv"],
                       recurrent=dict(n_heads=4, head_dim=8, state_size=4)))
    with pytest.raises(ValueError, match=r"no Hugging Face architecture here holds .*mamba \(model.layer_types: mamba\)"):
        hf_llm.save(z, tmp_path / "out")
    z = zoo.build(dict(vocab_size=64, d_model=32, n_layers=4, n_heads=4, layer_types=["mamba", "full_attention"],
                       nope_layers=[1], recurrent=dict(n_heads=4, head_dim=8, state_size=4)))
    with pytest.raises(ValueError, match="a GraniteMoeHybridForCausalLM has RoPE on every attention layer or on none"):
        hf_llm.save(z, tmp_path / "out")


def test_gemma4_refusals(tmp_path):
    """A Gemma 4 folder Zoo cannot hold (experts beside KV-sharing layers' wider MLPs, bidirectional attention, a last
    layer transformers would turn global, global layers of several shapes), models a Gemma4ForCausalLM cannot hold
    (another query scale, experts without its norms), and KV-sharing layers with no earlier layer of their kind are
    one-line errors naming the key."""
    from zoo.config import ConfigError
    from zoo.weights import hf_llm
    hf_model("Gemma4Text", **CASES["gemma4"][1]).save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    moe = {"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 8}
    for bad, match in (({**moe, "use_double_wide_mlp": True}, "use_double_wide_mlp with enable_moe_block is not"),
                       ({**moe, "num_experts": None}, "enable_moe_block=True needs num_experts"),
                       ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention=all is not supported"),
                       ({"layer_types": [SLIDING, FULL, FULL, SLIDING]}, "layer_types ends in 'sliding_attention'"),
                       ({"per_layer_config": {"1": {"head_dim": 32}, "3": {"head_dim": 16}}}, "per_layer_config must")):
        (tmp_path / "config.json").write_text(json.dumps({**cfg, **bad}))
        with pytest.raises(ConfigError, match=match):
            zoo.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    scaled = dataclasses.replace(zoo.from_pretrained(tmp_path).config, query_pre_attn_scalar=2.0)
    with pytest.raises(ValueError, match="a Gemma4ForCausalLM has no query_pre_attn_scalar but 1"):
        hf_llm.architecture_for(scaled)
    plain = dataclasses.replace(scaled, query_pre_attn_scalar=1.0, moe=zoo.config.MoEConfig(n_experts=4))
    with pytest.raises(ValueError, match="a Gemma4ForCausalLM has experts only beside an MLP of ffn_hidden"):
        hf_llm.architecture_for(plain)
    with pytest.raises(ConfigError, match="kv_shared_layers=1 needs an earlier attention layer of each"):
        zoo.build(dict(vocab_size=64, d_model=32, n_layers=4, n_heads=4, sliding_window=4, kv_shared_layers=1,
                       attn_pattern=["local", "local", "local", "global"]))


@pytest.mark.usefixtures("one_thread")
def test_gemma4_left_padded_rows_decode_alone(tmp_path):
    """KV-sharing layers on masked caches: a left-padded batch of two prompts gives each row's greedy tokens alone."""
    hf_model("Gemma4Text", **CASES["gemma4"][1]).save_pretrained(tmp_path)
    z = zoo.from_pretrained(tmp_path)
    a, b = tokens(seed=5, shape=(1, 12)), tokens(seed=6, shape=(1, 7))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :5] = 0
    out = z.generate(torch.cat([a, torch.nn.functional.pad(b, (5, 0))]), 10, attention_mask=mask)
    assert torch.equal(out[:1], z.generate(a, 10)) and torch.equal(out[1:, 5:], z.generate(b, 10))


@pytest.mark.usefixtures("one_thread")
def test_lightning_indexer_selects(tmp_path):
    """DeepSeek-V3.2's parity (test_parity_dialects_and_export) holds because the same keys are kept: the same weights
    attending to every key (a top-k past the sequence) give other logits past the first index_topk positions. A
    config.json whose mlp_layer_types Zoo's dense-then-sparse layers cannot hold is refused."""
    hf = hf_model(*CASES["deepseek-v32"][:1], **CASES["deepseek-v32"][1])
    hf.save_pretrained(tmp_path)
    z = zoo.from_pretrained(tmp_path)
    cfg = copy.deepcopy(z.config)
    cfg.mla.index_topk = 1000
    dense = zoo.build(cfg).eval()
    dense.load_state_dict(z.state_dict())
    x, k = tokens(), z.config.mla.index_topk
    with torch.no_grad():
        ref, sparse, every = hf(x).logits, z(x), dense(x)
    assert (ref - sparse).abs().max() <= 1e-4
    assert (every[:, :k] - sparse[:, :k]).abs().max() <= 1e-5  # up to k keys: all kept
    assert (ref[:, k:] - every[:, k:]).abs().max() > 1e-2
    from zoo.config import ConfigError  # dense and sparse layers in another order than DeepSeek's: refused by name
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "mlp_layer_types": ["dense", "sparse", "dense", "sparse"]}))
    with pytest.raises(ConfigError, match="mlp_layer_types must be first_k_dense_replace=1 dense layers"):
        zoo.from_pretrained(tmp_path)


@pytest.mark.usefixtures("one_thread")
def test_glm5_indexer_rope_and_shared_layers_show(tmp_path, monkeypatch):
    """GLM-5's parity (test_parity_dialects_and_export) rests on its two differences from DeepSeek-V3.2: read with
    DeepSeek-V3.2's indexer layout (its RoPE pairs not reordered) or with the "shared" layers attending to every key,
    the logits differ. An indexer_types Zoo cannot hold (the first layer shared), and such index_shared layers, are
    refused by name; only GLM-5's class holds shared layers."""
    from zoo.archs import DeepseekV32, GlmMoeDsa
    kind, kw = CASES["glm5-shared-index-groups-top5-heads3-yarn-raw-topk"]
    hf = hf_model(kind, **kw)
    hf.save_pretrained(tmp_path)
    z, x = zoo.from_pretrained(tmp_path), tokens()
    assert z.config.mla.index_shared == [1, 3] and [b.attn.indexer is None for b in z.blocks()] == [False, True] * 2
    with torch.no_grad():
        ref = hf(x).logits
        assert (ref - z(x)).abs().max() <= 1e-4
        for b in z.blocks():
            b.attn.reuse_index = None
        assert (ref - z(x)).abs().max() > 1e-2
    monkeypatch.setattr(GlmMoeDsa, "rope_rows", DeepseekV32.rope_rows)
    with torch.no_grad():
        assert (ref - zoo.from_pretrained(tmp_path)(x)).abs().max() > 1e-2
    from zoo.config import ConfigError
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "indexer_types": ["shared", "full", "full", "full"]}))
    with pytest.raises(ConfigError, match="indexer_types must be 'full' or 'shared' per layer, the first 'full'"):
        zoo.from_pretrained(tmp_path)
    for bad, match in (([0], "index_shared=.0. needs .* layer 0 an indexer layer"), ([4], "has .4., not layers")):
        with pytest.raises(ConfigError, match=match):
            zoo.build(dataclasses.replace(z.config, mla=dataclasses.replace(z.config.mla, index_shared=bad)))
    from zoo.weights import hf_llm  # a model of shared layers is a GLM-5 whatever it was loaded from; without, a DeepSeek
    assert hf_llm.architecture_for(z.config, "DeepseekV32ForCausalLM") == "GlmMoeDsaForCausalLM"
    plain = dataclasses.replace(z.config, mla=dataclasses.replace(z.config.mla, index_shared=[]))
    assert hf_llm.architecture_for(plain) == "DeepseekV32ForCausalLM"


def test_final_softcap_caps_and_chunked_loss_refuses():
    z = randomize(zoo.build(dict(vocab_size=64, d_model=32, n_layers=1, n_heads=4, final_softcap=0.5)))
    x = torch.randint(0, 64, (1, 8))
    with torch.no_grad():
        assert z(x).abs().max() <= 0.5
    with pytest.raises(ValueError, match="final_softcap"):
        z(x, targets=x)
    z.chunked_loss = False
    assert z(x, targets=x)[1] > 0


PRESETS = {"qwen3-0.6b": "Qwen3ForCausalLM", "qwen3-text-tiny": "Qwen3ForCausalLM", "gemma3-270m": "Gemma3ForCausalLM",
           "gemma3-1b": "Gemma3ForCausalLM", "gemma4-e2b": "Gemma4ForCausalLM",
           "gemma4-26b-a4b": "Gemma4ForCausalLM",
           "olmo3-7b": "Olmo3ForCausalLM", "glm4-9b": "Glm4ForCausalLM", "cohere2-7b": "Cohere2ForCausalLM",
           "mistral4-119b": "Mistral4ForCausalLM",
           "olmo2-1b": "Olmo2ForCausalLM", "phi4-mini": "Phi3ForCausalLM", "smollm3-3b": "SmolLM3ForCausalLM",
           "gpt-oss-20b": "GptOssForCausalLM", "deepseek-v3": "DeepseekV3ForCausalLM",
           "deepseek-v32": "DeepseekV32ForCausalLM", "glm5": "GlmMoeDsaForCausalLM", "lfm2-350m": "Lfm2ForCausalLM",
           "qwen3_5-0.8b": "Qwen3_5ForCausalLM", "qwen3-next-80b-a3b": "Qwen3NextForCausalLM",
           "qwen3_5-35b-a3b": "Qwen3_5MoeForCausalLM", "granite-4.0-h-tiny": "GraniteMoeHybridForCausalLM"}
SHARED_SHAPE = {"qwen3_5-35b-a3b", "glm5"}  # a shape an earlier record (Qwen3-Next) also holds: named as its checkpoint names it


@pytest.mark.parametrize("preset", PRESETS)
def test_preset_is_its_architecture(preset):
    """Each family's preset, built on the meta device, exports as its Hugging Face class, and transformers'
    model of that config.json holds exactly as many parameters."""
    from zoo.weights import hf_llm
    with torch.device("meta"):
        z = zoo.build(f"configs/llm/{preset}.yaml")
        arch = hf_llm.architecture_for(z.config, PRESETS[preset] if preset in SHARED_SHAPE else None)
        assert arch == PRESETS[preset]
        hf_cfg = hf_llm.config_to_hf(z.config, arch, torch.bfloat16)
        conf = transformers.AutoConfig.for_model(**{k: v for k, v in hf_cfg.items() if k != "architectures"})
        hf = transformers.AutoModelForCausalLM.from_config(conf)
    assert type(hf).__name__ == arch
    assert sum(p.numel() for p in hf.parameters()) == z.num_params()


@pytest.mark.parametrize("preset", ["phi4-mini", "glm4-9b", "smollm3-3b"])
def test_a_model_trained_from_scratch_exports_token_ids_its_vocabulary_holds(tmp_path, preset):
    """A preset shrunk to a vocabulary of 300 and built by Zoo (no config.json it came from): the export names no
    bos/eos/pad id, where transformers' class defaults (32000, 151329, 128004) lie outside the embedding."""
    shape = dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=96, vocab_size=300, max_seq_len=128)
    z = zoo.build(f"configs/llm/{preset}.yaml", **shape, **({"nope_layers": [1]} if preset == "smollm3-3b" else {}))
    out = zoo.save_pretrained(randomize(z), tmp_path)
    cfg = json.loads((out / "config.json").read_text())
    assert [cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")] == [None] * 3
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert_same_logits(hf, z.eval())


@pytest.mark.parametrize("preset", ["qwen3_5-0.8b", "qwen3-next-80b-a3b", "lfm2-350m"])
def test_a_hybrid_without_an_attention_layer_is_saved_as_a_zoo_folder(tmp_path, preset):
    """Two layers of a 3:1 (Qwen3.5, Qwen3-Next) or conv-first (LFM2) pattern are recurrent only: transformers'
    cache for those classes takes its length from an attention layer, so no forward with a cache runs there. The
    Hugging Face export refuses it in one line and save_pretrained writes a Zoo folder that loads back unchanged."""
    z = zoo.build(f"configs/llm/{preset}.yaml", d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                  vocab_size=300)
    from zoo.weights import hf_llm
    with pytest.raises(ValueError) as e:
        hf_llm.save(z, tmp_path / "hf")
    assert "\n" not in str(e.value) and "no attention layer" in str(e.value)
    back = zoo.from_pretrained(zoo.save_pretrained(z, tmp_path / "zoo"))
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), z.state_dict().values()))


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("case", ["deepseek-v3", "deepseek-v3-no-q-rank-yarn", "deepseek-v32",
                                  "glm5-shared-index-groups-top5-heads3-yarn-raw-topk"])
def test_absorbed_latent_attention_decodes_as_the_expanded(tmp_path, case):
    """`mla.absorb`: on the cache (a prefill of 12, a chunk of 3, then single tokens) the logits equal the
    expanded attention's (1e-4, fp32) and 20 greedy tokens are the same."""
    hf = hf_model(*CASES[case][:1], **CASES[case][1])
    hf.save_pretrained(tmp_path)
    z = zoo.from_pretrained(tmp_path)
    cfg = copy.deepcopy(z.config)
    cfg.mla.absorb = True
    a = zoo.build(cfg).eval()
    a.load_state_dict(z.state_dict())
    assert all(b.attn.absorb for b in a.blocks()) and not any(b.attn.absorb for b in z.blocks())
    x = torch.randint(0, 300, (2, 20), generator=torch.Generator().manual_seed(4))
    caches = [m.new_caches(2, 20) for m in (z, a)]
    with torch.no_grad():
        for start, end in [(0, 12), (12, 15)] + [(t, t + 1) for t in range(15, 20)]:
            ref, out = (m(x[:, start:end], caches=c, start_pos=start) for m, c in zip((z, a), caches))
            assert ref.abs().max() > 1.0 and (ref - out).abs().max() <= 1e-4, (start, (ref - out).abs().max())
    assert torch.equal(z.generate(x[:1, :12], 20), a.generate(x[:1, :12], 20))
