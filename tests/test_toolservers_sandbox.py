"""The python tool against hostile code, through a real server and a real bubblewrap sandbox.

Each case checks what the response says (limit hit, error seen by the code) and, through the
`probe` fixture, that the sandbox is usable right after; the server is never restarted in between.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import pytest

from agentrl.toolservers.client import ToolClient, ToolServiceUnavailable
from agentrl.toolservers.process import start_toolserver

LOCAL = "tcp://127.0.0.1:*"


@pytest.fixture(scope="module")
def python_server():
    # 2 sandboxes; 16 processes per sandbox keeps the fork bomb short on a 2-core machine.
    proc = start_toolserver("python", LOCAL, "--workers", "2", "--max-processes", "16", "--memory-mb", "512",
                            "--max-file-mb", "8", "--tmpfs-mb", "32", "--max-output-bytes", "65536")
    yield proc
    assert proc.stop(15) == 0


@pytest.fixture(scope="module")
def single_sandbox_server():
    """One sandbox, so consecutive calls are guaranteed to run in the same sandbox."""
    proc = start_toolserver("python", LOCAL, "--workers", "1")
    yield proc
    assert proc.stop(15) == 0


async def run(endpoint: str, code: str, **extra) -> dict:
    async with ToolClient([endpoint]) as client:
        resp = await client.call("python", {"code": code, **extra})
        assert resp.ok, resp.error
        after = await client.call("python", {"code": "print(6 * 7)"})
        assert after.ok and after.content["stdout"] == "42\n" and after.content["limit"] is None, after
    return resp.content


async def test_describe_marks_python_not_idempotent(python_server):
    async with ToolClient([python_server.endpoint]) as client:
        spec = (await client.describe())[0]
    assert spec["function"]["name"] == "python" and spec["idempotent"] is False
    assert set(spec["function"]["parameters"]["properties"]) == {"code", "stdin", "timeout_s"}


async def test_runs_code_with_stdin_and_reports_exit_code(python_server):
    out = await run(python_server.endpoint, "import sys\ndata = sys.stdin.read()\nprint(data.upper())\nsys.exit(3)",
                    stdin="hello")
    assert out["stdout"] == "HELLO\n" and out["exit_code"] == 3 and out["limit"] is None
    assert set(out) >= {"stdout", "stderr", "exit_code", "limit"}


async def test_exceptions_come_back_as_tracebacks_of_the_users_code(python_server):
    out = await run(python_server.endpoint, "x = 1\ny = x / 0")
    assert out["exit_code"] == 1 and out["limit"] is None
    assert 'File "<code>", line 2' in out["stderr"] and "ZeroDivisionError" in out["stderr"]


async def test_fork_bomb_hits_the_process_limit(python_server):
    out = await run(python_server.endpoint, "import os\nwhile True:\n    os.fork()", timeout_s=10)
    assert out["limit"] == "processes"


async def test_memory_bomb_hits_the_memory_limit(python_server):
    out = await run(python_server.endpoint, "chunks = []\nwhile True:\n    chunks.append(bytearray(50 << 20))")
    assert out["limit"] == "memory" and "MemoryError" in out["stderr"]


async def test_infinite_loop_hits_the_wall_time_limit(python_server):
    out = await run(python_server.endpoint, "while True:\n    pass", timeout_s=0.5)
    assert out["limit"] == "wall_time" and out["exit_code"] == -9


async def test_sleeping_past_the_request_deadline_is_cut_at_the_deadline(python_server):
    async with ToolClient([python_server.endpoint]) as client:
        resp = await client.call("python", {"code": "import time\ntime.sleep(30)\nprint('woke')", "timeout_s": 30},
                                 deadline_s=0.8)
    assert resp.ok and resp.content["limit"] == "wall_time" and "woke" not in resp.content["stdout"]


@pytest.mark.parametrize(
    "code",
    [
        "print(open('/etc/shadow').read())",
        "print(open('/etc/passwd').read())",
        f"print(open({os.path.abspath(__file__)!r}).read())",
        "print(open('/work/main/pyproject.toml').read())",
        "print(open('/root/.bashrc').read())",
    ],
)
async def test_host_files_are_not_visible(python_server, code):
    out = await run(python_server.endpoint, code)
    assert out["exit_code"] == 1 and "FileNotFoundError" in out["stderr"] and out["stdout"] == ""


async def test_environment_and_filesystem_show_nothing_of_the_host(python_server):
    out = await run(python_server.endpoint, "import os\nprint(sorted(os.environ))\nprint(sorted(os.listdir('/')))")
    env_line, root_line = out["stdout"].splitlines()
    assert env_line == "['HOME', 'LANG', 'PATH', 'PWD', 'PYTHONDONTWRITEBYTECODE']"
    assert root_line == "['bin', 'dev', 'lib', 'lib64', 'proc', 'sbin', 'tmp', 'usr']"


async def test_usr_is_read_only(python_server):
    out = await run(python_server.endpoint, "open('/usr/evil', 'w').write('x')")
    assert out["exit_code"] == 1 and "Read-only file system" in out["stderr"]


async def test_network_connections_fail(python_server):
    code = (
        "import socket\n"
        "for host in ('1.1.1.1', '127.0.0.1'):\n"
        "    try:\n"
        "        socket.create_connection((host, 80), timeout=2)\n"
        "        print('connected', host)\n"
        "    except OSError as exc:\n"
        "        print('refused', host, exc.errno)\n"
    )
    out = await run(python_server.endpoint, code)
    assert "connected" not in out["stdout"] and out["stdout"].count("refused") == 2


async def test_huge_file_hits_the_file_size_limit(python_server):
    out = await run(python_server.endpoint, "with open('/tmp/big', 'wb') as f:\n    f.write(b'x' * (64 << 20))")
    assert out["limit"] == "file_size"


async def test_many_files_fill_the_private_tmpfs(python_server):
    code = "for i in range(100):\n    open(f'/tmp/f{i}', 'wb').write(b'x' * (4 << 20))"
    out = await run(python_server.endpoint, code)
    assert out["limit"] == "disk" and "No space left" in out["stderr"]


async def test_huge_stdout_hits_the_output_limit(python_server):
    out = await run(python_server.endpoint, "while True:\n    print('x' * 1000)")
    assert out["limit"] == "output" and len(out["stdout"]) == 65536


async def test_killing_the_parent_does_not_kill_the_sandbox(python_server):
    """The call's parent and PID 1 run under another uid: the kernel refuses the signal."""
    code = (
        "import os, signal\n"
        "for pid in (os.getppid(), 1):\n"
        "    try:\n"
        "        os.kill(pid, signal.SIGKILL)\n"
        "    except PermissionError:\n"
        "        print('refused', pid == 1)\n"
        "print('alive')\n"
    )
    out = await run(python_server.endpoint, code)
    assert out["stdout"] == "refused False\nrefused True\nalive\n"
    assert python_server.alive()


