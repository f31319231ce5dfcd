"""A pool of vLLM servers, balanced by outstanding requests, with dead servers taken out.

`ServerPool.generate` sends each request to the live server with the fewest requests outstanding
(ties: the first). If a request fails to reach it or dies mid-request (`InferenceServerUnavailable`),
the server's /health decides: no answer -> it is marked dead (out of the pool); an answer -> the
error was transient (e.g. a stale keep-alive connection) and it stays. Either way the same request
(same prompt ids, same sampling parameters) is retried on the least-loaded live server: a turn is
regenerated whole, so the ids, log-probs and versions recorded all come from the one server that
answered. After `max_attempts`, or with no live server left (after waiting `no_server_wait_s` for
one to come back), the error is raised to the episode runner, which marks the episode failed
(never dropped silently).
A server that rejects a request (`InferenceServerError`, a 4xx answer, e.g. a prompt too long) is
not retried: another server would reject it too. A 5xx answer is the server failing (vLLM answers
500 while its engine is dead) and is handled like a lost connection.

A background probe (owned by the pool, cancelled by `close`) checks dead servers' /health every
`probe_interval_s` and puts them back when they answer. A server that starts again at another
address (another node of a cluster) is followed with `move(old, new)`: its place in the pool takes
the new URL, and the probe puts it back when it answers there.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from agentrl.common.inference import Generation, InferenceServerUnavailable, SamplingParams, VLLMClient

log = logging.getLogger(__name__)


@dataclass
class _Server:
    client: VLLMClient
    outstanding: int = 0
    alive: bool = True
    num_requests: int = 0
    num_failures: int = 0


class ServerPool:
    def __init__(self, base_urls: list[str], *, max_attempts: int = 3, probe_interval_s: float = 5.0,
                 request_timeout_s: float = 600.0, max_connections: int = 8192, no_server_wait_s: float = 0.0,
                 model: str | None = None):
        if not base_urls:
            raise ValueError("ServerPool needs at least one server base URL")
        self._client_options = {"max_connections": max_connections, "request_timeout_s": request_timeout_s, "model": model}
        self.servers = [_Server(VLLMClient(u, **self._client_options)) for u in base_urls]
        self.max_attempts = max_attempts
        self.probe_interval_s = probe_interval_s
        self.no_server_wait_s = no_server_wait_s
        """With every server down, how long a request waits for one to come back before failing, seconds."""
        self._probe: asyncio.Task | None = None
        self._retired: list[VLLMClient] = []
        """Clients of the old URLs of servers that moved (requests may still be in flight there)."""
        self.num_generated_tokens = 0
        self.num_retries = 0

    async def __aenter__(self) -> ServerPool:
        await self.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def start(self) -> None:
        self._probe = asyncio.create_task(self._probe_dead(), name="server-pool-probe")

    async def close(self, timeout_s: float = 5.0) -> None:
        if self._probe is not None:
            self._probe.cancel()
            await asyncio.wait([self._probe], timeout=timeout_s)
            self._probe = None
        await asyncio.wait_for(asyncio.gather(*(s.client.close() for s in self.servers), *(c.close() for c in self._retired)), timeout_s)

    @property
    def live_servers(self) -> list[str]:
        return [s.client.base_url for s in self.servers if s.alive]

    def _pick(self) -> _Server:
        live = [s for s in self.servers if s.alive]
        if not live:
            raise InferenceServerUnavailable(f"no live inference server (all {len(self.servers)} are down)")
        return min(live, key=lambda s: s.outstanding)

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        last_error: InferenceServerUnavailable | None = None
        for attempt in range(self.max_attempts):
            server = await self._pick_live()
            server.outstanding += 1
            server.num_requests += 1
            try:
                generation = await server.client.generate(prompt_ids, params)
            except InferenceServerUnavailable as err:
                last_error = err
                server.num_failures += 1
                # A failed request alone does not prove death: a pooled keep-alive connection the
                # server had closed fails with "Can not write request body" while the server is fine.
                # /health decides (connection refused on a dead server: milliseconds).
                if not await server.client.health():
                    self._mark_dead(server, err)
                if attempt + 1 < self.max_attempts:
                    self.num_retries += 1
                continue
            finally:
                server.outstanding -= 1
            self.num_generated_tokens += len(generation.token_ids)
            return generation
        raise InferenceServerUnavailable(f"generation failed on {self.max_attempts} attempts; last: {last_error}")

    async def _pick_live(self) -> _Server:
        """The least-loaded live server; with none live, wait up to `no_server_wait_s` for the probe
        to bring one back (a restarting server), then raise."""
        deadline = time.monotonic() + self.no_server_wait_s
        while True:
            try:
                return self._pick()
            except InferenceServerUnavailable:
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(min(self.probe_interval_s, 1.0))

    async def weight_versions(self) -> dict[str, int]:
        """The weight version each live server serves (base URL -> version). A server that does not
        answer is taken out of the pool here, as a failed generation would take it out, rather than
        failing the caller: an evaluation right after a server died must run on the others."""
        async def ask(server: _Server) -> int | None:
            try:
                return await server.client.weight_version()
            except InferenceServerUnavailable as err:
                if not await server.client.health():
                    self._mark_dead(server, err)
                    return None
                raise

        live = [s for s in self.servers if s.alive]
        answers = await asyncio.gather(*(ask(s) for s in live))
        return {s.client.base_url: v for s, v in zip(live, answers, strict=True) if v is not None}

    def mark_dead(self, base_url: str, err: Exception) -> None:
        """Take a server out (a caller outside generation saw it fail); the probe brings it back."""
        for server in self.servers:
            if server.client.base_url == base_url:
                self._mark_dead(server, err)

    def move(self, old_url: str, new_url: str) -> None:
        """The server at `old_url` answers at `new_url` now (started again elsewhere): requests go
        there once the probe finds it healthy. Requests in flight at the old URL fail and are retried
        as usual; its client is closed with the pool."""
        for server in self.servers:
            if server.client.base_url == old_url:
                log.warning("inference server %s answers at %s now; back in the pool when it answers there", old_url, new_url)
                self._mark_dead(server, InferenceServerUnavailable(f"it answers at {new_url} now"))
                self._retired.append(server.client)
                server.client = VLLMClient(new_url, **self._client_options)
                return
        raise KeyError(f"no server {old_url} in the pool (it has {[s.client.base_url for s in self.servers]})")

    def _mark_dead(self, server: _Server, err: Exception) -> None:
        if server.alive:
            server.alive = False
            log.warning("inference server %s taken out of the pool: %s", server.client.base_url, err)

    async def _probe_dead(self) -> None:
        while True:
            await asyncio.sleep(self.probe_interval_s)
            for server in self.servers:
                if not server.alive and await server.client.health():
                    server.alive = True
                    log.warning("inference server %s is back in the pool", server.client.base_url)
