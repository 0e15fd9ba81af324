"""Every file in zoo/blocks can be copied into another codebase as it is: it opens with a
docstring, imports torch and the standard library only (plus the sibling blocks its docstring
names on a `Needs:` line), and a bare copy of it, with exactly those siblings, imports and runs
in a fresh interpreter that has torch and nothing of zoo. The README's copy commands are run as
they are written."""
import ast
import re
import shutil
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

BLOCKS = Path(__file__).resolve().parents[1] / "zoo" / "blocks"
FILES = sorted(p for p in BLOCKS.glob("*.py") if p.name != "__init__.py")

# a recurrent block m on x (2, 7, 16): its gradient, its state, one-token steps, a document reset
RECURRENT = """
        y, state = m(x)
        y.sum().backward()
        assert m.A_log.grad is not None and state[1].shape == (2, 4, 8, {n})
        with torch.no_grad():
            s, steps = None, []
            for t in range(7):
                yt, s = m(x[:, t:t + 1], s)
                steps.append(yt)
            assert (torch.cat(steps, 1) - y).abs().max() < 1e-5
            doc = torch.tensor([[0] * 3 + [1] * 4] * 2)
            assert (m(x, doc_ids=doc)[0][:, 3:] - m(x[:, 3:])[0]).abs().max() < 1e-5
    """

