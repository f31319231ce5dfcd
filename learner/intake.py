"""Intake: where a learner's groups come from, and the bookkeeping that makes consumption exactly-once.

Owns the receiver (the socket), the spool (received groups on disk) and the ledger (what became of
each group); ledger.py says why that order of operations is exactly-once across a kill -9.

Order of supply: groups carried over from the previous step (a group that did not fit the last
token budget), then spooled groups the ledger does not cover (replayed after a restart, in arrival
order), then the socket. A new group is spooled, then acknowledged; a duplicate (already in the
ledger or the spool: the sender resent it) is acknowledged again and skipped, so the sender stops
resending it.

Poison: the receiver checks every group as it decodes it (`trajectory.decode_group`), before it is
spooled or acknowledged; a refused one is nacked, so the sender drops it, and kept in `rejected/`
(`rejected.py`). It never reaches the spool, so no restart replays it. A spooled group that fails the
same checks on replay (spooled by a learner that checked less) is moved to `rejected/` and recorded
in the ledger as "malformed", instead of failing every restart.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from agentrl.common.trajectory import GroupRejected, TrajectoryGroup
from agentrl.common.transport import GroupReceiver
from agentrl.learner.ledger import Ledger, Spool
from agentrl.learner.rejected import RejectedStore


class Intake:
    def __init__(self, receiver: GroupReceiver, spool: Spool, ledger: Ledger, rejected: RejectedStore):
        self.receiver = receiver
        self.spool = spool
        self.ledger = ledger
        self.rejected = rejected
        receiver.on_reject = lambda frames, reason, gid, sender: rejected.put(frames, reason, gid, source="socket",
                                                                              sender=sender)
        self._carry: list[TrajectoryGroup] = []
        self._replay = [gid for gid in spool.pending() if gid not in ledger]
        self.num_duplicates = 0
        self.num_replay_rejected = 0

    @property
    def num_replayed(self) -> int:
        """Spooled groups still to replay."""
        return len(self._replay)

    async def next_group(self) -> TrajectoryGroup:
        while True:
            if self._carry:
                return self._carry.pop(0)
            if self._replay:
                group = self._load_replay(self._replay.pop(0))
                if group is not None:
                    return group
                continue
            received = await self.receiver.recv()
            gid = received.group.group_id
            if gid in self.ledger or gid in self.spool:
                await self.receiver.ack(received)  # the sender may stop resending; nothing to train
                self.num_duplicates += 1
                continue
            self.spool.put(received.group)
            await self.receiver.ack(received)
            return received.group

    def _load_replay(self, gid: str) -> TrajectoryGroup | None:
        try:
            return self.spool.load(gid, vocab_size=self.receiver.vocab_size)
        except GroupRejected as err:
            self.rejected.put(self.spool.frames(gid), err.reason, gid, source="spool")
            self.ledger.rejected[gid] = "malformed"  # pruned from the spool with the next checkpoint
            self.num_replay_rejected += 1
            return None

    async def collect(self, tokens_per_step: int, stop: asyncio.Event, *, heartbeat: Callable[[], None],
                      heartbeat_s: float | None) -> list[TrajectoryGroup] | None:
        """Whole groups up to the token budget (at least one); None if `stop` is set meanwhile.
        `heartbeat` runs every `heartbeat_s` while waiting (None: never)."""
        groups: list[TrajectoryGroup] = []
        num_tokens = 0
        while num_tokens < tokens_per_step:
            getter = asyncio.ensure_future(self.next_group())
            stopper = asyncio.ensure_future(stop.wait())
            done, _ = await asyncio.wait({getter, stopper}, timeout=heartbeat_s, return_when=asyncio.FIRST_COMPLETED)
            while not done:
                heartbeat()
                done, _ = await asyncio.wait({getter, stopper}, timeout=heartbeat_s, return_when=asyncio.FIRST_COMPLETED)
            stopper.cancel()
            if getter not in done:
                getter.cancel()
                # A group already taken stays spooled (and unlisted in the ledger): it is replayed on restart.
                return None
            group = getter.result()
            group_tokens = sum(t.num_tokens for t in group.trajectories)
            if groups and num_tokens + group_tokens > tokens_per_step:
                self._carry.append(group)
                break
            groups.append(group)
            num_tokens += group_tokens
        return groups

    def settle(self, trained: dict[str, int], rejected: dict[str, str]) -> None:
        """Record what became of consumed groups (trained at a step, or rejected and why)."""
        self.ledger.trained.update(trained)
        self.ledger.rejected.update(rejected)

    def prune(self) -> None:
        """Delete the spool files the ledger now covers (call only after a checkpoint holding it)."""
        self.spool.remove([gid for gid in self.spool.pending() if gid in self.ledger])
