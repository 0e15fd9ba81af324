"""Text to image (data.format: captions, model.denoiser: flux2): captions and their bad input, the text encoder and
the prompt cache, the config's checks, and (slow) the embedded default trained three steps then sampled by
train/sample.py from its run folder."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

from conftest import CPU
from train.config import load_run_config
from train.data.latents import prompt_cache
from train.tasks.text_to_image import TextEncoder, caption_pairs
from zoo.config import ConfigError

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "diffusion" / "digits-text.yaml"


def image(path: Path, caption=None):
    Image.new("RGB", (12, 10), (200, 10, 10)).save(path)
    if caption is not None:
        path.with_suffix(".txt").write_text(caption + "\n")
    return str(path)


def test_captions_skip_uncaptioned_and_undecodable_images_in_one_line_each(tmp_path):
    a, d = image(tmp_path / "a.png", "a red square"), image(tmp_path / "d.png", "another")
    b = image(tmp_path / "b.png")
    (tmp_path / "c.png").write_bytes(b"not a png")
    (tmp_path / "c.txt").write_text("broken")
    logs = []
    assert caption_pairs(str(tmp_path), "run.yaml", logs.append) == [(a, "a red square"), (d, "another")]
    assert logs == [f"data: skipped 1 images without a caption (first: {b})",
                    f"data: skipped 1 undecodable images (first: {tmp_path / 'c.png'} (UnidentifiedImageError))"]
    rows = tmp_path / "rows.jsonl"
    rows.write_text("\n".join(json.dumps(r) for r in ({"image": "a.png", "caption": "x"}, {"image": "b.png"},
                                                      {"image": "gone.png", "caption": "y"})) + "\n")
    logs = []
    assert caption_pairs(str(rows), "run.yaml", logs.append) == [(a, "x")]
    assert len(logs) == 2 and "gone.png" in logs[1]
    rows.write_text('{"image": "a.png", "caption": "x"}\nnot json\n')
    with pytest.raises(ConfigError, match=rf"data.dataset: {rows}:2: not a"):
        caption_pairs(str(rows), "run.yaml")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError) as e:
        caption_pairs(str(tmp_path / "empty"), "run.yaml")
    assert str(e.value) == f"run.yaml: data.dataset: {tmp_path / 'empty'}: no captioned images"


def test_a_caption_folder_splits_into_prompt_indices(tmp_path):
    """Labels index the prompts ("" first, then every distinct caption and sample prompt); images read as crops."""
    from train.tasks.text_to_image import CaptionDataConfig, load_captioned
    for i, c in enumerate(["a cat", "a dog", "a cat", "a cow"]):
        image(tmp_path / f"{i}.png", c)
    data, prompts = load_captioned(CaptionDataConfig(dataset=str(tmp_path), val_fraction=0.25,
                                                     sample_prompts=["a bird"]), 16, "run.yaml")
    assert prompts == ["", "a bird", "a cat", "a cow", "a dog"] and data.classes == 5
    got = sorted(data.labels["train"].tolist() + data.labels["val"].tolist())
    assert got == [2, 2, 3, 4] and len(data.labels["val"]) == 1 and "captions" in data.key
    assert data.read("train", 0, 3).shape == (3, 3, 16, 16)


def test_text_encoder_pads_truncates_and_checks_its_width():
    """The byte-level encoder of the embedded default: (B, text_length, layers x d_model) embeddings, a prompt longer
    than text_length truncated and counted, the real tokens' embeddings independent of the padding; text_dim checked."""
    m = load_run_config(str(CONFIG), ["model.text_length=8"]).model
    enc = TextEncoder(m, "run.yaml", CPU, ROOT / "configs" / "llm" / "qwen3-text-tiny.yaml")
    out = enc.embed(["a one", "a handwritten digit one"])
    assert out.shape == (2, 8, 128) and enc.truncated == ["a handwritten digit one"]
    torch.testing.assert_close(enc.embed(["a one"])[0, :5], out[0, :5], rtol=0, atol=1e-6)
    bad = load_run_config(str(CONFIG), ["model.flux2.text_dim=64"]).model
    with pytest.raises(ConfigError, match="model.flux2.text_dim=64: the text encoder gives 2 layers x 64; set it to 128"):
        TextEncoder(bad, "run.yaml", CPU, ROOT / "configs" / "llm" / "qwen3-text-tiny.yaml")


