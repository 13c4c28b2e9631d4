"""One framework stack under a closed gate, for gpu_check.py's "held" check.

argv: STACK DEVICE
Runs the stack's work once (warm-up: compilation, handles, lazy init, and for
``torch_graph`` the capture of a CUDA graph), prints "ready", waits for a line on
stdin (the check closes this process's gate meanwhile), then runs the work again and
synchronises, and prints "done SECONDS".  Under a closed gate the work must not
return until the gate opens.  A missing package prints "skip REASON".
STACK: torch_eager | torch_graph | triton | cublas | cuda_python | ctypes
"""

import sys
import time

stack, device = sys.argv[1], sys.argv[2]
index = int(device.partition(":")[2] or 0)


def torch_eager():
    import torch

    a = torch.randn(1 << 20, device=f"cuda:{index}")
    return lambda: torch.relu(a * 2 + a).sum().item()


def torch_graph():
    import torch

    x = torch.randn(1 << 16, device=f"cuda:{index}")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            y = x * 2 + 1
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = x * 2 + 1  # noqa: F841  (captured by this sibling, replayed under the gate)
    return lambda: (g.replay(), torch.cuda.synchronize())


def triton_add():
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def add(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):  # noqa: N803
        pid = tl.program_id(0)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) + tl.load(y_ptr + offs,
                                                                           mask=mask), mask=mask)

    n = 1 << 20
    x = torch.randn(n, device=f"cuda:{index}")
    y, out = torch.randn_like(x), torch.empty_like(x)
    return lambda: (add[(n // 1024,)](x, y, out, n, BLOCK=1024), torch.cuda.synchronize())


def cublas():
    import torch

    a = torch.randn(2048, 2048, device=f"cuda:{index}")
    return lambda: (a @ a, torch.cuda.synchronize())


def cuda_python():
    import ctypes

    from cuda.bindings import driver as cu

    from krex.eval.kernels import DEVICE_PTX

    def ok(res):
        err = res[0] if isinstance(res, tuple) else res
        if int(err) != 0:
            raise RuntimeError(f"cuda-python: {err}")
        return res[1] if isinstance(res, tuple) and len(res) > 1 else None

    ok(cu.cuInit(0))
    dev = ok(cu.cuDeviceGet(index))
    ctx = ok(cu.cuDevicePrimaryCtxRetain(dev))
    ok(cu.cuCtxSetCurrent(ctx))
    mod = ok(cu.cuModuleLoadData(DEVICE_PTX + b"\0"))
    fn = ok(cu.cuModuleGetFunction(mod, b"krex_spin_ns"))
    ns = ctypes.c_uint64(1_000_000)
    params = (ctypes.c_void_p * 1)(ctypes.addressof(ns))

    def work():
        ok(cu.cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, 0, ctypes.addressof(params), 0))
        ok(cu.cuCtxSynchronize())

    work.keep = (ns, params)
    return work


def ctypes_driver():
    from gpu_driver import Driver

    drv = Driver(device)
    spin = drv.spin(1.0)
    return lambda: (spin(), drv.synchronize())


STACKS = {"torch_eager": torch_eager, "torch_graph": torch_graph, "triton": triton_add,
          "cublas": cublas, "cuda_python": cuda_python, "ctypes": ctypes_driver}
try:
    work = STACKS[stack]()
except ImportError as exc:
    print(f"skip {exc}", flush=True)
    sys.exit(0)
work()
print("ready", flush=True)
sys.stdin.readline()
t0 = time.monotonic()
work()
print(f"done {time.monotonic() - t0:.6f}", flush=True)
