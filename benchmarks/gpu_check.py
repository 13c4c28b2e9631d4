"""One prepared check of krex on a machine with an NVIDIA GPU (issue 16): run it in one go.

    python benchmarks/gpu_check.py --device cuda:0 --out $OUT/gpu_check.json   # <= 9 min
    python benchmarks/gpu_check.py --device cuda:0 --quick                     # ~ 4 min
    python benchmarks/gpu_check.py --device fakegpu:0 --quick                  # here, no GPU

Writes ONE JSON file (rewritten after every check, so a crash keeps what was measured)
and prints a markdown summary.  Exit status 0 when it ran (each check says ok or not),
2 when a prerequisite is missing (named in the JSON and on stderr).

Prerequisites (the GPU machine has no network: preinstall them): NVIDIA driver with
``libcuda.so.1``; this repository installed (``make install``: krex, psutil, the native
interposer); ``nvidia-ml-py`` (krex finds ``cuda:N`` through NVML).  Optional, each
enabling more stacks (skipped with a reason when absent): ``torch`` (CUDA build),
``triton``, ``cuda-bindings``.  Root lets it lock the GPU clocks (else recorded only).

Checks, in order (each a function returning a dict; an exception or its time budget
is recorded as ``{"ok": false, "error": ...}``, a missing package as ``skipped``):

1. ``prerequisites``  the above, up front; a missing one stops the run (exit 2).
2. ``environment``    driver, GPU, persistence and compute mode, MPS, MIG, clocks (locked
                      to their maximum where permitted, reset at exit), packages,
                      ``krex doctor --json`` (its interposer self-test runs on this driver).
3. ``interposition``  per stack, the interposer's named counters vs what CUPTI saw.
4. ``held``           torch eager, a CUDA graph captured by the sibling, Triton, cuBLAS,
                      cuda-python and ctypes launches each under a closed gate: parked,
                      drained clean, not finished until the gate opens (gpu_check_device).
5. ``overlap``        device-clock stamps (``%globaltimer``) of a streaming sibling vs
                      the holder's regions: ``region`` 0 overlaps; positive control
                      (freeze without drain) > 0; negative control 0 (gpu_check_device).
6. ``gate_drain``     close -> drained latency through a real daemon (p50/p95).
7. ``checkpoint_lock`` the same with ``--gpu-lock checkpoint``, and whether the device
                      was confirmed idle after the lock (clean regions).
8. ``inflation``      kernels of krex eval's buckets (0.1 / 1 / 10 ms) with 2 streaming
                      siblings under modes none / freeze / region; eval's reading (median
                      of each measurement vs the faster of the alone references before and
                      after, p50/p95/p99 per bucket) and per sample; and a bare baseline
                      (no krex at all) vs krex alone.
9. ``contexts``       process start -> context ready for 1 / 4 / 8 processes; krex exec.
10. ``device_truth``  the region report's device account (gpu_check_truth): no foreign
                      process in a quiet run; a context krex does not manage named in
                      every region; a clock lowered for 0.5 s inside a region (root)
                      reported ``throttled`` by the sampler.  On fakegpu through the fake
                      NVML of tests/fakenvml.

On ``fakegpu:N`` the real-stack parts are skipped with a reason and the rest runs
against fakegpu (its execution log is the device clock there).  This file has not
yet run on a GPU: record its first results in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PROGRAMS = os.path.join(HERE, "programs")
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)
from common import md_table, private_daemon  # noqa: E402

from krex import resultfile  # noqa: E402
from krex.measure import stats as kstats  # noqa: E402  (one quantile/inflation definition)

FORMAT = 2
PY = sys.executable
# Per-check wall-clock budgets (s), full and --quick.  Sum <= 8 min (full) / ~4 min (quick).
BUDGETS = {"prerequisites": (15, 15), "environment": (25, 20), "interposition": (60, 35),
           "held": (45, 30), "overlap": (75, 40), "gate_drain": (35, 20),
           "checkpoint_lock": (30, 20), "inflation": (140, 75), "contexts": (45, 25),
           "device_truth": (35, 30)}
assert sum(b[0] for b in BUDGETS.values()) <= 520


class CheckTimeout(Exception):
    pass


class Skipped(Exception):
    pass


# -- process hygiene -------------------------------------------------------------------


class Procs:
    """Every process a check starts; all reaped (with their descendants) on exit."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def popen(self, argv: list[str], **kw: Any) -> subprocess.Popen:
        kw.setdefault("stdin", subprocess.DEVNULL)
        p = subprocess.Popen(argv, start_new_session=True, **kw)
        self.procs.append(p)
        return p

    def reap(self) -> None:
        try:
            import psutil
        except ImportError:
            psutil = None
        family = []
        for p in self.procs:
            if p.poll() is None and psutil is not None:
                with contextlib.suppress(Exception):
                    family += psutil.Process(p.pid).children(recursive=True)
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(OSError):
                    p.terminate()
        deadline = time.monotonic() + 5
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(OSError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.kill()
                p.wait()
        for c in family:  # the commands of `krex run` live in their own process groups
            with contextlib.suppress(Exception):
                c.wait(2)
            with contextlib.suppress(Exception):
                if c.is_running() and c.status() != "zombie":
                    c.kill()
        for p in self.procs:
            for stream in (p.stdout, p.stderr):
                if stream is not None:
                    stream.close()
        self.procs.clear()

    def __enter__(self) -> Procs:
        return self

    def __exit__(self, *exc: object) -> None:
        self.reap()


def run(argv: list[str], timeout: float, **kw: Any) -> subprocess.CompletedProcess:
    """subprocess.run in a new session, killed with its group on timeout."""
    with Procs() as procs:
        p = procs.popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)
        out, err = p.communicate(timeout=timeout)
        return subprocess.CompletedProcess(argv, p.returncode, out, err)


