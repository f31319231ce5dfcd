"""The typed-config system: every component's config is a pydantic dataclass, checked at the boundary.

One system for every process (`agentrl train`, `eval`, `learner`, `actor`, tool services):

- A component's config is a dataclass declared with `@config_dataclass` (pydantic v2, `CONFIG`):
  unknown keys are refused, and the docstring under each field is its description (shown by
  `agentrl train --help`). A key that moved is named in the class's `__moved__` ({old key: its new
  path under the same table}); an old config that uses it is refused naming the new key. Construction in code validates too (lax: Python values are coerced the
  way pydantic does); ranges and cross-field rules live in `__post_init__`.
- Files and command lines go through `build(cls, data, origins)`, which validates strictly (the
  JSON mode of pydantic's strict validation: a TOML string is never an int, an int never a bool,
  arrays do become tuples, tables become dataclasses). Every error names where the value came from
  (the file, `--set`, the embedded default), the key path, what was wrong and, for unknown keys
  and choices, what is accepted. `ConfigError` carries that message; the CLIs print it and exit 2.
- Layers: `layer(base, override)` merges tables key by key (a table merges, anything else
  replaces, lists included), and `origins` records which source set each key path, so a partial
  `--config` file changes only the keys it names. `parse_override("a.b=VALUE")` reads a `--set`
  value as a TOML value (`3`, `1e-5`, `true`, `["search"]`, `"text"`), else as a plain string.
- `dump_toml` writes a resolved config back (the standard library reads TOML but does not write
  it): the supervisor hands each process the config it runs with, and `--print-config` shows it.
  None values are omitted: TOML has no null, so a None can only come from a default.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import tomllib
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pydantic
import pydantic.fields
from pydantic import ConfigDict
from pydantic.dataclasses import dataclass as _pydantic_dataclass

CONFIG = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_by_name=True, validate_by_alias=True)
"""The pydantic settings of every agentrl config dataclass."""

KeyPath = tuple[str, ...]
Origins = dict[KeyPath, str]


def config_dataclass(cls=None, /, **kwargs):
    """`@config_dataclass` (or `@config_dataclass(frozen=True)`): a pydantic dataclass with `CONFIG`."""
    def wrap(c):
        return _pydantic_dataclass(c, config=CONFIG, **kwargs)

    return wrap if cls is None else wrap(cls)


class ConfigError(ValueError):
    """A config that cannot be used; the message says where, which key, and what is accepted."""


# ---------------------------------------------------------------- reading and layering


def read_toml(path: str | Path) -> dict:
    """A TOML file as a dict; a missing file or a syntax error names the file (and line)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: not valid TOML: {err}") from None


def layer(base: dict, override: dict, *, origins: Origins | None = None, source: str = "",
          prefix: KeyPath = ()) -> dict:
    """`base` with `override` applied table by table; records `source` in `origins` for every key
    path `override` sets (a table that replaces a non-table counts as set whole)."""
    out = dict(base)
    for key, value in override.items():
        path = (*prefix, key)
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = layer(out[key], value, origins=origins, source=source, prefix=path)
            continue
        out[key] = value
        if origins is not None:
            for sub in _leaf_paths(value, path):
                origins[sub] = source
    return out


def _leaf_paths(value: Any, path: KeyPath) -> Iterator[KeyPath]:
    yield path
    if isinstance(value, dict):
        for key, sub in value.items():
            yield from _leaf_paths(sub, (*path, key))


def parse_override(text: str) -> tuple[KeyPath, Any]:
    """`a.b.c=VALUE` -> (("a", "b", "c"), value): VALUE as a TOML value, else the plain string."""
    key, sep, raw = text.partition("=")
    path = tuple(part.strip() for part in key.split("."))
    if not sep or not all(path):
        raise ConfigError(f"--set {text!r}: expected KEY.PATH=VALUE, e.g. --set learner.trainer.optimizer.lr=2e-5")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return path, value


def set_path(data: dict, path: KeyPath, value: Any) -> dict:
    """`data` with `value` at `path` (tables created as needed); `data` is not modified."""
    out = dict(data)
    head, *rest = path
    if rest:
        inner = out.get(head)
        if inner is not None and not isinstance(inner, dict):
            raise ConfigError(f"--set {'.'.join(path)}: {head!r} is a value, not a table")
        out[head] = set_path(inner or {}, tuple(rest), value)
    else:
        out[head] = value
    return out


# ---------------------------------------------------------------- validation


