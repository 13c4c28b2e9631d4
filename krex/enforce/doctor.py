"""What this machine supports for krex, and how to get the best: ``krex doctor``.

:func:`capabilities` probes the cgroup layout and the enforcer's backends
once and adds advice (the next action) for every missing piece;
:func:`diagnose` turns that, the devices and the interposer self-test into
the checks ``krex doctor`` renders (the CLI probes nothing itself).
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from krex.enforce.cgroups import CgroupLayout, favordynmods, instance_name, write
from krex.enforce.enforcer import EnforceConfig, Enforcer
from krex.enforce.process import _HAVE_PIDFD
from krex.enforce.warm import DEFAULT_LINGER_S, DEFAULT_PERIOD_MS


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
    info["unmanaged"] = unmanaged_mode()
    info["shield"] = shield_mode(layout)
    info["advice"] = advice(info, layout)
    return info


def unmanaged_mode() -> dict[str, Any]:
    """How this machine handles tasks krex does not manage on the holder's cores:
    never moved; judged by the holder's run delay where the kernel reports it."""
    from krex.enforce.contention import delay_measurable, delay_threshold_ns, kernel_tick

    tick_s, source = kernel_tick()
    if delay_measurable():
        mode, why = "evidence", ("a region where they kept the holder waiting is reported "
                                 "not clean (holder_preempted, foreign_task); the shield "
                                 "(below) moves them off the reserved cores where it can")
    else:
        mode, why = "none", ("not judged: this kernel reports no run delay "
                             "(CONFIG_SCHED_INFO off): every region says contention_check "
                             "is unavailable")
    return {"mode": mode, "why": why, "tick_ms": round(tick_s * 1e3, 3), "tick_source": source,
            "threshold_ms_at_100ms": round(delay_threshold_ns(100_000_000) / 1e6, 3)}


def shield_mode(layout: CgroupLayout) -> dict[str, Any]:
    """The shield this machine supports (``cpuset-shield`` or ``none``, with the
    ``not_enforced`` code and why), whether ``KREX_SHIELD`` turns it off, and who holds
    the machine-wide lock (no lock is taken here)."""
    from krex.enforce.shield import configured_mode, lock_path, machine_mode

    out: dict[str, Any] = dict(machine_mode(layout))
    out["configured"] = configured_mode()
    out["held_by"] = _lock_owner(lock_path())
    return out


def _lock_owner(path: str) -> int | None:
    import fcntl

    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return None  # nobody holds it
    except OSError:
        text = os.pread(fd, 64, 0).decode(errors="replace").strip()
        return int(text) if text.isdigit() else -1
    finally:
        os.close(fd)


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


# -- what a cgroup move costs after a quiet spell ---------------------------------------------

#: A move slower than this after a quiet spell waited for an RCU grace period (measured
#: here: 5.8-13.8 ms; a move that does not wait takes 0.03-0.3 ms, cache-cold included).
GRACE_PERIOD_MS = 1.5


