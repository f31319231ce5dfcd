"""Start a tool service as a subprocess, wait for its READY line, stop it by PID.

    proc = start_toolserver("search", "tcp://127.0.0.1:*", "--corpus", "passages.jsonl")
    proc.endpoint        # the endpoint from the READY line (the port bound when '*' was asked)
    proc.stop(timeout_s=10.0)

The service runs in its own session (process group), so `stop` can end it together with anything
it started (its sandboxes) by that group's id, never by name. `stop` sends SIGTERM, waits up to
`timeout_s`, then SIGKILLs the group. Its stderr (the log) goes to `log_path`, or to a temporary
file whose last lines are quoted if the service dies before READY, and which is removed when the
service exits cleanly (exit code 0).
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path


class ToolServerStartError(RuntimeError):
    pass


class ToolServerProcess:
    def __init__(self, name: str, popen: subprocess.Popen, endpoint: str, log_path: str,
                 remove_log_on_clean_exit: bool = False):
        self.name = name
        self.popen = popen
        self.endpoint = endpoint
        self.log_path = log_path
        self._remove_log = remove_log_on_clean_exit

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send `sig` to the service process only (tests use SIGKILL to simulate a crash)."""
        if self.alive():
            os.kill(self.popen.pid, sig)

    def stop(self, timeout_s: float = 10.0) -> int:
        """SIGTERM, wait up to timeout_s, then SIGKILL the process group. Returns the exit code."""
        if self.alive():
            os.kill(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
        self._kill_group()
        code = self.popen.wait(timeout_s)
        if self.popen.stdout is not None:
            self.popen.stdout.close()
        if code == 0 and self._remove_log:
            os.unlink(self.log_path)  # our temporary log of a clean run; kept when anything failed
            self._remove_log = False
        return code

    def _kill_group(self) -> None:
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)  # pgid == pid: started with start_new_session
        except ProcessLookupError:
            pass  # the whole group has already exited

    def log_tail(self, num_lines: int = 30) -> str:
        return "\n".join(Path(self.log_path).read_text(errors="replace").splitlines()[-num_lines:])


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
    with open(log_path, "ab") as log_file:
        popen = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=log_file, stdin=subprocess.DEVNULL,
            start_new_session=True, env=env,
        )
    proc = ToolServerProcess(name, popen, "", log_path, remove_log_on_clean_exit=temporary_log)
    assert popen.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(popen.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + ready_timeout_s
    buf = b""
    try:
        while b"\n" not in buf:
            left_s = deadline - time.monotonic()
            if left_s <= 0:
                raise ToolServerStartError(
                    f"toolserver {name} printed no READY within {ready_timeout_s} s; log {log_path}:\n"
                    f"{proc.log_tail()}"
                )
            if sel.select(left_s):
                chunk = os.read(popen.stdout.fileno(), 4096)
                if not chunk:
                    popen.wait(5)
                    raise ToolServerStartError(
                        f"toolserver {name} exited with {popen.returncode} before READY; log {log_path}:\n"
                        f"{proc.log_tail()}"
                    )
                buf += chunk
    except BaseException:
        proc._kill_group()
        popen.wait(10)
        raise
    finally:
        sel.close()
    line = buf.split(b"\n", 1)[0].decode()
    if not line.startswith("READY "):
        proc.stop(5)
        raise ToolServerStartError(f"toolserver {name}: expected 'READY <endpoint>', got {line!r}")
    proc.endpoint = line.split(" ", 1)[1]
    return proc
