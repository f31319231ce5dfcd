"""The `agentrl` command: one entry point, one subcommand per component.

Each subcommand lives beside the component it drives and is imported only when invoked, so
`agentrl tool call ...` never pays for importing torch or vLLM. A subcommand is a function
`main(argv: list[str]) -> int` that parses its own arguments.
"""

from __future__ import annotations

import importlib
import sys

# name -> ("module:function", one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "prepare-model": ("agentrl.model:prepare_main", "turn the shipped SmolLM2 GGUF into an HF folder"),
    "serve-model": ("agentrl.engine.serve:main", "start a vLLM server with hot-swappable weights"),
    "push-weights": ("agentrl.engine.weights:push_main", "hot-swap weights into a running server"),
    "toolserver": ("agentrl.toolservers.cli:serve_main", "run one tool service on a ZeroMQ endpoint"),
    "tool": ("agentrl.toolservers.cli:tool_main", "call or describe a running tool service"),
    "eval": ("agentrl.engine.cli:eval_main", "evaluate a policy on a task set (EM/F1)"),
    "rollout": ("agentrl.engine.cli:rollout_main", "run episodes and write their trajectories"),
    "learner": ("agentrl.learner.cli:main", "run the learner process"),
    "actor": ("agentrl.train:actor_main", "run the actor process (the orchestrator of a training run)"),
    "train": ("agentrl.train:main", "run the whole training job (services, actor, learner)"),
    "gateway": ("agentrl.gateway.cli:main", "serve the OpenAI chat API in front of vLLM, recording sessions' exact tokens"),
    "demo": ("agentrl.demo:main", "serve the model, run token-in/token-out requests and one hot swap"),
}


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: agentrl COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name.ljust(width)}  {help_}" for name, (_, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"agentrl: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module_name, func_name = COMMANDS[name][0].split(":")
    func = getattr(importlib.import_module(module_name), func_name)
    return int(func(rest) or 0)


def exit_on_sigterm() -> None:
    """Make SIGTERM raise SystemExit(143) in the main thread, so the `finally` blocks that stop
    child servers by PID run (the default action would end the process and orphan them)."""
    import signal

    def _raise(signum, _frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _raise)


if __name__ == "__main__":
    sys.exit(main())
