"""Tools: what an agent can call. A `Tool` executes and reports what happened; it never interprets.

Interface (the `ToolEnv` sees only this, so local and remote tools are interchangeable):
    tool.name, tool.description, tool.parameters (JSON schema of the arguments object),
    tool.idempotent, tool.schema() -> OpenAI function schema,
    await tool.execute(arguments, timeout_s=None) -> ToolResult(content, success, latency_s, error)

Failure contract:
- The tool ran but failed (bad arguments seen by the service, a sandbox limit, a deadline):
  `ToolResult(success=False, error=...)`. The model observes it like any result.
- The tool could not be reached at all (no live replica): `ToolUnavailable` is raised. That is an
  infrastructure failure, not the policy's doing, so the episode is marked failed instead of the
  policy being penalised for it.

Tools here: `FunctionTool` (any Python callable, sync or async), `LocalSearchTool` (BM25 over an
in-memory passage list; the same results format as the remote search service) and `RemoteTool`
(one tool of a ZeroMQ tool service, built from its `describe` answer by `remote_tools`).
"""

from __future__ import annotations

import asyncio
import inspect
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any


class ToolUnavailable(RuntimeError):
    """The tool could not be reached (infrastructure failure; the episode is marked failed)."""


@dataclass
class ToolResult:
    content: Any
    """JSON-able result (a string, a list of passages, a number, ...); None on failure."""
    success: bool
    latency_s: float
    """Seconds from the call to the result, as seen by the caller."""
    error: str | None = None
    """Readable reason when `success` is False (shown to the model)."""


