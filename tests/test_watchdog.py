"""The run's watchdog and lock (agentrl/common/watchdog.py), with real processes.

The owner is a real Python process that starts the watchdog and children the way the supervisor
does (each in its own session); the test SIGKILLs the owner and checks that nothing it started is
left, including a child that ignores SIGTERM and the grandchildren in a child's process group. The
full path (SIGKILL of `agentrl train` mid-RL, then `--resume`) is in test_train_e2e.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from agentrl.common.proctable import read_proc
from agentrl.common.watchdog import RunLock, RunLockedError

OWNER = """
import os, subprocess, sys, time
wd = subprocess.Popen([sys.executable, "-P", "-m", "agentrl.common.watchdog", str(os.getpid()), "--grace-s", "2"],
                      start_new_session=True)
group = subprocess.Popen(["bash", "-c", "sleep 1000 & sleep 1000 & wait"], start_new_session=True)
stubborn = subprocess.Popen(["bash", "-c", "trap '' TERM; sleep 1000 & wait"], start_new_session=True)
time.sleep(1.5)  # the watchdog has polled the tree at least once
print(wd.pid, group.pid, stubborn.pid, flush=True)
time.sleep(1000)
"""


def _tree_of(pids: set[int]) -> set[int]:
    """Live processes that are one of `pids` or a child of one."""
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (info := read_proc(int(entry))) is not None:
            if info.pid in pids or info.ppid in pids:
                found.add(info.pid)
    return found


def test_sigkilled_owner_leaves_no_process_behind():
    owner = subprocess.Popen([sys.executable, "-P", "-c", OWNER], stdout=subprocess.PIPE, text=True)
    watchdog, group, stubborn = map(int, owner.stdout.readline().split())
    started = _tree_of({group, stubborn}) | {watchdog}
    assert len(started) >= 6, started  # two bash leaders, their three sleeps, the watchdog
    owner.kill()
    owner.wait()
    t0 = time.monotonic()
    while (left := {p for p in started if read_proc(p) is not None}) and time.monotonic() - t0 < 10:
        time.sleep(0.1)
    assert not left, f"still alive {time.monotonic() - t0:.1f} s after the owner's SIGKILL: {left}"
    # The stubborn child ignores SIGTERM: it went only after the 2 s grace, with SIGKILL.
    assert time.monotonic() - t0 >= 2.0


DETACHING_OWNER = """
import os, subprocess, sys, time
wd = subprocess.Popen([sys.executable, "-P", "-m", "agentrl.common.watchdog", str(os.getpid()), "--grace-s", "2",
                       "--detach"], stdout=subprocess.PIPE, text=True)
watchdog = int(wd.stdout.readline().split()[1])
wd.wait()
role = subprocess.Popen(["bash", "-c", "sleep 1000 & sleep 1000 & wait"])  # a child with children of its own
time.sleep(1.5)
print(watchdog, role.pid, flush=True)
time.sleep(1000)
"""


def test_a_detached_watchdog_outlives_the_owners_children_and_stops_their_children():
    """What a Ray worker's exit does: the worker and its direct children are SIGKILLed at once. A
    detached watchdog is none of them, and stops what the role started itself."""
    owner = subprocess.Popen([sys.executable, "-P", "-c", DETACHING_OWNER], stdout=subprocess.PIPE, text=True)
    watchdog, role = map(int, owner.stdout.readline().split())
    assert read_proc(watchdog).ppid != owner.pid
    grandchildren = _tree_of({role}) - {role}
    assert len(grandchildren) == 2, grandchildren
    direct_children = {pid for pid in _tree_of({owner.pid}) if read_proc(pid).ppid == owner.pid}
    assert role in direct_children and watchdog not in direct_children
    for pid in direct_children:  # as Ray does when a worker exits
        os.kill(pid, signal.SIGKILL)
    owner.kill()
    owner.wait()
    t0 = time.monotonic()
    while (left := {p for p in grandchildren | {watchdog} if read_proc(p) is not None}) and time.monotonic() - t0 < 10:
        time.sleep(0.1)
    assert not left, f"still alive {time.monotonic() - t0:.1f} s after the owner and its child were killed: {left}"


def test_watchdog_told_to_stop_signals_nothing():
    owner = subprocess.Popen([sys.executable, "-P", "-c", OWNER], stdout=subprocess.PIPE, text=True)
    try:
        watchdog, group, stubborn = map(int, owner.stdout.readline().split())
        os.kill(watchdog, signal.SIGTERM)  # what the supervisor does after stopping its children itself
        t0 = time.monotonic()
        while read_proc(watchdog) is not None and time.monotonic() - t0 < 5:
            time.sleep(0.05)
        assert read_proc(watchdog) is None
        assert read_proc(group) is not None and read_proc(stubborn) is not None
    finally:
        owner.kill()
        owner.wait()
        for pid in (group, stubborn):
            os.killpg(pid, signal.SIGKILL)


def test_run_lock_is_held_while_any_process_of_the_run_lives(tmp_path):
    lock = RunLock(tmp_path).acquire()
    with pytest.raises(RunLockedError, match=f"supervisor pid {os.getpid()}"):
        RunLock(tmp_path).acquire()
    child = subprocess.Popen(["sleep", "1000"], pass_fds=(lock.fd,))  # as the watchdog inherits it
    try:
        lock.release()
        with pytest.raises(RunLockedError, match="still stopping"):
            RunLock(tmp_path).acquire()
    finally:
        child.kill()
        child.wait()
    RunLock(tmp_path).acquire().release()  # the last holder is gone: the directory is free
