"""ChildProcess.stop: nothing the child started outlives it, not even a process in a session of its
own (torchrun starts each rank so; the group's SIGKILL does not reach those)."""

from __future__ import annotations

import sys
import time

from agentrl.common.procs import ChildProcess
from agentrl.common.proctable import read_proc, same_process

TREE = """
import subprocess, sys, time
rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
print(rank.pid, flush=True)
time.sleep(600)
"""


def test_stop_takes_the_childs_whole_tree_even_a_process_in_a_session_of_its_own(tmp_path):
    child = ChildProcess("tree", [sys.executable, "-c", TREE], log_path=tmp_path / "tree.log", pipe_stdout=True).start()
    try:
        rank = read_proc(int(child.wait_for_line("", 30)))
        assert rank is not None and same_process(rank)
        child.stop(timeout_s=5)
        deadline = time.monotonic() + 5
        while same_process(rank) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not same_process(rank), "a process in its own session outlived the child that started it"
        assert child.stop(timeout_s=1) is not None  # stopping again is safe
    finally:
        child.stop(timeout_s=1)
        if rank is not None and same_process(rank):
            import os
            import signal

            os.kill(rank.pid, signal.SIGKILL)


def test_free_ports_come_from_below_the_ephemeral_range_once_each():
    """A port from the ephemeral range can be taken by an outgoing connection before its process binds
    it (a restarted learner failed four times that way): free_port stays below the range."""
    from agentrl.engine.serve import EPHEMERAL_RANGE, PORTS_FROM, free_port

    low = int(EPHEMERAL_RANGE.read_text().split()[0])
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert all(PORTS_FROM <= port < low for port in ports), (min(ports), max(ports), low)
