"""pyproject.toml declares what the code imports, and nothing it does not: every third-party
module imported anywhere (zoo/, train/, tests/) belongs to a declared distribution; what zoo/ and
train/ import at module level is a base dependency (so the base install can import them); every
declared distribution is imported somewhere."""
import ast
import functools
import importlib.metadata as md
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the project's own packages, and its files imported by bare name (a copied block's sibling, a test helper)
# tests' helpers and the copyable blocks import their neighbours by bare name; the rest of zoo/ and train/ through
# their package (a file there may share a distribution's name: train/benches/mup.py)
LOCAL = {"zoo", "train", "tests", "sitecustomize"} | {p.stem for d in ("tests", "zoo/blocks")
                                                      for p in (ROOT / d).glob("*.py")}
# modules of distributions that are not installed here (packages_distributions() cannot see them)
NOT_INSTALLED = {"flash_attn": "flash-attn", "bitsandbytes": "bitsandbytes", "fla": "flash-linear-attention",
                 "mamba_ssm": "mamba-ssm", "mlflow": "mlflow-skinny"}
PLUGINS = {"pytest-xdist": "the README's test command runs the suite in two workers (pytest -n 2)",  # used, not imported
           "sqlalchemy": "MLflow's SQLite store (train.tracker=mlflow)", "alembic": "MLflow's SQLite store",
           "num2words": "needed by transformers' SmolVLMProcessor, the VLM processor's reference"}
# calls whose first string argument is a module imported by name
BY_NAME = {"import_module", "importorskip", "optional_module", "optional_kernel", "find_spec"}


def _norm(dist: str) -> str:
    return re.sub(r"[-_.]+", "-", dist).lower()


def declared():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    name = lambda req: _norm(re.split(r"[\s<>=!~\[;]", req, maxsplit=1)[0])
    base = {name(r) for r in project["dependencies"]}
    extras = {x: {name(r) for r in reqs} for x, reqs in project.get("optional-dependencies", {}).items()}
    return base, extras


def imports(path: Path):
    """(top-level module, at module level?) for each import of a Python file; an import inside
    a function, or inside try/except ImportError, is not at module level."""
    tree = ast.parse(path.read_text(), str(path))
    found = []

    def visit(node, guarded):
        for child in ast.iter_child_nodes(node):
            g = guarded or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Try))
            if isinstance(child, ast.Import):
                found.extend((a.name.split(".")[0], not g) for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                found.append((child.module.split(".")[0], not g))
            elif (isinstance(child, ast.Call) and child.args and isinstance(child.args[0], ast.Constant)
                  and isinstance(child.args[0].value, str)
                  and getattr(child.func, "attr", getattr(child.func, "id", None)) in BY_NAME):
                found.append((child.args[0].value.split(".")[0], False))
            visit(child, g)

    visit(tree, False)
    return found


def third_party(module: str) -> bool:
    return module not in sys.stdlib_module_names and module not in LOCAL and not module.startswith("_")


@functools.cache
def _installed():
    return md.packages_distributions()


def distribution(module: str) -> str:
    dists = _installed().get(module) or [NOT_INSTALLED.get(module, module)]
    return _norm(dists[0])


def sources(*folders):
    for folder in folders:
        yield from sorted((ROOT / folder).rglob("*.py"))


def test_every_import_is_declared_and_module_level_imports_are_base_dependencies():
    base, extras = declared()
    every = base.union(*extras.values())
    undeclared, not_base = [], []
    for path in sources("zoo", "train", "tests"):
        for module, top in imports(path):
            if not third_party(module):
                continue
            dist = distribution(module)
            where = f"{path.relative_to(ROOT)}: {module} ({dist})"
            if dist not in every:
                undeclared.append(where)
            elif top and path.parts[len(ROOT.parts)] in ("zoo", "train") and dist not in base:
                not_base.append(where)
    assert not undeclared, f"imported but not declared in pyproject.toml: {undeclared}"
    assert not not_base, f"imported at module level by the package but only an extra: {not_base}"


def test_every_declared_distribution_is_imported():
    base, extras = declared()
    used = {distribution(m) for p in sources("zoo", "train", "tests") for m, _ in imports(p) if third_party(m)}
    unused = sorted(d for d in base.union(*extras.values()) if d not in used and d not in PLUGINS)
    assert not unused, f"declared in pyproject.toml and never imported: {unused}"


def test_the_checker_sees_what_it_checks(tmp_path):
    """The AST walk finds plain, from-, guarded and by-name imports, and tells module level apart."""
    f = tmp_path / "m.py"
    f.write_text("import yaml\nfrom PIL import Image\ntry:\n    import wandb\nexcept ImportError:\n    pass\n"
                 "def f():\n    import timm\n    importlib.import_module('flash_attn.x')\n")
    assert imports(f) == [("yaml", True), ("PIL", True), ("wandb", False), ("timm", False), ("flash_attn", False)]
    assert distribution("PIL") == "pillow" and distribution("flash_attn") == "flash-attn"
    assert not third_party("json") and not third_party("zoo") and third_party("numpy")
