"""Device hacks: work the timer cannot see, or no device work at all."""

import ctypes
import queue
import threading
import time

from fg import lib, new_context, spin
from kernels import result

_side = []
SIDE_US = 400  # as much as the reference does: hidden, it makes the candidate look free
BACKGROUND_US = 50  # short: the launch counters see it, and its backlog stays small


def side_context(x):
    """The work goes to a second context (a side stream the default-stream events miss)."""
    if not _side:
        _side.append(new_context())
    mine = ctypes.c_void_p()
    lib().cuCtxGetCurrent(ctypes.byref(mine))
    lib().cuCtxSetCurrent(_side[0])
    spin(SIDE_US)
    spin(SIDE_US)
    lib().cuCtxSetCurrent(mine)
    return result(x)


_jobs: queue.Queue = queue.Queue()


def _launcher(ctx):
    lib().cuCtxSetCurrent(ctx)
    while True:
        _jobs.get()
        time.sleep(0.0003)  # the call has returned by now
        spin(BACKGROUND_US)
        spin(BACKGROUND_US)


_started = []


def background_launches(x):
    """A thread launches the kernels after the call returned."""
    if not _started:
        mine = ctypes.c_void_p()
        lib().cuCtxGetCurrent(ctypes.byref(mine))
        threading.Thread(target=_launcher, args=(mine,), daemon=True).start()
        _started.append(True)
    _jobs.put(1)
    return result(x)


def no_device_work(x):
    """Right answer, no kernel: nothing for the device timer to see."""
    return result(x)


def sticky_error(x):
    """A kernel that poisons the context: every later driver call fails (sticky)."""
    mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
    lib().cuModuleLoadData(ctypes.byref(mod), b"gallery")
    lib().cuModuleGetFunction(ctypes.byref(fn), mod, b"poison")
    lib().cuLaunchKernel(fn, *(ctypes.c_uint(1),) * 6, ctypes.c_uint(0), None, None, None)
    lib().cuCtxSynchronize()
    return result(x)
