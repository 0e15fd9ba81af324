"""Mixture-of-Depths: a capacity-limited router in front of a pre-norm residual block.

Paper: Raposo et al., "Mixture-of-Depths: Dynamically allocating compute in transformer-based language models" (2024).

`MixtureOfDepths(block, d_model, capacity)` wraps `block(x, *per_token) -> x + f(x)` (or a tuple starting with it). Per
sequence the k = max(1, int(capacity * T)) best-scored tokens go through the block in order, the update scaled by
sigmoid(router logit); the rest pass unchanged (static shapes). The top-k sees later tokens, so a causal decision
(`router`: 'aux_loss' or 'predictor', with a `threshold`) is trained beside it (docs/llm.md, "Mixture of Depths");
`forward(..., causal=True)` routes by it and passes `key_mask` (B, T) to the block.

Returns (x, *rest, stats): `rest` is what the block returned after x; `stats` holds 0-dim tensors 'aux_loss', 'routed',
'decided', 'accuracy' and, with top-k routing, 'decide' (B, T).
Shapes: x (B, T, d_model) -> (B, T, d_model); per_token tensors (T, ...) shared, or (B, T, ...) per row -> gathered
(B, k, ...); doc_ids (B, T) -> (B, k).
"""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

ROUTERS = ("aux_loss", "predictor")


class MixtureOfDepths(nn.Module):
    def __init__(self, block: nn.Module, d_model: int, capacity: float, router: str = "aux_loss",
                 predictor_hidden: Optional[int] = None):
        super().__init__()
        if not 0.0 < capacity <= 1.0:
            raise ValueError(f"capacity must be in (0, 1], got {capacity}")
        if router not in ROUTERS:
            raise ValueError(f"unknown router {router!r} (supported: {', '.join(ROUTERS)})")
        self.block, self.capacity, self.router_kind = block, capacity, router
        self.router = nn.Linear(d_model, 1)
        # the decision threshold: fixed at inference; in training it follows the top-k's boundary
        self.register_buffer("threshold", torch.zeros(()))
        self.predictor = None
        if router == "predictor":
            h = predictor_hidden or max(8, d_model // 8)
            self.predictor = nn.Sequential(nn.Linear(d_model, h), nn.SiLU(), nn.Linear(h, 1))

    def tokens_routed(self, T: int) -> int:
        """k: the tokens per sequence of length T that the block processes (top-k routing)."""
        return max(1, min(T, int(self.capacity * T)))

    def decision_logits(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """The causal decision's logits (B, T): route where > `threshold`."""
        return router_logits if self.predictor is None else self.predictor(x.detach()).squeeze(-1).float()

    @staticmethod
    def _split(out):
        return (out[0], tuple(out[1:])) if isinstance(out, tuple) else (out, ())

    def forward(self, x: torch.Tensor, *per_token: torch.Tensor, causal: bool = False,
                doc_ids: Optional[torch.Tensor] = None, **block_kwargs):
        B, T, D = x.shape
        logits = self.router(x).squeeze(-1).float()  # (B, T)
        decide = self.decision_logits(x, logits)
        if doc_ids is not None:  # the block's document masking: its doc ids are those of the tokens it sees
            block_kwargs["doc_ids"] = doc_ids
        if causal:
            return self._forward_causal(x, per_token, logits, decide, block_kwargs)
        k = self.tokens_routed(T)
        idx = logits.topk(k, dim=-1, sorted=False).indices.sort(dim=-1).values  # (B, k), original order
        idx_d = idx[..., None].expand(B, k, D)
        xs = x.gather(1, idx_d)
        if doc_ids is not None:
            block_kwargs["doc_ids"] = doc_ids.gather(1, idx)
        rows = torch.arange(B, device=x.device)[:, None]
        gathered = (t[rows, idx] if t.dim() == x.dim() else t[idx] for t in per_token)  # per row, or shared
        y, rest = self._split(self.block(xs, *gathered, **block_kwargs))
        w = torch.sigmoid(logits.gather(1, idx))[..., None]
        out = x.scatter_add(1, idx_d, (w * (y - xs)).to(x.dtype))
        topk = torch.zeros_like(logits).scatter_(1, idx, 1.0)
        with torch.no_grad():
            decided = (decide > self.threshold).float()
            stats = {"routed": torch.tensor(k / T, device=x.device), "decided": decided.mean(),
                     "accuracy": (decided == topk).float().mean(), "decide": decide.detach()}
        stats["aux_loss"] = F.binary_cross_entropy_with_logits(decide, topk)
        return (out, *rest, stats)

    def _forward_causal(self, x, per_token, logits, decide, block_kwargs):
        route = decide > self.threshold  # (B, T)
        with torch.no_grad():
            stats = {"aux_loss": torch.zeros((), device=x.device), "routed": route.float().mean(),
                     "decided": route.float().mean(), "accuracy": torch.full((), float("nan"), device=x.device)}

        def run(x):
            y, rest = self._split(self.block(x, *per_token, key_mask=route, **block_kwargs))
            w = torch.sigmoid(logits)[..., None]
            return torch.where(route[..., None], x + (w * (y - x)).to(x.dtype), x), rest

        if torch.compiler.is_compiling():  # one graph: a branch in it, not a graph break per layer
            out = torch.cond(route.any(), lambda x: run(x)[0], torch.clone, (x,))
            return (out, *self._empty_rest(), stats)
        if not bool(route.any()):  # nothing routed: the block (and its cache) is left alone
            return (x, *self._empty_rest(), stats)
        out, rest = run(x)
        return (out, *rest, stats)

    @staticmethod
    @torch.no_grad()
    def boundary(decide: torch.Tensor, k: int) -> torch.Tensor:
        """The threshold that decides as many tokens as the top-k routes: the midpoint between the
        n-th and (n+1)-th largest decision logits (N, T), n = N x k."""
        n, total = decide.shape[0] * k, decide.numel()
        s = decide.flatten().topk(min(n + 1, total)).values
        return (s[n - 1] + s[n]) / 2 if n < total else s[-1] - 1.0

    @torch.no_grad()
    def update_threshold(self, boundary: torch.Tensor, rate: float):
        """Move the threshold toward `boundary` by the fraction `rate`; called outside forward, so
        activation checkpointing's recomputation does not count a batch twice."""
        self.threshold.lerp_(boundary.to(self.threshold), rate)

    def _empty_rest(self) -> tuple:
        """What the wrapped block returns after x when it does not run: its `n_extra` Nones."""
        return (None,) * getattr(self.block, "n_extra", 0)
