"""Noise schedules, SNR, Min-SNR-gamma loss weights, DDIM / DDPM samplers, classifier-free guidance, learned sigma and
flow matching.

    x_t = sqrt(abar_t) * x_0 + sqrt(1 - abar_t) * eps,    SNR(t) = abar_t / (1 - abar_t)
    flow:  x_s = (1 - s) x_0 + s eps,    target u = eps - x_0,    sampling x_{s'} = x_s + (s' - s) u
Papers: Ho et al., "Denoising Diffusion Probabilistic Models" (2020); Nichol & Dhariwal, "Improved Denoising Diffusion
Probabilistic Models" (2021: cosine betas, learned sigma); Salimans & Ho, "Progressive Distillation" (2022: v
prediction); Hang et al., "Efficient Diffusion Training via Min-SNR Weighting Strategy" (2023); Song et al., "Denoising
Diffusion Implicit Models" (2021); Ho & Salimans, "Classifier-Free Diffusion Guidance" (2022); for flow matching Liu et
al., "Flow Straight and Fast" (2023), Lipman et al., "Flow Matching for Generative Modeling" (2023) and Esser et al.,
"Scaling Rectified Flow Transformers" (2024).

Shapes: x (B, C, H, W); t (B,) int64 timesteps in [0, num_timesteps); per-item weights (B,).
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch

PREDICTIONS = ("eps", "v", "x0")  # and "flow": its own functions below (flow_*)


def betas_for(kind: str, num_timesteps: int, beta_start: float = 1e-4, beta_end: float = 0.02) -> torch.Tensor:
    """(num_timesteps,) float64 betas."""
    T = num_timesteps
    if kind == "linear":
        return torch.linspace(beta_start, beta_end, T, dtype=torch.float64)
    if kind == "scaled_linear":
        return torch.linspace(beta_start ** 0.5, beta_end ** 0.5, T, dtype=torch.float64) ** 2
    if kind == "cosine":
        s = 0.008
        f = lambda t: math.cos((t / T + s) / (1 + s) * math.pi / 2) ** 2  # noqa: E731
        return torch.tensor([min(1 - f(i + 1) / f(i), 0.999) for i in range(T)], dtype=torch.float64)
    raise ValueError(f"unknown beta schedule '{kind}' (known: linear, scaled_linear, cosine)")


def _bcast(v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """(B,) -> (B, 1, 1, ...) in x's dtype, to broadcast against x."""
    return v.to(x.dtype).reshape(-1, *([1] * (x.dim() - 1)))


def guided(model_fn: Callable, x: torch.Tensor, t: torch.Tensor, cond: torch.Tensor, uncond: torch.Tensor,
           scale: float) -> torch.Tensor:
    """Classifier-free guidance: one batched call on [cond; uncond] (labels, or prompt embeddings), combined with
    `scale` (1 = conditional only, 0 = unconditional only)."""
    if scale == 1.0:
        return model_fn(x, t, cond)
    out = model_fn(torch.cat([x, x]), torch.cat([t, t]), torch.cat([cond, uncond]))
    cond, uncond = out.chunk(2)
    return uncond + scale * (cond - uncond)


def min_snr_weight(snr: torch.Tensor, gamma: Optional[float], prediction: str = "eps") -> torch.Tensor:
    """Min-SNR-gamma weights from SNR (any shape); finite at SNR = 0 and SNR = inf."""
    if prediction not in PREDICTIONS:
        raise ValueError(f"prediction must be one of {PREDICTIONS}, got {prediction!r}")
    if gamma is None:
        return torch.ones_like(snr)
    clipped = torch.clamp(snr, max=gamma)                   # min(SNR, g): g at SNR = inf
    if prediction == "eps":
        return torch.clamp(gamma / snr, max=1.0)           # min(SNR, g) / SNR: 1 at SNR = 0
    if prediction == "v":
        return clipped / (snr + 1)                          # 0 at SNR = 0 and at SNR = inf
    return clipped


