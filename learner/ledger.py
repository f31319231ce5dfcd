"""Exactly-once consumption: the spool of received groups, the consumption ledger, and checkpoints.

Lifecycle of one group, and why none is lost or trained twice across a `kill -9`:

1. received from the orchestrator -> written to the spool (`Spool.put`: temp file, fsync, rename,
   fsync of the folder) -> only THEN acknowledged. An acknowledged group is therefore on disk;
   an unacknowledged one is resent by the sender (transport.py) after the learner restarts.
2. trained at step s -> recorded in the in-memory ledger (`Ledger.trained[group_id] = s`), or
   rejected/dropped (stale, equal rewards, too few samples) -> `Ledger.rejected[group_id] = why`.
3. checkpoint at step c (every M steps, on SIGTERM, at the end): model, optimizer, scheduler, RNG,
   step, version and the ledger are written to a temporary folder and renamed into place in one
   `os.replace`; a checkpoint folder either exists whole or not at all. Spool files of groups the
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

import io
import os
import random
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import torch

from agentrl.common.trajectory import TrajectoryGroup, decode_group, encode_group

CHECKPOINT_PREFIX = "step-"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """Write `data` to `path` so that a crash leaves either the old file or the whole new one."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


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

    def load(self, group_id: str) -> TrajectoryGroup:
        with open(self._paths[group_id], "rb") as f:
            return decode_group(msgpack.unpackb(f.read(), raw=False)["frames"])

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
    """group id -> why it was not trained ("stale", "equal_rewards", "too_few_samples")."""

    def __contains__(self, group_id: str) -> bool:
        return group_id in self.trained or group_id in self.rejected

    def to_dict(self) -> dict:
        return {"trained": dict(self.trained), "rejected": dict(self.rejected)}

    @classmethod
    def from_dict(cls, data: dict) -> Ledger:
        return cls(trained=dict(data["trained"]), rejected=dict(data["rejected"]))


def rng_state(device: torch.device | None = None) -> dict[str, Any]:
    """The generators' states; with a CUDA `device` also that device's generator ("cuda")."""
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if device is not None and device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device | None = None) -> None:
    """Inverse of `rng_state`. A "cuda" entry is restored onto a CUDA `device`; on the CPU there is no
    CUDA generator to restore it into (a GPU run resumed on the CPU), and a checkpoint without one
    (a CPU run resumed on a GPU) leaves the CUDA generator as `torch.manual_seed` set it."""
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and device is not None and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


def to_cpu(obj: Any) -> Any:
    """`obj` with every tensor inside (dicts, lists, tuples) on the CPU; CPU tensors are kept as they
    are, so a CPU learner's state is saved unchanged. Tensors sharing one CUDA storage (a tied
    embedding / LM head) stay shared on the CPU: the checkpoint holds the matrix once."""
    copies: dict[tuple, torch.Tensor] = {}

    def move(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            if x.device.type == "cpu":
                return x
            key = (x.device, x.untyped_storage().data_ptr(), x.storage_offset(), tuple(x.shape), x.stride(), x.dtype)
            if key not in copies:
                copies[key] = x.detach().cpu()
            return copies[key]
        if isinstance(x, dict):
            return {k: move(v) for k, v in x.items()}
        if type(x) in (list, tuple):
            return type(x)(move(v) for v in x)
        return x

    return move(obj)


def checkpoint_dirs(root: Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(CHECKPOINT_PREFIX) and (p / "state.pt").is_file()]
    return sorted(found, key=lambda p: int(p.name[len(CHECKPOINT_PREFIX):]))


def save_checkpoint(root: Path, step: int, state: dict[str, Any], *, keep: int) -> Path:
    """Write `state` (torch-serialisable) as checkpoint `step` atomically; keep the newest `keep`.
    Tensors are written from the CPU (`to_cpu`): a checkpoint loads on any host."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{CHECKPOINT_PREFIX}{step:08d}"
    tmp = root / f".tmp-{final.name}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    buf = io.BytesIO()
    torch.save(to_cpu(state), buf)
    with open(tmp / "state.pt", "wb") as f:
        f.write(buf.getbuffer())
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(root)
    for old in checkpoint_dirs(root)[:-keep]:
        shutil.rmtree(old)
    return final


def load_latest_checkpoint(root: Path) -> dict[str, Any] | None:
    for stale in root.glob(".tmp-*") if root.is_dir() else []:
        shutil.rmtree(stale)
    dirs = checkpoint_dirs(root)
    if not dirs:
        return None
    # On the CPU: the learner moves what it loads to its device (load_state_dict copies into the
    # parameters; the optimizer casts its state to each parameter's device).
    return torch.load(dirs[-1] / "state.pt", weights_only=False, map_location="cpu")
