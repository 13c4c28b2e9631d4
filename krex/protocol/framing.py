"""Length-prefixed frames with a size limit.

``encode_frame`` turns a dict into bytes; :class:`FrameReader` reads whole
frames from a socket and raises a specific error for each way a peer can get
it wrong (oversized, not JSON, not an object).
"""

from __future__ import annotations

import json
import socket
import struct
from typing import Any

from krex.errors import FrameTooLarge, ProtocolError

HEADER = struct.Struct(">I")
MAX_FRAME = 1 << 20  # 1 MiB: generous for reports, small enough to refuse garbage


class ConnectionClosed(EOFError):
    """The peer closed the connection (cleanly, between frames, or mid-frame)."""


def encode_frame(message: dict[str, Any]) -> bytes:
    body = json.dumps(message, separators=(",", ":"), default=_default).encode()
    if len(body) > MAX_FRAME:
        raise FrameTooLarge(f"frame of {len(body)} bytes exceeds the {MAX_FRAME}-byte limit")
    return HEADER.pack(len(body)) + body


def _default(value: Any) -> Any:
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    if hasattr(value, "to_dict"):
        return value.to_dict()
    raise TypeError(f"cannot encode {type(value).__name__} in a frame")


def decode_body(body: bytes) -> dict[str, Any]:
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(f"malformed frame: body is not UTF-8 JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ProtocolError(f"malformed frame: expected a JSON object, got {type(data).__name__}")
    return data


class FrameReader:
    """Reads frames from a blocking socket; one reader per socket."""

    def __init__(self, sock: socket.socket, max_frame: int = MAX_FRAME) -> None:
        self.sock = sock
        self.max_frame = max_frame

    def read(self) -> dict[str, Any]:
        header = self._exact(HEADER.size, at_boundary=True)
        (length,) = HEADER.unpack(header)
        if length > self.max_frame:
            raise FrameTooLarge(
                f"frame of {length} bytes exceeds the {self.max_frame}-byte limit"
            )
        return decode_body(self._exact(length, at_boundary=False))

    def _exact(self, n: int, *, at_boundary: bool) -> bytes:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            k = self.sock.recv_into(view[got:], n - got)
            if k == 0:
                where = "between frames" if at_boundary and got == 0 else "mid-frame"
                raise ConnectionClosed(f"peer closed the connection {where}")
            got += k
        return bytes(buf)
