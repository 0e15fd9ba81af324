"""Chunked linear + cross-entropy: the LM-head loss without ever holding the full logits.

`chunk_size` rows of logits at a time are made, reduced to their loss and turned into their gradients with respect to
h and W, then dropped: one (chunk_size, V) block at most, the same matmul work (fused linear cross-entropy, e.g.
Wijmans et al., "Cut Your Losses in Large-Vocabulary Language Models", 2024). Mean over targets != ignore_index, like
F.cross_entropy. Knowledge distillation the same way (`chunked_distillation_loss`; `distillation_loss` on full logits).

Shapes: h (N, D), weight (V, D), targets (N,) int64 -> scalar loss; a teacher's hidden states (N, Dt), LM head (V, Dt).
"""
import torch


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype work on `t` runs in: autocast's on its device when on, else its own."""
    dev = t.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else t.dtype


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
    """One chunk: the summed loss of its valid rows, d(loss)/d(logits) = softmax - onehot (n, V) in
    `dtype`, and the validity mask (n,). Written two ways: eagerly the fewest passes over the block;
    under torch.compile one pointwise expression that inductor fuses without an fp32 (n, V) block."""
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


def _chunk_grads(h, w, chunk_size: int, dtype, chunk):
    """Over the rows of h, `chunk_size` at a time: chunk(start, h_chunk) -> (summed loss, d(loss)/d(logits)
    (n, V), validity mask (n,)) turned into the gradients of h and w. Returns (total loss, grad_h,
    grad_w), not yet divided by the number of valid rows."""
    grad_h = torch.empty_like(h)
    grad_w, total = None, 0.0
    with torch.autocast(h.device.type, enabled=False):
        for s in range(0, h.shape[0], chunk_size):
            hc = h[s:s + chunk_size].to(dtype)
            loss, g, valid = chunk(s, hc)
            total = total + loss
            # Ignored rows are zeroed on the small (n, D) operands, and the 1/n_valid of the
            # mean is applied in backward (in fp32, with grad_out).
            mask = valid[:, None].to(dtype)  # (n, 1)
            grad_h[s:s + chunk_size] = (g @ w) * mask
            gw = g.t() @ (hc * mask)  # (V, D)
            grad_w = gw.to(torch.promote_types(gw.dtype, torch.float32)) if grad_w is None else grad_w.add_(gw)
    return total, grad_h, grad_w


