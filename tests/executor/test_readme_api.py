"""The README's Python API example runs in the simulator as written."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"
MARKER = "<!-- api-example: runs in CI -->"


def test_readme_api_example_runs(capsys):
    text = README.read_text()
    assert MARKER in text
    block = re.search(r"```python\n(.*?)```", text[text.index(MARKER):], re.S)
    exec(compile(block[1], f"{README}:api-example", "exec"), {})
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("[1, 2, 3] -> [") and lines[0].endswith("] length")
    assert lines[1].startswith("[4, 5] -> [")
    assert lines[2].endswith("bytes of KV cache; 6 tokens generated")
