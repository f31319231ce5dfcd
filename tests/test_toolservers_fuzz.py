"""Malformed input to the tool services, from both sides, with the services running for real.

- Clients: 1,000 malformed frames (seeded) to each ZeroMQ service (calculator, search, python) in
  batches of 100: random bytes, wrong frame counts, oversized requests and frames, broken msgpack,
  wrong types in every field. Every reply must be a well-formed error reply, and after each batch
  a good request must be answered correctly by the same server process.
- Sizes: a frame past the server's MAXMSGSIZE is never buffered (the server's peak memory does not
  grow by it); an oversized element of a batch is answered with its own id while the others run; the
  client splits a large burst of calls into frames under its limit and refuses a request that no
  frame could carry.
- A peer that stops reading does not stall the replies to another peer.
- Sandboxes: the frame reader and result checker on random and malformed byte streams, and garbage
  written into a running sandbox's real protocol pipe (from the host, as root: the call inside
  cannot reach that pipe, see test_sandbox_hostile.py) restarts that sandbox only.
- The client: garbage replies from a fake server are counted and dropped, and the client goes on.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import socket
import struct
import subprocess
import threading
import time
from pathlib import Path

import msgpack
import pytest
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from agentrl.toolservers import protocol as P
from agentrl.toolservers.client import ToolClient
from agentrl.toolservers.process import start_toolserver
from agentrl.toolservers.sandbox_frames import FrameReader, SandboxProtocolError, check_result
from agentrl.toolservers.server import ServerConfig, Tool, ToolServer, ToolSpec

CORPUS = Path(__file__).parent / "fixtures" / "toolservers" / "passages.jsonl"
LOCAL = "tcp://127.0.0.1:*"
MAX_REQUEST_BYTES = 4096
MAX_FRAME_BYTES = 16384
NUM_FRAMES = 1000
BATCH = 100
ERROR_TYPES = {P.E_MALFORMED, P.E_BAD_FRAMES, P.E_TOO_LARGE, P.E_UNKNOWN_TOOL, P.E_UNKNOWN_OP, P.E_INVALID_ARGS,
               P.E_DEADLINE}
BARRIER_ID = 987654321

GOOD_CALLS = {
    "calculator": ({"expression": "6*7"}, lambda content: content["value"] == "42"),
    "search": ({"query": "company number 1007", "top_k": 1}, lambda content: content[0]["id"] == "p007"),
    "python": ({"code": "print(6 * 7)"}, lambda content: content["stdout"] == "42\n"),
}
VALID_ARGS = {"calculator": {"expression": "1+1"}, "search": {"query": "x"}, "python": {"code": "print(1)"}}


# --- the generator of malformed frames ---------------------------------------------------------------

DROP = object()  # a field left out of a request
WEIRD = [None, True, False, 0, -1, 2**63 - 1, -(2**63), 1.5, float("nan"), float("inf"), float("-inf"), "", "x" * 300,
         b"\x00\xff", [], [1, [2, [3]]], {}, {"k": "v"}, {1: 2}, msgpack.ExtType(5, b"ext")]


def malformed_frames(rng: random.Random, tool: str) -> list[list[bytes]]:
    """NUM_FRAMES multipart messages, none of which is a request the server may run."""

    def call(**override) -> dict:
        msg = {"id": rng.randrange(1 << 31), "op": "call", "tool": tool, "args": dict(VALID_ARGS[tool]),
               "timeout_s": 5.0}
        msg.update(override)
        return {k: v for k, v in msg.items() if v is not DROP}

    def broken_call() -> dict:
        field = rng.choice(["id", "op", "tool", "args", "timeout_s", "arg_value", "extra_arg", "no_arg", "drop"])
        weird = rng.choice(WEIRD)
        if field == "id":
            return call(id=rng.choice([w for w in WEIRD if not (isinstance(w, int) and not isinstance(w, bool))]))
        if field == "op":
            return call(op=rng.choice([w for w in WEIRD if w not in ("call", "ping", "describe")] + ["explode", "CALL"]))
        if field == "tool":
            return call(tool=rng.choice([w for w in WEIRD if w != tool] + ["rm_rf", tool + "x"]))
        if field == "args":
            return call(args=rng.choice([w for w in WEIRD if not isinstance(w, dict)] + [{1: 2}, {"x": weird}]))
        if field == "timeout_s":
            return call(timeout_s=rng.choice([None, "5", [5], True, float("nan"), 0, -3.0, {}]))
        if field == "arg_value":
            key = next(iter(VALID_ARGS[tool]))
            return call(args={key: rng.choice([None, 1, 1.5, [], {}, b"b", True])})
        if field == "extra_arg":
            return call(args={**VALID_ARGS[tool], rng.choice(["zz", "__class__", "x" * 100]): weird})
        if field == "no_arg":
            return call(args={})
        return call(**{rng.choice(["id", "op", "tool", "args", "timeout_s"]): DROP})

    def packed_garbage() -> bytes:
        kind = rng.randrange(9)
        if kind == 0:
            return os.urandom(rng.randrange(0, 2048))
        if kind == 1:  # a real request cut short
            whole = msgpack.packb(call(), use_bin_type=True)
            return whole[: rng.randrange(0, len(whole))]
        if kind == 2:  # bytes that are never msgpack, or trailing garbage
            return rng.choice([b"\xc1", b"\xc1" * 50, msgpack.packb(broken_call()) + b"\xc1\x00"])
        if kind == 3:  # nesting, huge declared lengths, bad UTF-8, bad timestamps
            return rng.choice([b"\x91" * 5000 + b"\x01", b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff",
                               b"\xdb\xff\xff\xff\xff", b"\xa3\xff\xfe\xfd", b"\xc7\x03\xff\x01\x02\x03",
                               b"\x81\x91\x01\x02"])
        if kind == 4:  # values that are not requests
            return msgpack.packb(rng.choice(WEIRD[:-1] + [[], [[]], "call calculator 1+1"]), use_bin_type=True)
        if kind == 5:  # a batch of broken calls and garbage
            items = [rng.choice([broken_call(), rng.choice(WEIRD[:-1]), [broken_call()]]) for _ in range(rng.randrange(1, 20))]
            return msgpack.packb(items, use_bin_type=True)
        if kind == 6:  # one request over max_request_bytes, under max_frame_bytes
            return msgpack.packb(call(args={"padding": "x" * (MAX_REQUEST_BYTES + rng.randrange(1, 8000))}))
        if kind == 7:  # a batch with an oversized element and broken ones
            return msgpack.packb([broken_call(), call(args={"p": "y" * (MAX_REQUEST_BYTES + 10)}), broken_call()])
        return msgpack.packb(broken_call(), use_bin_type=True)

    frames = []
    for _ in range(NUM_FRAMES):
        if rng.random() < 0.1:  # wrong frame count: 2 to 5 payload frames, some empty
            frames.append([packed_garbage() if rng.random() < 0.7 else b"" for _ in range(rng.randrange(2, 6))])
        else:
            frames.append([packed_garbage()])
    return frames


def check_error_reply(reply) -> None:
    assert isinstance(reply, dict) and set(reply) == {"id", "ok", "content", "error", "latency_s"}, reply
    assert reply["ok"] is False and reply["content"] is None, reply
    assert reply["error"]["type"] in ERROR_TYPES and reply["error"]["message"], reply
    assert len(reply["error"]["message"]) < 1000, "an error message echoed too much of the request"


async def fuzz_service(proc, tool: str, seed: int) -> dict:
    """Send the frames in batches of BATCH; after each batch read every reply up to a barrier ping,
    then check a good call. Returns counts of the error types seen."""
    rng = random.Random(seed)
    frames = malformed_frames(rng, tool)
    args, good = GOOD_CALLS[tool]
    seen: dict[str, int] = {}
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(proc.endpoint)
    try:
        async with ToolClient([proc.endpoint]) as client:
            for start in range(0, NUM_FRAMES, BATCH):
                for multipart in frames[start:start + BATCH]:
                    await sock.send_multipart(multipart)
                await sock.send(msgpack.packb({"id": BARRIER_ID, "op": "ping"}))
                barrier = False
                while not barrier:
                    reply = msgpack.unpackb(await asyncio.wait_for(sock.recv(), 30), raw=False, strict_map_key=False)
                    for one in reply if isinstance(reply, list) else [reply]:
                        if one.get("id") == BARRIER_ID:
                            barrier = True
                            continue
                        check_error_reply(one)
                        seen[one["error"]["type"]] = seen.get(one["error"]["type"], 0) + 1
                resp = await client.call(tool, args)
                assert resp.ok and good(resp.content), (start, resp)
                assert proc.alive()
    finally:
        sock.close(0)
        ctx.term()
    return seen


@pytest.fixture(scope="module")
def calculator():
    proc = start_toolserver("calculator", LOCAL, "--max-request-bytes", str(MAX_REQUEST_BYTES),
                            "--max-frame-bytes", str(MAX_FRAME_BYTES))
    yield proc
    assert proc.stop(10) == 0


@pytest.mark.parametrize("tool", ["calculator", "search", "python"])
async def test_a_thousand_malformed_frames_get_error_replies_and_the_service_keeps_answering(tool, calculator, tmp_path):
    if tool == "calculator":
        proc, owned = calculator, False
    else:
        extra = ("--corpus", str(CORPUS), "--cache-dir", str(tmp_path / "cache")) if tool == "search" else ("--workers", "1")
        proc = start_toolserver(tool, LOCAL, "--max-request-bytes", str(MAX_REQUEST_BYTES),
                                "--max-frame-bytes", str(MAX_FRAME_BYTES), *extra)
        owned = True
    try:
        seen = await fuzz_service(proc, tool, seed={"calculator": 1, "search": 2, "python": 3}[tool])
    finally:
        if owned:
            assert proc.stop(15) == 0
    # The generator reached each kind of rejection.
    assert {P.E_MALFORMED, P.E_BAD_FRAMES, P.E_TOO_LARGE, P.E_UNKNOWN_TOOL, P.E_UNKNOWN_OP,
            P.E_INVALID_ARGS} <= set(seen), seen
    assert sum(seen.values()) >= NUM_FRAMES * 0.9


# --- sizes ---------------------------------------------------------------------------------------------


def peak_rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


async def test_a_frame_past_maxmsgsize_is_never_buffered_and_costs_only_its_senders_connection(calculator):
    """64 MiB to a server whose MAXMSGSIZE is 16 KiB: ZeroMQ drops that connection while reading the
    frame header, so the server's peak memory does not grow by the frame, and others are served."""
    before = peak_rss_bytes(calculator.pid)
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    sock.connect(calculator.endpoint)
    try:
        await sock.send(b"\x00" * (64 << 20))
        event = parse_monitor_message(await asyncio.wait_for(monitor.recv_multipart(), 10))
        assert event["event"] == zmq.EVENT_DISCONNECTED
        async with ToolClient([calculator.endpoint]) as client:
            assert (await client.call("calculator", {"expression": "6*7"})).content["value"] == "42"
    finally:
        sock.disable_monitor()
        monitor.close(0)
        sock.close(0)
        ctx.term()
    assert peak_rss_bytes(calculator.pid) - before < 16 << 20


