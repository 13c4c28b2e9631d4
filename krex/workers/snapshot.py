"""Process-global state a program may change, taken once and put back after each program.

``take()`` records the worker's state when it is ready; ``restore(snap)``
puts it back after a program and returns the names of what the program had
changed.  Covered: imported modules (new pure-Python modules are removed;
extension modules stay, they cannot be initialised twice), module globals
rebound by the program, attributes of the classes the modules define, cwd,
os.environ, sys.path/argv/meta_path/path_hooks,
signal handlers, the signal mask and timers, warnings filters, umask, the
recursion limit and switch interval, gc settings, trace/profile hooks,
standard streams and fds 0-2, random state (reseeded as a fresh process
would be) and torch's defaults when torch is loaded.  Context variables need
no putting back: ``runner`` runs each program in a copy of the worker's context.
"""

from __future__ import annotations

import gc
import itertools
import operator
import os
import random
import signal
import sys
import warnings
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from krex.workers import dictversion
from krex.workers.launcher import same_file

_UNSETTABLE = {signal.SIGKILL, signal.SIGSTOP}
RESTORE_FAILED = "restore-failed"  # in what restore() names: the worker must be recycled
_TIMERS = (signal.ITIMER_REAL, signal.ITIMER_VIRTUAL, signal.ITIMER_PROF)
# the program's own; ``__mp_main__`` is multiprocessing's name for the same module
# (torch's import binds it)
_SKIP_MODULES = {"__main__", "__mp_main__"}


@dataclass
class Snapshot:
    cwd: str
    environ: dict[str, str]
    lists: dict[str, list[Any]]  # sys.path, sys.argv, sys.meta_path, sys.path_hooks
    modules: dict[str, ModuleType]
    globals: dict[str, dict[str, Any]]  # module name -> copy of its (non-dunder) globals
    signals: dict[int, Any]
    sigmask: set[int]
    warnings_filters: list[Any]
    umask: int
    settings: dict[str, Any]  # recursion limit, switch interval, gc
    streams: tuple[Any, Any, Any]
    fds: dict[int, int]  # fd -> a dup of what it pointed to
    torch: dict[str, Any] = field(default_factory=dict)
    bindings: _Flat | None = None  # every module's namespace as taken, dunders too
    classes: _Classes | None = None  # the namespaces of the classes the modules define


class _Flat:
    """All modules' namespaces in flat lists, so which of them changed (a binding added,
    removed or rebound) is found in one pass at C speed over every binding (``dict.get``
    mapped over namespace and key lists, identities compared as lists of ints, the
    positions that differ picked by ``itertools.compress``) instead of a set difference
    per module.  Holds a copy of each namespace: no value it saw can be freed and its id
    reused.  The rare "module" whose namespace is not a dict (a class in
    ``sys.modules``, e.g. ``typing.io``) is compared in Python.  Where CPython's dict
    version tags can be read (:mod:`krex.workers.dictversion`), only the namespaces whose
    tag moved since they were last compared are compared again."""

    def __init__(self, modules: dict[str, ModuleType]) -> None:
        named = [(name, ns) for name, ns in zip(modules, map(_namespace, modules.values()),
                                                strict=True) if ns is not None]
        self.names = [name for name, ns in named if type(ns) is dict]
        self.live = [ns for _, ns in named if type(ns) is dict]
        self.tracker = dictversion.tracker(self.live)  # before the copies
        self.copies = [dict(ns) for ns in self.live]
        self.lens = list(map(len, self.live))
        self.spaces = [ns for ns, copy in zip(self.live, self.copies, strict=True) for _ in copy]
        self.owners = [name for name, copy in zip(self.names, self.copies, strict=True)
                       for _ in copy]
        self.keys = [k for copy in self.copies for k in copy]
        self.ids = [id(v) for copy in self.copies for v in copy.values()]
        self.others = [(name, ns, dict(ns)) for name, ns in named if type(ns) is not dict]

    def changed(self) -> set[str]:
        """The modules whose namespace differs from the copy (another length, or another
        object under a key it had); usually none."""
        if self.tracker is not None:
            return self._changed_by_tags() | self._others_changed()
        out: set[str] = set()
        lens = list(map(len, self.live))
        if lens != self.lens:
            out.update(itertools.compress(self.names, map(operator.ne, lens, self.lens)))
        found = list(map(id, map(dict.get, self.spaces, self.keys, itertools.repeat(_MISSING))))
        if found != self.ids:
            out.update(itertools.compress(self.owners, map(operator.ne, found, self.ids)))
        return out | self._others_changed()

    def _changed_by_tags(self) -> set[str]:
        """Only the namespaces whose tag moved since their last comparison are compared
        again (:mod:`krex.workers.dictversion`)."""
        def differs(i: int) -> bool:
            live, copy = self.live[i], self.copies[i]
            return len(live) != len(copy) or any(
                map(operator.is_not, map(live.get, copy, itertools.repeat(_MISSING)),
                    copy.values()))

        return set(itertools.compress(self.names, self.tracker.differs(differs)))  # type: ignore[union-attr]

    def _others_changed(self) -> set[str]:
        return {name for name, ns, copy in self.others
                if len(ns) != len(copy) or any(ns.get(k, _MISSING) is not v
                                               for k, v in copy.items())}

    def unchanged(self) -> bool:
        return not self.changed()


