"""The weight transports against a vLLM server that cannot read this host's files: the server runs in
its own mount namespace with a private /dev/shm and /tmp (`unshare --mount` + tmpfs), as a server on
another host would. A `shm` push is refused with an error that names the `stream` transport; a
push whose connection drops half way changes nothing; a `stream` push lands with 32 requests kept
in flight, none lost and some spanning the swap, and the server then answers as the pushed weights
do (the same greedy tokens as transformers' forward of those weights)."""

from __future__ import annotations

import asyncio
import hashlib
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlparse

import pytest
import torch
from safetensors.torch import load_file
from support.inflight import push_with_requests_in_flight

from agentrl.common.inference import SamplingParams, VLLMClient
from agentrl.common.weights import WeightPushError, push_weights, write_weights

pytestmark = pytest.mark.slow

PRIVATE_FILES = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                 'mount -t tmpfs tmpfs /dev/shm && mount -t tmpfs tmpfs /tmp && exec "$@"', "private-files"]
"""Runs a command with its own, empty /dev/shm and /tmp (execs it: the PID stays the command's)."""


def _namespaces_work() -> bool:
    probe = subprocess.run([*PRIVATE_FILES, "true"], capture_output=True, timeout=30)
    return probe.returncode == 0


@pytest.fixture(scope="module")
def private_server(model_dir, tmp_path_factory):
    from agentrl.engine.serve import VLLMServer, VLLMServerConfig

    if not _namespaces_work():
        pytest.skip("this machine does not let the tests create a mount namespace (unshare --mount needs CAP_SYS_ADMIN)")
    hidden = [p for p in (Path(sys.executable).absolute(), Path(sys.prefix), Path(model_dir).absolute())
              if any(q.is_relative_to(root) for q in (p, p.resolve()) for root in ("/tmp", "/dev/shm"))]
    if hidden:
        pytest.skip(f"{hidden[0]} lies under /tmp or /dev/shm, which the server's private mounts hide from it (a checkout there "
                    "cannot run this test)")
    server = VLLMServer(VLLMServerConfig(model_dir=str(model_dir), dtype="float32", gpu_memory_utilization=0.15,
                                         kv_cache_gib=1.0), log_path=tmp_path_factory.mktemp("vllm-private") / "server.log", launcher=PRIVATE_FILES)
    server.start(timeout_s=400)
    try:
        yield server
    finally:
        server.stop()


async def _greedy(client: VLLMClient, ids: list[int], n: int = 12) -> list[int]:
    return (await client.generate(ids, SamplingParams(max_tokens=n, temperature=0.0))).token_ids


async def _half_push(base_url: str, body: bytes) -> None:
    """Send a push's headers and half its body, then drop the connection."""
    url = urlparse(base_url)
    reader, writer = await asyncio.open_connection(url.hostname, url.port)
    head = (f"PUT /agentrl/weights HTTP/1.1\r\nHost: {url.netloc}\r\nContent-Length: {len(body)}\r\n"
            f"X-Agentrl-Size: {len(body)}\r\nX-Agentrl-Sha256: {hashlib.sha256(body).hexdigest()}\r\n\r\n")
    writer.write(head.encode() + body[: len(body) // 2])
    await writer.drain()
    writer.close()
    await writer.wait_closed()


async def test_pushes_reach_a_server_that_cannot_read_this_hosts_files_only_by_stream(private_server, model_dir, tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM

    url = private_server.base_url
    original = load_file(str(model_dir / "model.safetensors"))
    gen = torch.Generator().manual_seed(0)
    update = {k: v + 0.3 * torch.randn(v.shape, generator=gen) for k, v in original.items() if k.startswith("model.layers.29.")}
    ids = list(tokenizer.apply_chat_template([{"role": "user", "content": "Name three colours."}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False))
    async with VLLMClient(url) as client:
        before = await _greedy(client, ids)
        version0 = await client.weight_version()

        # shm: the server is handed a path it cannot open; the error says which transport reaches it.
        with pytest.raises(WeightPushError, match="transport 'stream'") as refused:
            await push_weights(url, update, version0 + 1, transport="shm")
        assert "learner.publish.transport" in str(refused.value)
        assert await _greedy(client, ids) == before and await client.weight_version() == version0

        # A push that loses its connection half way is refused; nothing is staged or applied.
        await _half_push(url, write_weights(update, str(tmp_path)).read_bytes())
        assert await client.health()
        assert await _greedy(client, ids) == before and await client.weight_version() == version0

        # stream, with 32 requests kept in flight until the push returns: none lost, some span the
        # swap, and the served model is the pushed one.
        result, done = await push_with_requests_in_flight(
            client, ids, push_weights(url, update, version0 + 1, transport="stream"), max_tokens=96)
        assert result.transport == "stream" and result.bytes > 0
        assert all(len(g.token_ids) == 96 for g in done)
        assert any(g.versions[0] == version0 and g.versions[-1] == version0 + 1 for g in done)
        after = await _greedy(client, ids)
        assert await client.weight_version() == version0 + 1
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.load_state_dict(update, strict=False)
    with torch.no_grad():
        expected = model.generate(torch.tensor([ids]), max_new_tokens=len(after), do_sample=False)[0, len(ids):].tolist()
    assert after != before and after == expected[: len(after)]
