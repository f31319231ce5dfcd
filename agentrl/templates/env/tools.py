"""The environment's tool service: the `lookup` tool over ZeroMQ.

    python tools.py --bind tcp://127.0.0.1:5700 --seed 0

`agentrl train` and `agentrl check` start it from the `[[tools]] command` of config.toml (in this
folder, with a free port for {bind}), wait for its `READY <endpoint>` line and stop it by PID.
A tool is a function with type hints and a docstring (its schema comes from them); what it returns
is the result the policy reads, and an exception it raises becomes an error result with the
message, which the policy reads as {"name": ..., "error": "ValueError: ..."}.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # environment.py beside this file

from environment import catalogue  # noqa: E402

from agentrl.toolservers.functions import serve  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0, help="the catalogue's seed: [tasks.options] seed")
    args, rest = parser.parse_known_args()
    items = catalogue(args.seed)

    def lookup(item: str) -> dict:
        """The stock code of a catalogue item.

        Args:
            item: the item's name, e.g. "red wool scarf"
        """
        name = " ".join(item.lower().split())
        if name not in items:
            raise ValueError(f"no item {item!r} in the catalogue")
        return {"item": name, "code": items[name]}

    return serve([lookup], rest)


if __name__ == "__main__":
    sys.exit(main())
