"""The wire protocol: framing, validation, access control and fuzzing a live daemon."""

import json
import os
import random
import socket
import stat
import struct
import subprocess

import pytest
from helpers import PY

from krex.errors import AccessDenied, BadRequest, KrexError, UnknownJob, from_wire, to_wire
from krex.protocol import messages as m
from krex.protocol.framing import MAX_FRAME, encode_frame


def raw_conn(daemon):
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(5)
    s.connect(daemon.socket)
    return s


def send(s, obj):
    s.sendall(encode_frame(obj))


def recv(s):
    head = _exact(s, 4)
    if head is None:
        return None
    (n,) = struct.unpack(">I", head)
    return json.loads(_exact(s, n))


def _exact(s, n):
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


def hello(s):
    send(s, {"type": "hello", "version": m.VERSION, "id": 1})
    assert recv(s)["type"] == "ok"


def test_messages_round_trip_and_validate():
    msg = m.parse_message({"type": "acquire", "job_id": 3, "max_hold_s": 2, "id": 9})
    assert msg == m.Acquire(job_id=3, max_hold_s=2.0, id=9)
    assert m.parse_message(msg.to_dict()) == msg
    for bad, code in [({"type": "nope"}, "unknown_message"), ({}, "protocol"),
                      ({"type": "acquire"}, "bad_request"),
                      ({"type": "acquire", "job_id": "1"}, "bad_request"),
                      ({"type": "acquire", "job_id": 1, "extra": 0}, "bad_request")]:
        with pytest.raises(KrexError) as info:
            m.parse_message(bad)
        assert info.value.code == code


def test_errors_survive_the_wire_and_pickle():
    import pickle

    err = AccessDenied("no", pid=12, device="cpu")
    back = from_wire(json.loads(json.dumps(to_wire(err))))
    assert type(back) is AccessDenied and back.pid == 12 and back.device == "cpu"
    again = pickle.loads(pickle.dumps(err))
    assert type(again) is AccessDenied and again.pid == 12 and again.hint == err.hint


def test_oversized_frame_is_refused_on_encode():
    with pytest.raises(KrexError):
        encode_frame({"type": "status", "pad": "x" * (MAX_FRAME + 1)})


def test_socket_and_directory_are_owner_only(daemon):
    assert stat.S_IMODE(os.stat(daemon.socket).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(daemon.runtime_dir).st_mode) == 0o700


def test_handshake_errors(daemon):
    s = raw_conn(daemon)
    send(s, {"type": "status", "id": 1})
    assert recv(s)["code"] == "protocol"  # hello must come first
    send(s, {"type": "hello", "version": 999, "id": 2})
    reply = recv(s)
    assert reply["code"] == "version_mismatch" and reply["re"] == 2
    assert recv(s) is None  # then the daemon closes
    s.close()


@pytest.mark.parametrize("payload,code", [
    (b"\x00\x00\x00\x05hello", "protocol"),  # not JSON
    (b"\x00\x00\x00\x02[]", "protocol"),  # not an object
    (encode_frame({"type": "teleport", "id": 4}), "unknown_message"),
    (encode_frame({"type": "acquire", "job_id": "x", "id": 5}), "bad_request"),
    (encode_frame({"type": "release", "region": 424242, "id": 6}), "unknown_region"),
    (encode_frame({"type": "acquire", "job_id": 424242, "id": 7}), "unknown_job"),
    (encode_frame({"type": "create_job", "mode": "sideways", "id": 8}), "bad_request"),
    (encode_frame({"type": "create_job", "device": "tpu:0", "id": 9}), "unknown_device"),
])
def test_every_bad_request_gets_a_specific_error(daemon, payload, code):
    s = raw_conn(daemon)
    hello(s)
    s.sendall(payload)
    assert recv(s)["code"] == code
    send(s, {"type": "status", "id": 10})  # and the connection still works
    assert recv(s)["type"] == "ok"
    s.close()


