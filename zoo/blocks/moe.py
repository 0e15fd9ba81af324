"""Mixture-of-Experts feed-forward: a token-choice top-k router over a bank of SwiGLU experts,
dropless by default, with optional always-on shared experts.

Papers: Shazeer et al., "Outrageously Large Neural Networks: The Sparsely-Gated
Mixture-of-Experts Layer" (2017); Fedus et al., "Switch Transformers" (2021: load-balancing
loss, capacity factor); Zoph et al., "ST-MoE: Designing Stable and Transferable Sparse Expert
Models" (2022: router z-loss); Gale et al., "MegaBlocks: Efficient Sparse Training with
Mixture-of-Experts" (2022: dropless grouped computation); Jiang et al., "Mixtral of Experts"
(2024); Qwen Team, "Qwen2 Technical Report" (2024: gated shared expert); DeepSeek-AI,
"DeepSeek-V3 Technical Report" (2024: sigmoid scores, auxiliary-loss-free balancing bias); OpenAI,
"gpt-oss-120b & gpt-oss-20b Model Card" (2025: `bias` on the router and experts, `swiglu_limit` L: the
SwiGLU clamped, gate min(g, L) * sigmoid(1.702 gate) * (clamp(u, -L, L) + 1)). DeepSeek-V3's group-limited
routing: `n_groups` groups of experts, only those of the `topk_groups` groups whose two best scores sum
highest chosen; the weights times `routed_scale`. Google DeepMind, Gemma 4 model card (2026): `router_norm`, the
router reading RMSNorm(x) (no gain) times a learned scale (D,) and D^-1/2, the chosen weights times a learned
per-expert scale (E,); `branch_norms`, the shared experts (Gemma 4's dense MLP) and the routed ones each between
RMSNorms of their own, y = post_s(shared(pre_s(x))) + post_r(routed(pre_r(x))), the router reading x itself.
`act`: the gate activation of the experts and the shared experts (silu: SwiGLU; gelu_tanh: GeGLU).

    y = sum_j w_j * expert_{e_j}(x) [+ sigmoid(x W_g^T) * shared(x)]
Experts are stacked `gate_up` (E, 2F, D) and `down` (E, D, F), run by grouped matmuls ('grouped')
or per expert ('loop'); `capacity_factor` None is dropless (it, `jitter`, `dispatch`: may be set after building).
`stats`: 'lb_loss', 'z_loss' (unweighted), 'load' (E,), 'dropped'; `update_bias(load, rate)` is DeepSeek-V3's bias step.

Shapes: x (B, T, D) or (N, D) -> y of the same shape, and `stats`, a dict of tensors.
Needs: mlp.py, norm.py (the shared experts are one SwiGLU, `branch_norms` RMSNorms; copy them beside this file).
"""
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

try:
    from .mlp import SwiGLU, gated
    from .norm import RMSNorm
except ImportError:  # copied next to mlp.py and norm.py, outside the zoo package
    from mlp import SwiGLU, gated
    from norm import RMSNorm

DISPATCH = ("auto", "grouped", "loop")
DECODE_ROWS = 2  # tokens up to which a compiled CPU forward uses the fused-reduction experts


def grouped_mm_supported(device: torch.device, dtype: torch.dtype, compiling: bool = False) -> bool:
    """Whether torch.nn.functional.grouped_mm runs for (device, dtype): CPU in fp32, bf16 and fp16
    (inside torch.compile bf16 and fp16 only), CUDA in bf16 from compute capability 8.0."""
    if not hasattr(F, "grouped_mm"):
        return False
    if device.type == "cpu":
        return dtype in (torch.bfloat16, torch.float16) or (dtype == torch.float32 and not compiling)
    if device.type == "cuda":
        return dtype == torch.bfloat16 and torch.cuda.get_device_capability(device) >= (8, 0)
    return False


@torch.compiler.disable
def _grouped_mm_eager(a, b, offs):
    return F.grouped_mm(a, b, offs=offs)


