"""The import graph, built from the source (imports inside functions included, since they are
edges too, only deferred): no cycles in zoo/ or train/, zoo never imports train, and inside train/
every import goes down its layers (LAYERS; docs/architecture.md)."""
import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("zoo", "train")
# train/'s layers, bottom to top: a module imports from its own layer and those below, never from one
# above (a piece two layers share moves down, or is passed in). A new module of train/ is placed here.
LAYERS = [
    ("base", ("train.hardware", "train.plots", "train.step", "train.optim", "train.data", "train.distributed",
              "train.model_parallel", "train.grad_compression")),
    ("config", ("train.config",)),
    ("run parts", ("train.features", "train.model", "train.checkpoint", "train.metrics", "train.finish")),
    ("scoring", ("train.eval", "train.chat", "train.predict", "train.sample_quality")),
    ("tasks", ("train.tasks",)),
    ("assembly", ("train.planner", "train.builder")),
    ("loop", ("train.loop",)),
    ("programs", ("train.run", "train.plan", "train.prepare", "train.sample", "train.docs", "train.bench",
                  "train.benches")),
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def imports_of(name: str, path: Path, known: set) -> set:
    """The project modules `name` imports (absolute and relative, at any depth of the file)."""
    is_pkg = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[:len(base) - node.level + 1]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            targets = [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in known else prefix for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:  # `import zoo.blocks.rope as r` -> zoo.blocks.rope; a name -> its module
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


@functools.cache
def graph() -> dict[str, set]:
    mods = modules()
    return {n: imports_of(n, p, set(mods)) for n, p in mods.items()}


def cycles(g: dict[str, set]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def layer_of(module: str) -> int:
    """The index in LAYERS of a module of train/."""
    found = [i for i, (_, names) in enumerate(LAYERS) for n in names if module == n or module.startswith(n + ".")]
    assert found, f"{module}: not in any of tests/test_imports.py's LAYERS (place it there)"
    return found[0]


def upward_imports(g: dict[str, set]) -> list[str]:
    """Every import inside train/ from a module to one of a higher layer, as 'importer (layer) -> imported (layer)'."""
    name = lambda m: f"{m} ({LAYERS[layer_of(m)][0]})"  # noqa: E731
    return sorted(f"{name(m)} -> {name(t)}" for m, ts in g.items() if m.startswith("train.")
                  for t in ts if t.startswith("train.") and layer_of(t) > layer_of(m))


def test_the_graph_sees_relative_and_deferred_imports():
    g = graph()
    assert "train.step" in g["train.loop"]            # from .step import ...
    assert "train.chat" in g["train.eval"]            # inside a function
    assert "zoo.config" in g["train.config"]          # absolute
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles():
    assert cycles(graph()) == []


def test_train_imports_only_down_its_layers():
    assert upward_imports(graph()) == []
    assert upward_imports({"train.config": {"train.tasks.lm", "train.optim"}, "train.tasks.lm": {"train.config"}}) \
        == ["train.config (config) -> train.tasks.lm (tasks)"]


def test_zoo_never_imports_train():
    bad = {m: sorted(t for t in ts if t.split(".")[0] == "train") for m, ts in graph().items() if m.startswith("zoo")}
    assert {m: ts for m, ts in bad.items() if ts} == {}


def test_tests_take_their_device_from_conftest():
    """No test constructs a device itself (torch.device("cpu"), device="cuda", "device": "cpu",
    "train.device=cpu"): each takes tests/conftest.py's (the `device` fixture, TEST_DEVICE, or CPU and CUDA
    where a device is data or a test is CPU-only), so ZOO_TEST_DEVICE=cuda moves the whole suite. A line
    that names a device as data says so in a comment."""
    literal = lambda n: isinstance(n, ast.Constant) and n.value in ("cpu", "cuda")  # noqa: E731
    found = []
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        if path.name == "test_imports.py":
            continue
        lines = path.read_text().split("\n")
        for n in ast.walk(ast.parse(path.read_text())):
            bad = ((isinstance(n, ast.Call) and ast.unparse(n.func) == "torch.device" and any(map(literal, n.args)))
                   or (isinstance(n, ast.keyword) and n.arg == "device" and literal(n.value))
                   or (isinstance(n, ast.Dict) and any(isinstance(k, ast.Constant) and k.value == "device"
                                                       and literal(v) for k, v in zip(n.keys, n.values)))
                   or (isinstance(n, ast.Constant) and isinstance(n.value, str)
                       and n.value.startswith(("train.device=cpu", "train.device=cuda"))))
            if bad and "# a device as data" not in lines[n.lineno - 1]:
                found.append(f"{path.name}:{n.lineno}")
    assert not found, found


def test_the_cuda_switch_is_refused_without_cuda_and_a_no_op_on_the_cpu(device):
    import os
    import subprocess
    import sys

    import torch

    from conftest import CPU
    assert device == torch.device(os.environ.get("ZOO_TEST_DEVICE", "cpu"))
    if device.type == "cpu":
        assert torch.get_default_device() == CPU
    if torch.cuda.is_available():
        return
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_imports.py",
                        "-k", "device_from_conftest"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "ZOO_TEST_DEVICE": "cuda"})
    assert r.returncode == 4 and "ZOO_TEST_DEVICE=cuda: torch sees no CUDA device" in r.stderr, (r.stdout, r.stderr)


def test_architectures_are_named_in_their_records_only():
    """What makes an architecture what it is lives in its record (zoo/archs), which the machinery reads: no
    branch on a particular architecture (`arch == "..."`, `arch in ("...", ...)`, `model_type == ...`)
    anywhere in zoo/ or train/ outside the records, and no Hugging Face class or model_type named outside
    the records and their readers (zoo/weights/hf_llm.py, gguf_llm.py; the benchmarks name the reference
    libraries' classes they run)."""
    import re
    from zoo.archs import RECORDS
    names = {f'"{n}"' for r in RECORDS.values() for n in (r.hf_class, r.model_type)}
    branch = re.compile(r"\b(arch|architecture|model_type)\b\s*(==\s*[\"']|!=\s*[\"']|(not )?in\s*[(\[{])|"
                        r"\bmodel_type\b\s*==")
    readers = {"hf_llm.py", "gguf_llm.py"}
    found = []
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            if path.parent.name == "archs":
                continue
            for i, line in enumerate(path.read_text().splitlines(), 1):
                named = path.name not in readers and path.parent.name != "benches" and any(n in line for n in names)
                if branch.search(line) or named:
                    found.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not found, "\n".join(found)
