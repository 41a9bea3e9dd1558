"""The package's layering, read from the source: every module under src/hydraspec is parsed with ast (imports
at any depth: module level, in functions, relative or absolute) into an import graph, which must have no cycle;
only cli.py imports hydraspec.cli; only backend.py, quantize.py and the models package import the CPU backend
(hydraspec.cpu); no module imports another's private (leading underscore) name."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
ROOT = "hydraspec"
# the modules that may import the CPU backend (besides the backend's own): the seam, the draft quantizer and the
# loader
CPU_GATES = (f"{ROOT}.backend", f"{ROOT}.quantize", f"{ROOT}.models")


def module_names(src: Path = SRC) -> dict[str, Path]:
    """{dotted module name: file} for every .py file of the package (a package is its __init__)."""
    out = {}
    for path in sorted((src / ROOT).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def is_package(name: str, modules: dict[str, Path]) -> bool:
    return modules[name].name == "__init__.py"


def imports_of(name: str, tree: ast.AST, modules: dict[str, Path]):
    """(target module, imported name or None, line) for every import of a package module in ``tree``.
    ``from X import y`` is an import of X.y when that is a module, else of X with the name y."""
    pkg = name if is_package(name, modules) else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == ROOT or a.name.startswith(ROOT + "."):
                    yield a.name, None, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not (target == ROOT or target.startswith(ROOT + ".")):
                continue
            for a in node.names:
                sub = f"{target}.{a.name}"
                if sub in modules:
                    yield sub, None, node.lineno
                else:
                    yield target, a.name, node.lineno


def owner(target: str, modules: dict[str, Path]) -> str:
    """The module a dotted import lands in (``import hydraspec.x.y`` of a module hydraspec.x.y, or an
    attribute path under it)."""
    while target not in modules and "." in target:
        target = target.rpartition(".")[0]
    return target


def edges(name: str, target: str, modules: dict[str, Path]) -> list[str]:
    """The modules an import of ``target`` by ``name`` runs: the target, and from outside a package (a.b of
    a.b.c) that package's __init__ too. A submodule importing its own package's modules adds no edge to it."""
    out = []
    parts = target.split(".")
    for i in range(1, len(parts) + 1):
        mod = ".".join(parts[:i])
        inside = name == mod or name.startswith(mod + ".")
        if mod in modules and mod != name and (mod == target or not inside):
            out.append(mod)
    return out


def import_graph(modules: dict[str, Path], sources: dict[str, str] | None = None):
    """{module: {imported module: first line}} and the list of (module, target, name, line) of every import.
    ``sources``: the modules' text (default: read from their files)."""
    graph: dict[str, dict[str, int]] = {m: {} for m in modules}
    found = []
    for name, path in modules.items():
        text = sources[name] if sources is not None else path.read_text()
        for target, imported, line in imports_of(name, ast.parse(text, filename=str(path)), modules):
            target = owner(target, modules)
            found.append((name, target, imported, line))
            for mod in edges(name, target, modules):
                graph[name].setdefault(mod, line)
    return graph, found


def find_cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    """One import cycle as [m0, m1, ..., m0], or None."""
    state: dict[str, int] = {}  # 1: on the DFS stack, 2: done
    stack: list[str] = []

    def visit(m: str):
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state:
                cyc = visit(n)
                if cyc:
                    return cyc
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            cyc = visit(m)
            if cyc:
                return cyc
    return None


def is_cpu(module: str) -> bool:
    return module == f"{ROOT}.cpu" or module.startswith(f"{ROOT}.cpu.")


def layer_problems(src: Path = SRC) -> list[str]:
    modules = module_names(src)
    graph, found = import_graph(modules)
    problems = []
    cyc = find_cycle(graph)
    if cyc:
        problems.append("import cycle: " + " -> ".join(
            f"{a} (line {graph[a][b]})" for a, b in zip(cyc, cyc[1:])) + f" -> {cyc[-1]}")
    for name, target, imported, line in found:
        if target == f"{ROOT}.cli" and name != target:
            problems.append(f"{name} line {line} imports {ROOT}.cli: only the command line may")
        if is_cpu(target) and not is_cpu(name) and not any(name == g or name.startswith(g + ".") for g in CPU_GATES):
            problems.append(f"{name} line {line} imports {target}: only {', '.join(CPU_GATES)} reach the CPU backend")
        private = imported is not None and imported.startswith("_") and not \
            (imported.startswith("__") and imported.endswith("__"))
        if private and target != name:
            problems.append(f"{name} line {line} imports the private name {imported} from {target}")
    return problems


def test_the_package_keeps_its_layers():
    assert len(module_names()) > 40  # the package was found
    assert layer_problems() == []


BAD = {
    "cycle": ("tree.py", "\n\ndef _late():\n    from .engine import Engine\n"),
    "private": ("engine.py", "\nfrom .cache import _nothing  # noqa\n"),
    "private, from a parent package's module": ("drafters/base.py", "\nfrom ..errors import _secret  # noqa\n"),
    "cli": ("bench/stats.py", "\n\ndef _late():\n    import hydraspec.cli\n"),
    "cpu": ("heads/modules.py", "\n\ndef _late():\n    from ..cpu import kernels  # noqa\n"),
    "cpu, a package import": ("trees/measure.py", "\nimport hydraspec.cpu.gguf  # noqa\n"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_the_check_fails_on_a_bad_import(tmp_path, case):
    """A copy of the package with one bad import added is refused, naming it."""
    import shutil

    shutil.copytree(SRC / ROOT, tmp_path / ROOT, ignore=shutil.ignore_patterns("__pycache__", "*.so", "build"))
    rel, code = BAD[case]
    path = tmp_path / ROOT / rel
    path.write_text(path.read_text() + code)
    word = {"cycle": "import cycle", "cli": "imports hydraspec.cli", "cpu": "reach the CPU backend",
            "cpu, a package import": "reach the CPU backend"}.get(case, "imports the private name")
    assert any(word in p for p in layer_problems(tmp_path))  # (a cli import is also a cycle)


def test_a_package_init_counts():
    """Importing a module of a subpackage from outside runs the subpackage's __init__: an __init__ that
    imports its importer back is a cycle; a submodule importing a sibling is not."""
    modules = {"hydraspec": Path("__init__.py"), "hydraspec.low": Path("low.py"),
               "hydraspec.sub": Path("sub/__init__.py"), "hydraspec.sub.a": Path("sub/a.py"),
               "hydraspec.sub.b": Path("sub/b.py")}
    src = {"hydraspec": "", "hydraspec.low": "from .sub.a import x\n", "hydraspec.sub": "from .b import y\n",
           "hydraspec.sub.a": "from .b import y\n", "hydraspec.sub.b": "def y(): from ..low import z\n"}
    graph, _ = import_graph(modules, src)
    assert graph["hydraspec.low"] == {"hydraspec.sub": 1, "hydraspec.sub.a": 1}
    assert graph["hydraspec.sub.a"] == {"hydraspec.sub.b": 1}
    assert find_cycle(graph) == ["hydraspec.low", "hydraspec.sub", "hydraspec.sub.b", "hydraspec.low"]
