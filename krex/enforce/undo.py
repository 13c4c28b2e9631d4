"""Undo records: JSON-able instructions that reverse an enforcement step.

Operations describe their own undo as records; the guardian (and the sweep
of a new daemon) replays them without knowing the operations.  Replay is
idempotent and safe: every signal and affinity change re-checks the start
time of its process or thread first.

Record kinds::

    {"kind": "thaw_v2",  "path": DIR}                   cgroup.freeze <- 0
    {"kind": "thaw_v1",  "path": DIR}                   freezer.state <- THAWED
    {"kind": "sigcont",  "pid": P, "start_time": T}     SIGCONT if still the same process
    {"kind": "cpuset",   "path": DIR, "cpus": "0-3"}    cpuset.cpus <- value
    {"kind": "affinity", "pid": P, "tid": T, "start_time": S, "cpus": [0, 1]}
    {"kind": "gate_open", "path": FILE, "slot": N}      reopen a job's GPU gate
    {"kind": "cuda_unlock", "lib": PATH, "pid": P}      cuCheckpointProcessUnlock(P)
    {"kind": "gpu_clocks_reset", "index": N, "module_dir": DIR}
                                                        NVML device N's locked clocks reset
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable

from krex.enforce.cgroups import write
from krex.enforce.process import ProcessRef, ThreadRef, may_touch


def _thaw_v2(rec: dict) -> None:
    write(os.path.join(rec["path"], "cgroup.freeze"), "0")


def _thaw_v1(rec: dict) -> None:
    write(os.path.join(rec["path"], "freezer.state"), "THAWED")


def _sigcont(rec: dict) -> None:
    ProcessRef(rec["pid"], rec["start_time"]).send_signal(signal.SIGCONT)


def _cpuset(rec: dict) -> None:
    write(os.path.join(rec["path"], "cpuset.cpus"), rec["cpus"] or "\n")


def _affinity(rec: dict) -> None:
    thread = ThreadRef(rec["pid"], rec["tid"], rec["start_time"])
    if may_touch(thread.pid) and thread.alive():
        os.sched_setaffinity(thread.tid, rec["cpus"])


def _gate_open(rec: dict) -> None:
    from krex.enforce.gate import GateFile

    gate = GateFile.open_existing(rec["path"])
    try:
        gate.open(int(rec.get("slot", 0)))
    finally:
        gate.release()


def _cuda_unlock(rec: dict) -> None:
    import ctypes

    os.environ.update(rec.get("env") or {})
    ctypes.CDLL(rec["lib"]).cuCheckpointProcessUnlock(ctypes.c_int(int(rec["pid"])), None)


def _gpu_clocks_reset(rec: dict) -> None:
    """Through the ``pynvml`` the daemon used (the guardian runs with ``-I``: no
    ``PYTHONPATH``), found again in ``module_dir``."""
    import importlib
    import sys

    if rec["module_dir"] not in sys.path:
        sys.path.insert(0, rec["module_dir"])
    nvml = importlib.import_module("pynvml")
    nvml.nvmlInit()
    nvml.nvmlDeviceResetGpuLockedClocks(nvml.nvmlDeviceGetHandleByIndex(int(rec["index"])))


def _amd_perf_level_reset(rec: dict) -> None:
    """AMD device ``index`` back to the ``AUTO`` performance level, through the
    ``amdsmi`` the daemon used (found again in ``module_dir``)."""
    import contextlib
    import importlib
    import io
    import sys

    if rec["module_dir"] not in sys.path:
        sys.path.insert(0, rec["module_dir"])
    with contextlib.redirect_stdout(io.StringIO()):  # amdsmi prints on import
        smi = importlib.import_module("amdsmi")
    smi.amdsmi_init()
    handle = smi.amdsmi_get_processor_handles()[int(rec["index"])]
    smi.amdsmi_set_gpu_perf_level(handle, smi.AmdSmiDevPerfLevel.AUTO)


_ACTIONS: dict[str, Callable[[dict], None]] = {
    "thaw_v2": _thaw_v2,
    "thaw_v1": _thaw_v1,
    "sigcont": _sigcont,
    "cpuset": _cpuset,
    "affinity": _affinity,
    "gate_open": _gate_open,
    "cuda_unlock": _cuda_unlock,
    "gpu_clocks_reset": _gpu_clocks_reset,
    "amd_perf_level_reset": _amd_perf_level_reset,
}


def replay(records: list[dict]) -> list[str]:
    """Apply every record in order; return one message per record that failed."""
    errors = []
    for rec in records:
        try:
            _ACTIONS[rec["kind"]](rec)
        except (OSError, KeyError, TypeError, ValueError) as e:
            if not isinstance(e, (FileNotFoundError, ProcessLookupError)):
                errors.append(f"{rec.get('kind')}: {e}")
    return errors
