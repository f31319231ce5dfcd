"""The sandbox zygote: runs INSIDE bubblewrap as PID 1 of the sandbox's PID namespace.

This file is not imported by the server. Its source text is passed to the sandbox's interpreter
with `python3 -I -S -c SOURCE CONFIG_JSON`, so no project file is visible inside the sandbox. It
uses only the standard library of the system interpreter (no msgpack there): frames on its
protocol pipe are a 4-byte big-endian length and a UTF-8 JSON object.

Protocol (stdin/stdout of this process, moved to private fds at start):
    zygote -> server  {"ready": true}                               once, after start-up
    server -> zygote  {"code": str, "stdin": str, "timeout_s": float}
    zygote -> server  {"stdout", "stderr", "exit_code", "limit", "duration_s"}
The zygote exits on EOF of its input, or when it cannot restore a clean state after a call
(the server then starts a fresh sandbox).

One call: fork a child (fresh process from the zygote's clean, already-initialized interpreter:
~1 ms instead of ~20 ms for a new interpreter), run the code there under per-process rlimits,
collect bounded stdout/stderr, enforce the wall-clock deadline, then restore the sandbox:
SIGKILL every other process in the PID namespace (the child's background processes and anything
that escaped with setsid or double-fork: as PID 1, the zygote is their reaper) and delete
everything under /tmp and /dev/shm. Being PID 1 also protects the zygote: the kernel does not
deliver SIGKILL/SIGSTOP sent from inside the namespace to its init, so the code cannot kill its
parent.
"""

# Imported before any call so that forked children start with them loaded (fast, and the same
# clean state every time).
import builtins  # noqa: F401  (kept loaded for children)
import errno
import gc
import io
import json
import linecache
import os
import random
import resource
import select
import signal
import struct
import sys
import time
import traceback

CFG = json.loads(sys.argv[1])
MAX_OUTPUT = CFG["max_output_bytes"]
LIMITS = ("memory", "processes", "file_size", "disk")


def limit_of(exc):
    """Which limit an uncaught exception reports, if any (the child tells the zygote on fd 3)."""
    if isinstance(exc, MemoryError):
        return "memory"
    if isinstance(exc, OSError):
        return {errno.EAGAIN: "processes", errno.EFBIG: "file_size", errno.ENOSPC: "disk"}.get(exc.errno)
    return None

PROTO_IN = os.dup(0)
PROTO_OUT = os.dup(1)
_null = os.open("/dev/null", os.O_RDWR)
os.dup2(_null, 0)
os.dup2(_null, 1)
os.close(_null)

# Per-uid process cap: the server starts each sandbox under its own unprivileged uid, so this
# bounds this sandbox alone (the zygote counts as one).
resource.setrlimit(resource.RLIMIT_NPROC, (CFG["max_processes"], CFG["max_processes"]))

_wake_r, _wake_w = os.pipe()
os.set_blocking(_wake_w, False)
os.set_blocking(_wake_r, False)
signal.signal(signal.SIGCHLD, lambda *_: None)
signal.set_wakeup_fd(_wake_w)


def send(obj):
    data = json.dumps(obj).encode()
    view = memoryview(struct.pack(">I", len(data)) + data)
    while view:
        view = view[os.write(PROTO_OUT, view):]


def read_exact(n):
    chunks = []
    while n:
        chunk = os.read(PROTO_IN, n)
        if not chunk:
            return None
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def recv():
    head = read_exact(4)
    if head is None:
        return None
    body = read_exact(struct.unpack(">I", head)[0])
    return None if body is None else json.loads(body)


