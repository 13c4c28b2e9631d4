"""The ideal throughput bound of each mode, from phase sizes measured alone.

The fastest of two commands alone, fresh and in a warm worker, gives: start-up ``s``
(interpreter, imports, context), compile ``c``, check ``k``, timing ``t`` of
which ``r`` is held in regions, warm dispatch ``w``; the profile gives the
serialised context delay ``x`` (fakegpu).  Per mode, a command needs:

- ``E`` exclusive device seconds (``command``: the whole command;
  ``function``: two fresh start-ups + check + timing; region modes: ``r``);
- ``H`` host core-seconds outside ``E`` (start-up less ``x``, or dispatch; compile; on
  ``cpu`` the check and warm-up; on this machine fakegpu's device is a host
  thread spinning through every kernel, so its busy time is host time too);
- ``X`` serialised context creation (``x`` per fresh device process);
- ``D`` device busy seconds (check + timing on fakegpu).

Seconds per command at the bottleneck: with siblings frozen during regions
``E + H / cores``; otherwise ``max(E, (H + E_host) / cores)``; never below
``X`` or ``D``.  Bound = 60 / that, commands per minute, one device.
"""

from __future__ import annotations

from typing import Any

from krex.eval.modes import MODES


def phase_sizes(alone: dict[str, Any], device: str, ctx_delay_ms: float) -> dict[str, float]:
    """Phase sizes of the fastest alone run of each kind (fresh, warm)."""
    fresh = min(alone["fresh"], key=lambda c: c["wall_s"])
    warm = min(alone["warm"], key=lambda c: c["wall_s"])
    p = fresh["phases"]
    c, k, t = p.get("compile_s", 0.0), p.get("check_s", 0.0), p.get("timing_s", 0.0)
    r = sum((kr.get("region") or {}).get("held_s") or 0.0 for kr in fresh["kernels"])
    wp = warm["phases"]
    work_w = wp.get("compile_s", 0.0) + wp.get("check_s", 0.0) + wp.get("timing_s", 0.0)
    return {"startup_s": max(0.0, fresh["wall_s"] - c - k - t), "compile_s": c, "check_s": k,
            "timing_s": t, "region_s": min(r, t), "dispatch_s": max(0.0, warm["wall_s"] - work_w),
            "ctx_s": ctx_delay_ms / 1e3 if device.startswith("fakegpu") else 0.0}


def seconds_per_command(mode_name: str, ph: dict[str, float], device: str, cores: int,
                        spin_host: bool) -> float:
    mode = MODES[mode_name]
    s, c, k, t, r = (ph[x] for x in ("startup_s", "compile_s", "check_s", "timing_s",
                                     "region_s"))
    cpu = device == "cpu"
    device_s = k + t
    cpu_start = max(0.0, s - ph["ctx_s"])  # the context delay is a serialised wait, not CPU
    start = ph["dispatch_s"] if mode.warm else cpu_start
    frozen = mode.frozen_regions and mode.job_mode == "region"
    spin = (device_s - (r if frozen else 0.0)) if spin_host else 0.0  # r is inside E
    host = start + c + ((k + t - r) if cpu else 0.0) + spin
    n_ctx = 0 if mode.warm else 1
    if mode.launch == "function":
        exclusive, host, n_ctx = 2 * s + k + t, host + 2 * cpu_start, 2
    elif mode.name == "command":
        exclusive = s + c + k + t
    elif mode.name == "none":
        exclusive = 0.0
    else:
        exclusive = r
    floor = max(n_ctx * ph["ctx_s"], 0.0 if cpu else device_s)
    if frozen:
        return max(exclusive + host / cores, floor)
    return max(exclusive, (host + (r if cpu else 0.0)) / cores, floor)


def bounds(alone: dict[str, Any], device: str, ctx_delay_ms: float,
           modes: list[str], cores: int) -> dict[str, Any]:
    """Bound (commands/min) per mode, on ``cores`` cores; fakegpu spin counted as host time."""
    ph = phase_sizes(alone, device, ctx_delay_ms)
    out: dict[str, Any] = {"phase_sizes_s": ph, "cores": cores, "per_mode_cpm": {}}
    spin = device.startswith("fakegpu")
    for name in modes:
        out["per_mode_cpm"][name] = 60.0 / max(
            seconds_per_command(name, ph, device, cores, spin_host=spin), 1e-9)
    node: dict[str, float] = {}
    for name in modes:  # a 16-core node with a real device: no host thread spins for it
        node[name] = 60.0 / max(seconds_per_command(name, ph, device, 16, spin_host=False), 1e-9)
    out["node16_per_mode_cpm"] = node
    return out
