"""Exactly-once consumption: the spool of received groups and the consumption ledger (checkpoint I/O: checkpoint.py).

Lifecycle of one group, and why none is lost or trained twice across a `kill -9`:

1. received from the orchestrator -> written to the spool (`Spool.put`: temp file, fsync, rename,
   fsync of the folder) -> only THEN acknowledged. An acknowledged group is therefore on disk;
   an unacknowledged one is resent by the sender (transport.py) after the learner restarts.
2. trained at step s -> recorded in the in-memory ledger (`Ledger.trained[group_id] = s`), or
   rejected/dropped (stale, equal rewards, too few samples) -> `Ledger.rejected[group_id] = why`.
3. checkpoint at step c (every M steps, on SIGTERM, at the end): model, optimizer, scheduler, RNG,
   step, version and the ledger are written to a temporary folder and renamed into place in one
   `os.replace` (checkpoint.py); a checkpoint folder either exists whole or not at all. Spool files of groups the
   ledger now covers are deleted after the rename.

After a crash the learner loads the newest checkpoint (step c, ledger L). Groups trained after c
lost their effect with the weights, and L does not list them; their spool files still exist, so
they are replayed (in arrival order) before anything new is read. A group the sender resends is
acknowledged again and skipped if L lists it or it is already spooled. So every acknowledged group
is trained exactly once in the lineage of the surviving checkpoint (`tests/test_learner_resume.py`
counts group ids through a real SIGKILL).

Backpressure: the learner reads from the socket only when it assembles a batch, so the spool holds
at most the groups of the steps since the last checkpoint plus one batch; the sender's
`max_unacked` bounds what waits in between.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import msgpack

from agentrl.common.files import write_atomic
from agentrl.common.trajectory import TrajectoryGroup, decode_group, encode_group


class Spool:
    """Durable FIFO of received groups, one file per group named `<arrival seq>-<safe id>.grp`."""

    def __init__(self, directory: Path):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        for stale in self.dir.glob(".*.tmp"):
            stale.unlink()
        self._paths: dict[str, Path] = {}
        self._next_seq = 0
        for path in sorted(self.dir.glob("*.grp")):
            self._next_seq = max(self._next_seq, int(path.name.split("-", 1)[0]) + 1)
            self._paths[self._group_id(path)] = path

    @classmethod
    def write_whole(cls, directory: Path, groups) -> Path:
        """A spool of `groups` at `directory`, all or nothing: written beside it (NAME.partial, one
        a stopped writer left is removed first), then renamed. Returns `directory`."""
        import shutil

        directory = Path(directory)
        partial = directory.with_name(directory.name + ".partial")
        if partial.exists():
            shutil.rmtree(partial)
        spool = cls(partial)
        for group in groups:
            spool.put(group)
        spool.dir.rename(directory)
        return directory

    @staticmethod
    def _group_id(path: Path) -> str:
        with open(path, "rb") as f:
            return msgpack.unpackb(f.read(), raw=False)["group_id"]

    def __contains__(self, group_id: str) -> bool:
        return group_id in self._paths

    def __len__(self) -> int:
        return len(self._paths)

    def put(self, group: TrajectoryGroup) -> None:
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", group.group_id)[:80]
        path = self.dir / f"{self._next_seq:012d}-{safe}.grp"
        self._next_seq += 1
        write_atomic(path, msgpack.packb({"group_id": group.group_id, "frames": encode_group(group)}, use_bin_type=True))
        self._paths[group.group_id] = path

    def frames(self, group_id: str) -> list[bytes]:
        """The group's message frames as received."""
        with open(self._paths[group_id], "rb") as f:
            return msgpack.unpackb(f.read(), raw=False)["frames"]

    def load(self, group_id: str, *, vocab_size: int | None = None) -> TrajectoryGroup:
        """The spooled group, through the receiver's checks (`decode_group`; raises GroupRejected)."""
        return decode_group(self.frames(group_id), vocab_size=vocab_size)

    def pending(self) -> list[str]:
        """Spooled group ids in arrival order."""
        return [gid for gid, _ in sorted(self._paths.items(), key=lambda kv: kv[1].name)]

    def remove(self, group_ids: list[str]) -> None:
        for gid in group_ids:
            path = self._paths.pop(gid, None)
            if path is not None:
                path.unlink()


@dataclass
class Ledger:
    """Which groups this lineage has consumed, and what became of them."""

    trained: dict[str, int] = field(default_factory=dict)
    """group id -> optimizer step (1-based, the step the update produced) that trained on it."""
    rejected: dict[str, str] = field(default_factory=dict)
    """group id -> why it was not trained ("stale", "equal_rewards", "too_few_samples", "nothing_to_train",
    "nonfinite_gradient"; "malformed": spooled, then refused by the checks on replay, see rejected/)."""

    def __contains__(self, group_id: str) -> bool:
        return group_id in self.trained or group_id in self.rejected

    def to_dict(self) -> dict:
        return {"trained": dict(self.trained), "rejected": dict(self.rejected)}

    @classmethod
    def from_dict(cls, data: dict) -> Ledger:
        return cls(trained=dict(data["trained"]), rejected=dict(data["rejected"]))
