"""Decoder-only transformer (Llama-style) built from zoo/blocks, with generate() on a KV cache.

    tokens -> embed -> n_layers x [x + attn(norm(x)); x + mlp(norm(x))] -> norm -> lm_head

Pre-norm RMSNorm, RoPE, grouped-query attention, SwiGLU; tied or untied embeddings; residual
projections initialised with std / sqrt(2 * n_layers) (GPT-2); optional activation
checkpointing per block; a chunked loss that never materialises the full fp32 logits.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import checkpoint

from .blocks.attention import CausalSelfAttention, KVCache, flash_available
from .blocks.chunked_ce import chunked_cross_entropy
from .blocks.mlp import SwiGLU
from .blocks.norm import RMSNorm
from .blocks.rope import RotaryEmbedding
from .config import ConfigError, LLMConfig, to_dict


class Block(nn.Module):
    def __init__(self, cfg: LLMConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = CausalSelfAttention(cfg.d_model, cfg.n_heads, cfg.resolved_n_kv_heads, cfg.resolved_head_dim, cfg.qkv_bias,
                                        cfg.attn_backend, cfg.sliding_window)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg.d_model, cfg.resolved_ffn_hidden)

    def forward(self, x, cos, sin, cache: Optional[KVCache] = None, start_pos: int = 0):
        x = x + self.attn(self.attn_norm(x), cos, sin, cache, start_pos)
        return x + self.mlp(self.mlp_norm(x))


class LLM(nn.Module):
    family = "llm"

    def __init__(self, cfg: LLMConfig):
        super().__init__()
        cfg.validate()
        if cfg.attn_backend == "flash" and flash_available() is None:
            raise ConfigError("model.attn_backend=flash needs flash-attn, which is not installed or does not "
                              "import (pip install -e '.[flash]', CUDA only); use auto or sdpa")
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        scaling = to_dict(cfg.rope_scaling) if cfg.rope_scaling else None
        self.rope = RotaryEmbedding(cfg.resolved_head_dim, cfg.max_seq_len, cfg.rope_theta, scaling)
        if self.embed.weight.device.type != "meta":  # a meta build (for loading) needs no init
            self.reset_parameters()

    def reset_parameters(self):
        std = self.config.init_std
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                nn.init.ones_(p)
            elif name.endswith(".bias"):
                nn.init.zeros_(p)
            elif name.endswith(("attn.proj.weight", "mlp.down.weight")):
                nn.init.normal_(p, 0.0, std / math.sqrt(2 * self.config.n_layers))
            else:
                nn.init.normal_(p, 0.0, std)

    # ------------------------------------------------------------------ forward / loss
    def forward(self, input_ids: torch.Tensor, targets: Optional[torch.Tensor] = None,
                caches: Optional[list] = None, start_pos: int = 0):
        """input_ids (B, T) -> logits (B, T, V); with targets (B, T): (logits, loss), where logits
        is None when the chunked loss is on (the full logits are never made)."""
        B, T = input_ids.shape
        x = self.embed(input_ids)
        dev = x.device.type
        rope_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
        cos, sin = self.rope(start_pos, T, rope_dtype)
        ckpt = self.config.activation_checkpointing and self.training and torch.is_grad_enabled()
        for i, layer in enumerate(self.layers):
            cache = caches[i] if caches is not None else None
            if ckpt:
                x = checkpoint(layer, x, cos, sin, use_reentrant=False)
            else:
                x = layer(x, cos, sin, cache, start_pos)
        h = self.norm(x)
        if targets is None:
            return self.lm_head(h)
        if self.config.chunked_loss:
            loss = chunked_cross_entropy(h.reshape(B * T, -1), self.lm_head.weight, targets.reshape(B * T),
                                         self.config.loss_chunk_size)
            return None, loss
        logits = self.lm_head(h)
        loss = F.cross_entropy(logits.float().view(B * T, -1), targets.reshape(B * T), ignore_index=-100)
        return logits, loss

    # ------------------------------------------------------------------ generation
    def new_caches(self, batch: int, max_len: int, device=None, dtype=None) -> list:
        p = self.embed.weight
        cfg = self.config
        return [KVCache(batch, cfg.resolved_n_kv_heads, max_len, cfg.resolved_head_dim, device or p.device, dtype or p.dtype)
                for _ in range(cfg.n_layers)]

    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, temperature: float = 0.0,
                 top_k: Optional[int] = None, top_p: Optional[float] = None,
                 eos_token_id: Optional[int] = None, generator: Optional[torch.Generator] = None,
                 compile: bool = False) -> torch.Tensor:
        """Extend input_ids (B, T) by max_new_tokens -> (B, T + max_new_tokens), using the KV cache.
        temperature 0 is greedy; otherwise sample from softmax(logits / temperature), restricted
        to the top_k tokens and/or the smallest set whose probability reaches top_p. Rows that
        produced eos_token_id keep emitting it.

        compile=True runs each one-token decoding step through torch.compile (see `decode_step`):
        the first call compiles (docs/pretrained.md, "Benchmark", has how long it takes), later
        calls with any prompt length, cache length or position reuse the compiled step. The prompt
        itself is always run eagerly."""
        was_training = self.training
        self.eval()
        B, T = input_ids.shape
        dtype = torch.get_autocast_dtype(input_ids.device.type) \
            if torch.is_autocast_enabled(input_ids.device.type) else None
        caches = self.new_caches(B, T + max_new_tokens, input_ids.device, dtype)
        step = compiled_decode_step() if compile else decode_step
        out = input_ids
        done = torch.zeros(B, dtype=torch.bool, device=input_ids.device)
        logits = self(input_ids, caches=caches, start_pos=0)[:, -1]
        for i in range(max_new_tokens):
            nxt = sample_next(logits.float(), temperature, top_k, top_p, generator)
            if eos_token_id is not None:
                nxt = torch.where(done, torch.full_like(nxt, eos_token_id), nxt)
                done |= nxt == eos_token_id
            out = torch.cat([out, nxt[:, None]], dim=1)
            if i + 1 < max_new_tokens:
                logits = step(self, nxt[:, None], caches, T + i)
        self.train(was_training)
        return out

    # ------------------------------------------------------------------ accounting
    def num_params(self, non_embedding: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())
        return n - self.embed.weight.numel() if non_embedding else n

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward): 6 * (matmul params) + attention (PaLM, 2022)."""
        cfg = self.config
        n_matmul = self.num_params(non_embedding=True) + (self.embed.weight.numel() if cfg.tie_embeddings else 0)
        attn = 12 * cfg.n_layers * cfg.n_heads * cfg.resolved_head_dim * seq_len
        return 6 * n_matmul + attn


