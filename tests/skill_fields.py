"""The fields SKILL.md tells an agent to read, read from SKILL.md itself.

Backticked snake_case words in its sections, minus the values they take (verdicts,
severities, outcomes, tools) and the options the agent sends; :func:`keys_of` gives an
answer's keys the way an agent reading it sees them.  test_skill.py checks the
extraction and the producers; the service tests check their answers against it.
"""

from __future__ import annotations

import os
import re

from krex.protocol.outcome import OUTCOMES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
with open(os.path.join(ROOT, "SKILL.md")) as _f:
    SKILL = _f.read()

# Words SKILL.md puts in backticks that are values (or tools), not fields to read.
VERDICTS = {"faster", "slower", "same", "unclear", "invalid"}
SEVERITIES = {"invalid", "flag", "note"}
TOOLS = {"evaluate", "bench_command", "exec_program", "node_status", "get_record"}
VALUES = VERDICTS | SEVERITIES | set(OUTCOMES) | TOOLS | {"true", "false"}
REQUEST_OPTIONS = {"fresh", "timeout_s"}  # what SKILL.md has the agent send, not read
FIELD = re.compile(r"`([a-z][a-z0-9_]*)(?::[^`]*)?`")


def section(start: str, end: str) -> str:
    begin = SKILL.index(start)
    return SKILL[begin:SKILL.index(end, begin)]


def fields_named(text: str) -> set[str]:
    return {w for w in FIELD.findall(text) if w not in VALUES | REQUEST_OPTIONS}


EVALUATE_FIELDS = fields_named(section("Read the answer in this order", "## Timing your own"))
FINDING_FIELDS = fields_named(section("`findings`: each has", "Do what")) - {"findings"}
BENCH_FIELDS = fields_named(section("- Whole command:", "- In Python"))
EXEC_FIELDS = fields_named(section("its exit code is the", "## When something fails"))


def keys_of(answer: dict) -> set[str]:
    """Its keys, and those SKILL.md says each finding has where it has findings."""
    findings = answer.get("findings") or []
    assert all(FINDING_FIELDS <= set(f) for f in findings), findings
    return set(answer) | (FINDING_FIELDS if findings else set())
