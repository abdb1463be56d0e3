"""The persistent kernel cache: compiled kernels (cubins) on disk, by content key.

Where: ``$MEMPLAN_CACHE_DIR``, else ``${XDG_CACHE_HOME:-~/.cache}/memplan``; entries live under
``kernels/<first two hex digits of the key>/<key>.kernel``. ``MEMPLAN_KERNEL_CACHE=0`` turns the
cache off (``memplan run --no-kernel-cache`` sets it); the simulator compiles nothing, so the cache
is off there too. The key (executor/kernel_key.py) covers everything that changes the machine code.

An entry is a magic line, the header's length (8 bytes, big-endian), a JSON header (format, key,
entry point, kernel name, argument types, arch, toolchain, the image's size and SHA-256) and the
image. It is written to a temporary file in its directory and renamed over the entry (atomic on
POSIX): a reader sees a whole entry or none, and processes filling one key at once each rename a
whole entry (the last one stays; they hold the same kernel). ``load`` checks the magic, the header,
the key, the size and the checksum; an entry failing any check is discarded with one warning line on
stderr and the kernel is compiled again, never used.

Start-up manifests (``manifests/<digest>.json``: the keys a plan's start-up needs, executor/compile.py)
are written the same way; an unreadable one is ignored.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import sys
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

ENV_DIR = "MEMPLAN_CACHE_DIR"
ENV_SWITCH = "MEMPLAN_KERNEL_CACHE"  # "0", "off", "false" or "no": off
MAGIC = b"memplan kernel cache entry\n"
FORMAT = 1
SUFFIX = ".kernel"
_KEY = re.compile(r"^[0-9a-f]{64}$")
_LENGTH_BYTES = 8


@dataclass(frozen=True)
class CachedKernel:
    """A compiled kernel: its cubin and entry point, and what it was compiled from and for."""

    entry_name: str
    image: bytes
    kernel: str  # module.qualname of the kernel function
    argtypes: tuple[str, ...]
    arch: str  # sm_90a
    toolchain: Mapping[str, str] = field(default_factory=dict)


class CorruptEntry(Exception):
    """An entry that fails a check (the message says which)."""


@dataclass(frozen=True)
class CacheInfo:
    root: Path
    enabled: bool
    entries: int
    bytes: int
    by_arch: dict[str, int]
    by_toolchain: dict[str, int]  # "numba-cuda X, nvvm Y, linker Z" -> entries
    corrupt: int
    temporary: int  # temporary files left by a process that stopped while writing


def default_cache_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """``$MEMPLAN_CACHE_DIR``, else ``${XDG_CACHE_HOME:-~/.cache}/memplan``."""
    if environ.get(ENV_DIR):
        return Path(environ[ENV_DIR]).expanduser()
    base = environ.get("XDG_CACHE_HOME") or str(Path("~/.cache").expanduser())
    return Path(base) / "memplan"


def cache_enabled(environ: Mapping[str, str] = os.environ) -> bool:
    """Off with ``MEMPLAN_KERNEL_CACHE=0`` (or off/false/no) and in the simulator."""
    if environ.get("NUMBA_ENABLE_CUDASIM", "0") == "1":
        return False
    return environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "off", "false", "no")


class KernelCache:
    """The entries under ``root`` (see the module docstring). ``warnings``: where a discarded entry's
    line goes (stderr)."""

    def __init__(self, root: Path, warnings: TextIO | None = None) -> None:
        self.root = Path(root)
        self.warnings = warnings

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] = os.environ) -> KernelCache | None:
        """The cache the environment names, or None when it is off."""
        return cls(default_cache_dir(environ)) if cache_enabled(environ) else None

    @property
    def kernels_dir(self) -> Path:
        return self.root / "kernels"

    def path(self, key: str) -> Path:
        assert _KEY.match(key), f"not a kernel key: {key!r}"
        return self.kernels_dir / key[:2] / f"{key}{SUFFIX}"

    def contains(self, key: str) -> bool:
        """Whether an entry file exists for ``key`` (``load`` checks it)."""
        return self.path(key).is_file()

    def load(self, key: str) -> CachedKernel | None:
        """The entry of ``key``, or None: a miss, or an entry that failed a check (discarded, one warning)."""
        path = self.path(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as error:
            self.warn(f"cannot read {path} ({error.strerror}); compiling the kernel")
            return None
        try:
            return decode_entry(data, key)
        except CorruptEntry as error:
            self.discard(key, str(error))
            return None

    def store(self, key: str, entry: CachedKernel) -> bool:
        """Write ``entry`` under ``key`` atomically; False (and one warning) when the file system refuses."""
        return self._write(self.path(key), encode_entry(key, entry), "the kernel is not cached")

    def manifest_path(self, digest: str) -> Path:
        assert _KEY.match(digest), f"not a manifest digest: {digest!r}"
        return self.root / "manifests" / f"{digest}.json"

    def load_manifest(self, digest: str) -> list[str] | None:
        """The kernel keys a start-up manifest lists (executor/compile.py), or None (none, or unreadable)."""
        try:
            keys = json.loads(self.manifest_path(digest).read_text())["keys"]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if not isinstance(keys, list) or not all(isinstance(k, str) and _KEY.match(k) for k in keys):
            return None
        return keys

    def store_manifest(self, digest: str, keys: list[str]) -> bool:
        """Write a start-up manifest atomically."""
        data = json.dumps({"format": FORMAT, "keys": keys}).encode()
        return self._write(self.manifest_path(digest), data, "the start-up manifest is not kept")

    def _write(self, path: Path, data: bytes, consequence: str) -> bool:
        """``data`` to ``path`` through a temporary file in its directory and a rename."""
        temporary = path.parent / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(temporary, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(temporary, path)
        except OSError as error:
            self.warn(f"cannot write {path} ({error.strerror or error}); {consequence}")
            try:
                temporary.unlink(missing_ok=True)
            except OSError:
                pass
            return False
        return True

    def discard(self, key: str, reason: str) -> None:
        """Remove a bad entry, with one warning line."""
        path = self.path(key)
        self.warn(f"discarding {path}: {reason}; compiling the kernel again")
        try:
            path.unlink(missing_ok=True)
        except OSError:
            pass

    def get_or_build(self, key: str, build: Callable[[], CachedKernel]) -> tuple[CachedKernel, bool]:
        """(the entry of ``key``, False) on a hit; else ``build()`` stored, and True."""
        entry = self.load(key)
        if entry is not None:
            return entry, False
        entry = build()
        self.store(key, entry)
        return entry, True

    def entry_paths(self) -> Iterator[Path]:
        if self.kernels_dir.is_dir():
            yield from sorted(self.kernels_dir.glob(f"??/*{SUFFIX}"))

    def info(self) -> CacheInfo:
        """Entries, bytes, entries by arch and toolchain, and how many fail their checks."""
        entries = size = corrupt = 0
        by_arch: Counter[str] = Counter()
        by_toolchain: Counter[str] = Counter()
        for path in self.entry_paths():
            data = path.read_bytes()
            try:
                entry = decode_entry(data, path.name.removesuffix(SUFFIX))
            except CorruptEntry:
                corrupt += 1
                continue
            entries += 1
            size += len(data)
            by_arch[entry.arch] += 1
            tools = entry.toolchain
            by_toolchain[f"numba-cuda {tools.get('numba-cuda')}, nvvm {tools.get('nvvm')}, "
                         f"{tools.get('linker')}"] += 1
        temporary = sum(1 for _ in self.kernels_dir.glob("??/.*.tmp")) if self.kernels_dir.is_dir() else 0
        return CacheInfo(self.root, cache_enabled(), entries, size, dict(by_arch), dict(by_toolchain), corrupt,
                         temporary)

    def clear(self) -> int:
        """Remove every entry, start-up manifest and temporary file; returns how many entries were removed."""
        removed = 0
        for path in sorted([*self.kernels_dir.glob("??/*"), *(self.root / "manifests").glob("*")]):
            if path.is_file() and path.name.endswith((SUFFIX, ".tmp", ".json")):
                removed += path.name.endswith(SUFFIX)
                path.unlink(missing_ok=True)
        for directory in sorted([*self.kernels_dir.glob("??"), self.kernels_dir, self.root / "manifests"]):
            try:
                directory.rmdir()
            except OSError:
                pass  # absent, or another process wrote into it meanwhile
        return removed

    def warn(self, message: str) -> None:
        """One line on the warnings stream (stderr)."""
        print(f"memplan: kernel cache: {message}", file=self.warnings or sys.stderr, flush=True)


def encode_entry(key: str, entry: CachedKernel) -> bytes:
    """An entry's bytes (see the module docstring)."""
    header = {"format": FORMAT, "key": key, "entry_name": entry.entry_name, "kernel": entry.kernel,
              "argtypes": list(entry.argtypes), "arch": entry.arch, "toolchain": dict(entry.toolchain),
              "image_bytes": len(entry.image), "image_sha256": hashlib.sha256(entry.image).hexdigest()}
    encoded = json.dumps(header, sort_keys=True).encode()
    return MAGIC + len(encoded).to_bytes(_LENGTH_BYTES, "big") + encoded + entry.image


