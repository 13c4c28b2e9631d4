"""gpu_check.py's timing checks: inflation (krex eval's buckets and readings, with a
bare baseline) and context creation (cold processes, warm ``krex exec`` workers)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

from common import private_daemon
from gpu_check import (
    PROGRAMS,
    PY,
    Procs,
    device_env,
    index_of,
    kind_of,
    krex_cmd,
    pyenv,
    run,
    stats,
    tail,
)

# -- 4. p95 inflation --------------------------------------------------------------------

MODES = {"none": (), "freeze": ("--no-gate",), "region": ()}


def check_inflation(args: argparse.Namespace) -> dict[str, Any]:
    """krex eval's buckets and readings, on this device: per measurement (median vs the
    faster of the alone references before and after) and per sample; plus a bare
    baseline (no krex at all) against krex alone."""
    rounds = 1 if args.quick else args.rounds
    families = ["driver"]
    skipped = {}
    if kind_of(args.device) == "fakegpu":
        skipped["torch"] = "torch.cuda._sleep needs a real CUDA GPU"
    elif args.quick:
        skipped["torch"] = "--quick: driver kernels only"
    elif _importable("torch"):
        families.append("torch")
    else:
        skipped["torch"] = "torch is not importable"
    rows: dict[str, list[dict]] = {m: [] for m in MODES}
    per_sample: dict[str, list[dict]] = {m: [] for m in MODES}
    bare_rows: list[dict] = []
    clean: dict[str, list[bool]] = {m: [] for m in MODES}
    errors: dict[str, Any] = {}
    rounds_done = 0
    with contextlib.ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        sizes = os.path.join(tmp, "sizes.json")
        socks = {m: stack.enter_context(private_daemon(*flags)) for m, flags in MODES.items()}
        for r in range(rounds):
            if r and args.remaining() < 60:
                errors["rounds"] = f"stopped after {r} rounds: budget"
                break
            bare = _probe_bare(args.device, sizes, families, tmp)
            before = _probe(socks["region"], args.device, "region", sizes, families, tmp)
            loaded = {}
            for mode, sock in socks.items():
                with _streamers(sock, args.device, 2):
                    loaded[mode] = _probe(sock, args.device, mode, sizes, families, tmp)
                print(f"  inflation: round {r + 1}/{rounds} mode {mode} done", file=sys.stderr)
            after = _probe(socks["region"], args.device, "region", sizes, families, tmp)
            errors.update({f"alone.{k}": v for k, v in before["errors"].items()})
            refs = _references(before, after)
            for mode, run_ in loaded.items():
                for name, k in run_["kernels"].items():
                    if name not in refs:
                        continue
                    med = statistics.median(k["samples_ms"])
                    rows[mode].append(_row(k["bucket_ms"], name, med, refs[name]))
                    per_sample[mode] += [_row(k["bucket_ms"], name, x, refs[name])
                                         for x in k["samples_ms"]]
                    clean[mode].append(bool(k["clean"]))
            for name, k in bare["kernels"].items():
                if name in before["kernels"]:
                    bare_rows.append(_row(k["bucket_ms"], name, statistics.median(
                        before["kernels"][name]["samples_ms"]),
                        statistics.median(k["samples_ms"])))
            rounds_done += 1
    from krex.eval.metrics import bucket_stats  # krex eval's own reading

    return {"ok": rounds_done > 0 and all(rows.values()), "rounds": rounds_done,
            "families": families, "skipped_families": skipped,
            "inflation_pct": {m: bucket_stats(v) for m, v in rows.items()},
            "per_sample_inflation_pct": {m: bucket_stats(v) for m, v in per_sample.items()},
            "krex_alone_vs_bare_pct": bucket_stats(bare_rows),
            "clean_fraction": {m: round(sum(c) / max(len(c), 1), 3) for m, c in clean.items()},
            "errors": errors}


def _row(bucket_ms: float, kernel: str, ms: float, ref_ms: float) -> dict[str, Any]:
    return {"bucket_ms": bucket_ms, "kernel": kernel, "inflation_pct": (ms / ref_ms - 1) * 100}


def _references(before: dict, after: dict) -> dict[str, float]:
    """krex eval's reference: the faster of the alone medians before and after."""
    refs = {}
    for name, k in before["kernels"].items():
        meds = [statistics.median(k["samples_ms"])]
        if name in after["kernels"]:
            meds.append(statistics.median(after["kernels"][name]["samples_ms"]))
        refs[name] = min(meds)
    return refs


