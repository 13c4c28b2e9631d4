"""records: the embedded store of evaluations and their regions (stdlib ``sqlite3``).

In: :class:`~krex.evaluate.Evaluation` dicts (``Evaluation.to_dict()``).
Out: the same dicts back by id or by request key (the deduplication of
identical requests), listings, and exports to JSONL and CSV.  One schema,
versioned (``SCHEMA_VERSION``; a database of another version is refused
with a hint, never silently rewritten).  The default path is
``$KREX_RECORDS_DB``, else ``$XDG_DATA_HOME/krex/records.sqlite3``
(``~/.local/share/krex/records.sqlite3``).  Safe for many processes at once
(WAL journal, busy timeout).
"""

from krex.records.store import SCHEMA_VERSION, RecordStore, default_path

__all__ = ["SCHEMA_VERSION", "RecordStore", "default_path"]