async def test_an_oversized_element_is_answered_with_its_id_and_the_rest_of_its_batch_runs(calculator):
    batch = [
        {"id": 1, "op": "call", "tool": "calculator", "args": {"expression": "6*7"}, "timeout_s": 5},
        {"id": 2, "op": "call", "tool": "calculator", "args": {"expression": "1", "pad": "x" * 5000}, "timeout_s": 5},
        {"id": 3, "op": "call", "tool": "calculator", "args": {"expression": "2**10"}, "timeout_s": 5},
    ]
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(calculator.endpoint)
    try:
        await sock.send(msgpack.packb(batch))  # 5.2 KB: over max_request_bytes, under max_frame_bytes
        replies: dict = {}
        while len(replies) < 3:
            reply = msgpack.unpackb(await asyncio.wait_for(sock.recv(), 10))
            replies.update({r["id"]: r for r in (reply if isinstance(reply, list) else [reply])})
    finally:
        sock.close(0)
        ctx.term()
    assert replies[1]["content"]["value"] == "42" and replies[3]["content"]["value"] == "1024"
    assert replies[2]["error"]["type"] == "request_too_large" and "4096" in replies[2]["error"]["message"]


async def test_the_client_splits_a_burst_into_frames_the_server_accepts(calculator):
    """64 calls of ~1.9 KB issued in one event-loop turn are 120 KB together: one frame would pass
    the server's 16 KiB MAXMSGSIZE and cost the connection; split under 4 KiB, all are answered."""
    async with ToolClient([calculator.endpoint], max_request_bytes=MAX_REQUEST_BYTES) as client:
        expressions = [f"{i} + " + " + ".join(["0"] * 450) for i in range(64)]
        resps = await asyncio.gather(*[client.call("calculator", {"expression": e}) for e in expressions])
        too_big = await client.call("calculator", {"expression": "1" * 2000, "pad": "x" * 5000})
        stats = dict(client.stats)
    assert [r.content["value"] for r in resps] == [str(i) for i in range(64)]
    assert not too_big.ok and too_big.error.type == "request_too_large" and "not sent" in too_big.error.message
    assert stats["num_replica_deaths"] == 0


