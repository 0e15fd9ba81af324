"""FLUX.2's pipeline around the transformer (zoo/diffusion/flux2_pipeline.py) against diffusers' Flux2KleinPipeline.

Reference: a transformers Qwen3ForCausalLM at random init (weights N(0, 0.1)), a byte-level BPE trained here with the
tail of Qwen3's chat template (a single user turn, thinking off: what the pipeline renders), and diffusers'
Flux2KleinPipeline run on Zoo's exported transformer and text encoder with a tiny AutoencoderKLFlux2 whose batch-norm
statistics are random (its decoder is never run: the latents are compared). Tolerances: prompt embeddings max |diff|
<= 1e-5, sampled latents (4 steps, guidance on) <= 1e-4, fp32.
"""
import json
from pathlib import Path

import pytest
import torch

import zoo
from train.data.conversations import prompt_tokens, tokenizer_and_template
from zoo.config import Flux2Config
from zoo.diffusion import flux2_pipeline as fp
from zoo.diffusion.flux2 import Flux2

import diffusers
import transformers

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and "
            "enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
PROMPTS = ["a red cat on a mat", "a handwritten seven, thick strokes, on a red mat beside a cat, drawn twice", ""]
MAX_LEN, LAYERS = 40, (1, 2, 4)  # the last is the final norm's output


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """A Hugging Face folder: a tiny Qwen3ForCausalLM (4 layers) and its tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    folder = tmp_path_factory.mktemp("qwen3")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator(PROMPTS * 5, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2Tokenizer", "chat_template": TEMPLATE, "pad_token": "<|endoftext|>",
        "eos_token": "<|im_end|>"}))
    torch.manual_seed(0)
    ref = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, tie_word_embeddings=False))
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.1)
    ref.save_pretrained(folder)
    return folder


def zoo_embeds(folder, llm, prompts, layers=LAYERS):
    tok, template = tokenizer_and_template(folder)
    return fp.prompt_embeds(llm, *prompt_tokens(tok, template, prompts, MAX_LEN), layers)


def test_prompt_embeddings_equal_the_pipelines(qwen3):
    ref = transformers.Qwen3ForCausalLM.from_pretrained(qwen3).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(qwen3)
    want = diffusers.Flux2KleinPipeline._get_qwen3_prompt_embeds(ref, hf_tok, PROMPTS, max_sequence_length=MAX_LEN,
                                                                  hidden_states_layers=LAYERS)
    llm = zoo.from_pretrained(qwen3)
    got = zoo_embeds(qwen3, llm, PROMPTS)
    assert got.shape == want.shape == (len(PROMPTS), MAX_LEN, len(LAYERS) * 32)
    assert (got - want).abs().max() <= 1e-5, (got - want).abs().max()
    assert want[:, :, :32].abs().max() > 0.1  # the padding rows carry signal too (they are compared)
    with pytest.raises(ValueError, match=r"layers \[5\] out of range"):
        zoo_embeds(qwen3, llm, PROMPTS, (2, 5))


def test_a_text_to_image_runs_text_encoder_embeds_as_the_pipeline(qwen3):
    """model.text_encoder a Hugging Face folder (train/tasks/text_to_image.py): the pipeline's prompt embeddings, a
    prompt longer than model.text_length truncated as the pipeline truncates it, and counted."""
    from conftest import CPU
    from train.config import load_run_config
    from train.tasks.text_to_image import TextEncoder
    ref = transformers.Qwen3ForCausalLM.from_pretrained(qwen3).eval()
    want = diffusers.Flux2KleinPipeline._get_qwen3_prompt_embeds(ref, transformers.AutoTokenizer.from_pretrained(
        qwen3), PROMPTS, max_sequence_length=MAX_LEN, hidden_states_layers=LAYERS)
    config = Path(__file__).resolve().parents[1] / "configs" / "diffusion" / "digits-text.yaml"
    m = load_run_config(str(config), [f"model.text_encoder={qwen3}", "model.flux2.text_dim=96",
                                      f"model.text_layers={list(LAYERS)}", f"model.text_length={MAX_LEN}"]).model
    enc = TextEncoder(m, "run.yaml", CPU)
    got = enc.embed(PROMPTS)
    assert got.shape == want.shape and (got - want).abs().max() <= 1e-5, (got - want).abs().max()
    assert enc.truncated == [PROMPTS[1]]


def test_latents_pack_as_the_pipeline_packs():
    z = torch.randn(2, 4, 6, 10)
    mean, std = torch.randn(16), torch.rand(16) + 0.5
    P = diffusers.Flux2KleinPipeline
    want = P._pack_latents((P._patchify_latents(z) - mean.view(1, -1, 1, 1)) / std.view(1, -1, 1, 1))
    assert torch.allclose(fp.pack(z, mean, std), want, atol=1e-6)
    assert torch.allclose(fp.unpack(fp.pack(z, mean, std), 3, 5, mean, std), z, atol=1e-5)
    ids = P._prepare_latent_ids(torch.zeros(2, 16, 3, 5))
    assert torch.equal(fp.unpack(want, 3, 5), P._unpatchify_latents(P._unpack_latents_with_ids(want, ids, 3, 5)))


@pytest.mark.parametrize("steps,tokens", [(4, 64), (50, 4096), (28, 5000)])
def test_sigmas_are_the_schedulers(steps, tokens):
    """FLUX.2's mu (dynamic shifting) and a fixed shift, on the pipeline's sigmas: the scheduler's, 1e-6."""
    from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu
    grid = [1 - i * (1 - 1 / steps) / (steps - 1) for i in range(steps)]
    s = diffusers.FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, shift=3.0)
    s.set_timesteps(sigmas=grid, mu=compute_empirical_mu(tokens, steps))
    assert torch.allclose(fp.sigmas(steps, tokens), s.sigmas, atol=1e-6)
    s = diffusers.FlowMatchEulerDiscreteScheduler(shift=2.5)
    s.set_timesteps(sigmas=grid)
    assert torch.allclose(fp.sigmas(steps, tokens, 2.5), s.sigmas, atol=1e-6)


