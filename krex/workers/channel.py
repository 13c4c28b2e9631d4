"""Framed messages between the pool and one of its workers.

A frame is a 4-byte big-endian length followed by a pickled dict.  Pickle is
acceptable here only because both ends belong to the same user and the pool
spawned the worker itself; this channel never faces a client.
"""

from __future__ import annotations

import pickle
import socket
import struct
import threading
from typing import Any

_HEADER = struct.Struct(">I")
MAX_FRAME = 1 << 30


class ChannelClosed(EOFError):
    """The other end went away."""


class Channel:
    """Blocking send (thread-safe) and blocking receive over a stream socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._send_lock = threading.Lock()

    def send(self, message: dict[str, Any]) -> None:
        body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        if len(body) > MAX_FRAME:
            raise ValueError(f"message of {len(body)} bytes exceeds the {MAX_FRAME}-byte limit")
        with self._send_lock:
            self.sock.sendall(_HEADER.pack(len(body)) + body)

    def recv(self) -> dict[str, Any]:
        (size,) = _HEADER.unpack(self._read_exact(_HEADER.size))
        if size > MAX_FRAME:
            raise ChannelClosed(f"frame of {size} bytes exceeds the limit")
        return pickle.loads(self._read_exact(size))

    def _read_exact(self, n: int) -> bytes:
        chunks, left = [], n
        while left:
            chunk = self.sock.recv(min(left, 1 << 20))
            if not chunk:
                raise ChannelClosed("peer closed the channel")
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class FrameDecoder:
    """Incremental decoder for a non-blocking reader: feed bytes, get messages."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        self._buf += data
        out = []
        while len(self._buf) >= _HEADER.size:
            (size,) = _HEADER.unpack_from(self._buf)
            if size > MAX_FRAME:
                raise ChannelClosed(f"frame of {size} bytes exceeds the limit")
            end = _HEADER.size + size
            if len(self._buf) < end:
                break
            out.append(pickle.loads(bytes(self._buf[_HEADER.size : end])))
            del self._buf[:end]
        return out
