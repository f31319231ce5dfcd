"""The config of a run (`agentrl train`, `eval`, `rollout`): one typed tree, resolved and checked before anything starts.

Resolution, in order (later layers win, table by table; lists replace whole):
1. the embedded default, `agentrl/configs/cpu_default.toml`;
2. `--config FILE` (a partial file changes only the keys it names; a file that switches
   `tasks.loader` brings its own `[tasks.options]` instead of merging with the default's);
3. each `--set KEY.PATH=VALUE`, in order (VALUE is read as a TOML value: 3, 2e-5, true,
   ["search"], "text"; anything else is taken as a string).

The result is validated strictly as `TrainConfig` (types, ranges, unknown keys, choices), then
across components (`check_run`): the sampling temperature is the learner's behaviour temperature,
episodes fit the server's context, the tools the tasks need are started, a packed row holds the
longest episode, supervisor-owned learner keys are not set by hand, the task loader imports and
its options validate. Every error names the layer that set the key (file, `--set`, or the
embedded default), the key path and what is accepted; the CLIs exit 2 on any of them, before any
process starts.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from agentrl.common.config import (
    ConfigError,
    FilePath,
    Origins,
    absolute_paths,
    build,
    config_dataclass,
    describe,
    layer,
    parse_override,
    read_toml,
    set_path,
    to_dict,
)
from agentrl.engine.agent import AgentConfig, check_agent
from agentrl.engine.env import EnvConfig
from agentrl.engine.environments import env_class, env_options
from agentrl.engine.orchestrator import OrchestratorConfig
from agentrl.engine.services import ServicesConfig, ToolSource, builtin_tools, check_tool_sources
from agentrl.engine.tasksets import TasksConfig, loader_options, resolve_loader
from agentrl.launch.plan import ClusterConfig
from agentrl.learner.config import LearnerConfig

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "cpu_default.toml"

SUPERVISOR_LEARNER_KEYS = ("output_dir", "mode", "model_dir", "server_urls", "transport.group_endpoint",
                           "transport.version_endpoint", "init_checkpoint", "seed", "progress_bar", "anchor_dir")
"""LearnerConfig keys (dotted paths) `agentrl train` fills in per phase; a config that sets them is refused."""
CURVE_LEARNER_KEYS = ("transport.curve_secret_key_file", "transport.curve_authorized_clients_dir")
"""LearnerConfig keys a run takes from [learner.transport] only (agentrl/credentials.py `RunCredentials.learner`)."""


@config_dataclass
class SFTConfig:
    enabled: bool = True
    """Run the cold start: on `demonstrations` when given, else on the environment's own
    demonstrations of training tasks; skipped, with a log line, when there are neither."""
    demonstrations: FilePath = ""
    """JSONL of demonstrations, one per line: {"task": {task}, "messages": [chat messages]}; the
    assistant messages (tool calls in the environment's format, or OpenAI `tool_calls`) are
    replayed through the environment and its real tools (engine/demonstrations.py)."""
    num_examples: int = 256
    """Demonstrations built from training tasks (cycled until `steps` are done)."""
    steps: int = 12
    """Optimizer steps of the cold start."""
    max_minutes: float = 0.0
    """Stop the cold start after this many minutes even if `steps` are not done (0: no limit), so
    that a slower machine keeps the run inside `minutes`; the learner checkpoints and pushes the
    step it reached. The cold start also stops when only the final evaluation's reserve is left of
    the budget. The steps done are in phases.json (`sft.steps_done`)."""
    learner: dict[str, Any] = field(default_factory=dict)
    """LearnerConfig keys for the SFT learner, layered over [learner] (e.g. a higher lr)."""

    def __post_init__(self) -> None:
        if self.steps < 1 or self.num_examples < 1:
            raise ValueError("sft.steps and sft.num_examples must be >= 1 (set sft.enabled = false to skip SFT)")
        if not self.max_minutes >= 0:
            raise ValueError(f"sft.max_minutes must be >= 0 (0: no limit), got {self.max_minutes}")


@config_dataclass
class EvalConfig:
    every_s: float = 300.0
    """Held-out evaluation interval during RL, seconds of wall-clock."""
    baselines: bool = True
    """Also evaluate the environment's baselines once, before training (QA: Naive RAG)."""
    baseline_questions: int = 0
    """Evaluate the untrained policy (Base Tool Call) and the baselines on this many held-out tasks,
    evenly spaced through the held-out set (0: all of them). The untrained policy's episodes run to
    max_turns and cost more than a trained one's: on a slow machine a subset keeps the evaluations
    within their share of the budget. The SFT and final evaluations always use the whole set (they
    are compared question by question); the report gives each row's n."""
    without_tools: bool = False
    """After the final evaluation, evaluate the final policy once more with every tool disabled (same
    prompt, each call fails): a score near Base Tool Call's says the tasks are not learnable without
    the tools. A diagnostic after the budget: not counted in `minutes` nor in minutes_after_setup, so
    opt-in (it costs about one held-out evaluation). Native episodes only (an `[agent]` program
    brings its own tool calls)."""
    transfer: bool = False
    """After the final evaluation, evaluate the final policy on the task set's transfer tasks (harder
    than any trained on; synthetic QA: `transfer_hops`, 3-hop), when it has them. A figure, no
    target; after the budget and opt-in like `without_tools`. Native episodes only."""
    max_share: float = 0.2
    """Evaluations during RL (every `every_s`) run only while the run's held-out evaluations so far,
    this one and the final one stay within this share of `minutes`: on a slow machine the baseline,
    SFT and final evaluations alone can take it, and RL keeps its time. 0: none during RL."""
    cache_baselines: bool = True
    """Reuse the untrained policy's evaluations (Base Tool Call and the environment's baselines) from
    an earlier run when everything that determines them is the same: the model folder's files, the
    served dtype, the vLLM and agentrl code, the environment's config and rendered prompt, the held-out
    tasks and the decoding (agentrl/evalcache.py). Never with an `[agent]`."""
    cache_dir: FilePath = ""
    """Where cached evaluations are kept; empty: $AGENTRL_CACHE_DIR, else ~/.cache/agentrl."""
    in_budget: bool = True
    """Count the held-out evaluations against `minutes`. False: `minutes` is SFT + RL time only
    (the evaluations before, between and after extend the run): benchmarks/vs_trl.py compares
    training time with a trainer that evaluates outside its budget."""

    def __post_init__(self) -> None:
        if not 0 <= self.max_share <= 1:
            raise ValueError(f"eval.max_share={self.max_share} must be in [0, 1]")
        if self.baseline_questions < 0:
            raise ValueError(f"eval.baseline_questions={self.baseline_questions} must be >= 0 (0: every held-out task)")


@config_dataclass
class RLConfig:
    stop_when_no_signal: bool = True
    """End the RL phase early when the groups carry no learning signal: of the last `no_signal_groups`
    groups the actor finished, at least `no_signal_share` had the same rewards in every sample
    (dynamic sampling drops such groups: a task the policy solves every time, or one no sample solves
    while no shaping term varies). The final evaluation follows; the JSON line's `rl_stopped_reason`
    is "no_signal" and the log says what was seen. The policy is then as good as this RL can make it
    on these tasks: a solved task would otherwise spend the rest of the budget sampling groups it drops."""
    no_signal_groups: int = 48
    """Groups the rule looks back over (also the window of the status line's signal count)."""
    no_signal_share: float = 0.95
    """Share of those groups with equal rewards at which RL stops."""

    def __post_init__(self) -> None:
        if self.no_signal_groups < 1 or not 0.0 < self.no_signal_share <= 1.0:
            raise ValueError(f"rl: no_signal_groups={self.no_signal_groups} must be >= 1 and no_signal_share="
                             f"{self.no_signal_share} in (0, 1]")


@config_dataclass
class NetworkConfig:
    host: str = "127.0.0.1"
    """The address this run's learners, vLLM server and the tool services it starts bind. Loopback
    (the default) keeps them on this host. Any other address (one other hosts reach) makes the run
    provision their credentials under RUN_DIR, each secret 0600, kept across --resume: CurveZMQ keys
    for the learners' sockets (RUN_DIR/curve/, unless [learner.transport] names its own) and for the tool
    services (the built-in ones and `[[tools]] command` services, whose "{bind}" is then on this
    address), and a control token for the server's weight endpoints (RUN_DIR/control_token, unless
    AGENTRL_CONTROL_TOKEN is set); the processes get them from files and the environment, never on
    a command line."""

    def __post_init__(self) -> None:
        import ipaddress

        try:
            ipaddress.IPv4Address(self.host)
        except ValueError:
            raise ValueError(f"host: {self.host!r} is not an IPv4 address (the address to bind, e.g. 10.0.0.5)") from None


@config_dataclass
class LoggingConfig:
    status_every_s: float = 30.0
    """Seconds between status lines on the terminal (phase, step, episodes, reward, ETA)."""
    progress_bar: Literal["auto", "on", "off"] = "auto"
    """A progress bar over the time budget: "auto" = when stdout is a terminal."""
    tensorboard: bool = True
    """Held-out scores and actor statistics in RUN_DIR/tensorboard (the learners write their own)."""
    wandb: bool = False
    """Also log to Weights & Biases (needs the `wandb` package)."""
    wandb_project: str = "agentrl"
    """W&B project name."""
    wandb_mode: Literal["offline", "online"] = "offline"
    """"offline" writes RUN_DIR/wandb and needs no network (`wandb sync` uploads it later)."""


@config_dataclass
class TrainConfig:
    minutes: float = 28.0
    """Wall-clock budget of everything after set-up (baseline evaluations, SFT, RL, every evaluation
    including the final one), minutes. The RL phase ends when what is left is the time the final
    evaluation is expected to take."""
    rl_min_share: float = 0.4
    """The share of `minutes` kept for the RL phase: the SFT cold start stops early enough to leave
    it (after the SFT and final evaluations' expected time). When what is left for RL is less anyway
    (the evaluations take it on a slow machine), the run says so before RL starts, with the
    `--minutes` that would give RL this share; a run that ends without an RL step says so in its
    report and JSON line (`rl_steps` 0)."""
    seed: int = 0
    """Seed of the learners (the task set has its own in [tasks.options])."""
    model_dir: FilePath = ""
    """HF folder of the initial policy; empty: the prepared SmolLM2-135M-Instruct."""
    tasks: TasksConfig = field(default_factory=TasksConfig)
    services: ServicesConfig = field(default_factory=ServicesConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    orchestrator: OrchestratorConfig = field(default_factory=OrchestratorConfig)
    """The actor's orchestrator; [orchestrator.sampling] samples the training episodes (evaluation is greedy)."""
    sft: SFTConfig = field(default_factory=SFTConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    """[rl]: when the RL phase ends before its time (the learner's own keys are in [learner])."""
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    """The RL learner; the supervisor fills in its output_dir, endpoints and servers."""
    tools: list[ToolSource] = field(default_factory=list)
    """Tools added to those the environment requires (engine/services.py)."""
    agent: AgentConfig = field(default_factory=AgentConfig)
    """[agent]: train an agent program (an `entry` function or a `command`) through the gateway
    instead of the native episode loop (engine/agent.py); empty: native episodes."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    network: NetworkConfig = field(default_factory=NetworkConfig)
    """[network]: where the run's endpoints bind, and the credentials it provisions off loopback."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """[cluster]: where the run's processes go: this host (default) or the nodes of a Ray cluster."""

    def __post_init__(self) -> None:
        if not self.minutes > 0:
            raise ValueError(f"minutes={self.minutes} must be > 0")
        if not 0 <= self.rl_min_share < 1:
            raise ValueError(f"rl_min_share={self.rl_min_share} must be in [0, 1)")
        if self.env.worked_example == "auto":  # rewards alone: the untrained model calls tools only after one
            self.env.worked_example = not self.sft.enabled


@dataclass
class Resolved:
    """A resolved run config with the layers that made it."""

    config: TrainConfig
    data: dict[str, Any]
    """The merged TOML data (what `--print-config` prints)."""
    origins: dict[tuple[str, ...], str]
    """Key path -> the layer that set it."""


def load_run_config(config_file: str | Path | None = None, sets: list | tuple = (), *,
                    base: Path | None = DEFAULT_CONFIG) -> Resolved:
    """Resolve and check (module docstring); raises ConfigError."""
    origins: Origins = {}
    data: dict[str, Any] = {}
    if base is not None:
        data = layer({}, read_toml(base), origins=origins, source=f"the embedded default ({base.name})")
    if config_file is not None:
        override = with_absolute_paths(read_toml(config_file), Path(config_file).absolute().parent, data)
        data = _switching_layer(data, override, origins, str(config_file))
    for item in sets:
        text, label = item if isinstance(item, tuple) else (item, f"--set {item}")
        path, value = parse_override(text)
        resolved = with_absolute_paths(set_path({}, path, value), Path.cwd(), data)  # relative: to the working directory
        value = _get_path(resolved, path)
        if path == ("agent", "command"):  # runs where the command line was given, whatever a file said
            data = set_path(data, ("agent", "cwd"), resolved["agent"].get("cwd"))
        if path in _SWITCHES and value != data.get(path[0], {}).get(path[1], _SWITCHES[path]):
            data = _drop_options(data, origins, path[0])
        data = set_path(data, path, value)
        for key in [k for k in origins if k[:len(path)] == path]:
            del origins[key]
        origins[path] = label
    source = str(config_file) if config_file is not None else "config"
    config = build(TrainConfig, data, origins=origins, default_source=source)
    check_run(config, data, origins, source)
    return Resolved(config=config, data=data, origins=origins)


def _get_path(data: dict, path: tuple[str, ...]) -> Any:
    for key in path:
        data = data[key]
    return data


def with_absolute_paths(override: dict, base: Path, below: dict) -> dict:
    """A config file's data with its relative paths taken from the file's folder `base`: path keys
    and plug-in files (`absolute_paths`), the path options of the task loader and environment the
    merged config names (`below`: the layers under this file), and, for a tool or agent command
    without its own `cwd`, `cwd` = `base`. (`--set` values go through it with the working directory.)
    A resolved config thus holds absolute paths, and a run's config.toml resumes from anywhere."""
    base = Path(os.path.normpath(base))
    out = absolute_paths(TrainConfig, override, base)
    sft = out.get("sft")
    if isinstance(sft, dict) and isinstance(sft.get("learner"), dict):  # a plain table, layered over [learner]
        out["sft"] = {**sft, "learner": absolute_paths(LearnerConfig, sft["learner"], base)}
    for entry in out.get("tools", []) if isinstance(out.get("tools"), list) else []:
        if isinstance(entry, dict) and (entry.get("command") or entry.get("mcp")) and "cwd" not in entry:
            entry["cwd"] = str(base)
    agent = out.get("agent")
    if isinstance(agent, dict) and agent.get("command") and "cwd" not in agent:
        agent["cwd"] = str(base)
    owners = {"tasks": resolve_loader, "env": lambda name: env_class(EnvConfig(env_class=name))}
    for (section, key), default in _SWITCHES.items():
        table = out.get(section)
        if not isinstance(table, dict) or not isinstance(table.get("options"), dict):
            continue
        name = table.get(key, below.get(section, {}).get(key, default))
        try:
            options_type = getattr(owners[section](name), "Options", None)
        except (ConfigError, ValueError):  # a plug-in that does not resolve: check_run names it
            continue
        if options_type is not None and dataclasses.is_dataclass(options_type):
            out[section] = {**table, "options": absolute_paths(options_type, table["options"], base)}
    return out


# A layer that names another task loader or environment class replaces that plug-in's options
# whole: the earlier options belong to the plug-in it replaces.
# (The value an absent key takes is the config class's default.)
_SWITCHES = {("tasks", "loader"): TasksConfig().loader, ("env", "class"): EnvConfig().env_class}


def _switching_layer(data: dict, override: dict, origins: Origins, source: str) -> dict:
    """`layer`, except that a layer naming another task loader or environment class replaces
    `[tasks.options]` or `[env.options]` whole."""
    for (section, key), default in _SWITCHES.items():
        new = override.get(section, {}).get(key)
        if new is not None and new != data.get(section, {}).get(key, default):
            data = _drop_options(data, origins, section)
    return layer(data, override, origins=origins, source=source)


def _drop_options(data: dict, origins: Origins, section: str) -> dict:
    data = copy.deepcopy(data)
    data.get(section, {}).pop("options", None)
    for key in [k for k in origins if k[:2] == (section, "options")]:
        del origins[key]
    return data


def check_run(config: TrainConfig, data: dict, origins: Origins, source: str = "config") -> None:
    """The rules across components (module docstring); ConfigError with every violation."""
    problems: list[str] = []

    def at(*key: str) -> str:
        for n in range(len(key), -1, -1):
            if key[:n] in origins:
                return f"{origins[key[:n]]}: {'.'.join(key)}"
        return f"{source}: {'.'.join(key)}"

    for section in ("learner", "sft.learner"):
        given = data.get("learner", {}) if section == "learner" else data.get("sft", {}).get("learner", {})
        for key in SUPERVISOR_LEARNER_KEYS:
            if _has(given, key):
                problems.append(f"{at(*section.split('.'), *key.split('.'))}: set by agentrl train for each phase; remove it")
    for key in CURVE_LEARNER_KEYS:
        if _has(data.get("sft", {}).get("learner", {}), key):
            problems.append(f"{at('sft', 'learner', *key.split('.'))}: set it in [learner.transport]: the SFT and RL "
                            "learners share their CurveZMQ keys, and the run hands its clients the matching ones")
    try:  # the SFT learner: [sft.learner] layered over [learner], as the supervisor derives it
        build(LearnerConfig, layer(_without(data.get("learner", {})), _without(sft_learner_overrides(config.sft))),
              origins=origins, default_source=source, prefix=("sft", "learner"))
    except ConfigError as err:
        problems.append(str(err))
    sampling = config.orchestrator.sampling
    if sampling.temperature > 0 and sampling.temperature != config.learner.trainer.temperature:
        problems.append(f"{at('orchestrator', 'sampling', 'temperature')} = {sampling.temperature} differs from "
                        f"{at('learner', 'trainer', 'temperature')} = {config.learner.trainer.temperature}, the "
                        "temperature the learner recomputes the behaviour log-probs at; set both to the same value")
    if not config.services.vllm and config.env.max_total_tokens > config.services.vllm_server.max_model_len:
        problems.append(f"{at('env', 'max_total_tokens')}: {config.env.max_total_tokens} is longer than the "
                        f"server's services.vllm_server.max_model_len = {config.services.vllm_server.max_model_len}; "
                        "lower it or raise max_model_len")
    serving, lora = config.services.vllm_server, config.learner.trainer.lora
    if serving.lora == "vllm" and not lora.enabled:
        problems.append(f"{at('services', 'vllm_server', 'lora')} = \"vllm\" serves the policy as a LoRA adapter, and "
                        "LoRA is off: turn it on (learner.trainer.lora.rank > 0) or leave it \"merge\"")
    elif serving.lora == "vllm":
        from agentrl.common.adapters import VLLM_MAX_LORA_RANKS

        largest = serving.max_lora_rank or VLLM_MAX_LORA_RANKS[-1]
        if lora.rank > largest:
            problems.append(f"{at('learner', 'trainer', 'lora', 'rank')} = {lora.rank} is above the server's max LoRA rank "
                            f"{largest} ({at('services', 'vllm_server', 'max_lora_rank')}): it would refuse every push; "
                            f"lower the rank, or raise max_lora_rank to one of {[r for r in VLLM_MAX_LORA_RANKS if r >= lora.rank]}")
    if config.cluster.learner.ranks > 1 and config.learner.anchor.coef > 0 and config.sft.enabled:
        problems.append(f"{at('cluster', 'learner', 'ranks')} = {config.cluster.learner.ranks} runs the learner under "
                        f"torchrun, and {at('learner', 'anchor', 'coef')} = {config.learner.anchor.coef} trains in one "
                        "learner process only (the ranks do not share the anchor's demonstrations yet): set "
                        "learner.anchor.coef = 0, or ranks = 1")
    if config.learner.trainer.max_row_tokens < config.env.max_total_tokens:
        problems.append(f"{at('learner', 'trainer', 'max_row_tokens')}: {config.learner.trainer.max_row_tokens} cannot "
                        f"hold the longest episode (env.max_total_tokens = {config.env.max_total_tokens}); raise it")
    # The plug-ins import and their options validate (a ConfigError from `build` names its source
    # already; one that starts with a key path gets the source of that key).
    checks = [(("tasks", "loader"), lambda: loader_options(config.tasks, origins=origins, source=source)),
              (("env", "class"), lambda: env_options(config.env, origins=origins, source=source)),
              (("env", "class"), lambda: builtin_tools(env_class(config.env).required_tools, config.services, config.tools)),
              (("tools",), lambda: check_tool_sources(config.tools)),
              (("agent",), lambda: check_agent(config.agent))]
    for key, check in checks:
        try:
            check()
        except ConfigError as err:
            text = str(err)
            problems.append(f"{at(*key).rsplit(': ', 1)[0]}: {text}" if text.startswith(("tasks.", "env.", "tools", "agent.")) else text)
    if config.sft.demonstrations and not Path(config.sft.demonstrations).is_file():
        problems.append(f"{at('sft', 'demonstrations')}: no such file {config.sft.demonstrations}")
    if problems:
        raise ConfigError("\n".join(dict.fromkeys(problems)))  # once each: two checks may trip on one cause


def sft_learner_overrides(sft) -> dict:
    """What the SFT phase's learner changes on `[learner]`: `[sft.learner]`, the step count, and,
    unless `[sft.learner]` names them, temperature 1.0, no KL reference and no demonstration anchor
    (the SFT loss is the demonstrations' likelihood already). The first two are RL's:
    `learner.trainer.temperature` is the sampling temperature the behaviour log-probs were computed
    at (demonstrations have none; training their likelihood at 0.7 instead of 1.0 cost the default's
    SFT checkpoint 0.677 -> 0.469 held-out EM, every 2-hop question answered after one search;
    docs/notes/recipe.md, run Q), and the SFT loss has no KL term, so a reference copy would only
    cost memory and loading time."""
    rl_only = {"kl_reference": False, "anchor": {"coef": 0.0}, "trainer": {"temperature": 1.0, "loss": {"kl_coef": 0.0}}}
    return layer(layer(rl_only, sft.learner),
                 {"max_steps": sft.steps, "publish": {"every": sft.steps}, "checkpoint": {"every": sft.steps}})


def config_data(config: TrainConfig) -> dict[str, Any]:
    """A resolved config as TOML data that resolves back to the same config: everything, except the
    learner keys the supervisor fills in per phase (which a config may not set)."""
    data = to_dict(config)
    data["learner"] = _without(data["learner"])
    return data


def _parent(data: dict, dotted: str) -> tuple[dict | None, str]:
    """The table of `data` that holds the dotted key `a.b.c` (None where a table on the way is
    missing) and the key's last part."""
    *tables, key = dotted.split(".")
    for name in tables:
        data = data.get(name) if isinstance(data, dict) else None
    return (data if isinstance(data, dict) else None), key


def _has(data: dict, dotted: str) -> bool:
    table, key = _parent(data, dotted)
    return table is not None and key in table


def _without(learner_data: dict) -> dict:
    """`learner_data` without the keys the supervisor fills in (SUPERVISOR_LEARNER_KEYS)."""
    data = copy.deepcopy(learner_data)
    for dotted in SUPERVISOR_LEARNER_KEYS:
        table, key = _parent(data, dotted)
        if table is not None:
            table.pop(key, None)
    return data


def schema_text() -> str:
    """Every key of the run config with its type, default and description (for `--help`)."""
    return ("(defaults shown are the code's; the embedded default sets some differently: see --print-config)\n"
            + "\n".join(describe(TrainConfig)))


def check_model_fit(config: TrainConfig) -> None:
    """What the config asks of the model folder: LoRA's target modules and layers (ConfigError)."""
    from agentrl.common.model import resolve_model
    from agentrl.learner.lora import check_lora_targets

    trainer = config.learner.trainer
    if trainer.lora.enabled:
        try:
            check_lora_targets(resolve_model(config.model_dir or None), trainer.lora, trainer.train_layers, key="learner.trainer")
        except ValueError as err:
            raise ConfigError(str(err)) from None
