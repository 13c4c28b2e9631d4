"""SKILL.md is what an agent follows: every field it tells the agent to read exists, in the
CLI's ``--json``, in the service's answers (HTTP and MCP share them) and in the exports.

The fields are read from SKILL.md itself (backticked snake_case words in the sections
tests/skill_fields.py names, minus the values they take), so a field named there
later, or renamed in the code, fails here until both agree.  The outputs are the real
producers' on a built evaluation, a bench run in-process (scripted regions) and an
exec result.
"""

from __future__ import annotations

import io
import json
import sys

import pytest
from helpers import PY
from skill_fields import (
    BENCH_FIELDS,
    EVALUATE_FIELDS,
    EXEC_FIELDS,
    FIELD,
    FINDING_FIELDS,
    REQUEST_OPTIONS,
    SKILL,
    keys_of,
)

from krex.evaluate.findings import Code, Finding
from krex.evaluate.result import Evaluation
from krex.measure import ScriptedRegions, bench_command
from krex.measure.command import relative_speed


def test_the_sections_name_the_fields_agents_read():
    """The extraction itself (so that an empty set cannot pass the tests below)."""
    assert {"verdict", "findings", "code", "severity", "next_action", "region_clean",
            "speedup", "ci_low", "ci_high", "record_id", "reused", "pooled_pairs",
            "extends"} == EVALUATE_FIELDS
    assert {"code", "severity", "next_action"} == FINDING_FIELDS
    assert {"p50_ms", "p95_ms", "noise_rel"} == BENCH_FIELDS
    assert {"state", "outcome"} == EXEC_FIELDS
    assert REQUEST_OPTIONS <= set(FIELD.findall(SKILL))


def evaluation() -> dict:
    ev = Evaluation(
        id="ev-1", created_at="2026-01-01T00:00:00Z", request_key="k", device="cpu",
        status="ok", verdict="unclear", correct=True, speedup=1.01, ci_low=0.97, ci_high=1.05,
        findings=[Finding(Code.TIMING_UNTRUSTED, "disturbed", {})],
        timing={"pairs": 8, "region": {"clean": False, "region": 3},
                "reference": {"median_ms": 1.0, "p95_ms": 1.1, "noise_rel": 0.01},
                "candidate": {"median_ms": 0.99, "p95_ms": 1.0, "noise_rel": 0.02}})
    return ev.to_dict()


def test_evaluate_answers_have_every_field_skill_md_names():
    from krex.cli.evaluate_cmds import json_of

    cli = json_of(evaluation())
    assert EVALUATE_FIELDS <= keys_of(cli), EVALUATE_FIELDS - keys_of(cli)
    assert cli["record_id"] == "ev-1" and cli["region_clean"] is False  # what they mean
    pytest.importorskip("fastapi", reason="the `server` extra is not installed")
    from krex.service import schemas, summary

    service = summary.evaluation(evaluation())  # HTTP's job result and MCP's tool answer
    assert EVALUATE_FIELDS <= keys_of(service), EVALUATE_FIELDS - keys_of(service)
    assert service["record_id"] == "ev-1" and service["region_clean"] is False
    assert REQUEST_OPTIONS <= set(schemas.EvaluateBody.model_fields)


def test_bench_answers_have_every_field_skill_md_names(tmp_path):
    from krex.cli.bench_cmds import export_json

    result = bench_command([PY, "-c", "pass"], warmup_runs=0, runs=3, device="cpu",
                           region=ScriptedRegions())
    cli = export_json([result], relative_speed([result]))["results"][0]  # --json, --export-json
    assert BENCH_FIELDS <= set(cli), BENCH_FIELDS - set(cli)
    times_ms = sorted(t * 1e3 for t in result["times_s"])
    assert cli["p50_ms"] == pytest.approx(times_ms[1]) and cli["noise_rel"] >= 0
    pytest.importorskip("fastapi", reason="the `server` extra is not installed")
    from krex.service import summary

    service = summary.bench(result)
    assert BENCH_FIELDS <= set(service), BENCH_FIELDS - set(service)
    assert service["p95_ms"] == cli["p95_ms"]


def test_exec_answers_have_every_field_skill_md_names(monkeypatch):
    from krex.cli import lean

    raised = {"status": "error", "exit_code": 1, "exception": "ZeroDivisionError: division",
              "recycled": False, "recycle_reason": None}
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert lean._report(dict(raised), None, True) == 1
    cli = json.loads(out.getvalue())
    assert cli["outcome"] == "failed"
    pytest.importorskip("fastapi", reason="the `server` extra is not installed")
    from krex.service import summary
    from krex.service.jobs import Job

    result = summary.execution(raised, "", "")
    job = Job("j1", "local", "exec", {}, state="failed", result=result).to_dict()
    answered = set(job) | set(result) | set(cli)
    assert EXEC_FIELDS <= answered, EXEC_FIELDS - answered
    assert result["outcome"] == job["state"] == "failed"
