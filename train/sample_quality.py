"""Sample quality of generated images: the Frechet distance, and a trained Zoo classifier as the judge.

Frechet distance (as FID, Heusel et al., "GANs Trained by a Two Time-Scale Update Rule Converge to
a Local Nash Equilibrium", 2017): FD = |mu_a - mu_b|^2 + tr(S_a) + tr(S_b) - 2 tr((S_a S_b)^(1/2)).
"Classifier FD" uses a Zoo ConvNet's penultimate features (not FID, which needs Inception's weights);
"sample accuracy" is the share of samples the classifier labels as asked.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np
import torch

NEGATIVE_TOLERANCE = 1e-10   # eigenvalues of M above -this x the largest are rounding error


def _as_features(x, name: str) -> np.ndarray:
    a = x.detach().cpu().double().numpy() if isinstance(x, torch.Tensor) else np.asarray(x, dtype=np.float64)
    if a.ndim != 2 or a.shape[0] < 2:
        raise ValueError(f"frechet_distance: {name} must be (N >= 2, D) features, got shape {tuple(a.shape)}")
    if not np.isfinite(a).all():
        raise ValueError(f"frechet_distance: {name} holds non-finite values")
    return a


def frechet_distance(a, b) -> float:
    """The Frechet distance between Gaussians fitted to features a (N, D) and b (M, D), in float64."""
    a, b = _as_features(a, "a"), _as_features(b, "b")
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"frechet_distance: features of different sizes, a {a.shape} and b {b.shape}")
    mu_a, mu_b = a.mean(0), b.mean(0)
    s_a, s_b = np.atleast_2d(np.cov(a, rowvar=False)), np.atleast_2d(np.cov(b, rowvar=False))  # N - 1 denominator
    w, v = np.linalg.eigh(s_a)
    root_a = (v * np.sqrt(np.clip(w, 0.0, None))) @ v.T          # S_a^(1/2) (S_a is PSD: its negatives are rounding)
    lam = np.linalg.eigvalsh(root_a @ s_b @ root_a)
    scale = max(float(np.abs(lam).max(initial=0.0)), 1e-300)
    if lam.min(initial=0.0) < -NEGATIVE_TOLERANCE * scale * len(lam):
        raise ValueError(f"frechet_distance: S_a^(1/2) S_b S_a^(1/2) has eigenvalue {lam.min():.3g} (largest "
                         f"{scale:.3g}); covariances give none below zero")
    tr_root = float(np.sqrt(np.clip(lam, 0.0, None)).sum())
    return float(((mu_a - mu_b) ** 2).sum() + np.trace(s_a) + np.trace(s_b) - 2.0 * tr_root)


class Classifier:
    """A trained Zoo ConvNet as the judge of images (N, C, H, W) in [0, 1], normalised as in its training (RGB
    turned grey for one channel): `features` are its final linear layer's input, `logits` its output."""

    def __init__(self, model: torch.nn.Module, mean, std, batch_size: int = 256):
        self.model, self.in_chans = model.eval(), model.config.in_chans
        self.mean = torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1)
        self.batch_size = batch_size
        self.head = model.get_submodule(model.classifier_name)

    @classmethod
    def from_run(cls, run_dir) -> "Classifier":
        """The classifier a ConvNet run of train/run.py wrote to run_dir (its config.yaml, and of its
        weights and EMA weights those with the lower validation loss at the run's final evaluation)."""
        from safetensors.torch import load_model

        import zoo

        from .config import load_run_config
        from .metrics import read_rows
        from .data.images import normalization
        run = Path(run_dir)
        if not (run / "config.yaml").is_file():
            raise FileNotFoundError(f"{run}: not a run folder (no config.yaml)")
        cfg = load_run_config(str(run / "config.yaml"))
        if cfg.family != "convnet":
            raise ValueError(f"{run}: a {cfg.family} run; the judge is a convnet classifier")
        model, weights = zoo.build(cfg.model), run / "model.safetensors"
        if not weights.is_file():
            raise FileNotFoundError(f"{run}: no model.safetensors (has the run finished?)")
        final = ([r for r in read_rows(run) if "val_loss" in r] or [{}])[-1]
        ema, inf = run / "model_ema.safetensors", float("inf")
        if ema.is_file() and final.get("ema_val_loss", inf) < final.get("val_loss", inf):
            weights = ema
        load_model(model, str(weights))
        return cls(model, *normalization(cfg.data, cfg.model.in_chans))

    @torch.no_grad()
    def __call__(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(features (N, F), logits (N, classes)), float32 on the CPU."""
        feats, logits = [], []
        grab = self.head.register_forward_hook(lambda m, inp, out: feats.append(inp[0].float().cpu()))
        try:
            dev = next(self.model.parameters()).device
            for i in range(0, len(images), self.batch_size):
                x = images[i:i + self.batch_size].float().cpu()
                if x.shape[1] == 3 and self.in_chans == 1:
                    x = x.mean(1, keepdim=True)
                logits.append(self.model(((x - self.mean) / self.std).to(dev)).float().cpu())
        finally:
            grab.remove()
        return torch.cat(feats), torch.cat(logits)


def sample_accuracy(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """The fraction of samples the classifier labels as the class they were generated for."""
    return float((logits.argmax(-1).cpu() == labels.cpu()).float().mean())


def judge(classifier: Classifier, images: torch.Tensor, labels: Optional[torch.Tensor],
          reference_features: torch.Tensor) -> dict:
    """{"classifier_fd", "sample_accuracy" (with labels)} of a set of images against the reference."""
    feats, logits = classifier(images)
    out = {"classifier_fd": frechet_distance(feats, reference_features)}
    if labels is not None:
        out["sample_accuracy"] = sample_accuracy(logits, labels)
    return out
