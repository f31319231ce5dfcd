"""Hostile code against the running python tool service: one real server, ONE sandbox.

With a single sandbox every case and the request after it run in the same sandbox, so each case
checks two things: how the attack is blocked (the errno, signal or limit the code sees), and, with
`attack()`, that the very next call in that sandbox is answered correctly and finds it clean (no
file in /tmp or /dev/shm, no other process). The server is never restarted in between; a case that
broke the sandbox would show up as a `sandbox_error` or a wrong answer right after it.

Raw system calls go through ctypes with x86-64 numbers (the module is skipped elsewhere).
"""

from __future__ import annotations

import json
import platform
import signal
import textwrap

import pytest

from agentrl.toolservers.client import ToolClient
from agentrl.toolservers.process import start_toolserver

pytestmark = pytest.mark.skipif(platform.machine() != "x86_64", reason="raw syscall numbers are x86-64's")

CPU_CORES = 0.5
MAX_PROCESSES = 16
MAX_INODES = 256

# What the call after each attack runs, and must print: its answer, and a clean sandbox.
GOOD = textwrap.dedent("""
    import os
    others = [p for p in os.listdir('/proc') if p.isdigit() and p != str(os.getpid())]
    print(6 * 7, os.listdir('/tmp'), os.listdir('/dev/shm'), others, os.statvfs('/tmp').f_ffree > 250)
""")
GOOD_STDOUT = "42 [] [] [] True\n"

# ctypes access to raw system calls for the attacks.
PRELUDE = textwrap.dedent("""
    import ctypes, errno, os, signal
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long

    def sys_(nr, *args):
        ctypes.set_errno(0)
        result = libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(a) if isinstance(a, int) else a for a in args])
        return result, errno.errorcode.get(ctypes.get_errno(), ctypes.get_errno()) if result < 0 else None

    def report(**values):
        import json
        print(json.dumps(values))
""")


@pytest.fixture(scope="module")
def server():
    proc = start_toolserver(
        "python", "tcp://127.0.0.1:*", "--workers", "1", "--max-processes", str(MAX_PROCESSES),
        "--memory-mb", "512", "--max-file-mb", "8", "--tmpfs-mb", "16", "--max-inodes", str(MAX_INODES),
        "--cpu-cores", str(CPU_CORES), "--max-output-bytes", "65536", "--max-timeout-s", "10",
    )
    yield proc
    assert proc.stop(15) == 0


async def attack(server, code: str, prelude: bool = True, **extra) -> dict:
    """Run `code`, then a good call in the same sandbox; return the attack's result."""
    async with ToolClient([server.endpoint]) as client:
        resp = await client.call("python", {"code": (PRELUDE if prelude else "") + textwrap.dedent(code), **extra})
        assert resp.ok, resp.error
        after = await client.call("python", {"code": GOOD})
        assert after.ok, after.error
        assert after.content["stdout"] == GOOD_STDOUT and after.content["limit"] is None, after.content
    assert server.alive()
    return resp.content


def reported(result: dict) -> dict:
    assert result["exit_code"] == 0, result
    return json.loads(result["stdout"].splitlines()[-1])


# --- the sandbox's own processes: PID 1 (the zygote) and the call's parent (the spawner) ------------


async def test_ptrace_of_pid1_and_of_the_parent_is_refused(server):
    out = reported(await attack(server, """
        PTRACE_TRACEME, PTRACE_ATTACH, PTRACE_SEIZE = 0, 16, 0x4206
        report(pid1=sys_(101, PTRACE_ATTACH, 1, 0, 0), parent=sys_(101, PTRACE_ATTACH, os.getppid(), 0, 0),
               seize=sys_(101, PTRACE_SEIZE, 1, 0, 0), traceme=sys_(101, PTRACE_TRACEME, 0, 0, 0))
    """))
    assert out == {"pid1": [-1, "EPERM"], "parent": [-1, "EPERM"], "seize": [-1, "EPERM"], "traceme": [-1, "EPERM"]}


