"""Tool services over real sockets: servers run as subprocesses, are killed and restarted.

Covers the framework (describe, bad input of every kind with the server staying up for others,
overload, deadlines, bounded shutdown, restart), the calculator, BM25 search with its index
cache, the CLI, and the CurveZMQ rule for non-loopback binds.
"""

from __future__ import annotations

import asyncio
import decimal
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest
import zmq
import zmq.asyncio
import zmq.auth

from agentrl.toolservers.client import ToolClient, ToolServiceUnavailable
from agentrl.toolservers.process import ToolServerStartError, start_toolserver

CORPUS = Path(__file__).parent / "fixtures" / "toolservers" / "passages.jsonl"
LOCAL = "tcp://127.0.0.1:*"


@pytest.fixture(scope="module")
def calculator():
    proc = start_toolserver("calculator", LOCAL, "--max-request-bytes", "4096")
    yield proc
    assert proc.stop(10) == 0


@pytest.fixture(scope="module")
def search_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("bm25cache")


@pytest.fixture(scope="module")
def search(search_cache):
    proc = start_toolserver("search", LOCAL, "--corpus", str(CORPUS), "--cache-dir", str(search_cache))
    yield proc
    assert proc.stop(10) == 0


async def raw_exchange(endpoint: str, frames: list[bytes]) -> dict | list:
    """Send raw frames on a DEALER (no client library) and return the decoded reply."""
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        await sock.send_multipart(frames)
        return msgpack.unpackb(await asyncio.wait_for(sock.recv(), 10), raw=False)
    finally:
        sock.close(0)
        ctx.term()


def call_frame(req_id: int, tool: str, args, timeout_s: float = 5.0) -> bytes:
    return msgpack.packb({"id": req_id, "op": "call", "tool": tool, "args": args, "timeout_s": timeout_s})


# --- describe and calculator ---------------------------------------------------------------------


async def test_describe_gives_openai_schemas_and_idempotent_flag(calculator):
    async with ToolClient([calculator.endpoint]) as client:
        specs = await client.describe()
    assert [s["function"]["name"] for s in specs] == ["calculator"]
    spec = specs[0]
    assert spec["type"] == "function" and spec["idempotent"] is True
    assert spec["function"]["parameters"]["required"] == ["expression"]
    assert spec["function"]["parameters"]["properties"]["expression"]["type"] == "string"


@pytest.mark.parametrize(
    "expression, value",
    [("0.1 + 0.2", "3/10"), ("(3 + 4) * 2 / 5", "14/5"), ("2 ** 100", str(2**100)), ("-7 // 2", "-4"),
     ("1e3 / 8", "125"), ("2 ** -2", "1/4"),
     # Python's precedence: ** binds tighter than a unary minus on its left, and to the right
     ("-2 ** 2", "-4"), ("2 ** 3 ** 2", "512"), ("2 * -3 ** 2", "-18"), ("-(1 + 2) ** 2", "-9"),
     ("2 ** -1 * 3", "3/2"), ("100 // 7 // 2", "7"), ("1 - 2 - 3", "-4"), ("7.5 % 2", "3/2")],
)
async def test_calculator_is_exact(calculator, expression, value):
    async with ToolClient([calculator.endpoint]) as client:
        resp = await client.call("calculator", {"expression": expression})
    assert resp.ok, resp.error
    assert resp.content["value"] == value
    assert resp.replica == calculator.endpoint and resp.server_latency_s > 0


@pytest.mark.parametrize(
    "expression, fragment",
    [("1/0", "division by zero"), ("__import__('os').system('id')", "unsupported element"),
     ("9 ** 9 ** 9", "larger than"), ("2 ** 0.5", "not an integer"), ("(1 +", "cannot parse"),
     ("[1, 2]", "unsupported element"), ("1 if 1 else 2", "unsupported element"),
     ("(1)(2)", "missing operator"), ("1 2", "missing operator"), ("2 *", "ends early"), ("(1", "missing ')'"),
     ("1)", "without a matching"), ("1__0", "malformed number")],
)
async def test_calculator_rejects_what_it_cannot_do_exactly_or_safely(calculator, expression, fragment):
    async with ToolClient([calculator.endpoint]) as client:
        resp = await client.call("calculator", {"expression": expression})
    assert not resp.ok and resp.error.type == "tool_error"
    assert fragment in resp.error.message


# 1.8 KB of products of powers: the whole product used to be computed (1.3 s), fail to print, and
# be computed again by the retry of its batch.
POWER_PRODUCT = "*".join(["(9**1000)**3"] * 150)[:1949]


