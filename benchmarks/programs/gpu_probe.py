"""The measured job of gpu_check.py's inflation check: one kernel per krex eval bucket.

argv: DEVICE OUT_JSON SIZES_JSON FAMILIES [bare]
FAMILIES, comma-separated: ``driver`` (a PTX spin kernel through the driver API with
ctypes, timed with krex's DriverEventTimer; fakegpu: spin_ns_N with FakegpuTimer) and
``torch`` (``torch.cuda._sleep(cycles)``, timed with torch events; GPU only).
Calibrations (cycles per ms) are made by the first run and reused by every later run,
so the alone and the loaded runs time the very same kernels.  Each kernel is timed
by krex.measure, whose region covers the timed loop only; with ``bare`` (run outside
krex: no daemon, no interposer) the same warm-up and number of samples are taken with
the same timer and no region: the baseline of krex itself.
"""

import json
import sys
import time

from gpu_driver import Driver, parse_device

import krex
from krex.eval.profile import BUCKETS_MS  # the buckets krex eval reports

device, out, sizes_path, families = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4].split(",")
bare = sys.argv[5:] == ["bare"]
kind, index = parse_device(device)
try:
    with open(sizes_path) as f:
        SIZES = json.load(f)
except FileNotFoundError:
    SIZES = {}


def driver_kernels():
    from krex.measure.events import DriverEventTimer, FakegpuTimer

    timer = FakegpuTimer(index) if kind == "fakegpu" else DriverEventTimer(index)
    drv = Driver(device, lib=timer.api.lib)
    return {f"driver-{ms:g}ms": (ms, drv.spin(ms), timer) for ms in BUCKETS_MS}


def torch_kernels():
    import torch

    from krex.measure.events import TorchEventTimer

    torch.cuda.set_device(index)
    if "torch_cycles_per_ms" not in SIZES:
        torch.cuda._sleep(1000)
        torch.cuda.synchronize()
        ratios = []
        for _ in range(5):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            torch.cuda._sleep(10_000_000)
            b.record()
            b.synchronize()
            ratios.append(10_000_000 / a.elapsed_time(b))
        SIZES["torch_cycles_per_ms"] = sorted(ratios)[2]
    per_ms = SIZES["torch_cycles_per_ms"]
    timer = TorchEventTimer(index, device)
    return {f"torch-{ms:g}ms": (ms, lambda c=int(ms * per_ms): torch.cuda._sleep(c), timer)
            for ms in BUCKETS_MS}


kernels = {}
errors = {}
for family, make in (("driver", driver_kernels), ("torch", torch_kernels)):
    if family in families:
        try:
            kernels.update(make())
        except Exception as exc:  # noqa: BLE001  (recorded; the other family still runs)
            errors[family] = f"{type(exc).__name__}: {exc}"
def bare_samples(fn, timer, ms: float) -> list[float]:
    """krex.measure's warm-up and sample budget, timed with the same timer, no region.
    The warm-up is counted in kernels, as krex.measure's is (``loop.warm_up``): launches
    are asynchronous, and a loop on the host's clock queued seconds of device work (on
    fakegpu a 10 ms kernel's 30 ms warm-up took 6-15 s to drain)."""
    for _ in range(max(1, int(max(5, 3 * ms) / ms))):
        fn()
    timer.synchronize()
    samples, end = [], time.perf_counter() + max(0.15, 30 * ms / 1e3)
    while time.perf_counter() < end or len(samples) < 5:
        start = timer.start()
        fn()
        samples.append(timer.elapsed_ms(timer.stop(start)))
    return samples


results = {}
for name, (ms, fn, timer) in kernels.items():
    if bare:
        results[name] = {"bucket_ms": ms, "samples_ms": bare_samples(fn, timer, ms),
                         "clean": None}
        continue
    m = krex.measure(fn, device=device, timer=timer, cache="hot", warmup_ms=max(5, 3 * ms),
                     min_time_s=max(0.15, 30 * ms / 1e3), max_time_s=max(0.3, 40 * ms / 1e3),
                     timeout_s=10, retries=0, noise_target=0.0, cuda_graph=False)
    results[name] = {"bucket_ms": ms, "samples_ms": m.samples_ms,
                     "clean": m.region.clean, "held_s": m.region.held_s,
                     "reasons": [r.message for r in m.region.reasons]}
with open(out, "w") as f:
    json.dump({"kernels": results, "errors": errors}, f)
with open(sizes_path, "w") as f:
    json.dump(SIZES, f)
