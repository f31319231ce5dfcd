"""Fault test: two replicas of `search`, one SIGKILLed mid-load.

Every request must complete with the right answer (those in flight on the killed replica are
resent to the survivor, since search is idempotent), exactly once: the caller gets one response
per call, matched to its own query, and nothing is left pending.
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import pytest

from agentrl.toolservers.client import ToolClient
from agentrl.toolservers.process import start_toolserver

CORPUS = Path(__file__).parent / "fixtures" / "toolservers" / "passages.jsonl"
NUM_CALLS = 3000
IN_FLIGHT = 64
KILL_AFTER = 600


@pytest.mark.alone  # its liveness is judged by 0.2 s heartbeats: it failed beside a run
async def test_sigkill_one_of_two_search_replicas_mid_load(tmp_path):
    args = ("--corpus", str(CORPUS), "--cache-dir", str(tmp_path / "cache"))
    victim = start_toolserver("search", "tcp://127.0.0.1:*", *args)
    survivor = start_toolserver("search", "tcp://127.0.0.1:*", *args)
    try:
        async with ToolClient([victim.endpoint, survivor.endpoint], heartbeat_interval_s=0.2) as client:
            answers: dict[int, list] = {}
            num_done = 0
            killed = asyncio.Event()
            queue: asyncio.Queue[int] = asyncio.Queue()
            for i in range(NUM_CALLS):
                queue.put_nowait(i)

            async def worker():
                nonlocal num_done
                while not queue.empty():
                    i = queue.get_nowait()
                    resp = await client.call("search", {"query": f"company number {1000 + i % 200}", "top_k": 1})
                    answers.setdefault(i, []).append(resp)
                    num_done += 1
                    if num_done == KILL_AFTER:
                        victim.kill(signal.SIGKILL)
                        killed.set()

            await asyncio.gather(*[worker() for _ in range(IN_FLIGHT)])
            stats = dict(client.stats)
            pending_left = sum(len(r.pending) for r in client._replicas)
    finally:
        victim.stop(10)
        assert survivor.stop(10) == 0

    assert killed.is_set() and victim.popen.returncode == -signal.SIGKILL
    assert sorted(answers) == list(range(NUM_CALLS))
    assert all(len(resps) == 1 for resps in answers.values()), "a call was answered twice"
    for i, (resp,) in answers.items():
        assert resp.ok, (i, resp.error)
        assert resp.content[0]["id"] == f"p{i % 200:03d}", f"call {i} got another call's answer"
    replicas = [resps[0].replica for _, resps in sorted(answers.items())]
    assert victim.endpoint in replicas[:KILL_AFTER], "the victim served nothing before the kill"
    assert set(replicas[KILL_AFTER + IN_FLIGHT:]) == {survivor.endpoint}
    assert stats["num_replica_deaths"] == 1
    assert stats["num_resent"] >= 1, "no call was in flight on the victim when it died"
    assert pending_left == 0


async def test_a_replica_started_again_at_another_endpoint_is_followed():
    """A replica whose node was lost starts again elsewhere, at another endpoint: `move` points the
    client there; the heartbeat's probe finds it and calls go to it again. An unknown endpoint is a
    KeyError naming the replicas."""
    first = start_toolserver("calculator", "tcp://127.0.0.1:*")
    moved = None
    try:
        async with ToolClient([first.endpoint], heartbeat_interval_s=0.2, request_timeout_s=10) as client:
            assert (await client.call("calculator", {"expression": "6*7"})).content["value"] == "42"
            old = first.endpoint
            first.kill(signal.SIGKILL)
            moved = start_toolserver("calculator", "tcp://127.0.0.1:*")
            assert moved.endpoint != old
            try:
                client.move("tcp://127.0.0.1:1", moved.endpoint)
            except KeyError as err:
                assert old in str(err)
            else:
                raise AssertionError("moving an unknown replica must raise")
            client.move(old, moved.endpoint)
            for _ in range(100):
                if client.live_replicas() == [moved.endpoint]:
                    break
                await asyncio.sleep(0.1)
            assert client.live_replicas() == [moved.endpoint]
            resp = await client.call("calculator", {"expression": "2+3"})
            assert resp.ok and resp.content["value"] == "5" and resp.replica == moved.endpoint
    finally:
        first.stop(10)
        if moved is not None:
            assert moved.stop(10) == 0
