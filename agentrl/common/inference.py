"""Async token-in/token-out client for one vLLM server.

Requests go to vLLM's `/inference/v1/generate` endpoint (enabled by `--enable-scale-out`): the
prompt is a list of token ids, the answer carries the sampled ids, their log-probs and the
weight-version spans that say which policy version sampled which tokens. Nothing is tokenized or
detokenized on this path, so the ids the learner trains on are exactly the ids the server sampled.

HTTP: a small HTTP/1.1 keep-alive client on a bare asyncio protocol (`_HTTPConnection`, one request
at a time per connection) and a pool of idle connections per client. It replaced aiohttp here
because the orchestrator's CPU per turn is the capacity limit (target: 3,000 turns/s on one core,
i.e. ~330 us per turn for everything) and aiohttp's request machinery alone took ~150 us per
request in the capacity profile. It speaks only what this client needs: requests with a
Content-Length body; answers with Content-Length or chunked bodies; `Connection: close` honoured.

The pool allows `max_connections` concurrent requests (default 8192: the orchestrator keeps
thousands of episodes in flight and each holds at most one request); further requests wait for a
connection. Requests have a connect timeout (a dead server is reported in seconds, not after the
request timeout) and a total timeout. A connection refused, a reset mid-request, a timeout or a 5xx
answer (the server failed, e.g. its engine died) raises `InferenceServerUnavailable`; the server
rejecting a request (4xx) raises `InferenceServerError` with its message. Neither is retried here: retrying on another server is the server pool's decision (a
keep-alive connection the server closed while idle is one such transient failure).

Policy versions are ints. The server labels weights with strings; agentrl always sets the decimal
string of the learner step (`agentrl.common.weights.push_weights`), and a freshly started server's label
"default" is version 0.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from urllib.parse import urlsplit

import msgspec

DEFAULT_VERSION_LABEL = "default"

# The request body is encoded and the answer decoded with msgspec: for a 700-id prompt the stdlib
# `json.dumps` took ~70 us per request and was the largest single cost per turn in the orchestrator
# capacity profile (msgspec: ~5 us); a typed decode of a 40-token answer with its log-probs takes
# ~12 us against ~46 us for `json.loads`.
_ENCODER = msgspec.json.Encoder()


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


MAX_VERSION = 2**31 - 1
"""The largest policy version (the trajectory stores versions as int32)."""


def parse_version(label: str) -> int:
    if label == DEFAULT_VERSION_LABEL:
        return 0
    try:
        version = int(label)
    except ValueError:
        raise InferenceServerError(f"server reports weight version {label!r}, not an agentrl version (an int)") from None
    if not 0 <= version <= MAX_VERSION:
        # Versions travel as int32 in the trajectory (trajectory.ARRAY_FIELDS); a label past that is no
        # learner step, and refusing it here fails this request instead of the episode's int32 cast.
        raise InferenceServerError(f"server reports weight version {label!r}, outside agentrl's [0, {MAX_VERSION}]")
    return version


class _HTTPConnection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection. `request` sends one request and waits for its whole answer."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._buffer = bytearray()
        self._answer: asyncio.Future | None = None
        self._head: tuple[int, int, bool, bool] | None = None
        """(status, body start, chunked, close after) once the status line and headers are in."""
        self._content_length = -1

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._answer is not None and not self._answer.done():
            self._answer.set_exception(ConnectionResetError(f"the server closed the connection mid-answer ({exc})"))

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        if self._answer is None or self._answer.done():
            # Bytes nobody asked for (a proxy's 408 before it closes, a server bug): the next request
            # on this connection would read them as its answer. Drop the connection instead.
            self.closed = True
            self.transport.close()
            return
        try:
            answer = self._parse()
        except ValueError as err:
            self._answer.set_exception(err)
            self.transport.close()
            return
        if answer is not None:
            self._answer.set_result(answer)

    async def request(self, head: bytes, body: bytes) -> tuple[int, bytes, bool]:
        """(status, body, reusable)."""
        self._answer = asyncio.get_running_loop().create_future()
        self._head, self._content_length = None, -1
        self.transport.write(head + body)  # one send: the body is a few KiB (a 700-id prompt: ~4 KiB)
        try:
            status, answer_body, close_after = await self._answer
        finally:
            self._answer = None
        return status, answer_body, not (close_after or self.closed or self._buffer)

    def _parse(self) -> tuple[int, bytes, bool] | None:
        buf = self._buffer
        if self._head is None:
            head_end = buf.find(b"\r\n\r\n")
            if head_end < 0:
                if len(buf) > 65536:
                    raise ValueError("HTTP answer headers longer than 64 KiB")
                return None
            lines = bytes(buf[:head_end]).decode("latin-1").split("\r\n")
            parts = lines[0].split(" ", 2)
            if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
                raise ValueError(f"not an HTTP/1.x status line: {lines[0][:100]!r}")
            chunked, close_after = False, parts[0] == "HTTP/1.0"
            for line in lines[1:]:
                name, _, value = line.partition(":")
                name, value = name.strip().lower(), value.strip().lower()
                if name == "content-length":
                    self._content_length = int(value)
                elif name == "transfer-encoding":
                    chunked = "chunked" in value
                elif name == "connection":
                    close_after = value == "close"
            if not chunked and self._content_length < 0:
                raise ValueError("HTTP answer with neither Content-Length nor chunked encoding")
            self._head = (int(parts[1]), head_end + 4, chunked, close_after)
        status, start, chunked, close_after = self._head
        if not chunked:
            end = start + self._content_length
            if len(buf) < end:
                return None
            body = bytes(buf[start:end])
            del buf[:end]
            return status, body, close_after
        body, pos = bytearray(), start
        while True:  # chunked: re-parsed from the start until the last chunk is in (answers are small)
            line_end = buf.find(b"\r\n", pos)
            if line_end < 0:
                return None
            size = int(bytes(buf[pos:line_end]).split(b";", 1)[0], 16)
            if size == 0:  # last chunk, then optional trailer lines, then an empty line
                end = buf.find(b"\r\n\r\n", line_end)
                if end < 0:
                    return None
                del buf[:end + 4]
                return status, bytes(body), close_after
            if len(buf) < line_end + 2 + size + 2:
                return None
            body += buf[line_end + 2:line_end + 2 + size]
            pos = line_end + 2 + size + 2


class VLLMClient:
    def __init__(
        self,
        base_url: str,
        *,
        max_connections: int = 8192,
        request_timeout_s: float = 600.0,
        connect_timeout_s: float = 5.0,
        model: str | None = None,
    ):
        self.base_url = base_url.rstrip("/")
        self.model = model
        """The `model` every generate request names (a LoRA adapter the server serves itself:
        agentrl.common.adapters.POLICY_ADAPTER); None: the server's base model."""
        url = urlsplit(self.base_url)
        if url.scheme != "http" or not url.hostname:
            raise ValueError(f"VLLMClient needs an http://host:port base URL, got {base_url!r}")
        self._host, self._port = url.hostname, url.port or 80
        self._path_prefix = url.path
        self._host_header = url.netloc
        self._request_timeout_s = request_timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._slots = asyncio.Semaphore(max_connections)
        self._idle: list[_HTTPConnection] = []
        self._open: set[_HTTPConnection] = set()

    async def __aenter__(self) -> VLLMClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        for conn in self._open:
            if conn.transport is not None:
                conn.transport.close()
        self._open.clear()
        self._idle.clear()

    async def _connection(self) -> _HTTPConnection:
        while self._idle:
            conn = self._idle.pop()  # most recently used first: the least likely to have been closed by the server
            if not conn.closed and not conn._buffer:
                return conn
            if conn.transport is not None:
                conn.transport.close()
            self._open.discard(conn)
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(self._connect_timeout_s):
            _, conn = await loop.create_connection(_HTTPConnection, self._host, self._port)
        self._open.add(conn)
        return conn

    async def _request(self, method: str, path: str, *, body: bytes | None = None, timeout_s: float | None = None) -> bytes:
        """The answer's body; HTTP errors raise InferenceServerError, transport failures InferenceServerUnavailable."""
        body = body or b""
        head = (f"{method} {self._path_prefix}{path} HTTP/1.1\r\nHost: {self._host_header}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
        conn = None
        reusable = False
        try:
            async with self._slots:
                async with asyncio.timeout(timeout_s or self._request_timeout_s):
                    conn = await self._connection()
                    status, data, reusable = await conn.request(head, body)
                if reusable:
                    self._idle.append(conn)
        except (OSError, TimeoutError, ValueError) as err:
            # OSError covers refused/reset connections; ValueError a malformed answer (the connection is dropped).
            raise InferenceServerUnavailable(f"{method} {self.base_url}{path} failed: {type(err).__name__}: {err}") from err
        finally:
            if conn is not None and not reusable:
                self._open.discard(conn)
                if conn.transport is not None:
                    conn.transport.close()
        if status >= 400:
            # 5xx: the server failed, not the request (vLLM answers 500 while its engine is dead, e.g.
            # its node going away): the pool asks /health whether to take the server out, and retries.
            error = InferenceServerUnavailable if status >= 500 else InferenceServerError
            raise error(f"{method} {self.base_url}{path} -> HTTP {status}: {data[:500].decode(errors='replace')}")
        return data

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
        if self.model is not None:
            body["model"] = self.model
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
