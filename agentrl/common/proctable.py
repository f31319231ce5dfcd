"""The process table, read from /proc: which processes exist, their parents and process groups, and
signalling a process group only while it has live members. One reader for the watchdog, the MCP
client's server groups and the gateway's agent commands (a pid or group id is reused once free, so
every signal here first checks that the process or group it means is still there)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ProcInfo:
    pid: int
    ppid: int
    pgid: int
    start_ticks: int
    """Start time since boot in clock ticks: with the pid, it names one process (pids are reused)."""


def read_proc(pid: int) -> ProcInfo | None:
    """/proc/PID/stat of a live process; None when it is gone (or a zombie, which holds no resources
    a signal could free)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The command name is in parentheses and may contain spaces: fields start after the last ')'.
    fields = text[text.rindex(")") + 2:].split()
    if fields[0] in ("Z", "X"):  # a zombie (exited, not yet reaped) or dead
        return None
    return ProcInfo(pid, ppid=int(fields[1]), pgid=int(fields[2]), start_ticks=int(fields[19]))


def all_processes() -> dict[int, ProcInfo]:
    out = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and (info := read_proc(int(entry.name))) is not None:
            out[info.pid] = info
    return out


def descendants(roots: set[int], table: dict[int, ProcInfo]) -> dict[int, ProcInfo]:
    """Every process in `table` below one of `roots` (the roots themselves excluded)."""
    children: dict[int, list[int]] = {}
    for info in table.values():
        children.setdefault(info.ppid, []).append(info.pid)
    found: dict[int, ProcInfo] = {}
    stack = [c for r in roots for c in children.get(r, ())]
    while stack:
        pid = stack.pop()
        if pid not in found:
            found[pid] = table[pid]
            stack.extend(children.get(pid, ()))
    return found


def same_process(info: ProcInfo) -> bool:
    now = read_proc(info.pid)
    return now is not None and now.start_ticks == info.start_ticks


def live_group_members(pgid: int) -> list[int]:
    """PIDs in process group `pgid` that are not zombies (a reparented zombie may never be reaped in a
    container whose init does not reap, and it holds no resources)."""
    return [info.pid for info in all_processes().values() if info.pgid == pgid]


def signal_group(pgid: int, sig: int) -> None:
    """Signal process group `pgid`, only while it has live members: once it has none its id may be
    reused, so an unconditional killpg could hit someone else's group."""
    if live_group_members(pgid):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:  # the last member exited between the look and the signal
            pass
