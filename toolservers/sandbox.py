"""The `python` tool: untrusted Python in bubblewrap sandboxes, from a pool started ahead of time.

Each of `num_workers` slots is one long-lived sandbox: `bwrap` (run as the slot's unprivileged
zygote uid through `setpriv`) joins a user namespace prepared for the slot and unshares every other
namespace (no network: connect() fails with "Network is unreachable"); the sandbox sees a
read-only /usr (the system interpreter and its standard library) and nothing else of the host: no
/etc, no /home, no project files, an empty environment. Inside, the zygote (sandbox_zygote.py,
passed as `-c` source) is PID 1 and supervises each call; a spawner process it forked at start-up
forks the child that runs each call's code. sandbox_zygote.py says how the child is kept away from
both (two uids, non-dumpable, hidepid, seccomp) and what its seccomp filter refuses.

The slot's user namespace maps exactly two host uids (and the same gids), both unprivileged:
    uid 0 inside     = uid_base + 2 * slot   zygote and spawner (capabilities only inside the sandbox)
    uid 1000 inside  = uid_base + 2 * slot + 1   the call's processes (no capabilities)
Mapping two uids needs a privileged writer of uid_map, so the service runs as root. The namespace
is made by a small helper process running as the zygote uid (so that bwrap, running as that uid,
may join it) which also sets the namespace's user.max_user_namespaces to 0: nothing inside can
create a user namespace of its own (the seccomp filter refuses it too).

What holds between calls (isolation):
- Each call runs in a new process forked by the spawner, a copy of the zygote's clean interpreter
  that never handles call data: no Python state (modules, globals, monkey-patches, random state)
  carries over, and no earlier call's data is in the memory it inherits.
- After each call every other process in the sandbox is SIGKILLed and reaped (background
  processes, double-forked or setsid'd ones included) and /tmp and /dev/shm are replaced by fresh
  empty tmpfs mounts; / and /dev are read-only, and SysV/POSIX IPC objects cannot be created. If
  the cleanup fails, the sandbox is discarded and a fresh one started.
- Not reset between calls of one slot: the kernel's page cache and the sandbox's namespaces
  themselves (hostname, empty network), which a call has no capability to change.

Limits, and what each reports in `limit` when hit:
    wall_time  the call's timeout (min of its timeout_s, max_timeout_s and the request deadline);
               the child and everything it started are killed
    cpu_time   RLIMIT_CPU per process (SIGXCPU); all processes of a slot together get at most
               `cpu_cores` of CPU bandwidth (cpu cgroup quota), so a call uses at most
               cpu_cores x its wall time of CPU whatever it forks
    memory     RLIMIT_AS per process (MemoryError), and the slot's memory cgroup, which bounds the
               sum over all its processes and tmpfs pages (OOM kill, seen in memory.oom_control)
    processes  the slot's pids cgroup (max_processes tasks: bwrap, zygote, spawner and the call's
               processes and threads) and RLIMIT_NPROC of the call uid (fork fails with EAGAIN)
    file_size  RLIMIT_FSIZE (SIGXFSZ)
    disk       the private /tmp or /dev/shm tmpfs (tmpfs_bytes, max_inodes each) filled up
    output     stdout or stderr over max_output_bytes; the child is killed at once

What comes back from a sandbox is parsed as untrusted bytes: a frame longer than the largest
result can be, a body that is not a JSON object with exactly the result's fields and types, or a
frame when no call runs, ends that sandbox (its call answered `sandbox_error`, the slot
restarted); the server itself never fails on it.

Backpressure: a slot runs one call at a time; calls wait in a FIFO queue (bounded by the server's
max_in_flight) and one that waited past its deadline is answered `deadline_exceeded` without
running. A sandbox that dies or does not answer within its call's timeout plus
`wedged_grace_s` is killed (its process group), its call answered `sandbox_error`, and the slot
restarted.

The service refuses to start if `bwrap`, `setpriv`, the system's libseccomp bindings or root are
missing: it never runs code less sandboxed than described here.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import select
import shutil
import signal
import struct
import subprocess
import time
from pathlib import Path

from agentrl.common.config import config_dataclass
from agentrl.toolservers import protocol as P
from agentrl.toolservers.cgroups import (
    CPU_PERIOD_US,
    cgroup_roots,
    counter,
    cpu_quota_us,
    empty_cgroup,
    remove_stale_cgroups,
)
from agentrl.toolservers.sandbox_frames import FrameReader, SandboxProtocolError, check_result
from agentrl.toolservers.server import Job, Outcome, Tool, ToolSpec

log = logging.getLogger(__name__)

ZYGOTE_SOURCE = (Path(__file__).parent / "sandbox_zygote.py").read_text()
MAX_CODE_CHARS = 100_000
MAX_STDIN_CHARS = 1_000_000
CALL_UID_INSIDE = 1000
"""The call's uid (and gid) inside the sandbox's user namespace; the zygote's is 0."""