# --- a peer that stops reading -------------------------------------------------------------------------


class _Bulky(Tool):
    spec = ToolSpec("bulky", "returns 200 KB (or `size` bytes)",
                    {"type": "object", "properties": {"i": {"type": "integer"}, "size": {"type": "integer"}}},
                    idempotent=True)

    def run(self, args: dict) -> str:
        return "x" * args.get("size", 200_000)


async def test_a_peer_that_stops_reading_does_not_stall_the_replies_to_others():
    """Peer A reads nothing. It first sends one frame of 200 calls (all admitted together, 40 MB of
    replies: more than ZeroMQ's queue of 4 frames of at most 1 MiB plus any TCP buffers can take), so
    what is held for it passes 1 MiB and is dropped; its 200 later calls, sent one per frame, find
    it stalled and are answered `overloaded` (not run). Meanwhile peer B's 50 calls are all answered
    at once (before, the server stopped reading requests from everyone while a reply waited for A).
    B asks for 1 KB replies: 50 of 200 KB would overrun B's own 4-frame queue whenever the server
    answers faster than B reads, so B would be seen as stalled too (CI saw that once).
    (One call per frame alone left the drop to timing: a stall seen between read batches turns
    every later call into `overloaded` before 1 MiB is held.)"""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = ServerConfig(bind=f"tcp://127.0.0.1:{port}", sndhwm=4, max_reply_frame_bytes=1 << 20,
                          max_held_reply_bytes=1 << 20)
    server = ToolServer(config, [_Bulky()])
    thread = threading.Thread(target=server.serve, kwargs={"install_signal_handlers": False})
    thread.start()
    ctx = zmq.asyncio.Context()
    stalled = ctx.socket(zmq.DEALER)
    stalled.setsockopt(zmq.LINGER, 0)
    stalled.setsockopt(zmq.RCVHWM, 1)
    stalled.setsockopt(zmq.RCVBUF, 65536)
    stalled.connect(config.bind)
    try:
        await stalled.send(msgpack.packb([{"id": i, "op": "call", "tool": "bulky", "args": {"i": i}, "timeout_s": 30}
                                          for i in range(200)]))
        for i in range(200, 400):
            await stalled.send(msgpack.packb({"id": i, "op": "call", "tool": "bulky", "args": {"i": i}, "timeout_s": 30}))
        await asyncio.sleep(1.0)
        async with ToolClient([config.bind], request_timeout_s=10) as other:
            t0 = time.monotonic()
            resps = await asyncio.gather(*[other.call("bulky", {"i": i, "size": 1000}, deadline_s=10)
                                           for i in range(50)])
            elapsed_s = time.monotonic() - t0
    finally:
        stalled.close(0)
        ctx.term()
        server.stop()
        thread.join(10)
    assert all(r.ok and len(r.content) == 1000 for r in resps), [r for r in resps if not r.ok][:3]
    assert elapsed_s < 5.0, elapsed_s
    assert server.stats.num_errors["overloaded"] > 0 and server.stats.num_replies_dropped_stalled > 0, server.stats
    assert not thread.is_alive()


