"""GroupSender/GroupReceiver and VersionPublisher/VersionSubscriber over real ZeroMQ sockets; the
inference client's HTTP/1.1 layer against a real aiohttp server on a loopback socket."""

from __future__ import annotations

import asyncio
import contextlib
import socket

import msgspec
import numpy as np
import pytest
from aiohttp import web

from agentrl.common.inference import (
    InferenceServerError,
    InferenceServerUnavailable,
    SamplingParams,
    VLLMClient,
)
from agentrl.common.trajectory import Trajectory, TrajectoryGroup, Turn
from agentrl.common.transport import GroupReceiver, GroupSender, VersionPublisher, VersionSubscriber


def endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def group(group_id: str, num_samples: int = 2) -> TrajectoryGroup:
    trajs = []
    for i in range(num_samples):
        ids = np.arange(10, dtype=np.int32)
        is_action = np.array([0] * 6 + [1] * 4, dtype=np.uint8)
        logprobs = np.where(is_action == 1, -0.5, 0.0).astype(np.float32)
        versions = np.where(is_action == 1, 3, -1).astype(np.int32)
        trajs.append(Trajectory("t", group_id, i, ids, is_action, logprobs, versions, 6, [Turn(6, 10, 10, {"valid_call": 0.1})], 1.0))
    return TrajectoryGroup(group_id, "t", trajs)


async def test_groups_arrive_intact_and_acks_clear_the_sender():
    ep = endpoint()
    receiver, sender = GroupReceiver(ep), GroupSender(ep, max_unacked=8)
    await receiver.start()
    await sender.start()
    try:
        for i in range(5):
            await sender.send(group(f"g{i}"))
        got = []
        for _ in range(5):
            received = await asyncio.wait_for(receiver.recv(), 10)
            got.append(received.group)
            await receiver.ack(received)
        assert [g.group_id for g in got] == [f"g{i}" for i in range(5)]
        assert got[0].trajectories[1].turns[0].process_rewards == {"valid_call": 0.1}
        assert np.array_equal(got[0].trajectories[0].behavior_logprobs, group("x").trajectories[0].behavior_logprobs)
        assert await sender.wait_all_acked(10) and sender.num_unacked == 0
    finally:
        await sender.close()
        await receiver.close()


async def test_send_blocks_while_max_unacked_groups_wait():
    ep = endpoint()
    receiver, sender = GroupReceiver(ep), GroupSender(ep, max_unacked=2)
    await receiver.start()
    await sender.start()
    try:
        await sender.send(group("a"))
        await sender.send(group("b"))
        third = asyncio.create_task(sender.send(group("c")))
        await asyncio.sleep(0.3)
        assert not third.done() and sender.num_unacked == 2
        await receiver.ack(await asyncio.wait_for(receiver.recv(), 10))
        await asyncio.wait_for(third, 10)
        assert sender.num_unacked == 2
    finally:
        await sender.close()
        await receiver.close()


async def test_unacked_groups_are_resent_to_a_restarted_learner_which_dedups():
    ep = endpoint()
    sender = GroupSender(ep, max_unacked=8)
    first = GroupReceiver(ep)
    await first.start()
    await sender.start()
    await sender.send(group("a"))
    await sender.send(group("b"))
    ledger = set()
    received = await asyncio.wait_for(first.recv(), 10)  # "a" reaches the ledger and is acked; "b" is lost in the crash
    ledger.add(received.group.group_id)
    await first.ack(received)
    await asyncio.sleep(0.2)
    await first.close()  # learner dies before acking "b"
    second = GroupReceiver(ep)
    await second.start()
    try:
        seen = []
        while sender.num_unacked:
            r = await asyncio.wait_for(second.recv(), 10)
            seen.append(r.group.group_id)
            ledger.add(r.group.group_id)  # a duplicate is skipped by the ledger but acked again
            await second.ack(r)
            await asyncio.sleep(0.05)
        assert "b" in seen and ledger == {"a", "b"} and sender.num_resent >= 1
    finally:
        await sender.close()
        await second.close()


