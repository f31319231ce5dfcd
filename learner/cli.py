"""`agentrl learner --config FILE`: the learner process (see agentrl.learner.service)."""

from __future__ import annotations

import os


def main(argv: list[str]) -> int:
    # Before torch loads: on a shared 2-core machine spinning OpenMP threads wait on a descheduled peer;
    # passive waiting measured 87 vs 30 tokens/s for a 512-token forward+backward under load.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from agentrl.learner.service import main as service_main

    return service_main(argv)
