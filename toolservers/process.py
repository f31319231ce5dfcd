"""Start a tool service as a subprocess, wait for its READY line, stop it by PID.

    proc = start_toolserver("search", "tcp://127.0.0.1:*", "--corpus", "passages.jsonl")
    proc.endpoint        # the endpoint from the READY line (the port bound when '*' was asked)
    proc.stop(timeout_s=10.0)

A `ToolServerProcess` is an `agentrl.common.procs.ChildProcess`: the service runs in its own
session (process group), so `stop` ends it together with anything it started (its sandboxes) by
that group's id, never by name (SIGTERM to the service, up to `timeout_s`, then SIGKILL of the
group). Its stderr (the log) goes to `log_path`, or to a temporary file whose last lines are quoted
if the service dies before READY, and which is removed when the service exits cleanly (code 0).
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile

from agentrl.common.procs import ChildProcess, ChildStartError


class ToolServerStartError(ChildStartError):
    pass


class ToolServerProcess(ChildProcess):
    def __init__(self, name: str, argv: list[str], *, log_path: str, env: dict[str, str] | None = None,
                 remove_log_on_clean_exit: bool = False, cwd: str | None = None):
        super().__init__(f"toolserver {name}", argv, log_path=log_path, env=env, pipe_stdout=True, cwd=cwd)
        self.service = name
        self.endpoint = ""
        """Filled from the READY line."""
        self._remove_log = remove_log_on_clean_exit

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send `sig` to the service process only (tests use SIGKILL to simulate a crash)."""
        self.signal(sig)

    def stop(self, timeout_s: float = 10.0) -> int | None:
        code = super().stop(timeout_s)
        if code == 0 and self._remove_log:
            os.unlink(self.log_path)  # our temporary log of a clean run; kept when anything failed
            self._remove_log = False
        return code


def start_toolserver(
    name: str,
    bind: str,
    *args: str,
    ready_timeout_s: float = 120.0,
    log_path: str | None = None,
    env: dict[str, str] | None = None,
) -> ToolServerProcess:
    """Run `agentrl toolserver NAME --bind BIND *args` and return once it printed READY."""
    temporary_log = log_path is None
    if log_path is None:
        fd, log_path = tempfile.mkstemp(prefix=f"agentrl-toolserver-{name}-", suffix=".log")
        os.close(fd)
    cmd = [sys.executable, "-P", "-m", "agentrl.cli", "toolserver", name, "--bind", bind, *args]
    proc = ToolServerProcess(name, cmd, log_path=log_path, env=env, remove_log_on_clean_exit=temporary_log).start()
    try:
        line = proc.wait_for_line("READY ", ready_timeout_s)
    except ChildStartError as err:
        raise ToolServerStartError(str(err)) from None
    proc.endpoint = line.split(" ", 1)[1]
    return proc
