"""The learner's `rejected/` folder: every refused group message, kept for reading.

A message the receiver refuses (`trajectory.decode_group`'s checks) or a spooled group that fails
them on replay is written as two files named `<seq>-<safe group id>`:
- `.frames`: the message exactly as received, as a msgpack array of its raw frames (after the
  routing id): `msgpack.unpackb(path.read_bytes())` gives the frames back, byte for byte;
- `.json`: {"group_id", "reason", "source" ("socket" or "spool"), "sender" (routing id, hex),
  "time" (unix s), "frame_bytes" (size of each frame)}.

Not durable (no fsync): the folder is for a person to read; exactly-once does not depend on it,
because a refused group is never acknowledged and never enters the ledger. A group id seen once is
written once per process (a sender's resend of it is counted, not written again), and the folder
stops growing at `max_bytes` (rejections are still logged, counted and answered).
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import msgpack


class RejectedStore:
    def __init__(self, directory: Path, *, max_bytes: int):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        """Stop writing once the folder holds this many bytes."""
        existing = sorted(self.dir.glob("*.json"))
        self._next_seq = max((int(p.name.split("-", 1)[0]) + 1 for p in existing), default=0)
        self.num_bytes = sum(p.stat().st_size for p in self.dir.iterdir() if p.is_file())
        self._written: set[str] = set()
        self.num_rejected = 0
        """Refusals seen by this process (written or not)."""
        self.num_not_written = 0
        """Refusals not written: a repeat of a group id already written, or the folder is full."""

    def put(self, frames: list[bytes], reason: str, group_id: str | None, *, source: str, sender: bytes = b"") -> Path | None:
        """Keep one refused message; returns the `.json` path, or None when not written."""
        self.num_rejected += 1
        payload = msgpack.packb(list(frames), use_bin_type=True)
        if (group_id is not None and group_id in self._written) or self.num_bytes + len(payload) > self.max_bytes:
            self.num_not_written += 1
            return None
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", group_id)[:80] if group_id else "unnamed"
        stem = f"{self._next_seq:09d}-{safe}"
        self._next_seq += 1
        meta = json.dumps({"group_id": group_id, "reason": reason, "source": source, "sender": sender.hex(),
                           "time": time.time(), "frame_bytes": [len(f) for f in frames]}, indent=1).encode()
        _write(self.dir / f"{stem}.frames", payload)
        _write(self.dir / f"{stem}.json", meta)  # last: a .json names a whole .frames beside it
        self.num_bytes += len(payload) + len(meta)
        if group_id is not None:
            self._written.add(group_id)
        return self.dir / f"{stem}.json"


def _write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def read_rejected(directory: Path) -> list[dict]:
    """The `.json` records of a rejected/ folder in arrival order, each with its frames under "frames"."""
    records = []
    for meta_path in sorted(Path(directory).glob("*.json")):
        record = json.loads(meta_path.read_text())
        record["frames"] = msgpack.unpackb(meta_path.with_suffix(".frames").read_bytes(), raw=False)
        records.append(record)
    return records
