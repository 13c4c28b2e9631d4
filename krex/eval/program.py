"""One benchmarking command of the eval workload (run as a script or in a warm worker).

    python program.py SPEC.json RESULT.json [--phase all|compile|check|time] [--seed N]

SPEC.json (written once per run by the harness): ``device``, ``profile``,
``kernels`` (KernelSpec dicts), ``n_funcs`` (compile size).  The command
starts up (the framework import and the device context), compiles generated C
with ``cc``, checks its kernels (device work, untimed), and times every kernel
with ``krex.measure`` (warm-up outside, timed loop inside a region).
RESULT.json gets the phase durations and one record per timed kernel.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from typing import Any

MIN_SAMPLES = 5  # every kernel gets at least this many timed calls
_T0 = time.perf_counter()
import krex.eval.heavy  # noqa: E402,F401  (the framework import: free in a warm worker)

_T_IMPORT = time.perf_counter()


def _context(device: str) -> Any:
    """The device context and its timer: fakegpu (creation serialised by the server) and
    cuda:N: driver-API events; rocm:N: torch events (the kernels are torch's)."""
    kind, _, index = device.partition(":")
    if kind == "fakegpu":
        from krex.measure.events import FakegpuTimer

        return FakegpuTimer(int(index or 0))
    if kind == "cuda":
        from krex.measure.events import DriverEventTimer

        return DriverEventTimer(int(index or 0))
    if kind == "rocm":
        from krex.measure.events import TorchEventTimer

        return TorchEventTimer(int(index or 0), device=device)
    return None


def _kernels(spec: dict[str, Any], timer: Any) -> list[tuple[Any, Any]]:
    from krex.eval.kernels import KernelSpec, build

    lib = timer.api.lib if hasattr(timer, "api") else None
    specs = [KernelSpec(**k) for k in spec["kernels"]]
    return [(k, build(k, spec["device"], lib)) for k in specs]


def _check(kernels: list[tuple[Any, Any]], timer: Any, budget_ms: float) -> None:
    from krex.eval.kernels import check_work

    if timer is None:
        check_work([fn for _, fn in kernels], budget_ms)
        return
    longest = max(kernels, key=lambda kv: kv[0].bucket_ms)
    for _ in range(max(1, round(budget_ms / longest[0].bucket_ms))):
        longest[1]()
    timer.synchronize()


def _time(kernels: list[tuple[Any, Any]], timer: Any, spec: dict[str, Any]) -> list[dict]:
    from krex.measure import measure

    prof, device = spec["profile"], spec["device"]
    cache = prof["cache"].get(device.partition(":")[0], "cold")
    out = []
    for k, fn in kernels:
        rep_ms = max(prof["rep_ms"], MIN_SAMPLES * k.bucket_ms)
        m = measure(fn, device=device, warmup_ms=prof["warmup_ms"], rep_ms=rep_ms,
                    cache=cache, retries=0, timer=timer, label=f"eval {k.name}")
        r = m.region
        out.append({"kernel": k.name, "bucket_ms": k.bucket_ms, "median_ms": m.median_ms,
                    "mean_ms": m.mean_ms, "min_ms": m.min_ms, "p95_ms": m.p95_ms,
                    "samples": len(m.samples_ms), "offcpu_fraction": m.offcpu_fraction,
                    "warnings": [w.name for w in m.warnings],
                    "region": {"region": r.region, "mode": r.mode, "waited_s": r.waited_s,
                               "held_s": r.held_s, "clean": r.clean,
                               "reasons": [x.to_dict() for x in r.reasons]}})
    return out


def run(spec: dict[str, Any], phase: str, seed: int) -> dict[str, Any]:
    from krex.eval.compile import compile_once

    res: dict[str, Any] = {"pid": os.getpid(), "phase": phase,
                           "import_s": _T_IMPORT - _T0, "kernels": []}
    t = time.perf_counter()
    timer = _context(spec["device"]) if phase != "compile" else None
    res["context_s"] = time.perf_counter() - t
    if phase in ("all", "compile"):
        t = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="krex-eval-cc-") as work:
            compile_once(spec["n_funcs"], work, seed)
        res["compile_s"] = time.perf_counter() - t
    if phase in ("all", "check", "time"):
        kernels = _kernels(spec, timer)
        t = time.perf_counter()
        if phase in ("all", "check"):
            _check(kernels, timer, spec["profile"]["check_ms"])
        res["check_s"] = time.perf_counter() - t
        if phase in ("all", "time"):
            t = time.perf_counter()
            res["kernels"] = _time(kernels, timer, spec)
            res["timing_s"] = time.perf_counter() - t
    return res


def main(argv: list[str]) -> int:
    spec_path, result_path = argv[0], argv[1]
    phase = argv[argv.index("--phase") + 1] if "--phase" in argv else "all"
    seed = int(argv[argv.index("--seed") + 1]) if "--seed" in argv else 0
    with open(spec_path) as f:
        spec = json.load(f)
    from krex import resultfile

    resultfile.write(result_path, run(spec, phase, seed), indent=None)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