class NoiseSchedule:
    """The discrete forward process and what the loss and the samplers need from it."""

    def __init__(self, kind: str = "linear", num_timesteps: int = 1000, beta_start: float = 1e-4,
                 beta_end: float = 0.02):
        self.kind, self.num_timesteps = kind, num_timesteps
        self.betas = betas_for(kind, num_timesteps, beta_start, beta_end)
        self.alphas_cumprod = torch.cumprod(1.0 - self.betas, 0)      # float64, CPU
        self._cache: dict = {}

    def _table(self, name: str, device) -> torch.Tensor:
        """float32 tables on `device`, computed in float64; index 0 is t = -1 (no noise)."""
        tables = self._cache.get(device)
        if tables is None:
            a = torch.cat([self.alphas_cumprod.new_ones(1), self.alphas_cumprod])
            tables = {"abar": a, "1-abar": 1 - a, "snr": a / (1 - a)}
            tables = self._cache[device] = {k: v.float().to(device) for k, v in tables.items()}
        return tables[name]

    def abar(self, t: torch.Tensor) -> torch.Tensor:
        """abar_t (float32, on t's device); t < 0 means no noise (abar = 1)."""
        return self._table("abar", t.device)[(t.long() + 1).clamp(min=0)]

    def snr(self, t: torch.Tensor) -> torch.Tensor:
        """SNR(t) = abar / (1 - abar) (computed in float64; inf for t < 0)."""
        return self._table("snr", t.device)[(t.long() + 1).clamp(min=0)]

    def min_snr_weight(self, t: torch.Tensor, gamma: Optional[float], prediction: str = "eps") -> torch.Tensor:
        """(B,) loss weights at timesteps t; gamma None = uniform (all ones)."""
        return min_snr_weight(self.snr(t), gamma, prediction)

    def add_noise(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        a = _bcast(self.abar(t), x0)
        return a.sqrt() * x0 + (1 - a).sqrt() * noise

    def target(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor, prediction: str) -> torch.Tensor:
        if prediction == "eps":
            return noise
        if prediction == "x0":
            return x0
        a = _bcast(self.abar(t), x0)
        return a.sqrt() * noise - (1 - a).sqrt() * x0

    def split(self, out: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor, prediction: str):
        """(x0, eps) implied by the network output `out` at x_t."""
        a = _bcast(self.abar(t), x_t)
        if prediction == "eps":
            return (x_t - (1 - a).sqrt() * out) / a.sqrt(), out
        if prediction == "x0":
            return out, (x_t - a.sqrt() * out) / (1 - a).sqrt()
        return a.sqrt() * x_t - (1 - a).sqrt() * out, a.sqrt() * out + (1 - a).sqrt() * x_t

    def timesteps(self, steps: int) -> list[int]:
        """`steps` timesteps from T-1 down, evenly spaced ('trailing' spacing: the first is T-1)."""
        T = self.num_timesteps
        if not 0 < steps <= T:
            raise ValueError(f"sampling steps must be in [1, {T}], got {steps}")
        return sorted({round(T - i * T / steps) - 1 for i in range(steps)}, reverse=True)

    def ddim_step(self, out, x_t, t, t_prev, prediction="eps", eta=0.0, noise=None):
        """x_{t_prev} from x_t (t_prev = -1: the final, noise-free step)."""
        x0, eps = self.split(out, x_t, t, prediction)
        a, a_prev = _bcast(self.abar(t), x_t), _bcast(self.abar(t_prev), x_t)
        std = eta * ((1 - a_prev) / (1 - a) * (1 - a / a_prev)).sqrt()
        x = a_prev.sqrt() * x0 + (1 - a_prev - std ** 2).clamp(min=0).sqrt() * eps
        if eta > 0:
            if noise is None:
                raise ValueError("ddim_step with eta > 0 needs noise")
            x = x + std * noise
        return x

    def ddpm_step(self, out, x_t, t, t_prev, prediction="eps", noise=None):
        """Ancestral step from the posterior q(x_{t_prev} | x_t, x_0) with variance beta~."""
        x0, _ = self.split(out, x_t, t, prediction)
        a, a_prev = _bcast(self.abar(t), x_t), _bcast(self.abar(t_prev), x_t)
        beta = 1 - a / a_prev                        # the step's beta (strided steps included)
        mean = (a_prev.sqrt() * beta * x0 + (1 - beta).sqrt() * (1 - a_prev) * x_t) / (1 - a)
        var = ((1 - a_prev) / (1 - a) * beta).clamp(min=1e-20)
        if noise is None:
            raise ValueError("ddpm_step needs noise")
        return mean + _bcast((t_prev >= 0).float(), x_t) * var.sqrt() * noise

    @torch.no_grad()
    def sample(self, model_fn: Callable, shape, steps: int = 50, sampler: str = "ddim", eta: float = 0.0,
               prediction: str = "eps", generator: Optional[torch.Generator] = None, device=None,
               dtype=torch.float32, x_T: Optional[torch.Tensor] = None):
        """Run the reverse process from x_T ~ N(0, I) (or the given x_T); model_fn(x, t) -> output."""
        if sampler not in ("ddim", "ddpm"):
            raise ValueError(f"sampler must be 'ddim' or 'ddpm', got {sampler!r}")
        x = torch.randn(shape, generator=generator, device=device, dtype=dtype) if x_T is None else x_T
        ts = self.timesteps(steps)
        for t, t_prev in zip(ts, ts[1:] + [-1]):
            tb, pb = (torch.full((x.shape[0],), v, device=x.device, dtype=torch.long) for v in (t, t_prev))
            out = model_fn(x, tb).to(x.dtype)
            noise = torch.randn(x.shape, generator=generator, device=x.device, dtype=x.dtype) \
                if sampler == "ddpm" or eta > 0 else None
            x = self.ddim_step(out, x, tb, pb, prediction, eta, noise) if sampler == "ddim" else \
                self.ddpm_step(out, x, tb, pb, prediction, noise)
        return x


# -- learned sigma ------------------------------------------------------------------------------

def vlb_term(schedule: "NoiseSchedule", var_out: torch.Tensor, x0_pred: torch.Tensor, x0: torch.Tensor,
             x_t: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """(B,) KL(q(x_{t-1} | x_t, x_0) || p(x_{t-1} | x_t)) in bits per element: p's mean from x0_pred
    (pass it detached), its log-variance from var_out in [-1, 1]; at t = 0 the Gaussian NLL of x_0."""
    a, a_prev = _bcast(schedule.abar(t), x_t), _bcast(schedule.abar(t - 1), x_t)
    beta = 1 - a / a_prev
    post_var = beta * (1 - a_prev) / (1 - a)
    t1 = torch.ones_like(t)                        # beta~ at t = 0 is 0: its log is clipped to beta~_1
    a1, a0 = _bcast(schedule.abar(t1), x_t), _bcast(schedule.abar(t1 - 1), x_t)
    post_var_1 = (1 - a1 / a0) * (1 - a0) / (1 - a1)
    log_post = torch.where(_bcast(t, x_t) > 0, post_var.clamp(min=1e-20).log(), post_var_1.log())
    frac = (var_out.float() + 1) / 2
    logvar_p = frac * beta.log() + (1 - frac) * log_post
    coef_x0, coef_xt = a_prev.sqrt() * beta / (1 - a), (1 - beta).sqrt() * (1 - a_prev) / (1 - a)
    mean_q = coef_x0 * x0 + coef_xt * x_t
    mean_p = coef_x0 * x0_pred.float() + coef_xt * x_t
    kl = 0.5 * (-1.0 + logvar_p - log_post + torch.exp(log_post - logvar_p)  # KL(q || p) of two Gaussians
                + (mean_q - mean_p) ** 2 * torch.exp(-logvar_p)).flatten(1).mean(1)
    nll = (0.5 * (math.log(2 * math.pi) + logvar_p + (x0 - mean_p) ** 2 * torch.exp(-logvar_p))).flatten(1).mean(1)
    return torch.where(t > 0, kl, nll) / math.log(2.0)


# -- flow matching ------------------------------------------------------------------------------

def flow_interpolate(x0: torch.Tensor, noise: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """x_s = (1 - s) x_0 + s eps, s (B,) in [0, 1]."""
    s = _bcast(s, x0)
    return (1 - s) * x0 + s * noise


def flow_target(x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The velocity d x_s / d s = eps - x_0."""
    return noise - x0


def flow_min_snr_weight(s: torch.Tensor, gamma: Optional[float]) -> torch.Tensor:
    """(B,) weights min((1 - s)^2, gamma s^2) of the velocity MSE (gamma None: ones)."""
    return torch.ones_like(s) if gamma is None else torch.minimum((1 - s) ** 2, gamma * s ** 2)


def flow_timesteps(n: int, kind: str = "logit_normal", mean: float = 0.0, std: float = 1.0,
                   generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """(n,) float32 s in (0, 1): sigmoid(N(mean, std)) ("logit_normal") or U(0, 1) ("uniform")."""
    if kind == "logit_normal":
        return torch.sigmoid(mean + std * torch.randn(n, generator=generator))
    if kind == "uniform":
        return torch.rand(n, generator=generator)
    raise ValueError(f"flow timestep sampling must be 'logit_normal' or 'uniform', got {kind!r}")


def flow_sigmas(steps: int, num_train_timesteps: int = 1000) -> torch.Tensor:
    """(steps + 1,) float32 noise levels from 1 down to 1/T, then 0 (diffusers' FlowMatchEuler grid, shift 1)."""
    T = num_train_timesteps
    return torch.cat([torch.linspace(1.0, 1.0 / T, steps, dtype=torch.float64).float(), torch.zeros(1)])


@torch.no_grad()
def flow_sample(model_fn: Callable, x: torch.Tensor, steps: int, num_train_timesteps: int = 1000,
                sigmas: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Euler integration of dx/ds = u from s = 1 (x: the noise) to s = 0 through `sigmas` (default flow_sigmas);
    model_fn(x, s * T) -> u."""
    sig = (flow_sigmas(steps, num_train_timesteps) if sigmas is None else sigmas).tolist()
    for s, s_next in zip(sig[:-1], sig[1:]):
        t = torch.full((x.shape[0],), s * num_train_timesteps, device=x.device, dtype=torch.float32)
        x = (x.float() + (s_next - s) * model_fn(x, t).float()).to(x.dtype)
    return x
