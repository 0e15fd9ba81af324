"""Every file in zoo/blocks can be copied into another codebase as it is: it opens with a
docstring, imports torch and the standard library only (plus the sibling blocks its docstring
names on a `Needs:` line), and a bare copy of it, with exactly those siblings, imports and runs
in a fresh interpreter that has torch and nothing of zoo."""
import ast
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

BLOCKS = Path(__file__).resolve().parents[1] / "zoo" / "blocks"
FILES = sorted(p for p in BLOCKS.glob("*.py") if p.name != "__init__.py")

# What each copied block runs (in the fresh interpreter, next to its needed siblings). A block
# without an entry here fails test_every_block_has_a_smoke_run: add one with the block.
SMOKE = {
    "norm.py": """
        from norm import RMSNorm
        x = torch.randn(2, 3, 8)
        y = RMSNorm(8, eps=1e-6)(x)
        ref = x / (x.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()
        assert (y - ref).abs().max() < 1e-5
    """,
    "rope.py": """
        from rope import RotaryEmbedding, apply_rope
        cos, sin = RotaryEmbedding(8, 16)(0, 5, torch.float32)
        q = torch.randn(1, 2, 5, 8)
        r = apply_rope(q, cos, sin)
        assert r.shape == q.shape and torch.allclose(r.norm(dim=-1), q.norm(dim=-1), atol=1e-5)
    """,
    "lora.py": """
        from lora import LoRALinear
        base = torch.nn.Linear(8, 12)
        x = torch.randn(3, 8)
        ref = base(x).detach()
        m = LoRALinear(base, [("q", 4), ("k", 4), ("v", 4)], ["q", "v"], r=2, alpha=4, dora=True)
        torch.nn.init.normal_(m.lora_B["q"])
        y = m(x)
        assert (y[:, 4:8] - ref[:, 4:8]).abs().max() == 0 and (y[:, :4] - ref[:, :4]).abs().max() > 1e-3
        m.merge()
        assert (m(x) - y).abs().max() < 1e-5
        m.unmerge()
        assert (m(x) - y).abs().max() < 1e-5
    """,
    "prefix.py": """
        from prefix import KVPrefix
        p = KVPrefix(2, 3, 4)
        k, v = p(torch.zeros(5, 2, 6, 4), torch.zeros(5, 2, 6, 4))
        assert k.shape == v.shape == (5, 2, 9, 4) and torch.equal(k[1, :, :3], p.k.detach())
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
    """,
    "mlp.py": """
        from mlp import SwiGLU
        m = SwiGLU(8, 16)
        x = torch.randn(3, 8)
        g, u = (x @ m.gate_up.weight.t()).chunk(2, -1)
        assert (m(x) - (torch.nn.functional.silu(g) * u) @ m.down.weight.t()).abs().max() < 1e-5
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
    "attention_cpu.py": """
        from attention_cpu import attend_bmm
        q, k, v = torch.randn(2, 4, 6, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
        mask = torch.ones(6, 6, dtype=torch.bool).tril()
        kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
        ref = ((q @ kk.transpose(-2, -1)) / 8 ** 0.5).masked_fill(~mask, float("-inf")).softmax(-1) @ vv
        assert (attend_bmm(q, k, v, block=2) - ref).abs().max() < 1e-5
    """,
    "matvec_cpu.py": """
        from matvec_cpu import MatvecAsReduction
        x, w, b = torch.randn(1, 16), torch.randn(8, 16), torch.randn(8)
        with MatvecAsReduction():
            y = torch.nn.functional.linear(x, w, b)
        assert (y - (x @ w.t() + b)).abs().max() < 1e-5
    """,
    "drop_path.py": """
        from drop_path import DropPath, drop_path
        x = torch.ones(1000, 4)
        y = DropPath(0.5).train()(x)
        assert set(y.unique().tolist()) <= {0.0, 2.0} and 300 < int((y[:, 0] > 0).sum()) < 700
        assert torch.equal(DropPath(0.5).eval()(x), x)
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
            roots = [(node.module or "").split(".")[0]]
            if node.level or roots[0] in siblings:  # a sibling block, inside the package or beside the copy
                assert roots[0] in siblings, f"{path.name} imports blocks/{roots[0]}.py without naming it on " \
                                             f"its Needs: line"
                continue
        else:
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


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_bare_copy_imports_and_runs(path, tmp_path):
    """Copy the block and exactly the siblings it names into an empty folder; run it there in a fresh,
    isolated interpreter (no PYTHONPATH, no user site, zoo blocked from import)."""
    for name in [path.name] + needs(path):
        shutil.copy(BLOCKS / name, tmp_path / name)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted({path.name, *needs(path)})
    code = BLOCKER + textwrap.dedent(SMOKE[path.name]) + "\nprint('ok')\n"
    out = subprocess.run([sys.executable, "-I", "-c", code, str(tmp_path)], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
