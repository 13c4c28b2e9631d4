"""gpu_check.py's checks judged on the device: prerequisites, held stacks, overlap.

- ``prerequisites``: everything the run needs, checked up front (the GPU machine
  has no network: what is missing cannot be installed there).
- ``held``: each framework stack (torch eager, a CUDA graph the sibling captured,
  Triton, cuBLAS, cuda-python, ctypes) runs under the interposer; its gate is
  closed, the stack is told to run: it must not finish while the gate is closed,
  the interposer must have parked it, its drain must be acknowledged clean, and
  it must finish once the gate opens.
- ``overlap``: a sibling streams kernels that stamp their start and end with the
  device's global timer; a holder takes regions, each with stamped kernels.  A
  sibling kernel whose device-time interval intersects a region's is an overlap.
  ``region`` (gate + drain + freeze) must show none; the positive control
  (freeze without drain, ``--no-gate``) must show some, or the method proves
  nothing; the negative control (the sibling's stamps all from before the
  holder's regions) must show none.
"""

from __future__ import annotations

import argparse
import bisect
import importlib.util
import json
import os
import select
import subprocess
import tempfile
import time
from typing import Any

from common import private_daemon
from gpu_check import PROGRAMS, PY, Procs, Skipped, device_env, kind_of, krex_cmd, pyenv, tail

REQUIRED = {"krex": "this repository, installed (pip install -e .)",
            "psutil": "krex's dependency"}
OPTIONAL = {"torch": "torch stacks (eager, CUDA graph, cuBLAS) and torch inflation family",
            "triton": "the Triton stack", "cuda.bindings": "the cuda-python stack (cuda-bindings)",
            "pynvml": "cuda:N discovery and the NVML audit (nvidia-ml-py): REQUIRED on cuda:N"}
HELD_STACKS = ("torch_eager", "torch_graph", "triton", "cublas", "cuda_python", "ctypes")
HELD_NEEDS = {"torch_eager": "torch", "torch_graph": "torch", "triton": "triton",
              "cublas": "torch", "cuda_python": "cuda.bindings", "ctypes": None}


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


# -- prerequisites ---------------------------------------------------------------------


def check_prerequisites(args: argparse.Namespace) -> dict[str, Any]:
    missing, notes = [], {}
    for module, why in REQUIRED.items():
        if not _importable(module):
            missing.append(f"python package {module} ({why})")
    for module, why in OPTIONAL.items():
        notes[module] = "present" if _importable(module) else f"missing: {why}"
    from krex.devices.native import check_interposer
    from krex.errors import KrexError

    try:
        check_interposer()
    except KrexError as exc:
        missing.append(f"the native interposer: {exc.message}")
    if kind_of(args.device) == "cuda":
        if not _importable("pynvml"):
            missing.append("nvidia-ml-py (pynvml): krex discovers cuda:N through NVML")
        missing += _driver_problems(args.device)
    out = {"ok": not missing, "missing": missing, "optional": notes}
    if missing:
        out["error"] = "missing prerequisites: " + "; ".join(missing)
    return out


def _driver_problems(device: str) -> list[str]:
    code = ("import ctypes,sys;l=ctypes.CDLL('libcuda.so.1');n=ctypes.c_int();"
            "r=l.cuInit(0);l.cuDeviceGetCount(ctypes.byref(n));print(r,n.value)")
    done = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        return [f"NVIDIA's libcuda.so.1 cannot be loaded: {tail(done.stderr, 200)}"]
    rc, count = (int(x) for x in done.stdout.split())
    index = int(device.partition(":")[2] or 0)
    if rc != 0 or count <= index:
        return [f"cuInit returned {rc} and {count} devices are visible: {device} is not usable"]
    return []


# -- held: framework stacks under a closed gate ---------------------------------------------


