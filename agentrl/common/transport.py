"""Orchestrator -> learner streaming of trajectory groups, acknowledged; learner -> orchestrator versions.

Sockets (loopback by default):
    orchestrator GroupSender (DEALER, connects) ──groups──> learner GroupReceiver (ROUTER, binds)
                             <──────── acks ──────────
    orchestrator VersionSubscriber (SUB, connects) <── {"version", "served_version"} ── learner VersionPublisher (PUB, binds)

Messages. Group: [b"group", *trajectory.encode_group(group)] (msgpack header + raw numpy frames).
Ack: [b"ack", group_id utf-8]. Version: one msgpack frame {"version": int, "served_version": int}.

Delivery invariant: every group handed to `GroupSender.send` reaches the learner's ledger at least
once, and the learner counts it once:
- the sender keeps each group until its ack arrives (`num_unacked`);
- after the DEALER reconnects (learner restarted, connection dropped: a socket-monitor
  CONNECTED event after the first) every unacked group is resent, since ZeroMQ drops what was queued
  in the dead connection; as a last resort, a group unacked for `resend_after_s` is resent too;
- the learner acks a group only once it is in its ledger, and acks duplicates (same group_id)
  again so the sender stops resending, while skipping them. Resends are therefore harmless.

Backpressure: `send` blocks while `max_unacked` groups await an ack, so a learner that falls
behind stops the orchestrator (which then stops starting episodes) instead of growing memory.
Memory on the sender is bounded by max_unacked groups.

Version updates: the publisher re-sends the latest pair every `republish_interval_s`, so a
subscriber that (re)connects late learns the current versions within that interval (PUB/SUB drops
messages sent before a subscriber joins).

Shutdown: `close(timeout_s)` cancels the background tasks this object owns and closes its sockets
with linger 0; it does not wait for acks (unacked groups are reported by `num_unacked`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import msgpack
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from agentrl.common.trajectory import TrajectoryGroup, decode_group, encode_group

log = logging.getLogger(__name__)

GROUP, ACK = b"group", b"ack"


class _Owned:
    """Owns a zmq context and background tasks; `_stop` cancels them within a bound."""

    def __init__(self) -> None:
        self._ctx: zmq.asyncio.Context | None = None
        self._tasks: list[asyncio.Task] = []

    def _spawn(self, coro, name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        task.add_done_callback(self._report)
        self._tasks.append(task)

    @staticmethod
    def _report(task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("transport task %s died: %r", task.get_name(), task.exception())

    async def _stop(self, timeout_s: float) -> None:
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=timeout_s)
        self._tasks.clear()
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None


class GroupSender(_Owned):
    def __init__(self, endpoint: str, *, max_unacked: int = 32, resend_after_s: float = 60.0):
        super().__init__()
        if max_unacked < 1:
            raise ValueError("GroupSender.max_unacked must be >= 1")
        self.endpoint = endpoint
        self.max_unacked = max_unacked
        self.resend_after_s = resend_after_s
        """A group unacked this long is resent (the learner dedups), seconds."""
        self._unacked: OrderedDict[str, tuple[list[bytes], float]] = OrderedDict()
        self._space = asyncio.Condition()
        self._sock: zmq.asyncio.Socket | None = None
        self.num_sent = 0
        self.num_resent = 0
        self.num_acked = 0

    @property
    def num_unacked(self) -> int:
        return len(self._unacked)

    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.RECONNECT_IVL, 100)
        monitor = self._sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self._sock.connect(self.endpoint)
        self._spawn(self._read_acks(), "group-sender-acks")
        self._spawn(self._watch_reconnects(monitor), "group-sender-monitor")
        self._spawn(self._resend_stale(), "group-sender-resend")

    async def close(self, timeout_s: float = 5.0) -> None:
        if self._sock is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._sock.disable_monitor()
        await self._stop(timeout_s)
        self._sock = None

    async def send(self, group: TrajectoryGroup) -> None:
        if self._sock is None:
            raise RuntimeError("GroupSender.send before start()")
        async with self._space:
            await self._space.wait_for(lambda: len(self._unacked) < self.max_unacked)
            frames = [GROUP, *encode_group(group)]
            self._unacked[group.group_id] = (frames, time.monotonic())
        await self._sock.send_multipart(frames, copy=False)
        self.num_sent += 1

    async def wait_all_acked(self, timeout_s: float) -> bool:
        """True once nothing is unacked; False if `timeout_s` passed first."""
        async with self._space:
            try:
                await asyncio.wait_for(self._space.wait_for(lambda: not self._unacked), timeout_s)
            except TimeoutError:
                return False
        return True

    async def _read_acks(self) -> None:
        while True:
            frames = await self._sock.recv_multipart()
            if len(frames) != 2 or frames[0] != ACK:
                log.error("GroupSender: ignoring a message that is not an ack (%d frames)", len(frames))
                continue
            async with self._space:
                if self._unacked.pop(frames[1].decode(), None) is not None:
                    self.num_acked += 1
                    self._space.notify_all()

    async def _resend_all(self, reason: str) -> None:
        pending = list(self._unacked.items())
        if pending:
            log.info("GroupSender: resending %d unacked groups (%s)", len(pending), reason)
        for group_id, (frames, _) in pending:
            if group_id in self._unacked:
                self._unacked[group_id] = (frames, time.monotonic())
                await self._sock.send_multipart(frames, copy=False)
                self.num_resent += 1

    async def _watch_reconnects(self, monitor: zmq.asyncio.Socket) -> None:
        num_connects = 0
        try:
            while True:
                event = parse_monitor_message(await monitor.recv_multipart())
                if event["event"] == zmq.EVENT_CONNECTED:
                    num_connects += 1
                    if num_connects > 1:
                        await self._resend_all("reconnected")
        finally:
            monitor.close(linger=0)

    async def _resend_stale(self) -> None:
        while True:
            await asyncio.sleep(min(self.resend_after_s / 4, 5.0))
            now = time.monotonic()
            if any(now - sent_at > self.resend_after_s for _, sent_at in self._unacked.values()):
                await self._resend_all(f"unacked for more than {self.resend_after_s} s")


@dataclass
class ReceivedGroup:
    group: TrajectoryGroup
    sender: bytes
    """ZeroMQ routing id of the sending orchestrator (where the ack goes)."""


class GroupReceiver(_Owned):
    def __init__(self, endpoint: str, *, max_queued_messages: int = 64):
        super().__init__()
        self.endpoint = endpoint
        self.max_queued_messages = max_queued_messages
        """ROUTER receive high-water mark, in messages; beyond it the senders' DEALERs block."""
        self._sock: zmq.asyncio.Socket | None = None
        self.num_malformed = 0
        self.num_unroutable_acks = 0

    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an ack to a vanished sender raises instead of vanishing
        self._sock.setsockopt(zmq.RCVHWM, self.max_queued_messages)
        self._sock.bind(self.endpoint)

    async def close(self, timeout_s: float = 5.0) -> None:
        await self._stop(timeout_s)
        self._sock = None

    async def recv(self) -> ReceivedGroup:
        """The next well-formed group. A malformed message is logged, counted in `num_malformed`
        and skipped (it cannot be acked by group id, and the learner must keep running)."""
        if self._sock is None:
            raise RuntimeError("GroupReceiver.recv before start()")
        while True:
            frames = await self._sock.recv_multipart(copy=True)
            sender, kind, payload = frames[0], frames[1] if len(frames) > 1 else b"", frames[2:]
            if kind != GROUP:
                self.num_malformed += 1
                log.error("GroupReceiver: message of unknown kind %r from %r", kind[:16], sender)
                continue
            try:
                return ReceivedGroup(decode_group(payload), sender)
            except (ValueError, KeyError, TypeError, msgpack.UnpackException) as err:
                self.num_malformed += 1
                log.error("GroupReceiver: malformed group from %r: %s", sender, err)

    async def ack(self, received: ReceivedGroup) -> None:
        try:
            await self._sock.send_multipart([received.sender, ACK, received.group.group_id.encode()])
        except zmq.error.ZMQError as err:
            if err.errno != zmq.EHOSTUNREACH:
                raise
            # The sender disconnected; it resends its unacked groups when it reconnects, and they are acked then.
            self.num_unroutable_acks += 1
            log.warning("GroupReceiver: sender of group %s is gone; its resend will be acked", received.group.group_id)