def child_main(code, fds):
    """In the forked child: never returns."""
    status = 1
    try:
        os.setsid()
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # Python ignores it; a file past the limit ends the call
        os.dup2(fds["stdin_r"], 0)
        os.dup2(fds["stdout_w"], 1)
        os.dup2(fds["stderr_w"], 2)
        os.dup2(fds["status_w"], 3)
        os.closerange(4, 65536)
        limits = [
            (resource.RLIMIT_AS, CFG["memory_bytes"]),
            (resource.RLIMIT_CPU, CFG["cpu_time_s"]),
            (resource.RLIMIT_FSIZE, CFG["max_file_bytes"]),
            (resource.RLIMIT_NOFILE, 256),
            (resource.RLIMIT_CORE, 0),
        ]
        for which, value in limits:
            resource.setrlimit(which, (value, value))
        # If the sandbox's memory cgroup fills, the kernel kills user code before the zygote.
        adj = os.open("/proc/self/oom_score_adj", os.O_WRONLY)
        os.write(adj, b"1000")
        os.close(adj)
        random.seed()  # forked children would otherwise share the zygote's random state
        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8", errors="replace")
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8", errors="replace",
                                      line_buffering=False, write_through=False)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8",
                                      errors="backslashreplace", write_through=True)
        sys.argv = ["<code>"]
        linecache.cache["<code>"] = (len(code), None, code.splitlines(True), "<code>")
        namespace = {"__name__": "__main__", "__builtins__": builtins}
        exec(compile(code, "<code>", "exec"), namespace)
        status = 0
    except SystemExit as exc:
        if exc.code is None:
            status = 0
        elif isinstance(exc.code, int):
            status = exc.code & 0xFF
        else:
            print(exc.code, file=sys.stderr)
            status = 1
    except BaseException as exc:  # noqa: BLE001  user code may raise anything; it is reported, not hidden
        limit = limit_of(exc)
        if limit:
            try:
                os.write(3, limit.encode() + b"\n")
            except OSError:
                pass  # the zygote stopped listening (call already over): nothing to tell
        # Drop this function's own frame: the traceback starts at the user's code.
        traceback.print_exception(type(exc), exc, exc.__traceback__.tb_next)
        status = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError, MemoryError):
                pass  # the reader is gone or the stream is broken: nothing left to report it to
        os._exit(status)


def other_pids():
    me = os.getpid()
    return [int(d) for d in os.listdir("/proc") if d.isdigit() and int(d) != me]


def reap():
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def kill_all_others(timeout_s=2.0):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        pids = other_pids()
        if not pids:
            return True
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        reap()
        time.sleep(0.001)
    return not other_pids()


def wipe(root):
    def make_writable_and_retry(func, path, _exc):
        os.chmod(os.path.dirname(path), 0o700)
        if os.path.isdir(path) and not os.path.islink(path):
            os.chmod(path, 0o700)
        func(path)

    import shutil

    for name in os.listdir(root):
        path = os.path.join(root, name)
        os.chmod(root, 0o1777)
        if os.path.isdir(path) and not os.path.islink(path):
            os.chmod(path, 0o700)
            shutil.rmtree(path, onerror=make_writable_and_retry)
        else:
            os.unlink(path)
    return not os.listdir(root)