def check_held(args: argparse.Namespace) -> dict[str, Any]:
    from krex.devices.native import preload_env
    from krex.enforce.gate import GateFile

    fake = kind_of(args.device) == "fakegpu"
    stacks: dict[str, Any] = {}
    with device_env(args.device) as base, tempfile.TemporaryDirectory() as tmp, \
            Procs() as procs:
        running = {}
        for stack in HELD_STACKS:
            need = HELD_NEEDS[stack]
            if fake and stack != "ctypes":
                stacks[stack] = {"ok": False, "skipped": "needs a real CUDA GPU"}
                continue
            if need and not _importable(need):
                stacks[stack] = {"ok": False, "skipped": f"{need} is not installed"}
                continue
            gate = GateFile.create(os.path.join(tmp, f"gate-{stack}"))
            env = pyenv(preload_env(gate.path, 0, base=base))
            p = procs.popen([PY, os.path.join(PROGRAMS, "held_probe.py"), stack, args.device],
                            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
            running[stack] = (p, gate)
        try:
            stacks.update(_hold_all(running, hold_s=0.5 if args.quick else 1.0,
                                    timeout_s=max(10.0, args.remaining() - 5)))
        finally:
            for _, gate in running.values():
                gate.unlink()
    ran = [s for s in stacks.values() if "skipped" not in s]
    return {"ok": bool(ran) and all(s["ok"] for s in ran), "stacks": stacks}


def _line(p: subprocess.Popen, timeout_s: float) -> str | None:
    ready, _, _ = select.select([p.stdout], [], [], max(0.0, timeout_s))
    return p.stdout.readline().strip() if ready else None


def _hold_all(running: dict, hold_s: float, timeout_s: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    deadline = time.monotonic() + timeout_s
    for stack, (p, _) in list(running.items()):
        line = _line(p, deadline - time.monotonic())
        if line is None or not line.startswith(("ready", "skip")):
            out[stack] = {"ok": False, "error": f"did not start: {line!r} "
                                                f"{tail(p.stderr.read() if p.poll() else '')}"}
            running.pop(stack)
        elif line.startswith("skip"):
            out[stack] = {"ok": False, "skipped": line[5:]}
            running.pop(stack)
    generations = {stack: gate.close(0) for stack, (_, gate) in running.items()}
    for p, _ in running.values():
        p.stdin.write("go\n")
        p.stdin.flush()
    # Hold until every stack has reached the closed gate (a loaded machine may take a
    # while to schedule it), then hold_s more: a fixed sleep alone can end before a
    # stack launched anything, and a stack that never parks still fails ("parked" 0).
    wait_until = min(deadline, time.monotonic() + 10.0)
    while time.monotonic() < wait_until and not all(
            sum(s.counters.get("parked", 0) for s in gate.slots(0)) > 0
            for _, gate in running.values()):
        time.sleep(0.02)
    time.sleep(hold_s)
    for stack, (p, gate) in running.items():
        early = _line(p, 0)
        try:
            acks = gate.wait_drained(0, generations[stack], timeout_s=10)
        except Exception as exc:  # noqa: BLE001  (recorded per stack)
            acks, exc_text = {}, str(exc)
        else:
            exc_text = ""
        slots = gate.slots(0)
        out[stack] = {"finished_while_closed": early is not None and early.startswith("done"),
                      "parked": sum(s.counters.get("parked", 0) for s in slots),
                      "drained": bool(acks) and all(s.ack_status == 0 for s in slots),
                      "drain_error": exc_text,
                      "unwrapped": sum(s.counters.get("unwrapped", 0) for s in slots)}
    for stack, (p, gate) in running.items():
        gate.open(0)
        line = _line(p, max(5.0, deadline - time.monotonic()))
        r = out[stack]
        r["released"] = bool(line and line.startswith("done"))
        r["ok"] = (not r["finished_while_closed"] and r["parked"] > 0 and r["drained"]
                   and r["released"] and r["unwrapped"] == 0)
    return out


# -- overlap on the device's clock ------------------------------------------------------------


def check_overlap(args: argparse.Namespace) -> dict[str, Any]:
    n = 15 if args.quick else 30
    out: dict[str, Any] = {}
    for case, flags in (("region", ()), ("positive_control", ("--no-gate",)),
                        ("negative_control", ())):
        if args.remaining() < 15:
            out[case] = {"skipped": "budget"}
            continue
        out[case] = _overlap_case(args, case, flags, n)
    expect = {"region": lambda r: r["overlapping_regions"] == 0,
              "positive_control": lambda r: r["overlapping_regions"] > 0,
              "negative_control": lambda r: r["overlapping_regions"] == 0}
    for case, r in out.items():
        if "regions" in r:
            r["as_expected"] = expect[case](r)
    ok = all(r.get("as_expected") for r in out.values())
    return {"ok": ok, "cases": out, "regions_per_case": n}


def _overlap_case(args: argparse.Namespace, case: str, flags: tuple, n: int) -> dict[str, Any]:
    with private_daemon(*flags) as sock, Procs() as procs, tempfile.TemporaryDirectory() as tmp:
        env = pyenv({**os.environ, "KREX_SOCKET": sock})
        sib_out, hold_out = os.path.join(tmp, "sibling.json"), os.path.join(tmp, "holder.json")
        sibling = procs.popen(krex_cmd("run", "--device", args.device, "--name", "stamper", "--",
                                       PY, os.path.join(PROGRAMS, "stamp_job.py"), "sibling",
                                       args.device, sib_out, "60"),
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if _line(sibling, 60) != "running":
            raise RuntimeError(f"the stamping sibling did not start: {tail(sibling.stderr.read())}")
        if case == "negative_control":  # the sibling's kernels all end before the regions
            time.sleep(0.5)
            sibling.terminate()
            sibling.wait(30)
        else:
            time.sleep(0.3)
        holder = procs.popen(krex_cmd("run", "--device", args.device, "--name", "holder", "--",
                                      PY, os.path.join(PROGRAMS, "stamp_job.py"), "holder",
                                      args.device, hold_out, str(n)),
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        _, err = holder.communicate(timeout=max(10.0, args.remaining() - 5))
        if holder.returncode != 0:
            raise RuntimeError(f"holder exited {holder.returncode}: {tail(err)}")
        if sibling.poll() is None:
            sibling.terminate()
            sibling.wait(30)
        with open(sib_out) as f:
            stamps = json.load(f)["stamps"]
        with open(hold_out) as f:
            held = json.load(f)
    return judge(held["regions"], stamps) | {
        "clean": sum(held["clean"]), "sibling_kernels": len(stamps)}


def judge(regions: list[list[list[int]]], sibling: list[list[int]]) -> dict[str, Any]:
    """Overlap of each region's device-time window with the sibling's kernels."""
    spans = sorted((s, e) for s, e in sibling if e > s)
    starts = [s for s, _ in spans]
    overlapping, overlap_ns = 0, 0
    for kernels in regions:
        done = [(s, e) for s, e in kernels if e > s]
        if not done:
            continue
        a, b = min(s for s, _ in done), max(e for _, e in done)
        hits = [(s, e) for s, e in spans[:bisect.bisect_left(starts, b)] if e > a]
        overlapping += bool(hits)
        overlap_ns += sum(min(e, b) - max(s, a) for s, e in hits)
    return {"regions": len(regions), "overlapping_regions": overlapping,
            "overlap_ns": overlap_ns, "overlap_ms": round(overlap_ns / 1e6, 3)}


def skip_unless_gpu(args: argparse.Namespace) -> None:
    if kind_of(args.device) not in ("cuda", "fakegpu"):
        raise Skipped(f"{args.device}: device-clock checks need CUDA or fakegpu")
