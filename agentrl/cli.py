"""The `agentrl` command: one entry point, one subcommand per component.

Each subcommand lives beside the component it drives and is imported only when invoked, so
`agentrl tool call ...` never pays for importing torch or vLLM. A subcommand is a function
`main(argv: list[str]) -> int` that parses its own arguments.
"""

from __future__ import annotations

import importlib
import sys

from agentrl.common.procs import exit_on_sigterm  # noqa: F401  (re-exported for scripts)

# name -> ("module:function", one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "prepare-model": ("agentrl.common.model:prepare_main", "turn the shipped SmolLM2 GGUF into an HF folder"),
    "serve-model": ("agentrl.engine.serve:main", "start a vLLM server with hot-swappable weights"),
    "push-weights": ("agentrl.common.weights:push_main", "hot-swap weights into a running server"),
    "toolserver": ("agentrl.toolservers.cli:serve_main", "run one tool service on a ZeroMQ endpoint"),
    "tool": ("agentrl.engine.tool_cli:main", "call or describe a running tool service"),
    "eval": ("agentrl.evaluate:eval_main", "evaluate a policy on a run's held-out tasks (EM/F1, baselines)"),
    "rollout": ("agentrl.evaluate:rollout_main", "run episodes and write their trajectories"),
    "learner": ("agentrl.learner.cli:main", "run the learner process"),
    "actor": ("agentrl.actor:main", "run the actor process (the orchestrator of a training run)"),
    "init-env": ("agentrl.init_env:main", "write a working environment folder to start from (tools, env, tasks, config)"),
    "check": ("agentrl.check:main", "check a training config in seconds: tasks, tools started and described, demonstrations"),
    "train": ("agentrl.train:main", "run the whole training job (services, actor, learner)"),
    "view": ("agentrl.view:main", "browse a run in a local web page: curves, evaluations, episodes token by token"),
    "rescore": ("agentrl.rescore:main", "score a run's stored episodes again with a changed environment (no model calls)"),
    "export": ("agentrl.export:main", "write a run's policy as a Hugging Face model folder"),
    "gateway": ("agentrl.gateway.cli:main", "serve the OpenAI chat API in front of vLLM, recording sessions' exact tokens"),
    "demo": ("agentrl.demo:main", "serve the model, run token-in/token-out requests and one hot swap"),
}


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: agentrl COMMAND [ARGS...]   (agentrl --version, agentrl COMMAND --help)", "", "commands:"]
    lines += [f"  {name.ljust(width)}  {help_}" for name, (_, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        from agentrl import __version__

        print(f"agentrl {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"agentrl: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module_name, func_name = COMMANDS[name][0].split(":")
    func = getattr(importlib.import_module(module_name), func_name)
    return int(func(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
