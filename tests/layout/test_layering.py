"""The host side of the executor and the whole planner import neither torch nor numba, and the
routing table the docs render is the one the code uses."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: Modules that run on the host only: scheduling, paging, step and tile planning, routing, workload.
HOST_MODULES = (
    "executor.page_allocator", "executor.page_tables", "executor.prefix_cache", "executor.routing",
    "executor.scheduler", "executor.step", "executor.tiles", "executor.workload", "executor.run_report",
    "planner.cli", "planner.plan", "planner.loader", "planner.validate", "planner.report", "planner.schema",
)

#: Installed in the child before anything else: importing a blocked package raises.
BLOCKER = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('torch', 'numba', 'llvmlite', 'cuda'):
            raise ImportError(f'host-side import of {name}')
        return None
sys.meta_path.insert(0, Block())
"""


def test_host_modules_import_neither_torch_nor_numba():
    code = BLOCKER + "\n".join(f"import {module}" for module in HOST_MODULES)
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


def test_blocker_blocks():
    """The blocker itself works: a module that needs torch fails under it."""
    code = BLOCKER + "import executor.arena"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "host-side import of torch" in result.stderr


def test_docs_kernels_md_is_the_routing_table():
    from executor.routing import render_markdown

    assert (ROOT / "docs" / "kernels.md").read_text() == render_markdown(), (
        "docs/kernels.md differs from executor/routing.py: run python3 -m executor.routing > docs/kernels.md")



def test_the_package_imports_nothing_from_tests_or_bench():
    """planner/ and executor/ are what ``pip install`` ships; tests/ and bench/ are not in the wheel, so
    an import of them works in a clone and fails in an installed package."""
    import ast

    offenders = []
    for package in ("planner", "executor"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
                offenders += [f"{path.relative_to(ROOT)}:{node.lineno} imports {name}" for name in names
                              if name.split(".")[0] in ("tests", "bench")]
    assert not offenders, "\n".join(offenders)