def _probe_bare(device: str, sizes: str, families: list[str], tmp: str) -> dict:
    """gpu_probe.py outside krex: no daemon, no interposer, no region."""
    out = os.path.join(tmp, "probe-bare.json")
    env = pyenv({k: v for k, v in os.environ.items() if k not in ("KREX_SOCKET", "LD_PRELOAD")})
    with device_env(device) as denv:
        env = pyenv({**denv, "PYTHONPATH": env["PYTHONPATH"]})
        r = run([PY, os.path.join(PROGRAMS, "gpu_probe.py"), device, out, sizes,
                 ",".join(families), "bare"], timeout=120, env=env)
    if r.returncode != 0 or not os.path.exists(out):
        raise RuntimeError(f"bare probe failed ({r.returncode}): {tail(r.stderr)}")
    with open(out) as f:
        return json.load(f)


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _probe(sock: str, device: str, mode: str, sizes: str, families: list[str], tmp: str
           ) -> dict:
    out = os.path.join(tmp, f"probe-{mode}.json")
    env = pyenv({**os.environ, "KREX_SOCKET": sock})
    job_mode = "none" if mode == "none" else "region"
    r = run(krex_cmd("run", "--device", device, "--mode", job_mode, "--", PY,
                     os.path.join(PROGRAMS, "gpu_probe.py"), device, out, sizes,
                     ",".join(families)), timeout=120, env=env)
    if r.returncode != 0 or not os.path.exists(out):
        raise RuntimeError(f"probe failed in mode {mode} ({r.returncode}): {tail(r.stderr)}")
    with open(out) as f:
        data = json.load(f)
    os.unlink(out)
    return data


@contextlib.contextmanager
def _streamers(sock: str, device: str, n: int) -> Iterator[None]:
    env = pyenv({**os.environ, "KREX_SOCKET": sock})
    with Procs() as procs:
        started = [procs.popen(krex_cmd("run", "--device", device, "--mode", "region", "--",
                                        PY, os.path.join(PROGRAMS, "gpu_stream.py"), device,
                                        "1.0", "8"),
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                               text=True) for _ in range(n)]
        for p in started:
            if "running" not in p.stdout.readline():
                raise RuntimeError("a streaming sibling did not start")
        time.sleep(0.3)
        yield


# -- 5. context creation -----------------------------------------------------------------


EXEC_PROG = """import ctypes, json, sys, time
t0 = time.monotonic()
lib = ctypes.CDLL("libcuda.so.1")
dev, ctx = ctypes.c_int(), ctypes.c_void_p()
assert lib.cuInit(0) == 0
assert lib.cuDeviceGet(ctypes.byref(dev), int(sys.argv[2])) == 0
assert lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0
assert lib.cuCtxSetCurrent(ctx) == 0
with open(sys.argv[1], "w") as f:
    json.dump({"start": t0, "ready": time.monotonic()}, f)
"""


