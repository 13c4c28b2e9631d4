"""The region report: typed, versioned, ``clean`` derived from outcome and reasons."""

import dataclasses
import json
import os

import pytest
from helpers import CONTENTION, PY, Daemon, run_krex

from krex.protocol.report import (
    REPORT_FORMAT,
    DeviceAudit,
    HostEvidence,
    Outcome,
    Reason,
    ReasonCode,
    RegionReport,
    Step,
)


def full_report(**overrides) -> RegionReport:
    host = HostEvidence(
        steps=[Step("gate_drain", "interposer", True, 0.2, 0.1),
               Step("freeze", "cgroup2", True, 0.5, 0.3, processes=3)],
        siblings_frozen=2, processes_frozen=3, freeze_backend="cgroup2",
        holder_involuntary_switches=4, holder_migrations=0, gated_jobs=2, gate_idle_jobs=[7],
        drain_acks_ms={123: 0.25})
    audit = DeviceAudit("nvml", {"utilization_pct": 3}, {"utilization_pct": 99}, [4242])
    fields = dict(region=9, device="cuda:0", label="k", job_id=3, job="agent", mode="region",
                  waited_s=0.01, held_s=0.5, max_hold_s=60.0, requested_mono_s=10.0,
                  granted_mono_s=10.01, released_mono_s=10.51, requested_wall_s=1.7e9,
                  jobs_served_while_waiting=1, host=host, device_audit=audit)
    fields.update(overrides)
    return RegionReport(**fields)


def test_round_trip_through_json_is_exact():
    report = full_report(reasons=[Reason.mechanism("isolate", "one core", disabled=False)])
    data = json.loads(json.dumps(report.to_dict()))
    assert data["format"] == REPORT_FORMAT and data["outcome"] == "released"
    assert data["host"]["drain_acks_ms"] == {"123": 0.25}
    assert RegionReport.from_dict(data) == report
    # Every field is written, so a field added later cannot be left out of the wire form.
    assert {f.name for f in dataclasses.fields(RegionReport)} <= set(data)
    assert {f.name for f in dataclasses.fields(HostEvidence)} <= set(data["host"])


def test_clean_is_derived_from_outcome_and_reasons():
    assert full_report().clean is True
    # Negative controls: any reason, or any end other than a release, is not clean.
    assert full_report(reasons=[Reason(ReasonCode.STEP_FAILED, "freeze: x")]).clean is False
    assert full_report(outcome=Outcome.OWNER_GONE).clean is False
    assert full_report(outcome=Outcome.NESTED).clean is None  # the outer region judges


def test_a_stored_clean_flag_cannot_disagree():
    data = full_report(reasons=[Reason(ReasonCode.NOT_EXCLUSIVE, "exclusivity: mode none")])
    tampered = {**data.to_dict(), "clean": True}
    assert RegionReport.from_dict(tampered).clean is False


def test_reasons_carry_code_message_and_evidence():
    r = Reason.mechanism("freeze", "disabled by configuration (freeze=off)", disabled=True)
    assert r.code is ReasonCode.MECHANISM_DISABLED and r.code.gap
    assert r.message == "freeze: disabled by configuration (freeze=off)"
    assert r.evidence == {"mechanism": "freeze", "why": "disabled by configuration (freeze=off)"}
    assert not ReasonCode.REVOKED.gap and not ReasonCode.STEP_FAILED.gap
    report = full_report(reasons=[r, Reason(ReasonCode.REVOKED, "held too long")],
                         outcome=Outcome.REVOKED)
    assert report.revoked and report.gaps() == [r]
    assert report.reason(ReasonCode.REVOKED).message == "held too long"
    assert report.why_not_clean() == f"{r.message}; held too long"


def test_bad_documents_are_refused():
    data = full_report().to_dict()
    with pytest.raises(ValueError, match="format"):
        RegionReport.from_dict({**data, "format": 99})
    with pytest.raises(ValueError):
        RegionReport.from_dict({**data, "reasons": [{"code": "no_such", "message": "m"}]})


def test_record_is_the_short_form_of_the_report():
    rec = full_report(reasons=[Reason(ReasonCode.REVOKED, "x")], outcome=Outcome.REVOKED).record()
    assert rec["outcome"] == "revoked" and rec["clean"] is False and rec["reasons"] == ["revoked"]
    assert rec["granted_mono_s"] == 10.01 and "host" not in rec


SHOW = "import json, krex\nwith krex.region() as r: pass\nprint(json.dumps(r.report.to_dict()))"


def _region_report(daemon: Daemon, *run_args: str) -> RegionReport:
    done = run_krex("run", *run_args, "--", PY, "-c", SHOW,
                    env={**os.environ, "KREX_SOCKET": daemon.socket})
    assert done.returncode == 0, done.stderr
    return RegionReport.from_dict(json.loads(done.stdout.splitlines()[-1]))


def test_daemon_reports_say_why_not_clean(runtime_dir):
    d = Daemon(str(runtime_dir), "--freeze", "off", "--no-isolate").start()
    try:
        bare = _region_report(d)
        unmanaged = _region_report(d, "--mode", "none")
    finally:
        d.stop()
    assert bare.clean is False and bare.outcome is Outcome.RELEASED
    assert {r.evidence["mechanism"] for r in bare.reasons} == {"freeze", "isolate"}
    assert {r.code for r in bare.reasons} == {ReasonCode.MECHANISM_DISABLED}
    assert unmanaged.clean is False and unmanaged.mode == "none"
    assert ReasonCode.NOT_EXCLUSIVE in {r.code for r in unmanaged.reasons}


def test_default_daemon_region_is_clean_or_says_why(daemon):
    report = _region_report(daemon)
    assert report.mode == "region" and report.host is not None
    assert report.clean is (not report.reasons)
    # Unmanaged tasks on the holder's cores (a loaded machine: other engineers, a CPU
    # loop beside the suite) are real evidence, judged by tests/test_contention.py;
    # every other reason is only what this machine cannot do.
    gaps = [r for r in report.reasons if r.code.value not in CONTENTION]
    assert all(r.code.gap for r in gaps), report.to_dict()
    # Every mechanism of a cpu region was either applied (a step) or says why not.
    # ("slot": the holder's move out of its device's subtree, a step of freeze/isolate)
    applied = {s.name for s in report.host.steps if s.ok} - {"slot"}
    missing = {r.evidence["mechanism"] for r in gaps}
    assert applied | missing == {"freeze", "isolate"} and not applied & missing
