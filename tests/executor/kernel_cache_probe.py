"""What test_kernel_cache.py runs in a fresh interpreter without the simulator (keys, discovery and
compiling need Numba's real CUDA target; no GPU is needed): ``python -c "from
tests.executor.kernel_cache_probe import main; main()" PROBE ARGS...`` prints one JSON object.

- ``keys DIR``: kernel keys of builders written into DIR (a kernel module and the module of its
  device function), then rewritten; and of a project kernel for two codecs.
- ``compile CACHE``: the kernels discovery lists for tiny-qwen3 on an H200 (GEMV decode up to
  batch 2); their start-up compile through two compile processes with ``fake_compile`` (no NVVM),
  then the same call again (the start-up manifest answers); and the key of a project kernel.
- ``startup CACHE``: ``memplan run``'s cold-start compile of the same plan for its hardware (one
  start-up process, compiles forked from it, ``fake_compile``), then the warm start it leaves.
- ``coverage MODEL``: start-up's discovery passes for MODEL on an H200 at a small serving shape, then
  a workload of mixed prompt lengths served on the same meta model: the kernel specializations its
  steps launch that the start-up passes did not (each would load or compile inside a step).
- ``store KEY CACHE START ROUNDS``: once START exists, store and load one entry ROUNDS times (two
  such processes race on one key).
"""

from __future__ import annotations

import importlib
import json
import sys
import time
from pathlib import Path

from executor.kernel_cache import CachedKernel, KernelCache

KERNEL_MODULE = '''
from executor.numba_cuda import load_cuda
from probe_device_functions import build_scale_by

cuda = load_cuda()


def build_scale(factor, unroll):
    scale_by = build_scale_by(factor)

    @cuda.jit
    def scale(values):
        i = cuda.grid(1)
        for u in range(unroll):
            if i * unroll + u < values.shape[0]:
                values[i * unroll + u] = scale_by(values[i * unroll + u]){extra}

    return scale
'''
DEVICE_MODULE = '''
from executor.numba_cuda import load_cuda

cuda = load_cuda()


def build_scale_by(factor):
    @cuda.jit(device=True, inline=True)
    def scale_by(value):
        return value * factor{extra}

    return scale_by
'''


def fake_compile(dispatcher, argtypes, arch) -> CachedKernel:
    """A stand-in for ``compile_image``: an entry naming what it was asked for, in no time."""
    function = dispatcher.py_func
    name = f"{function.__module__}.{function.__qualname__}"
    return CachedKernel(entry_name="fake", image=f"{name} {argtypes} {arch.name}".encode(), kernel=name,
                        argtypes=tuple(map(str, argtypes)), arch=arch.name)


def _keys(directory: Path) -> dict:
    from numba.cuda import types

    from executor.kernel_key import Arch, kernel_key

    sys.path.insert(0, str(directory))
    vector = (types.Array(types.float32, 1, "C"),)
    sm90 = Arch(9, 0)

    def write(kernel_extra: str = "", device_extra: str = "") -> None:
        (directory / "probe_kernels.py").write_text(KERNEL_MODULE.replace("{extra}", kernel_extra))
        (directory / "probe_device_functions.py").write_text(DEVICE_MODULE.replace("{extra}", device_extra))
        importlib.invalidate_caches()
        for name in ("probe_kernels", "probe_device_functions"):
            sys.modules.pop(name, None)

    def key(factor: float = 2.0, unroll: int = 2, arch: Arch = sm90, argtypes: tuple = vector) -> str:
        module = importlib.import_module("probe_kernels")
        return kernel_key(module.build_scale(factor, unroll), argtypes, arch)

    write()
    result = {"base": key(), "same again": key(), "factor 3": key(factor=3.0), "unroll 4": key(unroll=4),
              "sm_80": key(arch=Arch(8, 0)), "sm_100": key(arch=Arch(10, 0)),
              "float64 array": key(argtypes=(types.Array(types.float64, 1, "C"),)),
              "strided array": key(argtypes=(types.Array(types.float32, 1, "A"),))}
    time.sleep(0.01)  # a new modification time, whatever the file system's resolution
    write(kernel_extra=" + 0.0")
    result["kernel source edited"] = key()
    write(device_extra=" + 0.0")
    result["device function source edited"] = key()
    write()
    result["sources restored"] = key()

    from executor.kernels.primitives.codec import build_codec
    from tests.kernels.add_inplace import build_add_inplace_kernel

    result["project bf16"] = _project_key()
    result["project bf16 rebuilt"] = _project_key()
    # Importing the numba.types submodule (Numba's device compile does) rebinds the name ``numba.types``,
    # which build_codec imports, from numba.core.types to that alias module.
    importlib.import_module("numba.types")
    result["project bf16 after numba.types is imported"] = _project_key()
    floats = (types.Array(types.float32, 2, "C"),) * 2
    result["project f32"] = kernel_key(build_add_inplace_kernel(build_codec("float32")), floats, sm90)
    return result


