"""Child processes owned by PID: started in their own process group, stopped within a bound.

Every long-lived process agentrl starts (vLLM servers, tool services, the learner and actor of a
training run, MCP servers) goes through `ChildProcess`, so there is one answer to "how is it
stopped":

- `start()` runs the command in a new session (its own process group, pgid == pid), stdout and
  stderr appended to `log_path` (or stdout piped, for a READY line), stdin from /dev/null.
- `stop(timeout_s)` sends SIGTERM (to the leader, or to the whole group with `term_group=True`:
  a vLLM server's engine core and workers must see it too), waits up to `timeout_s`, then SIGKILLs
  the whole group and what of its tree (as it was when the stop began) is in other sessions, so
  nothing the child started (sandboxes, workers, torchrun's ranks) outlives it. Nothing is
  ever signalled by name.
- `wait_for_line(prefix, timeout_s)` reads the piped stdout until a line starting with `prefix`
  (a tool service's `READY <endpoint>`); an exit or a timeout first raises `ChildStartError` with
  the log tail.

A stopped or never-started child is safe to stop again (idempotent), so owners can stop
everything in a `finally` without tracking what got as far as starting.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path


class ChildStartError(RuntimeError):
    """The child exited or stayed silent before it was ready."""


class ChildProcess:
    def __init__(self, name: str, argv: Sequence[str], *, log_path: str | Path, env: dict[str, str] | None = None,
                 pipe_stdout: bool = False, term_group: bool = False, pass_fds: Sequence[int] = (),
                 cwd: str | Path | None = None):
        self.name = name
        self.cwd = cwd
        """The folder the child starts in (None: this process's working directory)."""
        self.argv = list(argv)
        self.log_path = Path(log_path)
        self.env = env
        """The child's whole environment (None: this process's); PYTHONUNBUFFERED=1 is always added."""
        self.pipe_stdout = pipe_stdout
        """Pipe stdout to this process (for `wait_for_line`) instead of the log; stderr still logs."""
        self.term_group = term_group
        """SIGTERM the whole process group on `stop`, not only the leader."""
        self.pass_fds = tuple(pass_fds)
        """Descriptors the child inherits (the run lock, which the watchdog keeps held)."""
        self.popen: subprocess.Popen | None = None

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> ChildProcess:
        if self.popen is not None:
            raise RuntimeError(f"{self.name}: already started (pid {self.popen.pid})")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ if self.env is None else self.env, PYTHONUNBUFFERED="1")
        with open(self.log_path, "ab") as log:
            self.popen = subprocess.Popen(
                self.argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE if self.pipe_stdout else log,
                stderr=log, env=env, start_new_session=True, pass_fds=self.pass_fds, cwd=self.cwd)
        return self

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen is not None else None

    def poll(self) -> int | None:
        """The exit code, or None while it runs (or before it started)."""
        return self.popen.poll() if self.popen is not None else None

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def signal(self, sig: int) -> None:
        """Send `sig` to the leader only (fault-injection tests use SIGKILL)."""
        if self.alive():
            os.kill(self.popen.pid, sig)

    def kill_group(self) -> None:
        """SIGKILL the whole process group at once."""
        if self.popen is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGKILL)

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM, wait up to `timeout_s`, SIGKILL the group; the exit code (None if never started)."""
        popen = self.popen
        if popen is None:
            return None
        from agentrl.common.proctable import all_processes, descendants, same_process

        # Its tree now, while the leader holds it: a child in a session of its own (torchrun starts
        # each rank so) is no member of the group and would outlive the group's SIGKILL.
        tree = descendants({popen.pid}, all_processes()) if popen.poll() is None else {}
        if popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                if self.term_group:
                    os.killpg(popen.pid, signal.SIGTERM)
                else:
                    os.kill(popen.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                popen.wait(timeout_s)
        # Whatever the leader left behind (workers, sandboxes, ranks) goes: its group, and the
        # processes of its tree in other sessions.
        self.kill_group()
        for info in tree.values():
            if same_process(info):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(info.pid, signal.SIGKILL)
        code = popen.wait(10)
        if popen.stdout is not None:
            popen.stdout.close()
        return code

    # -- readiness ------------------------------------------------------------------------------
    def wait_for_line(self, prefix: str, timeout_s: float) -> str:
        """The first stdout line starting with `prefix` (needs `pipe_stdout`); earlier lines are
        skipped. Raises ChildStartError (after killing the group) on exit or timeout."""
        if self.popen is None or self.popen.stdout is None:
            raise RuntimeError(f"{self.name}: wait_for_line needs a started child with pipe_stdout=True")
        fd = self.popen.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        buf = b""
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            try:
                while True:
                    while b"\n" in buf:
                        line, buf = buf.split(b"\n", 1)
                        text = line.decode(errors="replace")
                        if text.startswith(prefix):
                            return text
                    left_s = deadline - time.monotonic()
                    if left_s <= 0:
                        raise ChildStartError(f"{self.name} printed no {prefix.strip()} within {timeout_s:.0f} s; "
                                              f"log {self.log_path}:\n{self.log_tail()}")
                    if sel.select(left_s):
                        chunk = os.read(fd, 4096)
                        if not chunk:
                            code = self.popen.wait(5)
                            raise ChildStartError(f"{self.name} exited with {code} before {prefix.strip()}; "
                                                  f"log {self.log_path}:\n{self.log_tail()}")
                        buf += chunk
            except BaseException:
                self.kill_group()
                self.popen.wait(10)
                raise

    def log_tail(self, num_lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-num_lines:])
        except FileNotFoundError:
            return "(no log)"


def exit_on_sigterm() -> None:
    """Make SIGTERM and SIGHUP raise SystemExit(128 + signum) in the main thread, so the `finally`
    blocks that stop child servers by PID run (the default action would end the process and orphan
    them; SIGHUP is what a closed terminal or ssh session sends)."""
    def _raise(signum, _frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _raise)
    signal.signal(signal.SIGHUP, _raise)