def test_prompt_cache_is_reused_and_rebuilt_for_another_key(tmp_path):
    calls, logs = [], []

    def encode(prompts):
        calls.append(list(prompts))
        return torch.arange(len(prompts) * 6, dtype=torch.float32).view(len(prompts), 3, 2) + len(calls)
    prompts = ["", "a", "b"]
    first = prompt_cache(tmp_path / "p", {"k": 1}, prompts, encode, batch_size=2, log=logs.append)
    again = prompt_cache(tmp_path / "p", {"k": 1}, prompts, encode, batch_size=2, log=logs.append)
    assert calls == [["", "a"], ["b"]] and logs[-1] == f"prompts: reusing {tmp_path / 'p'}"
    assert first.shape == (3, 3, 2) and (first == again).all() and first[2, 0, 0] == 2
    other = prompt_cache(tmp_path / "p", {"k": 2}, prompts, encode, batch_size=2, log=logs.append)
    assert len(calls) == 4 and other[0, 0, 0] == 3


@pytest.mark.parametrize("over,key", [(["model.denoiser=unet", "model.prediction=eps", "model.sampler=ddim"],
                                       "model.denoiser=unet"),
                                      (["model.prediction=eps", "model.sampler=ddim"], "model.prediction")])
def test_the_text_conditioned_denoiser_and_captions_go_together(over, key):
    with pytest.raises(ConfigError, match=key):
        load_run_config(str(CONFIG), over)
    with pytest.raises(ConfigError, match="model.denoiser=flux2"):
        load_run_config(None, base={"family": "diffusion", "model": {
            "denoiser": "flux2", "prediction": "flow", "sampler": "flow_euler", "text_encoder": "x.yaml"}})



def test_sample_program_bad_arguments_are_one_line(tmp_path, capsys):
    """train/sample.py: a folder that is not there, --n or --steps below 1, --decoder beside a run folder (which
    decodes with its own autoencoder): each exit 2 with one line naming it, before any model loads."""
    from train.sample import main
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text("family: diffusion\n")
    cases = {(str(tmp_path / "nope"), "x"): f"{tmp_path / 'nope'}: no such folder",
             (str(tmp_path / "run"), "x", "--n", "0"): "--n must be >= 1, got 0",
             (str(tmp_path / "run"), "x", "--steps", "0"): "--steps must be >= 1, got 0",
             (str(tmp_path / "run"), "x", "--decoder", "t.pth"): "--decoder is for a pipeline folder"}
    for argv, message in cases.items():
        assert main(list(argv)) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, (argv, err)

def test_a_runs_samples_take_flux2s_shift_at_their_size(tmp_path, monkeypatch):
    """train/sample.py on a text-to-image run folder (a tiny FLUX.2 at random init): the noise levels its transformer
    sees are diffusers' FlowMatchEulerDiscreteScheduler's with FLUX.2's mu (dynamic shifting, the pipeline's sigmas)
    at the run's size and at --size 32 64; with --shift 2.5 that fixed shift; with --shift none its default grid
    (fp32, 1e-6)."""
    import diffusers
    import numpy as np
    import yaml
    from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu
    from safetensors.torch import save_model

    from parallel_runs import DIFFUSION, TEXT
    from train.sample import main
    from zoo.diffusion.flux2 import Flux2
    from zoo.diffusion.latent import LatentDiffusion
    steps, run = 3, tmp_path / "run"
    cfg = load_run_config(None, [*TEXT, "model.image_size=32", f"model.sample_steps={steps}"], base=DIFFUSION)
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict()))
    torch.manual_seed(0)
    save_model(LatentDiffusion(cfg.model), str(run / "model.safetensors"))
    seen, forward = [], Flux2.forward

    def spy(self, x, c, t, *a):  # the timestep (the noise level) of each step's transformer call
        seen.append(t[0].item())
        return forward(self, x, c, t, *a)
    monkeypatch.setattr(Flux2, "forward", spy)

    def levels(*args):
        seen.clear()
        assert main([str(run), "a prompt", "--out", str(tmp_path / "png"), *args]) == 0
        return torch.tensor(seen)

    def scheduler(mu=None, shift=1.0, grid=True):
        s = diffusers.FlowMatchEulerDiscreteScheduler(shift=shift, use_dynamic_shifting=mu is not None)
        s.set_timesteps(sigmas=np.linspace(1, 1 / steps, steps), mu=mu) if grid else s.set_timesteps(steps)
        return s.timesteps / 1000
    for args, tokens in (((), 2 * 2), (("--size", "32", "64"), 2 * 4)):  # 2x2-patch tokens of the 8x latents
        torch.testing.assert_close(levels(*args), scheduler(compute_empirical_mu(tokens, steps)), rtol=0, atol=1e-6)
    assert Image.open(tmp_path / "png" / "a_prompt-0-0.png").size == (64, 32)
    torch.testing.assert_close(levels("--shift", "2.5"), scheduler(shift=2.5), rtol=0, atol=1e-6)
    torch.testing.assert_close(levels("--shift", "none"), scheduler(grid=False), rtol=0, atol=1e-6)


