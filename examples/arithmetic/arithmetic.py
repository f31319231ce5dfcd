"""Arithmetic word problems solved with the calculator tool; the reward is whether the answer is the
problem's value, computed by running its expression.

    agentrl train --config examples/arithmetic/config.toml

Tasks (generated, seeded: `load_tasks`): "A baker bakes 23 loaves a day for 7 days and sells 96.
How many loaves are left?" with the expression "23 * 7 - 96" in the metadata; the reference is its
value (65), computed by the same exact evaluator the calculator service runs. Two to three
operations each; the numbers are large enough that a 135M model cannot do them in its head (held-out
score of the untrained model with the calculator: see README).

The environment: the calculator (a built-in tool service) is required; the worked example shows
one calculator call and the answer; `reward` is 1 when the number in <answer> equals the value
(commas and a trailing ".0" allowed), else 0; `demonstration` calls the calculator with the
task's expression, then answers its value (the SFT cold start).
"""

from __future__ import annotations

import random
import re
from pathlib import Path

from agentrl.common.config import config_dataclass
from agentrl.engine.env import EpisodeState, Reward, ToolEnv
from agentrl.engine.task import Task
from agentrl.engine.tasksets import TaskSet, generated_taskset
from agentrl.toolservers.calculator import evaluate

# (template, expression) pairs; {a}, {b}, {c} are filled with numbers.
TEMPLATES = [
    ("A baker bakes {a} loaves a day for {b} days and sells {c} of them. How many loaves are left?", "{a} * {b} - {c}"),
    ("A school has {a} classes of {b} pupils, and {c} more pupils join. How many pupils are there now?", "{a} * {b} + {c}"),
    ("A farmer packs {a} apples into boxes of {b}. How many full boxes does he fill?", "{a} // {b}"),
    ("A train carries {a} passengers in each of its {b} cars. At a stop {c} passengers get off. How many are left on the train?",
     "{a} * {b} - {c}"),
    ("Tickets cost {a} coins for adults and {b} coins for children. What do {c} adults and {c} children pay in all?",
     "({a} + {b}) * {c}"),
    ("A shop had {a} pens, sold {b} on Monday and {c} on Tuesday. How many pens are left?", "{a} - {b} - {c}"),
    ("A factory makes {a} bolts an hour. How many bolts does it make in {b} hours and {c} minutes at the same rate, counting whole bolts only?",
     "({a} * ({b} * 60 + {c})) // 60"),
    ("There are {a} seats in a hall, in rows of {b}. How many seats are there in {c} such halls?", "{a} * {c}"),
]
RANGES = {"a": (120, 990), "b": (7, 48), "c": (11, 95)}

INTRO = ('You solve arithmetic word problems. Use the calculator for every computation: '
         '<tool_call>{"name": "calculator", "arguments": {"expression": "..."}}</tool_call>. '
         "When you have the result, reply <answer>number</answer>.")

EXAMPLE_MESSAGES = (
    ("user", "A gardener plants 146 rows of 23 tulips and gives away 318 tulips. How many tulips does she keep?"),
    ("assistant", '<tool_call>{"name": "calculator", "arguments": {"expression": "146 * 23 - 318"}}</tool_call>'),
    ("tool", '<tool_response>\n{"value": "3040", "decimal": "3040"}\n</tool_response>'),
    ("assistant", "<answer>3040</answer>"),
)


def problem(rng: random.Random, index: int, split: str) -> Task:
    template, expression = TEMPLATES[rng.randrange(len(TEMPLATES))]
    numbers = {k: rng.randint(*RANGES[k]) for k in "abc"}
    if "- {b} - {c}" in expression:
        numbers["a"] = max(numbers["a"], numbers["b"] + numbers["c"] + 1)
    text, expr = template.format(**numbers), expression.format(**numbers)
    return Task(f"arith-{split}-{index}", prompt=text, reference=int(evaluate(expr)), metadata={"expression": expr})


@config_dataclass
class Options:
    seed: int = 0
    """Seed of the generated problems."""
    num_train: int = 2000
    """Training problems (cycled)."""
    num_heldout: int = 64
    """Held-out problems."""


def load_tasks(options: Options, workdir: Path) -> TaskSet:
    """Train and held-out problems from disjoint seeds."""
    return generated_taskset(options.seed, options.num_train, options.num_heldout, problem)


load_tasks.Options = Options

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.0+)?")


def parse_number(answer: str) -> int | None:
    match = _NUMBER.fullmatch(answer.strip())
    return int(match.group(0).replace(",", "").split(".")[0]) if match else None


class ArithmeticEnv(ToolEnv):
    required_tools = ("calculator",)
    score_metric = "correct"

    def intro(self) -> str:
        return INTRO

    def example_messages(self):
        return EXAMPLE_MESSAGES

    def reward(self, task: Task, episode: EpisodeState) -> Reward:
        value = parse_number(episode.answer) if isinstance(episode.answer, str) else None
        correct = float(value is not None and value == task.reference)
        return Reward(correct, {"correct": correct, "answered_number": float(value is not None)})

    def demonstration(self, task: Task) -> list[str]:
        return [self.parser.format_call("calculator", {"expression": task.metadata["expression"]}),
                self.parser.format_answer(str(task.reference))]
