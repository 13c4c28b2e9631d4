"""The process that runs one side of an evaluation: ``python -m krex.evaluate.callee``.

In: a JSON job on stdin (the function's and the inputs builder's specs, the cases in
slot order, the shared block's descriptor and size).  It builds every case's
arguments with the inputs builder (twice: a pristine set and a working set), binds
the native dispatcher (``krex._native._dispatch``) to numpy's exact ``ndarray`` type
(and torch's ``Tensor`` where torch is loaded already), *then* imports the function
and hands everything to ``_dispatch.serve``, which never returns to Python until the
driver says so.  Out: nothing but what the dispatcher writes into the shared block --
no pickle, no summary, no timing: this process is the adversary's, and nothing the
judge uses is computed here.  The reference runs in a callee of its own.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from typing import Any


def _types() -> tuple[Any, Any, Any]:
    """(numpy.ndarray, torch.Tensor or None, its to-host function or None): captured
    before any code of the candidate's runs, as C objects the dispatcher compares by identity."""
    import numpy as np

    torch = sys.modules.get("torch")  # loaded by the inputs builder or the driver's preload
    if torch is None:
        return np.ndarray, None, None
    return np.ndarray, torch.Tensor, torch._C.TensorBase.numpy  # a C method descriptor


def _arguments(job: dict[str, Any]) -> tuple[list[Any], list[Any]]:
    from krex.evaluate import spec, values
    from krex.evaluate.worker import build

    make = spec.load(spec.FnSpec.from_dict(job["inputs"]), "inputs")
    pristine, working = [], []
    for case in job["cases"]:
        built = build(make, case)
        pristine.append(built)
        working.append(values.copy_tree(built) if values.copyable(built) else build(make, case))
    return pristine, working


def _say(fd: int, line: str) -> None:
    """One line to the driver on the status pipe."""
    data = (line.replace("\n", " ")[:4000] + "\n").encode()
    while data:
        data = data[os.write(fd, data):]


def _die_with_the_driver() -> None:
    """SIGKILL when the driver (the parent) dies: a killed worker leaves no callee behind."""
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the driver died before the line above
        os._exit(5)


def main() -> int:
    _die_with_the_driver()
    job = json.loads(sys.stdin.read())
    sys.stdin.close()
    if job["role"] == "reference" and job.get("hidden"):  # unreadable to a candidate of its uid
        from krex.evaluate.sandbox import dumpable

        dumpable(False)
    status = int(job["status_fd"])
    from krex._native import _dispatch  # type: ignore[attr-defined]
    from krex.evaluate import spec
    from krex.evaluate.callees import TENSOR_MODULES

    for name in job.get("preload", ()):  # the driver's tensor modules (its --preload)
        if name in TENSOR_MODULES:
            importlib.import_module(name)
    try:
        pristine, working = _arguments(job)
    except BaseException as exc:  # noqa: BLE001  (the inputs builder: the request's fault)
        _say(status, f"inputs: {type(exc).__name__}: {exc}")
        return 4
    # The types once the problem's inputs builder has run (it imports torch where its
    # inputs are tensors), before the function: captured first, a worker without
    # torch preloaded took every tensor for a bad output.
    types = _types()
    _say(status, "bound")  # the driver takes this process's threads as krex's now ...
    go = int(job["go_fd"])
    os.read(go, 1)  # ... and says when it has: only then is the function imported
    os.close(go)
    try:
        fn = spec.load(spec.FnSpec.from_dict(job["fn"]), job["role"])
    except BaseException as exc:  # noqa: BLE001  (SystemExit too: the import's failure)
        _say(status, f"import: {type(exc).__name__}: {exc}")
        return 3
    os.close(status)  # end of file: the driver starts calling
    fd, size = int(job["fd"]), int(job["size"])
    del job
    _dispatch.serve(fd, size, fn, working, pristine, types)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no atexit or finalisers of the candidate's after the loop
