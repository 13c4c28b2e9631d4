"""The wire protocol: the only place bytes become messages.

In: bytes from a Unix stream socket.  Out: typed message objects
(:mod:`krex.protocol.messages`) or a specific :class:`krex.errors.ProtocolError`.

A frame is a 4-byte big-endian length followed by that many bytes of UTF-8
JSON (an object with a ``type`` field).  The first exchange on every
connection is ``hello`` / ``welcome`` carrying :data:`VERSION`.  The format is
documented for other languages in docs/protocol.md.
"""

from krex.protocol.address import runtime_dir, socket_path
from krex.protocol.framing import MAX_FRAME, FrameReader, encode_frame
from krex.protocol.messages import VERSION, Message, parse_message

__all__ = [
    "MAX_FRAME",
    "VERSION",
    "FrameReader",
    "Message",
    "encode_frame",
    "parse_message",
    "runtime_dir",
    "socket_path",
]