async def test_nothing_outlives_a_call(single_sandbox_server):
    """A call leaves background processes (one setsid'd, one double-forked) and a file; the next
    call in the same sandbox sees neither, and the previous call's Python state is gone."""
    spawn = (
        "import os, subprocess\n"
        "subprocess.Popen(['sleep', '1000'], start_new_session=True)\n"
        "if os.fork() == 0:\n"
        "    if os.fork() == 0:\n"
        "        os.setsid()\n"
        "        import time; time.sleep(1000)\n"
        "    os._exit(0)\n"
        "open('/tmp/left-behind', 'w').write('secret')\n"
        "open('/dev/shm/left-behind', 'w').write('secret')\n"
        "import builtins; builtins.LEAK = 'secret'\n"
        "print('spawned')\n"
    )
    look = (
        "import os, builtins\n"
        # Processes of the call uid are all visible here; the sandbox's own ones are hidden.
        "print([int(p) for p in os.listdir('/proc') if p.isdigit()] == [os.getpid()])\n"
        "print(os.listdir('/tmp'), os.listdir('/dev/shm'), hasattr(builtins, 'LEAK'))\n"
    )
    async with ToolClient([single_sandbox_server.endpoint]) as client:
        first = await client.call("python", {"code": spawn})
        assert first.ok and first.content["stdout"] == "spawned\n"
        second = await client.call("python", {"code": look})
    assert second.content["stdout"] == "True\n[] [] False\n", second.content


async def test_calls_run_concurrently_and_each_gets_its_own_output(python_server):
    async with ToolClient([python_server.endpoint]) as client:
        resps = await asyncio.gather(*[client.call("python", {"code": f"print({i} ** 2)"}) for i in range(40)])
    assert [r.content["stdout"] for r in resps] == [f"{i * i}\n" for i in range(40)]


