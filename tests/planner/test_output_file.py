"""``--out``: refused up front when it cannot be written or is an input; written atomically."""

from __future__ import annotations

import os

import pytest

from planner.errors import ConfigError
from planner.output_file import check_out_path, write_atomically


def test_a_new_file_in_an_existing_folder_is_accepted(tmp_path):
    assert check_out_path(str(tmp_path / "plan.json"), []) == tmp_path / "plan.json"


@pytest.mark.parametrize("target, rule", [
    ("missing/plan.json", "cannot be used"),
    ("folder", "is a directory"),
    ("input.yaml", "is the --model input"),
    ("link.yaml", "is the --model input"),
    ("folder/../input.yaml", "is the --model input"),
])
def test_an_unwritable_or_input_path_is_refused_naming_out(tmp_path, target, rule):
    (tmp_path / "folder").mkdir()
    (tmp_path / "input.yaml").write_text("name: x\n")
    (tmp_path / "link.yaml").symlink_to(tmp_path / "input.yaml")
    with pytest.raises(ConfigError, match=rule) as error:
        check_out_path(str(tmp_path / target), [("--model", tmp_path / "input.yaml"), ("--serving", None)])
    assert (error.value.source, error.value.field) == ("command line", "--out")


def test_a_device_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="not a regular file"):
        check_out_path("/dev/null", [])


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    target = tmp_path / "out.jsonl"
    target.write_text("old\n")
    os.chmod(target, 0o640)

    def fail(source, destination):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(ConfigError, match="No space left on device"):
        write_atomically(target, "new\n")
    assert target.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl"]
    monkeypatch.undo()
    write_atomically(target, "new\n")
    assert target.read_text() == "new\n" and (target.stat().st_mode & 0o777) == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl"]


def test_a_folder_that_takes_no_temporary_file_is_one_error_naming_out(tmp_path, monkeypatch):
    """/proc and /sys pass the folder checks but refuse a new file there: the temporary file's creation."""
    import tempfile

    def refuse(**kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "mkstemp", refuse)
    with pytest.raises(ConfigError, match="cannot write: Permission denied") as error:
        write_atomically(tmp_path / "plan.json", "{}\n")
    assert (error.value.source, error.value.field) == ("command line", "--out")
    assert list(tmp_path.iterdir()) == []
