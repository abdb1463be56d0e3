"""PYTHONPATH for a test's subprocess: this checkout first, then the entries the test process was given (a
machine that installs packages into a separate directory names it there, and the subprocess needs them too)."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def python_path() -> str:
    return os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))
