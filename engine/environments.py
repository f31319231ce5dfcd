"""The environment a config names (`[env] class`, `[env.options]`), built for a run.

Built-in names: "multihop_qa" (agentrl/envs/multihop_qa, imported when named). Anything else is "package.module:Class", a subclass
of `ToolEnv`. `env_class` and `env_options` run at config-check time (a bad class or option stops
the run before any server starts); `make_env` builds the instance each process runs on.
"""

from __future__ import annotations

from typing import Any

from agentrl.common.config import ConfigError, Origins
from agentrl.engine.chat import ChatFormat
from agentrl.engine.env import EnvConfig, ToolEnv
from agentrl.engine.plugins import build_options, resolve

ENVIRONMENTS: dict[str, type[ToolEnv] | str] = {"multihop_qa": "agentrl.envs.multihop_qa.env:MultiHopQAEnv"}


def env_class(config: EnvConfig) -> type[ToolEnv]:
    cls = resolve(config.env_class, "env.class", ENVIRONMENTS)
    if not (isinstance(cls, type) and issubclass(cls, ToolEnv)):
        raise ConfigError(f"env.class: {config.env_class!r} is not a ToolEnv subclass (got {cls!r})")
    return cls


def env_options(config: EnvConfig, *, origins: Origins | None = None, source: str = "config") -> Any:
    cls = env_class(config)
    return build_options(cls, config.options, "env.options", origins=origins, source=source)


def make_env(chat: ChatFormat, config: EnvConfig) -> ToolEnv:
    return env_class(config)(chat, config, env_options(config))