# Runs as the slot's zygote uid, so that the user namespace it makes is owned by that uid and bwrap
# (same uid) may join it; the server writes the namespace's uid/gid maps from outside.
USERNS_HELPER = """
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
if libc.unshare(0x10000000) != 0:  # CLONE_NEWUSER
    raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWUSER) failed")
with open("/proc/sys/user/max_user_namespaces", "w") as f:  # this namespace's own limit
    f.write("0")
sys.stdout.write("ready\\n")
sys.stdout.flush()
sys.stdin.read()
"""


@config_dataclass
class SandboxConfig:
    """The python tool's sandboxes and their limits (`[python]` of `agentrl toolserver --config`,
    `[services.python]` of a run config)."""

    num_workers: int = 4
    """Sandboxes started ahead of time; calls beyond this many wait in a queue."""
    python: str = "/usr/bin/python3"
    """Interpreter inside the sandbox (bound read-only from the host's /usr); it must be able to
    import the system's libseccomp bindings (Debian `python3-seccomp`)."""
    default_timeout_s: float = 5.0
    """Wall time of a call that names no timeout_s."""
    max_timeout_s: float = 30.0
    """Largest wall time a call may ask for."""
    memory_bytes: int = 1 << 30
    """RLIMIT_AS per process, and the slot's memory cgroup limit (all its processes and tmpfs).
    256 MiB breaks imports of numpy-sized modules; 1 GiB is workable."""
    zygote_memory_bytes: int = 256 << 20
    """RLIMIT_AS of the zygote and of the spawner (each uses about 30 MiB of address space)."""
    max_processes: int = 32
    """Tasks (processes and threads) in one sandbox at once: bwrap's monitor, the zygote and the
    spawner count, so a call may have max_processes - 3."""
    cpu_cores: float = 1.0
    """CPU bandwidth of one sandbox, all its processes together, in cores (cgroup cpu quota)."""
    max_file_bytes: int = 16 << 20
    """Largest file one call may write."""
    tmpfs_bytes: int = 64 << 20
    """Size of the private /tmp and of /dev/shm, each."""
    max_inodes: int = 4096
    """Files, directories and links in /tmp and in /dev/shm, each (tmpfs nr_inodes)."""
    max_output_bytes: int = 64 << 10
    """stdout and stderr kept per call, each; more kills the call (limit "output")."""
    uid_base: int = 61000
    """Slot i uses host uids (and gids) uid_base + 2i (zygote) and uid_base + 2i + 1 (calls)."""
    wedged_grace_s: float = 5.0
    """Extra seconds past a call's timeout before its sandbox is declared wedged and killed."""
    cgroups: bool = True
    """Put each slot in its own cgroup-v1 memory, pids and cpu cgroups (needs them mounted
    read-write). Without them only per-process rlimits bound memory, processes and CPU."""

    def __post_init__(self) -> None:
        if self.num_workers < 1:
            raise ValueError(f"num_workers: must be >= 1, got {self.num_workers}")
        if not 0 < self.default_timeout_s <= self.max_timeout_s:
            raise ValueError("default_timeout_s: need 0 < default_timeout_s <= max_timeout_s")
        if self.max_processes < 4:
            raise ValueError("max_processes: must be >= 4 (bwrap, the zygote, the spawner and the call)")
        if self.cpu_cores <= 0:
            raise ValueError(f"cpu_cores: must be > 0, got {self.cpu_cores}")
        if self.max_inodes < 16:
            raise ValueError(f"max_inodes: must be >= 16, got {self.max_inodes}")
        if self.zygote_memory_bytes > self.memory_bytes:
            raise ValueError("zygote_memory_bytes: must not exceed memory_bytes (a call's limit)")
        for name in ("memory_bytes", "max_file_bytes", "tmpfs_bytes", "max_output_bytes", "wedged_grace_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        if not self.python.startswith("/usr/"):
            raise ValueError(f"python: {self.python!r} must be an executable under /usr (only /usr is visible "
                             "inside the sandbox)")

    def check_host(self) -> None:
        """What only this host can tell: bubblewrap, setpriv and root are there, the interpreter runs,
        and the cgroups are writable when asked for (RuntimeError or ValueError saying what to fix)."""
        if shutil.which("bwrap") is None:
            raise RuntimeError(
                "the python tool needs bubblewrap (`bwrap`) and will not run code unsandboxed: "
                "install it with `apt-get install -y bubblewrap` (scripts/setup.sh does this)"
            )
        if os.geteuid() != 0:
            raise RuntimeError(
                "the python tool must run as root: each sandbox's user namespace maps two unprivileged "
                "uids (the sandbox's supervisor and the call, so that the call cannot trace or signal "
                "its supervisor), which only a privileged process may set up"
            )
        if shutil.which("setpriv") is None:
            raise RuntimeError("the python tool needs `setpriv` (util-linux) to start each sandbox under "
                               "its unprivileged uid")
        if not os.access(self.python, os.X_OK):
            raise ValueError(f"sandbox interpreter {self.python!r} is not an executable on this host")
        if self.cgroups:
            cgroup_roots()  # raises, naming the controller that is missing

    def seccomp_module_dir(self) -> str:
        """Where the sandbox interpreter finds the system's libseccomp bindings (under /usr)."""
        found = subprocess.run(
            [self.python, "-I", "-c", "import os, seccomp; print(os.path.dirname(seccomp.__file__))"],
            capture_output=True, text=True, timeout=30,
        )
        module_dir = found.stdout.strip()
        if found.returncode != 0 or not module_dir.startswith("/usr/"):
            raise RuntimeError(
                f"the python tool filters a call's system calls with libseccomp, but {self.python} cannot "
                f"import it from /usr ({found.stderr.strip().splitlines()[-1:] or module_dir!r}): install "
                "it with `apt-get install -y python3-seccomp` (scripts/setup.sh does this)"
            )
        return module_dir


class _Slot:
    def __init__(self, index: int, max_frame_bytes: int):
        self.index = index
        self.max_frame_bytes = max_frame_bytes
        self.popen: subprocess.Popen | None = None
        self.reader = FrameReader(max_frame_bytes)
        self.ready = False
        self.job: Job | None = None
        self.job_timeout_s = 0.0
        self.job_started_s = 0.0
        # The slot's cgroup counters as of the end of its last call (or its start): the zygote kills
        # every process of a call before it sends the result, so nothing moves them between one
        # result and the next call, and reading them once per call (not at dispatch and at the
        # result) is exact. 20-40 us a read, on the server's loop.
        self.oom_kills_seen = 0
        self.pids_max_hits_seen = 0
        self.cgroups: dict[str, Path] | None = None

    @property
    def fd(self) -> int:
        assert self.popen is not None and self.popen.stdout is not None
        return self.popen.stdout.fileno()

    def oom_kills(self) -> int:
        return 0 if self.cgroups is None else counter(self.cgroups["memory"] / "memory.oom_control", "oom_kill")

    def pids_max_hits(self) -> int:
        return 0 if self.cgroups is None else counter(self.cgroups["pids"] / "pids.events", "max")


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
        config.check_host()
        self.config = config
        # A result holds stdout and stderr of max_output_bytes each; JSON escapes a byte to at most
        # 6 characters ("\ufffd" for an invalid one), plus a few fields.
        max_frame_bytes = 12 * config.max_output_bytes + (64 << 10)
        self.slots = [_Slot(i, max_frame_bytes) for i in range(config.num_workers)]
        self.queue: collections.deque[Job] = collections.deque()
        self._by_fd: dict[int, _Slot] = {}
        self._cgroup_roots = cgroup_roots() if config.cgroups else None
        self._zygote_cfg = json.dumps({
            "max_output_bytes": config.max_output_bytes,
            "max_processes": config.max_processes,
            "memory_bytes": config.memory_bytes,
            "zygote_memory_bytes": config.zygote_memory_bytes,
            "cpu_time_s": int(config.max_timeout_s) + 1,
            "max_file_bytes": config.max_file_bytes,
            "tmpfs_bytes": config.tmpfs_bytes,
            "max_inodes": config.max_inodes,
            "call_uid": CALL_UID_INSIDE,
            "seccomp_module_dir": config.seccomp_module_dir(),
        })

    # --- slots -----------------------------------------------------------------------------------

    def start(self) -> None:
        if self._cgroup_roots is not None:
            for root in self._cgroup_roots.values():
                remove_stale_cgroups(root)
        for slot in self.slots:
            self._spawn(slot)
        # Wait for every sandbox to say ready, so READY means "calls run now at full speed".
        end = time.monotonic() + 30.0
        while not all(s.ready for s in self.slots):
            if time.monotonic() > end:
                raise RuntimeError(f"sandboxes not ready within 30 s: {[s.index for s in self.slots if not s.ready]}")
            for slot in self.slots:
                if not slot.ready:
                    select.select([slot.fd], [], [], 1.0)
                    try:
                        frames = self._read(slot)
                    except SandboxProtocolError as exc:
                        raise RuntimeError(f"sandbox {slot.index} sent a malformed frame at start-up: {exc}") from None
                    if frames is None:
                        raise RuntimeError(self._startup_failure(slot))
                    if frames:
                        raise RuntimeError(f"sandbox {slot.index} sent a result before it was ready")

    def _zygote_uid(self, slot: _Slot) -> int:
        return self.config.uid_base + 2 * slot.index

    def _command(self, slot: _Slot, userns_fd: int) -> list[str]:
        uid = self._zygote_uid(slot)
        setpriv = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all", "--"]
        tmpfs = str(self.config.tmpfs_bytes)
        bwrap = [
            "bwrap", "--userns", str(userns_fd), "--unshare-pid", "--unshare-net", "--unshare-ipc",
            "--unshare-uts", "--unshare-cgroup", "--die-with-parent", "--new-session", "--as-pid-1",
            "--hostname", "sandbox", "--uid", "0", "--gid", "0",
            # What the zygote needs inside the sandbox's namespaces: drop the call to its uid, kill
            # the call's processes, mount fresh tmpfs and /proc options. Nothing on the host.
            "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID", "--cap-add", "CAP_KILL",
            "--cap-add", "CAP_SYS_ADMIN",
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
            "--remount-ro", "/dev", "--remount-ro", "/",
            "--clearenv", "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/tmp",
            "--setenv", "LANG", "C.UTF-8", "--setenv", "PYTHONDONTWRITEBYTECODE", "1", "--chdir", "/tmp",
            self.config.python, "-I", "-S", "-c", ZYGOTE_SOURCE, self._zygote_cfg,
        ]
        return setpriv + bwrap

    def _make_userns(self, slot: _Slot) -> int:
        """A user namespace mapping the slot's two uids and gids; returns an fd that holds it."""
        uid = self._zygote_uid(slot)
        helper = subprocess.Popen(
            ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all", "--",
             self.config.python, "-I", "-S", "-c", USERNS_HELPER],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None,
        )
        assert helper.stdin is not None and helper.stdout is not None
        try:
            ready, _, _ = select.select([helper.stdout], [], [], 10.0)
            line = helper.stdout.readline() if ready else b""
            if line != b"ready\n":
                raise RuntimeError(f"the user-namespace helper of sandbox {slot.index} said {line!r} "
                                   f"(status {helper.poll()}); its error is in this server's log above")
            mapping = f"0 {uid} 1\n{CALL_UID_INSIDE} {uid + 1} 1\n"
            for name in ("uid_map", "gid_map"):
                with open(f"/proc/{helper.pid}/{name}", "w") as f:
                    f.write(mapping)
            return os.open(f"/proc/{helper.pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
        finally:
            helper.stdin.close()
            helper.stdout.close()
            try:
                helper.wait(5)
            except subprocess.TimeoutExpired:
                helper.kill()
                helper.wait(5)

    def _make_cgroups(self, slot: _Slot) -> dict[str, Path] | None:
        if self._cgroup_roots is None:
            return None
        name = f"agentrl-sandbox-{os.getpid()}-{slot.index}"
        cgroups = {controller: root / name for controller, root in self._cgroup_roots.items()}
        for path in cgroups.values():
            path.mkdir(exist_ok=True)
        (cgroups["memory"] / "memory.limit_in_bytes").write_text(str(self.config.memory_bytes))
        (cgroups["pids"] / "pids.max").write_text(str(self.config.max_processes))
        (cgroups["cpu"] / "cpu.cfs_period_us").write_text(str(CPU_PERIOD_US))
        (cgroups["cpu"] / "cpu.cfs_quota_us").write_text(str(cpu_quota_us(self.config.cpu_cores, self._cgroup_roots["cpu"])))
        return cgroups

    def _spawn(self, slot: _Slot) -> None:
        cgroups = slot.cgroups = self._make_cgroups(slot)

        def enter_cgroups() -> None:  # runs in the forked child before exec: no thread-unsafe work
            for path in (cgroups or {}).values():
                with open(path / "cgroup.procs", "w") as f:
                    f.write(str(os.getpid()))

        userns_fd = self._make_userns(slot)
        try:
            slot.popen = subprocess.Popen(
                self._command(slot, userns_fd), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None,
                start_new_session=True, preexec_fn=enter_cgroups, bufsize=0, pass_fds=(userns_fd,),
            )
        finally:
            os.close(userns_fd)
        os.set_blocking(slot.fd, False)
        slot.reader = FrameReader(slot.max_frame_bytes)
        slot.ready = False
        slot.job = None
        slot.oom_kills_seen, slot.pids_max_hits_seen = slot.oom_kills(), slot.pids_max_hits()
        self._by_fd[slot.fd] = slot

    def _kill(self, slot: _Slot) -> None:
        assert slot.popen is not None
        self._by_fd.pop(slot.fd, None)
        try:
            os.killpg(slot.popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # already gone
        slot.popen.wait(5)
        if slot.cgroups is not None:
            # The sandbox's PID 1 runs in its own session (bwrap --new-session), so the group kill
            # above reaches only bwrap; its processes die by PDEATHSIG, asynchronously. Kill what
            # the cgroup still holds and wait until it is empty, so it can be reused or removed.
            empty_cgroup(slot.cgroups["pids"], timeout_s=5.0)
        for stream in (slot.popen.stdin, slot.popen.stdout):
            if stream is not None:
                stream.close()

    def _startup_failure(self, slot: _Slot) -> str:
        assert slot.popen is not None
        return (f"sandbox {slot.index} exited during start-up (status {slot.popen.wait(5)}); its error is "
                "in this server's log above (bwrap/setpriv/zygote message)")

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

    def _read(self, slot: _Slot) -> list[dict] | None:
        """Result frames available from `slot`; None on EOF (the sandbox died). Raises
        SandboxProtocolError on bytes that are not the protocol."""
        try:
            chunk = os.read(slot.fd, 1 << 20)
        except BlockingIOError:
            return []
        if not chunk:
            return None
        results = []
        for frame in slot.reader.feed(chunk):
            if not slot.ready:
                if frame != {"ready": True}:
                    raise SandboxProtocolError(f"expected the ready frame first, got fields {sorted(map(str, frame))}")
                slot.ready = True
            else:
                results.append(check_result(frame))
        return results

    # --- Tool interface --------------------------------------------------------------------------

    def submit(self, jobs: list[Job]) -> list[tuple[Job, Outcome]]:
        self.queue.extend(jobs)
        return self._dispatch(time.monotonic())

    def fds(self) -> list[int]:
        return list(self._by_fd)

    def on_readable(self, fd: int) -> list[tuple[Job, Outcome]]:
        slot = self._by_fd[fd]
        try:
            results = self._read(slot)
        except SandboxProtocolError as exc:
            return self._restart(slot, f"it broke the protocol: {exc}") + self._dispatch(time.monotonic())
        if results is None:
            code = slot.popen.poll() if slot.popen is not None else None
            return self._restart(slot, f"sandbox process exited (status {code})") + self._dispatch(time.monotonic())
        done = []
        for result in results:
            if slot.job is None:
                return done + self._restart(slot, "it sent a result with no call running") + self._dispatch(
                    time.monotonic())
            # The kernel's verdicts, which the sandbox cannot see: an OOM kill in the slot's memory
            # cgroup, a fork refused by its pids cgroup.
            oom_kills, pids_max_hits = slot.oom_kills(), slot.pids_max_hits()
            if result["limit"] is None:
                if oom_kills > slot.oom_kills_seen:
                    result["limit"] = "memory"
                elif pids_max_hits > slot.pids_max_hits_seen:
                    result["limit"] = "processes"
            slot.oom_kills_seen, slot.pids_max_hits_seen = oom_kills, pids_max_hits
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
                # A whole frame (<= ~6 MB: stdin escaped) while the zygote waits in read().
                slot.popen.stdin.write(struct.pack(">I", len(data)) + data)
            except BrokenPipeError:
                self.queue.appendleft(job)
                done += self._restart(slot, "sandbox input pipe closed")
                continue
            slot.job, slot.job_timeout_s, slot.job_started_s = job, timeout_s, now_s
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
            for path in (slot.cgroups or {}).values():
                try:
                    path.rmdir()
                except OSError as exc:
                    log.warning("could not remove %s: %s", path, exc)