async def test_proc_entries_of_pid1_and_of_the_parent_do_not_exist(server):
    out = reported(await attack(server, """
        seen = {}
        for pid in (1, os.getppid()):
            for what, how in (("mem", "r+b"), ("environ", "rb"), ("maps", "rb"), ("cmdline", "rb")):
                try:
                    open(f"/proc/{pid}/{what}", how).read(16)
                    seen[f"{pid}/{what}"] = "OPENED"
                except OSError as exc:
                    seen[f"{pid}/{what}"] = errno.errorcode[exc.errno]
            try:
                seen[f"{pid}/fd"] = os.listdir(f"/proc/{pid}/fd")
            except OSError as exc:
                seen[f"{pid}/fd"] = errno.errorcode[exc.errno]
        report(seen=seen, pids=[p for p in os.listdir("/proc") if p.isdigit()], me=str(os.getpid()))
    """))
    assert set(out["seen"].values()) == {"ENOENT"}, out["seen"]  # hidepid=invisible
    assert out["pids"] == [out["me"]]


async def test_process_vm_readv_and_writev_of_pid1_are_refused(server):
    out = reported(await attack(server, """
        buf = ctypes.create_string_buffer(64)
        iov = (ctypes.c_void_p * 2)(ctypes.addressof(buf), 64)
        remote = (ctypes.c_void_p * 2)(0x400000, 64)
        report(readv=sys_(310, 1, ctypes.addressof(iov), 1, ctypes.addressof(remote), 1, 0),
               writev=sys_(311, 1, ctypes.addressof(iov), 1, ctypes.addressof(remote), 1, 0),
               kcmp=sys_(312, 1, os.getpid(), 0, 0, 0))
    """))
    assert out == {"readv": [-1, "EPERM"], "writev": [-1, "EPERM"], "kcmp": [-1, "EPERM"]}


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGSTOP,
                                 signal.SIGCHLD, signal.SIGHUP, 0])
async def test_signals_to_pid1_and_to_the_parent_are_refused(server, sig):
    out = reported(await attack(server, f"""
        results = {{}}
        for name, pid in (("pid1", 1), ("parent", os.getppid())):
            try:
                os.kill(pid, {int(sig)})
                results[name] = "DELIVERED"
            except OSError as exc:
                results[name] = errno.errorcode[exc.errno]
            results[name + "_tgkill"] = sys_(234, pid, pid, {int(sig)})[1]
        report(**results)
    """))
    assert out == {"pid1": "EPERM", "pid1_tgkill": "EPERM", "parent": "EPERM", "parent_tgkill": "EPERM"}


async def test_a_pidfd_of_pid1_gives_neither_signals_nor_descriptors(server):
    out = reported(await attack(server, """
        fd, err = sys_(434, 1, 0)  # pidfd_open
        report(open_error=err, send_signal=sys_(424, fd, signal.SIGKILL, 0, 0), getfd=sys_(438, fd, 0, 0))
    """))
    assert out["send_signal"] == [-1, "EPERM"] and out["getfd"] == [-1, "EPERM"], out


async def test_kill_minus_one_reaches_only_the_calls_own_processes(server):
    result = await attack(server, """
        import time
        pid = os.fork()
        if pid == 0:
            time.sleep(30)
            os._exit(0)
        os.kill(-1, signal.SIGKILL)  # every process it may signal but itself
        print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
    """)
    assert result["stdout"] == f"{-signal.SIGKILL}\n"  # its child died; attack() saw PID 1 answer after


async def test_sigio_aimed_at_pid1_is_not_delivered(server):
    result = await attack(server, """
        import fcntl
        r, w = os.pipe()
        fcntl.fcntl(r, fcntl.F_SETOWN, 1)
        fcntl.fcntl(r, fcntl.F_SETSIG, signal.SIGKILL)
        fcntl.fcntl(r, fcntl.F_SETFL, fcntl.fcntl(r, fcntl.F_GETFL) | os.O_ASYNC)
        for _ in range(100):
            os.write(w, b"x")
        print("written")
    """)
    assert result["stdout"] == "written\n"  # and attack() saw PID 1 answer the next call