@pytest.mark.parametrize("expression, fragment", [
    (POWER_PRODUCT, "digits (limit 10000)"),
    ("*".join(["9**1000"] * 250)[:1999], "digits (limit 10000)"),
    ("+".join(["(7/3)**1000*(7/3)**1000*(7/3)**1000*(7/3)**1000"] * 40)[:1919], "too much big-number arithmetic"),
    ("1e9999999", "more than 10000 digits"),
])
async def test_calculator_refuses_huge_work_before_doing_it(calculator, expression, fragment):
    async with ToolClient([calculator.endpoint], max_request_bytes=4096) as client:
        resp = await client.call("calculator", {"expression": expression})
    assert not resp.ok and resp.error.type == "tool_error" and fragment in resp.error.message, resp.error
    # Refused before the work: computing it takes 1.3 s; 0.5 s leaves room for a loaded machine.
    assert resp.server_latency_s < 0.5, resp.server_latency_s


async def test_calculator_prints_results_past_pythons_4300_digit_limit(calculator):
    async with ToolClient([calculator.endpoint]) as client:
        resp = await client.call("calculator", {"expression": "9**1000*9**1000*9**1000*9**1000*9**1000 / 7"})
    assert resp.ok, resp.error
    numerator, denominator = resp.content["value"].split("/")
    # int(text) refuses 4,772 digits here too; a Decimal compares exactly with an int
    assert len(numerator) == 4772 and decimal.Decimal(numerator) == 9**5000 and denominator == "7"


# --- bad input -------------------------------------------------------------------------------------


BAD_INPUTS = {
    "malformed msgpack": ([b"\xc1\xff\x00garbage"], "malformed_request"),
    "not a map": ([msgpack.packb("call calculator 1+1")], "malformed_request"),
    "no id": ([msgpack.packb({"op": "call"})], "malformed_request"),
    "two payload frames": ([call_frame(1, "calculator", {"expression": "1"}), b"extra"], "bad_frames"),
    "unknown op": ([msgpack.packb({"id": 1, "op": "explode"})], "unknown_op"),
    "unknown tool": ([call_frame(1, "rm_rf", {})], "unknown_tool"),
    "missing argument": ([call_frame(1, "calculator", {})], "invalid_arguments"),
    "wrong argument type": ([call_frame(1, "calculator", {"expression": 12})], "invalid_arguments"),
    "extra argument": ([call_frame(1, "calculator", {"expression": "1", "x": 1})], "invalid_arguments"),
    "arguments not a map": ([call_frame(1, "calculator", "1+1")], "invalid_arguments"),
    "oversized": ([call_frame(1, "calculator", {"expression": "1+" * 3000 + "1"})], "request_too_large"),
    "deadline past": ([call_frame(1, "calculator", {"expression": "1"}, timeout_s=-0.5)], "deadline_exceeded"),
    "no deadline": ([msgpack.packb({"id": 1, "op": "call", "tool": "calculator", "args": {"expression": "1"}})],
                    "malformed_request"),
}


async def test_bad_input_gets_structured_errors_while_other_clients_keep_succeeding(calculator):
    """Every kind of bad input, sent while a well-behaved client runs calls concurrently: each gets
    its own structured error, the server stays up, and every good call succeeds."""
    async with ToolClient([calculator.endpoint]) as good:
        stop = asyncio.Event()
        num_good = 0

        async def good_traffic():
            nonlocal num_good
            while not stop.is_set():
                resp = await good.call("calculator", {"expression": f"{num_good} + 1"})
                assert resp.ok and resp.content["value"] == str(num_good + 1)
                num_good += 1

        traffic = asyncio.create_task(good_traffic())
        try:
            for name, (frames, expected_type) in BAD_INPUTS.items():
                reply = await raw_exchange(calculator.endpoint, frames)
                assert reply["ok"] is False, name
                assert reply["error"]["type"] == expected_type, (name, reply)
                assert reply["error"]["message"], name
        finally:
            stop.set()
            await traffic
        assert num_good > 0
        assert (await good.call("calculator", {"expression": "2*21"})).content["value"] == "42"
    assert calculator.alive()