@pytest.mark.slow
def test_digits_text_trains_three_steps_and_samples_from_its_run_folder(tmp_path):
    """The embedded default, three steps (its autoencoder shortened), writes samples.png; train/sample.py then writes
    PNGs from the run folder with the text encoder the run saved (the prompt cache's reuse: test_reliability.py)."""
    run = [sys.executable, "train/run.py", str(CONFIG), f"train.out_dir={tmp_path / 'run'}", "train.max_steps=3",
           "data.ae_steps=20", "train.progress=false", "model.sample_steps=2", "data.samples_per_class=2",
           f"data.cache_dir={tmp_path / 'cache'}"]  # its own caches: the prompts are encoded here
    p = subprocess.run(run, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    log = (tmp_path / "run" / "log.txt").read_text()
    assert "prompts: encoded 41 prompts" in log and (tmp_path / "run" / "samples.png").is_file()
    p = subprocess.run([sys.executable, "train/sample.py", str(tmp_path / "run"), "a handwritten digit three",
                        "--out", str(tmp_path / "png"), "--n", "2", "--steps", "2"], cwd=ROOT, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    pngs = sorted((tmp_path / "png").glob("*.png"))
    assert [f.name for f in pngs] == ["a_handwritten_digit_three-0-0.png", "a_handwritten_digit_three-0-1.png"]
    assert Image.open(pngs[0]).size == (32, 32)


@pytest.mark.slow
def test_a_sigkilled_text_to_image_run_resumes_bitwise(tmp_path):
    """A tiny text-to-image run SIGKILLed past its first checkpoint and launched again: the losses, the weights and
    the EMA of the uninterrupted run, bit for bit (caption dropout, noise and timesteps drawn per step)."""
    import signal

    import yaml
    from conftest import wait_for_step
    from parallel_runs import DIFFUSION, TEXT, assert_bitwise, curve, launch, run
    cfg = tmp_path / "t2i.yaml"
    cfg.write_text(yaml.safe_dump(DIFFUSION))
    over = [*TEXT, "train.max_steps=8", "train.checkpoint_every=3", "train.samples=false"]
    run(cfg, tmp_path / "full", *over, nproc=0)
    p = launch(cfg, tmp_path / "killed", *over, nproc=0)
    assert wait_for_step(p, tmp_path / "killed", 4), "the run ended before it could be killed"
    p.send_signal(signal.SIGKILL)
    p.wait()
    run(cfg, tmp_path / "killed", *over, nproc=0)
    assert "resumed from" in (tmp_path / "killed" / "log.txt").read_text()
    assert curve(tmp_path / "killed") == curve(tmp_path / "full")
    for name in ("model.safetensors", "model_ema.safetensors"):
        assert_bitwise(tmp_path / "full", tmp_path / "killed", name)


@pytest.mark.slow
def test_a_lora_run_from_a_diffusers_transformer_loads_in_diffusers(tmp_path):
    """digits-text.yaml fine-tuned with LoRA from a diffusers Flux2Transformer2DModel folder (train.init_from): the
    run's adapter/pytorch_lora_weights.safetensors, read by Flux2KleinPipeline.load_lora_weights into that folder's
    transformer, gives what Zoo computes with the same file (fp32, 1e-4), and the trained adapter moves the output."""
    import diffusers

    from test_flux2 import inputs
    from train.loop import train
    from zoo.adapters import adapters_disabled
    from zoo.weights.diffusers_lora import load_lora
    import zoo
    kw = dict(num_layers=2, num_single_layers=2, num_attention_heads=4, attention_head_dim=32,
              axes_dims_rope=(8, 8, 8, 8), in_channels=16, joint_attention_dim=128, guidance_embeds=False)
    torch.manual_seed(0)
    diffusers.Flux2Transformer2DModel(**kw).save_pretrained(tmp_path / "base")
    cfg = load_run_config(str(CONFIG), [f"train.out_dir={tmp_path / 'run'}", f"train.init_from={tmp_path / 'base'}",
                                        "adapter.method=lora", "adapter.alpha=32", "train.max_steps=3",
                                        "optim.lr=1e-2", "data.ae_steps=5", f"data.cache_dir={tmp_path / 'cache'}",
                                        "train.eval_every=0", "train.checkpoint_every=0", "train.samples=false",
                                        "train.progress=false", f"train.device={CPU}"])
    train(cfg, log=lambda m: None)
    lora = tmp_path / "run" / "adapter" / "pytorch_lora_weights.safetensors"
    ref = diffusers.Flux2Transformer2DModel.from_pretrained(tmp_path / "base").eval()
    diffusers.Flux2KleinPipeline(scheduler=None, vae=None, text_encoder=None, tokenizer=None,
                                 transformer=ref).load_lora_weights(lora)
    model = load_lora(zoo.from_pretrained(tmp_path / "base"), lora)
    args = inputs(kw, 5, 2, 2)
    with torch.no_grad():
        got, want = model(**args), ref(**args).sample
        with adapters_disabled(model):
            base = model(**args)
    assert (got - want).abs().max() <= 1e-4 and (got - base).abs().max() > 1e-3, (got - want).abs().max()


@pytest.mark.slow
def test_a_lora_run_from_a_zoo_run_keeps_its_latent_scale_and_samples_with_its_adapter(tmp_path):
    """An adapter run fine-tuned from a Zoo run's weights (train.init_from) on other images standardises its latents
    as the base did (the scale its denoiser learnt, not the new images'), and train/sample.py's generate_run samples
    it as its base with its LoRA file: the same noise gives other images than the base alone."""
    import yaml
    from safetensors.torch import load_model

    import zoo
    from parallel_runs import DIFFUSION, TEXT
    from train.builder import new_task
    from train.loop import train
    from train.sample import generate_run
    cfg_file = tmp_path / "t2i.yaml"
    cfg_file.write_text(yaml.safe_dump(DIFFUSION))
    common = [*TEXT, f"data.cache_dir={tmp_path / 'cache'}", "train.samples=false", "train.ema_decay=null"]
    train(load_run_config(str(cfg_file), [*common, f"train.out_dir={tmp_path / 'base'}"]), log=lambda m: None)
    base = zoo.build(load_run_config(str(tmp_path / "base" / "config.yaml")).model)
    load_model(base, str(tmp_path / "base" / "model.safetensors"))
    ae = zoo.save_pretrained(base.autoencoder, tmp_path / "ae" / "taesd-digits_encoder.safetensors")
    for i, colour in enumerate([(250, 250, 250), (250, 0, 0), (0, 0, 250)]):
        Image.new("RGB", (16, 16), colour).save(tmp_path / f"{i}.png")
        (tmp_path / f"{i}.txt").write_text("a sks square")
    over = [*common, f"train.out_dir={tmp_path / 'lora'}", f"data.dataset={tmp_path}", f"model.autoencoder.weights={ae}",
            f"train.init_from={tmp_path / 'base' / 'model.safetensors'}", "adapter.method=lora", "optim.lr=0.5"]
    cfg = load_run_config(str(cfg_file), over)
    task = new_task(cfg, CPU, "fp32", lambda m: None)
    assert not torch.allclose(task.latent_mean, base.latent_mean)  # the new images' own scale differs
    raw = task.latents.latents("val", slice(0, 1))
    task.build_model()
    assert torch.equal(task.latent_mean, base.latent_mean) and torch.equal(task.latent_std, base.latent_std)
    torch.testing.assert_close(task.z_va, (raw - base.latent_mean.view(1, -1, 1, 1)) / base.latent_std.view(1, -1, 1, 1))
    train(cfg, log=lambda m: None)
    got, alone = (generate_run(tmp_path / r, ["a sks square"], steps=2, seed=0) for r in ("lora", "base"))
    assert (got - alone).abs().max() > 1e-5  # without the LoRA (or with a zero one) they are equal bit for bit


def test_prompts_are_padded_with_the_end_of_text_when_the_tokenizer_has_no_pad_token():
    """A Zoo LLM's sentencepiece tokenizer has EOS but no pad token: model.text_encoder pads its prompts with EOS
    (masked out, as pad tokens are); a tokenizer with neither is a one-line error."""
    from train.data import ByteTokenizer, DataError
    from train.data.conversations import ChatTemplate, prompt_tokens

    class NoPad(ByteTokenizer):
        pad_id, eos_id = None, 7

    ids, mask = prompt_tokens(NoPad(), ChatTemplate.builtin("chatml"), ["hi"], 40)
    n = int(mask.sum())
    assert ids[0, n:].eq(7).all() and ids[0, :n].tolist() == NoPad().encode(
        ChatTemplate.builtin("chatml").render([{"role": "user", "content": "hi"}], True))[:n]
    NoPad.eos_id = None
    with pytest.raises(DataError, match="no pad_token nor an end-of-text token"):
        prompt_tokens(NoPad(), ChatTemplate.builtin("chatml"), ["hi"], 40)