async def test_writes_to_every_descriptor_reach_nothing_of_the_sandbox(server):
    """The protocol pipe is not among the call's descriptors: only 0-3 exist (3: the call's own
    status pipe, where garbage is harmless)."""
    out = reported(await attack(server, """
        garbage = b"\\x00\\x00\\x00\\x10" + b'{"ready": true}' + os.urandom(4096)
        open_fds = []
        for fd in range(3, 1024):
            try:
                os.write(fd, garbage)
                open_fds.append(fd)
            except OSError as exc:
                assert exc.errno == errno.EBADF, exc
        os.write(3, os.urandom(1 << 16))
        report(open_fds=open_fds, listed=sorted(int(fd) for fd in os.listdir("/proc/self/fd")))
    """))
    assert out["open_fds"] == [3]
    assert set(out["listed"]) - {0, 1, 2, 3} <= {max(out["listed"])}  # the listing's own fd


async def test_an_earlier_calls_data_is_not_in_a_later_calls_memory(server):
    """Call A's code, stdin and output pass through the sandbox; call B searches its whole address
    space (its own, readable through /proc/self/mem) for them. Children are forked from a process
    that never handled call data, so B finds nothing (with children forked from the process that
    reads the jobs, B found 223 copies)."""
    secret = "7f3a9c" * 2
    scan = textwrap.dedent("""
        import re
        pattern = re.compile(rb"S3CRET-([0-9a-f]{12})")
        found = set()
        with open("/proc/self/maps") as maps, open("/proc/self/mem", "rb", 0) as mem:
            for line in maps:
                span, perms = line.split()[:2]
                lo, hi = (int(x, 16) for x in span.split("-"))
                if "r" not in perms or hi - lo > 1 << 28:
                    continue
                try:
                    mem.seek(lo)
                    found.update(m.decode() for m in pattern.findall(mem.read(hi - lo)))
                except OSError:
                    continue
        print(sorted(found))
    """)
    async with ToolClient([server.endpoint]) as client:
        first = await client.call("python", {"code": f"x = 'S3CRET-{secret}'\nimport sys\nprint(sys.stdin.read() * 3)",
                                             "stdin": f"S3CRET-{secret} " * 100})
        assert first.ok and f"S3CRET-{secret}" in first.content["stdout"]
        second = await client.call("python", {"code": scan})
    assert second.ok and second.content["exit_code"] == 0, second
    assert second.content["stdout"] == "[]\n", second.content


async def test_no_capabilities_no_uid_change_and_the_filter_is_on(server):
    out = reported(await attack(server, """
        status = dict(line.split(":\\t", 1) for line in open("/proc/self/status").read().splitlines() if ":\\t" in line)
        try:
            os.setuid(0)
            setuid = "WORKED"
        except OSError as exc:
            setuid = errno.errorcode[exc.errno]
        report(uid=os.getresuid(), gid=os.getresgid(), groups=os.getgroups(), cap_eff=status["CapEff"].strip(),
               cap_prm=status["CapPrm"].strip(), no_new_privs=status["NoNewPrivs"].strip(),
               seccomp=status["Seccomp"].strip(), setuid=setuid)
    """))
    assert out == {"uid": [1000] * 3, "gid": [1000] * 3, "groups": [], "cap_eff": "0" * 16, "cap_prm": "0" * 16,
                   "no_new_privs": "1", "seccomp": "2", "setuid": "EPERM"}


# --- namespaces, mounts, kernel surface ------------------------------------------------------------


async def test_namespace_creation_and_joining_are_refused(server):
    out = reported(await attack(server, """
        import subprocess
        CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x20000, 0x10000000, 0x20000000, 0x40000000
        net = os.open("/proc/self/ns/net", os.O_RDONLY)
        report(unshare={hex(f): sys_(272, f) for f in (CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET)},
               setns=sys_(308, net, 0), clone_newuser=sys_(56, CLONE_NEWUSER | signal.SIGCHLD, 0, 0, 0, 0),
               clone3=sys_(435, 0, 0), fork_still_works=subprocess.run(["true"]).returncode == 0)
    """))
    assert out["unshare"] == {hex(f): [-1, "EPERM"] for f in (0x20000, 0x10000000, 0x20000000, 0x40000000)}
    assert out["setns"] == [-1, "EPERM"] and out["clone_newuser"] == [-1, "EPERM"]
    assert out["clone3"] == [-1, "ENOSYS"] and out["fork_still_works"] is True


