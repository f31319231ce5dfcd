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
import msgspec

DEFAULT_VERSION_LABEL = "default"

# The request body is encoded and the answer decoded with msgspec: for a 700-id prompt the stdlib
# `json.dumps` took ~70 us per request and was the largest single cost per turn in the orchestrator
# capacity profile (msgspec: ~5 us); a typed decode of a 40-token answer with its log-probs takes
# ~12 us against ~46 us for `json.loads`.
_ENCODER = msgspec.json.Encoder()
_JSON_HEADERS = {"Content-Type": "application/json"}


class _LogprobEntry(msgspec.Struct):
    logprob: float
    token_id: int | str | None = None
    """The sampled id (a string in vLLM's text output mode)."""


class _Logprobs(msgspec.Struct):
    content: list[_LogprobEntry] | None = None


class _VersionSpan(msgspec.Struct):
    start: int
    end: int
    version: str


class _Choice(msgspec.Struct):
    token_ids: list[int] | None = None
    logprobs: _Logprobs | None = None
    finish_reason: str | None = None
    weight_versions: list[_VersionSpan] | None = None
    text: str | None = None


class _GenerateResponse(msgspec.Struct):
    choices: list[_Choice]


_GENERATE_DECODER = msgspec.json.Decoder(_GenerateResponse)


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
            # No cookies and no response decompression: the server sends neither, and the cookie jar
            # is consulted on every request otherwise.
            self._session = aiohttp.ClientSession(connector=connector, timeout=self._timeout,
                                                 cookie_jar=aiohttp.DummyCookieJar(), auto_decompress=False)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _request(self, method: str, path: str, *, body: bytes | None = None, timeout_s: float | None = None) -> bytes:
        """The answer's body; HTTP errors raise InferenceServerError, transport failures InferenceServerUnavailable."""
        url = self.base_url + path
        timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=self._timeout.sock_connect) if timeout_s else None
        try:
            async with self._http().request(method, url, data=body, headers=_JSON_HEADERS if body is not None else None,
                                            timeout=timeout) as resp:
                data = await resp.read()
                if resp.status >= 400:
                    raise InferenceServerError(f"{method} {url} -> HTTP {resp.status}: {data[:500].decode(errors='replace')}")
                return data
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
            sampling["stop_token_ids"] = params.stop_token_ids
        if params.seed is not None:
            sampling["seed"] = params.seed
        if params.ignore_eos:
            sampling["ignore_eos"] = True
        # The prompt list is encoded as it is (no copy): it is O(prompt length) to send and should be
        # O(1) Python work besides.
        body = {"token_ids": prompt_ids, "sampling_params": sampling, "stream": False}
        if return_text:
            body["output_mode"] = "text"
        try:
            payload = _ENCODER.encode(body)
        except TypeError as err:
            raise InferenceServerError(f"cannot encode the request (prompt ids must be ints): {err}") from err
        data = await self._request("POST", "/inference/v1/generate", body=payload)
        try:
            choice = _GENERATE_DECODER.decode(data).choices[0]
        except (msgspec.ValidationError, msgspec.DecodeError, IndexError) as err:
            raise InferenceServerError(f"unexpected answer from {self.base_url}/inference/v1/generate: {err}: {data[:300]!r}") from err
        token_ids = choice.token_ids or []
        content = (choice.logprobs.content if choice.logprobs is not None else None) or []
        if len(content) != len(token_ids):
            raise InferenceServerError(f"server returned {len(token_ids)} ids but {len(content)} log-probs")
        if not return_text and any(entry.token_id != tok for entry, tok in zip(content, token_ids, strict=True)):
            raise InferenceServerError("log-prob entries do not line up with the sampled ids")
        logprobs = [entry.logprob for entry in content]
        versions = _expand_versions(choice.weight_versions, len(token_ids))
        return Generation(token_ids, logprobs, choice.finish_reason or "stop", versions, self.base_url, choice.text)

    async def health(self) -> bool:
        try:
            await self._request("GET", "/health", timeout_s=5.0)
        except InferenceServerError:
            return False
        return True

    async def weight_version(self) -> int:
        data = await self._request("GET", "/weight_info", timeout_s=10.0)
        try:
            return parse_version(msgspec.json.decode(data)["weight_version"])
        except (msgspec.DecodeError, KeyError, TypeError) as err:
            raise InferenceServerError(f"unexpected /weight_info answer from {self.base_url}: {data[:300]!r}") from err


def _expand_versions(spans: list[_VersionSpan] | None, num_tokens: int) -> list[int]:
    if num_tokens == 0:
        return []
    if not spans:
        raise InferenceServerError("server returned no weight-version spans (is it an agentrl-started vLLM server?)")
    if len(spans) == 1 and spans[0].start == 0 and spans[0].end == num_tokens:  # the usual case: one version per turn
        return [parse_version(spans[0].version)] * num_tokens
    versions = [-1] * num_tokens
    for span in spans:
        v = parse_version(span.version)
        versions[span.start:span.end] = [v] * (span.end - span.start)
    if len(versions) != num_tokens or -1 in versions:
        raise InferenceServerError(f"weight-version spans {spans} do not cover all {num_tokens} tokens")
    return versions
