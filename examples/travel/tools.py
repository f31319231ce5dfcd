"""The travel example's own tool service: the world's three tools over ZeroMQ.

    python examples/travel/tools.py --bind tcp://127.0.0.1:5700 --seed 0

`agentrl train` starts it from the `[[tools]] command` of config.toml (with a free port for {bind})
and stops it by PID; it prints `READY <endpoint>` once it serves. The seed must be the task
loader's (`[tasks.options] seed`), so that the tools answer about the world the questions ask about.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # travel.py beside this file (safe-path mode adds nothing)

from travel import World  # noqa: E402

from agentrl.toolservers.functions import serve  # noqa: E402


def tools_for(world: World) -> list:
    def get_weather(city: str, day: int) -> dict:
        """The forecast for a city on a day: condition and the high in degrees C.

        Args:
            city: the city's name
            day: days from today, 0-6
        """
        return world.get_weather(city, day)

    def find_flights(origin: str, destination: str) -> dict:
        """Direct flights from one city to another: flight code, departure time and price.

        Args:
            origin: the city of departure
            destination: the city of arrival
        """
        return world.find_flights(origin, destination)

    def get_city(city: str) -> dict:
        """Facts about a city: its country and airport code.

        Args:
            city: the city's name
        """
        return world.get_city(city)

    return [get_weather, find_flights, get_city]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    args, rest = parser.parse_known_args()
    return serve(tools_for(World.generate(args.seed)), rest)


if __name__ == "__main__":
    sys.exit(main())
