"""gpu_check.py's ``device_truth`` check (issue 45): does a region report what the device saw?

Three runs of a holder through a private daemon (its sampler every 5 ms):

1. ``control``: three regions with nothing else on the device: no
   ``foreign_device_process``; the NVML account (clocks at grant and release, the
   sampler's summary between) is recorded.
2. ``foreign``: the same with a process krex does not manage holding a context on
   the device (``programs/gpu_foreign.py``, started without ``krex run``): every
   region must name its pid.
3. ``throttle``: one region of 1.5 s of kernels during which the check lowers the
   SM clock to about half for 0.5 s and puts it back: the region must say
   ``throttled`` with a clock dip between grant and release (the sampler's), where
   the readings at grant and release alone would have seen steady clocks.

On ``cuda:N`` the management library is the real NVML (lowering the clock needs root:
``nvmlDeviceSetGpuLockedClocks``; without it the third run is skipped) and the foreign
context is real.  On ``fakegpu:N`` the library boundary is the fake NVML of
``tests/fakenvml`` (the daemon's ``--fakegpu-nvml`` hook): the stranger is a sleeping
process listed in the fake's state, the clock is the fake's -- the daemon's code from
``import pynvml`` on is the one that runs on a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

from common import private_daemon
from gpu_check import PROGRAMS, PY, ROOT, Procs, Skipped, kind_of, krex_cmd, pyenv, tail

FAKE_NVML = os.path.join(ROOT, "tests", "fakenvml")
LONG_REGION_S = 1.5


class RealNvml:
    """The device's NVML (cuda:N): a real foreign context, the real clock lock."""

    flags: tuple[str, ...] = ()

    def __init__(self, args: argparse.Namespace) -> None:
        import pynvml

        self.nvml, self.args = pynvml, args
        pynvml.nvmlInit()
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(int(args.device.partition(":")[2] or 0))

    def foreign(self, procs: Procs, env: dict[str, str]) -> int:
        p = procs.popen([PY, os.path.join(PROGRAMS, "gpu_foreign.py"), self.args.device],
                        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if p.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the foreign context did not start: {tail(p.stderr.read())}")
        return p.pid

    def unlisted(self, pid: int) -> None:
        pass  # its process ends: NVML stops listing it

    def lower_clock(self) -> int:
        if os.geteuid() != 0:
            raise Skipped("lowering the SM clock needs root (nvmlDeviceSetGpuLockedClocks)")
        n, h = self.nvml, self.handle
        top = n.nvmlDeviceGetMaxClockInfo(h, n.NVML_CLOCK_SM)
        supported = n.nvmlDeviceGetSupportedGraphicsClocks(
            h, n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_MEM))
        low = min(supported, key=lambda mhz: abs(mhz - top / 2))
        n.nvmlDeviceSetGpuLockedClocks(h, low, low)
        return int(low)

    def restore_clock(self) -> None:
        n, h = self.nvml, self.handle
        if getattr(self.args, "clocks_locked", False):  # the environment check's lock at max
            top = n.nvmlDeviceGetMaxClockInfo(h, n.NVML_CLOCK_SM)
            n.nvmlDeviceSetGpuLockedClocks(h, top, top)
        else:
            n.nvmlDeviceResetGpuLockedClocks(h)


class FakeNvml:
    """tests/fakenvml standing for fakegpu:0's NVML (the daemon's test hook)."""

    flags = ("--fakegpu-nvml", "0")

    def __init__(self, state: str) -> None:
        if not os.path.isdir(FAKE_NVML):
            raise Skipped("fakegpu has no NVML, and tests/fakenvml is not in this checkout")
        sys.path.insert(0, FAKE_NVML)
        import pynvml  # the fake

        self.nvml, self.state = pynvml, state

    def foreign(self, procs: Procs, env: dict[str, str]) -> int:
        p = procs.popen([PY, "-c", "import time; print('ready', flush=True); time.sleep(600)"],
                        stdout=subprocess.PIPE, text=True)
        p.stdout.readline()
        self.nvml.update(processes=[{"pid": p.pid, "used_mib": 1}])
        return p.pid

    def unlisted(self, pid: int) -> None:
        self.nvml.update(processes=[])

    def lower_clock(self) -> int:
        self.nvml.update(sm_clock_mhz=990)
        return 990

    def restore_clock(self) -> None:
        self.nvml.update(sm_clock_mhz=self.nvml.DEFAULT["sm_clock_mhz"])