def build(cls: type, data: dict, *, origins: Origins | None = None, default_source: str = "config",
          prefix: KeyPath = ()) -> Any:
    """`cls` from `data`, strictly validated; a ConfigError lists every problem. `prefix`: where
    `data` sits in a larger config (key paths in messages and `origins` lookups start there)."""
    try:
        text = json.dumps(data)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"{default_source}: cannot read the config as data: {err}") from None
    try:
        return pydantic.TypeAdapter(cls).validate_json(text, strict=True)
    except pydantic.ValidationError as err:
        raise ConfigError(format_errors(cls, err, origins or {}, default_source, prefix)) from None


def from_options(cls: type, source: str, /, **values: Any) -> Any:
    """`cls` from a command line's options, checked as strictly as a config file: a None value is
    an option not given (the field keeps its default); errors start with `source` (the program)."""
    return build(cls, {key: value for key, value in values.items() if value is not None}, default_source=source)


def format_errors(cls: type, err: pydantic.ValidationError, origins: Origins, default_source: str,
                  prefix: KeyPath = ()) -> str:
    """One line per bad key: `source: key.path: what is wrong (got value)[; accepted: ...]`."""
    by_key: dict[KeyPath, list[dict]] = {}
    tables: dict[KeyPath, Any] = {}
    for e in err.errors():
        key, types = _key_path(cls, e["loc"])
        if e["type"] == "value_error":
            # A rule in __post_init__ raised at the dataclass; its message starts with the field it is about.
            head = re.match(r"(\w+)\s*[:=]", e["msg"].removeprefix("Value error, "))
            if head and head.group(1) in field_names(types.get(len(key))):
                key = (*key, head.group(1))
                e = {**e, "msg": e["msg"].removeprefix("Value error, ")[head.end():].strip()}
        by_key.setdefault(key, []).append(e)
        tables[key] = types.get(len(key) - 1)
    lines = []
    for key, errors in by_key.items():
        source = _origin(origins, (*prefix, *key), default_source)
        where = ".".join((*prefix, *key)) or "(top level)"
        if any(e["type"] in ("unexpected_keyword_argument", "extra_forbidden") for e in errors):
            moved = getattr(tables[key], "__moved__", {}).get(key[-1])
            if moved is not None:
                lines.append(f"{source}: {where}: this key moved; write it as {'.'.join((*prefix, *key[:-1], moved))}")
                continue
            accepted = field_names(tables[key])
            lines.append(f"{source}: {where}: unknown key; accepted keys here: {', '.join(accepted)}")
            continue
        messages = []
        for e in errors:
            msg = e["msg"].removeprefix("Value error, ")
            if msg not in messages:
                messages.append(msg)
        got = errors[0].get("input")
        shown = "" if isinstance(got, dict) or got is None else f" (got {json.dumps(got)[:80]})"
        lines.append(f"{source}: {where}: {' or '.join(messages)}{shown}")
    return "\n".join(lines)


def _origin(origins: Origins, key: KeyPath, default: str) -> str:
    key = tuple(part.split("[", 1)[0] for part in key)
    for n in range(len(key), -1, -1):
        if key[:n] in origins:
            return origins[key[:n]]
    return default


def _key_path(cls: type, loc: tuple) -> tuple[KeyPath, dict[int, Any]]:
    """The config key path of a pydantic error location (list indices shown as `[i]` on the key
    before them, union-member tags such as `int`, `literal['all']` or a tagged union's tag dropped),
    and the type of the table at each length of that path (a tagged union's chosen member)."""
    out: list[str] = []
    tp: Any = cls
    types: dict[int, Any] = {0: cls}
    for part in loc:
        members = tagged_members(tp)
        if isinstance(part, int):
            if out:
                out[-1] += f"[{part}]"
            tp = _item_type(tp)
        elif members is not None and part in members:
            tp = members[part]
        elif (names := field_names(tp)) and part in names:
            out.append(part)
            tp = _field_type(tp, part)
        elif not names and tp is not None and not _is_container(tp) and members is None:
            continue  # a union member's tag
        else:
            out.append(str(part))
            tp = None
        types[len(out)] = tp
    return tuple(out), types


def tagged_members(tp: Any) -> dict[str, type] | None:
    """{tag: dataclass} of a tagged union (`Annotated[A | B, Discriminator(...)]` whose members are
    `Annotated[A, Tag("a")]`), else None."""
    if typing.get_origin(tp) is not typing.Annotated or not any(isinstance(m, pydantic.Discriminator) for m in tp.__metadata__):
        return None
    members = {}
    for member in typing.get_args(tp.__origin__):
        tag = next(m.tag for m in member.__metadata__ if isinstance(m, pydantic.Tag))
        members[tag] = typing.get_args(member)[0]
    return members


