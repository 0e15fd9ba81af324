"""Samplers by name: Zoo's own DDIM, DDPM and flow Euler (schedule.py, no dependency), and diffusers' schedulers
(`DIFFUSERS`) driving any Zoo denoiser. docs/diffusion.md's table of them and their predictions is made from these."""
from __future__ import annotations

import inspect
from typing import Callable, Optional

import torch

from .schedule import NoiseSchedule, flow_sample

OWN = ("ddim", "ddpm", "flow_euler")
DIFFUSERS = {  # name -> (scheduler class, extra kwargs, predictions it takes)
    "dpmpp_2m": ("DPMSolverMultistepScheduler", {"algorithm_type": "dpmsolver++", "solver_order": 2},
                 ("eps", "v", "x0")),
    "euler": ("EulerDiscreteScheduler", {}, ("eps", "v")),
    "euler_a": ("EulerAncestralDiscreteScheduler", {}, ("eps", "v")),
    "unipc": ("UniPCMultistepScheduler", {"solver_order": 2}, ("eps", "v", "x0")),
}
SAMPLERS = OWN + tuple(DIFFUSERS)
_BETAS = {"linear": "linear", "scaled_linear": "scaled_linear", "cosine": "squaredcos_cap_v2"}
_PREDICTION = {"eps": "epsilon", "v": "v_prediction", "x0": "sample"}


def check_sampler(sampler: str, prediction: str) -> Optional[str]:
    """Why `sampler` cannot sample a model trained with `prediction`, or None if it can."""
    if sampler not in SAMPLERS:
        return f"unknown sampler {sampler!r} (known: {', '.join(SAMPLERS)})"
    if (prediction == "flow") != (sampler == "flow_euler"):
        return "flow matching samples with flow_euler only" if prediction == "flow" else \
            f"flow_euler samples flow-matching models only, not prediction={prediction}"
    if sampler in DIFFUSERS and prediction not in DIFFUSERS[sampler][2]:
        return f"{sampler} takes prediction {' or '.join(DIFFUSERS[sampler][2])}, not {prediction}"
    return None


def diffusers_scheduler(sampler: str, schedule: NoiseSchedule, prediction: str, beta_start: float,
                        beta_end: float):
    """The diffusers scheduler `sampler` names, configured from Zoo's noise schedule."""
    try:
        import diffusers
    except ImportError:
        raise ImportError(f"sampler {sampler} runs diffusers' scheduler: pip install -e '.[diffusers]' "
                          f"(ddim, ddpm and flow_euler need nothing)") from None
    name, extra, _ = DIFFUSERS[sampler]
    return getattr(diffusers, name)(num_train_timesteps=schedule.num_timesteps, beta_schedule=_BETAS[schedule.kind],
                                    beta_start=beta_start, beta_end=beta_end, prediction_type=_PREDICTION[prediction],
                                    timestep_spacing="trailing", **extra)


@torch.no_grad()
def sample_with_scheduler(model_fn: Callable, scheduler, x: torch.Tensor, steps: int,
                          generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """diffusers' sampling loop from noise x ~ N(0, I) (scaled by init_noise_sigma here); model_fn(x, t) -> output."""
    scheduler.set_timesteps(steps, device=x.device)
    x = x * getattr(scheduler, "init_noise_sigma", 1.0)
    draws = "generator" in inspect.signature(scheduler.step).parameters     # the stochastic ones
    for t in scheduler.timesteps:
        out = model_fn(scheduler.scale_model_input(x, t), t.expand(x.shape[0]))
        x = scheduler.step(out, t, x, **({"generator": generator} if draws else {})).prev_sample
    return x


@torch.no_grad()
def sample(model_fn: Callable, shape, sampler: str, steps: int, schedule: NoiseSchedule, prediction: str,
           beta_start: float, beta_end: float, eta: float = 0.0, generator: Optional[torch.Generator] = None,
           device=None, dtype=torch.float32, sigmas: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Latents (shape) sampled from noise drawn with `generator` by the named sampler (flow_euler: over `sigmas`,
    default flow_sigmas)."""
    if why := check_sampler(sampler, prediction):
        raise ValueError(why)
    x = torch.randn(shape, generator=generator, device=device, dtype=dtype)
    if sampler in ("ddim", "ddpm"):
        return schedule.sample(model_fn, shape, steps, sampler, eta, prediction, generator, x_T=x)
    if sampler == "flow_euler":
        return flow_sample(model_fn, x, steps, schedule.num_timesteps, sigmas)
    sched = diffusers_scheduler(sampler, schedule, prediction, beta_start, beta_end)
    return sample_with_scheduler(model_fn, sched, x, steps, generator)