class VersionPublisher(_Owned):
    def __init__(self, endpoint: str, *, republish_interval_s: float = 1.0):
        super().__init__()
        self.endpoint = endpoint
        self.republish_interval_s = republish_interval_s
        self._sock: zmq.asyncio.Socket | None = None
        self._latest: bytes | None = None

    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(self.endpoint)
        self._spawn(self._republish(), "version-republish")

    async def publish(self, version: int, served_version: int) -> None:
        self._latest = msgpack.packb({"version": int(version), "served_version": int(served_version)})
        await self._sock.send(self._latest)

    async def close(self, timeout_s: float = 5.0) -> None:
        await self._stop(timeout_s)
        self._sock = None

    async def _republish(self) -> None:
        while True:
            await asyncio.sleep(self.republish_interval_s)
            if self._latest is not None:
                await self._sock.send(self._latest)


class VersionSubscriber(_Owned):
    def __init__(self, endpoint: str):
        super().__init__()
        self.endpoint = endpoint
        self.latest: tuple[int, int] | None = None
        """(learner version, served version) last heard; None until the first message."""
        self._changed = asyncio.Condition()

    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(self.endpoint)
        self._spawn(self._listen(sock), "version-subscriber")

    async def close(self, timeout_s: float = 5.0) -> None:
        await self._stop(timeout_s)

    async def wait_until(self, pred: Callable[[tuple[int, int]], bool], timeout_s: float | None = None) -> tuple[int, int]:
        """Wait until `pred(latest)` holds (latest not None); raises TimeoutError after `timeout_s`."""
        async with self._changed:
            await asyncio.wait_for(self._changed.wait_for(lambda: self.latest is not None and pred(self.latest)), timeout_s)
            return self.latest

    async def _listen(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            msg = msgpack.unpackb(await sock.recv())
            latest = (int(msg["version"]), int(msg["served_version"]))
            if latest != self.latest:
                async with self._changed:
                    self.latest = latest
                    self._changed.notify_all()