# --- garbage from a sandbox ------------------------------------------------------------------------------


def frame(obj) -> bytes:
    body = json.dumps(obj).encode()
    return struct.pack(">I", len(body)) + body


RESULT = {"stdout": "42\n", "stderr": "", "exit_code": 0, "limit": None, "duration_s": 0.001}


def test_the_frame_reader_takes_whole_frames_in_any_chunking():
    data = frame(RESULT) + frame({**RESULT, "stdout": "7\n"})
    rng = random.Random(0)
    for _ in range(200):
        reader, frames, i = FrameReader(1 << 16), [], 0
        while i < len(data):
            step = rng.randrange(1, 40)
            frames += reader.feed(data[i:i + step])
            i += step
        assert [check_result(f)["stdout"] for f in frames] == ["42\n", "7\n"]


@pytest.mark.parametrize("data, fragment", [
    (struct.pack(">I", 1 << 30), "1073741824 bytes announced"),
    (struct.pack(">I", 5) + b"{nope", "not JSON"),
    (struct.pack(">I", 3) + b"\xff\xfe\xfd", "not JSON"),
    (struct.pack(">I", 40000) + b"[" * 40000, "not JSON"),
    (frame([1, 2]), "not an object"),
    (frame("ready"), "not an object"),
])
def test_the_frame_reader_refuses_bytes_that_are_not_frames(data, fragment):
    with pytest.raises(SandboxProtocolError, match=fragment):
        FrameReader(1 << 16).feed(data)


