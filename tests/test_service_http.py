"""``krex service``: the HTTP API through a real server (uvicorn) and a real daemon.

Jobs with idempotency keys, long-poll, cancel, quotas, tokens (stored hashed),
bad bodies (a clear 4xx, and the service keeps serving), the OpenAPI schema,
and loopback-by-default (tokens always: ``tests/test_service_guard.py``).  Requests go
over loopback with the standard library.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request

import pytest
from evaluate_helpers import CPU, spec
from helpers import krex, reap, run_krex, wait_for
from service_support import Service, free_port, regions_by_label
from skill_fields import BENCH_FIELDS, EVALUATE_FIELDS, EXEC_FIELDS, FINDING_FIELDS, keys_of

pytest.importorskip("fastapi", reason="the `server` extra is not installed")
pytest.importorskip("uvicorn", reason="the `server` extra is not installed")


def test_exec_job_idempotent_submit_and_long_poll(service):
    body = {"program": "import sys\nprint('hi', sys.argv[1:])\n", "args": ["a"]}
    key = {"Idempotency-Key": "job-1"}
    status, job = service.call("POST", "/v1/jobs/exec", body, headers=key)
    assert status == 201 and job["state"] in ("queued", "running"), job
    again_status, again = service.call("POST", "/v1/jobs/exec", body, headers=key)
    assert again_status == 200 and again["id"] == job["id"]  # a retry: the same job
    done = service.wait(job["id"])
    assert done["state"] == "succeeded", done
    assert done["result"]["exit_code"] == 0 and "hi ['a']" in done["result"]["stdout"]
    # Negative controls: without a key a submit is a new job; the same key for another
    # request is a conflict, not a silent replay.
    status, other = service.call("POST", "/v1/jobs/exec", body)
    assert status == 201 and other["id"] != job["id"]
    status, err = service.call("POST", "/v1/jobs/exec", {"program": "pass\n"}, headers=key)
    assert status == 409 and err["error"]["code"] == "idempotency_conflict", err
    status, listing = service.call("GET", "/v1/jobs")
    assert status == 200 and {job["id"], other["id"]} <= {j["id"] for j in listing["jobs"]}
    service.wait(other["id"])


def test_exec_job_state_says_what_the_program_did(service):
    """``succeeded`` means the program exited 0: a raise, an exit 3, a timeout and a
    crash each end in a state of their own (agents read ``state``)."""
    programs = {"succeeded": {"program": "print('fine')\n"},
                "failed": {"program": "1 / 0\n"},
                "timed_out": {"program": "import time\ntime.sleep(30)\n", "timeout_s": 1},
                "crashed": {"program": "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n"}}
    exit3 = {"program": "import sys\nsys.exit(3)\n"}
    jobs = {want: service.call("POST", "/v1/jobs/exec", body)[1]["id"]
            for want, body in programs.items()}
    for want, job_id in jobs.items():
        done = service.wait(job_id)
        assert done["state"] == want and done["result"]["outcome"] == want, done
        assert EXEC_FIELDS <= set(done) | set(done["result"])  # SKILL.md's
    done = service.wait(service.call("POST", "/v1/jobs/exec", exit3)[1]["id"])
    assert done["state"] == "failed" and done["result"]["exit_code"] == 3, done
    status, listing = service.call("GET", "/v1/jobs?state=timed_out")
    assert status == 200 and [j["id"] for j in listing["jobs"]] == [jobs["timed_out"]], listing


def test_long_poll_waits_for_the_job_and_no_longer(service):
    status, job = service.call("POST", "/v1/jobs/exec",
                               {"program": "import time\ntime.sleep(1.5)\n"})
    assert status == 201
    t = time.monotonic()
    early = service.wait(job["id"], wait_s=0.2)
    assert early["state"] in ("queued", "running") and time.monotonic() - t < 1.4
    done = service.wait(job["id"], wait_s=30)
    assert done["state"] == "succeeded" and time.monotonic() - t >= 1.0, done
    status, err = service.call("GET", f"/v1/jobs/{job['id']}?wait_s=100000")
    assert status == 422  # longer than the service's longest poll


def test_cancel_a_queued_and_a_running_job(daemon, tmp_path):
    """Cancel stops a running program (its worker is killed with what the program started,
    and replaced); a queued job never runs; the job next to it (negative control) runs on."""
    import psutil

    s = Service(tmp_path / "state", "--runners", "2")
    try:
        pids, flag = tmp_path / "pids", tmp_path / "go"
        forever = {"program": "import os, subprocess, sys, time\n"
                              "child = subprocess.Popen(['sleep', '600'])\n"
                              f"open({str(pids)!r}, 'w').write(f'{{os.getpid()}} {{child.pid}}')\n"
                              "while True:\n    time.sleep(0.05)\n"}
        waits = {"program": f"import os, time\nwhile not os.path.exists({str(flag)!r}):\n"
                            "    time.sleep(0.02)\nprint('done')\n"}
        _, running = s.call("POST", "/v1/jobs/exec", forever)
        _, neighbour = s.call("POST", "/v1/jobs/exec", waits)
        wait_for(lambda: pids.exists() and len(pids.read_text().split()) == 2, timeout_s=60)
        worker, child = (int(x) for x in pids.read_text().split())
        _, queued = s.call("POST", "/v1/jobs/exec", {"program": "print('never')\n"})
        status, cancelled = s.call("POST", f"/v1/jobs/{queued['id']}/cancel")
        assert status == 200 and cancelled["state"] == "cancelled"
        status, marked = s.call("POST", f"/v1/jobs/{running['id']}/cancel")
        assert status == 200 and marked["cancel_requested"], marked
        ended = s.wait(running["id"])
        assert ended["state"] == "cancelled", ended
        assert ended["result"]["recycled"] and "discarded" in ended["result"], ended
        for pid in (worker, child):  # nothing of the program is left running or stopped
            assert not psutil.pid_exists(pid) or \
                psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, pid
        assert s.wait(queued["id"], wait_s=0)["result"] is None  # it never ran
        assert s.wait(neighbour["id"], wait_s=0)["state"] == "running"  # untouched
        flag.touch()
        done = s.wait(neighbour["id"])
        assert done["state"] == "succeeded" and "done" in done["result"]["stdout"], done
        _, after = s.call("POST", "/v1/jobs/exec", {"program": "print('next')\n"})
        assert s.wait(after["id"])["result"]["stdout"] == "next\n"  # the pool serves on
        status, err = s.call("POST", "/v1/jobs/nosuchjob/cancel")
        assert status == 404 and err["error"]["code"] == "job_not_found"
    finally:
        s.stop()


def test_tokens_are_stored_hashed_and_checked(daemon, tmp_path):
    state = tmp_path / "state"
    out = run_krex("service", "token", "add", "agent-7", "--state-dir", str(state),
                   "--max-active-jobs", "1")
    assert out.returncode == 0, out.stderr
    token = out.stdout.strip()
    stored = (state / "tokens.json").read_text()
    assert token.startswith("krex_") and token not in stored and "token_sha256" in stored
    assert oct(os.stat(state / "tokens.json").st_mode & 0o777) == "0o600"
    s = Service(state, "--runners", "1")
    try:
        status, err = s.call("GET", "/v1/jobs", token=False)
        assert status == 401 and err["error"]["code"] == "unauthorized"
        status, err = s.call("GET", "/v1/jobs", headers={"Authorization": "Bearer krex_wrong"})
        assert status == 401
        auth = {"Authorization": f"Bearer {token}"}
        status, listing = s.call("GET", "/v1/jobs", headers=auth)
        assert status == 200 and listing == {"jobs": [], "next": None}
        # Quota: one active job for this tenant; the second submit is refused with 429.
        flag = tmp_path / "go"
        slow = {"program": f"import os, time\nwhile not os.path.exists({str(flag)!r}):\n"
                           "    time.sleep(0.02)\n"}
        status, job = s.call("POST", "/v1/jobs/exec", slow, headers=auth)
        assert status == 201 and job["tenant"] == "agent-7"
        status, err = s.call("POST", "/v1/jobs/exec", {"program": "pass\n"}, headers=auth)
        assert status == 429 and err["error"]["code"] == "service_quota_exceeded", err
        assert "quota 1" in err["error"]["what"] and err["error"]["hint"]
        flag.touch()
        assert s.wait(job["id"], headers=auth)["state"] == "succeeded"
        status, _ = s.call("POST", "/v1/jobs/exec", {"program": "pass\n"}, headers=auth)
        assert status == 201  # negative control: below the quota again, accepted
    finally:
        s.stop()
    out = run_krex("service", "token", "list", "--state-dir", str(state))
    assert "agent-7" in out.stdout and token not in out.stdout


def test_tenants_see_only_their_own_jobs(daemon, tmp_path):
    state = tmp_path / "state"
    token = run_krex("service", "token", "add", "other", "--state-dir",
                     str(state)).stdout.strip()
    s = Service(state, "--runners", "1")
    try:
        _, mine = s.call("POST", "/v1/jobs/exec", {"program": "pass\n"})
        assert mine["tenant"] == "local"  # the service's own token
        auth = {"Authorization": f"Bearer {token}"}
        status, err = s.call("GET", f"/v1/jobs/{mine['id']}", headers=auth)
        assert status == 404 and err["error"]["code"] == "job_not_found"
        assert s.wait(mine["id"])["tenant"] == "local"
        # The same idempotency key is per tenant.
        key = {"Idempotency-Key": "same"}
        _, a = s.call("POST", "/v1/jobs/exec", {"program": "pass\n"}, headers=key)
        _, b = s.call("POST", "/v1/jobs/exec", {"program": "pass\n"}, headers={**key, **auth})
        assert a["id"] != b["id"] and b["tenant"] == "other"
        s.wait(a["id"])
        s.wait(b["id"], headers=auth)
        # Listing pages through the tenant's jobs, newest first, by the `next` cursor.
        _, page1 = s.call("GET", "/v1/jobs?limit=1")
        assert [j["id"] for j in page1["jobs"]] == [a["id"]] and page1["next"] == a["id"]
        _, page2 = s.call("GET", f"/v1/jobs?limit=1&before={page1['next']}")
        assert [j["id"] for j in page2["jobs"]] == [mine["id"]] and page2["next"] is None
        status, err = s.call("GET", f"/v1/jobs?before={b['id']}")  # the other tenant's
        assert status == 404 and err["error"]["code"] == "job_not_found", err
    finally:
        s.stop()


@pytest.mark.parametrize("raw, status, code", [
    (b'{"program": "pass\\n"', 400, "malformed_json"),
    (b'["program"]', 422, "invalid_request"),
    (json.dumps({"program": "pass\n", "timeout_s": "5"}).encode(), 422, "invalid_request"),
    (json.dumps({"program": "pass\n", "nosuchfield": 1}).encode(), 422, "invalid_request"),
    (json.dumps({"program": "pass\n", "path": "/x.py"}).encode(), 422, "invalid_request"),
    (json.dumps({"program": "pass\n", "device": "gpu0; rm -rf /"}).encode(), 422,
     "invalid_request"),
    (json.dumps({"program": "x" * 300_000}).encode(), 413, "body_too_large"),
    (json.dumps({"path": "prog.py"}).encode(), 422, "invalid_request"),  # not the caller's cwd
])
def test_bad_bodies_get_a_clear_4xx_and_the_service_keeps_serving(service, raw, status, code):
    got, err = service.call("POST", "/v1/jobs/exec", raw=raw)
    assert got == status, err
    assert err["error"]["code"] == code and err["error"]["what"], err
    if code == "invalid_request":
        assert err["error"]["fields"] and err["error"]["hint"]
    ok, job = service.call("POST", "/v1/jobs/exec", {"program": "pass\n"})
    assert ok == 201 and service.wait(job["id"])["state"] == "succeeded"


def test_evaluate_with_a_relative_path_is_refused_at_submission(service, tmp_path):
    """The service's working directory is not the caller's: a relative node path is a 422
    that says so, not a 201 that fails later."""
    ref = tmp_path / "ref.py"
    ref.write_text("def fn(x):\n    return x\n")
    body = {"reference": "ref.py:fn", "candidate": f"{ref}:fn", "inputs": f"{ref}:fn"}
    status, err = service.call("POST", "/v1/jobs/evaluate", body)
    assert status == 422 and err["error"]["code"] == "invalid_request", err
    assert "absolute" in json.dumps(err) and "reference" in json.dumps(err), err
    status, err = service.call("POST", "/v1/jobs/evaluate", {**body, "reference": f"{ref}:fn",
                                                            "inputs": "./ref.py:fn"})
    assert status == 422 and "inputs" in json.dumps(err), err


def test_bad_idempotency_key_and_unknown_job(service):
    status, err = service.call("POST", "/v1/jobs/exec", {"program": "pass\n"},
                               headers={"Idempotency-Key": "has spaces"})
    assert status == 400 and "Idempotency-Key" in err["error"]["what"]
    status, err = service.call("GET", "/v1/jobs/nope")
    assert status == 404 and err["error"]["hint"]


def test_openapi_node_status_and_records(service):
    status, schema = service.call("GET", "/openapi.json")
    assert status == 200
    for path in ("/v1/jobs/evaluate", "/v1/jobs/exec", "/v1/jobs/bench", "/v1/jobs",
                 "/v1/jobs/{job_id}", "/v1/jobs/{job_id}/cancel", "/v1/node", "/v1/records",
                 "/v1/records/{record_id}"):
        assert path in schema["paths"], path
    exec_schema = schema["components"]["schemas"]["ExecBody"]
    assert exec_schema["additionalProperties"] is False
    status, node = service.call("GET", "/v1/node")
    assert status == 200 and "devices" in node["daemon"] and "pools" in node["daemon"]
    assert node["service"]["runners"] == 2
    status, records = service.call("GET", "/v1/records")
    assert status == 200 and isinstance(records["records"], list)
    status, err = service.call("GET", "/v1/records/nosuchrecord")
    assert status == 404 and err["error"]["code"] == "record_not_found"


def test_bench_job_times_a_command_in_a_region(service):
    status, job = service.call("POST", "/v1/jobs/bench",
                               {"command": ["true"], "runs": 3, "warmup": 0})
    assert status == 201, job
    done = service.wait(job["id"], wait_s=60)
    assert done["state"] == "succeeded", done
    r = done["result"]
    assert r["runs"] == 3 and r["p50_ms"] > 0 and r["p95_ms"] >= r["p50_ms"]
    assert BENCH_FIELDS <= set(r), BENCH_FIELDS - set(r)  # SKILL.md's
    assert r["region_id"] is not None and r["exit_codes"] == [0, 0, 0]


def test_trust_loopback_needs_a_loopback_listener(tmp_path):
    """On any other address requests from loopback are not told apart: refused at start."""
    out = run_krex("service", "--http", f"0.0.0.0:{free_port()}", "--trust-loopback",
                   "--state-dir", str(tmp_path / "state"), timeout=60)
    assert out.returncode == 1
    assert "--trust-loopback needs a loopback listener" in out.stderr


def _granted(text: str, tenant: str) -> float:
    return _sample(text, "krex_regions_granted_total", tenant)


def _sample(text: str, metric: str, tenant: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(metric + "{") and f'tenant="{tenant}"' in line)


def test_metrics_and_node_summary_attribute_regions_to_tenants(daemon, tmp_path):
    """A region taken by a tenant's exec job counts for that tenant; a region taken
    outside the service (negative control) does not.  The frozen-time histogram sees the
    outside region, which froze a sibling job (tests/test_daemon_core.py: a region with
    nobody to stop says 0)."""
    state = tmp_path / "state"
    token = run_krex("service", "token", "add", "agent-a", "--state-dir",
                     str(state)).stdout.strip()
    s = Service(state, "--runners", "1")
    try:
        def metrics() -> str:
            return s.call("GET", "/metrics")[1]["text"]
        assert _granted(metrics(), "agent-a") == 0
        auth = {"Authorization": f"Bearer {token}"}
        prog = "import krex\nfor _ in range(2):\n    with krex.region(label='svc'):\n        pass\n"
        _, job = s.call("POST", "/v1/jobs/exec", {"program": prog}, headers=auth)
        assert s.wait(job["id"], headers=auth)["state"] == "succeeded"
        sibling = krex("run", "--device", "cpu", "--name", "sibling", "--", "sleep", "60")
        try:
            wait_for(lambda: any(j["name"] == "sibling" for j in daemon.client().jobs()))
            outside = run_krex("region", "--label", "outside", "--", "sleep", "0.2")
        finally:
            reap(sibling)
        assert outside.returncode == 0, outside.stderr
        wait_for(lambda: _granted(metrics(), "agent-a") == 2 and _granted(metrics(), "local"),
                 timeout_s=30, interval_s=0.2)
        text = metrics()
        frozen = "krex_region_frozen_seconds"
        assert _sample(text, frozen + "_count", "agent-a") == 2, text
        assert _sample(text, frozen + "_count", "local") == 1, text
        assert 0.2 <= _sample(text, frozen + "_sum", "local") < 30, text
        assert "krex_worker_pool_size{device=\"cpu\"}" in text
        assert 'krex_service_jobs_total{kind="exec",state="succeeded"} 1.0' in text
        _, summary = s.call("GET", "/v1/node/summary?seconds=300")
        labels = {(b["label"], b["tenant"]) for b in summary["timeline"]}
        assert ("svc", "agent-a") in labels and ("outside", "local") in labels, summary
        assert set(summary["shares"]) == {"agent-a", "local"}
        assert {d["name"] for d in summary["devices"]} >= {"cpu"}
        status, page = s.call("GET", "/")
        assert status == 200 and "/v1/node/summary" in page["text"]
        for fetch in ("<script src", "<link", "@import", "src=\"http", "url(http"):
            assert fetch not in page["text"], fetch  # self-contained: nothing fetched
    finally:
        s.stop()


def test_evaluate_job_answers_verdict_and_stores_a_record(service):
    """The main endpoint: node paths and source text mixed; the record is then readable.
    Negative control: a candidate that computes something else is ``invalid``."""
    fast = {"source": "import numpy as np\n\n\ndef fast(x):\n"
                      "    return x * np.sqrt(x * x + np.float32(1.0))\n", "function": "fast"}
    wrong = {"source": "def wrong(x):\n    return x + 1\n", "function": "wrong"}
    jobs = {}
    for name, cand in (("fast", fast), ("wrong", wrong)):
        status, jobs[name] = service.call("POST", "/v1/jobs/evaluate", {
            "reference": spec(CPU, "kernels.py:reference"), "candidate": cand,
            "inputs": spec(CPU, "inputs.py:make"), "cache": "hot", "seeds": 2})
        assert status == 201, jobs[name]
    ev = service.wait(jobs["fast"]["id"], wait_s=60)
    assert ev["state"] == "succeeded", ev
    r = ev["result"]
    assert r["verdict"] == "faster" and r["correct"] is True and r["ci_low"] > 1.0, r
    top = EVALUATE_FIELDS - FINDING_FIELDS  # SKILL.md's fields
    assert top <= keys_of(r), top - keys_of(r)
    bad = service.wait(jobs["wrong"]["id"], wait_s=60)["result"]
    assert bad["verdict"] == "invalid" and bad["correct"] is False, bad
    assert any(f["code"] and f["next_action"] for f in bad["findings"]), bad
    assert EVALUATE_FIELDS <= keys_of(bad), EVALUATE_FIELDS - keys_of(bad)  # with findings
    status, record = service.call("GET", f"/v1/records/{r['record_id']}")
    assert status == 200 and record["id"] == r["record_id"] and record["verdict"] == "faster"
    status, rows = service.call("GET", "/v1/records?limit=10")
    assert r["record_id"] in {row["id"] for row in rows["records"]}


def test_a_scripted_agent_follows_skill_md_through_the_service(service):
    """SKILL.md's loop, as an agent with no human: evaluate, read the verdict, evaluate
    again (an unclear record gains pairs; a decided one is the answer), read the record,
    bench a command and read its p95."""
    body = {"reference": spec(CPU, "kernels.py:reference"),
            "candidate": spec(CPU, "honest.py:same"), "inputs": spec(CPU, "inputs.py:make"),
            "cache": "hot", "seeds": 2}

    def evaluate(key: str) -> dict:
        status, job = service.call("POST", "/v1/jobs/evaluate", body,
                                   headers={"Idempotency-Key": key})
        assert status == 201, job
        done = service.wait(job["id"], wait_s=60, timeout=90)
        assert done["state"] == "succeeded", done
        return done["result"]

    first = evaluate("agent-1")
    assert first["verdict"] in ("faster", "slower", "same", "unclear"), first
    assert first["correct"] is True and first["pooled_pairs"] == first["pairs"] > 0, first
    again = evaluate("agent-2")  # a new key: a new job for the same request
    if first["verdict"] == "unclear":
        assert not again["reused"] and again["extends"] == first["record_id"], again
        assert again["pooled_pairs"] == first["pooled_pairs"] + again["pairs"], again
    else:
        assert again["reused"] and again["record_id"] == first["record_id"], again
        assert again["verdict"] == first["verdict"] and again["speedup"] == first["speedup"]
    status, record = service.call("GET", f"/v1/records/{again['record_id']}")
    assert status == 200 and record["verdict"] == again["verdict"], record
    status, job = service.call("POST", "/v1/jobs/bench", {"command": ["true"], "runs": 5,
                                                          "warmup": 1})
    assert status == 201, job
    bench = service.wait(job["id"], wait_s=60)
    assert bench["state"] == "succeeded", bench
    r = bench["result"]
    assert 0 < r["p50_ms"] <= r["p95_ms"] and r["noise_rel"] >= 0, r


def _submit_raw(s: Service, body: dict, auth: dict[str, str]) -> tuple[int, dict, dict]:
    """POST /v1/jobs/exec: the status, the body and the headers (names in lower case)."""
    req = urllib.request.Request(s.base + "/v1/jobs/exec", data=json.dumps(body).encode(),
                                 method="POST", headers={"Content-Type": "application/json",
                                                         **auth})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read()), {k.lower(): v for k, v in r.headers.items()}
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), {k.lower(): v for k, v in e.headers.items()}


def test_jobs_run_as_their_tenant_in_the_daemon_and_meet_its_quota(quota_daemon, tmp_path):
    """Two tenants' HTTP jobs: the daemon charges each region to the job's tenant (its fair
    share and quotas apply to it); a tenant over its region-seconds quota gets a failed job
    with `quota_exceeded`, then 429 with Retry-After; the other tenant is not affected."""
    state = tmp_path / "state"
    tokens = {name: run_krex("service", "token", "add", name, "--state-dir",
                             str(state)).stdout.strip() for name in ("alice", "bob")}
    auth = {name: {"Authorization": f"Bearer {t}"} for name, t in tokens.items()}
    s = Service(state, "--runners", "2")

    def region(label: str, hold_s: float = 0.0) -> dict:
        return {"program": f"import krex, time\nwith krex.region(label={label!r}):\n"
                           f"    time.sleep({hold_s})\n"}
    try:
        jobs = {name: s.call("POST", "/v1/jobs/exec", region(f"{name[0]}-short"),
                             headers=auth[name]) for name in ("alice", "bob")}
        for name, (status, job) in jobs.items():
            assert status == 201 and s.wait(job["id"], headers=auth[name])["state"] == \
                "succeeded"
        outside = run_krex("region", "--label", "outside", "--", "true")
        assert outside.returncode == 0, outside.stderr
        seen = regions_by_label()
        assert seen["a-short"] == ["alice"] and seen["b-short"] == ["bob"], seen
        assert seen["outside"] == [f"uid:{os.getuid()}"]  # negative control: a local client
        # alice uses up her 0.5 region-seconds; her next region is refused by the daemon.
        _, long = s.call("POST", "/v1/jobs/exec", region("a-long", 0.7), headers=auth["alice"])
        assert s.wait(long["id"], headers=auth["alice"])["state"] == "succeeded"
        _, over = s.call("POST", "/v1/jobs/exec", region("a-over"), headers=auth["alice"])
        failed = s.wait(over["id"], headers=auth["alice"])
        assert failed["state"] == "failed", failed
        assert failed["error"]["code"] == "quota_exceeded", failed
        assert "quota" in failed["error"]["what"] and failed["error"]["hint"]
        status, err, headers = _submit_raw(s, region("a-again"), auth["alice"])
        assert status == 429 and err["error"]["code"] == "quota_exceeded", err
        assert int(headers["retry-after"]) >= 1 and err["error"]["retry_after_s"] > 0
        assert "alice" in err["error"]["what"] and err["error"]["hint"]
        # bob's budget is his own: accepted and run (negative control).
        status, job, _ = _submit_raw(s, region("b-after"), auth["bob"])
        assert status == 201 and s.wait(job["id"], headers=auth["bob"])["state"] == "succeeded"
        seen = regions_by_label()
        assert seen["a-long"] == ["alice"] and seen["b-after"] == ["bob"]
        assert "a-over" not in seen and "a-again" not in seen
    finally:
        s.stop()


def test_not_clean_reasons_are_read_as_codes_or_objects():
    """A daemon region record lists its reasons as codes (strings); a crash here stopped
    the node watcher and the MCP tool node_status under load."""
    from krex.service.node import _bar, reason_codes

    assert reason_codes({"reasons": ["holder_preempted", {"code": "foreign_task"}]}) == \
        ["holder_preempted", "foreign_task"]
    assert reason_codes({"reasons": None}) == [] == reason_codes({})
    assert _bar({"clean": False, "reasons": ["step_timeout"]}, 0.0)["reasons"] == ["step_timeout"]