def decode_step(model: LLM, ids: torch.Tensor, caches: list, pos: int) -> torch.Tensor:
    """One decoding step: ids (B, 1) at position pos -> next-token logits (B, V); fills the caches."""
    return model(ids, caches=caches, start_pos=pos)[:, -1]


class MatvecAsReduction(TorchFunctionMode):
    """Inside torch.compile on a CPU, turns F.linear on at most two rows (a decoding step at
    batch 1 or 2) into a multiply and a sum over the input dim, accumulated in fp32.

    Decoding is a chain of matrix-vector products that read every weight once per token, so
    its speed is the rate at which the weights are read. On a CPU the GEMV behind F.linear
    reads them well below the memory bandwidth, while inductor fuses the multiply-and-sum into
    one vectorised reduction that streams the weight at close to it (docs/pretrained.md,
    "Benchmark", has the measurements). In eager mode the product would be materialised, so
    this is only for compiled code; on other devices F.linear is left alone (cuBLAS GEMV is
    bandwidth-bound)."""

    MAX_ROWS = 2  # from 4 rows on, the GEMM is as fast (docs/pretrained.md, "Benchmark")

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, w = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if w.device.type == "cpu" and x.dim() >= 2 and x.shape[:-1].numel() <= self.MAX_ROWS:
                if torch.is_autocast_enabled("cpu"):
                    dt = torch.get_autocast_dtype("cpu")
                    x, w, bias = x.to(dt), w.to(dt), None if bias is None else bias.to(dt)
                y = (x.unsqueeze(-2) * w).sum(-1, dtype=torch.float32).to(x.dtype)
                return y if bias is None else y + bias
        return func(*args, **kwargs)


def _decode_step_matvec(model: LLM, ids: torch.Tensor, caches: list, pos: int) -> torch.Tensor:
    with MatvecAsReduction():
        return decode_step(model, ids, caches, pos)


_compiled_step = None


def compiled_decode_step():
    """decode_step under torch.compile, with the matrix-vector products as fused reductions on
    CPU. Shapes are static at the first call; a second position or cache length recompiles once
    with those sizes dynamic (torch.compile's automatic dynamic shapes), and later calls reuse it.
    The weights' shapes stay static, which keeps the reductions fully vectorised."""
    global _compiled_step
    if _compiled_step is None:
        _compiled_step = torch.compile(_decode_step_matvec)
    return _compiled_step


def sample_next(logits: torch.Tensor, temperature: float = 0.0, top_k: Optional[int] = None,
                top_p: Optional[float] = None, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """logits (B, V) -> next token ids (B,)."""
    if temperature <= 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, descending=True, dim=-1)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= top_p  # keep the smallest prefix reaching top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, idx, sorted_logits)
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)