def check_contexts(args: argparse.Namespace) -> dict[str, Any]:
    fake = kind_of(args.device) == "fakegpu"
    delay = args.fakegpu_ctx_delay_ms if fake else 0
    out: dict[str, Any] = {"ok": False, "fakegpu_ctx_delay_ms": delay if fake else None}
    modes = ["driver"]
    if fake:
        out["torch_skipped"] = "torch needs a real CUDA GPU"
    elif _importable("torch"):
        modes.append("torch")
    else:
        out["torch_skipped"] = "torch is not importable"
    cold: dict[str, Any] = {}
    with device_env(args.device, ctx_delay_ms=delay) as env:
        for mode in modes:
            for n in (1, 4, 8):
                if args.remaining() < 10:
                    cold[f"{mode}-{n}"] = {"ok": False, "skipped": "budget"}
                    continue
                try:
                    cold[f"{mode}-{n}"] = _concurrent_contexts(
                        args.device, mode, n, env, timeout=max(5.0, args.remaining() - 5))
                except Exception as exc:  # noqa: BLE001
                    cold[f"{mode}-{n}"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    out["cold"] = cold
    try:
        out["warm_workers"] = _warm_exec(args, delay)
    except Exception as exc:  # noqa: BLE001
        out["warm_workers"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    out["ok"] = all(v.get("ok") for v in cold.values()) and out["warm_workers"].get("ok", False)
    return out


def _concurrent_contexts(device: str, mode: str, n: int, env: dict[str, str],
                         timeout: float = 120.0) -> dict[str, Any]:
    with Procs() as procs:
        spawned = []
        for _ in range(n):
            t = time.monotonic()
            spawned.append((t, procs.popen([PY, os.path.join(PROGRAMS, "ctx_probe.py"), device,
                                            mode], env=env, stdout=subprocess.PIPE,
                                           stderr=subprocess.PIPE, text=True)))
        rows = []
        for t, p in spawned:
            o, e = p.communicate(timeout=min(120.0, timeout))
            if p.returncode != 0:
                raise RuntimeError(f"ctx_probe exited {p.returncode}: {tail(e)}")
            ts = json.loads(o.strip().splitlines()[-1])
            rows.append({"interpreter_ms": (ts["start"] - t) * 1e3,
                         "import_ms": (ts["imported"] - ts["start"]) * 1e3,
                         "init_ms": (ts["init"] - ts["imported"]) * 1e3,
                         "context_ms": (ts["ready"] - ts["init"]) * 1e3,
                         "spawn_to_ready_ms": (ts["ready"] - t) * 1e3})
    last_ready = max(r["spawn_to_ready_ms"] for r in rows)
    return {"ok": True, "processes": n,
            **{k: stats([r[k] for r in rows]) for k in rows[0]},
            "all_ready_ms": round(last_ready, 3)}


def _warm_exec(args: argparse.Namespace, delay: int) -> dict[str, Any]:
    flags = ("--fakegpu-ctx-delay-ms", str(delay)) if delay else ()
    runs = []
    with private_daemon(*flags) as sock, tempfile.TemporaryDirectory() as tmp:
        prog = os.path.join(tmp, "ctx_exec.py")
        with open(prog, "w") as f:
            f.write(EXEC_PROG)
        env = {**os.environ, "KREX_SOCKET": sock}
        for i in range(2 if args.quick else 4):
            out = os.path.join(tmp, f"exec-{i}.json")
            t = time.monotonic()
            r = run(krex_cmd("exec", "--device", args.device, "--json", "--timeout-s", "60",
                             prog, out, str(index_of(args.device))), timeout=90, env=env)
            wall = time.monotonic() - t
            if r.returncode != 0:
                raise RuntimeError(f"krex exec exited {r.returncode}: {tail(r.stderr)}")
            with open(out) as f:
                ts = json.load(f)
            text = r.stdout
            result = json.loads(text[text.index("{"):]) if "{" in text else {}
            runs.append({"command_wall_ms": round(wall * 1e3, 3),
                         "spawn_to_ready_ms": round((ts["ready"] - t) * 1e3, 3),
                         "in_program_ctx_ms": round((ts["ready"] - ts["start"]) * 1e3, 3),
                         "dispatch_ms": _ms(result.get("dispatch_s")),
                         "duration_ms": _ms(result.get("duration_s")),
                         "worker_pid": result.get("worker_pid")})
    return {"ok": True, "first": runs[0], "warm": runs[1:],
            "warm_spawn_to_ready_ms": stats([r["spawn_to_ready_ms"] for r in runs[1:]])}


def _ms(s: Any) -> float | None:
    return None if s is None else round(float(s) * 1e3, 3)