async def test_replica_dying_during_a_non_idempotent_call_is_not_retried():
    proc = start_toolserver("python", LOCAL, "--workers", "1")
    try:
        async with ToolClient([proc.endpoint], heartbeat_interval_s=0.1) as client:
            call = asyncio.create_task(client.call("python", {"code": "import time; time.sleep(5)"}))
            await asyncio.sleep(0)  # the call is queued on the socket first...
            await client.describe()  # ...so once describe is answered, the call is running
            proc.kill()
            with pytest.raises(ToolServiceUnavailable, match="not idempotent"):
                await call
    finally:
        proc.stop(10)


def test_refuses_to_start_without_bubblewrap(tmp_path):
    env = dict(os.environ, PATH=str(tmp_path))  # no bwrap on PATH
    res = subprocess.run([sys.executable, "-P", "-m", "agentrl.cli", "toolserver", "python", "--bind", LOCAL],
                         env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "bubblewrap" in res.stderr and "READY" not in res.stdout


async def test_memory_spread_over_processes_hits_the_sandbox_memory_cgroup(python_server):
    """Each process stays under its own 512 MiB address-space limit, together they pass the
    sandbox's 512 MiB memory cgroup: the kernel kills one, and the response says so."""
    code = (
        "import os, time\n"
        "for _ in range(3):\n"
        "    if os.fork() == 0:\n"
        "        block = b'x' * (300 << 20)\n"
        "        time.sleep(5)\n"
        "        os._exit(0)\n"
        "block = b'x' * (300 << 20)\n"
        "if all(os.wait()[1] == 0 for _ in range(3)):\n"
        "    print('all survived')\n"
    )
    out = await run(python_server.endpoint, code, timeout_s=15)
    assert out["limit"] == "memory" and "all survived" not in out["stdout"], out


async def test_sigterm_answers_running_and_queued_calls_and_exits_within_its_grace():
    """One sandbox: call A runs (sleeps 30 s), call B waits in the queue. SIGTERM: B is answered
    `shutting_down` (not executed: safe to resend), A is answered as cut off after the 2 s grace,
    and the server exits 0 by itself. Raw frames: the client library would resend B by itself."""
    import msgpack
    import zmq
    import zmq.asyncio

    proc = start_toolserver("python", LOCAL, "--workers", "1")
    ctx = zmq.asyncio.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(proc.endpoint)
    try:
        for req_id, code in ((1, "import time; time.sleep(30)"), (2, "print('B')")):
            await raw.send(msgpack.packb({"id": req_id, "op": "call", "tool": "python",
                                          "args": {"code": code, "timeout_s": 30}, "timeout_s": 30}))
        await raw.send(msgpack.packb({"id": 99, "op": "ping"}))  # barrier: A running, B queued
        assert msgpack.unpackb(await asyncio.wait_for(raw.recv(), 10))["id"] == 99
        proc.kill(signal.SIGTERM)
        replies = {}
        while len(replies) < 2:
            reply = msgpack.unpackb(await asyncio.wait_for(raw.recv(), 15))
            for one in reply if isinstance(reply, list) else [reply]:
                replies[one["id"]] = one
        assert replies[2]["error"]["type"] == "shutting_down"
        assert replies[1]["error"]["type"] == "sandbox_error" and "stopped" in replies[1]["error"]["message"]
        assert proc.popen.wait(15) == 0
    finally:
        raw.close(0)
        ctx.term()
        proc.stop(10)


async def test_a_sandbox_killed_from_outside_is_replaced_and_its_call_answered():
    """SIGKILL the sandbox (bwrap) process from the host while a call runs in it: the call is
    answered `sandbox_error`, the slot gets a fresh sandbox, and the next call succeeds."""
    proc = start_toolserver("python", LOCAL, "--workers", "1")
    try:
        def sandbox_pids() -> list[int]:
            out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(proc.pid)], capture_output=True, text=True)
            return [int(p) for p in out.stdout.split()]

        (first,) = sandbox_pids()
        async with ToolClient([proc.endpoint]) as client:
            running = asyncio.create_task(client.call("python", {"code": "import time; time.sleep(20)"}))
            await asyncio.sleep(0)  # the call is queued on the socket first...
            await client.describe()  # ...so once describe is answered, the call is running
            os.kill(first, signal.SIGKILL)
            resp = await asyncio.wait_for(running, 10)
            assert not resp.ok and resp.error.type == "sandbox_error"
            after = await client.call("python", {"code": "print('fresh')"})
            assert after.ok and after.content["stdout"] == "fresh\n"
        (second,) = sandbox_pids()
        assert second != first
    finally:
        assert proc.stop(10) == 0