def tail(text: str | None, n: int = 600) -> str:
    return (text or "").strip()[-n:]


def krex_cmd(*args: str) -> list[str]:
    return [PY, "-m", "krex", *args]


def kind_of(device: str) -> str:
    return device.split(":")[0]


def index_of(device: str) -> int:
    return int(device.partition(":")[2] or 0)


@contextlib.contextmanager
def device_env(device: str, ctx_delay_ms: int = 0) -> Iterator[dict[str, str]]:
    """The environment a process needs to reach ``device`` (a private fakegpu server)."""
    if kind_of(device) != "fakegpu":
        yield dict(os.environ)
        return
    from krex.devices.fakegpu import FakeGpu

    with tempfile.TemporaryDirectory(prefix="krex-gpucheck-") as tmp:
        gpu = FakeGpu(os.path.join(tmp, "fakegpu.sock"), ctx_delay_ms=ctx_delay_ms).start()
        try:
            env = gpu.env()
            env["KREX_FAKEGPU_LIB"] = os.path.join(str(_fakegpu_dir()), "libcuda.so.1")
            yield env | {"_KREX_GPUCHECK_FAKEGPU": "1"}
        finally:
            gpu.stop()


def _fakegpu_dir():
    from krex.devices.native import fakegpu_lib_dir

    return fakegpu_lib_dir()


def pyenv(env: dict[str, str]) -> dict[str, str]:
    """Programs import gpu_driver from benchmarks/programs and krex from the repo."""
    paths = [PROGRAMS, ROOT, *filter(None, env.get("PYTHONPATH", "").split(":"))]
    return {**env, "PYTHONPATH": ":".join(paths)}


def stats(xs: list[float]) -> dict[str, Any]:
    if not xs:
        return {"n": 0}
    p = kstats.quantiles(xs, (0.5, 0.95))
    return {"n": len(xs), "p50": round(p["p50"], 3), "p95": round(p["p95"], 3),
            "max": round(max(xs), 3)}


# -- 1. environment ------------------------------------------------------------------


