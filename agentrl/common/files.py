"""Durable files: atomic writes, and the JSONL records a run appends (metrics, evaluations, stats)."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in `path` durable (the directory entry itself is flushed)."""
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
    fsync_dir(path.parent)


def iter_jsonl(path: str | Path, error: type[Exception] = ValueError) -> Iterator[tuple[str, Any]]:
    """(where, record) for each non-blank line of a JSONL file, in order; `where` is "path:line", for
    the caller's own checks of the record. A line that is not JSON (a run killed mid-write, a hand
    edit) raises `error` naming path and line number."""
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise error(f"{path}:{number}: not a JSON record ({err}); remove or repair the line") from None
            yield f"{path}:{number}", record


def read_jsonl(path: Path) -> list[dict]:
    """The records of a JSONL file, oldest first ([] when it does not exist; blank lines skipped; a
    line that is not JSON raises ValueError naming it: `iter_jsonl`)."""
    if not path.exists():
        return []
    return [record for _, record in iter_jsonl(path)]


def sha256_update(digest: hashlib._Hash, path: Path) -> hashlib._Hash:
    """Feed the contents of the file `path` into `digest`, in 4 MiB blocks; returns `digest`."""
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest
