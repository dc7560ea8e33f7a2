"""The package layout keeps its rules (docs/development.md, *The layout's rules*), read from the code's own imports:
no import circle in ``cppo/``, at most 8 levels (a module one level above everything it imports, imports inside
functions counted, a subpackage's face passed through to the module that defines the name), nothing outside a
subpackage importing one of its modules directly, no module over 500 lines but the Triton kernels and those whose
docstring says why (a signal, not a cap), no function body over 60 lines (its docstring not counted) outside the Triton
kernels, and every module named with its job in docs/training.md."""

from __future__ import annotations

import ast
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
CPPO = REPO / "cppo"
MAX_LEVELS = 8
MAX_LINES = 500
#: A function's body at most (its docstring not counted): what a reader holds at once (issue 50).
MAX_FUNCTION_LINES = 60


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(CPPO.rglob("*.py"))}
PACKAGES = {name for name, p in MODULES.items() if p.name == "__init__.py"}
#: The subpackages of cppo (each with a face): config, distributed, engines, run, step, tasks, trl.
SUBPACKAGES = sorted(p for p in PACKAGES if p.count(".") == 1)


def absolute(module: str, level: int, target: str | None) -> str:
    """The absolute name of ``from <level dots><target> import ...`` written in ``module``."""
    if not level:
        return target or ""
    base = module if module in PACKAGES else module.rsplit(".", 1)[0]
    for _ in range(level - 1):
        base = base.rsplit(".", 1)[0]
    return f"{base}.{target}" if target else base


def imports(path: pathlib.Path, module: str) -> list[tuple[str, str | None]]:
    """``(imported module, name or None)`` of every import in ``path``, inside functions too."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            source = absolute(module, node.level, node.module)
            found += [(source, a.name) for a in node.names]
    return found


def defining_module(package: str, name: str, depth: int = 0) -> str:
    """The module that defines ``name`` handed on by ``package``'s face (a face passed through)."""
    if f"{package}.{name}" in MODULES:
        return f"{package}.{name}"
    for source, imported in imports(MODULES[package], package):
        if imported == name and source in MODULES:
            return defining_module(source, name, depth + 1) if source in PACKAGES and depth < 5 else source
    return package


def is_face(module: str) -> bool:
    """An ``__init__.py`` that only hands names on (imports, ``__all__`` and its docstring)."""
    if module not in PACKAGES or module == "cppo":
        return False
    body = ast.parse(MODULES[module].read_text(encoding="utf-8")).body
    return all(isinstance(n, (ast.Import, ast.ImportFrom, ast.Expr, ast.Assign)) for n in body)


def graph() -> dict[str, set[str]]:
    """``module -> the modules of cppo it imports``, faces passed through (and not themselves nodes)."""
    edges: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        if is_face(module):
            continue
        deps = set()
        for source, name in imports(path, module):
            if not source.startswith("cppo") or source.startswith("cppo_kernels"):
                continue
            target = f"{source}.{name}" if name and f"{source}.{name}" in MODULES else source
            if target in PACKAGES and name and f"{source}.{name}" not in MODULES:
                target = defining_module(target, name)
            if target in MODULES and target != module:
                deps.add(target)
        edges[module] = deps
    return {m: {d for d in deps if d in edges} for m, deps in edges.items()}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in edges:
        if v not in index:
            visit(v)
    return found


def levels(edges: dict[str, set[str]]) -> dict[str, int]:
    level: dict[str, int] = {}

    def of(m: str) -> int:
        if m not in level:
            level[m] = 1 + max((of(d) for d in edges[m]), default=0)
        return level[m]

    for m in edges:
        of(m)
    return level


EDGES = graph()


def test_no_import_circle():
    assert circles(EDGES) == []


def test_at_most_eight_levels_and_every_import_goes_down():
    level = levels(EDGES)
    assert max(level.values()) <= MAX_LEVELS, sorted(level.items(), key=lambda kv: -kv[1])[:4]
    assert all(level[d] < level[m] for m, deps in EDGES.items() for d in deps)


def test_the_levels_are_measured_through_function_imports_too():
    """cli imports the trainer inside a function: it still stands above it."""
    level = levels(EDGES)
    assert "cppo.trainer" in EDGES["cppo.cli"] and level["cppo.cli"] > level["cppo.trainer"]
    assert circles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]


def outside_files() -> list[pathlib.Path]:
    """The code that is not tests: cppo/, benchmarks/, examples/."""
    return [
        *sorted(CPPO.rglob("*.py")),
        *sorted((REPO / "benchmarks").rglob("*.py")),
        *sorted((REPO / "examples").rglob("*.py")),
    ]


