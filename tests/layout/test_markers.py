"""Every test that compiles kernels to sm_90 PTX carries ``@pytest.mark.ptx``, so the default run (CI's) leaves
it out and ``-m ptx`` finds it: a check added without the marker would put minutes of Numba's front end back
into CI."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def _marks(function: ast.FunctionDef) -> set[str]:
    """The ``pytest.mark.<name>`` decorators of a test function."""
    names = set()
    for decorator in function.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        if isinstance(target, ast.Attribute) and ast.unparse(target.value) == "pytest.mark":
            names.add(target.attr)
    return names


def _compiles_for_sm90(function: ast.FunctionDef) -> bool:
    return any(isinstance(node, ast.Call) and ast.unparse(node.func) == "compile_for_sm90"
               for node in ast.walk(function))


def test_every_sm90_compile_check_carries_the_ptx_mark():
    checks, unmarked = 0, []
    for path in sorted(TESTS.rglob("test_*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_") and _compiles_for_sm90(node):
                checks += 1
                if "ptx" not in _marks(node):
                    unmarked.append(f"{path.relative_to(TESTS)}::{node.name}")
    assert checks >= 30, f"found {checks} sm_90 compile checks; the walk missed them"
    assert not unmarked, f"sm_90 compile checks without @pytest.mark.ptx: {unmarked}"