def check_environment(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"device": args.device, "python": platform.python_version(),
                           "platform": platform.platform(), "cpus": os.cpu_count()}
    versions = {}
    for dist in ("krex", "torch", "triton", "cuda-bindings", "cuda-python", "nvidia-ml-py",
                 "numpy", "psutil"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    out["packages"] = versions
    out["nvidia_smi"] = _smi_query(index_of(args.device))
    out["clock_lock"] = lock_clocks(args) if kind_of(args.device) == "cuda" else None
    out["mps"] = _mps()
    out["nvml"] = _nvml(index_of(args.device))
    with device_env(args.device) as env:
        probe = ("import ctypes,json;l=ctypes.CDLL('libcuda.so.1');v=ctypes.c_int();"
                 "l.cuDriverGetVersion(ctypes.byref(v));r=l.cuInit(0);n=ctypes.c_int();"
                 "l.cuDeviceGetCount(ctypes.byref(n));b=ctypes.create_string_buffer(256);"
                 "l.cuDeviceGetName(b,256,0);print(json.dumps({'driver_api_version':v.value,"
                 "'cuInit':r,'devices':n.value,'name':b.value.decode()}))")
        try:
            r = run([PY, "-c", probe], timeout=20, env=env)
            out["libcuda"] = json.loads(r.stdout) if r.returncode == 0 else tail(r.stderr)
        except Exception as exc:  # noqa: BLE001
            out["libcuda"] = f"failed: {exc}"
    if versions["torch"] and kind_of(args.device) == "cuda":
        code = ("import json,torch;print(json.dumps({'torch':torch.__version__,"
                "'cuda':torch.version.cuda,'available':torch.cuda.is_available(),"
                "'name':torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,"
                "'capability':torch.cuda.get_device_capability(0) "
                "if torch.cuda.is_available() else None}))")
        try:
            r = run([PY, "-c", code], timeout=60)
            out["torch"] = json.loads(r.stdout) if r.returncode == 0 else tail(r.stderr)
        except Exception as exc:  # noqa: BLE001
            out["torch"] = f"failed: {exc}"
    try:
        r = run(krex_cmd("doctor", "--json"), timeout=30)
        out["doctor"] = json.loads(r.stdout) if r.stdout.strip() else tail(r.stderr)
    except Exception as exc:  # noqa: BLE001
        out["doctor"] = f"failed: {type(exc).__name__}: {exc}"
    out["ok"] = True
    return out


SMI_FIELDS = ("index,name,driver_version,memory.total,persistence_mode,compute_mode,"
              "mig.mode.current,ecc.mode.current,clocks.sm,clocks.mem,clocks.max.sm,"
              "clocks.max.mem,clocks.applications.graphics,power.limit,temperature.gpu,"
              "clocks_throttle_reasons.active")


def _smi_query(index: int) -> Any:
    smi = shutil.which("nvidia-smi")
    if not smi:
        return None
    try:
        r = run([smi, "-i", str(index), f"--query-gpu={SMI_FIELDS}", "--format=csv,noheader"],
                timeout=10)
    except Exception as exc:  # noqa: BLE001
        return f"failed: {exc}"
    values = [v.strip() for v in r.stdout.strip().split(",")]
    names = SMI_FIELDS.split(",")
    return dict(zip(names, values, strict=False)) if len(values) == len(names) else \
        (r.stdout.strip() or tail(r.stderr))


def lock_clocks(args: argparse.Namespace) -> dict[str, Any]:
    """Lock the GPU clocks to their maximum (root), so kernels time the same all run;
    ``reset_clocks`` undoes it at exit.  Not permitted: recorded, and the run goes on."""
    smi = shutil.which("nvidia-smi")
    q = _smi_query(index_of(args.device))
    if not smi or not isinstance(q, dict) or not q.get("clocks.max.sm", "").split()[0:1]:
        return {"locked": False, "why": "nvidia-smi or the maximum SM clock is unavailable"}
    mhz = q["clocks.max.sm"].split()[0]
    r = run([smi, "-i", str(index_of(args.device)), "-lgc", f"{mhz},{mhz}"], timeout=15)
    args.clocks_locked = r.returncode == 0
    return {"locked": args.clocks_locked, "sm_mhz": mhz,
            "why": "" if args.clocks_locked else tail(r.stdout + r.stderr, 300)}


def reset_clocks(args: argparse.Namespace) -> None:
    if getattr(args, "clocks_locked", False) and shutil.which("nvidia-smi"):
        run(["nvidia-smi", "-i", str(index_of(args.device)), "-rgc"], timeout=15)


def _mps() -> dict[str, Any]:
    """Whether the MPS control daemon runs here (it changes how contexts share the GPU)."""
    try:
        import psutil

        names = {p.info["name"] for p in psutil.process_iter(["name"])}
    except Exception:  # noqa: BLE001
        names = set()
    return {"control_daemon": "nvidia-cuda-mps-control" in names,
            "server": "nvidia-cuda-mps-server" in names,
            "pipe_directory": os.environ.get("CUDA_MPS_PIPE_DIRECTORY")}


def _nvml(index: int) -> Any:
    try:
        import pynvml
    except ImportError:
        return {"available": False, "why": "nvidia-ml-py (pynvml) is not installed"}
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001
        return {"available": False, "why": f"nvmlInit: {type(exc).__name__}: {exc}"}
    try:
        h = pynvml.nvmlDeviceGetHandleByIndex(index)
        name = pynvml.nvmlDeviceGetName(h)
        info: dict[str, Any] = {
            "available": True, "driver": _s(pynvml.nvmlSystemGetDriverVersion()),
            "name": _s(name), "sm_clock_mhz": pynvml.nvmlDeviceGetClockInfo(h, 1),
            "max_sm_clock_mhz": pynvml.nvmlDeviceGetMaxClockInfo(h, 1),
            "temperature_c": pynvml.nvmlDeviceGetTemperature(h, 0),
            "processes": len(pynvml.nvmlDeviceGetComputeRunningProcesses(h)),
        }
        with contextlib.suppress(Exception):
            info["throttle_reasons"] = pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(h)
        with contextlib.suppress(Exception):
            info["mig_mode"] = pynvml.nvmlDeviceGetMigMode(h)
        return info
    except Exception as exc:  # noqa: BLE001
        return {"available": True, "error": f"{type(exc).__name__}: {exc}"}
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()


def _s(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


# -- 2. interposition coverage ---------------------------------------------------------


STACKS = ("torch_eager", "cublas", "triton", "cuda_python", "ctypes")
GPU_ONLY = {"torch_eager", "cublas", "triton"}


def check_interposition(args: argparse.Namespace) -> dict[str, Any]:
    from krex.devices.native import check_interposer, preload_env
    from krex.enforce.gate import GateFile

    lib = check_interposer()
    fake = kind_of(args.device) == "fakegpu"
    reps = 5 if args.quick else 10
    stacks: dict[str, Any] = {}
    with device_env(args.device) as base, tempfile.TemporaryDirectory() as tmp:
        gate = GateFile.create(os.path.join(tmp, "gate"))
        try:
            env = pyenv(preload_env(os.path.join(tmp, "gate"), 0, base=base))
            env["KREX_GPUCHECK_INTERPOSER"] = str(lib)
            for stack in STACKS:
                if fake and stack in GPU_ONLY:
                    stacks[stack] = {"ok": False, "skipped": "needs a real CUDA GPU "
                                     f"(device {args.device})"}
                    continue
                stacks[stack] = _probe_stack(stack, args.device, env, tmp, reps,
                                             timeout=max(10.0, args.remaining() - 5))
        finally:
            gate.unlink()
    for s in stacks.values():
        expected = s.get("profiler_expected", s.get("fakegpu_server_launches",
                                                    s.get("expected_by_construction")))
        if s.get("ok") and expected:
            s["expected"] = expected
            s["caught_over_expected"] = round(s["caught"] / expected, 4)
    ran = [s for s in stacks.values() if s.get("ok")]
    return {"ok": bool(ran) and all(s.get("caught", 0) >= s.get("expected", 0)
                                    and s["interposer"]["unmatched"] == 0
                                    and s["interposer"].get("unwrapped", 0) == 0 for s in ran),
            "interposer": str(lib), "reps": reps, "stacks": stacks}


def _probe_stack(stack: str, device: str, env: dict[str, str], tmp: str, reps: int,
                 timeout: float) -> dict[str, Any]:
    out = os.path.join(tmp, f"{stack}.json")
    fake_before = _fakegpu_launches(env)
    try:
        r = run([PY, os.path.join(PROGRAMS, "interpose_probe.py"), stack, device, out,
                 str(reps)], timeout=min(timeout, 90), env=env)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"timed out after {min(timeout, 90):.0f} s"}
    if not os.path.exists(out):
        return {"ok": False, "error": f"probe exited {r.returncode}: {tail(r.stderr)}"}
    with open(out) as f:
        result = json.load(f)
    if fake_before is not None and result.get("ok"):
        # fakegpu's server is the ground truth there: launches it accepted, less the
        # warm-up round (run before the counters are read)
        accepted = _fakegpu_launches(env) - fake_before
        per_rep = (result.get("expected_by_construction") or 0) // max(reps, 1)
        result["fakegpu_server_launches"] = accepted - per_rep
    return result


def _fakegpu_launches(env: dict[str, str]) -> int | None:
    if "_KREX_GPUCHECK_FAKEGPU" not in env:
        return None
    from krex.devices.fakegpu import FakeGpu

    return FakeGpu(env["KREX_FAKEGPU_SOCKET"]).stats()["launches"]


# -- 3. gate and drain latency -------------------------------------------------------------


def check_gate_drain(args: argparse.Namespace) -> dict[str, Any]:
    return summarise_regions(_regions_with_streaming_sibling(args))


def check_checkpoint_lock(args: argparse.Namespace) -> dict[str, Any]:
    """The same holder and sibling with ``--gpu-lock checkpoint`` (cuCheckpointProcessLock)."""
    regions = _regions_with_streaming_sibling(args, "--gpu-lock", "checkpoint")
    out = summarise_regions(regions)
    locks = [ms for item in regions
             for ms in ((item["report"] or {}).get("host") or {}).get("lock_acks_ms", {}).values()]
    out["lock_ack_ms"] = stats(locks)
    # the lock does not wait for submitted work: a region is clean only once the daemon
    # saw the device idle after it (NVML); the count of clean regions says how often
    out["ok"] = bool(regions) and bool(locks)
    return out


def _regions_with_streaming_sibling(args: argparse.Namespace, *flags: str) -> list[dict]:
    n = 20 if args.quick else 50
    with private_daemon(*flags) as sock, Procs() as procs, \
            tempfile.TemporaryDirectory() as tmp:
        env = pyenv({**os.environ, "KREX_SOCKET": sock})
        sibling = procs.popen(krex_cmd("run", "--device", args.device, "--name", "streamer",
                                       "--", PY, os.path.join(PROGRAMS, "gpu_stream.py"),
                                       args.device, "1.0", "8"),
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = sibling.stdout.readline()
        if "running" not in line:
            raise RuntimeError(f"sibling did not start: {tail(sibling.stderr.read())}")
        time.sleep(0.3)
        out = os.path.join(tmp, "reports.json")
        holder = procs.popen(krex_cmd("run", "--device", args.device, "--name", "holder", "--",
                                      PY, os.path.join(PROGRAMS, "region_holder.py"),
                                      args.device, str(n), out),
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        _, err = holder.communicate(timeout=max(5.0, args.remaining() - 8))
        if holder.returncode != 0:
            raise RuntimeError(f"holder exited {holder.returncode}: {tail(err)}")
        with open(out) as f:
            return json.load(f)


def summarise_regions(regions: list[dict]) -> dict[str, Any]:
    series: dict[str, list[float]] = {"client_grant_ms": [], "total_enforcement_ms": [],
                                      "drain_ack_ms": []}
    clean, gated, reasons = 0, [], {}
    for item in regions:
        rep = item["report"] or {}
        host = rep.get("host") or {}
        series["client_grant_ms"].append(item["client_grant_ms"])
        total = 0.0
        for step in host.get("steps", []):
            if step.get("apply_ms") is not None:
                series.setdefault(f"{step['name']}_apply_ms", []).append(step["apply_ms"])
                total += step["apply_ms"]
            if step.get("revert_ms") is not None:
                series.setdefault(f"{step['name']}_revert_ms", []).append(step["revert_ms"])
        series["total_enforcement_ms"].append(total)
        series["drain_ack_ms"] += list((host.get("drain_acks_ms") or {}).values())
        gated.append(host.get("gated_jobs") or 0)
        clean += bool(rep.get("clean"))
        for reason in rep.get("reasons", []):  # the report's reasons not clean (protocol.md)
            reasons[reason["message"]] = reasons.get(reason["message"], 0) + 1
    latency = {k: stats(v) for k, v in series.items()}
    return {"ok": bool(regions) and all(g >= 1 for g in gated) and bool(series["drain_ack_ms"]),
            "regions": len(regions), "clean": clean, "gated_jobs_min": min(gated, default=0),
            "latency_ms": latency, "reasons": reasons,
            "close_to_drained_ms": latency.get("gate_drain_apply_ms"),
            "sample_report": regions[-1]["report"] if regions else None}


# -- driver --------------------------------------------------------------------------------

def checks() -> dict[str, Callable[[argparse.Namespace], dict[str, Any]]]:
    """Every check, in the order it runs (the device-clock ones live in gpu_check_device,
    inflation and contexts in gpu_check_timing)."""
    import gpu_check_device as dev
    import gpu_check_timing as timing
    import gpu_check_truth as truth

    return {"prerequisites": dev.check_prerequisites, "environment": check_environment,
            "interposition": check_interposition, "held": dev.check_held,
            "overlap": dev.check_overlap, "gate_drain": check_gate_drain,
            "checkpoint_lock": check_checkpoint_lock, "inflation": timing.check_inflation,
            "contexts": timing.check_contexts, "device_truth": truth.check_device_truth}


def default_out() -> str:
    if os.environ.get("OUT"):
        return os.path.join(os.environ["OUT"], "gpu_check.json")
    return os.path.join(ROOT, "results", "gpu_check.json")


def write_json(path: str, doc: dict[str, Any]) -> None:
    resultfile.write(path, doc, indent=2, default=str)


def _on_alarm(signum: int, frame: Any) -> None:
    raise CheckTimeout("check exceeded its time budget")


def run_check(name: str, fn: Callable, args: argparse.Namespace, budget_s: float
              ) -> dict[str, Any]:
    t0 = time.monotonic()
    args.remaining = lambda: budget_s - (time.monotonic() - t0)
    signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, budget_s)
    try:
        result = fn(args)
    except CheckTimeout:
        result = {"ok": False, "error": f"timed out after {budget_s:.0f} s"}
    except Skipped as exc:
        result = {"ok": False, "skipped": str(exc)}
    except Exception as exc:  # noqa: BLE001  (one check never sinks the others)
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                  "traceback": traceback.format_exc()[-3000:]}
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    result["elapsed_s"] = round(time.monotonic() - t0, 3)
    return result


def summary(doc: dict[str, Any]) -> str:
    lines = [f"# krex gpu_check on {doc['device']} ({doc['date']})", ""]
    c = doc["checks"]
    rows = [[n, "ok" if r.get("ok") else ("skipped" if r.get("skipped") else "FAILED"),
             r.get("elapsed_s"), (r.get("error") or r.get("skipped") or "")[:100]]
            for n, r in c.items()]
    lines += [md_table(["check", "status", "s", "note"], rows), ""]
    env = c.get("environment", {})
    if env.get("ok"):
        lines += [f"- libcuda: {env.get('libcuda')}", f"- nvidia-smi: {env.get('nvidia_smi')}",
                  f"- NVML: {env.get('nvml')}",
                  f"- packages: {json.dumps(env.get('packages'))}", ""]
    ip = c.get("interposition", {})
    if "stacks" in ip:
        rows = []
        for s, r in ip["stacks"].items():
            if not r.get("ok"):
                rows.append([s, "-", "-", "-", "-", r.get("skipped") or r.get("error", "")[:80]])
                continue
            d = r["interposer"]
            rows.append([s, r["caught"], r.get("expected", "?"),
                         f"{d['direct']}/{d['dlsym']}/{d['getprocaddress']}", d["unmatched"],
                         "profiler" if r.get("profiler") else r.get("profiler_skipped", "")])
        lines += ["## Interposition coverage", md_table(
            ["stack", "caught", "expected", "direct/dlsym/getproc", "unmatched", "truth"], rows),
            ""]
    held = c.get("held", {})
    if "stacks" in held:
        rows = [[k, v.get("skipped") or ("held" if v.get("ok") else "FAILED"), v.get("parked"),
                 v.get("drained"), v.get("released"), v.get("error", "")[:60]]
                for k, v in held["stacks"].items()]
        lines += ["## Stacks under a closed gate", md_table(
            ["stack", "status", "parked", "drained", "released", "note"], rows), ""]
    ov = c.get("overlap", {})
    if "cases" in ov:
        rows = [[k, v.get("regions"), v.get("overlapping_regions"), v.get("overlap_ms"),
                 v.get("as_expected"), v.get("skipped", "")] for k, v in ov["cases"].items()]
        lines += ["## Overlap on the device clock", md_table(
            ["case", "regions", "overlapping", "overlap ms", "as expected", "note"], rows), ""]
    gd = c.get("gate_drain", {})
    if "latency_ms" in gd:
        rows = [[k, v.get("n"), v.get("p50"), v.get("p95"), v.get("max")]
                for k, v in gd["latency_ms"].items()]
        lines += [f"## Gate and drain ({gd['regions']} regions, {gd['clean']} clean)",
                  md_table(["latency (ms)", "n", "p50", "p95", "max"], rows), ""]
    inf = c.get("inflation", {})
    if "inflation_pct" in inf:
        rows = [[m, f"{k} ms", v["n"], f"{v['p50']:+.2f}", f"{v['p95']:+.2f}", f"{v['p99']:+.2f}"]
                for m, ks in [*inf["inflation_pct"].items(),
                              ("krex alone vs bare", inf.get("krex_alone_vs_bare_pct", {}))]
                for k, v in ks.items()]
        lines += [f"## Inflation vs alone, krex eval's reading ({inf['rounds']} rounds)",
                  md_table(["mode", "bucket", "n", "p50 %", "p95 %", "p99 %"], rows), ""]
    cx = c.get("contexts", {})
    if "cold" in cx:
        rows = [[k, v.get("spawn_to_ready_ms", {}).get("p50"),
                 v.get("spawn_to_ready_ms", {}).get("max"), v.get("context_ms", {}).get("p50"),
                 v.get("error") or v.get("skipped") or ""] for k, v in cx["cold"].items()]
        lines += ["## Context creation (cold processes)",
                  md_table(["mode-processes", "spawn→ready p50 ms", "max ms",
                            "context p50 ms", "note"], rows)]
        w = cx.get("warm_workers", {})
        if w.get("ok"):
            lines += ["", f"- krex exec first: {w['first']['spawn_to_ready_ms']} ms; warm: "
                      f"{w['warm_spawn_to_ready_ms']}"]
        else:
            lines += ["", f"- krex exec: {w.get('error')}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda:0", help="cuda:N (default cuda:0) or fakegpu:N")
    ap.add_argument("--out", default=default_out(), help="results JSON (default "
                    "$OUT/gpu_check.json, else results/gpu_check.json)")
    ap.add_argument("--quick", action="store_true", help="about 4 minutes instead of 8")
    ap.add_argument("--rounds", type=int, default=2, help="inflation rounds (not --quick)")
    ap.add_argument("--only", help="comma-separated checks to run (default all; "
                                   "prerequisites always run)")
    ap.add_argument("--fakegpu-ctx-delay-ms", type=int, default=300)
    ap.add_argument("--budget-scale", type=float, default=1.0,
                    help="multiply every check's time budget (default 1)")
    args = ap.parse_args(argv)
    if kind_of(args.device) not in ("cuda", "fakegpu"):
        ap.error("--device must be cuda:N or fakegpu:N")
    registry = checks()
    selected = ["prerequisites"] + [c for c in (args.only.split(",") if args.only
                                               else registry) if c != "prerequisites"]
    doc: dict[str, Any] = {"format": FORMAT, "benchmark": "gpu_check", "device": args.device,
                           "quick": args.quick, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                           "host": platform.node(), "command": " ".join([PY, *sys.argv]),
                           "budgets_s": {}, "checks": {}}
    t0 = time.monotonic()
    try:
        for name in selected:
            if name not in registry:
                doc["checks"][name] = {"ok": False, "error": "unknown check"}
                continue
            budget = BUDGETS[name][1 if args.quick else 0] * args.budget_scale
            doc["budgets_s"][name] = budget
            print(f"gpu_check: {name} (budget {budget} s) ...", file=sys.stderr, flush=True)
            doc["checks"][name] = run_check(name, registry[name], args, budget)
            doc["elapsed_s"] = round(time.monotonic() - t0, 3)
            write_json(args.out, doc)  # after every check: a later crash keeps what was measured
            if name == "prerequisites" and not doc["checks"][name]["ok"]:
                print(f"gpu_check: {doc['checks'][name].get('error')}\nwritten {args.out}",
                      file=sys.stderr)
                return 2
    finally:
        reset_clocks(args)
    doc["complete"] = True
    write_json(args.out, doc)
    print(summary(doc))
    print(f"\nwritten {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
