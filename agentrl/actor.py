"""`agentrl actor --config FILE`: the entry of the actor process (engine/actor.py is the process).

It reads the actor config the supervisor wrote and runs `engine.actor.run_actor`; when the config
names an agent (`[agent]`, engine/agent.py) it also hands over the agent runner's factory: a gateway
served in this process over the actor's server pool, and the entry or command run per episode
(agentrl.gateway.agents). It lives here, beside the other entries, because it wires two components:
the engine does not import the gateway.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from agentrl.common.config import ConfigError, build, read_toml
from agentrl.engine.actor import ActorConfig, EpisodesFactory, run_actor


def agent_factory(cfg: ActorConfig) -> EpisodesFactory | None:
    """The agent runner's factory for `cfg`, or None for native episodes."""
    if not cfg.agent.enabled:
        return None
    from agentrl.gateway.agents import agent_episodes

    return lambda conn: agent_episodes(cfg.agent, conn.env, conn.pool, conn.chat.tokenizer, model_dir=cfg.model_dir,
                                       temperature=cfg.orchestrator.sampling.temperature)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="agentrl actor", description="The actor process: the orchestrator of a training run.")
    parser.add_argument("--config", required=True)
    args = parser.parse_args(argv)
    try:
        cfg = build(ActorConfig, read_toml(args.config), default_source=args.config)
        if cfg.agent.enabled:
            from agentrl.engine.agent import check_agent

            check_agent(cfg.agent)
    except ConfigError as err:
        print(f"agentrl actor: bad config: {err}", file=sys.stderr)
        return 2
    return asyncio.run(run_actor(cfg, agent_factory(cfg)))
