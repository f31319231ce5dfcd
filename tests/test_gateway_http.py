"""The gateway's HTTP/1.1 server (gateway/http.py) on a real socket: keep-alive and pipelining,
chunked bodies, 100-continue, bodies past the limit, requests that are not HTTP, HTTP/1.0 and
`Connection: close`, paths, a client that leaves mid-request, a handler that raises, idle
connections, and the bounded stop. Raw sockets say exactly what went over the wire; the official
`openai` client's side is tests/test_gateway.py."""

from __future__ import annotations

import asyncio
import json

import pytest
import pytest_asyncio

from agentrl.gateway.http import BodyTooLarge, HTTPServer, Request, Response

pytestmark = pytest.mark.asyncio(loop_scope="session")  # the fixture's server and the test share one loop


class EchoApp:
    """Answers what it was asked; `/sleep/<s>` first sleeps; `/raise` raises."""

    def __init__(self):
        self.num_finished = 0
        self.cancelled = 0

    async def handle(self, request: Request) -> Response:
        try:
            body = await request.read()
        except BodyTooLarge as err:
            return Response(json.dumps({"too_large": err.max_body_bytes}).encode(), 413)
        if request.path == "/raise":
            raise RuntimeError("a bug in the handler")
        if request.path.startswith("/sleep/"):
            try:
                await asyncio.sleep(float(request.path.removeprefix("/sleep/")))
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
        self.num_finished += 1
        answer = {"method": request.method, "path": request.path, "body": body.decode(), "session": request.headers.get("x-agentrl-session")}
        return Response(json.dumps(answer).encode())


def error_response(status: int, message: str) -> Response:
    return Response(json.dumps({"error": {"message": message}}).encode(), status)


@pytest_asyncio.fixture(loop_scope="session")
async def served():
    app = EchoApp()
    server = HTTPServer(app.handle, error_response=error_response, max_body_bytes=1000, keepalive_s=0.4, linger_s=0.3)
    port = await server.start("127.0.0.1", 0)
    try:
        yield app, server, port
    finally:
        await server.close(grace_s=1.0)


async def read_answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    headers = {}
    for line in head[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.lower()] = value.strip()
    body = await reader.readexactly(int(headers["content-length"]))
    return int(head[0].split(" ")[1]), headers, body


def post(path: str, body: bytes, extra: str = "") -> bytes:
    return f"POST {path} HTTP/1.1\r\nHost: x\r\n{extra}Content-Length: {len(body)}\r\n\r\n".encode() + body


async def connect(port: int):
    return await asyncio.open_connection("127.0.0.1", port)


async def closed_by_server(reader: asyncio.StreamReader) -> bool:
    return await asyncio.wait_for(reader.read(1), 5) == b""


async def test_keep_alive_and_pipelined_requests_are_answered_in_order(served):
    app, _, port = served
    reader, writer = await connect(port)
    writer.write(post("/a", b"one", "X-Agentrl-Session: s1\r\n"))
    status, headers, body = await read_answer(reader)
    assert status == 200 and "connection" not in headers
    assert json.loads(body) == {"method": "POST", "path": "/a", "body": "one", "session": "s1"}
    writer.write(post("/sleep/0.05", b"two") + post("/c", b"three") + b"GET /d HTTP/1.1\r\nHost: x\r\n\r\n")  # one send, three requests
    answers = [json.loads((await read_answer(reader))[2]) for _ in range(3)]
    assert [(a["path"], a["body"]) for a in answers] == [("/sleep/0.05", "two"), ("/c", "three"), ("/d", "")]
    assert app.num_finished == 4
    writer.close()


async def test_a_chunked_body_with_a_trailer_and_a_body_sent_in_pieces(served):
    _, _, port = served
    reader, writer = await connect(port)
    writer.write(b"POST /chunked HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n1;ext=1\r\n \r\n5\r\nwo")
    await asyncio.sleep(0.05)
    writer.write(b"rld\r\n0\r\nX-Trailer: t\r\n\r\n")
    assert json.loads((await read_answer(reader))[2])["body"] == "hello world"
    request = post("/pieces", b'{"k": "v"}')
    for k in range(0, len(request), 7):
        writer.write(request[k:k + 7])
        await asyncio.sleep(0.005)
    assert json.loads((await read_answer(reader))[2])["body"] == '{"k": "v"}'
    writer.close()


async def test_expect_100_continue_is_answered_before_the_body(served):
    _, _, port = served
    reader, writer = await connect(port)
    writer.write(b"POST /e HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 4\r\n\r\n")
    assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5) == b"HTTP/1.1 100 Continue\r\n\r\n"
    writer.write(b"body")
    assert json.loads((await read_answer(reader))[2])["body"] == "body"
    writer.close()


@pytest.mark.parametrize("head, body_pieces", [
    (b"POST /big HTTP/1.1\r\nHost: x\r\nContent-Length: 300000\r\n\r\n", [b"x" * 100000] * 3),
    (b"POST /big HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n", [b"3e8\r\n" + b"x" * 1000 + b"\r\n1\r\n", b"x" * 5000]),
])
async def test_a_body_past_the_limit_is_answered_413_while_the_client_still_sends_then_closed(served, head, body_pieces):
    """The rest of the body is read and dropped, so the client that is still sending gets the 413
    (closing at once would reset the connection under its feet)."""
    _, _, port = served
    reader, writer = await connect(port)
    writer.write(head + body_pieces[0])
    status, headers, body = await read_answer(reader)
    assert status == 413 and json.loads(body) == {"too_large": 1000} and headers["connection"] == "close"
    for piece in body_pieces[1:]:
        writer.write(piece)
        await writer.drain()
    assert await closed_by_server(reader)  # Content-Length: once all is in; chunked: after linger_s (0.3 here)