def run(job):
    t0 = time.monotonic()
    deadline = t0 + job["timeout_s"]
    stdin_r, stdin_w = os.pipe()
    stdout_r, stdout_w = os.pipe()
    stderr_r, stderr_w = os.pipe()
    status_r, status_w = os.pipe()
    fds = dict(stdin_r=stdin_r, stdout_w=stdout_w, stderr_w=stderr_w, status_w=status_w)
    pid = os.fork()
    if pid == 0:
        child_main(job["code"], fds)
    for fd in fds.values():
        os.close(fd)
    pending_stdin = memoryview(job["stdin"].encode())
    if not pending_stdin:
        os.close(stdin_w)
        stdin_w = -1
    else:
        os.set_blocking(stdin_w, False)
    out = {stdout_r: bytearray(), stderr_r: bytearray()}
    status_bytes = bytearray()
    open_fds = [stdout_r, stderr_r, status_r]
    limit, exit_status, peak = None, None, 1
    while exit_status is None:
        left_s = deadline - time.monotonic()
        if left_s <= 0:
            limit = "wall_time"
            break
        writers = [stdin_w] if stdin_w >= 0 else []
        readable, writable, _ = select.select(open_fds + [_wake_r], writers, [], min(left_s, 0.02))
        for fd in readable:
            if fd == _wake_r:
                while True:
                    try:
                        if not os.read(_wake_r, 512):
                            break
                    except BlockingIOError:
                        break
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                open_fds.remove(fd)
            elif fd == status_r:
                status_bytes += chunk[:256] if len(status_bytes) < 4096 else b""
            else:
                out[fd] += chunk
                if len(out[fd]) > MAX_OUTPUT:
                    limit = "output"
        if writable:
            try:
                pending_stdin = pending_stdin[os.write(stdin_w, pending_stdin[:65536]):]
            except BrokenPipeError:
                pending_stdin = pending_stdin[:0]
            if not pending_stdin:
                os.close(stdin_w)
                stdin_w = -1
        if limit is not None:
            break
        if not readable:
            # Only on a quiet 20 ms tick: a trivial call never pays for the scan. The fork-failure
            # report from the child (fd 3) covers a short-lived fork bomb the scan would miss.
            peak = max(peak, 1 + len(other_pids()))
        done_pid, status = os.waitpid(pid, os.WNOHANG)
        if done_pid:
            exit_status = status
    duration_s = time.monotonic() - t0
    if exit_status is None:
        os.kill(pid, signal.SIGKILL)
        _, exit_status = os.waitpid(pid, 0)
    # The child has exited; keep whatever it had written before its exit.
    for fd in (stdout_r, stderr_r, status_r):
        if fd in open_fds:
            os.set_blocking(fd, False)
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                chunk = b""
            if fd == status_r:
                status_bytes += chunk[:256] if len(status_bytes) < 4096 else b""
            else:
                out[fd] += chunk
    clean = kill_all_others()
    for fd in [stdout_r, stderr_r, status_r] + ([stdin_w] if stdin_w >= 0 else []):
        os.close(fd)
    tmp_full = os.statvfs("/tmp").f_bavail == 0 or os.statvfs("/dev/shm").f_bavail == 0
    clean = clean and wipe("/tmp") and wipe("/dev/shm")

    if os.WIFSIGNALED(exit_status):
        exit_code = -os.WTERMSIG(exit_status)
    else:
        exit_code = os.WEXITSTATUS(exit_status)
    if limit is None:
        reported = [name for name in LIMITS if name.encode() in status_bytes]
        if reported:
            limit = reported[0]
        elif exit_code == -signal.SIGXCPU:
            limit = "cpu_time"
        elif exit_code == -signal.SIGXFSZ:
            limit = "file_size"
        elif peak >= CFG["max_processes"]:
            limit = "processes"
        elif tmp_full:
            limit = "disk"
    result = {
        "stdout": bytes(out[stdout_r][:MAX_OUTPUT]).decode("utf-8", "replace"),
        "stderr": bytes(out[stderr_r][:MAX_OUTPUT]).decode("utf-8", "replace"),
        "exit_code": exit_code,
        "limit": limit,
        "duration_s": round(duration_s, 6),
    }
    return result, clean


def warm_up():
    """Exercise the compiler, printing and traceback formatting once here, so that each forked
    child starts with them initialized: halves a trivial call's CPU (1.6 -> 0.8 ms measured)."""
    source = "xs = [i * i for i in range(3)]\ndef f(a, *b, **c):\n    return a\nclass C:\n    pass\nprint(f(xs))\n"
    exec(compile(source, "<warm-up>", "exec"), {"__name__": "__warm__", "__builtins__": builtins})
    try:
        exec(compile("1 / 0", "<warm-up>", "exec"), {})
    except ZeroDivisionError as exc:
        traceback.format_exception(type(exc), exc, exc.__traceback__)
    sys.stdout.flush()


def main():
    # Objects allocated so far move to a permanent generation the collector never scans, so a
    # forked child's garbage collections do not write to (and copy) the zygote's pages.
    warm_up()
    gc.collect()
    gc.freeze()
    send({"ready": True})
    while True:
        job = recv()
        if job is None:
            return
        result, clean = run(job)
        send(result)
        if not clean:
            print("sandbox zygote: could not restore a clean state; exiting", file=sys.stderr)
            return


main()
