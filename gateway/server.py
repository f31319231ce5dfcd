"""The gateway: the OpenAI chat API in front of agentrl's inference pool, with exact token records.

    agent program (openai client) --HTTP--> Gateway --token-in/token-out--> ServerPool -> vLLM servers

Endpoints (each also under a per-session base URL `/s/{session}/v1/...`):
- `GET /v1/models`
- `POST /v1/chat/completions`: messages rendered by the model's renderer (`render`), generated
  through the pool (balancing, failover, weight versions), tool calls parsed by the model family's
  parser and answered in OpenAI's `tool_calls` format; `usage`; `stream: true` answers SSE chunks.
- `POST /v1/completions`: a text or token-id prompt, no chat template.
- with a tool host (an agent run's tools, gateway/agents.py): `GET /v1/agentrl/tools` (their OpenAI
  function schemas) and `POST /v1/agentrl/tools/{name}` (the arguments object as the body; answers
  the host's result JSON; under a session's base URL or header the call belongs to that session);
- `GET /agentrl/sessions/{id}` (the record), `DELETE /agentrl/sessions/{id}` (close: the final
  record), `GET /agentrl/sessions`, `GET /agentrl/stats`, `GET /health`.

`tool_choice`, as far as a prompt-based model can honour it (no constrained decoding here):
- "auto" (the default with tools): tools are listed in the prompt, calls are parsed from the text;
- "none": tools are still listed (the prompt stays a prefix of the next turn's, so the episode stays
  one segment) but nothing is parsed: the text is the content;
- "required": the assistant turn is opened with the family's call opening (`<tool_call>` for
  Hermes), so the model continues a call; the prefill is a prompt token, and part of the content;
- a named function: the opening includes the name (`<tool_call>{"name": "f", "arguments": `).
  If the model still writes no valid call, the answer has no `tool_calls` and finish_reason "stop".
`parallel_tool_calls: false` answers the first call only (all sampled ids are still recorded).

Streaming (gateway/answers.py): the turn is generated whole, then sent as SSE chunks. Cut and stop
(gateway/turns.py): the kept ids are an exact prefix of what was sampled, cut where the family's
parser says the action ends. The config: gateway/config.py.

Exactness checks: one recalled completion in `render_check_every` is rendered again from its text
and compared with its sampled ids (`num_render_checks`, `num_render_drifts`, a warning naming the
first differing prompt position); prompts use the recorded ids whatever the check finds.

Errors: every refusal is OpenAI's error JSON with a 4xx status naming the field; the inference
servers failing is 502/503; a bug in a handler is logged with its traceback, counted in
`num_internal_errors` and answered 500, and the gateway keeps serving.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import re
import time
from pathlib import Path

import msgspec

from agentrl.common.inference import InferenceServerError, InferenceServerUnavailable, SamplingParams
from agentrl.engine.parsers import TOOL_CALL_PARSERS, detect_tool_call_format
from agentrl.gateway import protocol as P
from agentrl.gateway.answers import (
    chat_completion,
    chat_logprobs,
    chat_stream,
    completion_stream,
    json_response,
)
from agentrl.gateway.config import GatewayConfig
from agentrl.gateway.http import BodyTooLarge, HTTPServer, Request, Response
from agentrl.gateway.render import (
    ChatMLRenderer,
    Rendered,
    TemplateRenderer,
    ToolList,
    forced_prefill,
    template_handles_tools,
)
from agentrl.gateway.sessions import Session, SessionStore
from agentrl.gateway.turns import Turn, chat_turn

log = logging.getLogger(__name__)

SESSION_HEADER = "X-Agentrl-Session"
_SESSION_HEADER_KEY = SESSION_HEADER.lower()  # gateway.http's headers are keyed by lower-cased names
_SESSION_ID = re.compile(r"[A-Za-z0-9._:@-]{1,128}")


class Gateway:
    """Owns the HTTP server, the session store and its sweeper; the pool is the caller's."""

    def __init__(self, config: GatewayConfig, tokenizer, pool, *, model_dir: str | Path | None = None,
                 on_session_end=None, tools=None):
        self.config = config
        self.tokenizer = tokenizer
        self.pool = pool
        """Anything with `async generate(prompt_ids, SamplingParams) -> Generation` (an engine ServerPool)."""
        self.tools = tools
        """None, or a tool host: `schemas() -> list[dict]` and `async call(session_id | None, name,
        arguments) -> dict` (raising GatewayError to refuse), served under /v1/agentrl/tools."""
        self.model_name = config.served_model_name or (Path(model_dir).name if model_dir else "model")
        self._model_names = {self.model_name, *([str(model_dir)] if model_dir else [])}
        self.family = config.tool_parser if config.tool_parser != "auto" else detect_tool_call_format(tokenizer)
        self.parser = TOOL_CALL_PARSERS[self.family]()
        use_template = config.renderer == "template" or (config.renderer == "auto" and template_handles_tools(tokenizer))
        self.renderer = TemplateRenderer(tokenizer, self.parser, model_dir) if use_template else ChatMLRenderer(tokenizer, self.parser)
        self._stop_ids = frozenset(self.renderer.stop_token_ids)
        self._eos_ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        self._backend = tokenizer.backend_tokenizer
        self._vocab_size = len(tokenizer)
        self.sessions = SessionStore(idle_s=config.session_idle_s, max_sessions=config.max_sessions, on_end=on_session_end)
        self._tool_lists: dict[bytes, ToolList] = {}
        self.stats = {"num_requests": 0, "num_turns": 0, "num_client_errors": 0, "num_upstream_errors": 0,
                      "num_internal_errors": 0, "num_render_checks": 0, "num_render_drifts": 0, "num_prefix_breaks": 0}
        self._routes_by_key = self._routes()
        self._http: HTTPServer | None = None
        self._sweeper: asyncio.Task | None = None
        self._gc_thresholds: tuple[int, ...] | None = None
        self._num_recalled_unchecked = 0
        self._sweeper_error: str | None = None
        self.base_url: str | None = None

    # -- lifecycle ---------------------------------------------------------------------------------

    def _routes(self) -> dict[tuple[str, str], object]:
        return {("GET", "/health"): self._health, ("GET", "/agentrl/stats"): self._stats,
                ("GET", "/agentrl/sessions"): self._list_sessions,
                ("GET", "/v1/models"): self._models, ("POST", "/v1/chat/completions"): self._chat,
                ("POST", "/v1/completions"): self._completions}

    async def start(self) -> str:
        # gateway.http's bare protocol with the routing below (a dict lookup): aiohttp's server cost
        # ~135 CPU us per request here, against ~30 (gateway/http.py).
        self._http = HTTPServer(self._handle, error_response=self._http_error, max_body_bytes=self.config.max_body_bytes)
        port = await self._http.start(self.config.host, self.config.port, backlog=4096)
        self.base_url = f"http://{self.config.host}:{port}"
        self._sweeper = asyncio.create_task(self._sweep(), name="gateway-session-sweeper")
        self._sweeper.add_done_callback(self._sweeper_ended)
        if self.config.gc_threshold0 is not None:
            self._gc_thresholds = gc.get_threshold()
            gc.collect()
            gc.freeze()  # what start-up built (tokenizer, modules) is never garbage; keep collections off it
            gc.set_threshold(self.config.gc_threshold0, *self._gc_thresholds[1:])
        log.info("gateway serving %s on %s (renderer %s, tool parser %s)", self.model_name, self.base_url, self.renderer.name, self.family)
        return self.base_url

    async def stop(self, timeout_s: float | None = None) -> None:
        """Stop serving: requests in flight get `shutdown_grace_s` to finish, then are cancelled."""
        timeout_s = timeout_s if timeout_s is not None else 2 * self.config.shutdown_grace_s + 5.0
        if self._gc_thresholds is not None:
            gc.set_threshold(*self._gc_thresholds)
            gc.unfreeze()
            self._gc_thresholds = None
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.wait([self._sweeper], timeout=timeout_s)
            self._sweeper = None
        if self._http is not None:
            await asyncio.wait_for(self._http.close(self.config.shutdown_grace_s), timeout_s)
            self._http = None

    def _sweeper_ended(self, task: asyncio.Task) -> None:
        """A sweeper that died (an `on_session_end` hook raised) is logged and makes /health fail:
        sessions would otherwise pile up unexpired without a sign."""
        if not task.cancelled() and task.exception() is not None:
            self._sweeper_error = f"{type(task.exception()).__name__}: {task.exception()}"
            log.error("the session sweeper stopped: %s", self._sweeper_error, exc_info=task.exception())

    async def _sweep(self) -> None:
        interval_s = self.config.sweep_interval_s or min(10.0, self.config.session_idle_s / 2)
        while True:
            await asyncio.sleep(interval_s)
            self.sessions.expire()

    # -- routing, errors and small endpoints --------------------------------------------------------

    def _route(self, method: str, path: str):
        """(handler, session id from the URL or None); GatewayError 404/405 for no route."""
        session_id = None
        if path.startswith("/s/"):
            session_id, slash, rest = path[3:].partition("/")
            if not slash or not session_id or not rest.startswith("v1/"):
                raise P.GatewayError(404, f"no route {path!r}: a session base URL is /s/{{session}}/v1", code="not_found")
            path = "/" + rest
        handler = self._routes_by_key.get((method, path))
        if handler is not None:
            return handler, session_id
        if session_id is None and path.startswith("/agentrl/sessions/"):
            handler = {"GET": self._get_session, "DELETE": self._close_session}.get(method)
            if handler is not None:
                return handler, path.removeprefix("/agentrl/sessions/")
        if self.tools is not None and path.startswith("/v1/agentrl/tools"):
            if method == "GET" and path == "/v1/agentrl/tools":
                return self._list_tools, session_id
            if method == "POST" and path.startswith("/v1/agentrl/tools/"):
                return self._call_tool, session_id
            raise P.GatewayError(405, f"{method} is not allowed on {path}", code="method_not_allowed")
        if any(p == path for _, p in self._routes_by_key) or path.startswith("/agentrl/sessions/"):
            raise P.GatewayError(405, f"{method} is not allowed on {path}", code="method_not_allowed")
        raise P.GatewayError(404, f"no route {method} {path}", code="not_found")

    def _http_error(self, status: int, message: str) -> Response:
        """The answer to a request that is not HTTP (400, 431, 501) or to a handler bug (500)."""
        self.stats["num_client_errors" if status < 500 else "num_internal_errors"] += 1
        return json_response(P.GatewayError(status, message, code="bad_http_request" if status < 500 else "internal_error").body(), status)

    async def _handle(self, request: Request) -> Response:
        """Every request: route, run, and answer any refusal as OpenAI's error JSON."""
        self.stats["num_requests"] += 1
        try:
            handler, session_id = self._route(request.method, request.path)
            return await handler(request, session_id)
        except P.GatewayError as err:
            self.stats["num_upstream_errors" if err.status in (502, 503) else
                       "num_client_errors" if err.status < 500 else "num_internal_errors"] += 1
            return json_response(err.body(), err.status)
        except BodyTooLarge:
            self.stats["num_client_errors"] += 1
            message = f"the request body is larger than the gateway's limit of {self.config.max_body_bytes} bytes"
            return json_response(P.GatewayError(413, message, code="body_too_large").body(), 413)
        except Exception as err:  # a bug: answered, counted and logged with its traceback; the gateway keeps serving
            self.stats["num_internal_errors"] += 1
            log.exception("internal error on %s %s", request.method, request.path)
            return json_response(P.GatewayError(500, f"internal gateway error: {type(err).__name__}: {err}", code="internal_error").body(), 500)

    async def _health(self, request: Request, session_id: str | None) -> Response:
        if self._sweeper_error is not None:
            return json_response({"status": f"the session sweeper stopped: {self._sweeper_error}"}, 503)
        return json_response({"status": "ok"})

    async def _stats(self, request: Request, session_id: str | None) -> Response:
        s = self.sessions
        return json_response({**self.stats, "num_sessions_open": len(s), "num_sessions_opened": s.num_opened,
                      "num_sessions_closed": s.num_closed, "num_sessions_expired": s.num_expired,
                      "renderer": self.renderer.name, "tool_parser": self.family, "model": self.model_name})

    async def _models(self, request: Request, session_id: str | None) -> Response:
        return json_response({"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                                  "owned_by": "agentrl", "max_model_len": self.config.max_model_len}]})

    async def _list_sessions(self, request: Request, session_id: str | None) -> Response:
        return json_response({"sessions": self.sessions.ids(), "num_open": len(self.sessions)})

    async def _get_session(self, request: Request, session_id: str) -> Response:
        return json_response(self.sessions.get(session_id).to_record())

    async def _close_session(self, request: Request, session_id: str) -> Response:
        return json_response(self.sessions.close(session_id))

    async def _list_tools(self, request: Request, session_id: str | None) -> Response:
        return json_response({"tools": self.tools.schemas()})

    async def _call_tool(self, request: Request, session_in_path: str | None) -> Response:
        session_id = self._session_id(request, session_in_path)
        name = request.path.rpartition("/agentrl/tools/")[2]
        try:
            arguments = msgspec.json.decode(await request.read())
        except msgspec.DecodeError as err:
            raise P.invalid(f"the body must be the tool's arguments as a JSON object: {err}", "arguments") from None
        if not isinstance(arguments, dict):
            raise P.invalid(f"the body must be the tool's arguments as a JSON object, got {type(arguments).__name__}", "arguments")
        session = self.sessions.open(session_id) if session_id is not None else None
        if session is not None:
            session.in_flight += 1
        try:
            return json_response(await self.tools.call(session_id, name, arguments))
        finally:
            if session is not None:
                session.in_flight -= 1
                session.last_used_s = time.monotonic()

    # -- the two generation endpoints ---------------------------------------------------------------

    def _session_id(self, request: Request, in_path: str | None) -> str | None:
        in_header = request.headers.get(_SESSION_HEADER_KEY)
        if in_path is not None and in_header is not None and in_path != in_header:
            raise P.invalid(f"the session in the URL ({in_path!r}) and in the {SESSION_HEADER} header ({in_header!r}) differ",
                            SESSION_HEADER)
        session_id = in_path if in_path is not None else in_header
        if session_id is not None and not _SESSION_ID.fullmatch(session_id):
            raise P.invalid(f"session id {session_id[:200]!r}: use 1 to 128 of the characters A-Z a-z 0-9 . _ : @ -", SESSION_HEADER)
        return session_id

    def _check_model(self, model: str) -> None:
        if model not in self._model_names:
            raise P.GatewayError(404, f"the model `{model}` does not exist; this gateway serves `{self.model_name}`",
                                 param="model", code="model_not_found")

    def _tools(self, raw: msgspec.Raw) -> ToolList | None:
        key = bytes(raw)
        if not key or key == b"null":
            return None
        tools = self._tool_lists.get(key)
        if tools is None:
            specs = P.decode_tools(raw)
            if not specs:
                return None
            if len(self._tool_lists) >= 1024:
                self._tool_lists.clear()
            tools = self._tool_lists[key] = ToolList(key, tuple(specs))
        return tools

    def _max_tokens(self, num_prompt_tokens: int, requested: int | None, param: str, default: int | None) -> int:
        limit = self.config.max_model_len
        if num_prompt_tokens >= limit:
            raise P.invalid(f"this model's maximum context length is {limit} tokens; the prompt is {num_prompt_tokens} tokens "
                            "(with the generation prompt), leaving none to generate", "messages", "context_length_exceeded")
        room = limit - num_prompt_tokens
        if requested is None:
            return room if default is None else min(default, room)
        if requested < 1:
            raise P.invalid(f"`{param}` must be >= 1, got {requested}", param)
        if requested > room:
            raise P.invalid(f"this model's maximum context length is {limit} tokens; the prompt is {num_prompt_tokens} tokens and "
                            f"`{param}` asks for {requested} more", param, "context_length_exceeded")
        return requested

    async def _generate(self, prompt_ids: list[int], params: SamplingParams):
        try:
            return await self.pool.generate(prompt_ids, params)
        except InferenceServerUnavailable as err:
            raise P.GatewayError(503, f"no inference server answered: {err}", code="upstream_unavailable") from err
        except InferenceServerError as err:
            raise P.GatewayError(502, f"the inference server refused the request: {err}", code="upstream_error") from err

    async def _chat(self, request: Request, session_in_path: str | None) -> Response:
        session_id = self._session_id(request, session_in_path)
        req = P.decode_chat(await request.read())
        self._check_model(req.model)
        tools = self._tools(req.tools)
        choice = P.tool_choice(req, tools.names if tools else [])
        if req.stream and req.logprobs:
            raise P.invalid("`logprobs` are returned by non-streaming requests only", "logprobs")
        session = self.sessions.open(session_id) if session_id is not None else None
        if session is not None:
            session.in_flight += 1
        try:
            if session is None:
                rendered = self.renderer.render(req.messages, tools, forced_prefill(self.family, choice.forced), None)
            else:
                rendered = self.renderer.render(req.messages, tools, forced_prefill(self.family, choice.forced), session.recall,
                                                session.last_rendered)
                session.last_rendered = rendered
            param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
            max_tokens = self._max_tokens(len(rendered.token_ids), req.max_completion_tokens or req.max_tokens, param, None)
            params = SamplingParams(max_tokens=max_tokens, top_p=1.0 if req.top_p is None else req.top_p,
                                    temperature=self.config.default_temperature if req.temperature is None else req.temperature,
                                    stop_token_ids=self.renderer.stop_token_ids, seed=req.seed)
            generation = await self._generate(rendered.token_ids, params)
            turn = chat_turn(generation, rendered, choice, parallel=req.parallel_tool_calls is not False, parser=self.parser,
                             stop_ids=self._stop_ids, decode=self._decode)
            if session is not None:
                self._record_chat(session, req.messages, rendered, turn, tools, choice)
        finally:
            if session is not None:
                session.in_flight -= 1
                session.last_used_s = time.monotonic()
        self.stats["num_turns"] += 1
        usage = {"prompt_tokens": len(rendered.token_ids), "completion_tokens": len(turn.ids),
                 "total_tokens": len(rendered.token_ids) + len(turn.ids)}
        completion_id = "chatcmpl-" + os.urandom(12).hex()
        if req.stream:
            include_usage = req.stream_options is not None and bool(req.stream_options.include_usage)
            return chat_stream(completion_id, self.model_name, turn, usage if include_usage else None)
        return chat_completion(completion_id, self.model_name, turn, usage, chat_logprobs(turn, self._decode) if req.logprobs else None)

    def _decode(self, ids: list[int]) -> str:
        return self._backend.decode(ids, skip_special_tokens=False)

    def _record_chat(self, session: Session, messages, rendered: Rendered, turn: Turn, tools, choice) -> None:
        c = session.counters
        c.num_spliced_messages += len(rendered.spliced)
        c.num_unrecognised_assistant += rendered.num_unrecognised
        every = self.config.render_check_every
        if every and any(not rec.checked for _, _, rec in rendered.spliced):
            self._num_recalled_unchecked += 1
            if self._num_recalled_unchecked % every == 0:
                self._check_rendering(session, messages, rendered, tools, choice)
            else:
                for _, _, rec in rendered.spliced:
                    rec.checked = True
        joined = session.record_turn(rendered.token_ids, turn.ids, turn.logprobs, turn.versions, len(turn.tool_calls), turn.finish_reason)
        if not joined and c.num_segments > 1:
            self.stats["num_prefix_breaks"] += 1
            log.info("session %s: the prompt extends no open segment; segment %d opened", session.id, c.num_segments - 1)
        calls = tuple((call["id"], call["function"]["name"], call["function"]["arguments"]) for call in turn.tool_calls)
        session.remember(turn.content or "", calls, rendered.prefill_ids + turn.ids)

    def _check_rendering(self, session: Session, messages, rendered: Rendered, tools, choice) -> None:
        session.counters.num_render_checks += 1
        self.stats["num_render_checks"] += 1
        position = self.renderer.first_drift(messages, tools, forced_prefill(self.family, choice.forced), rendered)
        if position is None:
            return
        session.counters.num_render_drifts += 1
        self.stats["num_render_drifts"] += 1
        index = next((i for i, start, _ in reversed(rendered.spliced) if start <= position), None)
        ids = rendered.token_ids
        sampled = ids[position] if position < len(ids) else None
        log.warning("session %s: the history rendered from text differs from the recorded ids at prompt position %d "
                    "(messages[%s]; recorded id %s %r); the recorded ids are kept", session.id, position, index, sampled,
                    self._decode([sampled]) if sampled is not None else "")

    async def _completions(self, request: Request, session_in_path: str | None) -> Response:
        session_id = self._session_id(request, session_in_path)
        req = P.decode_completion(await request.read())
        self._check_model(req.model)
        prompt = P.prompt_of(req)
        if isinstance(prompt, str):
            prompt_ids = self._backend.encode(prompt, add_special_tokens=False).ids
        else:
            bad = next((i for i, t in enumerate(prompt) if not 0 <= t < self._vocab_size), None)
            if bad is not None:
                raise P.invalid(f"prompt[{bad}] = {prompt[bad]} is not a token id of this model (0..{self._vocab_size - 1})", "prompt")
            prompt_ids = list(prompt)
        if not prompt_ids:
            raise P.invalid("`prompt` is empty", "prompt")
        max_tokens = self._max_tokens(len(prompt_ids), req.max_tokens, "max_tokens", 16)  # 16: OpenAI's default here
        params = SamplingParams(max_tokens=max_tokens, top_p=1.0 if req.top_p is None else req.top_p,
                                temperature=self.config.default_temperature if req.temperature is None else req.temperature,
                                stop_token_ids=self._eos_ids or None, seed=req.seed)
        session = self.sessions.open(session_id) if session_id is not None else None
        if session is not None:
            session.in_flight += 1
        try:
            generation = await self._generate(prompt_ids, params)
            ids = generation.token_ids
            if session is not None:
                session.record_turn(prompt_ids, ids, generation.logprobs, generation.versions, 0, generation.finish_reason)
        finally:
            if session is not None:
                session.in_flight -= 1
                session.last_used_s = time.monotonic()
        self.stats["num_turns"] += 1
        stopped = bool(ids) and ids[-1] in self._eos_ids
        text = self._decode(ids[:-1] if stopped else ids)
        finish = "length" if generation.finish_reason == "length" else "stop"
        usage = {"prompt_tokens": len(prompt_ids), "completion_tokens": len(ids), "total_tokens": len(prompt_ids) + len(ids)}
        logprobs = None
        if req.logprobs is not None:
            tokens = [self._decode([t]) for t in ids]
            offsets = [sum(len(t) for t in tokens[:k]) for k in range(len(tokens))]
            logprobs = {"tokens": tokens, "token_logprobs": generation.logprobs, "top_logprobs": None, "text_offset": offsets}
        completion_id = "cmpl-" + os.urandom(12).hex()
        body = {"id": completion_id, "object": "text_completion", "created": int(time.time()), "model": self.model_name,
                "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}], "usage": usage}
        if not req.stream:
            return json_response(body)
        return completion_stream(body, req.stream_options is not None and bool(req.stream_options.include_usage))
