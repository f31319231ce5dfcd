"""`[agent]`: an agent program from outside, trained through the gateway instead of the native episode loop.

Two ways to name it (exactly one):

    [agent]
    entry = "package.module:run"        # or "path/to/file.py:run" (resolved like engine/plugins.py)
    # command = ["python", "my_agent.py"]

- `entry`: `async def run(task: dict, client) -> float | None`, called on the actor's event loop
  with an `openai.AsyncOpenAI` whose base URL is the episode's own gateway session
  (`http://127.0.0.1:PORT/s/SESSION/v1`; nothing else to set).
- `command`: one subprocess per episode (a first element "python" is this interpreter), with
  `OPENAI_BASE_URL` (the session's base URL), `OPENAI_API_KEY` and `AGENTRL_SESSION` set and the
  task as one JSON object on stdin; it prints its reward as JSON (a number or `null`) on the last
  line of stdout and exits 0.

What the agent gets (the same for both): the task as `Task.to_json()` (id, prompt or messages,
reference, metadata; the reference is there for an agent that scores itself, and is not for the
model's eyes) plus `"tools"`, the environment's tools as OpenAI function schemas. The agent
offers them to the model with function calling and runs the calls it gets back itself, through the
gateway: `POST {base_url}/agentrl/tools/{name}` with the arguments object as the body answers
`{"content": str, "success": bool, "error": str | null}` (with the openai client:
`await client.post("/agentrl/tools/search", body=args, cast_to=dict)`). The call runs the run's
own tool (schema-checked, with the environment's timeout) and is recorded for the environment's
reward.

Reward: the agent's return value when it is a number; when it is None, the environment's
`reward(task, episode)` scores the recorded episode (gateway/agents.py says exactly what it sees).

The runner lives in `agentrl.gateway.agents` (it owns a Gateway); this module is the config and the
check that runs before anything starts.
"""

from __future__ import annotations

import inspect

from agentrl.common.config import ConfigError, FilePath, PluginRef, config_dataclass


@config_dataclass
class AgentConfig:
    entry: PluginRef | None = None
    """An async function `run(task, client) -> reward | None`, "package.module:run" or
    "path/file.py:run"; exclusive with `command`."""
    command: list[str] | None = None
    """An agent program run once per episode (argv; a first element "python" is this interpreter);
    exclusive with `entry`."""
    cwd: FilePath | None = None
    """The folder a `command` runs in. Not given: the folder of the config file that names the
    command, else the working directory."""
    timeout_s: float = 600.0
    """Longest an episode may run, seconds; past it the agent is cancelled (a command's process
    group killed) and the episode is failed."""
    stderr_tail_chars: int = 2000
    """How much of a failed command's stderr the failed episode records, characters (the end)."""

    def __post_init__(self) -> None:
        if self.entry is not None and self.command is not None:
            raise ValueError("entry: agent.entry and agent.command are exclusive; name the agent one way")
        if self.command is not None and not self.command:
            raise ValueError("command: agent.command is empty")
        if not self.timeout_s > 0 or self.stderr_tail_chars < 0:
            raise ValueError("timeout_s: must be > 0 (and stderr_tail_chars >= 0)")

    @property
    def enabled(self) -> bool:
        return self.entry is not None or self.command is not None


def agent_entry(config: AgentConfig):
    """The entry function `agent.entry` names; ConfigError naming `agent.entry` unless it is an
    async function of two parameters (task, client)."""
    from agentrl.engine.plugins import resolve

    fn = resolve(config.entry, "agent.entry")
    if not inspect.iscoroutinefunction(fn):
        raise ConfigError(f"agent.entry: {config.entry!r} must be an async function `async def run(task, client)`, "
                          f"got {type(fn).__name__}")
    params = list(inspect.signature(fn).parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required_other = [p for p in params if p not in positional and p.default is p.empty
                      and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if len(positional) != 2 or required_other:
        raise ConfigError(f"agent.entry: {config.entry!r} must take exactly two parameters (task, client); "
                          f"it takes ({', '.join(p.name for p in params)})")
    return fn


def check_agent(config: AgentConfig) -> None:
    """What can be checked before anything starts: the entry imports and has the right shape, the
    command's program exists."""
    if config.entry is not None:
        agent_entry(config)
    if config.command is not None:
        from agentrl.engine.services import check_command

        check_command(config.command, "agent.command", config.cwd)
