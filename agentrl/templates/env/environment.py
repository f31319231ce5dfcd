"""A starting point for your own environment, written by `agentrl init-env`: the tasks, the
environment and the task loader, in one file that `config.toml` names.

The task: a customer asks for the stock code of an item in a shop's catalogue. Only the `lookup`
tool (tools.py, a tool service of its own) knows the codes, so the policy has to call it and copy
the code into its answer. The catalogue is generated from a seed that the tasks and the tool service
share. Replace the catalogue, the tool, the prompt and the reward with yours; `agentrl check
--config config.toml` tells you in seconds whether the pieces still fit.
"""

from __future__ import annotations

import random
from pathlib import Path

from agentrl.common.config import config_dataclass
from agentrl.engine.env import EpisodeState, Reward, ToolEnv
from agentrl.engine.task import Task
from agentrl.engine.tasksets import TaskSet, generated_taskset

COLOURS = ["red", "blue", "green", "black", "white", "yellow", "grey", "orange", "purple", "brown"]
MATERIALS = ["wool", "cotton", "steel", "oak", "glass", "leather", "linen", "copper", "bamboo", "clay"]
THINGS = ["scarf", "mug", "lamp", "chair", "bowl", "bag", "kettle", "basket", "vase", "clock"]


def catalogue(seed: int) -> dict[str, str]:
    """Item name -> stock code (a letter, a dash and three digits), the same for the same seed."""
    rng = random.Random(seed)
    names = [f"{c} {m} {t}" for c in COLOURS for m in MATERIALS for t in THINGS]
    return {name: f"{rng.choice('ABCDEFGHJKLMNPRSTUVWXYZ')}-{rng.randint(100, 999)}" for name in names}


@config_dataclass
class Options:
    """[tasks.options] of this loader."""

    seed: int = 0
    """Seed of the catalogue; the tool service's --seed (config.toml) must be the same."""
    num_train: int = 2000
    """Training questions (cycled)."""
    num_heldout: int = 64
    """Held-out questions, about items no training question names."""


def load_tasks(options: Options, workdir: Path) -> TaskSet:
    """Training and held-out questions about disjoint halves of the catalogue."""
    items = sorted(catalogue(options.seed).items())
    halves = {"train": items[::2], "heldout": items[1::2]}

    def question(rng: random.Random, index: int, split: str) -> Task:
        name, code = halves[split][rng.randrange(len(halves[split]))]
        return Task(f"item-{split}-{index}", prompt=f"What is the stock code of the {name}?", reference=code,
                    metadata={"item": name})

    return generated_taskset(options.seed, options.num_train, options.num_heldout, question)


load_tasks.Options = Options


class CatalogueEnv(ToolEnv):
    """The environment: what the policy is told, how an episode is scored, and a gold episode."""

    score_metric = "correct"  # the held-out score of the report and of the run's last JSON line

    def intro(self) -> str:
        return ("You answer customers' questions about a shop's catalogue. Look an item up with the lookup tool: "
                '<tool_call>{"name": "lookup", "arguments": {"item": "..."}}</tool_call>. '
                "Then reply with its stock code: <answer>code</answer>.")

    def example_messages(self) -> tuple[tuple[str, str], ...]:
        """A worked example shown before the question (`env.worked_example`): an item that is not in
        the catalogue, looked up, then answered. The untrained model calls the tool only with one."""
        return (("user", "What is the stock code of the silver paper kite?"),
                ("assistant", self.parser.format_call("lookup", {"item": "silver paper kite"})),
                ("tool", '<tool_response>\n{"item": "silver paper kite", "code": "Q-417"}\n</tool_response>'),
                ("assistant", self.parser.format_answer("Q-417")))

    def reward(self, task: Task, episode: EpisodeState) -> Reward:
        """1 when the answer is the item's code (case and spaces aside), else 0."""
        answer = episode.answer if isinstance(episode.answer, str) else ""
        correct = float(answer.strip().upper() == task.reference)
        return Reward(correct, {"correct": correct})

    def demonstration(self, task: Task) -> list[str]:
        """The actions of a correct episode: the SFT cold start trains on them (run through the real tool)."""
        return [self.parser.format_call("lookup", {"item": task.metadata["item"]}),
                self.parser.format_answer(task.reference)]
