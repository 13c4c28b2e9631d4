"""The error registry: one module, unique codes, every class decodes off the wire."""

import ast
import os
import pickle
import socket
import threading

import pytest
from helpers import REPO, bare_connection

from krex import errors
from krex.errors import (
    AccessDenied,
    EnforcementFailed,
    InternalError,
    KrexError,
    error_class,
    error_codes,
    from_wire,
    to_wire,
)


def test_every_error_class_round_trips_the_wire_and_pickle():
    codes = error_codes()
    assert len(codes) > 20 and codes["error"] is KrexError
    for code, cls in codes.items():
        err = cls("boom", pid=3, device="cpu", region=7, seconds=1.5)
        back = from_wire(to_wire(err))
        assert type(back) is cls and back.code == code
        assert (back.pid, back.device, back.region, back.seconds) == (3, "cpu", 7, 1.5)
        again = pickle.loads(pickle.dumps(err))
        assert type(again) is cls and again.hint == err.hint


def test_unknown_codes_decode_as_the_base_class():
    assert error_class("no_such_code") is KrexError
    assert type(from_wire({"code": "no_such_code", "message": "m"})) is KrexError


def test_a_second_class_with_a_taken_code_is_refused():
    with pytest.raises(TypeError, match="taken by AccessDenied"):
        type("Again", (KrexError,), {"code": "access_denied"})
    with pytest.raises(TypeError, match="its own wire code"):
        type("Inherits", (AccessDenied,), {})
    assert error_codes()["access_denied"] is AccessDenied  # the registry is unchanged


def test_repr_shows_the_fields():
    text = repr(AccessDenied("no", pid=12, device="cpu"))
    hint = repr(AccessDenied.default_hint)
    assert text == f"AccessDenied('no', pid=12, device='cpu', hint={hint})"


def _error_names() -> set[str]:
    return {name for name, value in vars(errors).items()
            if isinstance(value, type) and issubclass(value, KrexError)}


def test_every_error_class_is_defined_in_errors_py():
    """Decoding must not depend on what else is imported: no KrexError subclass elsewhere."""
    names = _error_names()
    elsewhere = []
    for folder, _, files in os.walk(os.path.join(REPO, "krex")):
        for name in files:
            path = os.path.join(folder, name)
            if not name.endswith(".py") or path.endswith(os.path.join("krex", "errors.py")):
                continue
            for node in ast.walk(ast.parse(open(path).read())):
                if isinstance(node, ast.ClassDef):
                    bases = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "")
                             for b in node.bases}
                    if bases & names:
                        elsewhere.append(f"{os.path.relpath(path, REPO)}: {node.name}")
    assert elsewhere == []


def test_the_scan_above_finds_an_error_class_outside_errors_py(tmp_path):
    """Negative control for the scan: a subclass written elsewhere is seen."""
    source = "from krex.errors import KrexError\nclass Stray(KrexError):\n    code = 'x'\n"
    tree = ast.parse(source)
    found = [n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)
             and {b.id for b in n.bases if isinstance(b, ast.Name)} & _error_names()]
    assert found == ["Stray"]


def test_enforcement_failed_carries_host_evidence_off_the_wire():
    err = EnforcementFailed("x")
    assert err.host is None and "host" not in to_wire(err)


def test_a_bug_in_the_daemon_becomes_an_internal_error_and_the_session_survives():
    from krex.daemon.config import DaemonConfig
    from krex.daemon.server import Server, Session
    from krex.enforce.process import ProcessRef
    from krex.protocol.framing import FrameReader
    from krex.protocol.peer import peer_of

    class Buggy:
        def handle(self, session, msg):
            if msg.type == "status":
                raise ZeroDivisionError("a bug")
            return {"fine": True}

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    server = Server(DaemonConfig(runtime_dir="/nonexistent"), daemon=Buggy())
    session = Session(theirs, peer_of(theirs), ProcessRef.of(os.getpid()))
    loop = threading.Thread(target=server._session_loop, args=(session, FrameReader(theirs)))
    loop.start()
    conn = bare_connection(ours, reply_timeout_s=10.0)
    from krex.protocol import messages as m

    conn.call(m.Hello(version=m.VERSION))
    with pytest.raises(InternalError) as info:
        conn.call(m.Status())
    assert "ZeroDivisionError" in info.value.message and info.value.hint
    assert conn.call(m.Stop()) == {"fine": True}  # the same session keeps working
    ours.close()
    loop.join(5)
    theirs.close()
    assert not loop.is_alive()
