"""A travel assistant over structured API tools (Agent-R1's weather example, grown up): a generated
world of cities, forecasts and flights behind three JSON tools, requests that need one to three
calls, and answers that are JSON objects.

    agentrl train --config examples/travel/config.toml

The world (`World.generate(seed)`): made-up cities, each with a country and a 7-day forecast
(condition, high in degrees C), and flights between some pairs (code, departure, price). Its tools
run as this example's own tool service (tools.py), which `agentrl train` starts from a command:

    get_weather(city, day)            -> {"city", "day", "condition", "high_c"}
    find_flights(origin, destination) -> {"flights": [{"flight", "departs", "price"}, ...]}
    get_city(city)                    -> {"city", "country", "airport"}

Requests (`load_tasks`), each naming the JSON keys of its answer:
    weather            1 call   {"condition", "high_c"}
    cheapest flight    1 call   {"flight"}
    trip               2 calls  {"flight", "condition"}: the cheapest flight and the weather there
    warmer             2 calls  {"city"}: the warmer of two cities on a day
    trip with country  3 calls  {"flight", "country", "condition"}

The environment: `reward` = the fraction of the answer's keys that are right (the task reward),
`correct` = all of them right (the held-out score); the generic process terms reward valid and
successful calls and charge repeated ones. `demonstration` makes the gold calls, then answers.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentrl.common.config import config_dataclass
from agentrl.engine.env import EpisodeState, Reward, ToolEnv
from agentrl.engine.task import Task
from agentrl.engine.tasksets import TaskSet, generated_taskset

CONDITIONS = ("sunny", "cloudy", "rain", "snow", "windy", "fog")
_ONSETS = ["b", "br", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "th"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ou"]
_ENDINGS = ["ra", "mora", "ville", "stad", "holm", "polis", "ton", "mar"]
NUM_DAYS = 7


def _name(rng: random.Random, used: set[str], ending: list[str]) -> str:
    while True:
        name = (rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_ONSETS) + rng.choice(ending)).capitalize()
        if name not in used:
            used.add(name)
            return name


@dataclass
class World:
    cities: dict[str, dict] = field(default_factory=dict)
    """city -> {"country", "airport", "forecast": [{"condition", "high_c"}] * NUM_DAYS}"""
    flights: dict[tuple[str, str], list[dict]] = field(default_factory=dict)
    """(origin, destination) -> [{"flight", "departs", "price"}], by departure time"""

    @classmethod
    def generate(cls, seed: int, num_cities: int = 16) -> World:
        rng = random.Random(f"travel-{seed}")
        used: set[str] = set()
        countries = [_name(rng, used, ["ia", "land", "ovia"]) for _ in range(5)]
        world = cls()
        for _ in range(num_cities):
            city = _name(rng, used, _ENDINGS)
            world.cities[city] = {
                "country": rng.choice(countries), "airport": city[:3].upper(),
                "forecast": [{"condition": rng.choice(CONDITIONS), "high_c": rng.randint(-8, 34)} for _ in range(NUM_DAYS)]}
        names = sorted(world.cities)
        codes = set()
        for origin in names:
            for destination in rng.sample([n for n in names if n != origin], 5):
                flights = []
                for _ in range(rng.randint(2, 4)):
                    code = f"{origin[0]}{destination[0]}{rng.randint(100, 999)}"
                    while code in codes:
                        code = f"{origin[0]}{destination[0]}{rng.randint(100, 999)}"
                    codes.add(code)
                    flights.append({"flight": code, "departs": f"{rng.randint(5, 22):02d}:{rng.choice([0, 15, 30, 45]):02d}",
                                    "price": rng.randint(40, 600)})
                if len({f["price"] for f in flights}) < len(flights):  # a unique cheapest flight
                    for k, f in enumerate(flights):
                        f["price"] += k
                world.flights[(origin, destination)] = sorted(flights, key=lambda f: f["departs"])
        return world

    # -- the tools' answers (tools.py serves these)
    def get_weather(self, city: str, day: int) -> dict:
        if city not in self.cities:
            raise ValueError(f"unknown city {city!r}")
        if not 0 <= day < NUM_DAYS:
            raise ValueError(f"day must be 0-{NUM_DAYS - 1}")
        return {"city": city, "day": day, **self.cities[city]["forecast"][day]}

    def find_flights(self, origin: str, destination: str) -> dict:
        for c in (origin, destination):
            if c not in self.cities:
                raise ValueError(f"unknown city {c!r}")
        return {"flights": self.flights.get((origin, destination), [])}

    def get_city(self, city: str) -> dict:
        if city not in self.cities:
            raise ValueError(f"unknown city {city!r}")
        info = self.cities[city]
        return {"city": city, "country": info["country"], "airport": info["airport"]}

    def cheapest(self, origin: str, destination: str) -> str:
        return min(self.flights[(origin, destination)], key=lambda f: f["price"])["flight"]


def _call(name: str, **arguments: Any) -> dict:
    return {"name": name, "arguments": arguments}


def make_task(world: World, rng: random.Random, task_id: str) -> Task:
    kind = rng.choice(["weather", "cheapest", "trip", "warmer", "trip_country"])
    day = rng.randrange(NUM_DAYS)
    origin, destination = rng.choice(sorted(world.flights))
    a, b = rng.sample(sorted(world.cities), 2)
    if kind == "weather":
        f = world.cities[a]["forecast"][day]
        prompt = f"What is the forecast for {a} on day {day}? Answer as JSON with keys condition and high_c."
        reference, calls = {"condition": f["condition"], "high_c": f["high_c"]}, [_call("get_weather", city=a, day=day)]
    elif kind == "cheapest":
        prompt = f"Which flight from {origin} to {destination} is the cheapest? Answer as JSON with key flight."
        reference, calls = {"flight": world.cheapest(origin, destination)}, [_call("find_flights", origin=origin, destination=destination)]
    elif kind == "trip":
        prompt = (f"I fly from {origin} to {destination} on day {day}. What is the cheapest flight, and what weather "
                  "will I find there? Answer as JSON with keys flight and condition.")
        reference = {"flight": world.cheapest(origin, destination), "condition": world.cities[destination]["forecast"][day]["condition"]}
        calls = [_call("find_flights", origin=origin, destination=destination), _call("get_weather", city=destination, day=day)]
    elif kind == "warmer":
        ha, hb = (world.cities[c]["forecast"][day]["high_c"] for c in (a, b))
        while ha == hb:
            day = (day + 1) % NUM_DAYS
            ha, hb = (world.cities[c]["forecast"][day]["high_c"] for c in (a, b))
        prompt = f"Which is warmer on day {day}, {a} or {b}? Answer as JSON with key city."
        reference, calls = {"city": a if ha > hb else b}, [_call("get_weather", city=a, day=day), _call("get_weather", city=b, day=day)]
    else:
        prompt = (f"I fly from {origin} to {destination} on day {day}. What is the cheapest flight, which country is "
                  f"{destination} in, and what weather will I find there? Answer as JSON with keys flight, country and condition.")
        reference = {"flight": world.cheapest(origin, destination), "country": world.cities[destination]["country"],
                     "condition": world.cities[destination]["forecast"][day]["condition"]}
        calls = [_call("find_flights", origin=origin, destination=destination), _call("get_city", city=destination),
                 _call("get_weather", city=destination, day=day)]
    return Task(task_id, prompt=prompt, reference=reference, metadata={"kind": kind, "num_calls": len(calls), "gold_calls": calls})


@config_dataclass
class Options:
    seed: int = 0
    """Seed of the world and of the requests (the tool service must use the same: tools.py --seed)."""
    num_train: int = 2000
    """Training requests (cycled)."""
    num_heldout: int = 60
    """Held-out requests."""


def load_tasks(options: Options, workdir: Path) -> TaskSet:
    world = World.generate(options.seed)
    return generated_taskset(options.seed, options.num_train, options.num_heldout,
                             lambda rng, i, split: make_task(world, rng, f"travel-{split}-{i}"))


load_tasks.Options = Options

INTRO = ('You are a travel assistant. Call a tool with <tool_call>{"name": "<tool name>", "arguments": {...}}</tool_call>, '
         "one call per fact you need. When you have every fact, reply <answer>{JSON with the keys asked for}</answer>.")

EXAMPLE_MESSAGES = (
    ("user", "I fly from Brimholm to Toulara on day 1. What is the cheapest flight, and what weather will I find there? "
             "Answer as JSON with keys flight and condition."),
    ("assistant", '<tool_call>{"name": "find_flights", "arguments": {"origin": "Brimholm", "destination": "Toulara"}}</tool_call>'),
    ("tool", '<tool_response>\n{"flights": [{"flight": "BT204", "departs": "07:30", "price": 310}, {"flight": "BT977", "departs": "18:15", "price": 95}]}\n</tool_response>'),
    ("assistant", '<tool_call>{"name": "get_weather", "arguments": {"city": "Toulara", "day": 1}}</tool_call>'),
    ("tool", '<tool_response>\n{"city": "Toulara", "day": 1, "condition": "rain", "high_c": 12}\n</tool_response>'),
    ("assistant", '<answer>{"flight": "BT977", "condition": "rain"}</answer>'),
)


def parse_answer(answer: Any) -> dict | None:
    if isinstance(answer, dict):
        return answer
    try:
        value = json.loads(answer)
    except (TypeError, json.JSONDecodeError):
        return None
    return value if isinstance(value, dict) else None


class TravelEnv(ToolEnv):
    score_metric = "correct"
    report_by = ("kind",)

    def intro(self) -> str:
        return INTRO

    def example_messages(self):
        return EXAMPLE_MESSAGES

    def reward(self, task: Task, episode: EpisodeState) -> Reward:
        answer = parse_answer(episode.answer) if episode.answer is not None else None
        reference: dict = task.reference
        right = sum(1 for k, v in reference.items() if answer is not None and answer.get(k) == v)
        fraction = right / len(reference)
        return Reward(fraction, {"correct": float(right == len(reference)), "fields_right": fraction,
                                 "valid_json": float(answer is not None)})

    def demonstration(self, task: Task) -> list[str]:
        calls = [self.parser.format_call(c["name"], c["arguments"]) for c in task.metadata["gold_calls"]]
        return [*calls, self.parser.format_answer(json.dumps(task.reference))]