@pytest.mark.parametrize("result, fragment", [
    ({**RESULT, "extra": 1}, "fields"),
    ({k: v for k, v in RESULT.items() if k != "limit"}, "fields"),
    ({**RESULT, "exit_code": True}, "exit_code"),
    ({**RESULT, "exit_code": "0"}, "exit_code"),
    ({**RESULT, "stdout": None}, "stdout"),
    ({**RESULT, "duration_s": [1]}, "duration_s"),
    ({**RESULT, "limit": "everything"}, "unknown limit"),
    ({**RESULT, "limit": 3}, "limit"),
])
def test_results_with_wrong_fields_or_types_are_refused(result, fragment):
    with pytest.raises(SandboxProtocolError, match=fragment):
        check_result(result)


def test_random_byte_streams_give_frames_or_protocol_errors_only():
    rng = random.Random(7)
    for _ in range(1000):
        reader = FrameReader(4096)
        try:
            for _ in range(5):
                for one in reader.feed(rng.randbytes(rng.randrange(0, 64)) if rng.random() < 0.5 else
                                       struct.pack(">I", rng.randrange(0, 64)) + rng.randbytes(rng.randrange(0, 64))):
                    check_result(one)
        except SandboxProtocolError:
            pass


def _protocol_pipe_of_the_sandbox(server_pid: int) -> str:
    """/proc path of the write end of the zygote's result pipe (the server reads the other end)."""
    bwrap = [int(p) for p in subprocess.run(["ps", "-o", "pid=", "--ppid", str(server_pid)], capture_output=True,
                                            text=True).stdout.split()]
    (zygote,) = [int(p) for p in subprocess.run(["ps", "-o", "pid=", "--ppid", str(bwrap[0])], capture_output=True,
                                                text=True).stdout.split()]
    server_pipes = {os.readlink(f"/proc/{server_pid}/fd/{fd}") for fd in os.listdir(f"/proc/{server_pid}/fd")}
    for fd in os.listdir(f"/proc/{zygote}/fd"):
        target = os.readlink(f"/proc/{zygote}/fd/{fd}")
        flags = int(Path(f"/proc/{zygote}/fdinfo/{fd}").read_text().split("flags:")[1].split()[0], 8)
        if target.startswith("pipe:") and target in server_pipes and flags & os.O_WRONLY:
            return f"/proc/{zygote}/fd/{fd}"
    raise AssertionError("no result pipe shared by the server and its zygote")