# What each copied block runs (in the fresh interpreter, next to its needed siblings). A block
# without an entry here fails test_every_block_has_a_smoke_run: add one with the block.
SMOKE = {
    "norm.py": """
        from norm import RMSNorm
        x = torch.randn(2, 3, 8)
        y = RMSNorm(8, eps=1e-6)(x)
        ref = x / (x.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()
        assert (y - ref).abs().max() < 1e-5
        from norm import GatedRMSNorm
        g = torch.randn(2, 3, 8)
        assert (GatedRMSNorm(8, eps=1e-6)(x, g) - ref * torch.nn.functional.silu(g)).abs().max() < 1e-5
        halves = GatedRMSNorm(8, eps=1e-6, group=4, gate_first=True)(x, g)
        xg = (x * torch.nn.functional.silu(g)).unflatten(-1, (2, 4))
        assert (halves - (xg / (xg.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()).flatten(-2)).abs().max() < 1e-5
    """,
    "per_layer.py": """
        from per_layer import PerLayerInput, PerLayerInputs
        ids, x = torch.randint(0, 10, (2, 5)), torch.randn(2, 5, 16)
        inputs = PerLayerInputs(10, 16, 3, 4)(ids, x)
        assert inputs.shape == (2, 5, 3, 4)
        layer = PerLayerInput(16, 4)
        y = layer(x, inputs[:, :, 0])
        torch.nn.init.zeros_(layer.out.weight)  # a zero output projection adds nothing
        assert y.shape == x.shape and not torch.equal(y, x) and torch.equal(layer(x, inputs[:, :, 0]), x)
    """,
    "rope.py": """
        from rope import RotaryEmbedding, apply_rope
        cos, sin = RotaryEmbedding(8, 16)(0, 5, torch.float32)
        q = torch.randn(1, 2, 5, 8)
        r = apply_rope(q, cos, sin)
        assert r.shape == q.shape and torch.allclose(r.norm(dim=-1), q.norm(dim=-1), atol=1e-5)
        yarn = RotaryEmbedding(8, 16, scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8})
        assert yarn.attention_factor > 1 and yarn.inv_freq[0] == 1 and yarn.inv_freq[-1] < cos.new_tensor(1e4 ** -0.75)
        longrope = {"type": "longrope", "factor": 2.0, "original_max_position_embeddings": 4,
                    "short_factor": [1.0] * 4, "long_factor": [2.0] * 4}
        lr = RotaryEmbedding(8, 16, scaling=longrope)
        short, long = lr(0, 4, torch.float32)[0], lr(0, 5, torch.float32)[0]
        assert torch.allclose(short, cos[:4] * lr.attention_factor) and not torch.allclose(long[:4], short)
    """,
    "lora.py": """
        from lora import LoRALinear, adapters_per_row
        base = torch.nn.Linear(8, 12)
        x = torch.randn(3, 8)
        ref = base(x).detach()
        m = LoRALinear(base, [("q", 4), ("k", 4), ("v", 4)], ["q", "v"], r=2, alpha=4, dora=True)
        torch.nn.init.normal_(m.adapter.lora_B["q"])
        y = m(x)
        assert (y[:, 4:8] - ref[:, 4:8]).abs().max() == 0 and (y[:, :4] - ref[:, :4]).abs().max() > 1e-3
        m.merge()
        assert (m(x) - y).abs().max() < 1e-5
        m.unmerge()
        assert (m(x) - y).abs().max() < 1e-5
        m.add_adapter("b", ["k"], r=2)
        torch.nn.init.normal_(m.adapters["b"].lora_B["k"])
        with adapters_per_row(m, ["__base__", "default", "b"]):
            mixed = m(x)
        assert (mixed[0] - ref[0]).abs().max() < 1e-6 and (mixed[1] - y[1]).abs().max() < 1e-6
        assert (mixed[2, 4:8] - ref[2, 4:8]).abs().max() > 1e-3 and (mixed[2, :4] - ref[2, :4]).abs().max() < 1e-6
    """,
    "prefix.py": """
        from prefix import KVPrefix, PromptEmbedding
        p = KVPrefix(2, 3, 4)
        k, v = p(torch.zeros(5, 2, 6, 4), torch.zeros(5, 2, 6, 4))
        assert k.shape == v.shape == (5, 2, 9, 4) and torch.equal(k[1, :, :3], p.k.detach())
        e = PromptEmbedding(3, 4)
        x = e(torch.zeros(5, 6, 4))
        assert x.shape == (5, 9, 4) and torch.equal(x[2, :3], e.weight.detach()) and not x[:, 3:].any()
    """,
    "bottleneck.py": """
        from bottleneck import BottleneckAdapter
        a = BottleneckAdapter(8, 2)
        h = torch.randn(3, 5, 8)
        assert torch.equal(a(h), h)  # up starts at zero: the identity
        torch.nn.init.normal_(a.up.weight)
        y = a(h)
        y.sum().backward()
        assert (y - h).abs().max() > 1e-3 and a.down.weight.grad is not None
    """,
    "attention.py": """
        from attention import CausalSelfAttention, KVCache
        from rope import RotaryEmbedding
        attn = CausalSelfAttention(16, n_heads=4, n_kv_heads=2)
        cos, sin = RotaryEmbedding(4, 16)(0, 6, torch.float32)
        x = torch.randn(2, 6, 16)
        y = attn(x, cos, sin)
        y.sum().backward()
        assert y.shape == x.shape and attn.qkv.weight.grad is not None
        qk = CausalSelfAttention(16, n_heads=4, n_kv_heads=2, qk_norm=True)
        qk(x, cos, sin).sum().backward()
        assert qk.q_norm.weight.grad is not None and qk.k_norm.weight.grad is not None
        cache = KVCache(2, 2, 6, 4)
        with torch.no_grad():
            steps = [attn(x[:, i:i + 1], cos[i:i + 1], sin[i:i + 1], cache, i) for i in range(6)]
        assert (torch.cat(steps, 1) - y).abs().max() < 1e-4
        # Gemma / OLMo 2 / GPT-OSS / Phi-4 options: a huge cap and a sink at -inf change nothing
        same = CausalSelfAttention(16, n_heads=4, n_kv_heads=2, softcap=1e9, sinks=True)
        same.load_state_dict(attn.state_dict(), strict=False)
        torch.nn.init.constant_(same.sinks, float("-inf"))
        assert (same(x, cos, sin) - y).abs().max() < 1e-5
        torch.nn.init.zeros_(same.sinks)
        assert (same(x, cos, sin) - y).abs().max() > 1e-3
        proj = CausalSelfAttention(16, n_heads=4, n_kv_heads=2, qk_norm="proj", rope=False, scale=0.3)
        assert proj.q_norm.weight.shape == (16,) and proj(x, cos, sin).shape == x.shape
        half = CausalSelfAttention(16, n_heads=4, n_kv_heads=2)
        half.load_state_dict(attn.state_dict())
        y_half = half(x, cos[:, :2], sin[:, :2])  # partial rotary: the first half of each head rotated
        assert y_half.shape == x.shape and (y_half - y).abs().max() > 1e-4
    """,
    "mla.py": """
        from mla import LatentKVCache, MultiHeadLatentAttention
        from rope import RotaryEmbedding
        attn = MultiHeadLatentAttention(16, n_heads=4, kv_rank=6, rope_dim=4, nope_dim=6, v_dim=5, q_rank=8)
        cos, sin = RotaryEmbedding(4, 16)(0, 6, torch.float32)
        x = torch.randn(2, 6, 16)
        y = attn(x, cos, sin)
        y.sum().backward()
        assert y.shape == x.shape and attn.kv_b.weight.grad is not None
        cache = LatentKVCache(2, 6, 6 + 4)  # the compressed latents only
        with torch.no_grad():
            steps = [attn(x[:, i:i + 1], cos[i:i + 1], sin[i:i + 1], cache, i) for i in range(6)]
        assert (torch.cat(steps, 1) - y).abs().max() < 1e-4
    """,
    "attention_docs.py": """
        from attention import CausalSelfAttention
        from attention_docs import Documents, document_positions
        from rope import RotaryEmbedding
        attn = CausalSelfAttention(16, n_heads=4, n_kv_heads=2)
        rope = RotaryEmbedding(4, 16)
        x = torch.randn(2, 6, 16)
        y = attn(x, *rope(0, 6, torch.float32))
        doc = torch.tensor([[0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 0, 0]])
        yd = attn(x, *rope.at(document_positions(doc), torch.float32), mask=Documents(doc))
        assert (yd[:, :3] - y[:, :3]).abs().max() < 1e-5 and (yd[1] - y[1]).abs().max() < 1e-5
        assert (yd[:1, 3:] - attn(x[:1, 3:], *rope(0, 3, torch.float32))).abs().max() < 1e-5
    """,
    "attention_masked.py": """
        from attention import CausalSelfAttention
        from attention_masked import KeyMask, MaskedKVCache
        from rope import RotaryEmbedding
        attn = CausalSelfAttention(16, n_heads=4, n_kv_heads=2)
        cos, sin = RotaryEmbedding(4, 16)(0, 6, torch.float32)
        x = torch.randn(1, 6, 16)
        keep = torch.tensor([[True, False, True, True, False, True]])
        y = attn(x, cos, sin, mask=KeyMask(keep))
        cache = MaskedKVCache(1, 2, 6, 4)
        with torch.no_grad():
            steps = [attn(x[:, i:i + 1], cos[i:i + 1], sin[i:i + 1], cache, i, KeyMask(keep[:, i:i + 1]))
                     for i in range(6)]
        assert (torch.cat(steps, 1) - y).abs().max() < 1e-4
        dense = attn(x[:, keep[0]], cos[keep[0]], sin[keep[0]])  # the skipped keys never seen
        assert (y[:, keep[0]] - dense).abs().max() < 1e-5
    """,
    "mlp.py": """
        from mlp import ReLU2MLP, SwiGLU
        r = ReLU2MLP(8, 16)
        x = torch.randn(3, 8)
        assert (r(x) - (x @ r.up.weight.t()).clamp(min=0) ** 2 @ r.down.weight.t()).abs().max() < 1e-5
        m = SwiGLU(8, 16)
        x = torch.randn(3, 8)
        g, u = (x @ m.gate_up.weight.t()).chunk(2, -1)
        assert (m(x) - (torch.nn.functional.silu(g) * u) @ m.down.weight.t()).abs().max() < 1e-5
        m.act = "gelu_tanh"
        ref = torch.nn.functional.gelu(g, approximate="tanh") * u @ m.down.weight.t()
        assert (m(x) - ref).abs().max() < 1e-5
    """,
    "moe.py": """
        from moe import MoE
        m = MoE(8, 12, n_experts=4, top_k=2, n_shared=1, shared_gate=True)
        x = torch.randn(2, 5, 8, requires_grad=True)
        y, stats = m(x)
        (y.square().mean() + 0.01 * stats["lb_loss"]).backward()
        assert y.shape == x.shape and stats["load"].sum() == 20 and m.router.weight.grad is not None
        loop = MoE(8, 12, n_experts=4, top_k=2, n_shared=1, shared_gate=True, dispatch="loop")
        loop.load_state_dict(m.state_dict())
        assert (loop(x)[0] - y).abs().max() < 1e-5
        gpt = MoE(8, 12, n_experts=4, top_k=2, bias=True, swiglu_limit=0.5)  # GPT-OSS: biases, clamped SwiGLU
        assert gpt.router.bias is not None and gpt.gate_up_bias.shape == (4, 24) and gpt(x)[0].shape == x.shape
        gem = MoE(8, 12, n_experts=4, top_k=2, n_shared=1, router_norm=True, branch_norms=True, act="gelu_tanh")
        assert gem.expert_scale.shape == (4,) and gem.routed_post_norm.weight.shape == (8,)
        assert gem(x)[0].shape == x.shape
    """,
    "mod.py": """
        from mod import MixtureOfDepths
        class Residual(torch.nn.Module):  # a residual block that uses a per-position table
            def __init__(self):
                super().__init__()
                self.lin = torch.nn.Linear(8, 8)
            def forward(self, x, pos_emb, key_mask=None):
                return x + self.lin(x + pos_emb)
        m = MixtureOfDepths(Residual(), 8, capacity=0.25)
        x, pos = torch.randn(2, 12, 8), torch.randn(12, 8)
        y, stats = m(x, pos)
        (y.square().mean() + stats["aux_loss"]).backward()
        assert ((y != x).any(-1).sum(-1) == 3).all() and m.router.weight.grad.abs().sum() > 0
        y, stats = m(x, pos, causal=True)
        assert y.shape == x.shape and 0.0 <= stats["routed"] <= 1.0
    """,
    "checkpoint.py": """
        from checkpoint import run_block
        block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.GELU(), torch.nn.Linear(8, 8))
        x = torch.randn(6, 8)
        grads = []
        for policy in ("none", "full", "selective"):
            torch.manual_seed(0)
            block[1].reset_running_stats()
            block.zero_grad()
            run_block(block, 0, policy, 1, x).square().sum().backward()
            grads.append((block[0].weight.grad.clone(), block[1].running_mean.clone()))
        assert all((g - grads[0][0]).abs().max() < 1e-6 and torch.equal(m, grads[0][1]) for g, m in grads)
        from checkpoint import checkpoint_units
        stack = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU()) for _ in range(3)])
        assert checkpoint_units(stack, "selective", every=2) == 2 and "forward" not in stack[1].__dict__
        stack(x).square().sum().backward()
        assert checkpoint_units(stack, "none") == 0 and not any("forward" in u.__dict__ for u in stack)
    """,
    "timestep.py": """
        import math
        from timestep import LabelEmbedder, TimestepEmbedder, timestep_embedding
        t = torch.tensor([0, 10, 999])
        e = timestep_embedding(t, 8, freq_shift=1)
        f = torch.tensor([10000 ** (-i / 3) for i in range(4)])                 # / (half - shift)
        assert (e - torch.cat([torch.cos(t[:, None] * f), torch.sin(t[:, None] * f)], 1)).abs().max() < 1e-4
        assert TimestepEmbedder(16, 8)(t.float() / 3).shape == (3, 16)
        y = LabelEmbedder(5, 16)
        dropped = y.drop(torch.zeros(1000, dtype=torch.long), 0.3)
        assert set(dropped.unique().tolist()) == {0, 5} and 200 < int((dropped == 5).sum()) < 400
        assert y(dropped).shape == (1000, 16)
    """,
    "patch.py": """
        from patch import PatchEmbed, sincos_pos_embed_2d, unpatchify
        pe = PatchEmbed(3, 12, 2)
        x = torch.randn(2, 3, 4, 6)
        tokens = pe(x)
        assert tokens.shape == (2, 6, 12)
        # token (row 1, column 2) is the linear map of the patch x[:, :, 2:4, 4:6]
        ref = (pe.proj.weight.flatten(1) @ x[:, :, 2:4, 4:6].flatten(1).t()).t() + pe.proj.bias
        assert (tokens[:, 1 * 3 + 2] - ref).abs().max() < 1e-5
        patches = x.unfold(2, 2, 2).unfold(3, 2, 2).permute(0, 2, 3, 4, 5, 1).reshape(2, 6, 12)  # (p, p, C) per token
        assert torch.equal(unpatchify(patches, 2, 2, 3), x)
        pos = sincos_pos_embed_2d(8, 3, 3)
        def sc(q):  # [sin, sin, cos, cos] of q * (1, 1/100)
            a = torch.tensor([q, q / 100])
            return torch.cat([a.sin(), a.cos()])
        assert pos.shape == (9, 8) and torch.allclose(pos[5], torch.cat([sc(2.0), sc(1.0)]))   # row 1, column 2
        assert torch.allclose(sincos_pos_embed_2d(8, 6, 6, base_size=3)[2], torch.cat([sc(1.0), sc(0.0)]))  # column 2 * 3/6
    """,
    "mmdit.py": """
        from mmdit import (DoubleStreamBlock, Modulation, SingleStreamBlock, TimeGuidanceEmbedder, apply_rope_pairs,
                           positions, rope_4d)
        txt, img = positions(3, 2, 4)
        assert txt[:, 3].tolist() == [0, 1, 2] and img[5].tolist() == [0, 1, 1, 0]
        cos, sin = rope_4d(torch.cat([txt, img]), (2, 2, 2, 2), theta=2000.0)
        q = torch.randn(1, 11, 1, 8)
        assert torch.allclose(apply_rope_pairs(q, cos, sin).norm(dim=-1), q.norm(dim=-1), atol=1e-5)
        # relative: a query/key pair moved together along an axis keeps its dot product
        ids = torch.tensor([[0, 1, 2, 0], [0, 3, 5, 0], [0, 4, 2, 0], [0, 6, 5, 0]])
        c4, s4 = rope_4d(ids, (2, 2, 2, 2))
        v = torch.randn(1, 1, 1, 8).expand(1, 4, 1, 8)
        r = apply_rope_pairs(v, c4, s4)[0, :, 0]
        assert abs(float(r[0] @ r[1] - r[2] @ r[3])) < 1e-4
        temb = TimeGuidanceEmbedder(16, 8, guidance=True)(torch.tensor([0.5, 0.5]), torch.tensor([1.0, 4.0]))
        assert temb.shape == (2, 16) and (temb[0] - temb[1]).abs().max() > 0
        x, c = torch.randn(2, 8, 16), torch.randn(2, 3, 16)
        double = DoubleStreamBlock(16, 2, 8)
        mods = Modulation(16, 2)(temb), Modulation(16, 2)(temb)
        y, d = double(x, c, *mods, (cos, sin))
        assert y.shape == x.shape and d.shape == c.shape
        # attention is joint: the text changes the image stream
        assert torch.equal(double(x, c, *mods, (cos, sin))[0], y)
        y2, _ = double(x, c.flip(1), *mods, (cos, sin))
        assert (y2 - y).abs().max() > 1e-4
        single = SingleStreamBlock(16, 2, 8)
        z = single(torch.cat([d, y], 1), Modulation(16, 1)(temb), (cos, sin))
        z.square().sum().backward()
        assert z.shape == (2, 11, 16) and single.to_qkv_mlp_proj.weight.grad.abs().sum() > 0
    """,
    "vit.py": """
        from vit import ViTBlock, add_prefix, resample_pos_embed
        block = ViTBlock(16, 4, init_values=0.1)
        x = torch.randn(2, 6, 16)
        y = block(x)
        y.square().sum().backward()
        assert y.shape == x.shape and block.ls1.gamma.grad.abs().sum() > 0 and block.attn.qkv.weight.grad is not None
        cls, regs, pos = torch.randn(1, 1, 16), torch.randn(1, 2, 16), torch.randn(1, 4, 16)
        t = add_prefix(x[:, :4], pos, [cls, regs], embed_prefix=False)
        assert torch.equal(t[:, 0], cls[:, 0].expand(2, -1)) and torch.equal(t[:, 3:], x[:, :4] + pos)
        wide = resample_pos_embed(torch.cat([cls, pos], 1), (4, 4), (2, 2), n_prefix=1)
        assert wide.shape == (1, 17, 16) and torch.equal(wide[:, 0], cls[:, 0])
        assert torch.allclose(resample_pos_embed(torch.ones(1, 4, 16), (3, 5), (2, 2)), torch.ones(1, 15, 16))
        from vit import naflex_pos_embed, patch_rope
        cos, sin = patch_rope(4, 2, 3, n_prefix=1)
        assert cos.shape == (7, 4) and torch.equal(cos[0], torch.ones(4)) and torch.equal(sin[0], torch.zeros(4))
        gated = ViTBlock(16, 4, mlp="swiglu")
        mask = torch.tensor([[True] * 7, [True] * 5 + [False] * 2])[:, None, None]
        y = gated(torch.randn(2, 7, 16), (cos, sin), mask)
        y.sum().backward()
        assert y.shape == (2, 7, 16) and gated.mlp.gate_up.weight.grad is not None
        pads = naflex_pos_embed(pos, (2, 2), torch.tensor([[1, 3], [2, 2]]), 5)
        assert pads.shape == (2, 5, 16) and torch.equal(pads[0, 3], pads[0, 0]) and torch.equal(pads[1, :4], pos[0])
    """,
    "pixel_shuffle.py": """
        from pixel_shuffle import PixelShuffleProjector, pixel_shuffle
        x = torch.arange(16.0).view(1, 16, 1)                            # a 4 x 4 grid, one channel
        assert pixel_shuffle(x, 2).flatten().tolist() == [0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15]
        assert pixel_shuffle(torch.arange(8.0).view(1, 8, 1), 2, 2, 4)[0, 1].tolist() == [2, 3, 6, 7]
        proj = PixelShuffleProjector(8, 5, 3)
        y = proj(torch.randn(2, 36, 8))
        y.sum().backward()
        assert y.shape == (2, 4, 5) and proj.proj.weight.shape == (5, 72) and proj.proj.bias is None
    """,
    "attention_pool.py": """
        from attention_pool import AttentionPool
        pool = AttentionPool(16, 4, torch.nn.Linear(16, 16))
        x = torch.randn(2, 5, 16)
        y = pool(x)
        y.sum().backward()
        assert y.shape == (2, 16) and pool.latent.grad is not None
        with torch.no_grad():  # masked tokens change nothing
            mask = torch.tensor([[True] * 3 + [False] * 2] * 2)
            assert (pool(x, mask) - pool(torch.cat([x[:, :3], torch.randn(2, 2, 16)], 1), mask)).abs().max() < 1e-5
    """,
    "adaln.py": """
        from adaln import DiTBlock, FinalLayer, axial_rope
        block = DiTBlock(16, 4, qk_norm=True)
        x, c = torch.randn(2, 6, 16), torch.randn(2, 16)
        assert torch.equal(block(x, c), x)                               # adaLN-Zero: the identity at init
        torch.nn.init.normal_(block.ada.weight, std=0.1)
        rope = axial_rope(4, 2, 3)
        y = block(x, c, rope)
        y.square().sum().backward()
        assert y.shape == x.shape and block.attn.qkv.weight.grad.abs().sum() > 0
        # attention is bidirectional: the first token's output depends on the last token (one channel: LayerNorm
        # removes a shift of all of them)
        x2 = x.clone(); x2[:, -1, 0] += 1
        assert (block(x2, c, rope)[:, 0] - y[:, 0]).abs().max() > 1e-4
        assert FinalLayer(16, 8)(x, c).abs().max() == 0
    """,
    "attention_cpu.py": """
        from attention_cpu import attend_bmm
        q, k, v = torch.randn(2, 4, 6, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
        mask = torch.ones(6, 6, dtype=torch.bool).tril()
        kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
        ref = ((q @ kk.transpose(-2, -1)) / 8 ** 0.5).masked_fill(~mask, float("-inf")).softmax(-1) @ vv
        assert (attend_bmm(q, k, v, block=2) - ref).abs().max() < 1e-5
        own = torch.tensor([0, 0, 0, 1, 1, 1])
        docs = (own[:, None] == own[None, :]).expand(2, 6, 6)
        ref = ((q @ kk.transpose(-2, -1)) / 8 ** 0.5).masked_fill(~(mask & docs[:, None]), float("-inf")).softmax(-1) @ vv
        assert (attend_bmm(q, k, v, block=2, mask=docs) - ref).abs().max() < 1e-5
    """,
    "matvec_cpu.py": """
        from matvec_cpu import MatvecCPU, as_reduction
        x, w, b = torch.randn(1, 16), torch.randn(8, 16), torch.randn(8)
        with MatvecCPU():
            y = torch.nn.functional.linear(x, w, b)
        assert (y - (x @ w.t() + b)).abs().max() < 1e-5 and (as_reduction(x, w, b) - y).abs().max() < 1e-5
    """,
    "drop_path.py": """
        from drop_path import DropPath, drop_path
        x = torch.ones(1000, 4)
        y = DropPath(0.5).train()(x)
        assert set(y.unique().tolist()) <= {0.0, 2.0} and 300 < int((y[:, 0] > 0).sum()) < 700
        assert torch.equal(DropPath(0.5).eval()(x), x)
    """,
    "se.py": """
        from se import SqueezeExcite
        m = SqueezeExcite(8, 2)
        x = torch.randn(3, 8, 5, 5).contiguous(memory_format=torch.channels_last)
        s = torch.sigmoid(m.conv_expand(torch.relu(m.conv_reduce(x.mean((2, 3), keepdim=True)))))
        y = m(x)
        assert (y - x * s).abs().max() < 1e-6 and y.is_contiguous(memory_format=torch.channels_last)
    """,
    "hard_swish.py": """
        from hard_swish import HardSigmoid, HardSwish
        x = torch.linspace(-5, 5, 101)
        ref = x * torch.clamp(x + 3, 0, 6) / 6
        assert (HardSwish(inplace=True)(x) - ref).abs().max() < 1e-6
        assert (HardSigmoid()(x) - torch.clamp(x + 3, 0, 6) / 6).abs().max() < 1e-6
    """,
    "layernorm2d.py": """
        from layernorm2d import LayerNorm2d
        m = LayerNorm2d(6)
        torch.nn.init.normal_(m.weight)
        x = torch.randn(2, 6, 4, 5)
        mu, var = x.mean(1, keepdim=True), x.var(1, unbiased=False, keepdim=True)
        ref = (x - mu) / (var + 1e-6).sqrt() * m.weight.view(1, -1, 1, 1) + m.bias.view(1, -1, 1, 1)
        assert (m(x) - ref).abs().max() < 1e-5
    """,
    "grn.py": """
        from grn import GRN
        m = GRN(6)
        x = torch.randn(2, 4, 5, 6)
        assert torch.equal(m(x), x)  # starts as the identity
        torch.nn.init.normal_(m.weight)
        torch.nn.init.normal_(m.bias)
        g = x.pow(2).sum((1, 2), keepdim=True).sqrt()
        ref = x + m.bias + m.weight * x * (g / (g.mean(-1, keepdim=True) + 1e-6))
        assert (m(x) - ref).abs().max() < 1e-5
    """,
    "mbconv.py": """
        from mbconv import DepthwiseSeparable, MBConv
        m = MBConv(8, 8, 32, kernel=5, se_channels=2, drop_path=0.2).eval()
        x = torch.randn(2, 8, 9, 9)
        torch.nn.init.zeros_(m.bn3.weight)
        assert torch.equal(m(x), x)  # a residual block whose last BN is zero is the identity
        m = MBConv(8, 16, 32, stride=2).train()
        y = m(x)
        y.sum().backward()
        assert y.shape == (2, 16, 5, 5) and m.conv_pw.weight.grad is not None and m.conv_pw.bias is None
        d = DepthwiseSeparable(8, 4, se_channels=2)
        assert d(x).shape == (2, 4, 9, 9) and not d.has_skip
    """,
    "recurrent.py": """
        from recurrent import causal_conv, chunk_decays, to_chunks
        x, w = torch.randn(2, 5, 3), torch.randn(3, 1, 4)
        ref = torch.nn.functional.conv1d(x.transpose(1, 2), w, padding=3, groups=3)[..., :5].transpose(1, 2)
        y, state = causal_conv(x, w)
        assert (y - ref).abs().max() < 1e-5 and torch.equal(state, x[:, 2:])
        doc = torch.tensor([[0, 0, 1, 1, 1]] * 2)
        y, state = causal_conv(x, w, doc_ids=doc)
        assert (y[:, 2:] - causal_conv(x[:, 2:], w)[0]).abs().max() < 1e-5 and torch.equal(state, x[:, 2:])
        within, head, tail, whole = chunk_decays(to_chunks(-torch.rand(2, 1, 5), 4))
        assert within.shape == (2, 1, 2, 4, 4) and torch.equal(within[..., 0, 1:], torch.zeros(2, 1, 2, 3))
    """,
    "gated_deltanet.py": """
        from gated_deltanet import GatedDeltaNet
        m = GatedDeltaNet(16, 2, 8, n_v_heads=4, chunk=4)
        x = torch.randn(2, 7, 16)
    """ + RECURRENT.format(n=8),
    "mamba2.py": """
        from mamba2 import Mamba2
        m = Mamba2(16, 4, 8, state_size=6, n_groups=2, chunk=4)
        x = torch.randn(2, 7, 16)
    """ + RECURRENT.format(n=6),
    "short_conv.py": """
        from short_conv import ShortConv
        m = ShortConv(8, 3)
        x = torch.randn(2, 5, 8)
        y, state = m(x)
        s, steps = None, []
        for t in range(5):
            yt, s = m(x[:, t:t + 1], s)
            steps.append(yt)
        assert (torch.cat(steps, 1) - y).abs().max() < 1e-5 and (s - state).abs().max() < 1e-5
        doc = torch.tensor([[0, 0, 1, 1, 1]] * 2)
        assert (m(x, doc_ids=doc)[0][:, 2:] - m(x[:, 2:])[0]).abs().max() < 1e-5
    """,
    "chunked_ce.py": """
        from chunked_ce import chunked_cross_entropy
        h = torch.randn(10, 8, requires_grad=True)
        w = torch.randn(32, 8, requires_grad=True)
        t = torch.randint(0, 32, (10,))
        loss = chunked_cross_entropy(h, w, t, 3)
        ref = torch.nn.functional.cross_entropy(h @ w.t(), t)
        assert (loss - ref).abs() < 1e-5
        loss.backward()
        assert h.grad is not None and w.grad is not None
        from chunked_ce import chunked_distillation_loss, distillation_loss
        th, tw = torch.randn(10, 6), torch.randn(32, 6)
        kd = chunked_distillation_loss(h, w, t, th, tw, 0.5, 2.0, 3)
        assert (kd - distillation_loss(h @ w.t(), th @ tw.t(), t, 0.5, 2.0)).abs() < 1e-5
    """,
}


