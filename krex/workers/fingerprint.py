"""Identities of a set of modules' bindings: has anything rebound or replaced them?

In: module names.  Out: a :class:`Bindings` snapshot of every binding of
those modules and of the classes they define — for a function, its code
object, defaults and keyword defaults as well — whose :meth:`Bindings.changed`
names what differs *now*.  Used by the canary (krex's own modules, preloaded
into every worker, must be as they were when the worker started) and by
``krex.evaluate.guard`` (what a candidate may not touch during one evaluation).
Mutation inside kept objects (a list in a module) and native code are out of
reach.

Thousands of bindings are checked twice per evaluation, so both taking and
checking run at C speed: shallow copies of the namespaces, ``map(id, …)``
over their values (looked up again with ``dict.get`` / ``mappingproxy.get``
mapped over flat lists of namespaces and keys: one pass for all modules, one for
all classes) and over the functions' code/defaults, lists of ints compared with
``==``.  Identity, never equality: an object whose ``__eq__``
says True to anything must not pass for the original.  The snapshot holds
every object it saw (the namespaces' copies, the code objects, the defaults),
so none can be freed and its address reused by a replacement while it lives.
Only when something differs does a Python loop name the bindings.  Where CPython's dict
version tags can be read (:mod:`krex.workers.dictversion`), a namespace whose tag has not
moved since its last exact comparison is not compared again: a check is then the tags,
the functions' parts and the wrappers, not every binding.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Mapping
from itertools import repeat
from operator import attrgetter, is_not
from typing import Any

from krex.workers import dictversion

_WRAPPERS = (staticmethod, classmethod, types.MethodType)  # judged by their __func__ too
_FUNC = attrgetter("__func__")
_PARTS = (attrgetter("__code__"), attrgetter("__defaults__"), attrgetter("__kwdefaults__"))
_MISSING = object()


class Bindings:
    """A snapshot of the named modules' bindings (and of the classes they define)."""

    def __init__(self, module_names: list[str]) -> None:
        # (name prefix, live namespace, its copy as taken): modules, then their classes
        self.spaces: list[tuple[tuple[str, ...], Mapping[str, Any], dict[str, Any]]] = []
        self.modules: list[str] = []  # the names found, in order
        self.trackers: list[dictversion.Tracker] = []  # one per module, spaces in order
        self.untracked = False  # a module's spaces not all tracked: compare every binding
        for name in module_names:
            module = sys.modules.get(name)
            if module is not None:
                self.modules.append(name)
                self._add_module(name, vars(module))
        values = [v for _, _, copy in self.spaces for v in copy.values()]
        self.wrappers = [v for v in values if isinstance(v, _WRAPPERS)]
        self.wrapped = list(map(_FUNC, self.wrappers))  # held: their addresses stay theirs
        functions = {id(v): v for v in (*values, *self.wrapped) if type(v) is types.FunctionType}
        self.functions = list(functions.values())
        self.parts = [list(map(get, self.functions)) for get in _PARTS]  # held, as above
        self.ids = [list(map(id, held)) for held in (self.wrapped, *self.parts)]
        if self.untracked:
            self._flatten()

    def _flatten(self) -> None:
        """Every binding in flat lists by the kind of its namespace (a module's dict, a
        class's mappingproxy): one ``map`` at C speed over them all, not one per space."""
        # by the unbound ``get`` of the namespaces' type: dict.get, mappingproxy.get
        self.flat: dict[Any, tuple[list[Any], list[str], list[int]]] = {}
        for _, live, copy in self.spaces:
            spaces, keys, ids = self.flat.setdefault(type(live).get, ([], [], []))
            spaces.extend([live] * len(copy))
            keys.extend(copy)
            ids.extend(map(id, copy.values()))

    def _add_module(self, name: str, namespace: dict[str, Any]) -> None:
        """The module's and its classes' namespaces: tracked by their dict version tags
        where every one's dict is found, the tags read before the copies are taken."""
        classes = [(attr, value) for attr, value in list(namespace.items())
                   if isinstance(value, type) and getattr(value, "__module__", None) == name]
        spaces = [((name,), namespace)] + [((name, a), vars(c)) for a, c in classes]
        dicts = [namespace] + [dictversion.class_dict(c) for _, c in classes]
        if dictversion.available() and None not in dicts:
            self.trackers.append(dictversion.Tracker(dicts))  # type: ignore[arg-type]
        else:
            self.untracked = True
        self.spaces += [(prefix, live, dict(live)) for prefix, live in spaces]

    def changed(self) -> list[str]:
        """Names rebound, replaced or removed since the snapshot (new names are not judged),
        sorted; ``[]`` — the usual answer — at C speed."""
        return [] if self._same() else self._names()

    def _same(self) -> bool:
        if not self.untracked:
            if not self._spaces_same():
                return False
        else:
            for get, (spaces, keys, ids) in self.flat.items():
                # by name, so names added since (a submodule imported later) change nothing
                if list(map(id, map(get, spaces, keys, repeat(_MISSING)))) != ids:
                    return False
        return self._functions_same()

    def _spaces_same(self) -> bool:
        """By the tags: only the spaces whose tag moved since their last comparison are
        compared again (by name, so names added since change nothing)."""
        first = 0
        for tracker in self.trackers:
            def differs(i: int, first: int = first) -> bool:
                _, live, copy = self.spaces[first + i]
                return any(map(is_not, map(live.get, copy, repeat(_MISSING)), copy.values()))

            if any(tracker.differs(differs)):
                return False
            first += len(tracker.answers)
        return True

    def _functions_same(self) -> bool:
        """The wrappers still wrap what they did; the functions' parts are the same objects
        (identities of objects this snapshot holds: their ids cannot be reused)."""
        wrapped, *parts = self.ids
        if list(map(id, map(_FUNC, self.wrappers))) != wrapped:
            return False
        return all(list(map(id, map(get, self.functions))) == held
                   for get, held in zip(_PARTS, parts, strict=True))

    def _names(self) -> list[str]:
        """The slow path: which bindings differ, by name."""
        changed_functions = {id(f) for get, held in zip(_PARTS, self.parts, strict=True)
                             for f, part in zip(self.functions, held, strict=True)
                             if get(f) is not part}
        rewrapped = {id(w) for w, f in zip(self.wrappers, self.wrapped, strict=True)
                     if _FUNC(w) is not f}
        out = set()
        for prefix, live, copy in self.spaces:
            for attr, value in copy.items():
                inner = _FUNC(value) if isinstance(value, _WRAPPERS) else value
                if (live.get(attr, _MISSING) is not value or id(value) in rewrapped
                        or id(inner) in changed_functions):
                    out.add(".".join((*prefix, attr)))
        return sorted(out)

    def __len__(self) -> int:
        return sum(len(copy) for _, _, copy in self.spaces)


def fingerprint(module_names: list[str]) -> Bindings:
    """A :class:`Bindings` snapshot of the named modules; ``.changed()`` names what differs."""
    return Bindings(module_names)


def krex_modules() -> list[str]:
    """krex's own modules, as loaded now."""
    return sorted(n for n in list(sys.modules) if n == "krex" or n.startswith("krex."))