async def test_a_batch_frame_answers_each_element_including_bad_ones(calculator):
    batch = [
        {"id": 1, "op": "call", "tool": "calculator", "args": {"expression": "6*7"}, "timeout_s": 5},
        "not a request",
        {"id": 3, "op": "call", "tool": "calculator", "args": {"expression": "1/0"}, "timeout_s": 5},
    ]
    reply = await raw_exchange(calculator.endpoint, [msgpack.packb(batch)])
    by_id = {r["id"]: r for r in reply}
    assert by_id[1]["ok"] and by_id[1]["content"]["value"] == "42"
    assert by_id[None]["error"]["type"] == "malformed_request"
    assert by_id[3]["error"]["type"] == "tool_error"


async def test_overload_is_answered_explicitly_not_dropped():
    """With room for 1 call in flight, a second concurrent call is answered `overloaded` (and was
    not executed) rather than queued without bound or dropped."""
    proc = start_toolserver("python", LOCAL, "--workers", "1", "--max-in-flight", "1")
    try:
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(proc.endpoint)
        await sock.send(call_frame(1, "python", {"code": "import time; time.sleep(1); print('slow')"}))
        # Barrier: frames from one peer are handled in order, so once the ping is answered call 1
        # has been admitted (and occupies the one in-flight place).
        await sock.send(msgpack.packb({"id": 99, "op": "ping"}))
        assert msgpack.unpackb(await asyncio.wait_for(sock.recv(), 10))["id"] == 99
        await sock.send(call_frame(2, "python", {"code": "print('second')"}))
        replies = [msgpack.unpackb(await asyncio.wait_for(sock.recv(), 10)) for _ in range(2)]
        sock.close(0)
        ctx.term()
        by_id = {r["id"]: r for r in replies}
        assert by_id[2]["error"]["type"] == "overloaded"
        assert by_id[1]["ok"] and by_id[1]["content"]["stdout"] == "slow\n"
    finally:
        assert proc.stop(10) == 0


# --- search ----------------------------------------------------------------------------------------


def _passages() -> dict[str, dict]:
    return {p["id"]: p for p in map(json.loads, CORPUS.read_text().splitlines())}


async def test_search_finds_the_passage_and_respects_top_k(search):
    passages = _passages()
    async with ToolClient([search.endpoint]) as client:
        spec = (await client.describe())[0]
        assert spec["idempotent"] is True and spec["function"]["name"] == "search"
        results = await asyncio.gather(*[
            client.call("search", {"query": f"which company has number {1000 + i}?", "top_k": 1 + i % 5})
            for i in range(0, 200, 7)
        ])
        default_k = await client.call("search", {"query": "a town on the river"})
        nothing = await client.call("search", {"query": "the of and"})
    for i, resp in zip(range(0, 200, 7), results, strict=True):
        assert resp.ok, resp.error
        hits = resp.content
        assert len(hits) == 1 + i % 5
        assert hits[0]["id"] == f"p{i:03d}"
        assert set(hits[0]) == {"id", "title", "text", "score"}
        assert hits[0]["text"] == passages[hits[0]["id"]]["text"]
        assert [h["score"] for h in hits] == sorted((h["score"] for h in hits), reverse=True)
    assert len(default_k.content) == 3
    assert nothing.ok and nothing.content == []


async def test_search_index_is_cached_and_gives_the_same_answers(search, search_cache):
    entries = [p for p in search_cache.iterdir() if not p.name.startswith(".")]
    assert len(entries) == 1 and (entries[0] / "index").is_dir()
    query = {"query": "botanist born in a town", "top_k": 5}
    async with ToolClient([search.endpoint]) as client:
        first = await client.call("search", query)
    second_server = start_toolserver("search", LOCAL, "--corpus", str(CORPUS), "--cache-dir", str(search_cache))
    try:
        assert "loaded from cache" in second_server.log_tail()
        async with ToolClient([second_server.endpoint]) as client:
            second = await client.call("search", query)
    finally:
        second_server.stop(10)
    assert first.content == second.content and len(first.content) == 5


def test_search_refuses_a_bad_corpus(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "title": "t", "text": "x"}\n{"id": "a", "title": "t", "text": "y"}\n')
    with pytest.raises(ToolServerStartError, match="appears twice"):
        start_toolserver("search", LOCAL, "--corpus", str(bad), "--cache-dir", str(tmp_path / "c"))


# --- lifecycle: shutdown, restart ------------------------------------------------------------------