def grouped_linear(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """x (S, K) sorted by group, w (G, N, K) in nn.Linear layout, offs (G,) int32 group ends ->
    (S, N), row i multiplied by w[g]^T for the group g it lies in. Rows at or past offs[-1] are
    left undefined (the caller masks them)."""
    if torch.compiler.is_compiling() and not grouped_mm_supported(x.device, x.dtype, compiling=True):
        return _grouped_mm_eager(x, w.transpose(-2, -1), offs)
    return F.grouped_mm(x, w.transpose(-2, -1), offs=offs)


def loop_linear(x: torch.Tensor, w: torch.Tensor, counts: list) -> torch.Tensor:
    """The per-expert fallback of `grouped_linear`: counts[g] rows per group; rows past them zeros."""
    outs, start = [], 0
    for g, n in enumerate(counts):
        if n:
            outs.append(x[start:start + n] @ w[g].t())
        start += n
    rest = x.shape[0] - start
    if rest or not outs:
        outs.append(x.new_zeros(rest, w.shape[1]))
    return torch.cat(outs)


class MoE(nn.Module):
    def __init__(self, dim: int, hidden: int, n_experts: int, top_k: int, scoring: str = "softmax",
                 norm_topk_prob: bool = True, n_shared: int = 0, shared_hidden: Optional[int] = None,
                 shared_gate: bool = False, capacity_factor: Optional[float] = None,
                 bias_balancing: bool = False, jitter: float = 0.0, dispatch: str = "auto", bias: bool = False,
                 swiglu_limit: Optional[float] = None, n_groups: int = 1, topk_groups: int = 1,
                 routed_scale: float = 1.0, act: str = "silu", router_norm: bool = False,
                 branch_norms: bool = False, eps: float = 1e-6):
        super().__init__()
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k={top_k} must be in [1, n_experts={n_experts}]")
        if scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"scoring must be 'softmax' or 'sigmoid', got {scoring!r}")
        if dispatch not in DISPATCH:
            raise ValueError(f"dispatch must be one of {', '.join(DISPATCH)}, got {dispatch!r}")
        if branch_norms and not n_shared:
            raise ValueError("branch_norms needs n_shared > 0 (the shared branch)")
        if capacity_factor is not None and capacity_factor <= 0:
            raise ValueError(f"capacity_factor must be > 0 or None, got {capacity_factor}")
        self.dim, self.hidden, self.n_experts, self.top_k = dim, hidden, n_experts, top_k
        self.scoring, self.norm_topk_prob = scoring, norm_topk_prob
        self.capacity_factor, self.jitter, self.dispatch = capacity_factor, jitter, dispatch
        if n_experts % n_groups or not 1 <= topk_groups <= n_groups:
            raise ValueError(f"n_groups={n_groups} must divide n_experts={n_experts}, topk_groups={topk_groups} in [1, n_groups]")
        self.swiglu_limit, self.n_groups, self.topk_groups, self.routed_scale = swiglu_limit, n_groups, topk_groups, routed_scale
        self.act, self.eps = act, eps
        self.router = nn.Linear(dim, n_experts, bias=bias)
        self.gate_up = nn.Parameter(torch.empty(n_experts, 2 * hidden, dim))
        self.down = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.gate_up_bias = nn.Parameter(torch.zeros(n_experts, 2 * hidden)) if bias else None
        self.down_bias = nn.Parameter(torch.zeros(n_experts, dim)) if bias else None
        self.shared = SwiGLU(dim, n_shared * (shared_hidden or hidden), act=act) if n_shared else None
        # router_norm: the router's input gain and the chosen experts' scales
        self.router_scale = nn.Parameter(torch.ones(dim)) if router_norm else None
        self.expert_scale = nn.Parameter(torch.ones(n_experts)) if router_norm else None
        for name in ("shared_norm", "shared_post_norm", "routed_norm", "routed_post_norm"):
            setattr(self, name, RMSNorm(dim, eps) if branch_norms else nn.Identity())
        self.shared_gate = nn.Linear(dim, 1, bias=False) if n_shared and shared_gate else None
        # bias_balancing: persistent, so that a checkpoint resumes with the same routing
        self.register_buffer("score_bias", torch.zeros(n_experts) if bias_balancing else None)
        self.reset_parameters()

    def reset_parameters(self):
        """nn.Linear's default init, expert by expert."""
        for w in (self.gate_up, self.down):
            bound = 1 / math.sqrt(w.shape[-1])
            nn.init.uniform_(w, -bound, bound)

    # ------------------------------------------------------------------ routing
    def route(self, x: torch.Tensor):
        """x (N, D) -> logits (N, E) fp32, weights (N, k) fp32, experts (N, k) int64, probs (N, E)
        fp32 (the per-token distribution the load-balancing loss uses)."""
        if self.router_scale is not None:
            x = F.rms_norm(x.float(), (self.dim,), None, self.eps).to(x.dtype) * self.router_scale.to(x.dtype) \
                * self.dim ** -0.5
        logits = self.router(x).float()
        scores = logits.softmax(-1) if self.scoring == "softmax" else logits.sigmoid()
        choice = scores if self.score_bias is None else scores + self.score_bias
        if self.n_groups > 1:  # group-limited: only experts of the groups with the best two scores summed
            G = self.n_groups
            best = choice.view(-1, G, self.n_experts // G).topk(2, dim=-1).values.sum(-1)  # (N, G)
            keep = torch.zeros_like(best, dtype=torch.bool).scatter_(1, best.topk(self.topk_groups, dim=-1).indices, True)
            choice = choice.masked_fill(~keep.repeat_interleave(self.n_experts // G, dim=1), float("-inf"))
        experts = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(-1, experts)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        if self.routed_scale != 1.0:
            weights = weights * self.routed_scale
        if self.expert_scale is not None:
            weights = weights * self.expert_scale[experts].float()
        probs = scores if self.scoring == "softmax" else scores / scores.sum(-1, keepdim=True)
        return logits, weights, experts, probs

    @torch.no_grad()
    def update_bias(self, load: torch.Tensor, rate: float):
        """DeepSeek-V3's loss-free balancing: under-loaded experts' bias up by `rate`, over-loaded ones' down."""
        if self.score_bias is None:
            raise RuntimeError("update_bias needs MoE(..., bias_balancing=True)")
        load = load.float()
        self.score_bias += rate * torch.sign(load.mean() - load)

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor):
        shape = x.shape
        if self.training and self.jitter > 0:  # Mixtral's router_jitter_noise: on the experts' input too
            x = x * torch.empty_like(x).uniform_(1.0 - self.jitter, 1.0 + self.jitter)
        x = x.reshape(-1, shape[-1])
        N, E, k = x.shape[0], self.n_experts, self.top_k
        logits, weights, experts, probs = self.route(x)

        # (token, choice) pairs in choice-major order (all first choices, then all second ones),
        # so that under a capacity the first choices and the earlier tokens are served first
        flat = experts.t().reshape(-1)
        w_flat = weights.t().reshape(-1)
        counts = torch.zeros(E, dtype=torch.long, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
        sorted_e, order = torch.sort(flat, stable=True)
        kept, keep = counts, None
        if self.capacity_factor is not None and self.training:
            cap = math.ceil(self.capacity_factor * N * k / E)
            starts = counts.cumsum(0) - counts
            keep = torch.arange(N * k, device=x.device) - starts[sorted_e] < cap
            # the dropped pairs move behind all the kept ones (which stay sorted by expert)
            _, again = torch.sort(sorted_e + E * (~keep).long(), stable=True)
            order, keep = order[again], keep[again]
            kept = counts.clamp(max=cap)
        token = order % N
        y = self._experts(self.routed_norm(x), token, sorted_e if keep is None else flat[order], kept, keep).float()
        if keep is not None:  # before the weights: the dropped rows hold undefined values
            y = torch.where(keep[:, None], y, 0.0)
        y = y * w_flat[order, None]
        # back to choice-major order, then each token's top_k contributions summed in fp32
        y = torch.empty_like(y).index_copy_(0, order, y).view(k, N, -1).sum(0)  # order is a permutation
        dt = self._dtype(x)
        y = self.routed_post_norm(y.to(dt))
        if self.shared is not None:
            s = self.shared(self.shared_norm(x))
            if self.shared_gate is not None:
                s = torch.sigmoid(self.shared_gate(x)) * s
            y = y + self.shared_post_norm(s).to(dt)

        f = counts.float() / N
        stats = {"load": counts.float(),
                 "lb_loss": E * (f * probs.mean(0)).sum(),
                 "z_loss": torch.logsumexp(logits, -1).pow(2).mean(),
                 "dropped": (counts - kept).sum().float()}
        return y.view(*shape[:-1], -1), stats

    @staticmethod
    def _dtype(x):
        dev = x.device.type
        return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype

    def _glu(self, h: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """The gate_up rows h (S, 2F) of experts e (S,) -> the activations (S, F): SwiGLU, or the clamped one."""
        if self.gate_up_bias is not None:
            h = h + self.gate_up_bias[e].to(h.dtype)
        g, u = h.chunk(2, dim=-1)
        if self.swiglu_limit is None:
            return gated(g, u, self.act)
        g, u = g.clamp(max=self.swiglu_limit), u.clamp(-self.swiglu_limit, self.swiglu_limit)
        return g * torch.sigmoid(1.702 * g) * (u + 1)

    def _out(self, y: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        return y if self.down_bias is None else y + self.down_bias[e].to(y.dtype)

    def _experts(self, x, token, sorted_e, kept, keep):
        """The gated experts on the gathered tokens x[token] (S, D), grouped by expert (row i
        for expert sorted_e[i]): kept[e] rows for expert e, then the dropped rows (if any).
        Returns (S, D) in the compute dtype."""
        dt = self._dtype(x)
        xs = x[token].to(dt)
        if keep is None and x.shape[0] <= DECODE_ROWS and x.device.type == "cpu" and torch.compiler.is_compiling():
            gate_up = self.gate_up[sorted_e].to(dt)  # (S, 2F, D): fused into the reduction, never made
            h = (xs[:, None, :] * gate_up).sum(-1, dtype=torch.float32).to(dt)
            a = self._glu(h, sorted_e)
            return self._out((a[:, None, :] * self.down[sorted_e].to(dt)).sum(-1, dtype=torch.float32).to(dt), sorted_e)
        gate_up, down = self.gate_up.to(dt), self.down.to(dt)
        mode = self.dispatch
        if mode == "auto":
            mode = "grouped" if grouped_mm_supported(x.device, dt) else "loop"
        if mode == "grouped":
            if keep is not None:  # rows past the kept ones are left undefined: zero their gradient
                xs = xs.masked_fill(~keep[:, None], 0.0)
            offs = kept.cumsum(0).to(torch.int32)
            return self._out(grouped_linear(self._glu(grouped_linear(xs, gate_up, offs), sorted_e), down, offs), sorted_e)
        counts = kept.tolist()  # the loop needs the group sizes on the host
        return self._out(loop_linear(self._glu(loop_linear(xs, gate_up, counts), sorted_e), down, counts), sorted_e)

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, hidden={self.hidden}, n_experts={self.n_experts}, top_k={self.top_k}, "
                f"scoring={self.scoring}, capacity_factor={self.capacity_factor}")
