"""`agentrl check --config F [--set K=V ...]`: what `agentrl train` checks before it starts vLLM, and
more, in seconds.

1. the config resolves (every key, plug-in and option; `agentrl train`'s own checks);
2. the task set loads: every task line is read and checked (a bad line is named file:line);
3. the model folder's tokenizer loads, and every held-out task renders to a prompt that leaves room
   for an action within `env.max_total_tokens`;
4. each tool service starts (your commands, the built-ins the environment needs, MCP servers), its
   tools are described and registered with the environment, and nothing is called; every process
   started is stopped by PID before the command returns;
5. the environment's demonstration of one task per split (held-out, training) parses as actions
   that call tools the services offer, with arguments their schemas accept, and ends with an answer;
   then it is replayed through the environment with the real tools and scored by `reward()`: it must
   reach the environment's `max_score` in its `score_metric` (a demonstration that scores less would
   teach the policy to fail), `reward()` must not raise (its last frame is named) and must return
   the `score_metric`;
6. every key of the environment's `report_by` is in the metadata of at least one held-out task.

Exit 0 with a summary, or 2 with the problem (the key or file:line, and the fix). No vLLM server
is started; the only episodes played are the demonstrations'.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
import time
from pathlib import Path

from agentrl.common.config import ConfigError


class CheckError(ConfigError):
    """A problem `agentrl check` found after the config resolved."""


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="agentrl check", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=None, help="TOML file layered over the embedded default (as for train)")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY.PATH=VALUE",
                        help="override one key after --config (repeatable)")
    args = parser.parse_args(argv)
    from agentrl.engine.task import TaskError
    from agentrl.runconfig import check_model_fit, load_run_config
    from agentrl.toolservers.process import ToolServerStartError

    t0 = time.monotonic()
    try:
        config = load_run_config(args.config, args.sets).config
        check_model_fit(config)
    except (ConfigError, FileNotFoundError) as err:
        print(f"agentrl check: bad config:\n{err}", file=sys.stderr)
        return 2
    workdir = Path(tempfile.mkdtemp(prefix="agentrl-check-"))
    try:
        lines = asyncio.run(check(config, workdir, say=print))
    except (ConfigError, TaskError, ToolServerStartError, OSError) as err:
        # The services' logs stay for reading (the error may name one); removed when the check passes.
        print(f"agentrl check: {err}\n(tool service logs: {workdir / 'logs'})", file=sys.stderr)
        return 2
    shutil.rmtree(workdir)
    for line in lines:
        print(line)
    print(f"ok: {args.config or 'the embedded default'} is ready to train ({time.monotonic() - t0:.1f} s)")
    return 0


async def check(config, workdir: Path, say=print) -> list[str]:
    """Every check after the config's (module docstring); the summary lines, or CheckError (and the
    task loader's TaskError, a tool service's ConfigError)."""
    from agentrl.common.model import resolve_model
    from agentrl.engine.environments import env_class
    from agentrl.engine.services import Connections, start_services
    from agentrl.engine.tasksets import load_taskset

    lines = []
    taskset = load_taskset(config.tasks, workdir / "tasks")
    if config.sft.enabled:  # the SFT phase draws them all after the baselines: a shortfall would end the run there
        try:
            taskset.demonstration_tasks(config.sft.num_examples)
        except ValueError as err:
            raise CheckError(f"sft.num_examples = {config.sft.num_examples}: the task set cannot give that many "
                             f"demonstration tasks ({err}); lower it or enlarge the task set") from None
    train = taskset.demonstration_tasks(1)
    lines.append(f"tasks: {len(taskset.heldout)} held-out, training stream {'starts with ' + train[0].task_id if train else 'empty'}"
                 + (f", {len(taskset.transfer)} transfer" if taskset.transfer else ""))
    model_dir = str(resolve_model(config.model_dir or None))
    services = await start_services(config.services, tools=config.tools, env_required=env_class(config.env).required_tools,
                                    model_dir=model_dir, corpus=taskset.corpus, logs=workdir / "logs",
                                    say=say, start_vllm=False)
    try:
        remote = services.remote
        async with Connections([], remote, model_dir, config.env, local=services.local) as conn:
            env = conn.env
            if not env.tools:
                raise CheckError("no tools: the environment has none registered (add [[tools]] or services.tools)")
            by_service = [f"{s.name} ({len(s.endpoints)} replica{'s' if len(s.endpoints) > 1 else ''})" for s in remote]
            lines.append(f"tools: {', '.join(sorted(env.tools))}" + (f" from {', '.join(by_service)}" if by_service else ""))
            lines.append(check_prompts(env, taskset.heldout))
            lines.extend(check_report_by(env, taskset.heldout))
            for split, tasks in (("held-out", taskset.heldout[:1]), ("training", train)):
                for task in tasks:
                    line, actions = check_demonstration(env, task, split, sft=config.sft.enabled)
                    if actions is not None:
                        line += "; " + await score_demonstration(env, task, actions, split)
                    lines.append(line)
    finally:
        await asyncio.to_thread(services.stop)
        say(f"stopped {len(services.procs)} tool service process{'es' if len(services.procs) != 1 else ''}")
    return lines


def _hook(call, what: str):
    """Run one of the environment's hooks; whatever it raises is the environment's bug, named."""
    try:
        return call()
    except Exception as err:  # noqa: BLE001 - user code: any exception is reported with where it came from
        raise CheckError(f"env.class: {what} raised {type(err).__name__}: {err}") from err


def check_prompts(env, tasks) -> str:
    """Every task renders; the longest prompt leaves room for an action within max_total_tokens."""
    longest = max(((len(_hook(lambda t=t: env.reset(t), f"the prompt of task {t.task_id!r} (reset, first_messages)").token_ids),
                    t.task_id) for t in tasks), default=(0, ""))
    room = env.config.max_total_tokens - longest[0]
    if room < env.config.max_action_tokens:
        raise CheckError(f"env.max_total_tokens: {env.config.max_total_tokens} leaves {room} tokens after the prompt of "
                         f"task {longest[1]!r} ({longest[0]} tokens), fewer than one action (env.max_action_tokens = "
                         f"{env.config.max_action_tokens}); raise env.max_total_tokens or shorten the prompt")
    return (f"prompts: system prompt and tools {len(env.reset(tasks[0]).token_ids) if tasks else 0} tokens with the first "
            f"task; longest {longest[0]} ({longest[1]}) of env.max_total_tokens = {env.config.max_total_tokens}")


def check_demonstration(env, task, split: str, *, sft: bool) -> tuple[str, list[str] | None]:
    """The environment's demonstration of `task` parses, calls only offered tools with arguments
    their schemas accept, and ends with an answer; nothing is run. The summary line and the actions
    (None: the environment has no demonstration)."""
    where = f"env.class: the demonstration of {split} task {task.task_id!r}"
    actions = _hook(lambda: env.demonstration(task), f"demonstration(task {task.task_id!r})")
    if actions is None:
        note = "; the SFT cold start is skipped (sft.enabled = false, or write demonstration())" if sft else ""
        return f"demonstration ({split} {task.task_id}): none{note}", None
    if not actions:
        raise CheckError(f"{where} is empty; return None for no demonstration, or the action texts")
    calls = []
    for i, action in enumerate(actions):
        if not isinstance(action, str):
            raise CheckError(f"{where}: action {i} is {type(action).__name__}, not a string (use env.parser.format_call / format_answer)")
        parsed = env.parser.parse(action)
        for err in parsed.errors:
            raise CheckError(f"{where}: action {i} has a malformed tool call ({err.kind}: {err.message}): {action[:200]!r}")
        for call in parsed.calls:
            problem = env.call_problem(call.name, call.arguments)
            if problem is not None:
                raise CheckError(f"{where}: action {i}: {problem}")
            calls.append(call.name)
        answer = env.final_answer(parsed, action, True)
        if answer is not None and i < len(actions) - 1:
            raise CheckError(f"{where}: action {i} answers, and {len(actions) - 1 - i} more follow it; end with the answer")
    if env.final_answer(env.parser.parse(actions[-1]), actions[-1], True) is None:
        raise CheckError(f"{where} does not end with an answer (env.parser.format_answer)")
    return f"demonstration ({split} {task.task_id}): {len(actions)} actions, calls {', '.join(calls) or 'none'}, then an answer", actions


async def score_demonstration(env, task, actions: list[str], split: str) -> str:
    """The demonstration of `task` replayed through the environment and its real tools, scored by its
    `reward()`; CheckError unless it reaches `env.max_score` in `env.score_metric`."""
    from agentrl.engine.episode import DemonstrationError, play

    where = f"env.class: the demonstration of {split} task {task.task_id!r}"
    try:  # as the SFT cold start plays it
        traj = await play(env, task, actions, group_id=f"check-{task.task_id}")
    except DemonstrationError as err:
        cause = last_frame(err.error) if err.error else str(err)
        raise CheckError(f"{where} failed when replayed with the real tools: {cause}") from None
    metric = env.score_metric
    if metric not in traj.metrics:
        returned = sorted(k for k in traj.metrics if not k.startswith(("process/", "num_")) and k != "gold")  # the engine's own
        raise CheckError(f"env.class: score_metric = {metric!r} is not among the metrics reward() returns "
                         f"({', '.join(returned) or 'none'}): set score_metric to one of them, or return it in "
                         f"Reward(metrics={{{metric!r}: ...}})")
    score = float(traj.metrics[metric])
    if score < env.max_score:
        raise CheckError(f"{where} scores {metric} = {score:g} when replayed with the real tools, below the "
                         f"environment's max_score = {env.max_score:g}: SFT would teach the policy to fail it. Fix "
                         "demonstration() or reward(), or set the class's max_score if the most a task can earn is less")
    return f"replayed with the real tools, {metric} = {score:g}"


def last_frame(error: str) -> str:
    """The exception and the last frame of a traceback in an episode's error text."""
    lines = [line for line in error.strip().splitlines() if line.strip()]
    frames = [line.strip() for line in lines if line.lstrip().startswith('File "')]
    if not frames:
        return lines[-1] if lines else error
    return f"{lines[-1].strip()} (last frame: {frames[-1]})"


def check_report_by(env, tasks) -> list[str]:
    """Every `report_by` key is in some held-out task's metadata (the report breaks scores down by it)."""
    for key in env.report_by:
        if not any(key in task.metadata for task in tasks):
            have = sorted({k for task in tasks for k in task.metadata})
            raise CheckError(f"env.class: report_by names {key!r}, which no held-out task's metadata has (they have: "
                             f"{', '.join(have) or 'no metadata'}); remove it or add it to the tasks' metadata")
    return [f"report by: {', '.join(env.report_by)}"] if env.report_by else []
