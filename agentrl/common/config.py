"""Typed configs from TOML: dataclasses built from tables, unknown keys refused with the known ones.

Also a small TOML writer, so a supervisor can hand each process the resolved config it runs with
(the standard library reads TOML but does not write it), and the reader of the JSONL records a run
writes (evaluations, metrics).
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from pathlib import Path
from typing import Any


def from_dict(cls: type, data: Any, where: str) -> Any:
    """Build dataclass `cls` from a dict; nested dataclass fields from nested dicts (also lists of them)."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a table, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; accepted: {sorted(names)}")
    kwargs = {}
    for key, value in data.items():
        kwargs[key] = _convert(hints[key], value, f"{where}.{key}")
    try:
        return cls(**kwargs)
    except TypeError as err:
        raise ValueError(f"{where}: {err}") from None


def _convert(hint: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(hint)
    options = typing.get_args(hint) if origin in (typing.Union, types.UnionType) else (hint,)
    for option in options:
        if dataclasses.is_dataclass(option) and isinstance(value, dict):
            return from_dict(option, value, where)
        if typing.get_origin(option) is list and isinstance(value, list):
            (item,) = typing.get_args(option) or (Any,)
            if dataclasses.is_dataclass(item):
                return [from_dict(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
            return list(value)
    return value


def to_dict(obj: Any) -> Any:
    return dataclasses.asdict(obj) if dataclasses.is_dataclass(obj) else obj


def dump_toml(data: dict) -> str:
    """TOML text for a dict of scalars, lists, and nested dicts (tables). None values are omitted."""
    lines: list[str] = []
    _dump_table(data, [], lines)
    return "\n".join(lines) + "\n"


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
        return "{" + ", ".join(f"{json.dumps(k)} = {_scalar(v)}" for k, v in value.items() if v is not None) + "}"
    raise TypeError(f"cannot write {type(value).__name__} to TOML: {value!r}")


def _dump_table(data: dict, path: list[str], lines: list[str]) -> None:
    tables = []
    for key, value in data.items():
        if value is None:
            continue
        if isinstance(value, dict):
            tables.append((key, value))
        else:
            lines.append(f"{json.dumps(key)} = {_scalar(value)}")
    for key, value in tables:
        lines.append("")
        lines.append("[" + ".".join(json.dumps(p) for p in [*path, key]) + "]")
        _dump_table(value, [*path, key], lines)


def deep_merge(base: dict, override: dict) -> dict:
    """`base` with `override` applied table by table (nested dicts merge, other values replace)."""
    out = dict(base)
    for key, value in override.items():
        out[key] = deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def read_jsonl(path: Path) -> list[dict]:
    """The records of a JSONL file, oldest first ([] when it does not exist; blank lines skipped). A
    line that is not JSON (a run killed mid-write, a hand edit) is named by path and line number."""
    if not path.exists():
        return []
    records = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{number}: not a JSON record ({err}); remove or repair the line") from err
    return records
