"""`agentrl train` on the tests' tiny run (tests/tiny_run.toml), for the tests and benchmarks that
start whole runs: each layers only the keys its case needs, with `--set`."""

from __future__ import annotations

import sys
from pathlib import Path

TINY_RUN = Path(__file__).resolve().parents[1] / "tiny_run.toml"


def train_argv(*sets: str, out: str | Path | None = None, extra: tuple[str, ...] = ()) -> list[str]:
    """The command line of `agentrl train --config tests/tiny_run.toml [--out OUT] --set S ... EXTRA`."""
    argv = [sys.executable, "-P", "-m", "agentrl.cli", "train", "--config", str(TINY_RUN)]
    if out is not None:
        argv += ["--out", str(out)]
    for item in sets:
        argv += ["--set", item]
    return argv + list(extra)
