"""The gateway's HTTP/1.1 server: a bare asyncio protocol, in place of aiohttp's server.

Why: per request, aiohttp's low-level server (C parser and all) cost ~135 CPU us on this machine
against ~30 us for a bare protocol answering the same bytes (1,024 keep-alive connections, ~3 KB
JSON bodies, the load of benchmarks/gateway.py). At 1.25 requests per chat turn that is ~130 of
the gateway's ~550 CPU us per turn, its largest single cost. The engine's inference client made the
same move for the same reason (agentrl.common.inference).

What it speaks (what OpenAI clients, urllib and the project's own clients send):
- HTTP/1.1 and 1.0 requests; keep-alive is 1.1's default (`Connection: close` honoured) and 1.0's
  only with `Connection: keep-alive`;
- request bodies with `Content-Length` or `Transfer-Encoding: chunked` (trailers ignored);
  `Expect: 100-continue` is answered before the body is read;
- pipelined requests, answered in order, one at a time per connection;
- a body larger than `max_body_bytes`: the request goes to the handler at once without its body
  (`Request.read` raises `BodyTooLarge`, which the gateway answers 413); the rest of the body is
  read and dropped (for at most `linger_s`, as aiohttp lingers) so that the client, still sending,
  gets the answer rather than a reset, then the connection is closed;
- a request that is not HTTP (bad request line, header, length or chunk size; a head past 64 KiB;
  a transfer coding other than chunked): `error_response(status, message)` answers it (400, 431 or
  501) and the connection is closed.
Answers carry `Content-Length` (the gateway's server-sent-event streams are whole before they are
sent, server.py), `Connection: close` when the connection closes after them.

Lifecycle: every request runs as a task owned by its connection; the handler answers its own
errors (the gateway's `_handle` turns every exception into a JSON answer), so an exception out of it
is logged and answered 500 and the connection closed. A client that disconnects mid-request does not
cancel its handler (the session record stays complete); the answer is dropped. Connections idle
(no request in flight, no byte in) longer than `keepalive_s` are closed by a sweep every
`keepalive_s / 4`. `close` stops listening, lets requests in flight run for `grace_s` (their
answers close their connections), cancels the rest and closes every connection.

Backpressure: while a request is in flight or the client does not read its answers (the transport's
write buffer is past its high-water mark), further bytes are buffered only up to one largest body +
one head; past that the connection stops reading until the answer is out.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from urllib.parse import unquote, urlsplit

log = logging.getLogger(__name__)

MAX_HEAD_BYTES = 65536
"""Request line + headers, at most (aiohttp's limits were 8 KiB a line, ~64 KiB in all)."""
_REASONS = {s.value: s.phrase for s in HTTPStatus}


class BodyTooLarge(Exception):
    """The request's body is larger than the server's `max_body_bytes` (raised by `Request.read`)."""

    def __init__(self, max_body_bytes: int):
        super().__init__(f"the request body is larger than {max_body_bytes} bytes")
        self.max_body_bytes = max_body_bytes


class _BadRequest(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class Request:
    """One parsed request. `headers` maps lower-cased names to values (the first of repeated ones)."""

    __slots__ = ("method", "path", "headers", "_body", "_max_body_bytes", "keep_alive")

    def __init__(self, method: str, path: str, headers: dict[str, str], body: bytes | None, max_body_bytes: int, keep_alive: bool):
        self.method = method
        self.path = path
        """Percent-decoded, without the query string (as aiohttp's `request.path`)."""
        self.headers = headers
        self._body = body
        """None: the body was larger than `max_body_bytes` and was not read."""
        self._max_body_bytes = max_body_bytes
        self.keep_alive = keep_alive

    async def read(self) -> bytes:
        if self._body is None:
            raise BodyTooLarge(self._max_body_bytes)
        return self._body


class Response:
    __slots__ = ("body", "status", "content_type", "headers")

    def __init__(self, body: bytes, status: int = 200, content_type: str = "application/json", headers: str = ""):
        self.body = body
        self.status = status
        self.content_type = content_type
        self.headers = headers
        """Further header lines, each ending in CRLF."""

    def encode(self, keep_alive: bool) -> bytes:
        connection = "" if keep_alive else "Connection: close\r\n"
        head = (f"HTTP/1.1 {self.status} {_REASONS.get(self.status, 'Unknown')}\r\nContent-Type: {self.content_type}\r\n"
                f"Content-Length: {len(self.body)}\r\n{self.headers}{connection}\r\n")
        return head.encode("latin-1") + self.body


Handler = Callable[[Request], Awaitable[Response]]


class _Connection(asyncio.Protocol):
    """One client connection: parses requests from its bytes and answers them in order."""

    def __init__(self, server: HTTPServer):
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.task: asyncio.Task | None = None
        """The request being answered, or None."""
        self.idle_since_s = time.monotonic()
        self._buffer = bytearray()
        self._head: tuple | None = None
        """(method, path, headers, keep_alive, body start, Content-Length or -1 when chunked) once parsed."""
        self._continue_sent = False
        self._reading = True
        self._writing_paused = False
        self._closing = False
        """No further request is read (an answer with Connection: close is on its way)."""
        self._discard_left: int | None = None
        """After a body past the limit: its bytes still to come and be dropped (-1: unknown, chunked)."""
        self._linger_deadline_s: float | None = None

    # -- transport callbacks ------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # answers go out at once, not after a delayed ACK
        self.server.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.server.connections.discard(self)

    def data_received(self, data: bytes) -> None:
        self.idle_since_s = time.monotonic()
        if self._discard_left is not None:
            self._discard(len(data))
            return
        if self._closing:
            return
        self._buffer += data
        if self.task is None and not self._writing_paused:
            self._next_request()
        elif len(self._buffer) > self.server.max_body_bytes + MAX_HEAD_BYTES:
            self._pause_reading()

    def pause_writing(self) -> None:
        self._writing_paused = True

    def resume_writing(self) -> None:
        self._writing_paused = False
        if self.task is None and not self._closing:
            self._next_request()

    # -- requests -----------------------------------------------------------------------------------

    def _next_request(self) -> None:
        try:
            request = self._parse()
        except _BadRequest as err:
            self._write(self.server.error_response(err.status, str(err)), keep_alive=False)
            return
        if request is None:
            if not self._reading and len(self._buffer) <= self.server.max_body_bytes + MAX_HEAD_BYTES:
                self._reading = True
                self.transport.resume_reading()
            return
        self.task = asyncio.get_running_loop().create_task(self._serve(request))

    async def _serve(self, request: Request) -> None:
        try:
            response = await self.server.handler(request)
        except asyncio.CancelledError:
            self._close()
            raise
        except Exception as err:  # noqa: BLE001 - the handler answers its own errors; this one is a bug in it, logged
            log.exception("the gateway's handler raised on %s %s", request.method, request.path)
            response = self.server.error_response(500, f"internal gateway error: {type(err).__name__}: {err}")
            request.keep_alive = False
        self.task = None
        self.idle_since_s = time.monotonic()
        if self.server.closing:
            request.keep_alive = False  # no next request starts once the server is stopping
        self._write(response, request.keep_alive)
        if request.keep_alive and self._buffer and not self._writing_paused:
            self._next_request()

    def _write(self, response: Response, keep_alive: bool) -> None:
        if self.closed or self.transport.is_closing():
            return  # the client went away; its answer has nowhere to go
        self.transport.write(response.encode(keep_alive))
        if self._discard_left is not None:
            self._linger_then_close()
        elif not keep_alive:
            self._close()

    def _close(self) -> None:
        self._closing = True
        if self.transport is not None and not self.closed:
            self.transport.close()

    def _pause_reading(self) -> None:
        if self._reading:
            self._reading = False
            self.transport.pause_reading()

    def _parse(self) -> Request | None:
        """The next whole request in the buffer (removed from it), or None until more bytes come."""
        buf = self._buffer
        if self._head is None:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > MAX_HEAD_BYTES:
                    raise _BadRequest(431, f"the request line and headers are longer than {MAX_HEAD_BYTES} bytes")
                return None
            if end > MAX_HEAD_BYTES:
                raise _BadRequest(431, f"the request line and headers are longer than {MAX_HEAD_BYTES} bytes")
            self._head = self._parse_head(bytes(buf[:end]), end + 4)
            self._continue_sent = False
        method, path, headers, keep_alive, start, length = self._head
        max_body = self.server.max_body_bytes
        if length > max_body:
            waiting_for_continue = headers.get("expect", "").lower() == "100-continue" and not self._continue_sent
            return self._too_large(method, path, headers, 0 if waiting_for_continue else max(start + length - len(buf), 0))
        if length >= 0:
            if len(buf) < start + length:
                self._send_continue(headers)
                return None
            body = bytes(buf[start:start + length])
            del buf[:start + length]
        else:
            parsed = self._chunked_body(start)
            if parsed is None:
                self._send_continue(headers)
                return None
            if parsed is _TOO_LARGE:
                return self._too_large(method, path, headers, -1)
            body, end = parsed
            del buf[:end]
        self._head = None
        if not keep_alive:
            self._closing = True
        return Request(method, path, headers, body, max_body, keep_alive)

    def _too_large(self, method: str, path: str, headers: dict[str, str], body_left: int) -> Request:
        self._closing = True
        self._head = None
        self._discard_left = body_left
        self._buffer.clear()
        return Request(method, path, headers, None, self.server.max_body_bytes, keep_alive=False)

    def _discard(self, num_bytes: int) -> None:
        if self._discard_left > 0:
            self._discard_left = max(self._discard_left - num_bytes, 0)

    def _linger_then_close(self) -> None:
        """Close once the dropped body is all in (or after `linger_s`): closing a socket with unread
        bytes resets the connection, and the client would lose the answer."""
        if self._discard_left == 0 or self.closed:
            self._close()
            return
        if self._linger_deadline_s is None:
            self._linger_deadline_s = time.monotonic() + self.server.linger_s
        elif time.monotonic() >= self._linger_deadline_s:
            self._close()
            return
        asyncio.get_running_loop().call_later(0.05, self._linger_then_close)

    def _send_continue(self, headers: dict[str, str]) -> None:
        if not self._continue_sent and headers.get("expect", "").lower() == "100-continue":
            self._continue_sent = True
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    @staticmethod
    def _parse_head(head: bytes, body_start: int) -> tuple:
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1.") or not parts[0].isalpha() or not parts[1]:
            raise _BadRequest(400, f"not an HTTP/1.x request line: {lines[0][:100]!r}")
        method, target, version = parts
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, colon, value = line.partition(":")
            if not colon or not name or name != name.strip():
                raise _BadRequest(400, f"malformed header line {line[:100]!r}")
            headers.setdefault(name.lower(), value.strip())
        connection = headers.get("connection", "").lower()
        keep_alive = "close" not in connection if version != "HTTP/1.0" else "keep-alive" in connection
        coding = headers.get("transfer-encoding")
        if coding is not None:
            if coding.lower() != "chunked":
                raise _BadRequest(501, f"Transfer-Encoding {coding!r} is not supported (send Content-Length or chunked)")
            length = -1
        else:
            value = headers.get("content-length", "0")
            if not value.isdigit():
                raise _BadRequest(400, f"Content-Length {value[:40]!r} is not a number of bytes")
            length = int(value)
        if target.startswith(("http://", "https://")):  # absolute form (a proxy-style client)
            target = urlsplit(target).path or "/"
        path = target.partition("?")[0].partition("#")[0]
        if "%" in path:
            path = unquote(path)
        return method, path, headers, keep_alive, body_start, length

    def _chunked_body(self, start: int):
        """(body, end of the chunked encoding) from the buffer; None until it is whole; _TOO_LARGE
        once the chunks so far exceed `max_body_bytes`. Parsed again from the start as bytes come in:
        quadratic in the number of chunks, and chunked request bodies are rare (OpenAI clients send
        Content-Length)."""
        buf, pos, size_so_far = self._buffer, start, 0
        pieces = []
        while True:
            line_end = buf.find(b"\r\n", pos)
            if line_end < 0:
                return None
            size_text = bytes(buf[pos:line_end]).split(b";", 1)[0].strip()
            try:
                size = int(size_text, 16)
            except ValueError:
                raise _BadRequest(400, f"bad chunk size {size_text[:20]!r}") from None
            if size < 0:
                raise _BadRequest(400, f"bad chunk size {size_text[:20]!r}")
            size_so_far += size
            if size_so_far > self.server.max_body_bytes:
                return _TOO_LARGE
            if size == 0:  # the last chunk, then optional trailer lines, then an empty line
                end = buf.find(b"\r\n\r\n", line_end) if buf[line_end + 2:line_end + 4] != b"\r\n" else line_end
                if end < 0:
                    return None
                return b"".join(pieces), end + 4
            if len(buf) < line_end + 2 + size + 2:
                return None
            if buf[line_end + 2 + size:line_end + 4 + size] != b"\r\n":
                raise _BadRequest(400, "a chunk does not end with CRLF")
            pieces.append(bytes(buf[line_end + 2:line_end + 2 + size]))
            pos = line_end + 4 + size


_TOO_LARGE = object()


class HTTPServer:
    """Serves `handler` on host:port (see the module docstring)."""

    def __init__(self, handler: Handler, *, error_response: Callable[[int, str], Response], max_body_bytes: int,
                 keepalive_s: float = 75.0, linger_s: float = 10.0):
        self.handler = handler
        self.error_response = error_response
        """(status, message) -> the answer to a request that is not HTTP, or to a handler that raised
        (500); the connection closes after it."""
        self.max_body_bytes = max_body_bytes
        self.keepalive_s = keepalive_s
        """An idle keep-alive connection is closed after this long, seconds (aiohttp's default: 75)."""
        self.linger_s = linger_s
        """After answering a body past the limit, how long its rest is still read and dropped, seconds
        (aiohttp's lingering time: 10)."""
        self.connections: set[_Connection] = set()
        self.closing = False
        """Set by `close`: answers still in flight close their connections."""
        self._server: asyncio.Server | None = None
        self._sweeper: asyncio.Task | None = None

    async def start(self, host: str, port: int, backlog: int = 4096) -> int:
        """Listen; returns the bound port (a free one for port 0)."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self), host, port, backlog=backlog, reuse_address=True)
        self._sweeper = loop.create_task(self._sweep_idle(), name="gateway-http-idle-sweeper")
        return self._server.sockets[0].getsockname()[1]

    async def _sweep_idle(self) -> None:
        while True:
            await asyncio.sleep(self.keepalive_s / 4)
            now_s = time.monotonic()
            for conn in [c for c in self.connections if c.task is None and now_s - c.idle_since_s > self.keepalive_s]:
                conn._close()

    async def close(self, grace_s: float) -> None:
        """Stop listening; requests in flight get `grace_s` to finish (their answers say
        `Connection: close`), then are cancelled; every connection is closed."""
        self.closing = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.wait([self._sweeper])
        if self._server is not None:
            self._server.close()
        in_flight = [c.task for c in self.connections if c.task is not None]
        for conn in list(self.connections):
            if conn.task is None:
                conn._close()
        if in_flight:
            _, pending = await asyncio.wait(in_flight, timeout=grace_s)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending)
        for conn in list(self.connections):
            conn._close()
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None
