"""Run one program inside the worker: a script as ``__main__`` or a pickled callable.

In: a request dict (``ExecRequest.to_dict()`` before base64).  Out: a dict
with ``status``, ``exit_code``, ``exception``, ``traceback``, ``value`` and
``started_mono_s`` / ``ended_mono_s`` (``time.monotonic()`` just before the
program's first instruction and after its threads and exit functions
finished).  The job's argv, cwd and environment are applied here; putting the
worker back afterwards is ``snapshot.restore``'s job.
"""

from __future__ import annotations

import atexit
import contextvars
import ctypes
import importlib
import os
import pickle
import sys
import threading
import time
import traceback
import types
from collections.abc import Callable
from typing import Any

_LIBC = ctypes.CDLL(None)


def run(req: dict[str, Any], base_env: dict[str, str], pinned_env: list[str]) -> dict[str, Any]:
    """Run ``req``; every outcome of the program becomes a result dict."""
    _apply(req, base_env, pinned_env)
    main = types.ModuleType("__main__")
    saved_main = sys.modules.get("__main__")
    threads_before = set(threading.enumerate())
    exit_funcs: list[tuple[Callable[..., Any], tuple, dict]] = []
    result: dict[str, Any] = {"status": "ok", "exit_code": 0, "started_mono_s": None}
    try:
        sys.modules["__main__"] = main
        with _CapturedAtexit(exit_funcs):
            # in a copy of the worker's context: context variables the program sets
            # (decimal's context, krex.client's ACTING_FOR) end with it, as in a process
            contextvars.copy_context().run(_program, req, main, result, threads_before,
                                           exit_funcs)
    finally:
        result["ended_mono_s"] = time.monotonic()
        sys.modules["__main__"] = saved_main  # type: ignore[assignment]
        _flush()
    return result


def _program(req: dict[str, Any], main: types.ModuleType, result: dict[str, Any],
             threads_before: set[threading.Thread],
             exit_funcs: list[tuple[Callable[..., Any], tuple, dict]]) -> None:
    result.update(_execute(req, main, result))
    _join_foreground_threads(threads_before)
    _run_exit_funcs(exit_funcs)


def _apply(req: dict[str, Any], base_env: dict[str, str], pinned_env: list[str]) -> None:
    env = dict(base_env if req.get("env") is None else req["env"])
    for key, value in base_env.items():
        if any(key.startswith(p[:-1]) if p.endswith("*") else key == p for p in pinned_env):
            env[key] = value
    os.environ.clear()
    os.environ.update(env)
    os.chdir(req["cwd"])
    if req["kind"] == "path":
        path = os.path.abspath(req["path"])
        sys.argv[:] = [path, *req.get("args", [])]
        first = os.path.dirname(path)
    else:
        sys.argv[:] = ["-c", *req.get("args", [])]
        first = os.getcwd()
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:1] = [first, *[p for p in extra if p not in sys.path]]
    importlib.invalidate_caches()


def _execute(req: dict[str, Any], main: types.ModuleType, result: dict[str, Any]) -> dict:
    try:
        if req["kind"] == "path":
            code = _compile(req["path"], main)
            result["started_mono_s"] = time.monotonic()
            exec(code, vars(main))
            return {}
        fn, args, kwargs = pickle.loads(req["payload"])
        result["started_mono_s"] = time.monotonic()
        value = fn(*args, **kwargs)
        return {"value": pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)}
    except SystemExit as e:
        return _system_exit(e)
    except BaseException as e:  # noqa: BLE001  (the program's failure is its result)
        return _failure(e)


def _compile(path: str, main: types.ModuleType) -> types.CodeType:
    path = os.path.abspath(path)
    with open(path, "rb") as f:
        source = f.read()
    main.__file__ = path
    main.__builtins__ = __builtins__  # type: ignore[attr-defined]
    main.__cached__ = None  # type: ignore[attr-defined]
    return compile(source, path, "exec", dont_inherit=True)


def _system_exit(e: SystemExit) -> dict[str, Any]:
    code = e.code
    if code is None or code == 0:
        return {}
    if isinstance(code, int):
        return {"status": "error", "exit_code": code, "exception": f"SystemExit: {code}"}
    print(code, file=sys.stderr)  # what the interpreter does with sys.exit("message")
    return {"status": "error", "exit_code": 1, "exception": f"SystemExit: {code}"}


def _failure(e: BaseException) -> dict[str, Any]:
    tb = e.__traceback__.tb_next if e.__traceback__ else None  # drop this module's frame
    text = "".join(traceback.format_exception(type(e), e, tb))
    sys.stderr.write(text)  # like an uncaught exception in a fresh interpreter
    return {"status": "error", "exit_code": 1, "exception": _describe(e), "traceback": text}


def _describe(e: BaseException) -> str:
    message = str(e)
    return f"{type(e).__name__}: {message}" if message else type(e).__name__


class _CapturedAtexit:
    """Collect atexit registrations made by the program; run them when it ends."""

    def __init__(self, into: list) -> None:
        self.into = into

    def __enter__(self) -> None:
        self.saved = (atexit.register, atexit.unregister)
        atexit.register = self._register  # type: ignore[assignment]
        atexit.unregister = self._unregister

    def __exit__(self, *exc: object) -> None:
        atexit.register, atexit.unregister = self.saved

    def _register(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Callable[..., Any]:
        self.into.append((fn, args, kwargs))
        return fn

    def _unregister(self, fn: Callable[..., Any]) -> None:
        self.into[:] = [entry for entry in self.into if entry[0] != fn]


def _run_exit_funcs(funcs: list[tuple[Callable[..., Any], tuple, dict]]) -> None:
    for fn, args, kwargs in reversed(funcs):
        try:
            fn(*args, **kwargs)
        except BaseException:  # noqa: BLE001  (the interpreter reports and goes on)
            traceback.print_exc()


def _join_foreground_threads(before: set[threading.Thread]) -> None:
    """A fresh interpreter waits for non-daemon threads before it exits; so do we."""
    for t in threading.enumerate():
        if t not in before and not t.daemon and t is not threading.current_thread():
            t.join()


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            stream.flush()  # type: ignore[union-attr]  # None (no stream) is caught too
        except Exception:  # noqa: BLE001, S110 - a program may have closed or replaced it
            pass
    _LIBC.fflush(None)
