"""Where the services of a run answer now: RUN_DIR/services.json.

A service the run started again on another node answers at another address. Those who hold its
endpoint follow it through this file: `agentrl train` writes it (atomically, by rename) whenever a
service starts or starts again, and the actor (its server pool, tool clients and learner
connections) and the learner (its weight publisher) read it every few seconds. The run directory
is shared by every node of a cluster run (README, "A Ray cluster"), so nothing else carries it.

The file maps a key to a list of endpoints, index for index the list each reader was configured
with: "inference" (the vLLM servers' base URLs), "tools/NAME" (a tool service's replicas),
"learner" ([group endpoint, version endpoint]). A reader compares what it holds with the file and
acts on the entries that changed (`DirectoryFollower.moves`). A missing file means nothing moved
(a run from before this file existed, or services given from outside the run).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

DIRECTORY_FILE = "services.json"
INFERENCE = "inference"
LEARNER = "learner"


def tools_key(name: str) -> str:
    return f"tools/{name}"


@dataclass(frozen=True)
class Move:
    key: str
    index: int
    old: str
    new: str


def write_directory(path: Path, entries: dict[str, list[str]]) -> None:
    """Write `entries` to `path` whole: readers see the old file or the new one, never a part."""
    for key, endpoints in entries.items():
        if not isinstance(endpoints, list) or not all(isinstance(e, str) and e for e in endpoints):
            raise ValueError(f"service directory: {key} must be a list of endpoints, got {endpoints!r}")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(entries, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)


def read_directory(path: Path) -> dict[str, list[str]] | None:
    """The entries of `path`; None when it does not exist. A file that is not a directory's raises
    ValueError naming it (a reader logs that and keeps what it holds)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    return parse_directory(text, path)


def parse_directory(text: str, path: Path) -> dict[str, list[str]]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not JSON ({err})") from None
    if not isinstance(data, dict) or not all(isinstance(v, list) and all(isinstance(e, str) for e in v)
                                             for v in data.values()):
        raise ValueError(f"{path}: not a service directory (an object of endpoint lists)")
    return data


class DirectoryFollower:
    """What one reader holds of the directory, and what changed since it last looked."""

    def __init__(self, path: str | Path, held: dict[str, list[str]]):
        self.path = Path(path)
        self.held = {key: list(endpoints) for key, endpoints in held.items()}
        self._seen: str | None = None
        """The file's text at the last look that read it (compared whole: it is small, and a rewrite
        on a network file system may keep its mtime)."""

    def moves(self) -> list[Move]:
        """The entries of the file that differ from what is held, now held. Only the keys and
        indices this reader holds count: a longer list or a key it does not use is not its business.
        A file that cannot be read now (an I/O error on shared storage) is read again next time."""
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return []
        except OSError as err:
            log.warning("service directory: %s cannot be read now (%s); trying again at the next look", self.path, err)
            return []
        if text == self._seen:
            return []
        self._seen = text  # a bad file is said once, not at every look
        try:
            entries = parse_directory(text, self.path)
        except ValueError as err:
            log.error("service directory: %s; keeping the endpoints held", err)
            return []
        moves = []
        for key, held in self.held.items():
            for index, new in enumerate(entries.get(key, [])[:len(held)]):
                if new != held[index]:
                    moves.append(Move(key, index, held[index], new))
                    held[index] = new
        return moves