class _Classes:
    """The classes each module defines (``__module__`` is its name) and their namespaces as
    taken: a program that rebinds, adds or removes a class attribute
    (``json.JSONEncoder.default``, ``threading.Thread.run``) would otherwise hand the
    change to the next program.  Watched by their dicts' version tags where found
    (:mod:`krex.workers.dictversion`), the rest compared after every program."""

    def __init__(self, modules: dict[str, ModuleType]) -> None:
        found: dict[int, type] = {}
        with warnings.catch_warnings():  # a deprecated alias's warning is not the program's
            warnings.simplefilter("ignore")
            for name, module in modules.items():
                namespace = _namespace(module)
                if type(namespace) is dict:
                    for value in list(namespace.values()):
                        if isinstance(value, type) and getattr(value, "__module__", None) == name:
                            found.setdefault(id(value), value)
        self.classes = list(found.values())
        dicts = [dictversion.class_dict(c) for c in self.classes]
        self.tracked = [i for i, d in enumerate(dicts) if d is not None]
        self.tracker = dictversion.tracker([dicts[i] for i in self.tracked])  # type: ignore[misc]
        if self.tracker is None:
            self.tracked = []
        kept = set(self.tracked)
        self.untracked = [i for i in range(len(self.classes)) if i not in kept]
        self.copies = [dict(vars(c)) for c in self.classes]  # after the tags were read

    def _differs(self, i: int) -> bool:
        live, copy = vars(self.classes[i]), self.copies[i]
        return len(live) != len(copy) or any(
            map(operator.is_not, map(live.get, copy, itertools.repeat(_MISSING)),
                copy.values()))

    def changed(self) -> list[int]:
        """Indices of the classes whose namespace differs from its copy; usually none."""
        out = [i for i in self.untracked if self._differs(i)]
        if self.tracker is not None:
            answers = self.tracker.differs(lambda j: self._differs(self.tracked[j]))
            out += [self.tracked[j] for j in itertools.compress(range(len(answers)), answers)]
        return out


def _namespace(module: ModuleType) -> Any:
    try:
        return vars(module)
    except TypeError:
        return None


def take() -> Snapshot:
    mods = {k: m for k, m in sys.modules.items() if m is not None and k not in _SKIP_MODULES}
    # The classes first: reading a class's ``__module__`` can run code (torch's deprecated
    # aliases warn, and the warning adds ``__warningregistry__`` to this module), which
    # the flat copy of every namespace must already hold.
    classes = _Classes(mods)
    return Snapshot(
        cwd=os.getcwd(), environ=dict(os.environ),
        lists={k: list(getattr(sys, k)) for k in ("path", "argv", "meta_path", "path_hooks")},
        modules=mods, globals={k: _public(m) for k, m in mods.items()},
        signals={s: signal.getsignal(s) for s in _signals()},
        sigmask=set(signal.pthread_sigmask(signal.SIG_BLOCK, [])),
        warnings_filters=list(warnings.filters), umask=_umask(), settings=_settings(),
        streams=(sys.stdin, sys.stdout, sys.stderr),
        fds={fd: os.dup(fd) for fd in (0, 1, 2)}, torch=_torch_state(),
        bindings=_Flat(mods), classes=classes,
    )


def restore(snap: Snapshot) -> list[str]:
    """Put the worker back as it was in ``snap``; return what had changed."""
    changed: list[str] = []
    for name, fn in _RESTORERS:
        try:
            changed.extend(f"{name}:{x}" if x else name for x in fn(snap))
        except Exception as e:  # noqa: BLE001  (one failed step must not skip the others)
            changed.append(f"{name}:{RESTORE_FAILED}:{type(e).__name__}")
    reseed()
    return changed


def reseed() -> None:
    """Fresh random state, as a new process would have."""
    random.seed()
    mtrand = sys.modules.get("numpy.random.mtrand")
    if mtrand is not None:
        mtrand.seed()
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "seed"):
        torch.seed()


def _public(module: ModuleType) -> dict[str, Any]:
    try:
        return {k: v for k, v in vars(module).items() if not k.startswith("__")}
    except TypeError:
        return {}


def _signals() -> list[int]:
    return [s for s in signal.valid_signals() if s not in _UNSETTABLE]


def _umask() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    return 0o022


def _settings() -> dict[str, Any]:
    return {"recursionlimit": sys.getrecursionlimit(), "switchinterval": sys.getswitchinterval(),
            "gc_enabled": gc.isenabled(), "gc_threshold": gc.get_threshold(),
            "trace": sys.gettrace(), "profile": sys.getprofile(),
            "excepthook": sys.excepthook, "displayhook": sys.displayhook}


def _torch_state() -> dict[str, Any]:
    torch = sys.modules.get("torch")
    if torch is None:
        return {}
    state: dict[str, Any] = {"dtype": torch.get_default_dtype()}
    for name, get in _TORCH_FLAGS.items():
        try:
            state[name] = get(torch)
        except Exception:  # noqa: BLE001, S110 - flag missing in this torch version
            pass
    return state


_TORCH_FLAGS = {
    "matmul_precision": lambda t: t.get_float32_matmul_precision(),
    "deterministic": lambda t: t.are_deterministic_algorithms_enabled(),
    "num_threads": lambda t: t.get_num_threads(),
    "cudnn_benchmark": lambda t: t.backends.cudnn.benchmark,
    "cudnn_deterministic": lambda t: t.backends.cudnn.deterministic,
    "cudnn_tf32": lambda t: t.backends.cudnn.allow_tf32,
    "matmul_tf32": lambda t: t.backends.cuda.matmul.allow_tf32,
}


def _restore_modules(snap: Snapshot) -> list[str]:
    out = []
    for name in [k for k in sys.modules if k not in snap.modules and k not in _SKIP_MODULES]:
        module = sys.modules[name]
        if module is not None and _is_extension(module):
            continue  # extension modules cannot be initialised twice in one process
        del sys.modules[name]
        out.append("")
    for name, module in snap.modules.items():
        if sys.modules.get(name) is not module:
            sys.modules[name] = module
            out.append(name)
    return [f"{len(out)} module(s)"] if out else []


def _is_extension(module: ModuleType) -> bool:
    spec = getattr(module, "__spec__", None)
    origin = getattr(spec, "origin", None) or getattr(module, "__file__", None) or ""
    return origin == "built-in" or origin.endswith((".so", ".pyd"))


def _restore_globals(snap: Snapshot) -> list[str]:
    """Thousands of bindings after every program: a module whose bindings are all the
    saved objects is skipped after one pass at C speed (set difference, ``map``); one flat
    pass over them all (:class:`_Flat`) names the modules worth that look -- usually none."""
    names = snap.globals if snap.bindings is None else sorted(snap.bindings.changed())
    out = []
    for name in names:
        saved = snap.globals.get(name)
        if saved is None:
            continue
        namespace = vars(snap.modules[name])
        added = [k for k in namespace.keys() - saved.keys() if not k.startswith("__")]
        found = map(namespace.get, saved, itertools.repeat(_MISSING))  # a deleted None too
        if not added and not any(map(operator.is_not, found, saved.values())):
            continue
        for key in added:
            del namespace[key]
            out.append(f"{name}.{key}")
        for key, value in saved.items():
            if namespace.get(key, _MISSING) is not value:
                namespace[key] = value
                out.append(f"{name}.{key}")
    return out


_MISSING = object()


def _restore_classes(snap: Snapshot) -> list[str]:
    """Class attributes rebound, added or removed by the program, put back through
    ``type.__setattr__`` (a metaclass's own ``__setattr__``, e.g. an enum's, is not asked);
    a class that refuses (an immutable type, changed through its dict) is named
    ``restore-failed`` and the worker is recycled."""
    if snap.classes is None:
        return []
    out = []
    for i in snap.classes.changed():
        cls, saved = snap.classes.classes[i], snap.classes.copies[i]
        live, name = vars(cls), f"{cls.__module__}.{cls.__qualname__}"
        try:
            for key in [k for k in live if k not in saved]:
                type.__delattr__(cls, key)
                out.append(f"{name}.{key}")
            for key, value in saved.items():
                if live.get(key, _MISSING) is not value:
                    type.__setattr__(cls, key, value)
                    out.append(f"{name}.{key}")
        except (TypeError, AttributeError):
            out.append(f"{name}:{RESTORE_FAILED}")
    return out


