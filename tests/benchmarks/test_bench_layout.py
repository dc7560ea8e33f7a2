"""The benchmarks' layout (docs/development.md, *The benchmarks*): the commands at ``benchmarks/*.py``, the code behind
them in rooms (``endtoend/``, ``sweeps/``, ``gpukit/``, ``components/`` for the ``bench_*.py`` ones, ``benchkit/`` for
what they all share), and functions a reader can hold (issue 50, part 4)."""

from __future__ import annotations

import ast
import pathlib

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"
MAX_BODY = 60
ROOMS = ("benchkit", "components", "endtoend", "gpukit", "sweeps")
#: The commands users and the docs call, at their documented paths.
COMMANDS = (
    "accuracy_arm.py",
    "accuracy_seeds.py",
    "bench_generate.py",
    "bench_loss.py",
    "bench_select.py",
    "bench_trl.py",
    "gpu_check.py",
    "overlap.py",
    "speedup.py",
)


def code_files() -> list[pathlib.Path]:
    return [p for p in sorted(BENCH.rglob("*.py")) if p.relative_to(BENCH).parts[0] in (*ROOMS, p.name)]


def long_functions(path: pathlib.Path, limit: int = MAX_BODY) -> dict[str, int]:
    """``{qualified name: body lines}`` of the functions in ``path`` whose body (its docstring not counted) runs over
    ``limit`` lines."""
    long = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    body = child.body
                    doc = isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant)
                    first = body[1] if doc and len(body) > 1 else body[0]
                    if (lines := child.end_lineno - first.lineno + 1) > limit:
                        long[name] = lines
                visit(child, name + ".")

    visit(ast.parse(path.read_text(encoding="utf-8")), "")
    return long


def test_no_function_body_over_60_lines():
    long = {f"{p.relative_to(BENCH)}:{name}": n for p in code_files() for name, n in long_functions(p).items()}
    assert not long, long


def test_a_long_function_is_found(tmp_path):
    path = tmp_path / "m.py"
    path.write_text(
        'class A:\n    def f(self):\n        """doc."""\n' + "        x = 1\n" * 61 + "\ndef g():\n    pass\n"
    )
    assert long_functions(path) == {"A.f": 61}
    assert long_functions(path, limit=61) == {}


def test_the_top_holds_the_commands_and_the_rooms():
    assert sorted(p.name for p in BENCH.glob("*.py")) == sorted(COMMANDS)
    for room in ROOMS:
        face = BENCH / room / "__init__.py"
        assert face.is_file() and ast.get_docstring(ast.parse(face.read_text(encoding="utf-8"))), room


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_runs_as_a_script(command):
    tree = ast.parse((BENCH / command).read_text(encoding="utf-8"))
    assert ast.get_docstring(tree), command
    assert any(
        isinstance(n, ast.If) and isinstance(n.test, ast.Compare) and getattr(n.test.left, "id", "") == "__name__"
        for n in tree.body
    ), f"{command} has no `if __name__ == '__main__':`"


@pytest.mark.parametrize(
    "command,module",
    [("bench_generate", "generation"), ("bench_loss", "loss"), ("bench_select", "selection"), ("bench_trl", "trainer")],
)
def test_a_thin_command_imported_is_its_rooms_module(command, module):
    """``import bench_loss`` (the GPU kit, the tests) gives ``components.loss`` itself, so that what is patched on the
    one is seen by the other."""
    import importlib

    assert importlib.import_module(command) is importlib.import_module(f"components.{module}")
