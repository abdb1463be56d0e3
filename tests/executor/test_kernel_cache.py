"""The persistent kernel cache: hits and misses, corrupt entries rejected and rebuilt, two processes
filling one key, keys that change with a builder's source, a specialization argument or the target
arch, discovery following the launchers' routing, the start-up compile through processes (a fake
compiler) and its manifest, and ``memplan compile`` for sm_90 without a GPU (real NVVM and
nvJitLink cubins), whose second call compiles nothing.

Keys, discovery and compiling need Numba's CUDA target rather than the simulator this test process
runs, so they run in a fresh interpreter (tests/executor/kernel_cache_probe.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from executor.kernel_cache import MAGIC, CachedKernel, KernelCache, cache_enabled, default_cache_dir, encode_entry
from planner.cli import main
from tests.subprocess_env import python_path

REPO_ROOT = Path(__file__).resolve().parents[2]
KEY = hashlib.sha256(b"a kernel").hexdigest()
OTHER_KEY = hashlib.sha256(b"another kernel").hexdigest()
ENTRY = CachedKernel(entry_name="_Z6kernel", image=b"\x7fELF" + bytes(range(200)), kernel="module.build.<locals>.k",
                     argtypes=("array(int16, 2d, C)", "float32"), arch="sm_90a",
                     toolchain={"numba-cuda": "0.30.4", "nvvm": "2.0", "linker": "nvjitlink 13.5"})


def _probe_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["PYTHONPATH"] = python_path()
    env.update(extra)
    return env


def _probe(*args: str, **env: str) -> dict:
    """Run one probe of kernel_cache_probe.py in a fresh interpreter without the simulator."""
    proc = subprocess.run([sys.executable, "-c", "from tests.executor.kernel_cache_probe import main; main()", *args],
                          cwd=REPO_ROOT, env=_probe_env(**env), capture_output=True, text=True, timeout=900)
    if proc.returncode != 0 and "NvvmSupportError" in proc.stderr:
        pytest.skip("NVVM is not installed here")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


class Builds:
    """A build function that counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> CachedKernel:
        self.calls += 1
        return ENTRY


# -- the store ------------------------------------------------------------------------------------------------------


def test_a_miss_builds_and_stores_and_a_hit_loads_without_building(tmp_path):
    cache, build = KernelCache(tmp_path), Builds()
    assert cache.load(KEY) is None and not cache.contains(KEY)
    entry, built = cache.get_or_build(KEY, build)
    assert built and build.calls == 1 and entry == ENTRY
    assert cache.path(KEY).is_file() and cache.path(KEY).parent.name == KEY[:2]
    entry, built = KernelCache(tmp_path).get_or_build(KEY, build)  # a new cache object: from the file
    assert not built and build.calls == 1 and entry == ENTRY
    assert cache.load(OTHER_KEY) is None  # another key is still a miss
    assert [p.name for p in cache.entry_paths()] == [f"{KEY}.kernel"]


def _corrupt_and_reload(tmp_path: Path, damage, capsys) -> tuple[KernelCache, Builds, str]:
    cache, build = KernelCache(tmp_path), Builds()
    cache.store(KEY, ENTRY)
    path = cache.path(KEY)
    path.write_bytes(damage(path.read_bytes()))
    capsys.readouterr()
    assert cache.load(KEY) is None
    warning = capsys.readouterr().err
    assert not path.exists()  # discarded, never used
    entry, built = cache.get_or_build(KEY, build)  # rebuilt and stored whole
    assert built and build.calls == 1 and entry == ENTRY and cache.load(KEY) == ENTRY
    return cache, build, warning


def _flip(offset_from_end: int):
    def damage(data: bytes) -> bytes:
        index = len(data) - offset_from_end
        return data[:index] + bytes([data[index] ^ 0x01]) + data[index + 1 :]

    return damage


