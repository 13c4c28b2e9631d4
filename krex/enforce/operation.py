"""The shape every enforcement mechanism has: an undoable operation.

An operation is checked (``available``), applied, and later reverted; it also
describes how to undo itself as JSON-able records that the guardian replays
(:mod:`krex.enforce.undo`) if the daemon dies before ``revert`` runs.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class Operation(Protocol):
    name: str

    def available(self) -> tuple[bool, str]:
        """(True, "") if ``apply`` can work here, else (False, why not)."""
        ...

    def apply(self) -> None: ...

    def revert(self) -> None: ...

    def undo_records(self) -> list[dict]:
        """Instructions the guardian replays to undo this op (see undo.py)."""
        ...


class NoOp:
    """An operation that does nothing (a placeholder for a skipped step)."""

    def __init__(self, name: str, backend: str = "off") -> None:
        self.name = name
        self.backend = backend

    def available(self) -> tuple[bool, str]:
        return True, ""

    def apply(self) -> None:
        pass

    def revert(self) -> None:
        pass

    def undo_records(self) -> list[dict]:
        return []