async def test_a_body_past_the_limit_behind_expect_100_continue_is_refused_without_waiting_for_it(served):
    _, _, port = served
    reader, writer = await connect(port)
    writer.write(b"POST /big HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 5000\r\n\r\n")
    assert (await read_answer(reader))[0] == 413
    assert await asyncio.wait_for(closed_by_server(reader), 0.2)


@pytest.mark.parametrize("request_bytes, status", [
    (b"NONSENSE\r\n\r\n", 400),
    (b"GET / HTTP/2.0\r\n\r\n", 400),
    (b"POST / HTTP/1.1\r\nContent-Length: ten\r\n\r\n", 400),
    (b"POST / HTTP/1.1\r\nno colon here\r\n\r\n", 400),
    (b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 400),
    (b"POST / HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n", 501),
    (b"GET / HTTP/1.1\r\nX-Long: " + b"a" * 70000, 431),
])
async def test_a_request_that_is_not_http_is_answered_and_the_connection_closed(served, request_bytes, status):
    app, _, port = served
    reader, writer = await connect(port)
    writer.write(request_bytes)
    got, headers, body = await read_answer(reader)
    assert got == status and json.loads(body)["error"]["message"] and headers["connection"] == "close"
    assert await closed_by_server(reader)
    assert app.num_finished == 0


async def test_http_1_0_and_connection_close_close_after_the_answer(served):
    _, _, port = served
    for request in (b"GET /old HTTP/1.0\r\n\r\n", b"GET /bye HTTP/1.1\r\nConnection: close\r\n\r\n"):
        reader, writer = await connect(port)
        writer.write(request)
        status, headers, _ = await read_answer(reader)
        assert status == 200 and headers["connection"] == "close"
        assert await closed_by_server(reader)
    reader, writer = await connect(port)  # HTTP/1.0 asking for keep-alive keeps it
    writer.write(b"GET /one HTTP/1.0\r\nConnection: keep-alive\r\n\r\nGET /two HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
    assert [json.loads((await read_answer(reader))[2])["path"] for _ in range(2)] == ["/one", "/two"]
    writer.close()


async def test_paths_are_percent_decoded_without_the_query(served):
    _, _, port = served
    reader, writer = await connect(port)
    writer.write(b"GET /agentrl/sessions/a%3Ab?x=1 HTTP/1.1\r\n\r\nGET http://host:1/abs/path?q HTTP/1.1\r\n\r\n")
    assert [json.loads((await read_answer(reader))[2])["path"] for _ in range(2)] == ["/agentrl/sessions/a:b", "/abs/path"]
    writer.close()


async def test_a_client_that_leaves_mid_request_does_not_cancel_it_and_the_server_goes_on(served):
    app, _, port = served
    _, writer = await connect(port)
    writer.write(post("/sleep/0.2", b"x"))
    await asyncio.sleep(0.05)
    writer.close()
    await asyncio.sleep(0.4)
    assert app.num_finished == 1 and app.cancelled == 0
    reader, writer = await connect(port)
    writer.write(post("/after", b""))
    assert (await read_answer(reader))[0] == 200
    writer.close()


async def test_a_handler_that_raises_is_answered_500_and_the_connection_closed(served):
    _, _, port = served
    reader, writer = await connect(port)
    writer.write(post("/raise", b""))
    status, headers, body = await read_answer(reader)
    assert status == 500 and "RuntimeError: a bug in the handler" in json.loads(body)["error"]["message"]
    assert await closed_by_server(reader)


async def test_idle_connections_are_closed_after_keepalive_s(served):
    _, server, port = served
    reader, writer = await connect(port)
    writer.write(post("/x", b""))
    await read_answer(reader)
    assert len(server.connections) == 1
    assert await asyncio.wait_for(reader.read(1), 2) == b""  # keepalive_s = 0.4, swept every 0.1 s
    assert not server.connections


async def test_close_lets_requests_finish_within_the_grace_then_cancels_the_rest():
    app = EchoApp()
    server = HTTPServer(app.handle, error_response=error_response, max_body_bytes=1000)
    port = await server.start("127.0.0.1", 0)
    quick_r, quick_w = await connect(port)
    slow_r, slow_w = await connect(port)
    idle_r, _ = await connect(port)
    quick_w.write(post("/sleep/0.1", b""))
    slow_w.write(post("/sleep/30", b""))
    await asyncio.sleep(0.05)
    loop = asyncio.get_running_loop()
    start = loop.time()
    await server.close(grace_s=0.5)
    assert loop.time() - start < 2.0
    status, headers, _ = await read_answer(quick_r)
    assert status == 200 and headers["connection"] == "close" and app.num_finished == 1
    assert app.cancelled == 1 and await closed_by_server(slow_r) and await closed_by_server(idle_r)
    with pytest.raises(OSError):
        await connect(port)