async def test_a_learner_that_moved_gets_the_unacked_groups_and_publishes_versions_at_its_new_endpoints():
    """A learner started again on another node binds other endpoints: the sender and the subscriber
    move there (the run's service directory says where), and every unacked group is resent there."""
    first_ep = endpoint()
    sender = GroupSender(first_ep, max_unacked=8)
    versions = VersionSubscriber(endpoint())
    first = GroupReceiver(first_ep)
    await first.start()
    await sender.start()
    await versions.start()
    second_ep, second_versions_ep = endpoint(), endpoint()
    second, publisher = GroupReceiver(second_ep), VersionPublisher(second_versions_ep, republish_interval_s=0.1)
    try:
        await sender.send(group("a"))
        received = await asyncio.wait_for(first.recv(), 10)
        await first.ack(received)
        await asyncio.sleep(0.2)
        await first.close()  # its node is lost before "b" arrives
        await sender.send(group("b"))
        await second.start()
        await publisher.start()
        sender.move(second_ep)
        versions.move(second_versions_ep)
        r = await asyncio.wait_for(second.recv(), 10)
        assert r.group.group_id == "b" and sender.endpoint == second_ep
        await second.ack(r)
        await publisher.publish(7, 6)
        assert await versions.wait_until(lambda v: v[0] == 7, timeout_s=10) == (7, 6)
        assert await sender.wait_all_acked(10)
    finally:
        await versions.close()
        await sender.close()
        await second.close()
        await publisher.close()


async def test_groups_sent_towards_a_learner_that_never_answered_reach_it_where_it_moved():
    """The learner's first endpoint never answered (its node was lost before it bound): the groups
    queued for it are dropped with that connection, and resent at the first connect to where it
    moved, with no second connect to trigger a resend."""
    sender = GroupSender(endpoint(), max_unacked=8)
    await sender.start()
    moved_ep = endpoint()
    receiver = GroupReceiver(moved_ep)
    try:
        await sender.send(group("a"))
        await sender.send(group("b"))
        await receiver.start()
        sender.move(moved_ep)
        seen = []
        for _ in range(2):
            r = await asyncio.wait_for(receiver.recv(), 10)
            seen.append(r.group.group_id)
            await receiver.ack(r)
        assert sorted(seen) == ["a", "b"] and await sender.wait_all_acked(10) and sender.num_resent >= 2
    finally:
        await sender.close()
        await receiver.close()


async def test_malformed_message_is_counted_and_skipped():
    import zmq
    import zmq.asyncio

    ep = endpoint()
    receiver = GroupReceiver(ep)
    await receiver.start()
    ctx = zmq.asyncio.Context()
    bad = ctx.socket(zmq.DEALER)
    bad.connect(ep)
    sender = GroupSender(ep)
    await sender.start()
    try:
        receiving = asyncio.create_task(receiver.recv())
        await bad.send_multipart([b"group", b"\x00not msgpack"])
        for _ in range(200):  # the receiver reads, counts and skips it, and keeps waiting
            if receiver.num_malformed:
                break
            await asyncio.sleep(0.05)
        assert receiver.num_malformed == 1 and not receiving.done()
        await sender.send(group("ok"))
        assert (await asyncio.wait_for(receiving, 10)).group.group_id == "ok"
    finally:
        ctx.destroy(linger=0)
        await sender.close()
        await receiver.close()


async def test_versions_reach_a_late_subscriber():
    ep = endpoint()
    pub = VersionPublisher(ep, republish_interval_s=0.1)
    await pub.start()
    await pub.publish(5, 3)
    sub = VersionSubscriber(ep)  # joins after the publish: learns the value from a republish
    await sub.start()
    try:
        assert await sub.wait_until(lambda v: True, timeout_s=10) == (5, 3)
        await pub.publish(6, 6)
        assert await sub.wait_until(lambda v: v[1] == 6, timeout_s=10) == (6, 6)
        with pytest.raises(TimeoutError):
            await sub.wait_until(lambda v: v[0] > 100, timeout_s=0.3)
    finally:
        await sub.close()
        await pub.close()