def move_cost(layout: CgroupLayout, quiet_s: float = 0.06, n: int = 3,
              daemon: dict[str, Any] | None = None) -> dict[str, Any]:
    """What moving a process between two cgroups costs here after ``quiet_s`` without a
    move, measured (``n`` moves of a sleeping child between two scratch cgroups, p50 ms),
    against back-to-back moves.  The kernel's ``cgroup_threadgroup_rwsem`` makes the first
    move after a quiet spell wait for an RCU grace period unless the cgroup2 mount has
    ``favordynmods``: a region set up after a pause pays it in its ``slot`` step, and its
    undo again.  ``daemon``: the running daemon's ``status()["daemon"]`` (None: none runs),
    for the verdict (:func:`move_verdict`).  ``{"ok": None, "why": ...}`` where no
    writable cgroup is at hand."""
    kind, base = _scratch_base(layout)
    out: dict[str, Any] = {"favordynmods": favordynmods(), "quiet_ms": quiet_s * 1e3,
                           "hierarchy": kind, "v2_root": layout.v2_root, "ok": None}
    if base is None:
        out["why"] = "no writable cgroup to move a process in (needs root)"
        return out
    top = os.path.join(base, "krex-" + instance_name("doctor"))
    dirs = [top, top + "/a", top + "/b"]
    sleeper = shutil.which("sleep")
    proc = subprocess.Popen([sleeper, "60"] if sleeper
                            else [sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        for d in dirs:
            os.mkdir(d)
            if kind == "cpuset":
                for name in ("cpuset.cpus", "cpuset.mems"):
                    write(f"{d}/{name}", _read(f"{base}/{name}"))
        quiet: list[float] = []
        back: list[float] = []
        for i in range(2 * n):
            if i % 2 == 0:
                time.sleep(quiet_s)
            t0 = time.perf_counter()
            write(f"{top}/{'ab'[i % 2]}/cgroup.procs", str(proc.pid))
            (quiet if i % 2 == 0 else back).append((time.perf_counter() - t0) * 1e3)
    except OSError as e:
        out["why"] = f"could not move a process between scratch cgroups: {e}"
        return out
    finally:
        proc.kill()
        proc.wait()
        for d in reversed(dirs):
            try:
                os.rmdir(d)
            except OSError:
                pass
    out["after_quiet_ms"] = round(statistics.median(quiet), 3)
    out["back_to_back_ms"] = round(statistics.median(back), 3)
    out.update(move_verdict(out["after_quiet_ms"], out["favordynmods"], *_warmer(daemon)))
    return out


def _warmer(daemon: dict[str, Any] | None) -> tuple[bool, str]:
    """Whether the daemon keeps moves warm, and which daemon that is: the running one as
    its status says, else one started with the defaults."""
    if daemon is None:
        return DEFAULT_PERIOD_MS > 0, "a daemon started with the defaults (none runs now)"
    warm = daemon.get("warm_moves") or {"state": "off", "why": "a krex too old to say"}
    who = f"the running daemon (pid {daemon.get('pid')})"
    if warm["state"] == "off":
        return False, f"{who} does not keep them warm: {warm['why']}"
    return True, who


def move_verdict(after_quiet_ms: float, favordynmods_on: bool | None,
                 warmed: bool = True,
                 by: str = "a daemon started with the defaults") -> dict[str, Any]:
    """``ok``: a move after a quiet spell did not wait for a grace period, or it does and
    the daemon keeps moves warm while regions are taken (``warmed``, ``by``: which daemon;
    krex.enforce.warm)."""
    waits = after_quiet_ms > GRACE_PERIOD_MS
    if not waits:
        return {"ok": True, "waits": False, "why": ""}
    why = ("a cgroup move after a quiet spell waits for an RCU grace period: a region set "
           "up after a pause pays it in its slot step, and its undo again")
    if favordynmods_on:
        why += " (although the cgroup2 mount has favordynmods: a loaded machine's grace period?)"
    elif warmed:
        return {"ok": True, "waits": True, "why": (
            why + f"; {by} keeps moves fast while regions are taken (krex serve "
            f"--warm-moves-ms, {DEFAULT_PERIOD_MS:g} by default): only a region after more "
            f"than --warm-linger-s ({DEFAULT_LINGER_S:g} s by default) without one pays it; "
            "favordynmods on the cgroup2 mount would remove the wait for good")}
    if not favordynmods_on:
        why += f"; {by}"
    return {"ok": False, "waits": True, "why": why}


def _scratch_base(layout: CgroupLayout) -> tuple[str, str | None]:
    for kind, base, ok in (("v2", layout.v2_base, layout.v2_writable),
                           ("freezer", layout.freezer, layout.freezer_writable),
                           ("cpuset", layout.cpuset, layout.cpuset_writable)):
        if base and ok:
            return kind, base
    return "", None


def _read(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


# -- krex doctor -----------------------------------------------------------------------------


def diagnose(layout: CgroupLayout | None = None,
             daemon: dict[str, Any] | None = None,
             clocks: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every check ``krex doctor`` shows: ``{"checks": [...], "devices": [...],
    "capabilities": capabilities()}``; each check has ``check``, ``ok``, ``detail``,
    ``advice`` (empty when ok).  ``daemon``: the running daemon's ``status()["daemon"]``,
    if one runs (the CLI asks it; this layer has no client); ``clocks``: its
    ``status()["enforcement"]["clocks"]`` (which devices it locked)."""
    from krex.devices import discover

    layout = layout or CgroupLayout.probe()
    caps = capabilities(layout)
    devices = discover()
    checks = [_check("root", caps["root"], f"euid {os.geteuid()}",
                     "cgroup freezing and cpusets need root or a delegated cgroup subtree")]
    checks += _cgroup_checks(caps["cgroup_layout"])
    checks.append(_check("devices", True, ", ".join(d.name for d in devices)))
    locked = (clocks or {}).get("locked")
    checks += device_checks([d.name for d in devices if d.name.startswith("cuda:")],
                            locked=locked)
    checks += [clock_check(d.name, locked) for d in devices if d.name.startswith("rocm:")]
    checks += _enforce_checks(caps)
    checks.append(_moves_check(move_cost(layout, daemon=daemon)))
    checks.append(_selftest_check())
    checks.append(_tenant_users_check())
    checks.append(_sandbox_check())
    return {"checks": checks, "devices": [d.to_dict() for d in devices], "capabilities": caps}


def _tenant_users_check() -> dict[str, Any]:
    """Can a root daemon's tenant user (krex serve --tenant-uids) run krex here?"""
    from krex.protocol.runas import DEFAULT_UIDS

    if os.geteuid() != 0:
        return _check("tenant users", True, f"euid {os.geteuid()}: a daemon of this user "
                      "runs tenants' code as this user")
    first = int(DEFAULT_UIDS.split("-")[0])
    return _reach_check("tenant users", first + 1, (first,), f"--tenant-uids {DEFAULT_UIDS}",
                        "a root daemon runs each tenant's code as a uid of its own, which "
                        "must read the interpreter and krex: install krex where every user "
                        "may read it (a venv under /opt from the system's Python), or give "
                        "the daemon --tenant-uids daemon where every tenant may have a shell "
                        "as root")


def _sandbox_check() -> dict[str, Any]:
    """Can an evaluation's candidate run as a uid of its own here (krex.evaluate.sandbox)?"""
    from krex.protocol.runas import SANDBOX_UIDS

    if os.geteuid() != 0:
        return _check("candidate sandbox", True, f"euid {os.geteuid()}: a candidate runs as "
                      "its driver's uid, without network, unable to read or signal the "
                      "driver and the reference (integrity.sandbox says so)")
    return _reach_check("candidate sandbox", int(SANDBOX_UIDS.split("-")[0]), (),
                        f"KREX_SANDBOX_UIDS {SANDBOX_UIDS}",
                        "a root driver runs each evaluation's candidate as a uid of its own, "
                        "which must read the interpreter and krex; until it can, candidates "
                        "run as root (no network, limited, signalling only themselves) and "
                        "each record's integrity.sandbox.missing names this: install krex "
                        "where every user may read it, or evaluate with --sandbox required")


def _reach_check(name: str, uid: int, groups: tuple[int, ...], what: str,
                 advice: str) -> dict[str, Any]:
    from krex.protocol.runas import RunAs

    user = RunAs(uid=uid, gid=uid, groups=groups, home="/")
    package = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "__init__.py")
    why = user.cannot_reach([os.path.realpath(sys.executable), os.__file__, package], [])
    return _check(name, why is None, why or f"uid {uid} ({what}) can run krex here", advice)


def _check(name: str, ok: bool, detail: str, advice: str = "") -> dict[str, Any]:
    return {"check": name, "ok": ok, "detail": detail, "advice": "" if ok else advice}


def _cgroup_checks(layout: dict[str, Any]) -> list[dict[str, Any]]:
    v1 = [f"{name} ({layout[name]})" for name in ("freezer", "cpuset") if layout.get(name)]
    return [
        _check("cgroup v2", bool(layout["v2_root"]), layout["v2_root"] or "not mounted",
               "mount cgroup2 (systemd.unified_cgroup_hierarchy=1) for the fastest freeze"),
        _check("cgroup v1 controllers", bool(v1), ", ".join(v1) or "none",
               "the freezer/cpuset v1 controllers are a fallback when v2 is missing"),
    ]


def _enforce_checks(caps: dict[str, Any]) -> list[dict[str, Any]]:
    advice = "; ".join(caps["advice"])
    checks = [_check(f"freeze: {name}", info["ok"], info["why"] or "available", advice)
              for name, info in caps["freeze"].items()]
    checks.append(_check("freeze backend chosen", caps["freeze_chosen"] == "cgroup2",
                         caps["freeze_chosen"] or "none", advice))
    checks += [_check(f"isolate: {name}", info["ok"], info["why"] or "available", advice)
               for name, info in caps["isolate"].items()]
    unmanaged = caps["unmanaged"]
    checks.append(_check(f"unmanaged tasks: {unmanaged['mode']}", unmanaged["mode"] != "none",
                         f"{unmanaged['why']} (tick {unmanaged['tick_ms']} ms from "
                         f"{unmanaged['tick_source']})",
                         "use a kernel with CONFIG_SCHED_INFO (schedstat) so contention is "
                         "judged"))
    shield = caps["shield"]
    held = f"; held by krex daemon pid {shield['held_by']}" if shield["held_by"] else ""
    checks.append(_check(f"shield: {shield['mode']}", shield["mode"] != "none",
                         (shield["why"] or "unmanaged tasks are moved off the reserved cores "
                          "during a region") + f" (KREX_SHIELD={shield['configured']}{held})",
                         "run the daemon as root on a machine with a cgroup v1 cpuset "
                         "hierarchy to keep unmanaged tasks off the holder's cores"))
    checks.append(_check("measure cores", bool(caps["measure_cores"]),
                         f"{caps['measure_cores']} of {caps['all_cores']}",
                         "CPU isolation needs at least 2 cores"))
    return checks


def device_checks(names: list[str], fakegpu_nvml: int | None = None,
                  locked: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """What each NVIDIA device says of its sharing and its contexts now (NVML): a device
    shared by MIG or MPS, or with processes holding a context on it, gives regions
    ``shared_device`` or ``foreign_device_process`` unless those are krex's own jobs.
    A device NVML does not answer for is said so (its regions get no device audit).
    ``locked``: the running daemon's locked clocks (``--lock-clocks``), if any."""
    from krex.devices.audit import nvml_device

    out = []
    for name in names:
        device = nvml_device(name, fakegpu_nvml)
        if device is None:
            out.append(_check(f"{name}: NVML", False, "NVML does not answer: no device audit",
                              "install the cuda extra (pip install 'krex[cuda]') and the "
                              "NVIDIA driver"))
            continue
        reading = device.read()
        sharing = "; ".join(f"{m.mode.upper()}: {m.detail}" for m in reading.sharing)
        out.append(_check(f"{name}: not shared", not reading.sharing, sharing or "no MIG, no MPS",
                          "regions there say shared_device: time on a device without MPS "
                          "(echo quit | nvidia-cuda-mps-control) and with MIG off "
                          "(nvidia-smi -i N -mig 0)"))
        procs = ", ".join(f"{p.pid} ({p.command or 'uid ' + str(p.uid)})"
                          for p in reading.processes)
        out.append(_check(f"{name}: contexts", not reading.processes,
                          procs or "no process has a context on it",
                          "a process krex does not manage makes its regions "
                          "foreign_device_process: stop it, or run it under krex run"))
        out.append(clock_check(name, locked))
    return out


def clock_check(name: str, locked: list[dict[str, Any]] | None) -> dict[str, Any]:
    """Whether the running daemon locked ``name``'s clocks (``--lock-clocks``)."""
    from krex.enforce.clocklock import AMD_LEVELS

    lock = next((c for c in locked or [] if c["device"] == name), None)
    how = ""
    if lock is not None:
        how = f"performance level {AMD_LEVELS[lock['mode']]}, " \
            if lock.get("library") == "amdsmi" else ""
        how += f"SM clock {lock['sm_mhz']} MHz ({lock['mode']})"
    return _check(f"{name}: clocks locked", lock is not None,
                  f"{how} by the running daemon" if lock
                  else "not locked: kernel times follow the boost clock and the heat",
                  "krex serve --lock-clocks base (root; reset when the daemon stops, or by "
                  "its guardian if it dies)")


def _moves_check(cost: dict[str, Any]) -> dict[str, Any]:
    if cost["ok"] is None:
        return _check("cgroup moves", True, f"not measured: {cost['why']}")
    fdm = {True: "on", False: "off", None: "no cgroup2 mount"}[cost["favordynmods"]]
    detail = (f"a move after {cost['quiet_ms']:.0f} ms of quiet took {cost['after_quiet_ms']} ms "
              f"p50, back to back {cost['back_to_back_ms']} ms ({cost['hierarchy']}; "
              f"favordynmods {fdm})")
    if cost["why"]:
        detail += f": {cost['why']}"
    root = cost["v2_root"] or "/sys/fs/cgroup"
    return _check("cgroup moves", cost["ok"], detail,
                  "let the daemon keep moves warm (krex serve without --warm-moves-ms 0), or "
                  f"mount -o remount,favordynmods {root} (machine-wide; fork and exit get a "
                  "little slower; from Linux 6.18 it stays in effect until reboot)")


def _selftest_check() -> dict[str, Any]:
    from krex.devices.selftest import interposer_selftest
    from krex.enforce.gate import GateFile

    with tempfile.TemporaryDirectory() as tmp, GateFile.create(os.path.join(tmp, "gate")) as gate:
        test = interposer_selftest(str(gate.path))
    return _check("GPU interposer self-test", test["ok"], test["detail"],
                  "reinstall krex (pip install -e .) so the native parts are built")
