"""Mixture-of-Depths: a capacity-limited router in front of a pre-norm residual block.

Paper: Raposo et al., "Mixture-of-Depths: Dynamically allocating compute in transformer-based
language models" (2024).

`MixtureOfDepths(block, d_model, capacity)` wraps any residual block `block(x, *per_token) -> x + f(x)`
(or a tuple whose first item is that). A router (linear d_model -> 1, with a bias: the causal
decision's base rate, which does not move the top-k) scores every token;
per sequence, the k = max(1, int(capacity * T)) best-scoring tokens go through the block, gathered in
their original order, with the `per_token` tensors (RoPE's cos and sin tables (T, D), indexed by
position, or (B, T, D) with a row per sequence) gathered at their original positions, and with
`doc_ids` (B, T) when given (the block's document masking), so the block's causal attention and
RoPE see the tokens where they are and in their documents. The top-k is over the whole row, so
the documents of a row share its capacity. The block's update of a routed token is scaled by its router weight
sigmoid(r) and added back to the residual stream; every other token passes through unchanged:

    x_i <- x_i + sigmoid(r_i) * (block(X_routed)_i - x_i)   if token i is in the top-k of its sequence
    x_i <- x_i                                               otherwise

The scaling puts the router on the language-model loss's gradient path. The paper multiplies by
the raw router output; the sigmoid keeps the scale in (0, 1), which lets the threshold below sit
at a fixed logit of 0. k is fixed by T, so every shape is static (it compiles).

Causal decisions. The top-k over a sequence looks at later tokens, which decoding cannot do. The
block keeps one of the paper's two causal decisions, trained beside the top-k (`router`):
- 'aux_loss': a binary cross-entropy on the router logit, target "is this token in the top-k";
  decide "route" when the logit is > `threshold`.
- 'predictor': a small MLP (d_model -> predictor_hidden -> 1, SiLU) on the stop-gradient block
  input, trained with the same cross-entropy; decide "route" when its logit is > `threshold`. The
  router itself learns only through the language-model loss.
The threshold (a buffer, 0 at the start) is set in training and fixed after it: each top-k
forward reports its decision logits in its stats ('decide'); `boundary(decide, k)` is the
midpoint between the n-th and (n+1)-th largest of a batch's decision logits (n = B x k: the
threshold that decides exactly as many tokens as the top-k routes; the logits may be gathered
from several processes), and `update_threshold(boundary, rate)` moves the threshold toward it
(an exponential moving average). The cross-entropy alone, at its small weight, leaves the
decision logits' top-k boundary far below 0 for a long time (with one token in eight routed,
"route nothing" is right 87.5% of the time); a threshold at the boundary makes the decision route
about the top-k's share (docs/llm.md, "Mixture of Depths", compares both).

`forward(x, *per_token, causal=False)` routes by the top-k (training, evaluation);
`causal=True` routes each token by its own decision (decoding): the block runs on every token with
`key_mask=route` (B, T) bool, and must let no query attend to a key outside the mask (other than
itself) and keep the mask in its KV cache, so a skipped token adds nothing the layer's later tokens
can see (zoo/blocks/attention.py does both). When no token of the call is routed (a decoding step
that skips the layer) the block does not run at all; a block returning a tuple says how many items
follow x in its attribute `n_extra`, and a skipped call returns as many Nones in their place. Under
torch.compile that test is a `torch.cond` inside the graph (no graph break), and a causal call
returns the Nones in place of the block's extras whether or not it ran.

Returns (x, *rest, stats): `rest` is what the block returned after x (e.g. a MoE block's routing
statistics); `stats` is a dict of 0-dim tensors, 'aux_loss' (the decision's binary cross-entropy
against the top-k; 0 in causal mode), 'routed' (the fraction of tokens the block processed),
'decided' (the fraction the causal decision routes), 'accuracy' (the fraction of tokens whose
causal decision agrees with the top-k; NaN in causal mode); and with top-k routing 'decide', the
decision logits (B, T), detached.

Shapes: x (B, T, d_model) -> (B, T, d_model); per_token tensors (T, ...) shared by every row, or
(B, T, ...) with as many dims as x, one row per sequence -> gathered (B, k, ...); doc_ids (B, T) ->
(B, k).
Depends on torch only.
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
        # the decision threshold: a fixed logit at inference; in training it follows the top-k's
        # boundary in the decision logits (`update_threshold`), so the decision routes the top-k's share
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
        if self.predictor is None:
            return router_logits
        return self.predictor(x.detach()).squeeze(-1).float()

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
        """The threshold that decides exactly as many tokens of a batch as the top-k routes: the
        midpoint between the n-th and (n+1)-th largest of its decision logits (N, T), n = N x k."""
        n, total = decide.shape[0] * k, decide.numel()
        s = decide.flatten().topk(min(n + 1, total)).values
        return (s[n - 1] + s[n]) / 2 if n < total else s[-1] - 1.0

    @torch.no_grad()
    def update_threshold(self, boundary: torch.Tensor, rate: float):
        """Move the decision threshold toward `boundary` (`boundary` of a training forward's
        decision logits) by the fraction `rate`; called outside forward, so activation checkpointing's
        recomputation does not count a batch twice."""
        self.threshold.lerp_(boundary.to(self.threshold), rate)

    def _empty_rest(self) -> tuple:
        """What the wrapped block returns after x when it does not run: its `n_extra` Nones."""
        return (None,) * getattr(self.block, "n_extra", 0)