async def test_sigterm_stops_the_server_by_itself_and_a_restart_is_picked_up():
    proc = start_toolserver("calculator", LOCAL)
    endpoint = proc.endpoint
    async with ToolClient([endpoint], heartbeat_interval_s=0.1, request_timeout_s=10) as client:
        assert (await client.call("calculator", {"expression": "1+1"})).ok
        proc.kill(signal.SIGKILL)
        proc.stop(10)
        while client.live_replicas():
            await asyncio.sleep(0.05)
        with pytest.raises(ToolServiceUnavailable, match="no live replica"):
            await client.call("calculator", {"expression": "1+1"})
        restarted = start_toolserver("calculator", endpoint)
        try:
            while not client.live_replicas():
                await asyncio.sleep(0.05)
            resp = await client.call("calculator", {"expression": "20+22"})
            assert resp.ok and resp.content["value"] == "42"
        finally:
            # exit code 0: SIGTERM ended it cleanly; a hang would end in SIGKILL (-9) instead
            assert restarted.stop(10) == 0


# --- CLI -------------------------------------------------------------------------------------------


def agentrl(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-P", "-m", "agentrl.cli", *args], capture_output=True, text=True,
                          timeout=timeout_s)


def test_cli_call_prints_one_json_line_and_exits_0_when_the_service_answered(calculator):
    ok = agentrl("tool", "call", "--endpoint", calculator.endpoint, "--tool", "calculator",
                 "--args", '{"expression": "1/3 + 1"}')
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout) == {"ok": True, "content": {"value": "4/3", "decimal": "1.33333333333333333333333333333"}}
    err = agentrl("tool", "call", "--endpoint", calculator.endpoint, "--tool", "calculator", "--args", '{"e": 1}')
    assert err.returncode == 0
    out = json.loads(err.stdout)
    assert out["ok"] is False and out["error"]["type"] == "invalid_arguments"
    described = agentrl("tool", "describe", "--endpoint", calculator.endpoint)
    assert json.loads(described.stdout)[0]["function"]["name"] == "calculator"


def test_cli_exits_1_when_no_service_answers():
    res = agentrl("tool", "call", "--endpoint", "tcp://127.0.0.1:9", "--tool", "calculator",
                  "--args", "{}", "--timeout-s", "1")
    assert res.returncode == 1 and "no replica" in res.stderr and res.stdout == ""


# --- CurveZMQ off loopback -------------------------------------------------------------------------


def test_non_loopback_bind_without_keys_is_refused_with_the_reason():
    res = agentrl("toolserver", "calculator", "--bind", "tcp://0.0.0.0:*", timeout_s=30)
    assert res.returncode == 2
    assert "refusing to bind tcp://0.0.0.0:*" in res.stderr and "CurveZMQ" in res.stderr
    assert "READY" not in res.stdout


async def test_non_loopback_bind_with_curve_keys_serves_only_authorized_clients(tmp_path):
    server_dir, clients_dir, stranger_dir = (tmp_path / d for d in ("server", "clients", "stranger"))
    for d in (server_dir, clients_dir, stranger_dir):
        d.mkdir()
    _, server_secret = zmq.auth.create_certificates(server_dir, "server")
    _, client_secret = zmq.auth.create_certificates(clients_dir, "trainer")
    _, stranger_secret = zmq.auth.create_certificates(stranger_dir, "stranger")
    proc = start_toolserver("calculator", "tcp://0.0.0.0:*", "--curve-secret-key", server_secret,
                            "--curve-authorized-clients", str(clients_dir))
    try:
        port = proc.endpoint.rsplit(":", 1)[1]
        endpoint = f"tcp://127.0.0.1:{port}"
        server_public, _ = zmq.auth.load_certificate(server_secret)

        def keys(secret_file: str) -> dict:
            public, secret = zmq.auth.load_certificate(secret_file)
            return dict(curve_server_public_key=server_public, curve_client_public_key=public,
                        curve_client_secret_key=secret)

        async with ToolClient([endpoint], **keys(client_secret)) as client:
            resp = await client.call("calculator", {"expression": "2**10"})
            assert resp.ok and resp.content["value"] == "1024"
        with pytest.raises(ToolServiceUnavailable):
            await ToolClient([endpoint], request_timeout_s=1.5, **keys(stranger_secret)).start()
        with pytest.raises(ToolServiceUnavailable):
            await ToolClient([endpoint], request_timeout_s=1.5).start()  # plain text: no handshake
    finally:
        assert proc.stop(10) == 0


def test_process_helper_reports_a_server_that_dies_before_ready(tmp_path):
    with pytest.raises(ToolServerStartError, match="exited with 2 before READY"):
        start_toolserver("search", LOCAL)  # no --corpus
    assert os.path.exists(CORPUS)