class Tool(ABC):
    name: str
    description: str
    parameters: dict
    """JSON schema of the arguments object ({"type": "object", "properties": ..., "required": ...})."""
    idempotent: bool = True

    def schema(self) -> dict:
        """OpenAI function-calling schema."""
        return {"type": "function", "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}

    @abstractmethod
    async def execute(self, arguments: dict, timeout_s: float | None = None) -> ToolResult: ...


class DisabledTool(Tool):
    """Stands where `tool` was, with its name and schema (the prompt does not change), and fails
    every call saying it is disabled: the tool-disabled evaluation, which asks whether the policy
    answers from the tool's results or from what it memorised about the tasks."""

    def __init__(self, tool: Tool):
        self.name, self.description, self.parameters, self.idempotent = tool.name, tool.description, tool.parameters, True

    async def execute(self, arguments: dict, timeout_s: float | None = None) -> ToolResult:
        return ToolResult(None, False, 0.0, f"the tool {self.name!r} is disabled in this evaluation")


class FunctionTool(Tool):
    """A Python callable as a tool: `fn(**arguments)` returns the content; an exception is a failed
    result whose message the model sees (the callable's own bug is the tool's failure, not the
    episode's). A coroutine function is awaited on the loop; a plain function runs on a worker
    thread when `threaded` (the default for `from_function`: a slow user function must not stall
    thousands of episodes on the orchestrator's loop), else inline."""

    def __init__(self, name: str, description: str, parameters: dict, fn: Callable[..., Any | Awaitable[Any]], *,
                 idempotent: bool = True, threaded: bool = False):
        self.name, self.description, self.parameters, self.idempotent = name, description, parameters, idempotent
        self._fn = fn
        self._threaded = threaded and not inspect.iscoroutinefunction(fn)

    @classmethod
    def from_function(cls, fn: Callable, *, name: str | None = None, description: str | None = None,
                      parameters: dict | None = None) -> FunctionTool:
        """A tool from a function; its schema from type hints and docstring unless given
        (agentrl.toolservers.functions.function_schema; SchemaError names what is missing)."""
        from agentrl.toolservers.functions import function_schema

        if parameters is None or description is None:
            auto_description, auto_parameters = function_schema(fn)
            description, parameters = description or auto_description, parameters or auto_parameters
        return cls(name or fn.__name__, description, parameters, fn, threaded=True)

    async def execute(self, arguments: dict, timeout_s: float | None = None) -> ToolResult:
        start = time.perf_counter()
        try:
            if self._threaded:
                call = asyncio.to_thread(self._fn, **arguments)
                out = await asyncio.wait_for(call, timeout_s) if timeout_s else await call
            else:
                out = self._fn(**arguments)
            if inspect.isawaitable(out):
                out = await asyncio.wait_for(out, timeout_s) if timeout_s else await out
        except TimeoutError:
            return ToolResult(None, False, time.perf_counter() - start, f"timed out after {timeout_s} s")
        except Exception as err:  # noqa: BLE001 - any failure of user code is reported to the model as the tool's result
            return ToolResult(None, False, time.perf_counter() - start, f"{type(err).__name__}: {err}")
        return ToolResult(out, True, time.perf_counter() - start)


class FinishTool(Tool):
    """The `finish` tool of an environment with `EnvConfig.finish_tool`: listed to the model with
    the environment's schema; a valid call ends the episode (its arguments are the answer) before
    any tool runs, so `execute` only answers a call that did not validate."""

    def __init__(self, name: str, parameters: dict):
        self.name, self.parameters = name, parameters
        self.description = "Finish the task: call it once, with the result as its arguments."

    async def execute(self, arguments: dict, timeout_s: float | None = None) -> ToolResult:
        return ToolResult(None, False, 0.0, f"{self.name} ends the episode only with arguments that match its schema")


SEARCH_PARAMETERS = {
    "type": "object",
    "properties": {
        "query": {"type": "string", "description": "what to look for"},
        "top_k": {"type": "integer", "minimum": 1, "maximum": 10, "description": "number of passages (default 3)"},
    },
    "required": ["query"],
    "additionalProperties": False,
}


class LocalSearchTool(Tool):
    """BM25 search over passages held in this process; results are [{"id","title","text","score"}].
    The search service's index (`toolservers.search.BM25Index`), so it ranks as the service does.

    For tests, gold trajectories and the benchmark; a training run uses the search service."""

    name = "search"
    description = "Search the knowledge base. Returns the best matching passages."
    parameters = SEARCH_PARAMETERS

    def __init__(self, passages: list[dict], default_top_k: int = 3):
        from agentrl.toolservers.search import BM25Index

        self._index = BM25Index.build(passages)
        self._default_top_k = default_top_k

    def search(self, query: str, top_k: int | None = None) -> list[dict]:
        return self._index.search([query], [top_k or self._default_top_k])[0]

    async def execute(self, arguments: dict, timeout_s: float | None = None) -> ToolResult:
        start = time.perf_counter()
        return ToolResult(self.search(arguments["query"], arguments.get("top_k")), True, time.perf_counter() - start)


class RemoteTool(Tool):
    """One tool of a remote tool service, called through a `ToolClient` (shared by all its tools)."""

    def __init__(self, client, spec: dict):
        fn = spec["function"]
        self.name, self.description = fn["name"], fn.get("description", "")
        self.parameters = fn.get("parameters") or {"type": "object", "properties": {}}
        self.idempotent = bool(spec.get("idempotent", False))
        self._client = client

    async def execute(self, arguments: dict, timeout_s: float | None = None) -> ToolResult:
        from agentrl.toolservers.client import ToolServiceUnavailable

        start = time.perf_counter()
        try:
            resp = await self._client.call(self.name, arguments, deadline_s=timeout_s)
        except ToolServiceUnavailable as err:
            raise ToolUnavailable(f"tool {self.name!r}: {err}") from err
        latency_s = time.perf_counter() - start
        if resp.ok:
            return ToolResult(resp.content, True, latency_s)
        return ToolResult(None, False, latency_s, f"{resp.error.type}: {resp.error.message}")


async def remote_tools(client) -> list[RemoteTool]:
    """The tools a started `ToolClient`'s service offers, from its `describe` answer."""
    return [RemoteTool(client, spec) for spec in await client.describe()]