@pytest.fixture(scope="module")
def pipeline(qwen3, tmp_path_factory):
    """(Flux2KleinPipeline on Zoo's exports, Zoo's transformer and text encoder, the latents' mean and std)."""
    tmp = tmp_path_factory.mktemp("pipeline")
    llm = zoo.from_pretrained(qwen3)
    torch.manual_seed(1)
    model = Flux2(Flux2Config(double_depth=2, single_depth=2, heads=2, head_dim=16, rope_axes=(4, 4, 4, 4),
                              in_channels=16, text_dim=3 * 32))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)
    vae = diffusers.AutoencoderKLFlux2(block_out_channels=(8, 8), down_block_types=("DownEncoderBlock2D",) * 2,
                                       up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4,
                                       norm_num_groups=4, layers_per_block=1).eval()
    vae.bn.running_mean.normal_(0, 1)
    vae.bn.running_var.uniform_(0.5, 2)
    mean, std = vae.bn.running_mean, (vae.bn.running_var + vae.config.batch_norm_eps).sqrt()
    zoo.save_pretrained(model, tmp / "transformer")
    zoo.save_pretrained(llm, tmp / "text_encoder")
    pipe = diffusers.Flux2KleinPipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, shift=3.0), vae=vae,
        text_encoder=transformers.Qwen3ForCausalLM.from_pretrained(tmp / "text_encoder").eval(),
        tokenizer=transformers.AutoTokenizer.from_pretrained(qwen3),
        transformer=diffusers.Flux2Transformer2DModel.from_pretrained(tmp / "transformer").eval())
    return pipe, model, llm, mean, std


def pipeline_latents(pipe, prompts, h, w, seed=7):
    f = 2 * pipe.vae_scale_factor  # pixels per latent token
    return pipe(prompt=prompts, height=h * f, width=w * f, num_inference_steps=4, guidance_scale=3.0,
                generator=torch.Generator().manual_seed(seed), output_type="latent", max_sequence_length=MAX_LEN,
                text_encoder_out_layers=LAYERS).images


def test_the_pipeline_samples_zoos_latents(qwen3, pipeline):
    pipe, model, llm, mean, std = pipeline
    h, w, prompts = 3, 5, PROMPTS[:2]
    want = pipeline_latents(pipe, prompts, h, w)
    cond, uncond = zoo_embeds(qwen3, llm, prompts), zoo_embeds(qwen3, llm, [""] * len(prompts))
    got = fp.sample(model, cond, uncond, h, w, steps=4, scale=3.0, generator=torch.Generator().manual_seed(7),
                    mean=mean, std=std)
    assert got.shape == want.shape == (2, 4, 2 * h, 2 * w)
    assert (got - want).abs().max() <= 1e-4, (got - want).abs().max()
    unguided = fp.sample(model, cond, uncond, h, w, steps=4, scale=1.0, generator=torch.Generator().manual_seed(7),
                         mean=mean, std=std)
    assert (unguided - want).abs().max() > 1e-2  # guidance changed the sample


def test_sample_program_on_a_saved_pipeline_folder(pipeline, tmp_path):
    from train import sample
    from zoo.diffusion.taesd import TAESD
    pipe, *_ = pipeline
    pipe.save_pretrained(tmp_path / "pipe")
    zoo.save_pretrained(TAESD(4, channels=8), tmp_path / "taesd_encoder.pth")
    decoder = zoo.from_pretrained(tmp_path / "taesd_encoder.pth").eval()
    h, w, f = 3, 5, 2 * pipe.vae_scale_factor
    with torch.no_grad():
        want = decoder.decode(pipeline_latents(pipe, [PROMPTS[0]] * 2, h, w, seed=3)).clamp(0, 1)
    got = sample.generate(tmp_path / "pipe", [PROMPTS[0]], decoder, steps=4, guidance=3.0, seed=3, n=2,
                          size=(h * f, w * f), max_length=MAX_LEN, layers=LAYERS)
    assert got.shape == want.shape and (got - want).abs().max() <= 1e-4, (got - want).abs().max()
    argv = [str(tmp_path / "pipe"), "a cat", "", "--decoder", str(tmp_path / "taesd_encoder.pth"), "--out",
            str(tmp_path / "out"), "--steps", "2", "--size", str(h * f), str(w * f), "--max-length", "24",
            "--layers", "1", "2", "4"]
    assert sample.main(argv) == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["a_cat-0-0.png", "empty-0-0.png"]
    assert sample.main([str(tmp_path), "a cat", "--decoder", str(tmp_path / "taesd_encoder.pth")]) == 2