@contextlib.contextmanager
def management(args: argparse.Namespace) -> Iterator[RealNvml | FakeNvml]:
    """The device's management library, and the environment the daemon needs for it."""
    kind = kind_of(args.device)
    if kind == "cuda":
        try:
            yield RealNvml(args)
        except ImportError as exc:
            raise Skipped(f"NVML (nvidia-ml-py) is not installed: {exc}") from None
        return
    if kind != "fakegpu":
        raise Skipped(f"{args.device}: the device's truth is read through NVML (cuda) here")
    with tempfile.TemporaryDirectory(prefix="krex-gpucheck-nvml-") as tmp:
        saved = {k: os.environ.get(k) for k in ("KREX_FAKE_NVML", "PYTHONPATH")}
        os.environ["KREX_FAKE_NVML"] = os.path.join(tmp, "nvml.json")
        os.environ["PYTHONPATH"] = ":".join(filter(None, [FAKE_NVML, saved["PYTHONPATH"]]))
        try:
            yield FakeNvml(os.environ["KREX_FAKE_NVML"])
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            with contextlib.suppress(ValueError):
                sys.path.remove(FAKE_NVML)
            sys.modules.pop("pynvml", None)


def _holder(args: argparse.Namespace, env: dict[str, str], tmp: str, name: str) -> list[dict]:
    out = os.path.join(tmp, f"{name}.json")
    done = subprocess.run(krex_cmd("run", "--device", args.device, "--name", name, "--", PY,
                                   os.path.join(PROGRAMS, "region_holder.py"), args.device,
                                   "3", out, "20"),
                          env=env, capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise RuntimeError(f"{name} holder exited {done.returncode}: {tail(done.stderr)}")
    with open(out) as f:
        return [item["report"] for item in json.load(f)]


def _codes(report: dict) -> list[str]:
    return [r["code"] for r in report.get("reasons", [])]


def _foreign_pids(report: dict) -> list[int]:
    return [p["pid"] for r in report.get("reasons", []) if r["code"] == "foreign_device_process"
            for p in r["evidence"]["processes"]]


def _throttle(args: argparse.Namespace, mgmt: RealNvml | FakeNvml, env: dict[str, str],
              tmp: str, procs: Procs) -> dict[str, Any]:
    out = os.path.join(tmp, "long.json")
    p = procs.popen(krex_cmd("run", "--device", args.device, "--name", "long", "--", PY,
                             os.path.join(PROGRAMS, "long_region.py"), args.device,
                             str(LONG_REGION_S), out),
                    env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if p.stdout.readline().strip() != "in region":
        raise RuntimeError(f"the long region did not start: {tail(p.stderr.read())}")
    time.sleep(0.4)
    low = mgmt.lower_clock()
    try:
        time.sleep(0.5)
    finally:
        mgmt.restore_clock()
    _, err = p.communicate(timeout=60)
    if p.returncode != 0:
        raise RuntimeError(f"the long region exited {p.returncode}: {tail(err)}")
    with open(out) as f:
        report = json.load(f)
    found = next((r for r in report.get("reasons", []) if r["code"] == "throttled"), None)
    ev = found["evidence"] if found else {}
    return {"ok": found is not None and (ev.get("min_clock_ratio_between") or 1.0) < 0.9,
            "lowered_to_mhz": low, "throttled": found is not None,
            "clock_ratio_at_release": ev.get("clock_ratio"),
            "min_clock_ratio_between": ev.get("min_clock_ratio_between"),
            "between": (report.get("device_audit") or {}).get("end", {}).get("between")}


def check_device_truth(args: argparse.Namespace) -> dict[str, Any]:
    with management(args) as mgmt, \
            private_daemon(*mgmt.flags, "--device-sample-ms", "5") as sock, \
            Procs() as procs, tempfile.TemporaryDirectory() as tmp:
        env = pyenv({**os.environ, "KREX_SOCKET": sock})
        control = _holder(args, env, tmp, "control")
        stranger = mgmt.foreign(procs, env)
        try:
            foreign = _holder(args, env, tmp, "foreign")
        finally:
            procs.reap()
            mgmt.unlisted(stranger)
        try:
            throttle = _throttle(args, mgmt, env, tmp, procs)
        except Skipped as exc:
            throttle = {"ok": None, "skipped": str(exc)}
    named = [stranger in _foreign_pids(r) for r in foreign]
    audit = (control[-1].get("device_audit") or {}) if control else {}
    out = {"control_reasons": [_codes(r) for r in control],
           "control_audit": {"start": audit.get("start"), "end": audit.get("end")},
           "foreign_pid": stranger, "foreign_named": named,
           "foreign_reasons": [_codes(r) for r in foreign], "throttle": throttle}
    out["ok"] = (not any("foreign_device_process" in c for c in out["control_reasons"])
                 and bool(named) and all(named) and throttle["ok"] is not False)
    return out