def test_oversized_frame_gets_error_then_close(daemon):
    s = raw_conn(daemon)
    hello(s)
    s.sendall(struct.pack(">I", MAX_FRAME + 1))
    assert recv(s)["code"] == "frame_too_large"
    assert recv(s) is None
    s.close()


def test_cannot_act_for_other_processes(daemon):
    with daemon.client() as c:
        job = c.create_job(device="cpu", name="mine", mode="command")["job_id"]
        with pytest.raises(AccessDenied):
            c.attach_job(job, 1)  # init is nobody's descendant
        with pytest.raises(UnknownJob):
            c.acquire(999999)
        # A member that is not the job's owner may not hold the device for the whole job.
        code = (
            "import sys; from krex.client.connection import Client\n"
            "c = Client(sys.argv[1], autostart=False)\n"
            "c.register(int(sys.argv[2]))\n"
            "try:\n c.acquire(int(sys.argv[2]), whole_job=True); print('granted')\n"
            "except Exception as e:\n print(type(e).__name__)\n"
        )
        out = subprocess.run([PY, "-c", code, daemon.socket, str(job)], capture_output=True,
                             text=True, timeout=30)
        assert out.stdout.strip() == "AccessDenied", out.stderr


def test_unrelated_process_is_refused(daemon):
    """A process that is not part of the job (nor below its owner) cannot use it."""
    with daemon.client() as c:
        job = c.create_job(device="cpu", name="mine", mode="region")["job_id"]
    # Re-parent a process to init by double fork, so it is not our descendant.
    code = (
        "import os, sys, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    from krex.client.connection import Client\n"
        "    c = Client(sys.argv[1], autostart=False)\n"
        "    try:\n        c.acquire(int(sys.argv[2])); r = 'granted'\n"
        "    except Exception as e:\n        r = type(e).__name__\n"
        "    open(sys.argv[3], 'w').write(r)\n"
        "    os._exit(0)\n"
    )
    import tempfile
    import time

    out = tempfile.mktemp()
    subprocess.run([PY, "-c", code, daemon.socket, str(job), out], timeout=30, check=True)
    deadline = time.monotonic() + 20
    while not os.path.exists(out) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.1)
    assert open(out).read() in ("AccessDenied", "UnknownJob")
    os.unlink(out)


def test_bad_arguments_are_rejected(daemon):
    with daemon.client() as c:
        job = c.register()["job_id"]
        with pytest.raises(BadRequest):
            c.acquire(job, max_hold_s=-1)


def test_fuzzing_never_stops_the_daemon(daemon):
    rng = random.Random(1234)
    outcomes = {"error": 0, "closed": 0}
    for i in range(150):
        s = raw_conn(daemon)
        try:
            if i % 3:
                hello(s)
            s.sendall(_garbage(rng))
            s.shutdown(socket.SHUT_WR)
            reply = recv(s)
            outcomes["error" if reply and reply.get("type") == "error" else "closed"] += 1
            assert reply is None or reply["type"] in ("error", "ok")
        except (ConnectionResetError, BrokenPipeError):
            outcomes["closed"] += 1
        finally:
            s.close()
    assert outcomes["error"] > 50
    with daemon.client() as c:  # a well-formed client is served
        job = c.register()["job_id"]
        rid = c.acquire(job)["region"]
        assert c.release(rid)["report"]["region"] == rid


def _garbage(rng):
    kind = rng.randrange(5)
    if kind == 0:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
    if kind == 1:
        body = bytes(rng.randrange(256) for _ in range(rng.randrange(0, 32)))
        return struct.pack(">I", len(body)) + body
    if kind == 2:
        return struct.pack(">I", rng.randrange(MAX_FRAME, 1 << 32))
    if kind == 3:
        t = rng.choice(["acquire", "release", "attach_job", "end_job", "regions", "x", 5, None])
        obj = {"type": t, "job_id": rng.choice([1, -1, "a", None, 2**70]), "id": rng.randrange(9)}
        return encode_frame(obj)
    body = json.dumps({"type": "hello", "version": rng.randrange(3)}).encode()
    return struct.pack(">I", len(body) + rng.randrange(0, 3)) + body
