"""Async token-in/token-out client for one vLLM server.

Requests go to vLLM's `/inference/v1/generate` endpoint (enabled by `--enable-scale-out`): the
prompt is a list of token ids, the answer carries the sampled ids, their log-probs and the
weight-version spans that say which policy version sampled which tokens. Nothing is tokenized or
detokenized on this path, so the ids the learner trains on are exactly the ids the server sampled.

One `aiohttp.ClientSession` per client. The connection pool allows `max_connections` concurrent
requests (default 8192: the orchestrator keeps thousands of episodes in flight and each holds at
most one request). Requests have a connect timeout (a dead server is reported in seconds, not
after the request timeout) and a total timeout. A connection refused, a reset mid-request or a
timeout raises `InferenceServerUnavailable`; the server rejecting a request raises
`InferenceServerError` with its message. Neither is retried here: retrying on another server is
the server pool's decision.

Policy versions are ints. The server labels weights with strings; agentrl always sets the decimal
string of the learner step (`engine.weights.push_weights`), and a freshly started server's label
"default" is version 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import aiohttp

DEFAULT_VERSION_LABEL = "default"


class InferenceServerError(RuntimeError):
    """The server answered, but with an error."""


class InferenceServerUnavailable(InferenceServerError):
    """The server could not be reached, died mid-request, or did not answer in time."""


@dataclass
class SamplingParams:
    max_tokens: int
    """Upper bound on generated tokens for this request."""
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: list[int] | None = None
    """Generation stops after emitting any of these ids (the id is included in the output)."""
    seed: int | None = None
    ignore_eos: bool = False
    """Keep generating past EOS until max_tokens (load generators and benchmarks)."""


@dataclass
class Generation:
    token_ids: list[int]
    """Sampled ids, in order."""
    logprobs: list[float]
    """Log-prob of each sampled id under the policy that sampled it."""
    finish_reason: str
    """"stop" (EOS or a stop id), "length" (max_tokens) or "abort"."""
    versions: list[int]
    """Policy version that sampled each token; len == len(token_ids)."""
    server: str
    """Base URL of the server that answered."""
    text: str | None = None
    """Detokenized output, only when requested (`return_text=True`); the ids remain the truth."""


def parse_version(label: str) -> int:
    if label == DEFAULT_VERSION_LABEL:
        return 0
    try:
        return int(label)
    except ValueError:
        raise InferenceServerError(f"server reports weight version {label!r}, not an agentrl version (an int)") from None


class VLLMClient:
    def __init__(
        self,
        base_url: str,
        *,
        max_connections: int = 8192,
        request_timeout_s: float = 600.0,
        connect_timeout_s: float = 5.0,
    ):
        self.base_url = base_url.rstrip("/")
        self._max_connections = max_connections
        self._timeout = aiohttp.ClientTimeout(total=request_timeout_s, sock_connect=connect_timeout_s)
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> VLLMClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=self._max_connections, limit_per_host=self._max_connections)
            self._session = aiohttp.ClientSession(connector=connector, timeout=self._timeout)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _request(self, method: str, path: str, *, json_body=None, params=None, timeout_s: float | None = None):
        url = self.base_url + path
        timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=self._timeout.sock_connect) if timeout_s else None
        try:
            async with self._http().request(method, url, json=json_body, params=params, timeout=timeout) as resp:
                if resp.status >= 400:
                    text = await resp.text()
                    raise InferenceServerError(f"{method} {url} -> HTTP {resp.status}: {text[:500]}")
                if resp.content_type == "application/json":
                    return await resp.json()
                return await resp.text()
        except (TimeoutError, aiohttp.ClientConnectionError) as err:
            raise InferenceServerUnavailable(f"{method} {url} failed: {type(err).__name__}: {err}") from err

    async def generate(self, prompt_ids: list[int], params: SamplingParams, *, return_text: bool = False) -> Generation:
        sampling = {
            "max_tokens": params.max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "logprobs": 0,
        }
        if params.stop_token_ids:
            sampling["stop_token_ids"] = list(params.stop_token_ids)
        if params.seed is not None:
            sampling["seed"] = params.seed
        if params.ignore_eos:
            sampling["ignore_eos"] = True
        body = {"token_ids": list(prompt_ids), "sampling_params": sampling, "stream": False}
        if return_text:
            body["output_mode"] = "text"
        data = await self._request("POST", "/inference/v1/generate", json_body=body)
        choice = data["choices"][0]
        token_ids = choice["token_ids"] or []
        content = (choice.get("logprobs") or {}).get("content") or []
        if len(content) != len(token_ids):
            raise InferenceServerError(f"server returned {len(token_ids)} ids but {len(content)} log-probs")
        logprobs = []
        for tok, entry in zip(token_ids, content, strict=True):
            if not return_text and entry["token_id"] != tok:
                raise InferenceServerError("log-prob entries do not line up with the sampled ids")
            logprobs.append(float(entry["logprob"]))
        versions = _expand_versions(choice.get("weight_versions"), len(token_ids))
        return Generation(
            token_ids, logprobs, choice.get("finish_reason") or "stop", versions, self.base_url, choice.get("text")
        )

    async def health(self) -> bool:
        try:
            await self._request("GET", "/health", timeout_s=5.0)
        except InferenceServerError:
            return False
        return True

    async def weight_version(self) -> int:
        data = await self._request("GET", "/weight_info", timeout_s=10.0)
        return parse_version(data["weight_version"])


def _expand_versions(spans: list[dict] | None, num_tokens: int) -> list[int]:
    if num_tokens == 0:
        return []
    if not spans:
        raise InferenceServerError("server returned no weight-version spans (is it an agentrl-started vLLM server?)")
    versions = [-1] * num_tokens
    for span in spans:
        v = parse_version(span["version"])
        for i in range(span["start"], span["end"]):
            versions[i] = v
    if -1 in versions:
        raise InferenceServerError(f"weight-version spans {spans} do not cover all {num_tokens} tokens")
    return versions
