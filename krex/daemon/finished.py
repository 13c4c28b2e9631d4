"""Finished regions, kept compactly: what the ``regions`` request pages through.

In: each finished region's short record (``RegionReport.record()``, a dict of a
few hundred bytes as JSON but ≈ 2 KB as a Python dict).  Out: pages of those
records, newest first within a page, older pages by the ``before`` cursor.

A daemon under load finishes hundreds of regions a minute; kept as dicts, a
ring of 20 000 grew the daemon by ≈ 0.8 MiB/min for the best part of an hour
before its bound (``benchmarks/bench_service_load.py``).  Here a record is
serialised once, to JSON bytes, when it arrives; every :data:`BLOCK` records
are compressed together (similar records compress well), with their sequence
numbers, uids and job ids kept beside them in arrays so that a page is chosen
without decompressing what it skips: ≈ 63 B a region in all, measured with real
records.  The ring keeps the newest ``max_records`` (rounded up to whole blocks):
≈ 1.3 MiB at 20 000 (``tests/test_service_memory.py``).
The full report stays in the event log.
"""

from __future__ import annotations

import bisect
import json
import zlib
from array import array
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

BLOCK = 256  # records compressed together
NO_JOB = -1  # job id of a record that names none


def _encode(rec: dict[str, Any]) -> bytes:
    return json.dumps(rec, separators=(",", ":"), default=str).encode()


@dataclass
class _Block:
    """``BLOCK`` records: their keys in arrays, their JSON compressed as one list."""

    seqs: array[int]
    uids: array[int]
    job_ids: array[int]
    sizes: array[int]
    blob: bytes

    def records(self) -> list[bytes]:
        data = zlib.decompress(self.blob)
        out, at = [], 0
        for n in self.sizes:
            out.append(data[at:at + n])
            at += n
        return out


class FinishedRegions:
    """The newest finished regions' records, in order of arrival (their ``seq``)."""

    def __init__(self, max_records: int = 20000) -> None:
        self.max_blocks = max(1, -(-max_records // BLOCK))
        self._blocks: deque[_Block] = deque()
        self._open: list[tuple[int, int, int, bytes]] = []  # not yet compressed

    def append(self, row: tuple[int, int, dict[str, Any]]) -> None:
        """Keep ``(seq, uid, record)``; seqs must grow."""
        seq, uid, rec = row
        job_id = rec.get("job_id")
        self._open.append((seq, uid, job_id if isinstance(job_id, int) else NO_JOB,
                           _encode(rec)))
        if len(self._open) >= BLOCK:
            self._seal()

    def _seal(self) -> None:
        rows = self._open
        self._open = []
        self._blocks.append(_Block(array("q", (r[0] for r in rows)),
                                   array("q", (r[1] for r in rows)),
                                   array("q", (r[2] for r in rows)),
                                   array("l", (len(r[3]) for r in rows)),
                                   zlib.compress(b"".join(r[3] for r in rows), 6)))
        while len(self._blocks) > self.max_blocks:
            self._blocks.popleft()

    def __len__(self) -> int:
        return sum(len(b.seqs) for b in self._blocks) + len(self._open)

    def nbytes(self) -> int:
        """What the kept records take, roughly (arrays and compressed or encoded JSON)."""
        per_block = sum(len(b.blob) + 4 * len(b.seqs) * 8 for b in self._blocks)
        return per_block + sum(len(r[3]) + 100 for r in self._open)

    def newest(self, before: int | None = None) -> Iterator[tuple[int, int, int, bytes]]:
        """``(seq, uid, job_id, json)`` newest first, of records with seq < ``before``."""
        for seq, uid, job_id, raw in reversed(self._open):
            if before is None or seq < before:
                yield seq, uid, job_id, raw
        for block in reversed(self._blocks):
            end = bisect.bisect_left(block.seqs, before) if before else len(block.seqs)
            if end == 0:
                continue
            raws = block.records()
            for i in range(end - 1, -1, -1):
                yield block.seqs[i], block.uids[i], block.job_ids[i], raws[i]

    def page(self, visible: Callable[[int], bool], job_ids: list[int] | None, limit: int,
             before: int | None, max_bytes: int) -> tuple[list[dict[str, Any]], int | None]:
        """The newest ``limit`` records (in order) older than ``before`` whose uid is
        ``visible``, within ``max_bytes`` of JSON, and the next page's cursor (None: no
        more)."""
        wanted = set(job_ids) if job_ids is not None else None
        out: list[tuple[int, bytes]] = []
        size = 0
        for seq, uid, job_id, raw in self.newest(before):
            if (wanted is not None and job_id not in wanted) or not visible(uid):
                continue
            if len(out) >= limit or size > max_bytes:
                return _decoded(out), out[-1][0] if out else seq + 1
            out.append((seq, raw))
            size += len(raw)
        return _decoded(out), None


def _decoded(rows: list[tuple[int, bytes]]) -> list[dict[str, Any]]:
    return [json.loads(raw) for _, raw in reversed(rows)]
