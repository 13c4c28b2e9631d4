"""``krex doctor``: the machine's capabilities relevant to krex, with advice."""

from __future__ import annotations

import os
from typing import Any

from krex.devices import discover


def _check(name: str, ok: bool, detail: str, advice: str = "") -> dict[str, Any]:
    return {"check": name, "ok": ok, "detail": detail, "advice": "" if ok else advice}


def _cgroup_checks() -> list[dict[str, Any]]:
    v2 = [p for p in ("/sys/fs/cgroup", "/sys/fs/cgroup/unified")
          if os.path.exists(os.path.join(p, "cgroup.controllers"))]
    v1 = sorted(c for c in ("freezer", "cpuset", "cpu", "memory")
                if os.path.isdir(os.path.join("/sys/fs/cgroup", c)))
    return [
        _check("cgroup v2", bool(v2), ", ".join(v2) or "not mounted",
               "mount cgroup2 (systemd.unified_cgroup_hierarchy=1) for the fastest freeze"),
        _check("cgroup v1 controllers", bool(v1), ", ".join(v1) or "none",
               "the freezer/cpuset v1 controllers are a fallback when v2 is missing"),
    ]


def diagnose() -> dict[str, Any]:
    root = os.geteuid() == 0
    checks = [_check("root", root, f"euid {os.geteuid()}",
                     "cgroup freezing and cpusets need root or a delegated cgroup subtree")]
    checks += _cgroup_checks()
    devices = discover()
    checks.append(_check("devices", True, ", ".join(d.name for d in devices)))
    checks += _enforce_checks()
    return {"checks": checks, "devices": [d.to_dict() for d in devices]}


def _enforce_checks() -> list[dict[str, Any]]:
    from krex.devices.selftest import interposer_selftest
    from krex.enforce.doctor import capabilities

    caps = capabilities()
    advice = "; ".join(caps["advice"])
    freeze = caps["freeze"]
    checks = [_check(f"freeze: {name}", info["ok"], info["why"] or "available", advice)
              for name, info in freeze.items()]
    checks.append(_check("freeze backend chosen", caps["freeze_chosen"] == "cgroup2",
                         caps["freeze_chosen"] or "none", advice))
    for name, info in caps["isolate"].items():
        checks.append(_check(f"isolate: {name}", info["ok"], info["why"] or "available",
                             advice))
    checks.append(_check("measure cores", bool(caps["measure_cores"]),
                         f"{caps['measure_cores']} of {caps['all_cores']}",
                         "CPU isolation needs at least 2 cores"))
    test = interposer_selftest()
    checks.append(_check("GPU interposer self-test", test["ok"], test["detail"],
                         "reinstall krex (pip install -e .) so the native parts are built"))
    return checks
