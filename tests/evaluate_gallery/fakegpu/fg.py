"""fakegpu helpers for the gallery: the driver, spin kernels, a second context."""

import ctypes
import os

_lib = None
_fns: dict = {}


def lib():
    global _lib
    if _lib is None:
        _lib = ctypes.CDLL(os.environ.get("KREX_FAKEGPU_LIB", "libcuda.so.1"))
        assert _lib.cuInit(0) == 0
    return _lib


def _fn(us):
    if us not in _fns:
        mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
        assert lib().cuModuleLoadData(ctypes.byref(mod), b"gallery") == 0
        assert lib().cuModuleGetFunction(ctypes.byref(fn), mod, f"spin_us_{us}".encode()) == 0
        _fns[us] = fn
    return _fns[us]


ARGS = (ctypes.c_uint(1),) * 6 + (ctypes.c_uint(0), None, None, None)


def spin(us, stream=None):
    """Launch a kernel of ``us`` microseconds on the current context's stream."""
    rc = lib().cuLaunchKernel(_fn(us), *ARGS[:7], stream, None, None)
    assert rc == 0, rc


def current():
    ctx = ctypes.c_void_p()
    assert lib().cuCtxGetCurrent(ctypes.byref(ctx)) == 0
    return ctx


def new_context():
    ctx, dev = ctypes.c_void_p(), ctypes.c_int()
    assert lib().cuDeviceGet(ctypes.byref(dev), 0) == 0
    mine = current()
    assert lib().cuCtxCreate_v2(ctypes.byref(ctx), 0, dev) == 0
    assert lib().cuCtxSetCurrent(mine) == 0
    return ctx
