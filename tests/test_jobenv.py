"""Launch blocking and profilers in a job's environment (enforce/jobenv.py), read by the
daemon from /proc/PID/environ of the job's root, through a real daemon.

GPU regions only (fakegpu here): on ``cpu`` the variables change nothing that is timed,
and the same job there is the control that the reason is the device's.
"""

from __future__ import annotations

import json
import os

import pytest
from helpers import PY, krex

from krex.devices import fakegpu
from krex.enforce.jobenv import findings
from krex.protocol.report import ReasonCode

REGION = ("import json, krex, sys\n"
          "with krex.region(device=sys.argv[1]) as r:\n"
          "    pass\n"
          "print(json.dumps(r.report.to_dict()))")
CLEAN_ENV = ("CUDA_LAUNCH_BLOCKING", "HIP_LAUNCH_BLOCKING", "AMD_SERIALIZE_KERNEL",
             "CUDA_INJECTION64_PATH", "NVTX_INJECTION64_PATH", "HSA_TOOLS_LIB", "LD_PRELOAD",
             "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")


def _region(device: str, **env: str) -> dict:
    base = {k: v for k, v in os.environ.items()
            if k not in CLEAN_ENV and not k.startswith("NSYS_")}
    p = krex("run", "--device", device, "--", PY, "-c", REGION, device, env={**base, **env})
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


def _reason(report: dict) -> dict | None:
    return next((r for r in report["reasons"] if r["code"] == "job_environment"), None)


@pytest.mark.skipif(not fakegpu.available(), reason="fakegpu was not built")
def test_launch_blocking_or_a_profiler_in_the_jobs_environment_is_named(daemon):
    """``CUDA_LAUNCH_BLOCKING=1``, or a profiler's injection: ``job_environment`` on the
    job's regions, naming the variable.  Controls: the same job without them, with
    ``CUDA_LAUNCH_BLOCKING=0``, and with the variable on ``cpu``."""
    plain = _region("fakegpu:0")
    off = _region("fakegpu:0", CUDA_LAUNCH_BLOCKING="0")
    on_cpu = _region("cpu", CUDA_LAUNCH_BLOCKING="1")
    blocking = _region("fakegpu:0", CUDA_LAUNCH_BLOCKING="1")
    profiled = _region("fakegpu:0", CUDA_INJECTION64_PATH="/opt/nsight/libToolsInjection64.so",
                       NSYS_PROFILING_SESSION_ID="7",
                       LD_PRELOAD="/nonexistent/libcupti.so")  # ld.so: "ignored", job runs
    for control in (plain, off, on_cpu):
        assert _reason(control) is None, control["reasons"]
    found = _reason(blocking)
    assert found is not None, blocking["reasons"]
    assert not blocking["clean"]
    assert found["evidence"]["variables"] == [
        {"variable": "CUDA_LAUNCH_BLOCKING", "value": "1", "why": "launch_blocking"}]
    assert "CUDA_LAUNCH_BLOCKING=1" in found["message"]
    found = _reason(profiled)
    assert found is not None, profiled["reasons"]
    assert [v["variable"] for v in found["evidence"]["variables"]] == [
        "CUDA_INJECTION64_PATH", "NSYS_PROFILING_SESSION_ID", "LD_PRELOAD"]
    # the daemon put its interposer first in the job's LD_PRELOAD: only the profiler counts
    assert found["evidence"]["variables"][-1]["value"] == "/nonexistent/libcupti.so"


def test_a_profiler_library_in_ld_preload_is_named_and_krexs_own_interposer_is_not():
    env = {"LD_PRELOAD": "/opt/krex/libkrex_interpose.so:/usr/local/cuda/lib64/libcupti.so.13",
           "HIP_LAUNCH_BLOCKING": "1", "PATH": "/usr/bin"}
    assert [(f.variable, f.value, f.why) for f in findings(env)] == [
        ("HIP_LAUNCH_BLOCKING", "1", "launch_blocking"),
        ("LD_PRELOAD", "/usr/local/cuda/lib64/libcupti.so.13", "profiler")]
    assert findings({"LD_PRELOAD": "/opt/krex/libkrex_interpose.so", "NSYS_": ""}) == []
    assert ReasonCode.JOB_ENVIRONMENT.gap  # a retry would run in the same environment


def test_an_mps_clients_share_of_the_sms_is_named_and_the_pipe_alone_is_not():
    """``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` runs the job's kernels on a share of the SMs.
    Control: ``CUDA_MPS_PIPE_DIRECTORY`` alone only says where a server would be (the
    device's NVML reading says whether one holds it: ``shared_device``), and empty."""
    env = {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50", "CUDA_MPS_PIPE_DIRECTORY": "/tmp/mps"}
    assert [(f.variable, f.value, f.why) for f in findings(env)] == [
        ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "50", "mps_client")]
    assert findings({"CUDA_MPS_PIPE_DIRECTORY": "/tmp/mps",
                     "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": " "}) == []
