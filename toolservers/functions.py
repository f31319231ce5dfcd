"""Python functions as tools: their schema from type hints and docstring, and a tool service that hosts them.

    # my_tools.py: a tool service `agentrl train` can start from a command (docs/ENVIRONMENTS.md)
    from agentrl.toolservers.functions import serve

    def get_weather(city: str, day: int = 0) -> dict:
        '''Weather forecast for a city.

        Args:
            city: the city's name
            day: days from today (0 = today)
        '''
        return {...}

    if __name__ == "__main__":
        serve([get_weather])      # --bind tcp://127.0.0.1:PORT (or :* for a free port); prints READY

`function_schema(fn)`: the OpenAI function schema of `fn` from its signature: str -> string, int ->
integer, float -> number, bool -> boolean, dict -> object, list -> array (in-process tools only:
the service's argument checker has no arrays), `X | None` or a default -> optional; descriptions
from the docstring's first paragraph and its `Args:` section. A parameter without a usable type
hint is an error naming it (give `parameters` explicitly instead). The service answers a call with
the function's return value (JSON-able); `ToolFailure` or any exception becomes a failed result
with the message, which the model sees.
"""

from __future__ import annotations

import argparse
import inspect
import os
import re
import sys
import types
import typing
from collections.abc import Callable, Sequence
from typing import Any

from agentrl.toolservers.server import (
    ServerConfig,
    Tool,
    ToolFailure,
    ToolServer,
    ToolSpec,
    configure_logging,
)

_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", dict: "object", list: "array"}


class SchemaError(ValueError):
    """A function whose arguments cannot be described as a JSON schema."""


def _json_type(hint: Any, where: str) -> tuple[str, bool]:
    """(JSON type, optional) of a type hint."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(members) != 1:
            raise SchemaError(f"{where}: a union of {members} has no single JSON type; give `parameters` explicitly")
        return _json_type(members[0], where)[0], True
    base = origin or hint
    if base in _JSON_TYPES:
        return _JSON_TYPES[base], False
    raise SchemaError(f"{where}: type hint {hint!r} has no JSON type (str, int, float, bool, dict, list); "
                      "give `parameters` explicitly")


def _docstring(fn: Callable) -> tuple[str, dict[str, str]]:
    """(description, {parameter: description}) from a Google-style docstring."""
    doc = inspect.getdoc(fn) or ""
    head, _, rest = doc.partition("\n\n")
    params: dict[str, str] = {}
    section = re.search(r"^(Args|Arguments|Parameters):\s*$(.*?)(?=^\S|\Z)", doc, re.M | re.S)
    if section:
        for line in section.group(2).splitlines():
            match = re.match(r"\s+(\w+)(?:\s*\([^)]*\))?:\s*(.+)", line)
            if match:
                params[match.group(1)] = match.group(2).strip()
    return " ".join(head.split()), params


def function_schema(fn: Callable, *, where: str | None = None) -> tuple[str, dict]:
    """(description, JSON schema of the arguments object) of `fn` (module docstring)."""
    where = where or getattr(fn, "__qualname__", repr(fn))
    try:
        hints = typing.get_type_hints(fn)
        signature = inspect.signature(fn)
    except (TypeError, ValueError, NameError) as err:
        raise SchemaError(f"{where}: cannot read its signature ({err}); give `parameters` explicitly") from None
    description, param_docs = _docstring(fn)
    properties, required = {}, []
    for name, param in signature.parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise SchemaError(f"{where}: *{name} / **{name} cannot be described; give `parameters` explicitly")
        if name not in hints:
            raise SchemaError(f"{where}: parameter {name!r} has no type hint; add one or give `parameters` explicitly")
        json_type, optional = _json_type(hints[name], f"{where}: parameter {name!r}")
        prop: dict[str, Any] = {"type": json_type}
        if name in param_docs:
            prop["description"] = param_docs[name]
        properties[name] = prop
        if param.default is inspect.Parameter.empty and not optional:
            required.append(name)
    if not description:
        raise SchemaError(f"{where}: no docstring; the model needs a description of the tool")
    return description, {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


class FunctionServiceTool(Tool):
    """A Python function hosted by a ToolServer (runs inline on the server's loop)."""

    def __init__(self, fn: Callable, *, name: str | None = None, description: str | None = None,
                 parameters: dict | None = None, idempotent: bool = True):
        auto_description, auto_parameters = function_schema(fn) if parameters is None or description is None else ("", {})
        self.spec = ToolSpec(name or fn.__name__, description or auto_description, parameters or auto_parameters, idempotent)
        self._fn = fn

    def run(self, args: dict) -> Any:
        try:
            return self._fn(**args)
        except ToolFailure:
            raise
        except Exception as err:  # noqa: BLE001 - the function's failure on this input is the call's result
            raise ToolFailure(f"{type(err).__name__}: {err}") from err


CURVE_SECRET_KEY_ENV = "AGENTRL_CURVE_SECRET_KEY"
CURVE_AUTHORIZED_CLIENTS_ENV = "AGENTRL_CURVE_AUTHORIZED_CLIENTS"
"""The certificate files a run hands a `[[tools]] command` service it starts off loopback
(engine/services.py sets them; the options below default to them)."""


def serve(functions: Sequence[Callable | Tool], argv: list[str] | None = None) -> int:
    """Host `functions` as one tool service: `--bind ENDPOINT` (default tcp://127.0.0.1:* = a free
    port), `--log-level`, and off loopback `--curve-secret-key` / `--curve-authorized-clients`
    (default: the files `agentrl train` names in AGENTRL_CURVE_SECRET_KEY /
    AGENTRL_CURVE_AUTHORIZED_CLIENTS); prints `READY <endpoint>` on stdout; stops on SIGTERM."""
    parser = argparse.ArgumentParser(description="A tool service hosting Python functions.")
    parser.add_argument("--bind", default="tcp://127.0.0.1:*")
    parser.add_argument("--curve-secret-key", default=os.environ.get(CURVE_SECRET_KEY_ENV),
                        help="this service's zmq.auth NAME.key_secret (needed off loopback)")
    parser.add_argument("--curve-authorized-clients", default=os.environ.get(CURVE_AUTHORIZED_CLIENTS_ENV),
                        help="folder of the allowed clients' zmq.auth *.key files")
    parser.add_argument("--log-level", default="WARNING")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    configure_logging(args.log_level)
    tools = [f if isinstance(f, Tool) else FunctionServiceTool(f) for f in functions]
    config = ServerConfig(bind=args.bind, curve_secret_key_file=args.curve_secret_key,
                          curve_authorized_clients_dir=args.curve_authorized_clients)
    ToolServer(config, tools).serve()
    return 0
