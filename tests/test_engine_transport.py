"""GroupSender/GroupReceiver and VersionPublisher/VersionSubscriber over real ZeroMQ sockets."""

from __future__ import annotations

import asyncio
import socket

import numpy as np
import pytest

from agentrl.engine.trajectory import Trajectory, TrajectoryGroup, Turn
from agentrl.engine.transport import GroupReceiver, GroupSender, VersionPublisher, VersionSubscriber


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