@pytest.mark.parametrize("where, damage, reason", [
    ("image", _flip(1), "checksum"),
    ("image start", _flip(len(ENTRY.image)), "checksum"),
    ("magic", lambda data: bytes([data[0] ^ 0x01]) + data[1:], "magic"),
    ("header", lambda data: data.replace(b'"arch"', b'"arch!"', 1), "unreadable header"),
    ("header length", lambda data: data[: len(MAGIC)] + (1 << 40).to_bytes(8, "big") + data[len(MAGIC) + 8 :],
     "truncated"),
])
def test_a_flipped_byte_is_rejected_with_one_warning_and_rebuilt(tmp_path, capsys, where, damage, reason):
    _, _, warning = _corrupt_and_reload(tmp_path, damage, capsys)
    lines = warning.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("memplan: kernel cache: discarding ") and reason in lines[0], where


@pytest.mark.parametrize("keep", [0, 5, len(MAGIC) + 4, len(MAGIC) + 30, -1])
def test_a_truncated_entry_is_rejected_and_rebuilt(tmp_path, capsys, keep):
    _, _, warning = _corrupt_and_reload(tmp_path, lambda data: data[:keep], capsys)
    assert len(warning.strip().splitlines()) == 1 and "discarding" in warning


def test_an_entry_filed_under_another_key_is_rejected(tmp_path, capsys):
    cache = KernelCache(tmp_path)
    cache.store(KEY, ENTRY)
    cache.path(OTHER_KEY).parent.mkdir(parents=True, exist_ok=True)
    cache.path(OTHER_KEY).write_bytes(cache.path(KEY).read_bytes())
    assert cache.load(OTHER_KEY) is None and "another key" in capsys.readouterr().err
    assert cache.load(KEY) == ENTRY