async def test_a_call_nobody_answers_returns_deadline_exceeded_after_the_grace():
    """A replica that answers heartbeats but never a call (a wedged tool): the client gives the
    caller a deadline_exceeded response instead of waiting forever."""
    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    describe = [{"type": "function", "idempotent": True,
                 "function": {"name": "stuck", "description": "", "parameters": {"type": "object"}}}]

    async def serve():
        while True:
            peer, payload = await router.recv_multipart()
            for msg in (lambda m: m if isinstance(m, list) else [m])(msgpack.unpackb(payload)):
                if msg["op"] in ("ping", "describe"):
                    content = describe if msg["op"] == "describe" else {}
                    reply = {"id": msg["id"], "ok": True, "content": content, "error": None, "latency_s": 0.0}
                    await router.send_multipart([peer, msgpack.packb(reply)])

    server = asyncio.create_task(serve())
    try:
        async with ToolClient([f"tcp://127.0.0.1:{port}"], heartbeat_interval_s=0.1, reply_grace_s=0.2) as client:
            resp = await client.call("stuck", {}, deadline_s=0.3)
            assert not resp.ok and resp.error.type == "deadline_exceeded"
            assert "no reply within 0.3 s" in resp.error.message
            assert client.live_replicas() == [f"tcp://127.0.0.1:{port}"]
    finally:
        server.cancel()
        router.close(0)
        ctx.term()


async def test_an_unexpected_exception_is_answered_without_running_any_call_twice():
    """A batch in which one call raises: every call of it ran exactly once (the batch used to be
    retried call by call, running each a second time)."""
    import socket
    import threading

    from agentrl.toolservers.server import ServerConfig, Tool, ToolServer, ToolSpec

    runs: dict[int, int] = {}

    class Counting(Tool):
        spec = ToolSpec("counting", "counts", {"type": "object", "properties": {"x": {"type": "integer"}},
                                               "required": ["x"]}, idempotent=True)

        def run(self, args: dict) -> int:
            runs[args["x"]] = runs.get(args["x"], 0) + 1
            if args["x"] == 3:
                raise ValueError("three")
            return args["x"]

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ToolServer(ServerConfig(bind=f"tcp://127.0.0.1:{port}"), [Counting()])
    thread = threading.Thread(target=server.serve, kwargs={"install_signal_handlers": False})
    thread.start()
    try:
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{port}")
        await sock.send(msgpack.packb([{"id": x, "op": "call", "tool": "counting", "args": {"x": x}, "timeout_s": 5}
                                       for x in range(8)]))
        replies: dict = {}
        while len(replies) < 8:
            reply = msgpack.unpackb(await asyncio.wait_for(sock.recv(), 10))
            replies.update({r["id"]: r for r in (reply if isinstance(reply, list) else [reply])})
        sock.close(0)
        ctx.term()
    finally:
        server.stop()
        thread.join(10)
    assert runs == {x: 1 for x in range(8)}
    assert replies[3]["error"]["message"] == "internal error in tool counting: ValueError: three"
    assert all(replies[x]["content"] == x for x in range(8) if x != 3)


async def test_a_tool_crashing_on_one_input_answers_that_call_with_an_error_and_serves_the_rest():
    """In-process server (real socket) with a tool that raises on x == 13: that call gets a
    tool_error naming the exception, the other calls of the same batch succeed, the server lives."""
    import socket
    import threading

    from agentrl.toolservers.server import ServerConfig, Tool, ToolServer, ToolSpec

    class Fragile(Tool):
        spec = ToolSpec("fragile", "doubles x", {"type": "object", "properties": {"x": {"type": "integer"}},
                                                 "required": ["x"]}, idempotent=True)

        def run(self, args: dict) -> int:
            if args["x"] == 13:
                raise RuntimeError("unlucky input")
            return 2 * args["x"]

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ToolServer(ServerConfig(bind=f"tcp://127.0.0.1:{port}"), [Fragile()])
    thread = threading.Thread(target=server.serve, kwargs={"install_signal_handlers": False})
    thread.start()
    try:
        async with ToolClient([f"tcp://127.0.0.1:{port}"]) as client:
            resps = await asyncio.gather(*[client.call("fragile", {"x": x}) for x in range(20)])
            again = await client.call("fragile", {"x": 21})
    finally:
        server.stop()
        thread.join(10)
    for x, resp in enumerate(resps):
        if x == 13:
            assert not resp.ok and resp.error.type == "tool_error" and "RuntimeError: unlucky input" in resp.error.message
        else:
            assert resp.ok and resp.content == 2 * x
    assert again.ok and again.content == 42 and not thread.is_alive()