async def test_mounts_are_refused(server):
    out = reported(await attack(server, """
        report(mount=sys_(165, b"none", b"/tmp", b"tmpfs", 0, 0), umount=sys_(166, b"/tmp", 2),
               remount_root=sys_(165, 0, b"/", 0, 32, 0), pivot_root=sys_(155, b"/tmp", b"/tmp"),
               chroot=sys_(161, b"/tmp"), fsopen=sys_(430, b"tmpfs", 0), open_tree=sys_(428, -100, b"/", 1))
    """))
    assert all(v == [-1, "EPERM"] for v in out.values()), out


async def test_bpf_perf_keys_io_uring_userfaultfd_and_modules_are_refused(server):
    out = reported(await attack(server, """
        attr = ctypes.create_string_buffer(128)
        report(bpf=sys_(321, 0, ctypes.addressof(attr), 128), perf_event_open=sys_(298, ctypes.addressof(attr), 0, -1, -1, 0),
               keyctl=sys_(250, 0, 0, 0), add_key=sys_(248, b"user", b"k", b"v", 1, -4),
               request_key=sys_(249, b"user", b"k", 0, 0), io_uring_setup=sys_(425, 8, ctypes.addressof(attr)),
               userfaultfd=sys_(323, 0), init_module=sys_(175, 0, 0, b""), kexec_load=sys_(246, 0, 0, 0, 0),
               open_by_handle_at=sys_(304, -100, 0, 0), personality=sys_(135, 0x0400000))
    """))
    assert all(v == [-1, "EPERM"] for v in out.values()), out


async def test_ipc_objects_that_would_outlive_the_call_cannot_be_created(server):
    out = reported(await attack(server, """
        IPC_PRIVATE, IPC_CREAT = 0, 0o1000
        report(shmget=sys_(29, IPC_PRIVATE, 4096, IPC_CREAT | 0o600), semget=sys_(64, IPC_PRIVATE, 1, IPC_CREAT | 0o600),
               msgget=sys_(68, IPC_PRIVATE, IPC_CREAT | 0o600), mq_open=sys_(240, b"q", os.O_CREAT | os.O_RDWR, 0o600, 0))
    """))
    assert all(v == [-1, "EPERM"] for v in out.values()), out


async def test_a_32bit_system_call_kills_the_process(server):
    """int 0x80 reaches the i386 syscall table, which a filter keyed on x86-64 numbers would not
    see: the filter's architecture check kills the process (SIGSYS) instead."""
    result = await attack(server, """
        import mmap
        code = bytes([0xB8, 26, 0, 0, 0, 0x31, 0xDB, 0xCD, 0x80, 0xC3])  # mov eax, 26 (ptrace); xor ebx, ebx; int 0x80; ret
        page = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
        page.write(code)
        address = ctypes.addressof(ctypes.c_char.from_buffer(page))
        print("calling", flush=True)
        ctypes.CFUNCTYPE(ctypes.c_int)(address)()
        print("returned")
    """)
    assert result["exit_code"] == -signal.SIGSYS and result["stdout"] == "calling\n", result


# --- what a call writes does not survive it --------------------------------------------------------


async def test_root_and_dev_are_read_only(server):
    out = reported(await attack(server, """
        seen = {}
        for name, action in (("/evil", lambda: open("/evil", "w")), ("/dev/evil", lambda: open("/dev/evil", "w")),
                             ("mkdir /usr/x", lambda: os.mkdir("/usr/x")), ("mkdir /dev/x", lambda: os.mkdir("/dev/x")),
                             ("hostname", lambda: open("/proc/sys/kernel/hostname", "w").write("x"))):
            try:
                action()
                seen[name] = "WROTE"
            except OSError as exc:
                seen[name] = errno.errorcode[exc.errno]
        report(**seen)
    """))
    hostname = out.pop("hostname")
    assert out == {"/evil": "EROFS", "/dev/evil": "EROFS", "mkdir /usr/x": "EROFS", "mkdir /dev/x": "EROFS"}
    assert hostname in ("EROFS", "EACCES")  # /proc/sys is bound read-only, its files belong to no uid here