# ------------------------------------------------------------------ inference client over HTTP/1.1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def answer(ids: list[int], spans: list[tuple[int, int, str]]) -> bytes:
    choice = {"token_ids": ids, "finish_reason": "stop",
              "logprobs": {"content": [{"token_id": i, "logprob": -0.1 * i, "top_logprobs": []} for i in ids]},
              "weight_versions": [{"start": a, "end": b, "version": v} for a, b, v in spans]}
    return msgspec.json.encode({"request_id": "r", "choices": [choice]})


@contextlib.asynccontextmanager
async def http_server(port: int | None = None):
    """A real HTTP server whose answer to /inference/v1/generate depends on the first prompt id:
    1 -> Content-Length answer, 2 -> chunked answer in pieces, 3 -> Connection: close, 4 -> HTTP 400,
    5 -> the connection is cut after half the headers, 6 -> a normal answer, then an unsolicited
    second answer on the idle connection. Records the client port of every request."""
    peers: list[int] = []

    async def generate(request: web.Request) -> web.StreamResponse:
        peers.append(request.transport.get_extra_info("peername")[1])
        body = msgspec.json.decode(await request.read())
        prompt, max_tokens = body["token_ids"], body["sampling_params"]["max_tokens"]
        ids = [prompt[-1] + k for k in range(max_tokens)]
        kind = prompt[0]
        if kind == 1:
            return web.Response(body=answer(ids, [(0, len(ids), "default")]), content_type="application/json")
        if kind == 2:
            resp = web.StreamResponse()
            resp.enable_chunked_encoding()
            resp.content_type = "application/json"
            await resp.prepare(request)
            data = answer(ids, [(0, 2, "default"), (2, len(ids), "7")])
            for k in range(0, len(data), 17):
                await resp.write(data[k:k + 17])
                await asyncio.sleep(0)
            await resp.write_eof()
            return resp
        if kind == 3:
            return web.Response(body=answer(ids, [(0, len(ids), "3")]), content_type="application/json",
                                headers={"Connection": "close"})
        if kind == 4:
            return web.json_response({"error": "prompt too long"}, status=400)
        if kind == 7:  # what vLLM answers while its engine is dead
            return web.json_response({"error": {"message": "EngineCore encountered an issue."}}, status=500)
        if kind == 6:
            stray = answer([999], [(0, 1, "999")])
            stray_head = f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(stray)}\r\n\r\n"
            transport = request.transport
            asyncio.get_running_loop().call_later(0.05, lambda: transport.write(stray_head.encode() + stray))
            return web.Response(body=answer(ids, [(0, len(ids), "6")]), content_type="application/json")
        request.transport.write(b"HTTP/1.1 200 OK\r\nContent-Le")
        request.transport.abort()
        return web.Response()  # goes nowhere: the connection is gone

    async def health(request: web.Request) -> web.Response:
        return web.Response()

    app = web.Application()
    app.router.add_post("/inference/v1/generate", generate)
    app.router.add_get("/health", health)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = port or _free_port()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    try:
        yield f"http://127.0.0.1:{port}", peers
    finally:
        await runner.cleanup()


async def test_client_reads_length_and_chunked_answers_over_reused_connections():
    async with http_server() as (url, peers), VLLMClient(url) as client:
        for _ in range(3):
            gen = await client.generate([1, 50, 60], SamplingParams(max_tokens=4))
            assert gen.token_ids == [60, 61, 62, 63] and gen.versions == [0] * 4 and gen.server == url
            assert gen.logprobs == pytest.approx([-6.0, -6.1, -6.2, -6.3])
        chunked = await client.generate([2, 70], SamplingParams(max_tokens=5))
        assert chunked.token_ids == [70, 71, 72, 73, 74] and chunked.versions == [0, 0, 7, 7, 7]
        # Many at once: each needs its own connection; afterwards they are all reused.
        many = await asyncio.gather(*(client.generate([1, i], SamplingParams(max_tokens=2)) for i in range(32)))
        assert [g.token_ids for g in many] == [[i, i + 1] for i in range(32)]
        num_connections = len(set(peers))
        await asyncio.gather(*(client.generate([1, i], SamplingParams(max_tokens=2)) for i in range(32)))
        assert len(set(peers)) == num_connections <= 33
        # An answer that closes its connection is read whole; the next request opens a new one.
        closing = await client.generate([3, 80], SamplingParams(max_tokens=2))
        assert closing.token_ids == [80, 81] and closing.versions == [3, 3]
        again = await client.generate([1, 90], SamplingParams(max_tokens=2))
        assert again.token_ids == [90, 91]


