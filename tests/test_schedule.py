"""Noise schedule, SNR, Min-SNR weights and the DDIM / DDPM steps against diffusers' schedulers.

Tolerances: alphas_cumprod 1e-6 (diffusers computes in fp32, zoo in fp64); one sampler step
max abs diff <= 1e-5 on O(1) inputs (fp32).
"""
import pytest
import torch

from zoo.diffusion.schedule import NoiseSchedule, guided, min_snr_weight

import diffusers

SCHEDULES = [("linear", "linear", 1e-4, 0.02), ("scaled_linear", "scaled_linear", 0.00085, 0.012),
             ("cosine", "squaredcos_cap_v2", 1e-4, 0.02)]
PREDICTIONS = [("eps", "epsilon"), ("v", "v_prediction"), ("x0", "sample")]


@pytest.mark.parametrize("kind,ref_kind,b0,b1", SCHEDULES)
def test_alphas_cumprod_match_diffusers(kind, ref_kind, b0, b1):
    ours = NoiseSchedule(kind, 1000, b0, b1)
    ref = diffusers.DDPMScheduler(num_train_timesteps=1000, beta_schedule=ref_kind, beta_start=b0, beta_end=b1)
    assert (ours.alphas_cumprod - ref.alphas_cumprod.double()).abs().max() < 1e-6


@pytest.mark.parametrize("kind,ref_kind,b0,b1", SCHEDULES)
@pytest.mark.parametrize("gamma", [1.0, 5.0])
def test_snr_and_min_snr_weights_against_diffusers_alphas(kind, ref_kind, b0, b1, gamma):
    ref = diffusers.DDPMScheduler(num_train_timesteps=1000, beta_schedule=ref_kind, beta_start=b0, beta_end=b1)
    abar = torch.cumprod(1 - ref.betas.double(), 0)   # diffusers' betas, in fp64: its fp32 table is
    assert torch.allclose(abar, ref.alphas_cumprod.double(), atol=1e-6)  # too coarse for SNR near abar = 1
    snr = abar / (1 - abar)
    clipped = torch.minimum(snr, torch.full_like(snr, gamma))
    expected = {"eps": clipped / snr, "v": clipped / (snr + 1), "x0": clipped}
    ours = NoiseSchedule(kind, 1000, b0, b1)
    t = torch.arange(1000)
    assert torch.allclose(ours.snr(t).double(), snr, rtol=1e-5)
    for pred, want in expected.items():
        got = ours.min_snr_weight(t, gamma, pred).double()
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-6), pred
    assert torch.equal(ours.min_snr_weight(t, None, "eps"), torch.ones(1000))


def test_min_snr_weights_finite_at_zero_and_infinite_snr():
    snr = torch.tensor([0.0, 1e-30, 1.0, 1e30, float("inf")])
    for pred, at_zero, at_inf in [("eps", 1.0, 0.0), ("v", 0.0, 0.0), ("x0", 0.0, 5.0)]:
        w = min_snr_weight(snr, 5.0, pred)
        assert torch.isfinite(w).all(), pred
        assert w[0].item() == pytest.approx(at_zero) and w[-1].item() == pytest.approx(at_inf), pred
    with pytest.raises(ValueError, match="prediction"):
        min_snr_weight(snr, 5.0, "epsilon")


@pytest.mark.parametrize("pred,ref_pred", PREDICTIONS)
@pytest.mark.parametrize("eta", [0.0, 0.6])
def test_ddim_step_matches_diffusers(pred, ref_pred, eta):
    ref = diffusers.DDIMScheduler(num_train_timesteps=1000, beta_schedule="linear", clip_sample=False,
                                  set_alpha_to_one=True, prediction_type=ref_pred)
    ref.set_timesteps(50)
    ours = NoiseSchedule("linear", 1000)
    g = torch.Generator().manual_seed(0)
    x, out, noise = (torch.randn(3, 4, 8, 8, generator=g) for _ in range(3))
    for t in (ref.timesteps[0].item(), ref.timesteps[17].item(), ref.timesteps[-1].item()):
        want = ref.step(out, t, x, eta=eta, variance_noise=noise).prev_sample
        tb = torch.full((3,), t)
        got = ours.ddim_step(out, x, tb, tb - 1000 // 50, pred, eta, noise)
        assert (got - want).abs().max() <= 1e-5, (t, (got - want).abs().max())


@pytest.mark.parametrize("pred,ref_pred", PREDICTIONS)
def test_ddpm_step_matches_diffusers(pred, ref_pred):
    ref = diffusers.DDPMScheduler(num_train_timesteps=1000, beta_schedule="linear", clip_sample=False,
                                  prediction_type=ref_pred, variance_type="fixed_small")
    ref.set_timesteps(50)
    ours = NoiseSchedule("linear", 1000)
    g = torch.Generator().manual_seed(1)
    x, out = torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 4, 8, 8, generator=g)
    for t in (ref.timesteps[0].item(), ref.timesteps[30].item(), ref.timesteps[-1].item()):
        want = ref.step(out, t, x, generator=torch.Generator().manual_seed(7)).prev_sample
        noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(7))  # the draw diffusers made
        tb = torch.full((2,), t)
        got = ours.ddpm_step(out, x, tb, tb - 1000 // 50, pred, noise)
        assert (got - want).abs().max() <= 1e-5, (t, (got - want).abs().max())


def _toy_model(x, t):
    return 0.5 * x + 1e-3 * t.float().view(-1, 1, 1, 1)


def test_eta_zero_sampling_is_deterministic_and_eta_positive_is_not():
    s = NoiseSchedule("cosine", 1000)
    x_T = torch.randn(2, 4, 4, 4, generator=torch.Generator().manual_seed(0))
    runs = [s.sample(_toy_model, x_T.shape, steps=10, eta=0.0, x_T=x_T.clone(),
                     generator=torch.Generator().manual_seed(seed)) for seed in (1, 2)]
    assert torch.equal(runs[0], runs[1])
    noisy = [s.sample(_toy_model, x_T.shape, steps=10, eta=1.0, x_T=x_T.clone(),
                      generator=torch.Generator().manual_seed(seed)) for seed in (1, 2)]
    assert not torch.allclose(noisy[0], noisy[1])
    ddpm = [s.sample(_toy_model, x_T.shape, steps=10, sampler="ddpm", x_T=x_T.clone(),
                     generator=torch.Generator().manual_seed(3)) for _ in range(2)]
    assert torch.equal(ddpm[0], ddpm[1])                       # same generator seed: reproducible


def test_timesteps_trailing_spacing():
    s = NoiseSchedule("linear", 1000)
    ts = s.timesteps(50)
    assert len(ts) == 50 and ts[0] == 999 and ts == sorted(ts, reverse=True) and ts[-1] >= 0
    assert s.timesteps(1000) == list(range(999, -1, -1))
    with pytest.raises(ValueError, match="steps"):
        s.timesteps(0)


def test_classifier_free_guidance_combines_cond_and_uncond():
    def model(x, t, y):
        return x * (y.float() + 1).view(-1, 1, 1, 1)

    x, t, y = torch.randn(3, 2, 4, 4), torch.zeros(3, dtype=torch.long), torch.tensor([0, 1, 2])
    cond, uncond = model(x, t, y), model(x, t, torch.full_like(y, 10))
    assert torch.allclose(guided(model, x, t, y, torch.full_like(y, 10), 3.0), uncond + 3.0 * (cond - uncond))
    assert torch.equal(guided(model, x, t, y, torch.full_like(y, 10), 1.0), cond)
