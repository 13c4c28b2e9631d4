"""What this machine supports for host enforcement, and how to get the best.

:func:`capabilities` probes the cgroup layout and the enforcer's backends and
adds advice (the next action) for every missing piece; ``krex doctor`` prints it.
"""

from __future__ import annotations

import os

from krex.enforce.cgroups import CgroupLayout
from krex.enforce.enforcer import EnforceConfig, Enforcer
from krex.enforce.process import _HAVE_PIDFD


def capabilities(layout: CgroupLayout | None = None) -> dict:
    layout = layout or CgroupLayout.probe()
    info = Enforcer(EnforceConfig(), layout).backends()
    info["pidfd"] = _HAVE_PIDFD
    info["root"] = os.geteuid() == 0
    info["cgroup_layout"] = {
        "v2_root": layout.v2_root,
        "v2_base": layout.v2_base,
        "freezer": layout.freezer,
        "cpuset": layout.cpuset,
        "reasons": dict(layout.reasons),
    }
    info["advice"] = advice(info, layout)
    return info


def advice(info: dict, layout: CgroupLayout) -> list[str]:
    out = []
    if info["freeze_chosen"] != "cgroup2":
        if layout.v2_root is None:
            out.append(
                "mount cgroup2 (or boot with systemd.unified_cgroup_hierarchy=1) for the "
                "fastest freezer (cgroup.freeze)"
            )
        else:
            out.append(
                "run krexd as root, or in a delegated cgroup (systemd-run --user --scope "
                "-p Delegate=yes krex serve), to freeze with cgroup.freeze"
            )
    if info["freeze_chosen"] == "signal":
        out.append("freezing falls back to SIGSTOP: slower, and visible to the jobs (state T)")
    if not info["isolate"]["cpuset"]["ok"]:
        out.append(
            "no writable cpuset cgroup: isolation uses per-thread affinity (threads a job "
            "starts mid-region inherit it; a cpuset moves them all)"
        )
    if not info["isolate"]["affinity"]["ok"]:
        out.append(f"CPU isolation unavailable: {info['isolate']['affinity']['why']}")
    if not info["pidfd"]:
        out.append(
            "no pidfd (Linux < 5.3 or Python < 3.9): signals use kill() after a start-time "
            "check, with a tiny PID-reuse window"
        )
    return out