def _restore_process(snap: Snapshot) -> list[str]:
    out = []
    if os.getcwd() != snap.cwd:
        os.chdir(snap.cwd)
        out.append("cwd")
    if dict(os.environ) != snap.environ:
        os.environ.clear()
        os.environ.update(snap.environ)
        out.append("environ")
    if _umask() != snap.umask:
        os.umask(snap.umask)
        out.append("umask")
    return out


def _restore_sys(snap: Snapshot) -> list[str]:
    out = []
    for name, saved in snap.lists.items():
        current = getattr(sys, name)
        if current != saved:
            current[:] = saved
            out.append(name)
    for key in [k for k in sys.path_importer_cache if k not in sys.path]:
        del sys.path_importer_cache[key]
    if (sys.stdin, sys.stdout, sys.stderr) != snap.streams:
        sys.stdin, sys.stdout, sys.stderr = snap.streams
        out.append("streams")
    return out


def _restore_settings(snap: Snapshot) -> list[str]:
    now, saved = _settings(), snap.settings
    if now == saved:
        return []
    sys.setrecursionlimit(saved["recursionlimit"])
    sys.setswitchinterval(saved["switchinterval"])
    (gc.enable if saved["gc_enabled"] else gc.disable)()
    gc.set_threshold(*saved["gc_threshold"])
    sys.settrace(saved["trace"])
    sys.setprofile(saved["profile"])
    sys.excepthook, sys.displayhook = saved["excepthook"], saved["displayhook"]
    return [k for k in saved if now[k] != saved[k]]


def _restore_signals(snap: Snapshot) -> list[str]:
    out = []
    for sig in _TIMERS:
        if signal.getitimer(sig) != (0.0, 0.0):
            signal.setitimer(sig, 0)
            out.append("timer")
    for sig, handler in snap.signals.items():
        if signal.getsignal(sig) is not handler and handler is not None:
            signal.signal(sig, handler)
            out.append(signal.Signals(sig).name)
    if set(signal.pthread_sigmask(signal.SIG_BLOCK, [])) != snap.sigmask:
        signal.pthread_sigmask(signal.SIG_SETMASK, snap.sigmask)
        out.append("mask")
    return out


def _restore_warnings(snap: Snapshot) -> list[str]:
    if warnings.filters == snap.warnings_filters:
        return []
    warnings.filters[:] = snap.warnings_filters  # type: ignore[index]  # a list at run time
    warnings._filters_mutated()  # type: ignore[attr-defined]
    return [""]


def _restore_fds(snap: Snapshot) -> list[str]:
    out = []
    for fd, saved in snap.fds.items():
        if not same_file(fd, saved):
            os.dup2(saved, fd)
            out.append(str(fd))
    return out


def _restore_torch(snap: Snapshot) -> list[str]:
    torch = sys.modules.get("torch")
    if torch is None or not snap.torch:
        return []
    now = _torch_state()
    changed = [k for k, v in snap.torch.items() if now.get(k) != v]
    for key in changed:
        _TORCH_SETTERS[key](torch, snap.torch[key])
    return changed


def _set_attr(path: str):
    def setter(torch: Any, value: Any) -> None:
        *parents, last = path.split(".")
        obj = torch
        for p in parents:
            obj = getattr(obj, p)
        setattr(obj, last, value)
    return setter


_TORCH_SETTERS = {
    "dtype": lambda t, v: t.set_default_dtype(v),
    "matmul_precision": lambda t, v: t.set_float32_matmul_precision(v),
    "deterministic": lambda t, v: t.use_deterministic_algorithms(v),
    "num_threads": lambda t, v: t.set_num_threads(v),
    "cudnn_benchmark": _set_attr("backends.cudnn.benchmark"),
    "cudnn_deterministic": _set_attr("backends.cudnn.deterministic"),
    "cudnn_tf32": _set_attr("backends.cudnn.allow_tf32"),
    "matmul_tf32": _set_attr("backends.cuda.matmul.allow_tf32"),
}

# Order matters: modules first (so globals of removed modules are not
# touched), then everything else.
_RESTORERS = (
    ("modules", _restore_modules), ("globals", _restore_globals), ("classes", _restore_classes),
    ("process", _restore_process), ("sys", _restore_sys), ("settings", _restore_settings),
    ("signals", _restore_signals), ("warnings", _restore_warnings), ("fds", _restore_fds),
    ("torch", _restore_torch),
)