def decode_entry(data: bytes, key: str) -> CachedKernel:
    """The entry in ``data``, checked against ``key``; raises CorruptEntry naming the failed check."""
    if not data.startswith(MAGIC):
        raise CorruptEntry("not a kernel cache entry (bad magic)")
    start = len(MAGIC) + _LENGTH_BYTES
    if len(data) < start:
        raise CorruptEntry("truncated header")
    length = int.from_bytes(data[len(MAGIC) : start], "big")
    if len(data) < start + length:
        raise CorruptEntry("truncated header")
    try:
        header = json.loads(data[start : start + length])
        image = data[start + length :]
        if header["format"] != FORMAT:
            raise CorruptEntry(f"entry format {header['format']}, expected {FORMAT}")
        if header["key"] != key:
            raise CorruptEntry("its header names another key")
        if header["image_bytes"] != len(image):
            raise CorruptEntry(f"image of {len(image)} bytes, header says {header['image_bytes']} (truncated?)")
        if hashlib.sha256(image).hexdigest() != header["image_sha256"]:
            raise CorruptEntry("image checksum mismatch")
        entry_name = header["entry_name"]
        if not isinstance(entry_name, str) or not entry_name:
            raise CorruptEntry("no entry point")
        return CachedKernel(entry_name=entry_name, image=image, kernel=str(header["kernel"]),
                            argtypes=tuple(map(str, header["argtypes"])), arch=str(header["arch"]),
                            toolchain={str(k): str(v) for k, v in dict(header["toolchain"]).items()})
    except CorruptEntry:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise CorruptEntry(f"unreadable header ({type(error).__name__})") from None
