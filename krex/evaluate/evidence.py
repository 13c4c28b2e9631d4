"""What comes back from an evaluation's program, read without trusting its bytes.

:func:`summary` decodes the program's return value with an unpickler that looks up
no global (a class, a function, a ``__reduce__`` are refused, never run): the sealed
driver's JSON text, or the one-program evaluation's plain dict.
:func:`candidate_tree` reads the candidate's outputs only if their files are the
ones the sealed driver wrote (their SHA-256 travels in its summary).
"""

from __future__ import annotations

import hashlib
import io
import json
import pickle
from collections.abc import Callable
from typing import Any

from krex.evaluate.findings import Code, Finding


class NoGlobals(pickle.Unpickler):
    """Unpickles plain data only: no class, no function is ever looked up."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refused: {module}.{name}")


def summary(result: Any) -> dict[str, Any] | None:
    """The program's summary.  Sealed: the driver's JSON text (decoded without globals),
    never an object; else the candidate's program's return value (``worker`` isolation:
    a pickle from the candidate's process, docs/evaluate.md, threat model)."""
    if result.value is None:
        return None
    try:
        value = NoGlobals(io.BytesIO(result.value)).load()
        if isinstance(value, str):
            value = json.loads(value)
    except (pickle.UnpicklingError, ValueError, EOFError) as exc:
        return {"status": "error", "stage": "outputs",
                "exception": f"the program's result was refused: {exc}"}
    return value if isinstance(value, dict) else None


def candidate_tree(path: str, returned: dict[str, Any],
                   load: Callable[[str], Any]) -> tuple[Any, Finding | None]:
    """The candidate's outputs (``load(path)``); sealed, only if they are the files the
    driver wrote."""
    tree = load(path)
    expected = returned.get("candidate_sha256")
    if tree is None or expected is None:
        return tree, None
    found = files_digest(path)
    if found != expected:
        return None, Finding(Code.KREX_TAMPERED, "the candidate's outputs changed after the "
                             "driver wrote them", {"sha256": found, "expected": expected})
    return tree, None


def files_digest(path: str, suffixes: tuple[str, ...] = (".json", ".bin")) -> str:
    """SHA-256 over ``path`` + each suffix, in order (the candidate's outputs' files)."""
    h = hashlib.sha256()
    for suffix in suffixes:
        with open(path + suffix, "rb") as f:
            h.update(f.read())
    return h.hexdigest()