def test_an_unwritable_cache_warns_once_and_the_run_goes_on(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    assert not KernelCache(blocker).store(KEY, ENTRY)
    assert capsys.readouterr().err.count("memplan: kernel cache: cannot write") == 1


def test_two_processes_filling_one_key_both_succeed_and_leave_one_valid_entry(tmp_path):
    start, rounds = tmp_path / "start", 40
    command = [sys.executable, "-c", "from tests.executor.kernel_cache_probe import main; main()", "store", KEY,
               str(tmp_path / "cache"), str(start), str(rounds)]
    procs = [subprocess.Popen(command, cwd=REPO_ROOT, env=_probe_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    time.sleep(0.5)  # both interpreters up and waiting
    start.write_text("go")
    results = [proc.communicate(timeout=300) for proc in procs]
    for proc, (out, err) in zip(procs, results):
        assert proc.returncode == 0, err
        assert json.loads(out) == {"stored": rounds, "loaded": rounds}
    cache = KernelCache(tmp_path / "cache")
    files = sorted(p.name for p in cache.path(KEY).parent.iterdir())
    assert files == [f"{KEY}.kernel"]  # one entry, no temporary file left
    entry = cache.load(KEY)
    assert entry is not None and entry.image == bytes(range(256)) * 4096


def test_the_cache_directory_and_switch_come_from_the_environment(tmp_path):
    assert default_cache_dir({"MEMPLAN_CACHE_DIR": str(tmp_path)}) == tmp_path
    assert default_cache_dir({"XDG_CACHE_HOME": "/x"}) == Path("/x/memplan")
    assert default_cache_dir({}) == Path("~/.cache/memplan").expanduser()
    assert cache_enabled({}) and cache_enabled({"MEMPLAN_KERNEL_CACHE": "1"})
    assert not any(cache_enabled({"MEMPLAN_KERNEL_CACHE": value}) for value in ("0", "off", "False", "no"))
    assert not cache_enabled({"NUMBA_ENABLE_CUDASIM": "1"})  # the simulator compiles nothing
    assert KernelCache.from_environment({"MEMPLAN_KERNEL_CACHE": "0"}) is None


def test_memplan_cache_info_and_clear(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MEMPLAN_CACHE_DIR", str(tmp_path))
    cache = KernelCache(tmp_path)
    cache.store(KEY, ENTRY)
    cache.store(OTHER_KEY, ENTRY)
    cache.path(OTHER_KEY).write_bytes(b"damaged")
    assert main(["cache", "info"]) == 0
    out = capsys.readouterr().out
    assert f"kernel cache: {tmp_path}" in out
    assert f"entries: 1 ({len(encode_entry(KEY, ENTRY)):,} bytes)" in out
    assert "sm_90a: 1" in out and "numba-cuda 0.30.4, nvvm 2.0, nvjitlink 13.5: 1" in out
    assert "corrupt entries: 1" in out
    assert main(["cache", "clear"]) == 0
    assert "removed 2 entries" in capsys.readouterr().out
    assert list(cache.entry_paths()) == [] and cache.load(KEY) is None


# -- keys, discovery, compiling (fresh interpreters) --------------------------------------------------------------


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> dict:
    return _probe("keys", str(tmp_path_factory.mktemp("builders")))


def test_the_key_is_stable_and_changes_with_each_input(keys):
    assert keys["base"] == keys["same again"] == keys["sources restored"]
    changed = ["factor 3", "unroll 4", "sm_80", "sm_100", "float64 array", "strided array", "kernel source edited",
               "device function source edited"]
    values = [keys["base"], *(keys[name] for name in changed)]
    assert len(set(values)) == len(values), {name: keys[name][:12] for name in ["base", *changed]}


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict:
    return _probe("compile", str(tmp_path_factory.mktemp("cache")))


def test_a_project_kernel_keys_alike_in_two_processes_and_apart_by_codec(keys, compiled):
    assert keys["project bf16"] == keys["project bf16 rebuilt"] != keys["project f32"]
    assert keys["project bf16 after numba.types is imported"] == keys["project bf16"]  # a library module's alias
    assert compiled["project bf16"] == keys["project bf16"]  # what a compile process keys, the run finds


def test_discovery_follows_the_launchers_routing_through_each_graph_bucket(compiled):
    needs = compiled["needs"]
    gemv = {need["phase"] for need in needs if need["name"].endswith("gemv")}
    # GEMV decode kernels are built per batch: warm-up's one-request step, then bucket 2; bucket 4 and
    # larger run the cuBLAS projections.
    assert gemv == {"warm-up", "decode graph 2"}, gemv
    assert compiled["buckets"] == [1, 2, 4]
    phases = {need["phase"] for need in needs}
    assert "warm-up" in phases and all(phase == "warm-up" or phase.startswith(("decode graph ", "prefill graph "))
                                       for phase in phases)
    samplers = [need for need in needs if need["name"].endswith("build_sample_kernel.<locals>.sample")]
    assert len(samplers) == 1  # one specialization, whatever the batch


@pytest.mark.parametrize("model", ["qwen3-8b", "qwen3.5-9b"])
def test_the_start_up_passes_ready_every_kernel_a_serving_workload_launches(model):
    """No kernel loads or compiles inside a serving step: the steps of a workload of mixed prompt lengths
    arriving in waves (decode rows beside long, short and split chunks, steps above the largest prefill
    graph, a short prompt alone: the fused rope + KV write and Qwen3.5's recurrent delta rule) launch no
    specialization that start-up's passes did not."""
    result = _probe("coverage", model)
    assert {"decode rows + no prefill", "decode rows + prefill <= 2048", "decode rows + prefill > 2048",
            "prefill < 64"} <= set(result["kinds"]), result["kinds"]
    assert result["uncovered"] == [], result["uncovered"]


def test_the_startup_compile_fills_the_cache_through_processes_and_its_manifest_answers_next(compiled):
    first, second = compiled["first"], compiled["second"]
    assert first["failed"] == [] and first["processes"] == 2 and first["cached"] == 0
    assert first["compiled"] == len(first["planned"]) == first["needed"] - first["uncacheable"] > 5
    assert compiled["entries"] == first["planned"]
    assert second["from_manifest"] and second["compiled"] == 0 and second["cached"] == second["needed"]
    assert second["processes"] == 0 and second["planned"] == []  # no discovery, no process


def test_the_run_s_cold_start_compiles_in_forks_of_one_start_up_process_and_leaves_a_warm_start(tmp_path):
    result = _probe("startup", str(tmp_path))
    cold, warm = result["cold"], result["warm"]
    assert cold["failed"] == [] and cold["cached"] == 0 and cold["processes"] == 2
    assert cold["compiled"] == len(result["planned"]) == cold["needed"] - cold["uncacheable"] > 5
    assert result["entries"] == result["planned"]  # what the start-up process compiled, the run's discovery needs
    assert warm["from_manifest"] and warm["compiled"] == 0 and warm["cached"] == warm["needed"] == cold["needed"]


def test_memplan_compile_for_sm90_without_a_gpu_fills_the_cache_and_a_second_call_compiles_nothing(tmp_path):
    command = [sys.executable, "-m", "planner.cli", "compile", "--model", "tiny-qwen3", "--hardware", "h200",
               "--serving", "sim", "--kernels", "chunk_copy", "--jobs", "1", "--list"]
    env = _probe_env(MEMPLAN_CACHE_DIR=str(tmp_path))
    first = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900)
    if first.returncode != 0 and "NvvmSupportError" in first.stderr:
        pytest.skip("NVVM is not installed here")
    assert first.returncode == 0, first.stderr[-4000:]
    assert "tiny-qwen3 on h200 (sm_90a, 132 SMs): 2 needed, 0 in the cache, 2 compiled (here)" in first.stdout
    cache = KernelCache(tmp_path)
    entries = [cache.load(path.name.removesuffix(".kernel")) for path in cache.entry_paths()]
    assert len(entries) == 2 and all(entry is not None for entry in entries)
    for entry in entries:
        assert entry.arch == "sm_90a" and entry.kernel.endswith("chunk_copy_kernel")
        assert entry.image.startswith(b"\x7fELF")  # a cubin nvJitLink linked on the host
        assert entry.entry_name.encode() in entry.image
    second = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert second.returncode == 0, second.stderr[-4000:]
    assert "2 needed, 2 in the cache in" in second.stdout and "compiled" not in second.stdout.splitlines()[0]


def test_memplan_compile_without_nvjitlink_or_a_driver_names_the_package_in_one_line(tmp_path):
    """A machine without a GPU that installed the executor's extra but not numba-cuda's CUDA 13 one: numba
    finds no nvJitLink and no driver to link with."""
    script = ("import sys\n"
              "from executor.numba_cuda import load_cuda\n"
              "load_cuda()\n"
              "from numba.cuda.cudadrv import driver\n"
              "try:\n"
              "    driver.driver.get_version()\n"
              "    sys.exit(99)  # a driver answers: this machine can link without nvJitLink\n"
              "except Exception:\n"
              "    pass\n"
              "driver._have_nvjitlink = lambda: False\n"
              "from planner.cli import main\n"
              "sys.exit(main(['compile', '--model', 'tiny-qwen3', '--hardware', 'h200', '--serving', 'sim']))\n")
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=300, env=_probe_env(MEMPLAN_CACHE_DIR=str(tmp_path)))
    if result.returncode == 99:
        pytest.skip("a CUDA driver is present")
    err = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(err) == 1, result.stderr[-2000:]
    assert err[0].startswith("memplan: compile error: no linker for cubins here") and "numba-cuda[cu13]" in err[0]
    assert list(KernelCache(tmp_path).entry_paths()) == []


@pytest.mark.parametrize("flags, env, message", [
    (["--jobs", "0"], {}, "--jobs must be at least 1, got 0"),
    ([], {}, "unset NUMBA_ENABLE_CUDASIM"),  # this process runs the simulator
    ([], {"NUMBA_ENABLE_CUDASIM": None, "MEMPLAN_KERNEL_CACHE": "0"}, "the kernel cache is off"),
    (["--hardware", "cpu-sim", "--serving", "sim"], {"NUMBA_ENABLE_CUDASIM": None},
     "cpu-sim has compute capability 0.0"),
])
def test_memplan_compile_refuses_what_it_cannot_compile_for_in_one_line(monkeypatch, capsys, tmp_path, flags, env,
                                                                         message):
    monkeypatch.setenv("MEMPLAN_CACHE_DIR", str(tmp_path))
    for name, value in env.items():  # none of these cases gets as far as loading numba.cuda
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    assert main(["compile", "--model", "tiny-qwen3", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("memplan: compile error: ") and message in err[0], err
    assert list(KernelCache(tmp_path).entry_paths()) == []
