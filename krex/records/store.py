"""The SQLite store: schema, writes, look-ups, exports."""

from __future__ import annotations

import csv
import io
import json
import os
import sqlite3
from collections.abc import Iterator
from typing import Any

from krex.errors import RecordsError

SCHEMA_VERSION = 2  # 2: evaluations.tenant (1 is migrated on open)
BUSY_TIMEOUT_S = 30.0

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS evaluations (
    id TEXT PRIMARY KEY,
    created_at TEXT NOT NULL,
    request_key TEXT NOT NULL,
    device TEXT NOT NULL,
    status TEXT NOT NULL,
    verdict TEXT NOT NULL,
    correct INTEGER,
    speedup REAL,
    ci_low REAL,
    ci_high REAL,
    reference TEXT NOT NULL,
    candidate TEXT NOT NULL,
    inputs TEXT NOT NULL,
    reference_sha256 TEXT,
    candidate_sha256 TEXT,
    inputs_sha256 TEXT,
    krex_version TEXT,
    findings TEXT NOT NULL,
    record TEXT NOT NULL,
    tenant TEXT
);
CREATE INDEX IF NOT EXISTS evaluations_key ON evaluations (request_key, created_at);
CREATE INDEX IF NOT EXISTS evaluations_time ON evaluations (created_at);
CREATE TABLE IF NOT EXISTS regions (
    evaluation_id TEXT NOT NULL REFERENCES evaluations (id),
    attempt INTEGER NOT NULL,
    accepted INTEGER NOT NULL,
    report TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS regions_evaluation ON regions (evaluation_id);
"""

# The flat columns of a listing and of the CSV export, in order.
COLUMNS = ("id", "created_at", "device", "status", "verdict", "correct", "speedup", "ci_low",
           "ci_high", "reference", "candidate", "inputs", "candidate_sha256", "findings")


def default_path() -> str:
    explicit = os.environ.get("KREX_RECORDS_DB")
    if explicit:
        return explicit
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local",
                                                             "share")
    return os.path.join(base, "krex", "records.sqlite3")


class RecordStore:
    """One SQLite file of evaluations; open per use (``with RecordStore() as store``)."""

    def __init__(self, path: str | None = None) -> None:
        self.path = path or default_path()
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        try:
            self.db = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S)
            self.db.execute("PRAGMA journal_mode=WAL")
            self._migrate()
        except sqlite3.DatabaseError as exc:
            raise RecordsError(f"cannot use the records database {self.path}: {exc}") from None
        self.db.row_factory = sqlite3.Row

    def _migrate(self) -> None:
        with self.db:
            self.db.executescript(_SCHEMA)
            row = self.db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
            if row is None:
                self.db.execute("INSERT OR IGNORE INTO meta VALUES ('schema_version', ?)",
                                (str(SCHEMA_VERSION),))
                return
            if int(row[0]) == 1:  # records before tenants: whose they were is not known
                self.db.execute("ALTER TABLE evaluations ADD COLUMN tenant TEXT")
                self.db.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'",
                                (str(SCHEMA_VERSION),))
                return
        if int(row[0]) != SCHEMA_VERSION:
            raise RecordsError(f"{self.path} has records schema {row[0]}, this krex reads "
                               f"{SCHEMA_VERSION}")

    # -- writes ----------------------------------------------------------------------

    def save(self, record: dict[str, Any]) -> None:
        """Store one evaluation (``Evaluation.to_dict()``) and its region reports."""
        timing = record.get("timing") or {}
        row = (record["id"], record["created_at"], record["request_key"], record["device"],
               record["status"], record["verdict"], _bool(record.get("correct")),
               record.get("speedup"), record.get("ci_low"), record.get("ci_high"),
               _spec_text(record.get("reference")), _spec_text(record.get("candidate")),
               _spec_text(record.get("inputs")), (record.get("reference") or {}).get("sha256"),
               (record.get("candidate") or {}).get("sha256"),
               (record.get("inputs") or {}).get("sha256"),
               (record.get("provenance") or {}).get("krex_version"),
               json.dumps([f["code"] for f in record.get("findings", [])]),
               json.dumps(record, default=str), record.get("tenant"))
        regions = [(record["id"], i, 0, json.dumps(r, default=str))
                   for i, r in enumerate(timing.get("rejected_regions") or [])]
        if timing.get("region"):
            regions.append((record["id"], len(regions), 1, json.dumps(timing["region"],
                                                                     default=str)))
        with self.db:
            self.db.execute(f"INSERT INTO evaluations VALUES ({','.join('?' * len(row))})", row)
            self.db.executemany("INSERT INTO regions VALUES (?, ?, ?, ?)", regions)

    def prune(self, max_bytes: int) -> int:
        """The oldest evaluations (and their regions) deleted, a tenth at a time, until the
        pages in use fit ``max_bytes``; how many went."""
        gone = 0
        while used_bytes(self.db) > max_bytes:
            n = self.count()
            if not n:
                break
            batch = max(1, n // 10)
            with self.db:
                old = "SELECT id FROM evaluations ORDER BY created_at LIMIT ?"
                self.db.execute(f"DELETE FROM regions WHERE evaluation_id IN ({old})", (batch,))
                self.db.execute(f"DELETE FROM evaluations WHERE id IN ({old})", (batch,))
            gone += batch
        return gone

    # -- reads -----------------------------------------------------------------------

    def get(self, evaluation_id: str, tenant: str | None = None) -> dict[str, Any] | None:
        """One record by id (a unique prefix of at least 6 characters works too); with
        ``tenant``, only one of that tenant's."""
        where, params = _of(tenant)
        rows = self.db.execute("SELECT record FROM evaluations WHERE (id = ? OR "
                               f"(length(?) >= 6 AND id LIKE ? || '%')){where} LIMIT 2",
                               (evaluation_id, evaluation_id, evaluation_id, *params)).fetchall()
        if len(rows) != 1:
            return None
        return dict(json.loads(rows[0]["record"]))

    def latest_for(self, request_key: str, tenant: str | None = None) -> dict[str, Any] | None:
        """The newest record of ``request_key``: of ``tenant``'s own, or (None) of
        records made for no tenant (a local run): never another tenant's."""
        row = self.db.execute("SELECT record FROM evaluations WHERE request_key = ? AND "
                              "tenant IS ? ORDER BY created_at DESC LIMIT 1",
                              (request_key, tenant)).fetchone()
        return None if row is None else dict(json.loads(row["record"]))

    def regions(self, evaluation_id: str) -> list[dict[str, Any]]:
        rows = self.db.execute("SELECT attempt, accepted, report FROM regions WHERE "
                               "evaluation_id = ? ORDER BY attempt", (evaluation_id,)).fetchall()
        return [{"attempt": r["attempt"], "accepted": bool(r["accepted"]),
                 "report": json.loads(r["report"])} for r in rows]

    def rows(self, limit: int | None = None, tenant: str | None = None) -> list[dict[str, Any]]:
        """Flat rows (``COLUMNS``), newest first; with ``tenant``, only its own."""
        where, params = _of(tenant)
        sql = f"SELECT {', '.join(COLUMNS)} FROM evaluations WHERE 1{where} " \
              "ORDER BY created_at DESC"
        if limit is not None:
            sql += " LIMIT ?"
            params = (*params, limit)
        return [_row(r) for r in self.db.execute(sql, params)]

    def records(self) -> Iterator[dict[str, Any]]:
        """Every full record, oldest first."""
        for row in self.db.execute("SELECT record FROM evaluations ORDER BY created_at"):
            yield json.loads(row["record"])

    def count(self) -> int:
        return int(self.db.execute("SELECT count(*) FROM evaluations").fetchone()[0])

    # -- exports ---------------------------------------------------------------------

    def export_jsonl(self, out: io.TextIOBase | Any) -> int:
        n = 0
        for record in self.records():
            out.write(json.dumps(record, default=str) + "\n")
            n += 1
        return n

    def export_csv(self, out: io.TextIOBase | Any) -> int:
        writer = csv.DictWriter(out, fieldnames=list(COLUMNS))
        writer.writeheader()
        rows = list(reversed(self.rows()))
        for row in rows:
            writer.writerow({**row, "findings": " ".join(row["findings"])})
        return len(rows)

    def close(self) -> None:
        self.db.close()

    def __enter__(self) -> RecordStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def used_bytes(db: sqlite3.Connection) -> int:
    """Bytes of a SQLite database's pages in use (its free pages are reused before the file
    grows): what a byte budget bounds."""
    pages = db.execute("PRAGMA page_count").fetchone()[0]
    free = db.execute("PRAGMA freelist_count").fetchone()[0]
    return int((pages - free) * db.execute("PRAGMA page_size").fetchone()[0])


def _of(tenant: str | None) -> tuple[str, tuple[Any, ...]]:
    """The condition that keeps ``tenant``'s records (None: every record)."""
    return ("", ()) if tenant is None else (" AND tenant = ?", (tenant,))


def _bool(value: Any) -> int | None:
    return None if value is None else int(bool(value))


def _spec_text(spec: dict[str, str] | None) -> str:
    if not spec:
        return ""
    return f"{spec.get('path', '')}:{spec.get('name', '')}"


def _row(r: sqlite3.Row) -> dict[str, Any]:
    out = dict(r)
    out["correct"] = None if out["correct"] is None else bool(out["correct"])
    out["findings"] = json.loads(out["findings"])
    return out