async def test_files_dirs_links_and_fifos_in_tmp_and_shm_are_gone_for_the_next_call(server):
    result = await attack(server, """
        for root in ("/tmp", "/dev/shm"):
            os.makedirs(f"{root}/a/b/c")
            open(f"{root}/a/b/c/file", "w").write("secret")
            os.symlink("/tmp/a", f"{root}/link")
            os.mkfifo(f"{root}/fifo")
            os.chmod(f"{root}/a/b", 0)
            os.chmod(f"{root}/a", 0)
        fd = os.open("/tmp/held-open", os.O_CREAT | os.O_WRONLY)
        os.unlink("/tmp/held-open")
        print(sorted(os.listdir("/tmp")))
    """)
    assert result["stdout"] == "['a', 'fifo', 'link']\n"  # and attack() found both empty after


async def test_a_deep_tree_of_unreadable_directories_is_gone_for_the_next_call(server):
    result = await attack(server, """
        path = "/tmp"
        for level in range(200):
            path += "/d"
            os.mkdir(path)
        for level in range(200):
            os.chmod(path, 0)
            path = os.path.dirname(path)
        print(level)
    """)
    assert result["stdout"] == "199\n"


async def test_inode_exhaustion_is_reported_and_does_not_carry_over(server):
    result = await attack(server, """
        count = 0
        while True:
            open(f"/dev/shm/f{count}", "w").close()
            count += 1
    """)
    assert result["limit"] == "disk" and "No space left" in result["stderr"]  # attack() saw f_ffree back


async def test_a_background_process_cannot_write_into_the_next_call(server):
    async with ToolClient([server.endpoint]) as client:
        first = await client.call("python", {"code": textwrap.dedent("""
            import os, time
            if os.fork() == 0:
                os.setsid()
                for i in range(100):
                    time.sleep(0.01)
                    open(f"/tmp/late{i}", "w").close()
            print("forked")
        """)})
        assert first.ok and first.content["stdout"] == "forked\n"
        later = await client.call("python", {"code": "import os, time\ntime.sleep(0.5)\nprint(os.listdir('/tmp'))"})
    assert later.content["stdout"] == "[]\n", later.content


# --- resources ---------------------------------------------------------------------------------------


async def test_a_fork_bomb_stops_at_the_process_limit(server):
    result = await attack(server, "import os\nwhile True:\n    os.fork()", prelude=False, timeout_s=10)
    assert result["limit"] == "processes"


async def test_a_thread_bomb_stops_at_the_pids_cgroup(server):
    """Threads are tasks too: Python's RuntimeError is no errno the zygote maps to a limit, the
    pids cgroup's own count says which limit was hit."""
    result = await attack(server, textwrap.dedent("""
        import threading, time
        threads = []
        while True:
            t = threading.Thread(target=time.sleep, args=(5,), daemon=True)
            t.start()
            threads.append(t)
    """), prelude=False, timeout_s=10)
    assert result["limit"] == "processes" and "can't start new thread" in result["stderr"], result


async def test_cpu_burned_across_processes_is_held_to_the_slots_cpu_quota(server):
    """6 processes spin for 2 s of wall time; all of them together got about CPU_CORES x 2 s of
    CPU (without the cpu cgroup: up to 2 cores x 2 s on this machine)."""
    out = reported(await attack(server, """
        import resource, time
        start = time.monotonic()
        pids = []
        for _ in range(6):
            pid = os.fork()
            if pid == 0:
                while time.monotonic() - start < 2.0:
                    pass
                os._exit(0)
            pids.append(pid)
        for pid in pids:
            os.waitpid(pid, 0)
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        report(cpu_s=usage.ru_utime + usage.ru_stime, wall_s=time.monotonic() - start)
    """, timeout_s=10))
    assert out["cpu_s"] <= CPU_CORES * out["wall_s"] * 1.2 + 0.1, out


