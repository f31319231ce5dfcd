"""`agentrl learner --config FILE`: the learner process (see agentrl.learner.service)."""

from __future__ import annotations


def main(argv: list[str]) -> int:
    from agentrl.learner.service import main as service_main

    return service_main(argv)
