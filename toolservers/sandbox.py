"""The `python` tool: untrusted Python in bubblewrap sandboxes, from a pool started ahead of time.

Each of `num_workers` slots is one long-lived sandbox: `setpriv` to the slot's own unprivileged
uid, then `bwrap` with every namespace unshared (no network: connect() fails with "Network is
unreachable"), a read-only /usr (the system interpreter and its standard library) and nothing else
of the host: no /etc, no /home, no project files, an empty environment. Inside, the zygote
(sandbox_zygote.py, passed as `-c` source) is PID 1 and forks one fresh child per call.

What holds between calls (isolation):
- Each call runs in a new process forked from the zygote's clean interpreter: no Python state
  (modules, globals, monkey-patches, random state) carries over from an earlier call.
- After each call every other process in the sandbox is SIGKILLed (background processes,
  double-forked or setsid'd ones included: as PID 1 the zygote reaps them all) and /tmp and
  /dev/shm are emptied. If either fails, the sandbox is discarded and a fresh one started.
- Not reset between calls of one slot: the kernel's page cache and the sandbox's namespaces
  themselves (hostname, empty network). A call cannot see another call's files or processes.
- The code cannot kill its parent: SIGKILL from inside a PID namespace to its init is ignored.

Limits, and what each reports in `limit` when hit:
    wall_time  the call's timeout (min of its timeout_s, max_timeout_s and the request deadline);
               the child and everything it started are killed
    cpu_time   RLIMIT_CPU per process (SIGXCPU)
    memory     RLIMIT_AS per process (MemoryError), and the slot's memory cgroup, which bounds the
               sum over all its processes and tmpfs pages (OOM kill, seen in memory.oom_control)
    processes  RLIMIT_NPROC on the slot's uid (fork fails with EAGAIN at the cap)
    file_size  RLIMIT_FSIZE (SIGXFSZ)
    disk       the private /tmp or /dev/shm tmpfs (tmpfs_bytes each) filled up
    output     stdout or stderr over max_output_bytes; the child is killed at once

Backpressure: a slot runs one call at a time; calls wait in a FIFO queue (bounded by the server's
max_in_flight) and one that waited past its deadline is answered `deadline_exceeded` without
running. A sandbox that dies or does not answer within its call's timeout plus
`wedged_grace_s` is killed (its process group), its call answered `sandbox_error`, and the slot
restarted.

The service refuses to start if `bwrap` is not installed: it never runs code unsandboxed.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import shutil
import signal
import struct
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from agentrl.toolservers import protocol as P
from agentrl.toolservers.server import Job, Outcome, Tool, ToolSpec

log = logging.getLogger(__name__)

ZYGOTE_SOURCE = (Path(__file__).parent / "sandbox_zygote.py").read_text()
MAX_CODE_CHARS = 100_000
MAX_STDIN_CHARS = 1_000_000


@dataclass
class SandboxConfig:
    num_workers: int = 4
    """Sandboxes started ahead of time; calls beyond this many wait in a queue."""
    python: str = "/usr/bin/python3"
    """Interpreter inside the sandbox (bound read-only from the host's /usr)."""
    default_timeout_s: float = 5.0
    """Wall time of a call that names no timeout_s."""
    max_timeout_s: float = 30.0
    """Largest wall time a call may ask for."""
    memory_bytes: int = 1 << 30
    """RLIMIT_AS per process, and the slot's memory cgroup limit (all its processes and tmpfs).
    256 MiB breaks imports of numpy-sized modules; 1 GiB is workable."""
    max_processes: int = 32
    """Processes (and threads) in one sandbox at once, the zygote included."""
    max_file_bytes: int = 16 << 20
    """Largest file one call may write."""
    tmpfs_bytes: int = 64 << 20
    """Size of the private /tmp and of /dev/shm, each."""
    max_output_bytes: int = 64 << 10
    """stdout and stderr kept per call, each; more kills the call (limit "output")."""
    uid_base: int = 61000
    """Slot i runs as uid/gid uid_base + i when the server runs as root."""
    wedged_grace_s: float = 5.0
    """Extra seconds past a call's timeout before its sandbox is declared wedged and killed."""
    memory_cgroup: bool = True
    """Put each slot in its own cgroup-v1 memory cgroup (needs root and a writable
    /sys/fs/cgroup/memory). Without it only the per-process RLIMIT_AS bounds memory."""

    def validate(self) -> None:
        if shutil.which("bwrap") is None:
            raise RuntimeError(
                "the python tool needs bubblewrap (`bwrap`) and will not run code unsandboxed: "
                "install it with `apt-get install -y bubblewrap` (scripts/setup.sh does this)"
            )
        if os.geteuid() == 0 and shutil.which("setpriv") is None:
            raise RuntimeError("running as root, the python tool needs `setpriv` (util-linux) to drop to an "
                               "unprivileged uid per sandbox")
        if not os.access(self.python, os.X_OK) or not self.python.startswith("/usr/"):
            raise ValueError(f"sandbox interpreter {self.python!r} must be an executable under /usr "
                             "(only /usr is visible inside the sandbox)")
        if self.num_workers < 1:
            raise ValueError(f"--workers must be >= 1, got {self.num_workers}")
        if not 0 < self.default_timeout_s <= self.max_timeout_s:
            raise ValueError("need 0 < default_timeout_s <= max_timeout_s")
        if self.max_processes < 2:
            raise ValueError("max_processes must be >= 2 (the zygote and the call)")
        if self.memory_cgroup and _memory_cgroup_root() is None:
            raise RuntimeError(
                "cannot create memory cgroups (needs root and cgroup v1 memory mounted read-write at "
                "/sys/fs/cgroup/memory); set SandboxConfig.memory_cgroup=False to rely on per-process "
                "RLIMIT_AS only, which does not bound the total memory of a call's processes"
            )


def _memory_cgroup_root() -> Path | None:
    if os.geteuid() != 0:
        return None
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            root = Path("/sys/fs/cgroup/memory") / path.lstrip("/")
            return root if os.access(root, os.W_OK) else None
    return None


def _empty_cgroup(cgroup: Path, timeout_s: float) -> None:
    end = time.monotonic() + timeout_s
    while pids := (cgroup / "cgroup.procs").read_text().split():
        if time.monotonic() > end:
            raise RuntimeError(f"processes {pids} still in {cgroup} after SIGKILL and {timeout_s} s")
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass  # exited between the read and the kill
        time.sleep(0.005)


def _remove_stale_cgroups(root: Path) -> None:
    """Remove empty slot cgroups left by servers that were SIGKILLed (they cannot clean up)."""
    for cgroup in root.glob("agentrl-sandbox-*-*"):
        owner_pid = int(cgroup.name.split("-")[2])
        if owner_pid != os.getpid() and not Path(f"/proc/{owner_pid}").exists():
            if not (cgroup / "cgroup.procs").read_text().strip():
                cgroup.rmdir()


def _oom_kills(cgroup: Path | None) -> int:
    if cgroup is None:
        return 0
    for line in (cgroup / "memory.oom_control").read_text().splitlines():
        if line.startswith("oom_kill "):
            return int(line.split()[1])
    return 0


class _Slot:
    def __init__(self, index: int):
        self.index = index
        self.popen: subprocess.Popen | None = None
        self.buf = bytearray()
        self.ready = False
        self.job: Job | None = None
        self.job_timeout_s = 0.0
        self.job_started_s = 0.0
        self.oom_kills_before = 0
        self.cgroup: Path | None = None

    @property
    def fd(self) -> int:
        assert self.popen is not None and self.popen.stdout is not None
        return self.popen.stdout.fileno()


class PythonTool(Tool):
    spec = ToolSpec(
        name="python",
        description=(
            "Run a Python 3 program in an isolated sandbox (no network, no host files, limited time and "
            "memory) and return its stdout, stderr and exit code. Print what you want to see."
        ),
        parameters={
            "type": "object",
            "properties": {
                "code": {"type": "string", "description": "The program.", "maxLength": MAX_CODE_CHARS},
                "stdin": {"type": "string", "description": "Text given on standard input.",
                          "maxLength": MAX_STDIN_CHARS},
                "timeout_s": {"type": "number", "description": "Wall-time limit in seconds.",
                              "minimum": 0.001},
            },
            "required": ["code"],
            "additionalProperties": False,
        },
        idempotent=False,
    )

    def __init__(self, config: SandboxConfig):
        config.validate()
        self.config = config
        self.slots = [_Slot(i) for i in range(config.num_workers)]
        self.queue: collections.deque[Job] = collections.deque()
        self._by_fd: dict[int, _Slot] = {}
        self._cgroup_root = _memory_cgroup_root() if config.memory_cgroup else None
        self._zygote_cfg = json.dumps({
            "max_output_bytes": config.max_output_bytes,
            "max_processes": config.max_processes,
            "memory_bytes": config.memory_bytes,
            "cpu_time_s": int(config.max_timeout_s) + 1,
            "max_file_bytes": config.max_file_bytes,
        })

    # --- slots -----------------------------------------------------------------------------------

    def start(self) -> None:
        if self._cgroup_root is not None:
            _remove_stale_cgroups(self._cgroup_root)
        for slot in self.slots:
            self._spawn(slot)
        # Wait for every sandbox to say ready, so READY means "calls run now at full speed".
        end = time.monotonic() + 30.0
        while not all(s.ready for s in self.slots):
            if time.monotonic() > end:
                raise RuntimeError(f"sandboxes not ready within 30 s: {[s.index for s in self.slots if not s.ready]}")
            for slot in self.slots:
                if not slot.ready and self._read(slot, block=True) is None:
                    raise RuntimeError(self._startup_failure(slot))

    def _command(self, slot: _Slot) -> list[str]:
        uid = self.config.uid_base + slot.index if os.geteuid() == 0 else os.getuid()
        prefix = (
            ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all", "--"]
            if os.geteuid() == 0 else []
        )
        tmpfs = str(self.config.tmpfs_bytes)
        bwrap = [
            "bwrap", "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent",
            "--new-session", "--as-pid-1", "--hostname", "sandbox",
            "--ro-bind", "/usr", "/usr",
        ]
        for name in ("bin", "lib", "lib64", "sbin"):
            host = Path("/") / name
            if host.is_symlink():
                bwrap += ["--symlink", os.readlink(host), f"/{name}"]
            elif host.is_dir():
                bwrap += ["--ro-bind", str(host), f"/{name}"]
        bwrap += [
            "--proc", "/proc", "--dev", "/dev",
            "--size", tmpfs, "--tmpfs", "/tmp", "--size", tmpfs, "--tmpfs", "/dev/shm",
            "--uid", str(uid), "--gid", str(uid),
            "--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/tmp",
            "--setenv", "LANG", "C.UTF-8", "--setenv", "PYTHONDONTWRITEBYTECODE", "1", "--chdir", "/tmp",
            self.config.python, "-I", "-S", "-c", ZYGOTE_SOURCE, self._zygote_cfg,
        ]
        return prefix + bwrap

    def _spawn(self, slot: _Slot) -> None:
        cgroup = None
        if self._cgroup_root is not None:
            cgroup = self._cgroup_root / f"agentrl-sandbox-{os.getpid()}-{slot.index}"
            cgroup.mkdir(exist_ok=True)
            (cgroup / "memory.limit_in_bytes").write_text(str(self.config.memory_bytes))
        slot.cgroup = cgroup

        def enter_cgroup() -> None:  # runs in the forked child before exec: no thread-unsafe work
            if cgroup is not None:
                with open(cgroup / "cgroup.procs", "w") as f:
                    f.write(str(os.getpid()))

        slot.popen = subprocess.Popen(
            self._command(slot), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None,
            start_new_session=True, preexec_fn=enter_cgroup, bufsize=0,
        )
        os.set_blocking(slot.fd, False)
        slot.buf.clear()
        slot.ready = False
        slot.job = None
        self._by_fd[slot.fd] = slot

    def _kill(self, slot: _Slot) -> None:
        assert slot.popen is not None
        self._by_fd.pop(slot.fd, None)
        try:
            os.killpg(slot.popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # already gone
        slot.popen.wait(5)
        if slot.cgroup is not None:
            # The sandbox's PID 1 runs in its own session (bwrap --new-session), so the group kill
            # above reaches only bwrap; its processes die by PDEATHSIG, asynchronously. Kill what
            # the cgroup still holds and wait until it is empty, so it can be reused or removed.
            _empty_cgroup(slot.cgroup, timeout_s=5.0)
        for stream in (slot.popen.stdin, slot.popen.stdout):
            if stream is not None:
                stream.close()

    def _startup_failure(self, slot: _Slot) -> str:
        assert slot.popen is not None
        return (f"sandbox {slot.index} exited during start-up (status {slot.popen.wait(5)}); its error is "
                "in this server's log above (bwrap/setpriv message)")

    def _restart(self, slot: _Slot, why: str) -> list[tuple[Job, Outcome]]:
        if not slot.ready:
            # It worked at start(); a sandbox that now dies before it is ready would die again at
            # once: stop loudly rather than respawn in a loop.
            raise RuntimeError(self._startup_failure(slot))
        done = []
        if slot.job is not None:
            done.append((slot.job, Outcome.failure(P.E_SANDBOX, f"sandbox {slot.index} failed: {why}")))
        log.warning("sandbox %d restarted: %s", slot.index, why)
        self._kill(slot)
        self._spawn(slot)
        return done

    def _read(self, slot: _Slot, block: bool = False) -> list[dict] | None:
        """Frames available from `slot`; None on EOF (the sandbox died)."""
        assert slot.popen is not None and slot.popen.stdout is not None
        if block:
            import select

            select.select([slot.fd], [], [], 1.0)
        try:
            chunk = os.read(slot.fd, 1 << 20)
        except BlockingIOError:
            return []
        if not chunk:
            return None
        slot.buf += chunk
        frames = []
        while len(slot.buf) >= 4:
            (size,) = struct.unpack(">I", slot.buf[:4])
            if len(slot.buf) < 4 + size:
                break
            frames.append(json.loads(slot.buf[4 : 4 + size]))
            del slot.buf[: 4 + size]
        for frame in frames:
            if frame.get("ready"):
                slot.ready = True
        return [f for f in frames if not f.get("ready")]

    # --- Tool interface --------------------------------------------------------------------------

    def submit(self, jobs: list[Job]) -> list[tuple[Job, Outcome]]:
        self.queue.extend(jobs)
        return self._dispatch(time.monotonic())

    def fds(self) -> list[int]:
        return list(self._by_fd)

    def on_readable(self, fd: int) -> list[tuple[Job, Outcome]]:
        slot = self._by_fd[fd]
        frames = self._read(slot)
        if frames is None:
            code = slot.popen.poll() if slot.popen is not None else None
            done = self._restart(slot, f"sandbox process exited (status {code})")
        else:
            done = []
            for result in frames:
                assert slot.job is not None, "sandbox answered with no call running"
                if _oom_kills(slot.cgroup) > slot.oom_kills_before and result["limit"] is None:
                    result["limit"] = "memory"
                done.append((slot.job, Outcome(True, result)))
                slot.job = None
        return done + self._dispatch(time.monotonic())

    def tick(self, now_s: float) -> list[tuple[Job, Outcome]]:
        done = []
        for slot in self.slots:
            if slot.job is not None and now_s > slot.job_started_s + slot.job_timeout_s + self.config.wedged_grace_s:
                done += self._restart(slot, f"no answer {self.config.wedged_grace_s} s after the call's timeout")
        return done + self._dispatch(now_s)

    def _dispatch(self, now_s: float) -> list[tuple[Job, Outcome]]:
        done = []
        idle = [s for s in self.slots if s.ready and s.job is None]
        while self.queue and idle:
            job = self.queue.popleft()
            left_s = job.deadline_s - now_s
            if left_s <= 0.001:
                done.append((job, Outcome.failure(P.E_DEADLINE, "deadline passed while queued for a sandbox")))
                continue
            slot = idle.pop()
            timeout_s = min(job.args.get("timeout_s", self.config.default_timeout_s), self.config.max_timeout_s, left_s)
            frame = json.dumps({"code": job.args["code"], "stdin": job.args.get("stdin", ""), "timeout_s": timeout_s})
            data = frame.encode()
            assert slot.popen is not None and slot.popen.stdin is not None
            try:
                # A whole frame (<= ~1.1 MB) while the zygote waits in read(): it drains it at once.
                slot.popen.stdin.write(struct.pack(">I", len(data)) + data)
            except BrokenPipeError:
                self.queue.appendleft(job)
                done += self._restart(slot, "sandbox input pipe closed")
                continue
            slot.job, slot.job_timeout_s, slot.job_started_s = job, timeout_s, now_s
            slot.oom_kills_before = _oom_kills(slot.cgroup)
        # Expire calls that have waited past their deadline even while all sandboxes are busy.
        if self.queue and self.queue[0].deadline_s <= now_s:
            keep = collections.deque()
            for job in self.queue:
                if job.deadline_s <= now_s:
                    done.append((job, Outcome.failure(P.E_DEADLINE, "deadline passed while queued for a sandbox")))
                else:
                    keep.append(job)
            self.queue = keep
        return done

    def cancel_queued(self) -> list[Job]:
        jobs = list(self.queue)
        self.queue.clear()
        return jobs

    def num_running(self) -> int:
        return sum(s.job is not None for s in self.slots)

    def abort_running(self) -> list[tuple[Job, Outcome]]:
        done = []
        for slot in self.slots:
            if slot.job is not None:
                message = "the server stopped while this call ran (after its shutdown grace period)"
                done.append((slot.job, Outcome.failure(P.E_SANDBOX, message)))
                slot.job = None
        return done

    def close(self, timeout_s: float) -> None:
        for slot in self.slots:
            if slot.popen is not None and slot.popen.stdin is not None:
                slot.popen.stdin.close()  # EOF: the zygote exits after its current call
        end = time.monotonic() + timeout_s
        for slot in self.slots:
            if slot.popen is None:
                continue
            try:
                slot.popen.wait(max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            self._kill(slot)
            if slot.cgroup is not None:
                try:
                    slot.cgroup.rmdir()
                except OSError as exc:
                    log.warning("could not remove %s: %s", slot.cgroup, exc)