def private_imports(path: pathlib.Path) -> list[str]:
    """The imports in ``path`` of a subpackage's module from outside that subpackage."""
    module = module_name(path) if path.is_relative_to(CPPO) else path.stem
    wrong = []
    for source, name in imports(path, module):
        target = f"{source}.{name}" if name and f"{source}.{name}" in MODULES else source
        package = next((p for p in SUBPACKAGES if target.startswith(p + ".")), None)
        if package and target not in PACKAGES and not (module == package or module.startswith(package + ".")):
            wrong.append(f"{path.relative_to(REPO) if path.is_relative_to(REPO) else path.name} imports {target}")
    return wrong


def test_nothing_outside_a_subpackage_imports_its_modules():
    """A subpackage's face (its __init__.py) names what the rest may import; its modules are its own business."""
    wrong = [line for path in outside_files() for line in private_imports(path)]
    assert not wrong, wrong


def test_a_private_import_is_found(tmp_path):
    bad = tmp_path / "bench.py"
    bad.write_text("from cppo.step.models import lm_head\nfrom cppo.step import Pruning\nimport cppo.run.lock\n")
    assert private_imports(bad) == ["bench.py imports cppo.step.models", "bench.py imports cppo.run.lock"]


def says_why_it_is_long(path: pathlib.Path) -> bool:
    """The module's docstring says why it runs over :data:`MAX_LINES` (a sentence naming "500 lines")."""
    return f"{MAX_LINES} lines" in (ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or "")


@pytest.mark.parametrize("root", ["cppo", "cppo_kernels", "benchmarks", "examples"])
def test_no_module_over_500_lines_but_the_triton_kernels(root):
    """The size is a signal, not a cap (issue 50): a module over 500 lines says why in its docstring."""
    long = {
        p.relative_to(REPO).as_posix(): n
        for p in (REPO / root).rglob("*.py")
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES
        and not p.name.endswith("_triton.py")
        and not says_why_it_is_long(p)
    }
    assert not long, long


def body_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """The lines of a function's body, from its first statement after the docstring to its end (a nested function
    counted in it)."""
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:] if isinstance(body[0].value.value, str) else body
    return node.end_lineno - body[0].lineno + 1 if body else 0


def long_functions(source: str, where: str) -> dict[str, int]:
    """``{"WHERE:LINE NAME": body lines}`` of each function of ``source`` whose body is over
    :data:`MAX_FUNCTION_LINES`."""
    return {
        f"{where}:{node.lineno} {node.name}": n
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and (n := body_lines(node)) > MAX_FUNCTION_LINES
    }


def test_a_long_function_is_found():
    fits = "def fits():\n    '''Its docstring, not counted.'''\n" + "    x = 1\n" * MAX_FUNCTION_LINES
    long = "class C:\n    async def long(self):\n" + "        x = 1\n" * (MAX_FUNCTION_LINES + 1)
    assert long_functions(fits + "\n\n" + long, "m.py") == {
        f"m.py:{MAX_FUNCTION_LINES + 6} long": MAX_FUNCTION_LINES + 1
    }


@pytest.mark.parametrize("root", ["cppo", "cppo_kernels"])
def test_no_function_body_over_60_lines_but_in_the_triton_kernels(root):
    """Functions a reader can hold (issue 50): no body over 60 lines, its docstring not counted (the benchmarks'
    functions: tests/benchmarks/test_bench_layout.py)."""
    long = {}
    for path in sorted((REPO / root).rglob("*.py")):
        if not path.name.endswith("_triton.py"):
            long |= long_functions(path.read_text(encoding="utf-8"), path.relative_to(REPO).as_posix())
    assert not long, long


def test_the_module_map_names_every_module_with_its_job():
    """docs/training.md's table *Where each part lives*: a row per module of cppo/ and per subpackage."""
    text = (REPO / "docs" / "training.md").read_text(encoding="utf-8")
    table = text.split("## Where each part lives", 1)[1].split("\n## ", 1)[0]
    rows = {line.split("|")[1].strip().strip("`") for line in table.splitlines() if line.startswith("| `cppo/")}
    want = {p.relative_to(REPO).as_posix() for p in CPPO.rglob("*.py") if p.name != "__init__.py" or p.parent == CPPO}
    want |= {f"{p.replace('.', '/')}/" for p in SUBPACKAGES}
    assert want - rows == set(), sorted(want - rows)
    assert rows - want == set(), sorted(rows - want)  # no row for a module that is gone
