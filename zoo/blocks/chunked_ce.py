"""Chunked linear + cross-entropy: the LM-head loss without ever holding the full logits.

A language model's last step, logits = h @ W^T followed by cross-entropy, would hold a
(N, V) fp32 logits tensor (N = B*T tokens, V = vocabulary) plus its gradient. Here the
tokens are processed `chunk_size` rows at a time: each chunk's logits are made, reduced to
its loss, and turned at once into its gradients with respect to h and W (softmax - onehot),
then dropped. Peak extra memory is one (chunk_size, V) block instead of (N, V); the matmul
work is the same as the plain path (one forward and two gradient matmuls per chunk).
The same idea is known as fused linear cross-entropy (e.g. Wijmans et al., "Cut Your Losses
in Large-Vocabulary Language Models", 2024).

Mean over targets != ignore_index, like torch.nn.functional.cross_entropy.
Under autocast the matmuls run in the autocast dtype; the softmax and sums in fp32.

Shapes: h (N, D), weight (V, D), targets (N,) int64 -> scalar loss.
Depends on torch only.
"""
import torch


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    dev = t.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return t.dtype


def _chunk(h, w, t, ignore_index, want_grad):
    logits = h @ w.t()  # (n, V)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    lse = torch.logsumexp(logits, dim=-1)
    valid = t != ignore_index
    safe_t = torch.where(valid, t, torch.zeros_like(t))
    tgt = logits.gather(1, safe_t[:, None]).squeeze(1)
    loss = ((lse - tgt) * valid).sum()
    if not want_grad:
        return loss, None
    g = (logits - lse[:, None]).exp_()  # softmax
    g.scatter_add_(1, safe_t[:, None], -valid[:, None].to(g.dtype))
    g.mul_(valid[:, None])
    return loss, g


class _ChunkedLinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, targets, chunk_size: int, ignore_index: int, dtype: torch.dtype):
        ctx.weight_dtype = weight.dtype
        n_valid = (targets != ignore_index).sum().clamp(min=1).float()
        w = weight.to(dtype)
        grad_h = torch.empty_like(h)
        acc = torch.promote_types(weight.dtype, torch.float32)
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device)
        total = torch.zeros((), dtype=acc, device=h.device)
        with torch.autocast(h.device.type, enabled=False):
            for s in range(0, h.shape[0], chunk_size):
                hc = h[s:s + chunk_size].to(dtype)
                loss, g = _chunk(hc, w, targets[s:s + chunk_size], ignore_index, True)
                total += loss
                g = g.to(dtype)
                grad_h[s:s + chunk_size] = g @ w
                grad_w += (g.t() @ hc).to(acc)
        ctx.save_for_backward(grad_h, grad_w, n_valid)
        return total / n_valid

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w, n_valid = ctx.saved_tensors
        scale = grad_out / n_valid
        return grad_h * scale.to(grad_h.dtype), (grad_w * scale).to(ctx.weight_dtype), None, None, None, None


def chunked_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                          chunk_size: int = 2048, ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy of softmax(h @ weight^T) against targets, chunk by chunk."""
    if h.dim() != 2 or weight.dim() != 2 or targets.shape != h.shape[:1]:
        raise ValueError(f"expected h (N, D), weight (V, D), targets (N,); got {tuple(h.shape)}, "
                         f"{tuple(weight.shape)}, {tuple(targets.shape)}")
    dtype = _compute_dtype(h)
    if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
        return _ChunkedLinearCE.apply(h, weight, targets, chunk_size, ignore_index, dtype)
    n_valid = (targets != ignore_index).sum().clamp(min=1).float()
    total = torch.zeros((), dtype=torch.promote_types(weight.dtype, torch.float32), device=h.device)
    w = weight.to(dtype)
    with torch.autocast(h.device.type, enabled=False):
        for s in range(0, h.shape[0], chunk_size):
            total += _chunk(h[s:s + chunk_size].to(dtype), w, targets[s:s + chunk_size], ignore_index, False)[0]
    return total / n_valid
