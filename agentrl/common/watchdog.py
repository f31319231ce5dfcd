"""A run's watchdog: when the process that owns a run dies by any means (SIGKILL included), every
process it started dies too, within `grace_s` plus one poll.

    python -m agentrl.common.watchdog OWNER_PID [--poll-s 0.5] [--grace-s 5] [--detach]

Why a separate process: the supervisor starts its children in their own sessions (a terminal's
Ctrl-C reaches only the supervisor, which stops them in order), so nothing signals them when the
supervisor itself is SIGKILLed; PR_SET_PDEATHSIG does not help either, as it fires on the death of
the *thread* that forked the child, and children are started from worker threads.

What it does: every `poll_s` it reads /proc and keeps the owner's descendant tree (pid, start time,
process group). Once the owner is gone it sends SIGTERM to every descendant still alive (the same
start time: a reused pid is never signalled) and to the groups they lead, so each stops its own
children in order; after `grace_s` it SIGKILLs whatever is left. It exits once the owner and all
its descendants are gone, or on SIGTERM from the owner (a run that ended normally).

`--detach`: the watchdog forks away from whoever started it (printing `WATCHDOG PID` on stdout, then
closing it), so it is no child of the owner. A Ray worker is such an owner: when it exits, Ray kills
its direct children, which would take an attached watchdog along and leave the grandchildren (a
vLLM server's engine processes) behind.

It also keeps the run directory's lock (an inherited descriptor of `RunLock`'s file) held until
then, so `agentrl train --resume` refuses while any process of the old run is still alive.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import signal
import sys
import time
from pathlib import Path

from agentrl.common.proctable import ProcInfo, all_processes, descendants, read_proc, same_process


class Watchdog:
    def __init__(self, owner_pid: int, *, poll_s: float = 0.5, grace_s: float = 5.0):
        self.owner = read_proc(owner_pid)
        self.poll_s, self.grace_s = poll_s, grace_s
        self.known: dict[int, ProcInfo] = {}
        """The owner's descendants seen so far, kept after they are reparented (to init, once
        their parent died): a tree walk alone would lose them."""

    def refresh(self) -> None:
        table = all_processes()
        roots = {self.owner.pid} if self.owner else set()
        roots |= {pid for pid, info in self.known.items() if pid in table and table[pid].start_ticks == info.start_ticks}
        for pid, info in descendants(roots, table).items():
            self.known.setdefault(pid, info)
        self.known.pop(os.getpid(), None)
        self.known = {pid: info for pid, info in self.known.items() if same_process(info)}

    def owner_alive(self) -> bool:
        return self.owner is not None and same_process(self.owner)

    def watch(self) -> None:
        while self.owner_alive():
            self.refresh()
            time.sleep(self.poll_s)
        self.refresh()  # what the owner started in its last poll interval
        self.signal_all(signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        while self.known and time.monotonic() < deadline:
            time.sleep(min(self.poll_s, 0.2))
            self.refresh()
        if self.known:
            self.signal_all(signal.SIGKILL)

    def signal_all(self, sig: int) -> None:
        own_group = os.getpgid(0)
        for info in list(self.known.values()):
            if not same_process(info):
                continue
            print(f"watchdog: {signal.Signals(sig).name} to pid {info.pid}", file=sys.stderr, flush=True)
            try:
                if info.pgid == info.pid and info.pgid != own_group:
                    os.killpg(info.pgid, sig)  # the group it leads: a vLLM server's engine and workers
                else:
                    os.kill(info.pid, sig)
            except ProcessLookupError:
                continue


class RunLockedError(RuntimeError):
    """Another process of a run holds the run directory."""


class RunLock:
    """An exclusive flock on `run_dir/.lock`, held by the supervisor and by the watchdog it starts
    (which inherits the descriptor), so the lock is released only once every process of the run is
    gone. The file names the supervisor's pid, for the error."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / ".lock"
        self.fd: int | None = None

    def acquire(self) -> RunLock:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RunLockedError(f"{self.path.parent} is in use by another run (supervisor pid {holder}, or a process "
                                 "it started that is still stopping); wait for it to end") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m agentrl.common.watchdog")
    ap.add_argument("owner_pid", type=int)
    ap.add_argument("--poll-s", type=float, default=0.5)
    ap.add_argument("--grace-s", type=float, default=5.0)
    ap.add_argument("--detach", action="store_true", help="fork away from the caller; print WATCHDOG PID")
    args = ap.parse_args(argv)
    if args.detach:
        if os.fork():
            os._exit(0)
        os.setsid()
        print(f"WATCHDOG {os.getpid()}", flush=True)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the owner's to handle
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # the owner stopped everything itself
    Watchdog(args.owner_pid, poll_s=args.poll_s, grace_s=args.grace_s).watch()
    return 0


if __name__ == "__main__":
    sys.exit(main())