async def test_one_huge_allocation_hits_the_memory_limit(server):
    result = await attack(server, "x = bytearray(2 << 30)", prelude=False)
    assert result["limit"] == "memory" and "MemoryError" in result["stderr"]


async def test_filling_shared_memory_is_freed_for_the_next_call(server):
    """16 MiB in /dev/shm (its size) is charged to the sandbox's memory cgroup while the call
    lasts; the next call finds it empty and can fill it again."""
    for _ in range(2):
        result = await attack(server, """
            written = 0
            try:
                for i in range(64):  # files of 4 MiB: under the 8 MiB file-size limit
                    with open(f"/dev/shm/fill{i}", "wb") as f:
                        for _ in range(4):
                            f.write(b"x" * (1 << 20))
                            written += 1
            except OSError as exc:
                print(errno.errorcode[exc.errno], written)
        """)
        assert result["stdout"] in ("ENOSPC 15\n", "ENOSPC 16\n") and result["limit"] == "disk", result


async def test_running_out_of_descriptors_is_the_calls_own_error(server):
    result = await attack(server, "files = []\nwhile True:\n    files.append(open('/dev/null'))", prelude=False)
    assert result["exit_code"] == 1 and "Too many open files" in result["stderr"]


async def test_a_call_that_stops_itself_is_cut_at_its_deadline(server):
    result = await attack(server, "import os, signal\nos.kill(os.getpid(), signal.SIGSTOP)", prelude=False,
                          timeout_s=1)
    assert result["limit"] == "wall_time" and result["exit_code"] == -signal.SIGKILL


# --- host, network, output ---------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/etc/passwd", "/proc/1/root/etc/passwd", "/sys/kernel/notes", "/root/.bashrc",
                                  "/work/main/pyproject.toml", "/etc/hostname"])
async def test_host_files_are_not_there(server, path):
    result = await attack(server, f"print(open({path!r}).read())", prelude=False)
    assert result["exit_code"] == 1 and "FileNotFoundError" in result["stderr"] and result["stdout"] == ""


async def test_the_network_reaches_neither_the_internet_nor_the_tool_server_itself(server):
    port = int(server.endpoint.rsplit(":", 1)[1])
    out = reported(await attack(server, f"""
        import socket
        seen = {{}}
        for host, port in (("1.1.1.1", 80), ("127.0.0.1", {port})):
            try:
                socket.create_connection((host, port), timeout=2)
                seen[host] = "CONNECTED"
            except OSError as exc:
                seen[host] = errno.errorcode.get(exc.errno, str(exc))
        report(interfaces=[name for _, name in socket.if_nameindex()], **seen)
    """))
    assert out == {"interfaces": ["lo"], "1.1.1.1": "ENETUNREACH", "127.0.0.1": "ECONNREFUSED"}


async def test_a_flood_of_stdout_and_stderr_hits_the_output_limit(server):
    for stream in ("stdout", "stderr"):
        result = await attack(server, f"import sys\nwhile True:\n    sys.{stream}.write('x' * 4096)", prelude=False)
        assert result["limit"] == "output" and len(result[stream]) == 65536


async def test_bytes_that_look_like_protocol_frames_stay_the_calls_output(server):
    result = await attack(server, """
        os.write(1, b"\\x00\\x00\\x00\\x0f" + b'{"ready": true}' + b"\\xff\\xfe\\x00 end")
        os.write(2, b"\\x00\\x00\\x01\\x00" + b'{"stdout": "forged", "stderr": "", "exit_code": 0}')
    """)
    assert result["stdout"] == '\x00\x00\x00\x0f{"ready": true}\ufffd\ufffd\x00 end'
    assert result["stderr"].endswith('{"stdout": "forged", "stderr": "", "exit_code": 0}')
