"""Samplers by name against diffusers' own sampling loop, and the flow-matching objective by hand.

Samplers: the same DiT weights (Zoo's, and diffusers' DiTTransformer2DModel loaded from Zoo's export),
the same initial noise and generator, the same guidance; the reference loop is written here as
diffusers' DiTPipeline runs it (guidance on the noise channels, learned-sigma channels dropped),
with the scheduler configured here. fp32, max |diff| <= 1e-4 on the final latents.
"""
import functools
import math

import pytest
import torch

from zoo.config import DiffusionConfig, from_dict
from zoo.diffusion.latent import LatentDiffusion
from zoo.diffusion.schedule import flow_min_snr_weight, flow_timesteps

import diffusers

STEPS, GUIDANCE = 5, 2.5
COMMON = dict(num_train_timesteps=1000, beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012,
              timestep_spacing="trailing")
REFERENCE = {  # name -> (diffusers scheduler, its arguments), built independently of zoo/diffusion/samplers.py
    "ddim": lambda p: diffusers.DDIMScheduler(**COMMON, prediction_type=p, clip_sample=False, set_alpha_to_one=True),
    "ddpm": lambda p: diffusers.DDPMScheduler(**COMMON, prediction_type=p, clip_sample=False),
    "dpmpp_2m": lambda p: diffusers.DPMSolverMultistepScheduler(**COMMON, prediction_type=p,
                                                                algorithm_type="dpmsolver++", solver_order=2),
    "euler": lambda p: diffusers.EulerDiscreteScheduler(**COMMON, prediction_type=p),
    "euler_a": lambda p: diffusers.EulerAncestralDiscreteScheduler(**COMMON, prediction_type=p),
    "unipc": lambda p: diffusers.UniPCMultistepScheduler(**COMMON, prediction_type=p, solver_order=2),
    "flow_euler": lambda p: diffusers.FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000),
}


@functools.cache  # one model per (prediction, learn_sigma), shared by the samplers that use it
def model_and_reference(prediction, learn_sigma):
    import tempfile

    import zoo
    cfg = from_dict(DiffusionConfig, {
        "image_size": 16, "num_classes": 3, "autoencoder": {"latent_channels": 4, "channels": 8},
        "denoiser": "dit", "dit": {"depth": 1, "width": 16, "heads": 2, "patch_size": 1, "learn_sigma": learn_sigma},
        "prediction": prediction, "sampler": "flow_euler" if prediction == "flow" else "ddim",
        "min_snr_gamma": None, "schedule": "scaled_linear", "beta_start": 0.00085, "beta_end": 0.012})
    model = LatentDiffusion(cfg).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.denoiser.parameters():
            p.normal_(0, 0.2)
    with tempfile.TemporaryDirectory() as tmp:
        zoo.save_pretrained(model.denoiser, tmp)
        return model, diffusers.DiTTransformer2DModel.from_pretrained(tmp).eval()


@torch.no_grad()
def reference_loop(ref, scheduler, labels, null, C, size, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(len(labels), C, size, size, generator=g)
    scheduler.set_timesteps(STEPS)
    flow = isinstance(scheduler, diffusers.FlowMatchEulerDiscreteScheduler)
    x = x if flow else x * scheduler.init_noise_sigma
    both = torch.cat([labels, torch.full_like(labels, null)])
    for t in scheduler.timesteps:
        inp = torch.cat([x, x]) if flow else scheduler.scale_model_input(torch.cat([x, x]), t)
        out = ref(inp, t.expand(len(both)), both).sample[:, :C]
        cond, uncond = out.chunk(2)
        extra = {} if isinstance(scheduler, diffusers.UniPCMultistepScheduler) else {"generator": g}
        x = scheduler.step(uncond + GUIDANCE * (cond - uncond), t, x, **extra).prev_sample
    return x


@pytest.mark.parametrize("sampler,prediction,learn_sigma", [
    ("ddim", "v", False), ("ddpm", "eps", True), ("dpmpp_2m", "eps", False), ("euler", "v", False),
    ("euler_a", "eps", True), ("unipc", "x0", False), ("flow_euler", "flow", False)])
def test_named_sampler_equals_diffusers_loop(sampler, prediction, learn_sigma):
    model, ref = model_and_reference(prediction, learn_sigma)
    labels = torch.tensor([0, 2])
    ours = model.sample_latents(labels, steps=STEPS, guidance=GUIDANCE, sampler=sampler,
                                generator=torch.Generator().manual_seed(7))
    p = {"eps": "epsilon", "v": "v_prediction", "x0": "sample", "flow": None}[prediction]
    want = reference_loop(ref, REFERENCE[sampler](p), labels, 3, 4, 2, seed=7)
    assert ours.shape == want.shape and torch.isfinite(want).all()
    assert (ours - want).abs().max() <= 1e-4, (ours - want).abs().max()


def test_flow_matching_loss_and_target_by_hand():
    cfg = from_dict(DiffusionConfig, {"image_size": 16, "autoencoder": {"latent_channels": 4, "channels": 8},
                                      "denoiser": "dit", "dit": {"depth": 1, "width": 16, "heads": 2, "patch_size": 1},
                                      "prediction": "flow", "sampler": "flow_euler", "min_snr_gamma": 5.0})
    model = LatentDiffusion(cfg)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.denoiser.parameters():
            p.normal_(0, 0.2)
    z, n = torch.randn(3, 4, 2, 2), torch.randn(3, 4, 2, 2)
    s, y = torch.tensor([0.1, 0.5, 0.93]), torch.tensor([0, 1, 10])
    x_s = torch.stack([(1 - s[i]) * z[i] + s[i] * n[i] for i in range(3)])        # the linear path
    u = model.denoiser(x_s, s * 1000, y)
    mse = torch.stack([((u[i] - (n[i] - z[i])) ** 2).mean() for i in range(3)])  # the velocity target
    assert torch.allclose(model(z, y, s, n, weighted=False), mse, atol=1e-6)
    # Min-SNR's equivalent: the x0-error weighted by min(SNR, 5), SNR = (1 - s)^2 / s^2, x0 = x_s - s u
    snr = (1 - s) ** 2 / s ** 2
    x0_err = torch.stack([((x_s[i] - s[i] * u[i] - z[i]) ** 2).mean() for i in range(3)])
    assert torch.allclose(model(z, y, s, n), torch.minimum(snr, torch.tensor(5.0)) * x0_err, atol=1e-6)
    assert torch.equal(flow_min_snr_weight(s, None), torch.ones(3))


def test_logit_normal_timesteps():
    s = flow_timesteps(20000, "logit_normal", 0.5, 0.8, torch.Generator().manual_seed(0))
    logit = torch.log(s / (1 - s))
    assert 0 < s.min() and s.max() < 1
    assert abs(logit.mean().item() - 0.5) < 0.03 and abs(logit.std().item() - 0.8) < 0.03
    u = flow_timesteps(20000, "uniform", generator=torch.Generator().manual_seed(0))
    assert abs(u.mean().item() - 0.5) < 0.01 and not math.isclose(u.std().item(), 0.8, abs_tol=0.1)
