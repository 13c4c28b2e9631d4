"""Interposition coverage probe of gpu_check.py: one stack, under the krex interposer.

argv: STACK DEVICE OUT_JSON [REPS=10]
STACK: torch_eager | triton | cublas | cuda_python | ctypes
Runs the stack's workload once (warm-up: compilation, handles, lazy init), then REPS
times while reading the interposer's own named counters before and
after and, when torch is importable and the device is a GPU, counting the kernels,
copies and memsets the CUDA profiler (CUPTI, through torch.profiler) saw.  Writes
OUT_JSON; a missing package raises ``Skip`` which is written as ``skipped``.
"""

import collections
import ctypes
import json
import os
import sys
import tempfile
import time
import traceback

stack, device, out = sys.argv[1], sys.argv[2], sys.argv[3]
reps = int(sys.argv[4]) if len(sys.argv) > 4 else 10
index = int(device.partition(":")[2] or 0)
fake = device.startswith("fakegpu")


class Skip(Exception):
    pass


def counts() -> dict:
    from krex.devices.native import interposer_counters

    lib = ctypes.CDLL(os.environ["KREX_GPUCHECK_INTERPOSER"])
    c = interposer_counters(lib)
    return {"direct": c["launch_direct"], "dlsym": c["launch_dlsym"],
            "getprocaddress": c["launch_getproc"], **c, "active": lib.krex_interposer_active()}


def need(module: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise Skip(f"{module} is not importable: {exc}") from None


# -- workloads: setup() -> (work(), expected launches by construction or None) ----------


def torch_eager():
    torch = need("torch")
    dev = f"cuda:{index}"
    a = torch.randn(1 << 20, device=dev)
    x, y = torch.randn(256, 256, device=dev), torch.randn(256, 256, device=dev)

    def work():
        b = a * 2
        c = b + a
        d = torch.relu(c)
        e = d.sin()
        f = x @ y
        return e, f
    return work, None


def cublas():
    torch = need("torch")
    dev = f"cuda:{index}"
    a32, b32 = torch.randn(2048, 2048, device=dev), torch.randn(2048, 2048, device=dev)
    a16, b16 = a32.half(), b32.half()

    def work():
        return torch.matmul(a32, b32), torch.matmul(a16, b16)
    return work, None


def triton_add():
    torch = need("torch")
    triton = need("triton")
    if _TRITON_ADD is None:
        raise Skip(f"triton kernel could not be defined: {_TRITON_ERROR}")
    dev = f"cuda:{index}"
    n = 1 << 20
    x, y = torch.randn(n, device=dev), torch.randn(n, device=dev)
    o = torch.empty_like(x)

    def work():
        _TRITON_ADD[(triton.cdiv(n, 1024),)](x, y, o, n, BLOCK=1024)
    return work, 1


_TRITON_ADD = _TRITON_ERROR = None
if stack == "triton":  # @triton.jit needs a module-level function (it reads its source)
    try:
        import triton
        import triton.language as tl

        @triton.jit
        def add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):  # noqa: N803 - triton's style
            pid = tl.program_id(axis=0)
            offs = pid * BLOCK + tl.arange(0, BLOCK)
            mask = offs < n
            x = tl.load(x_ptr + offs, mask=mask)
            y = tl.load(y_ptr + offs, mask=mask)
            tl.store(out_ptr + offs, x + y, mask=mask)

        _TRITON_ADD = add_kernel
    except Exception as exc:  # noqa: BLE001  (reported as a skip by triton_add)
        _TRITON_ERROR = f"{type(exc).__name__}: {exc}"


KERNEL_SRC = 'extern "C" __global__ void krex_noop() {}'


