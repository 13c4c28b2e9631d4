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
    body = _ENCODER.encode(message).encode()
    if len(body) > MAX_FRAME:
        raise FrameTooLarge(f"frame of {len(body)} bytes exceeds the {MAX_FRAME}-byte limit")
    return HEADER.pack(len(body)) + body


def _default(value: Any) -> Any:
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    if hasattr(value, "to_dict"):
        return value.to_dict()
    raise TypeError(f"cannot encode {type(value).__name__} in a frame")


# One encoder and one decoder for every frame: ``json.dumps``/``loads`` build an
# encoder and detect the encoding on each call, on every grant's path (UTF-8 only here).
_ENCODER = json.JSONEncoder(separators=(",", ":"), default=_default)
_DECODER = json.JSONDecoder()


def decode_body(body: bytes) -> dict[str, Any]:
    try:
        data = _DECODER.decode(body.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(f"malformed frame: body is not UTF-8 JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ProtocolError(f"malformed frame: expected a JSON object, got {type(data).__name__}")
    return data


class FrameReader:
    """Reads frames from a blocking socket; one reader per socket.

    Reads in large chunks and keeps what follows a frame for the next call, so
    a frame costs one ``recv`` in the common case.
    """

    CHUNK = 1 << 16

    def __init__(self, sock: socket.socket, max_frame: int = MAX_FRAME) -> None:
        self.sock = sock
        self.max_frame = max_frame
        self._buf = bytearray()

    def buffered(self) -> int:
        """Bytes read from the socket and not yet returned as a frame."""
        return len(self._buf)

    def read(self) -> dict[str, Any]:
        self._fill(HEADER.size, at_boundary=True)
        (length,) = HEADER.unpack_from(self._buf)
        if length > self.max_frame:
            raise FrameTooLarge(
                f"frame of {length} bytes exceeds the {self.max_frame}-byte limit"
            )
        self._fill(HEADER.size + length, at_boundary=False)
        body = bytes(self._buf[HEADER.size : HEADER.size + length])
        del self._buf[: HEADER.size + length]
        return decode_body(body)

    def _fill(self, n: int, *, at_boundary: bool) -> None:
        while len(self._buf) < n:
            chunk = self.sock.recv(max(self.CHUNK, n - len(self._buf)))
            if not chunk:
                where = "between frames" if at_boundary and not self._buf else "mid-frame"
                raise ConnectionClosed(f"peer closed the connection {where}")
            self._buf += chunk