def tagged_member_of(tp: Any, value: Any) -> type | None:
    """The member of tagged union `tp` that `value` (a table or an instance) is, or None."""
    members = tagged_members(tp)
    if members is None:
        return None
    discriminator = next(m for m in tp.__metadata__ if isinstance(m, pydantic.Discriminator)).discriminator
    return members.get(discriminator(value)) if callable(discriminator) else None


def _strip_optional(tp: Any) -> Any:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(tp) if a is not type(None)]
        dataclass_members = [a for a in members if dataclasses.is_dataclass(a) or _is_container(a)]
        return dataclass_members[0] if dataclass_members else tp
    return tp


def _is_container(tp: Any) -> bool:
    return typing.get_origin(tp) in (list, tuple, dict)


def _item_type(tp: Any) -> Any:
    tp = _strip_optional(tp)
    args = typing.get_args(tp)
    return args[0] if typing.get_origin(tp) in (list, tuple) and args else None


def _field_type(tp: Any, name: str) -> Any:
    tp = _strip_optional(tp)
    if not dataclasses.is_dataclass(tp):
        return None
    return _strip_optional(typing.get_type_hints(tp, include_extras=True)[_field_name(tp, name)])


def field_names(tp: Any) -> list[str]:
    """The keys a config table of type `tp` accepts (a field's alias where it has one: env.class)."""
    tp = _strip_optional(tp)
    return [_alias(tp, f.name) for f in dataclasses.fields(tp)] if dataclasses.is_dataclass(tp) else []


def _alias(tp: Any, name: str) -> str:
    info = getattr(tp, "__pydantic_fields__", {}).get(name)
    return info.alias if info is not None and info.alias else name


def _field_name(tp: Any, key: str) -> str:
    """The field a config key (or alias) names."""
    for f in dataclasses.fields(tp):
        if _alias(tp, f.name) == key:
            return f.name
    return key


# ---------------------------------------------------------------- relative paths

PATH = "agentrl:path"
"""`Annotated` metadata of a field holding a file or folder path (`FilePath`)."""
PLUGIN = "agentrl:plugin"
"""`Annotated` metadata of a field naming a plug-in, "package.module:name" or "path/file.py:name" (`PluginRef`)."""
FilePath = typing.Annotated[str, PATH]
PluginRef = typing.Annotated[str, PLUGIN]


def absolute_paths(cls: type, data: dict, base: Path) -> dict:
    """`data`, a config table of type `cls` read from a file in folder `base`, with each relative
    path made absolute against `base`: the values of `FilePath` fields (and lists of them), and the
    file part of `PluginRef` fields written as "path/file.py:name". Nested tables and arrays of
    tables are followed; plug-in option tables (plain dicts) are not (their owner knows their
    type). Values of the wrong type are left for validation to report."""
    hints = typing.get_type_hints(cls, include_extras=True)
    out = dict(data)
    for key, value in data.items():
        name = _field_name(cls, key)
        if name not in hints:
            continue
        hint = hints[name]
        kind = _path_kind(hint)
        if kind is not None:
            out[key] = _absolute(value, kind, base)
            continue
        tp = _strip_optional(typing.get_type_hints(cls, include_extras=True)[name])
        if dataclasses.is_dataclass(tp) and isinstance(value, dict):
            out[key] = absolute_paths(tp, value, base)
        elif (inner := _item_type(tp)) is not None and isinstance(value, list):
            out[key] = [absolute_paths(member, v, base) if isinstance(v, dict) and (member := _table_type(inner, v)) else v
                        for v in value]
    return out


def _table_type(tp: Any, value: dict) -> type | None:
    """The dataclass a table `value` of type `tp` is read as (a tagged union's member), or None."""
    if dataclasses.is_dataclass(tp):
        return tp
    return tagged_member_of(tp, value)


def _path_kind(hint: Any) -> str | None:
    """PATH or PLUGIN when `hint` is such a field (optional, or a list of them), else None."""
    if typing.get_origin(hint) is typing.Annotated:
        return next((m for m in hint.__metadata__ if m in (PATH, PLUGIN)), None)
    if typing.get_origin(hint) in (typing.Union, types.UnionType, list):
        return next((k for a in typing.get_args(hint) if (k := _path_kind(a)) is not None), None)
    return None