def needs(path: Path) -> list[str]:
    """The sibling block files a block's docstring names on its `Needs:` line."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    m = re.search(r"^Needs:\s*(.+)$", doc, re.M)
    return re.findall(r"\b(\w+\.py)\b", m.group(1)) if m else []


def test_every_block_has_a_smoke_run():
    assert FILES
    missing = [p.name for p in FILES if p.name not in SMOKE]
    assert not missing, f"add a SMOKE entry for {missing}"


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_block_imports_only_torch_stdlib_and_named_siblings(path):
    tree = ast.parse(path.read_text())
    doc = ast.get_docstring(tree)
    assert doc and len(doc.split()) >= 3, f"{path.name} must open with a docstring"
    assert isinstance(tree.body[0], ast.Expr) and isinstance(tree.body[0].value, ast.Constant)
    siblings = {n.removesuffix(".py") for n in needs(path)}
    for s in siblings:
        assert (BLOCKS / f"{s}.py").is_file(), f"{path.name} names {s}.py, which is not a block"
    allowed = {"torch"} | set(sys.stdlib_module_names)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots = [a.name.split(".")[0] for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            # `from .x import y` / `from x import y`, or `from . import x` (the module itself)
            roots = [a.name for a in node.names] if node.module is None else [node.module.split(".")[0]]
        else:
            continue
        if getattr(node, "level", 0) or any(r in siblings for r in roots):
            missing = [r for r in roots if r not in siblings]  # a sibling block, inside the package or beside the copy
            assert not missing, f"{path.name} imports blocks/{missing[0]}.py without naming it on its Needs: line"
            continue
        for r in roots:
            # an optional import inside a function (flash-attn) is looked up on first use, not at import
            assert r in allowed or _inside_function(tree, node), f"{path.name} imports {r}"


def _inside_function(tree, target) -> bool:
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(n is target for n in ast.walk(fn)):
            return True
    return False


BLOCKER = """
import importlib.abc, sys
class _NoZoo(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("zoo", "train"):
            raise ImportError(f"{name}: not available to a copied block")
sys.meta_path.insert(0, _NoZoo())
try:
    import zoo  # noqa: F401
except ImportError:
    pass
else:
    raise SystemExit("zoo is importable: the test would prove nothing")
sys.path.insert(0, sys.argv[1])
import torch
torch.manual_seed(0)
"""


README = BLOCKS.parents[1] / "README.md"


def readme_copies() -> list[list[str]]:
    """The README's `cp zoo/blocks/{a,b}.py DEST` commands, as the file names each copies."""
    out = []
    for m in re.finditer(r"^cp zoo/blocks/(?:\{([\w,]+)\}|(\w+))\.py \S+$", README.read_text(), re.M):
        out.append([f"{n}.py" for n in (m.group(1) or m.group(2)).split(",")])
    return out


def test_readme_copy_commands_follow_the_needs_lines(tmp_path):
    """Each copy command of the README copies a block and exactly the files its Needs: line names;
    run as written (the files copied into an empty folder), the block runs there."""
    copies = readme_copies()
    assert copies, "the README shows no `cp zoo/blocks/...` command"
    for names in copies:
        assert set(names) == {names[0], *needs(BLOCKS / names[0])}, names
        dest = tmp_path / names[0].removesuffix(".py")
        dest.mkdir()
        for n in names:
            shutil.copy(BLOCKS / n, dest / n)
        _run_smoke(names[0], dest)


def _run_smoke(name: str, folder: Path):
    code = BLOCKER + textwrap.dedent(SMOKE[name]) + "\nprint('ok')\n"
    out = subprocess.run([sys.executable, "-I", "-c", code, str(folder)], cwd=folder, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


@pytest.fixture(scope="module")
def bare_copies(tmp_path_factory):
    """Each block copied with exactly the siblings it names into an empty folder, and its smoke run
    started there, two at a time (each interpreter spends most of its time importing torch)."""
    def copy_and_run(path: Path):
        folder = tmp_path_factory.mktemp(path.stem)
        for name in [path.name] + needs(path):
            shutil.copy(BLOCKS / name, folder / name)
        assert sorted(p.name for p in folder.iterdir()) == sorted({path.name, *needs(path)})
        _run_smoke(path.name, folder)
    with ThreadPoolExecutor(2) as pool:
        yield {path.name: pool.submit(copy_and_run, path) for path in FILES}


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_bare_copy_imports_and_runs(path, bare_copies):
    """The block and exactly the siblings it names, alone in a folder, run in a fresh, isolated
    interpreter (no PYTHONPATH, no user site, zoo blocked from import)."""
    bare_copies[path.name].result()
