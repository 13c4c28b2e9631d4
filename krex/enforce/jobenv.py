"""What a job's environment changes in what its GPU regions time: launch blocking,
profilers, an MPS client's share of the SMs.

``CUDA_LAUNCH_BLOCKING=1`` (or ``HIP_LAUNCH_BLOCKING``, ``AMD_SERIALIZE_KERNEL``)
makes every launch wait for its kernel, so a timed loop measures launch
latency and host round trips as well; an injected profiler (CUPTI through
``CUDA_INJECTION64_PATH``, Nsight Systems' ``NSYS_*`` and
``NVTX_INJECTION64_PATH``, rocprof's ``HSA_TOOLS_LIB``, or one of their
libraries in ``LD_PRELOAD``) adds its own work to every launch, and an MPS
client with ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` runs on that share of the SMs.
Either way the numbers are not the kernel's alone, and taking the region again
would not help.

In: a job's root process (the daemon reads ``/proc/PID/environ`` itself; the
job reports nothing).  Out: a ``job_environment`` reason (a *gap*) naming each
variable, for every GPU region of the job.  Read once per job (keyed by its
root's pid and start time), at its first GPU grant.

What it sees is the environment the root was started with, as the kernel
shows it: a variable set later (``setenv``, or only in a child's environment)
is not seen, a process may overwrite that memory of its own, and an
environment the daemon may not read (another user's, without root) gives
nothing.  It catches a job started in a profiler or with launch blocking; it
does not catch one that hides them on purpose.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from krex.enforce.process import ProcessRef
from krex.protocol.report import Reason, ReasonCode

LAUNCH_BLOCKING = ("CUDA_LAUNCH_BLOCKING", "HIP_LAUNCH_BLOCKING", "AMD_SERIALIZE_KERNEL")
INJECTION = ("CUDA_INJECTION64_PATH", "NVTX_INJECTION64_PATH", "HSA_TOOLS_LIB")
PROFILER_PREFIXES = ("NSYS_",)
MPS_CLIENT = ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",)  # an MPS client on a share of the SMs
# Libraries of profilers and tracers, as they appear in LD_PRELOAD (by file name).
PROFILER_LIBRARIES = ("libcupti", "libnvperf", "libtoolsinjection", "libnsys", "rocprof",
                      "librocprofiler", "libroctracer")
VALUE_CHARS = 200


@dataclass(frozen=True)
class EnvFinding:
    """One variable of a job's environment that changes what is timed."""

    variable: str
    value: str
    why: str  # launch_blocking | profiler | mps_client

    def to_dict(self) -> dict[str, str]:
        return {"variable": self.variable, "value": self.value, "why": self.why}


def findings(env: dict[str, str]) -> list[EnvFinding]:
    """What in ``env`` changes what a GPU region times."""
    out = [EnvFinding(k, env[k], "launch_blocking") for k in LAUNCH_BLOCKING
           if env.get(k, "0").strip() not in ("", "0")]
    out += [EnvFinding(k, v, "profiler") for k, v in sorted(env.items()) if v and (
        k in INJECTION or k.startswith(PROFILER_PREFIXES))]
    out += [EnvFinding(k, env[k], "mps_client") for k in MPS_CLIENT if env.get(k, "").strip()]
    preloaded = [p for p in env.get("LD_PRELOAD", "").replace(" ", ":").split(":")
                 if os.path.basename(p).lower().startswith(PROFILER_LIBRARIES)]
    if preloaded:
        out.append(EnvFinding("LD_PRELOAD", ":".join(preloaded), "profiler"))
    return [EnvFinding(f.variable, f.value[:VALUE_CHARS], f.why) for f in out]


def read_environ(pid: int) -> dict[str, str] | None:
    """A process's initial environment from ``/proc`` (None: gone or not ours to read)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    env = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            env[key.decode(errors="replace")] = value.decode(errors="replace")
    return env


def reason(found: list[EnvFinding], pid: int) -> Reason:
    names = ", ".join(f"{f.variable}={f.value}" for f in found)
    return Reason(ReasonCode.JOB_ENVIRONMENT,
                  f"job environment: {names} (launch blocking, a profiler or an MPS share "
                  "of the SMs changes what is timed)",
                  {"pid": pid, "variables": [f.to_dict() for f in found]})


class JobEnvironments:
    """The ``job_environment`` reasons of each job's GPU regions, read once per root."""

    def __init__(self) -> None:
        self._seen: dict[int, tuple[tuple[int, int], list[Reason]]] = {}

    def reasons(self, job_id: int, root: ProcessRef | None) -> list[Reason]:
        if root is None:
            return []
        key = (root.pid, root.start_time)
        seen = self._seen.get(job_id)
        if seen is None or seen[0] != key:
            env = read_environ(root.pid)
            found = findings(env) if env is not None and root.alive() else []
            seen = self._seen[job_id] = (key, [reason(found, root.pid)] if found else [])
        return list(seen[1])

    def forget(self, job_id: int) -> None:
        self._seen.pop(job_id, None)