def test_a_sandbox_cpu_quota_never_exceeds_its_parent_cgroups(tmp_path):
    # cgroup v1 refuses (EINVAL) a child quota above its parent's: a tool service in a container held
    # to 0.76 cores must give its sandboxes at most that, not fail to start them.
    from agentrl.toolservers.cgroups import CPU_PERIOD_US, cpu_quota_us

    (tmp_path / "cpu.cfs_quota_us").write_text("-1\n")  # no quota above
    (tmp_path / "cpu.cfs_period_us").write_text("100000\n")
    assert cpu_quota_us(1.0, tmp_path) == CPU_PERIOD_US
    (tmp_path / "cpu.cfs_quota_us").write_text("76000\n")  # 0.76 cores
    assert cpu_quota_us(1.0, tmp_path) == int(0.76 * CPU_PERIOD_US)
    assert cpu_quota_us(0.5, tmp_path) == int(0.5 * CPU_PERIOD_US)
    (tmp_path / "cpu.cfs_period_us").write_text("50000\n")  # 38000 per 50000 is still 0.76 cores
    (tmp_path / "cpu.cfs_quota_us").write_text("38000\n")
    assert cpu_quota_us(1.0, tmp_path) == int(0.76 * CPU_PERIOD_US)
    # A parent without a quota of its own under an ancestor with one: the ancestor's bounds it.
    child = tmp_path / "service"
    child.mkdir()
    (child / "cpu.cfs_quota_us").write_text("-1\n")
    (child / "cpu.cfs_period_us").write_text("100000\n")
    assert cpu_quota_us(1.0, child) == int(0.76 * CPU_PERIOD_US)


def test_a_config_file_sets_the_limits_and_the_command_line_wins(tmp_path):
    config = tmp_path / "python.toml"
    config.write_text("[python]\nnum_workers = 3\nmax_output_bytes = 1000\n[server]\nmax_in_flight = 64\n")
    proc = start_toolserver("python", LOCAL, "--config", str(config), "--workers", "1")
    try:
        out = asyncio.run(run(proc.endpoint, "print('x' * 5000)"))
        assert out["limit"] == "output" and len(out["stdout"]) == 1000, out
        sandboxes = subprocess.run(["ps", "-o", "pid=", "--ppid", str(proc.pid)], capture_output=True, text=True)
        assert len(sandboxes.stdout.split()) == 1  # --workers 1, not the file's 3
    finally:
        assert proc.stop(15) == 0


@pytest.mark.parametrize("text, says", [
    ("[python]\nmemory_bytes = \"1G\"\n", "python.memory_bytes: Input should be a valid integer"),
    ("[python]\nmax_processes = 2\n", "python.max_processes: must be >= 4"),
    ("[search]\nk1 = 1.0\n", "do not apply to the python service"),
])
def test_a_bad_config_file_stops_the_service_naming_the_key(tmp_path, text, says):
    config = tmp_path / "python.toml"
    config.write_text(text)
    res = subprocess.run([sys.executable, "-P", "-m", "agentrl.cli", "toolserver", "python", "--bind", LOCAL,
                          "--config", str(config)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "READY" not in res.stdout
    assert str(config) in res.stderr and says in res.stderr, res.stderr


def test_a_run_configs_python_table_reaches_the_service_it_starts(tmp_path):
    from agentrl.common.config import build
    from agentrl.engine.services import ServicesConfig, start_services

    config = build(ServicesConfig, {"tools": ["python"], "python": {"num_workers": 1, "max_output_bytes": 1000}})

    async def call_it():
        services = await start_services(config, tools=[], env_required=(), model_dir="", corpus=None,
                                        logs=tmp_path / "logs", start_vllm=False, say=lambda _: None)
        try:
            (service,) = services.remote
            return await run(service.endpoints[0], "print('x' * 5000)")
        finally:
            services.stop()

    out = asyncio.run(call_it())
    assert out["limit"] == "output" and len(out["stdout"]) == 1000, out


def test_a_bad_python_table_in_a_run_config_names_the_key():
    res = subprocess.run([sys.executable, "-P", "-m", "agentrl.cli", "train", "--print-config",
                          "--set", "services.python.max_processes=2"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "services.python.max_processes: must be >= 4" in res.stderr, res.stderr
