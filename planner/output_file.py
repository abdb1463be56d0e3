"""``--out``: the file a command writes its result to, checked before any work and written atomically.

``check_out_path`` runs first, so a run never ends in an error about where its result goes: the folder must
exist and be writable, the path must not be a directory or anything but a regular file, and it must not be
one of the command's inputs. ``write_atomically`` writes a temporary file in the same folder and renames it
over the target, so the target holds either its old contents or the complete new ones.
"""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Iterable
from pathlib import Path

from planner.errors import ConfigError
from planner.inputs import reason

OUT_FLAG = "--out"
#: What the errors about --out name as their source.
COMMAND_LINE = "command line"


def check_out_path(out: str, inputs: Iterable[tuple[str, Path | None]]) -> Path:
    """``out`` as a Path a result can be written to; ConfigError naming --out otherwise.

    ``inputs``: (flag, file) of every file the command reads (None where the flag names no file); ``out``
    may be none of them, by any spelling or link."""
    path = Path(out)
    try:
        info = os.stat(path)
    except FileNotFoundError:
        info = None
    except (OSError, ValueError) as error:
        raise ConfigError(COMMAND_LINE, OUT_FLAG, out, f"cannot write there: {reason(error)}") from None
    if info is not None and stat.S_ISDIR(info.st_mode):
        raise ConfigError(COMMAND_LINE, OUT_FLAG, out, "is a directory; give a file path")
    if info is not None and not stat.S_ISREG(info.st_mode):
        raise ConfigError(COMMAND_LINE, OUT_FLAG, out,
                          "is not a regular file (a device, FIFO or socket); give a file path")
    folder = path.parent
    try:
        folder_info = os.stat(folder)
    except (OSError, ValueError) as error:
        raise ConfigError(COMMAND_LINE, OUT_FLAG, out,
                          f"its folder {str(folder)!r} cannot be used: {reason(error)}") from None
    if not stat.S_ISDIR(folder_info.st_mode):
        raise ConfigError(COMMAND_LINE, OUT_FLAG, out, f"{str(folder)!r} is not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(COMMAND_LINE, OUT_FLAG, out, f"the folder {str(folder)!r} is not writable")
    if info is not None:
        for flag, source in inputs:
            if source is not None and _same_file(path, source):
                raise ConfigError(COMMAND_LINE, OUT_FLAG, out,
                                  f"is the {flag} input; writing it would overwrite that input")
    return path


def config_inputs(model: str | None, hardware: str | None, serving: str | None) -> list[tuple[str, Path | None]]:
    """(flag, file) of the config files that the --model, --hardware and --serving specs name (None where a
    spec names no file): inputs --out may not overwrite."""
    from planner.loader import resolve_config

    flags = (("--model", model, "models"), ("--hardware", hardware, "hardware"), ("--serving", serving, "serving"))
    return [(flag, resolve_config(spec, kind) if spec else None) for flag, spec, kind in flags]


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in its folder and a rename."""
    try:
        handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as error:
        raise ConfigError(COMMAND_LINE, OUT_FLAG, str(path), f"cannot write: {reason(error)}") from None
    try:
        os.fchmod(handle, file_mode(path))
        with os.fdopen(handle, "w", encoding="utf-8") as stream:
            stream.write(text)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, path)
    except OSError as error:
        Path(temporary).unlink(missing_ok=True)
        raise ConfigError(COMMAND_LINE, OUT_FLAG, str(path), f"cannot write: {reason(error)}") from None
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def file_mode(path: Path) -> int:
    """The permission bits the written file gets: the replaced file's, else what the umask leaves of 0o666."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except (OSError, ValueError):
        return False