def _project_key() -> str:
    from numba.cuda import types

    from executor.kernel_key import Arch, kernel_key
    from executor.kernels.primitives.codec import build_codec
    from tests.kernels.add_inplace import build_add_inplace_kernel

    rows = (types.Array(types.int16, 2, "C"),) * 2
    return kernel_key(build_add_inplace_kernel(build_codec("bfloat16")), rows, Arch(9, 0))


def _compile(cache_root: Path) -> dict:
    from executor.compile import Target, prepare_compile, run_compile
    from executor.kernel_compiler import target_device
    from executor.kernel_discovery import discover
    from executor.kernel_key import Arch
    from planner.loader import plan_from_configs

    plan = plan_from_configs("tiny-qwen3", "h200", "sim", {"decode_gemv_max_batch": 2})
    target = Target(Arch.from_capability(plan.hardware.compute_capability), plan.hardware.num_sms)
    cache = KernelCache(cache_root)
    result = {"buckets": list(plan.serving.decode_graph_batch_sizes), "project bf16": _project_key()}
    with target_device(target.arch, target.num_sms):
        result["needs"] = [{"name": need.name, "phase": need.phase, "argtypes": list(map(str, need.argtypes))}
                           for need in discover(plan)]
        for attempt in ("first", "second"):
            job = prepare_compile(plan, cache, target, use_manifest=True)
            report = run_compile(job, plan, cache, target, jobs=2, compile_function=fake_compile)
            result[attempt] = {"needed": report.needed, "cached": report.cached, "compiled": report.compiled,
                               "failed": report.failed, "uncacheable": report.uncacheable,
                               "processes": report.processes, "from_manifest": report.from_manifest,
                               "planned": sorted(kernel.key for kernel in job.planned)}
    result["entries"] = sorted(path.name.removesuffix(".kernel") for path in cache.entry_paths())
    return result


def _startup(cache_root: Path) -> dict:
    """memplan run's cold-start compile (a start-up process, forked compiles) for the plan's hardware,
    then the warm start it leaves: the reports, and the entries against an in-process discovery."""
    from executor.compile import StartupCompile, hardware_target, planned_kernels
    from executor.kernel_compiler import target_device
    from planner.loader import plan_from_configs

    plan = plan_from_configs("tiny-qwen3", "h200", "sim", {"decode_gemv_max_batch": 2})
    target = hardware_target(plan)
    cache = KernelCache(cache_root)
    result = {}
    for attempt in ("cold", "warm"):
        report = StartupCompile(plan, cache, None, jobs=2, target=target, compile_function=fake_compile).wait()
        result[attempt] = {"needed": report.needed, "cached": report.cached, "compiled": report.compiled,
                           "failed": report.failed, "uncacheable": report.uncacheable,
                           "processes": report.processes, "from_manifest": report.from_manifest}
    with target_device(target.arch, target.num_sms):
        result["planned"] = sorted(kernel.key for kernel in planned_kernels(plan, target)[0])
    result["entries"] = sorted(path.name.removesuffix(".kernel") for path in cache.entry_paths())
    return result