def cuda_python():
    try:
        from cuda.bindings import driver as cu
    except ImportError:
        try:
            from cuda import cuda as cu  # cuda-python < 12.6
        except ImportError as exc:
            raise Skip(f"cuda-bindings is not importable: {exc}") from None

    def ok(result, what):
        err, *rest = result if isinstance(result, tuple) else (result,)
        if getattr(err, "value", err) != 0:
            raise RuntimeError(f"{what} failed: {err}")
        return rest[0] if len(rest) == 1 else rest

    ok(cu.cuInit(0), "cuInit")
    dev = ok(cu.cuDeviceGet(index), "cuDeviceGet")
    ctx = ok(cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
    ok(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    source = "embedded PTX"
    if fake:
        image, name = b"fake\0", b"spin_us_10"
    else:
        from gpu_driver import PTX

        image, name = PTX + b"\0", b"krex_noop"
        try:
            from cuda.bindings import nvrtc

            major = ok(cu.cuDeviceGetAttribute(
                cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev), "attr")
            minor = ok(cu.cuDeviceGetAttribute(
                cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev), "attr")
            prog = ok(nvrtc.nvrtcCreateProgram(KERNEL_SRC.encode(), b"k.cu", 0, [], []), "nvrtc")
            opts = [f"--gpu-architecture=compute_{major}{minor}".encode()]
            ok(nvrtc.nvrtcCompileProgram(prog, len(opts), opts), "nvrtcCompileProgram")
            size = ok(nvrtc.nvrtcGetPTXSize(prog), "nvrtcGetPTXSize")
            ptx = b" " * size
            ok(nvrtc.nvrtcGetPTX(prog, ptx), "nvrtcGetPTX")
            image, source = ptx if ptx.endswith(b"\0") else ptx + b"\0", "NVRTC"
        except Exception as exc:  # noqa: BLE001  (fall back to the embedded PTX)
            source = f"embedded PTX (NVRTC unavailable: {type(exc).__name__}: {exc})"
    buf = ctypes.create_string_buffer(image)
    try:
        module = ok(cu.cuModuleLoadData(image), "cuModuleLoadData")
    except Exception:  # noqa: BLE001  (older bindings want an address)
        module = ok(cu.cuModuleLoadData(ctypes.addressof(buf)), "cuModuleLoadData")
    fn = ok(cu.cuModuleGetFunction(module, name), "cuModuleGetFunction")
    INFO["kernel_source"] = source

    def work():
        ok(cu.cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0), "cuLaunchKernel")
        ok(cu.cuCtxSynchronize(), "cuCtxSynchronize")
    return work, 1


def ctypes_driver():
    from gpu_driver import Driver

    drv = Driver(device)
    fn = drv.noop_function()
    via_getproc = drv.getproc_launcher()
    via_ptsz = drv.getproc_launcher(per_thread_stream=True)

    def work():
        drv.launch(fn)                        # dlopen + dlsym(handle), as ctypes and Triton
        drv.launch(fn, launcher=via_getproc)  # cuGetProcAddress_v2, as the CUDA runtime
        drv.launch(fn, launcher=via_ptsz)     # ... per-thread default stream variant
        drv.synchronize()
    return work, 3


STACKS = {"torch_eager": torch_eager, "cublas": cublas, "triton": triton_add,
          "cuda_python": cuda_python, "ctypes": ctypes_driver}
INFO: dict = {"stack": stack, "device": device, "reps": reps}


def profiler_counts(work, sync) -> tuple[dict, dict]:
    """Run work() reps times under torch.profiler; interposer deltas and CUPTI counts."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        before = counts()
        for _ in range(reps):
            work()
        sync()
        after = counts()
    cuda_events = collections.Counter()
    try:  # cross-check of the trace: the profiler's own device-side events
        for e in prof.events():
            if "CUDA" in str(getattr(e, "device_type", "")):
                name = str(e.name)
                cuda_events["memcpy" if name.startswith("Memcpy") else
                            "memset" if name.startswith("Memset") else "kernel"] += 1
    except Exception as exc:  # noqa: BLE001
        cuda_events["error: " + type(exc).__name__] += 1
    del torch
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    finally:
        os.unlink(path)
    cats = collections.Counter()
    launch_api = collections.Counter()
    for ev in trace.get("traceEvents", []):
        cat = str(ev.get("cat", ""))
        if ev.get("ph") != "X":
            continue
        cats[cat] += 1
        if cat in ("cuda_runtime", "cuda_driver") and "aunch" in str(ev.get("name", "")):
            launch_api[str(ev.get("name"))] += 1
    prof_counts = {"kernels": cats.get("kernel", 0), "memcpy": cats.get("gpu_memcpy", 0),
                   "memset": cats.get("gpu_memset", 0), "launch_api_calls": dict(launch_api),
                   "categories": dict(cats), "events_device_side": dict(cuda_events)}
    return _delta(before, after), prof_counts


def _delta(before: dict, after: dict) -> dict:
    return {k: after[k] - before[k] for k in after if k != "active"}


def main() -> dict:
    start = time.monotonic()
    setup = STACKS[stack]
    work, per_rep = setup()
    torch = None
    if not fake:
        try:
            import torch
        except ImportError:
            torch = None
    sync = torch.cuda.synchronize if torch is not None else (lambda: None)
    work()  # warm-up: JIT, handles, lazy init
    sync()
    INFO["setup_s"] = time.monotonic() - start
    INFO["expected_by_construction"] = None if per_rep is None else per_rep * reps
    if torch is not None and torch.cuda.is_available():
        delta, prof = profiler_counts(work, sync)
        INFO["profiler"] = prof
        INFO["profiler_expected"] = prof["kernels"] + prof["memcpy"] + prof["memset"]
    else:
        before = counts()
        for _ in range(reps):
            work()
        sync()
        delta = _delta(before, counts())
        INFO["profiler"] = None
        INFO["profiler_skipped"] = ("the device is fakegpu: no CUPTI" if fake
                                    else "torch is not importable: no CUPTI profiler")
    INFO["interposer"] = delta
    INFO["interposer_active"] = counts()["active"]
    INFO["caught"] = delta["direct"] + delta["dlsym"] + delta["getprocaddress"]
    return INFO


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    try:
        result = {"ok": True, **main()}
    except Skip as exc:
        result = {"ok": False, "skipped": str(exc), **INFO}
    except Exception as exc:  # noqa: BLE001  (the parent records it)
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                  "traceback": traceback.format_exc()[-2000:], **INFO}
    with open(out, "w") as f:
        json.dump(result, f, default=str)