def _absolute(value: Any, kind: str, base: Path) -> Any:
    if isinstance(value, list):
        return [_absolute(v, kind, base) for v in value]
    if not isinstance(value, str) or not value:
        return value
    if kind == PATH:
        return value if Path(value).is_absolute() else os.path.normpath(base / value)
    module, sep, attr = value.partition(":")
    if sep and module.endswith(".py") and not Path(module).is_absolute():
        return f"{os.path.normpath(base / module)}:{attr}"
    return value


# ---------------------------------------------------------------- describing and writing


def describe(cls: type, prefix: str = "") -> Iterator[str]:
    """`key.path  type = default  description` for every field, nested dataclasses expanded."""
    hints = typing.get_type_hints(cls)
    structure = typing.get_type_hints(cls, include_extras=True)
    infos = getattr(cls, "__pydantic_fields__", {})
    for f in dataclasses.fields(cls):
        path = f"{prefix}{_alias(cls, f.name)}"
        tp = _strip_optional(structure[f.name])
        doc = (infos[f.name].description or "") if f.name in infos else ""
        doc = " ".join(doc.split())
        inner = _item_type(tp) if typing.get_origin(tp) is list else None
        if dataclasses.is_dataclass(tp):
            yield f"[{path}]{'  ' + doc if doc else ''}"
            yield from describe(tp, path + ".")
        elif inner is not None and dataclasses.is_dataclass(inner):
            yield f"[[{path}]]{'  ' + doc if doc else ''}"
            yield from describe(inner, path + "[].")
        elif inner is not None and (members := tagged_members(inner)) is not None:
            yield f"[[{path}]]{'  ' + doc if doc else ''} Each entry is one of:"
            for tag, member in members.items():
                yield f"  [[{path}]] with {tag}: {' '.join((member.__doc__ or '').split())}"
                yield from describe(member, f"{path}[].")
        else:
            default = _default_of(f)
            yield f"  {path}: {_type_name(hints[f.name])}{'' if default is None else ' = ' + default}" + (f"  {doc}" if doc else "")


def _default_of(f: dataclasses.Field) -> str | None:
    if isinstance(f.default, pydantic.fields.FieldInfo):  # a field declared with pydantic.Field (an alias)
        value = f.default.get_default(call_default_factory=True)
    elif f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "(required)"
    if value is None:
        return None
    return json.dumps(to_dict(value)) if not isinstance(value, str) else json.dumps(value)


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is typing.Literal:
        return " | ".join(json.dumps(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "none"
    if typing.get_origin(tp) in (list, tuple):
        return f"{typing.get_origin(tp).__name__}[{', '.join(_type_name(a) for a in typing.get_args(tp) if a is not Ellipsis)}]"
    return getattr(tp, "__name__", str(tp))


def to_dict(obj: Any) -> Any:
    """A config as plain data (dataclasses -> dicts under their config keys, tuples -> lists), ready
    for TOML or JSON."""
    if hasattr(obj, "__pydantic_fields__") and not isinstance(obj, type):
        obj = pydantic.TypeAdapter(type(obj)).dump_python(obj, by_alias=True)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        obj = dataclasses.asdict(obj)
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [to_dict(v) for v in obj]
    return obj


def dump_toml(data: dict) -> str:
    """TOML text for a dict of scalars, lists, and nested dicts (tables). None values are omitted."""
    lines: list[str] = []
    _dump_table(data, [], lines)
    return "\n".join(lines).lstrip("\n") + "\n"


_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def _key(key: str) -> str:
    return key if _BARE_KEY.match(key) else json.dumps(key)


def _scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_scalar(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_key(k)} = {_scalar(v)}" for k, v in value.items() if v is not None) + "}"
    raise TypeError(f"cannot write {type(value).__name__} to TOML: {value!r}")


def _dump_table(data: dict, path: list[str], lines: list[str]) -> None:
    tables = []
    for key, value in data.items():
        if value is None:
            continue
        if isinstance(value, dict):
            tables.append((key, value))
        else:
            lines.append(f"{_key(key)} = {_scalar(value)}")
    for key, value in tables:
        lines.append("")
        lines.append("[" + ".".join(_key(p) for p in [*path, key]) + "]")
        _dump_table(value, [*path, key], lines)


def deep_merge(base: dict, override: dict) -> dict:
    """`base` with `override` applied table by table (nested dicts merge, other values replace)."""
    return layer(base, override)
