"""The wire protocol: the only place bytes become messages.

In: bytes from a Unix stream socket.  Out: typed message objects
(:mod:`krex.protocol.messages`) or a specific :class:`krex.errors.ProtocolError`.

A frame is a 4-byte big-endian length followed by that many bytes of UTF-8
JSON (an object with a ``type`` field).  The first exchange on every
connection is ``hello`` / ``welcome`` carrying :data:`VERSION`.  The format is
documented for other languages in docs/protocol.md.

The names below are imported on first use (:mod:`krex.lazy`), so importing one
submodule (``krex.protocol.address``: the CLI's lean path) does not build every
message class.
"""

from krex.lazy import lazy_exports

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (CLI start-up)
if TYPE_CHECKING:
    from krex.protocol.address import runtime_dir, socket_path
    from krex.protocol.framing import MAX_FRAME, FrameReader, encode_frame
    from krex.protocol.messages import VERSION, Message, parse_message

__getattr__, __dir__ = lazy_exports(__name__, {
    **{n: f"krex.protocol.address:{n}" for n in ("runtime_dir", "socket_path")},
    **{n: f"krex.protocol.framing:{n}" for n in ("MAX_FRAME", "FrameReader", "encode_frame")},
    **{n: f"krex.protocol.messages:{n}" for n in ("VERSION", "Message", "parse_message")},
})

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
