"""Tool services a run starts off loopback (`[network] host`): bound to that address, with the
CurveZMQ certificates the run makes; only the run's client gets an answer. Real processes, real
sockets on this machine's routable address (skipped on a machine that has none)."""

from __future__ import annotations

import asyncio
import stat
import sys
from pathlib import Path
from urllib.parse import urlparse

import pytest

SERVICE = '''
from agentrl.toolservers.functions import serve


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


if __name__ == "__main__":
    raise SystemExit(serve([add]))
'''


@pytest.fixture
def host():
    from support.network import routable_address

    address = routable_address()
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address to bind")
    return address


def test_off_loopback_every_tool_service_binds_there_with_the_runs_keys(host, tmp_path):
    import zmq.auth

    from agentrl.common.config import build
    from agentrl.credentials import RunCredentials
    from agentrl.engine.services import CommandSource, ServicesConfig, start_services, tool_client_keys
    from agentrl.learner.config import LearnerTransportConfig
    from agentrl.toolservers.client import ToolClient, ToolServiceUnavailable

    (tmp_path / "adder.py").write_text(SERVICE)
    (tmp_path / "run").mkdir()
    credentials = RunCredentials(tmp_path / "run", host=host, learner_transport=LearnerTransportConfig(), external_vllm=False)
    keys = credentials.tools()
    curve = tmp_path / "run" / "curve"
    assert stat.S_IMODE((curve / "agentrl-run-tools.key_secret").stat().st_mode) == 0o600
    assert [p.name for p in Path(keys.authorized_clients).iterdir()] == ["agentrl-run.key"]
    secret = zmq.auth.load_certificate(keys.server_secret)[1]
    client_secret = zmq.auth.load_certificate(keys.client_secret)[1]
    config = build(ServicesConfig, {"tools": ["calculator"]})
    command = CommandSource(command=[sys.executable, "adder.py", "--bind", "{bind}"], cwd=str(tmp_path))

    async def run():
        services = await start_services(config, tools=[command], env_required=(), model_dir="", corpus=None,
                                        logs=tmp_path / "logs", start_vllm=False, say=lambda _: None, host=host,
                                        tool_keys=keys)
        try:
            assert {s.name for s in services.remote} == {"tools[0]", "calculator"}
            # No key on any service's command line (the certificate files' paths are there).
            for proc in services.procs:
                argv = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
                assert secret not in argv and client_secret not in argv
            answers = {}
            for service in services.remote:
                (endpoint,) = service.endpoints
                assert urlparse(endpoint).hostname == host, endpoint
                async with ToolClient(service.endpoints, **tool_client_keys(service)) as client:
                    names = [spec["function"]["name"] for spec in await client.describe()]
                    if "add" in names:
                        answers["add"] = await client.call("add", {"a": 2, "b": 3})
                    else:
                        answers["calculator"] = await client.call("calculator", {"expression": "6*7"})
                with pytest.raises(ToolServiceUnavailable):  # no keys: the handshake fails, nothing answers
                    async with ToolClient(service.endpoints, request_timeout_s=3) as client:
                        await client.describe()
            return answers
        finally:
            services.stop()

    answers = asyncio.run(run())
    assert answers["add"].ok and answers["add"].content == 5, answers["add"]
    assert answers["calculator"].ok, answers["calculator"]


def test_off_loopback_tool_services_are_refused_without_keys(host, tmp_path):
    from agentrl.common.config import ConfigError, build
    from agentrl.engine.services import ServicesConfig, start_services

    config = build(ServicesConfig, {"tools": ["calculator"]})
    with pytest.raises(ConfigError, match="need CurveZMQ certificates"):
        asyncio.run(start_services(config, tools=[], env_required=(), model_dir="", corpus=None, logs=tmp_path,
                                   start_vllm=False, host=host))


def test_on_loopback_the_run_makes_no_tool_keys(tmp_path):
    from agentrl.runconfig import TrainConfig
    from agentrl.train import Supervisor

    supervisor = Supervisor(TrainConfig(), tmp_path / "run")
    assert supervisor.credentials.tools() is None
    assert not (tmp_path / "run" / "curve").exists()