def _coverage(model_name: str) -> dict:
    import random

    from executor.engine import _request_chunk
    from executor.kernel_compiler import target_device
    from executor.kernel_discovery import find_kernels, kernel_name, meta_model, startup_passes
    from executor.kernel_key import Arch
    from executor.page_tables import PageTables
    from executor.scheduler import Request, Scheduler
    from executor.step import plan_step
    from planner.loader import plan_from_configs

    # Steps above the largest prefill-graph bucket (2,048 rows) run eagerly; prompts up to 3,000 tokens
    # arrive in waves, so steps mix decode rows with long, short and split chunks.
    plan = plan_from_configs(model_name, "h200", None, {"max_batch": 32, "max_prefill_tokens": 4096,
                                                         "max_context": 3072, "gpu_memory_utilization": 0.5})
    rng = random.Random(5)
    lengths = [rng.choice([rng.randint(1, 64), rng.randint(64, 3000)]) for _ in range(48)]
    requests = [Request(i, [rng.randrange(1000) for _ in range(n)], rng.randint(1, 24)) for i, n in enumerate(lengths)]
    # step -> arrivals; the last, one short prompt while the rest decode: a step whose prefill rows are
    # fewer than routing.CHUNKED_DELTA_RULE_MIN_ROWS (Qwen3.5's recurrent delta rule)
    requests.append(Request(len(requests), [rng.randrange(1000) for _ in range(20)], 2))
    waves = {0: requests[:24], 6: requests[24:40], 30: requests[40:48], 50: requests[48:]}
    with target_device(Arch.from_capability(plan.hardware.compute_capability), plan.hardware.num_sms):
        model = meta_model(plan)
        phases = list(startup_passes(plan, model))
        kernels = find_kernels(model)
        started = {id(kernel): set(kernel.discovered) for kernel in kernels}
        scheduler = Scheduler(plan.capacity, prefix_caching=False,
                              has_recurrent_state=plan.geometry.num_linear_layers > 0)
        tables, by_id, steps, rows = PageTables(), {r.request_id: r for r in requests}, 0, set()
        while steps <= max(waves) or scheduler.has_unfinished:
            for request in waves.get(steps, []):
                assert scheduler.add(request)
            step = scheduler.schedule()
            if step is not None:
                for slot in step.fresh_slots:
                    model.reset_slot(slot)
                model.step(plan_step(plan, [_request_chunk(c, by_id[c.request_id]) for c in step.chunks], tables))
                tokens = step.num_prefill_tokens
                rows.add(("decode rows + " if step.num_decode_rows else "")
                         + ("no prefill" if tokens == 0 else "prefill < 64" if tokens < 64
                            else "prefill <= 2048" if tokens <= 2048 else "prefill > 2048"))
                scheduler.update(step, [0] * step.num_requests)
            steps += 1
    uncovered = sorted(f"{kernel_name(k)} {t}" for k in kernels for t in k.discovered if t not in started[id(k)])
    return {"phases": phases, "steps": steps, "kinds": sorted(rows), "uncovered": uncovered}


def _store(key: str, cache_root: Path, start: Path, rounds: int) -> dict:
    cache = KernelCache(cache_root)
    entry = CachedKernel(entry_name="kernel", image=bytes(range(256)) * 4096, kernel="probe.kernel",
                         argtypes=("float32",), arch="sm_90a")
    while not start.exists():
        time.sleep(0.001)
    loaded = 0
    for _ in range(rounds):
        assert cache.store(key, entry)
        found = cache.load(key)
        assert found == entry, "a reader saw a partial or foreign entry"
        loaded += 1
    return {"stored": rounds, "loaded": loaded}


def main() -> None:
    probe, *args = sys.argv[1:]
    if probe == "keys":
        result = _keys(Path(args[0]))
    elif probe == "compile":
        result = _compile(Path(args[0]))
    elif probe == "startup":
        result = _startup(Path(args[0]))
    elif probe == "coverage":
        result = _coverage(args[0])
    elif probe == "store":
        result = _store(args[0], Path(args[1]), Path(args[2]), int(args[3]))
    else:
        raise SystemExit(f"unknown probe {probe!r}")
    print(json.dumps(result))