class _ChunkedLinearCE(torch.autograd.Function):
    """The gradients are made in the forward pass, chunk by chunk, and only scaled in backward."""

    @staticmethod
    def forward(ctx, h, weight, targets, chunk_size: int, ignore_index: int, dtype: torch.dtype):
        ctx.weight_dtype = weight.dtype
        n_valid = (targets != ignore_index).sum().clamp(min=1)
        w = weight.to(dtype)
        total, grad_h, grad_w = _chunk_grads(h, w, chunk_size, dtype, lambda s, hc: _loss_and_dlogits(
            hc, w, targets[s:s + chunk_size], ignore_index, dtype))
        ctx.save_for_backward(grad_h, grad_w, n_valid)
        ctx.n_other = 4  # the inputs after h and weight: no gradients
        return total / n_valid.to(total.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w, n_valid = ctx.saved_tensors
        scale = grad_out / n_valid.to(grad_out.dtype)
        return ((grad_h * scale).to(grad_h.dtype), (grad_w * scale).to(ctx.weight_dtype)) + (None,) * ctx.n_other


def chunked_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                          chunk_size: int = 2048, ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy of softmax(h @ weight^T) against targets, chunk by chunk (0 if all ignored)."""
    if h.dim() != 2 or weight.dim() != 2 or targets.shape != h.shape[:1]:
        raise ValueError(f"expected h (N, D), weight (V, D), targets (N,); got {tuple(h.shape)}, "
                         f"{tuple(weight.shape)}, {tuple(targets.shape)}")
    if h.shape[0] == 0:
        raise ValueError("chunked_cross_entropy: no tokens (h has 0 rows)")
    dtype = compute_dtype(h)
    if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
        return _ChunkedLinearCE.apply(h, weight, targets, chunk_size, ignore_index, dtype)
    n_valid = (targets != ignore_index).sum().clamp(min=1)
    total = 0.0
    w = weight.to(dtype)
    with torch.autocast(h.device.type, enabled=False):
        for s in range(0, h.shape[0], chunk_size):
            total = total + _log_probs(h[s:s + chunk_size].to(dtype), w, targets[s:s + chunk_size], ignore_index)[0]
    return total / n_valid.to(total.dtype)


# ---------------------------------------------------------------- knowledge distillation
def distillation_loss(logits: torch.Tensor, teacher_logits: torch.Tensor, targets: torch.Tensor, alpha: float,
                      temperature: float, ignore_index: int = -100) -> torch.Tensor:
    """Knowledge distillation (Hinton et al., "Distilling the Knowledge in a Neural Network", 2015):
    alpha * T^2 * KL(softmax(teacher / T) || softmax(student / T)) + (1 - alpha) * cross-entropy, the
    mean over rows whose target is not ignore_index. logits, teacher_logits (N, V); targets (N,) -> scalar."""
    s, t = logits.float(), teacher_logits.detach().float()
    valid = targets != ignore_index
    n = valid.sum().clamp(min=1)
    ce = torch.nn.functional.cross_entropy(s, targets, ignore_index=ignore_index, reduction="sum")
    log_t = torch.log_softmax(t / temperature, dim=-1)
    kl = (log_t.exp() * (log_t - torch.log_softmax(s / temperature, dim=-1))).sum(-1)
    return ((1 - alpha) * ce + alpha * temperature ** 2 * (kl * valid).sum()) / n


def _kd_chunk(h, w, t, th, tw, alpha, T, ignore_index, dtype):
    """One chunk: its summed loss, d(loss)/d(student logits) (n, V) in `dtype`, and the validity mask."""
    valid = t != ignore_index
    safe_t = t.masked_fill(~valid, 0)
    f32 = torch.promote_types(dtype, torch.float32)
    s = (h @ w.t()).to(f32)
    z = (th @ tw.t()).to(f32)
    logp = torch.log_softmax(s, dim=-1)
    log_sT, log_tT = torch.log_softmax(s / T, dim=-1), torch.log_softmax(z / T, dim=-1)
    p_tT = log_tT.exp()
    ce = -(logp.gather(1, safe_t[:, None]).squeeze(1) * valid).sum()
    kl = ((p_tT * (log_tT - log_sT)).sum(-1) * valid).sum()
    g = (1 - alpha) * logp.exp_().scatter_add_(1, safe_t[:, None], -valid[:, None].to(f32))
    g += (alpha * T) * (log_sT.exp_() - p_tT)
    return (1 - alpha) * ce + alpha * T * T * kl, g.to(dtype), valid


class _ChunkedLinearKD(_ChunkedLinearCE):
    """As _ChunkedLinearCE (its backward): each chunk's gradients are made in the forward pass."""

    @staticmethod
    def forward(ctx, h, weight, targets, teacher_h, teacher_weight, alpha, T, chunk_size, ignore_index, dtype):
        ctx.weight_dtype = weight.dtype
        n_valid = (targets != ignore_index).sum().clamp(min=1)
        w, tw = weight.to(dtype), teacher_weight.to(dtype)
        total, grad_h, grad_w = _chunk_grads(h, w, chunk_size, dtype, lambda s, hc: _kd_chunk(
            hc, w, targets[s:s + chunk_size], teacher_h[s:s + chunk_size].to(dtype), tw, alpha, T, ignore_index, dtype))
        ctx.save_for_backward(grad_h, grad_w, n_valid)
        ctx.n_other = 8
        return total / n_valid.to(total.dtype)


def chunked_distillation_loss(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                              teacher_h: torch.Tensor, teacher_weight: torch.Tensor, alpha: float,
                              temperature: float, chunk_size: int = 2048, ignore_index: int = -100) -> torch.Tensor:
    """`distillation_loss` of h @ weight^T against teacher_h @ teacher_weight^T, chunk by chunk: h (N, D),
    weight (V, D), targets (N,), teacher_h (N, Dt), teacher_weight (V, Dt) -> scalar; no teacher grad."""
    if teacher_h.shape[0] != h.shape[0] or teacher_weight.shape[0] != weight.shape[0]:
        raise ValueError(f"teacher shapes {tuple(teacher_h.shape)}, {tuple(teacher_weight.shape)} do not match the "
                         f"student's {tuple(h.shape)}, {tuple(weight.shape)} (same tokens, same vocabulary)")
    dtype = compute_dtype(h)
    teacher_h, teacher_weight = teacher_h.detach(), teacher_weight.detach()
    if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
        return _ChunkedLinearKD.apply(h, weight, targets, teacher_h, teacher_weight, alpha, temperature,
                                      chunk_size, ignore_index, dtype)
    n_valid = (targets != ignore_index).sum().clamp(min=1)
    total, w, tw = 0.0, weight.to(dtype), teacher_weight.to(dtype)
    with torch.autocast(h.device.type, enabled=False):
        for s in range(0, h.shape[0], chunk_size):
            total = total + _kd_chunk(h[s:s + chunk_size].to(dtype), w, targets[s:s + chunk_size],
                                      teacher_h[s:s + chunk_size].to(dtype), tw, alpha, temperature, ignore_index,
                                      dtype)[0]
    return total / n_valid.to(total.dtype)
