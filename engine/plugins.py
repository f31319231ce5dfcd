"""Plug-ins named in a config: environments, task loaders and function tools as "package.module:name".

`resolve(path, key, builtins)` imports what a config names (or takes a built-in by name) and turns
every way that can fail into a ConfigError naming the config key, so a bad name stops the run at
start, before any server. The module may also be a file, "path/to/module.py:name" (relative to the
working directory): it is imported once under a name derived from its absolute path, so a file
that holds an environment and its task loader is one module, and every process of a run (they
share the working directory) imports the same file. Its folder is added to the end of `sys.path`
first, so the file imports the modules beside it (`from units import convert` in `my_env/env.py`
imports `my_env/units.py`) as a script run with `python` would; a sibling whose name an installed
package already has loses to that package (rename the sibling). `build_options(owner, data, key)` validates a plug-in's options table
against the dataclass the plug-in declares as its `Options` attribute.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from agentrl.common.config import ConfigError, Origins, build


def resolve(path: str, key: str, builtins: Mapping[str, Any] | None = None) -> Any:
    """The object `path` names: a key of `builtins` (whose value is the object, or the
    "package.module:attribute" it is imported from), or "package.module:attribute"."""
    builtins = builtins or {}
    if path in builtins:
        if not isinstance(builtins[path], str):
            return builtins[path]
        path = builtins[path]
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        known = f"neither a built-in ({', '.join(builtins)}) nor" if builtins else "not"
        raise ConfigError(f"{key}: {path!r} is {known} a 'package.module:name' path")
    try:
        module = _import_file(module_name, key) if module_name.endswith(".py") else importlib.import_module(module_name)
    except ConfigError:
        raise
    except ImportError as err:
        hint = ""
        if not module_name.endswith(".py") and Path(module_name.replace(".", "/") + ".py").is_file():
            hint = f"; to load the file {module_name.replace('.', '/')}.py, write {module_name.replace('.', '/')}.py:{attr}"
        elif not module_name.endswith(".py"):
            hint = " (a module on the Python path, \"package.module:name\"; a file is \"path/to/file.py:name\")"
        raise ConfigError(f"{key}: cannot import {module_name!r}: {err}{hint}") from None
    except Exception as err:  # noqa: BLE001 - a user module that raises on import is reported, with its error
        raise ConfigError(f"{key}: importing {module_name!r} raised {type(err).__name__}: {err}") from None
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = sorted(n for n, v in vars(obj).items() if not n.startswith("_") and isinstance(v, type)
                           and getattr(v, "__module__", None) == getattr(module, "__name__", None))
            has = f"; it defines the classes {', '.join(names)}" if names else ""
            raise ConfigError(f"{key}: {module_name!r} has no {attr!r}{has}")
        obj = getattr(obj, part)
    return obj


def _import_file(path: str, key: str):
    file = Path(path).resolve()
    if not file.is_file():
        where = "" if Path(path).is_absolute() else f" (relative paths are taken from {Path.cwd()})"
        raise ConfigError(f"{key}: no such file {path!r}{where}")
    name = "agentrl_plugin_" + hashlib.sha1(str(file).encode()).hexdigest()[:12] + "_" + file.stem
    if name in sys.modules:
        return sys.modules[name]
    if str(file.parent) not in sys.path:  # its sibling modules (module docstring)
        sys.path.append(str(file.parent))
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def build_options(owner: Any, data: dict, key: str, *, origins: Origins | None = None, source: str = "config") -> Any:
    """`owner.Options` built from `data` (strict, like every config); a plug-in without an
    `Options` dataclass takes no options."""
    options_type = getattr(owner, "Options", None)
    if options_type is None:
        if data:
            raise ConfigError(f"{source}: {key}: {getattr(owner, '__name__', owner)!r} takes no options, got {sorted(data)}")
        return None
    return build(options_type, data, origins=origins, default_source=source, prefix=tuple(key.split(".")))
