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
Under autocast the matmuls run in the autocast dtype; the log-softmax and sums in fp32.

Shapes: h (N, D), weight (V, D), targets (N,) int64 -> scalar loss.
Depends on torch only.
"""
import torch


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    dev = t.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return t.dtype


def _log_probs(h, w, t, ignore_index):
    """One chunk: log-softmax (n, V) in >= fp32, the summed loss of its valid rows, the
    validity mask and the targets with ignored ones replaced by 0 (safe to index with)."""
    logits = h @ w.t()  # (n, V) in the compute dtype
    logp = torch.log_softmax(logits, dim=-1, dtype=torch.promote_types(logits.dtype, torch.float32))
    valid = t != ignore_index
    safe_t = t.masked_fill(~valid, 0)
    loss = -(logp.gather(1, safe_t[:, None]).squeeze(1) * valid).sum()
    return loss, logp, valid, safe_t


def _loss_and_dlogits(h, w, t, ignore_index, dtype):
    """One chunk: the summed loss of its valid rows, d(loss)/d(logits) = softmax - onehot on
    valid rows (n, V) in `dtype` (rows of ignored targets: softmax, masked by the caller), and
    the validity mask (n,).

    Two formulations of the same math. Eagerly, log_softmax and an in-place exp are the fewest
    full passes over the (n, V) block. Under torch.compile, logsumexp plus one pointwise
    expression (exp(logits - lse) - onehot, the one-hot as a comparison against column
    indices) lets inductor make two fused kernels that never write an fp32 (n, V) block; a
    scatter into the block would instead break the fusion."""
    valid = t != ignore_index
    safe_t = t.masked_fill(~valid, 0)
    if torch.compiler.is_compiling():
        logits = h @ w.t()
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        lse = torch.logsumexp(logits, dim=-1, keepdim=True)
        loss = ((lse.squeeze(1) - logits.gather(1, safe_t[:, None]).squeeze(1)) * valid).sum()
        cols = torch.arange(logits.shape[1], device=logits.device)
        onehot = (cols == safe_t[:, None]) & valid[:, None]
        return loss, (torch.exp(logits - lse) - onehot.to(logits.dtype)).to(dtype), valid
    loss, g, valid, safe_t = _log_probs(h, w, t, ignore_index)
    g = g.exp_().scatter_add_(1, safe_t[:, None], -valid[:, None].to(g.dtype)).to(dtype)
    return loss, g, valid


class _ChunkedLinearCE(torch.autograd.Function):
    """The gradients are made in the forward pass, chunk by chunk, and only scaled in backward."""

    @staticmethod
    def forward(ctx, h, weight, targets, chunk_size: int, ignore_index: int, dtype: torch.dtype):
        ctx.weight_dtype = weight.dtype
        n_valid = (targets != ignore_index).sum().clamp(min=1)
        w = weight.to(dtype)
        grad_h = torch.empty_like(h)
        grad_w = None
        total = 0.0
        with torch.autocast(h.device.type, enabled=False):
            for s in range(0, h.shape[0], chunk_size):
                hc = h[s:s + chunk_size].to(dtype)
                loss, g, valid = _loss_and_dlogits(hc, w, targets[s:s + chunk_size], ignore_index, dtype)
                total = total + loss
                # Ignored rows are zeroed on the small (n, D) operands, and the 1/n_valid of the
                # mean is applied in backward (in fp32, with grad_out).
                mask = valid[:, None].to(dtype)  # (n, 1)
                grad_h[s:s + chunk_size] = (g @ w) * mask
                gw = g.t() @ (hc * mask)  # (V, D)
                grad_w = gw.to(torch.promote_types(gw.dtype, torch.float32)) if grad_w is None else grad_w.add_(gw)
        ctx.save_for_backward(grad_h, grad_w, n_valid)
        return total / n_valid.to(total.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w, n_valid = ctx.saved_tensors
        scale = grad_out / n_valid.to(grad_out.dtype)
        return ((grad_h * scale).to(grad_h.dtype), (grad_w * scale).to(ctx.weight_dtype),
                None, None, None, None)


def chunked_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                          chunk_size: int = 2048, ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy of softmax(h @ weight^T) against targets, chunk by chunk.
    All targets ignored gives 0 (F.cross_entropy would give nan)."""
    if h.dim() != 2 or weight.dim() != 2 or targets.shape != h.shape[:1]:
        raise ValueError(f"expected h (N, D), weight (V, D), targets (N,); got {tuple(h.shape)}, "
                         f"{tuple(weight.shape)}, {tuple(targets.shape)}")
    if h.shape[0] == 0:
        raise ValueError("chunked_cross_entropy: no tokens (h has 0 rows)")
    dtype = _compute_dtype(h)
    if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
        return _ChunkedLinearCE.apply(h, weight, targets, chunk_size, ignore_index, dtype)
    n_valid = (targets != ignore_index).sum().clamp(min=1)
    total = 0.0
    w = weight.to(dtype)
    with torch.autocast(h.device.type, enabled=False):
        for s in range(0, h.shape[0], chunk_size):
            total = total + _log_probs(h[s:s + chunk_size].to(dtype), w, targets[s:s + chunk_size], ignore_index)[0]
    return total / n_valid.to(total.dtype)
