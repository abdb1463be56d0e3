"""A non-editable install (the wheel pip builds from the checkout) runs `memplan plan` from any directory:
the shipped configs and schemas travel as package data."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_non_editable_install_plans_from_outside_the_checkout(tmp_path):
    source = tmp_path / "source"  # a copy: building leaves build/ and *.egg-info beside the sources
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for package in ("planner", "executor"):
        shutil.copytree(ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps",
                    "--no-build-isolation", "--no-index", "--target", str(target), str(source)],
                   check=True, capture_output=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(target)}

    def memplan(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, str(target / "bin" / "memplan"), *argv], cwd=elsewhere, env=env,
                              capture_output=True, text=True)

    where = subprocess.run([sys.executable, "-c", "import planner; print(planner.__file__)"], cwd=elsewhere,
                           env=env, capture_output=True, text=True, check=True).stdout
    assert where.startswith(str(target))  # the installed copy, not the checkout
    version = memplan("--version")
    assert version.returncode == 0 and version.stdout.startswith("memplan ")
    table = memplan("plan", "--model", "qwen3-8b", "--hardware", "h100", "--format", "table")
    assert table.returncode == 0, table.stderr
    assert table.stdout.startswith("memplan: qwen3-8b on h100-sxm")
    readme = memplan("plan", "--model", "qwen3-8b", "--hardware", "h200", "--format", "table")  # the README's first
    assert readme.returncode == 0, readme.stderr  # h200's default_serving (serving/h200.yaml) ships with the package
    assert "step capacity: batch 256, tokens 8,447" in readme.stdout
    plan = memplan("plan", "--model", "tiny-qwen3.5", "--hardware", "cpu-sim", "--out", "plan.json")
    assert plan.returncode == 0, plan.stderr
    validated = memplan("validate", "plan.json")  # the shipped schemas load from the package
    assert validated.returncode == 0, validated.stderr + validated.stdout