@pytest.mark.parametrize("garbage", [
    b"\x00\x00\x00\x05{nope",
    struct.pack(">I", 1 << 31),
    frame({"ready": True}),
    frame({**RESULT, "limit": "forged"}),
    frame({**RESULT, "exit_code": "0"}),
    b"\xff" + random.Random(5).randbytes(1023),
])
async def test_garbage_in_a_sandboxs_protocol_pipe_restarts_that_sandbox_only(garbage):
    """Written from the host into the zygote's real result pipe while a call sleeps in it: the call
    is answered `sandbox_error` naming the protocol, the slot restarts, the server lives and
    answers the next call. (A well-formed result frame would be taken as the call's result: only
    root on the host can write there, and nothing can tell it from the zygote's.)"""
    # The call would sleep 60 s: the garbage ends it at once, and it is surely still running when the
    # write lands, however slowly a loaded machine finds the pipe (a 3 s sleep once ended first).
    proc = start_toolserver("python", LOCAL, "--workers", "1", "--default-timeout-s", "90", "--max-timeout-s", "90")
    try:
        async with ToolClient([proc.endpoint]) as client:
            running = asyncio.create_task(client.call("python", {"code": "import time; time.sleep(60); print('slept')"}))
            await asyncio.sleep(0)
            await client.describe()  # the call is running once this is answered
            with open(_protocol_pipe_of_the_sandbox(proc.pid), "wb") as pipe:
                pipe.write(garbage)
            resp = await asyncio.wait_for(running, 45)
            after = await client.call("python", {"code": "print(6 * 7)"})
        assert not resp.ok and resp.error.type == "sandbox_error" and "protocol" in resp.error.message, resp
        assert after.ok and after.content["stdout"] == "42\n", after
        assert proc.alive()
    finally:
        assert proc.stop(15) == 0


# --- garbage to the client ---------------------------------------------------------------------------------


async def test_the_client_drops_garbage_replies_and_goes_on():
    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    describe = [{"type": "function", "idempotent": True,
                 "function": {"name": "echo", "description": "", "parameters": {"type": "object"}}}]
    garbage = [b"\xc1", b"", msgpack.packb("hello"), msgpack.packb([1, 2]), msgpack.packb({"id": "x", "ok": True}),
               msgpack.packb({"id": 5, "ok": False, "content": None, "error": None, "latency_s": 0}),
               msgpack.packb({"id": 5, "ok": True, "content": 1, "error": {"type": 1}, "latency_s": 0}),
               msgpack.packb({"id": 5, "ok": True, "content": 1, "error": None, "latency_s": "soon"}),
               os.urandom(300)]

    async def serve():
        while True:
            peer, payload = await router.recv_multipart()
            msg = msgpack.unpackb(payload)
            for one in msg if isinstance(msg, list) else [msg]:
                if one["op"] == "call":
                    for junk in garbage:
                        await router.send_multipart([peer, junk])
                content = describe if one["op"] == "describe" else one.get("args", {})
                await router.send_multipart([peer, msgpack.packb(
                    {"id": one["id"], "ok": True, "content": content, "error": None, "latency_s": 0.0})])

    task = asyncio.create_task(serve())
    try:
        async with ToolClient([f"tcp://127.0.0.1:{port}"], max_reply_bytes=1 << 20) as client:
            resp = await client.call("echo", {"v": 1})
            again = await client.call("echo", {"v": 2})
            assert client._replicas[0].sock.getsockopt(zmq.MAXMSGSIZE) == 1 << 20
            stats = dict(client.stats)
    finally:
        task.cancel()
        router.close(0)
        ctx.term()
    assert resp.ok and resp.content == {"v": 1} and again.content == {"v": 2}
    assert stats["num_bad_replies"] >= 2 * (len(garbage) - 1)