async def test_client_separates_rejections_from_unavailability():
    async with http_server() as (url, _), VLLMClient(url, request_timeout_s=5.0) as client:
        with pytest.raises(InferenceServerError, match="HTTP 400.*prompt too long") as rejected:
            await client.generate([4, 1], SamplingParams(max_tokens=2))
        assert not isinstance(rejected.value, InferenceServerUnavailable)
        with pytest.raises(InferenceServerUnavailable, match="closed the connection"):
            await client.generate([5, 1], SamplingParams(max_tokens=2))
        # A 5xx is the server failing, not the request: unavailable (the pool asks /health, retries).
        with pytest.raises(InferenceServerUnavailable, match="HTTP 500.*EngineCore"):
            await client.generate([7, 1], SamplingParams(max_tokens=2))
        # The client is still usable afterwards.
        assert (await client.generate([1, 5], SamplingParams(max_tokens=1))).token_ids == [5]
        # Bytes arriving on an idle connection are never read as a later request's answer.
        assert (await client.generate([6, 40], SamplingParams(max_tokens=1))).token_ids == [40]
        await asyncio.sleep(0.3)
        later = await client.generate([1, 41], SamplingParams(max_tokens=2))
        assert later.token_ids == [41, 42] and later.versions == [0, 0]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]
    async with VLLMClient(f"http://127.0.0.1:{dead_port}") as client:
        with pytest.raises(InferenceServerUnavailable, match="ConnectionRefused"):
            await client.generate([1, 2], SamplingParams(max_tokens=2))
        assert not await client.health()


async def test_a_request_waits_for_a_restarting_server_within_the_pools_wait():
    """With every server down, a request waits up to `no_server_wait_s` for one to answer again (the
    run starting it again at its URL) instead of failing its episode at once."""
    from agentrl.engine.pool import ServerPool

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    async with ServerPool([url], probe_interval_s=0.2, no_server_wait_s=20.0) as pool:
        async def restart_later():
            await asyncio.sleep(1.0)
            return http_server(port)

        later = asyncio.create_task(restart_later())
        request = asyncio.create_task(pool.generate([1, 9], SamplingParams(max_tokens=2)))
        async with await later:
            generation = await asyncio.wait_for(request, 20)
        assert generation.token_ids == [9, 10] and pool.num_retries >= 1
    async with ServerPool([url], probe_interval_s=0.2, no_server_wait_s=0.0) as pool:  # no wait: fails at once
        with pytest.raises(InferenceServerUnavailable, match="no live inference server"):
            await pool.generate([1, 9], SamplingParams(max_tokens=2))


async def test_the_pool_follows_a_server_that_moved():
    """A server started again at another address: `move` points its place in the pool there; the
    probe puts it back when it answers, and requests go there."""
    from agentrl.engine.pool import ServerPool

    old_url = f"http://127.0.0.1:{_free_port()}"
    port = _free_port()
    async with ServerPool([old_url], probe_interval_s=0.2, no_server_wait_s=20.0) as pool:
        with pytest.raises(KeyError, match="no server http://elsewhere"):
            pool.move("http://elsewhere:1", "http://x:2")
        async with http_server(port):
            pool.move(old_url, f"http://127.0.0.1:{port}")
            generation = await asyncio.wait_for(pool.generate([1, 9], SamplingParams(max_tokens=2)), 20)
            assert generation.token_ids == [9, 10] and pool.live_servers == [f"http://127.0.0.1:{port}"]
