"""The host side of the sandbox's frame protocol (toolservers/sandbox_zygote.py is the other side):
length-prefixed JSON objects, and the results a zygote may send."""

from __future__ import annotations

import json
import struct

LIMITS = frozenset({"wall_time", "cpu_time", "memory", "processes", "file_size", "disk", "output"})


class SandboxProtocolError(Exception):
    """A sandbox sent bytes that are not a well-formed frame of the zygote protocol."""


class FrameReader:
    """Splits the byte stream from a sandbox into frames: a 4-byte big-endian length, then that
    many bytes of UTF-8 JSON holding an object. Anything else raises SandboxProtocolError; at
    most 4 + max_frame_bytes bytes are ever buffered."""

    def __init__(self, max_frame_bytes: int):
        self.max_frame_bytes = max_frame_bytes
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[dict]:
        self._buf += data
        frames = []
        while len(self._buf) >= 4:
            (size,) = struct.unpack_from(">I", self._buf)
            if size > self.max_frame_bytes:
                raise SandboxProtocolError(f"a frame of {size} bytes announced; results are at most "
                                           f"{self.max_frame_bytes}")
            if len(self._buf) < 4 + size:
                break
            body = bytes(self._buf[4 : 4 + size])
            del self._buf[: 4 + size]
            try:
                frame = json.loads(body)
            except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
                raise SandboxProtocolError(f"a frame is not JSON: {exc}") from None
            if not isinstance(frame, dict):
                raise SandboxProtocolError(f"a frame is JSON {type(frame).__name__}, not an object")
            frames.append(frame)
        return frames


_RESULT_TYPES: dict[str, tuple[type, ...]] = {
    "stdout": (str,), "stderr": (str,), "exit_code": (int,), "limit": (str, type(None)),
    "duration_s": (int, float),
}


def check_result(frame: dict) -> dict:
    """`frame` if it is a result the zygote can send, else SandboxProtocolError saying why."""
    if frame.keys() != _RESULT_TYPES.keys():
        raise SandboxProtocolError(f"a result has fields {sorted(map(str, frame))}; expected {sorted(_RESULT_TYPES)}")
    for name, types in _RESULT_TYPES.items():
        if not isinstance(frame[name], types) or isinstance(frame[name], bool):
            raise SandboxProtocolError(f"result field {name!r} is {type(frame[name]).__name__}")
    if frame["limit"] is not None and frame["limit"] not in LIMITS:
        raise SandboxProtocolError(f"result names an unknown limit {frame['limit'][:40]!r}")
    return frame
