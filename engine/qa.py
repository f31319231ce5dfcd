"""The multi-hop question-answering environment (Agent-R1's setting), built on the public ToolEnv API.

Tasks (engine/tasks.py `qa_task`): prompt = the question, reference = the gold answer and its
aliases, metadata = num_hops, source, supporting passage ids, gold search queries (synthetic).

    intro / example      "You answer questions by searching a knowledge base ..." and one worked
                         2-hop example on made-up entities, as chat turns (SmolLM2 needs it to call
                         tools at all: 0 of 8 samples made a valid call without one, 3 of 8 with one)
    first messages       "Question: <question>"
    end of the episode   <answer>...</answer>
    reward               exact match (or F1, `task_metric`) of the answer against the gold answers,
                         with the SQuAD / HotpotQA normalisation (metrics.py); metrics em and f1
    demonstration        one search per gold query, then the gold answer (synthetic tasks)
    baselines            Naive RAG: one retrieval with the question, the passages in the prompt,
                         one answer turn

The held-out score is EM; scores are also reported by hop count.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, Literal

from agentrl.common.config import config_dataclass
from agentrl.engine.env import EnvConfig, EpisodeState, Reward, ToolEnv, format_content
from agentrl.engine.metrics import exact_match, f1_score
from agentrl.engine.task import Task

INTRO = ('You answer questions by searching a knowledge base. Call a tool with <tool_call>{"name": "<tool name>", '
         '"arguments": {...}}</tool_call>. Look up one fact per search. When you know the answer, reply '
         "<answer>short answer</answer>.")

# One worked example on made-up entities, given as real chat turns after the system message. Measured
# on this machine with SmolLM2-135M-Instruct (vLLM, 4 questions x 4 samples, first turn, 60 tokens):
# the same example written as text inside the system prompt gave 2/16 valid search calls at T=1.0,
# 6/16 at T=0.7 and 0/4 greedy; as chat turns, 6/16, 12/16 and 4/4.
EXAMPLE_MESSAGES: tuple[tuple[str, str], ...] = (
    ("user", "Question: Which city was the founder of Brimbell Optics born in?"),
    ("assistant", '<tool_call>{"name": "search", "arguments": {"query": "founder of Brimbell Optics"}}</tool_call>'),
    ("tool", "<tool_response>\n[1] Brimbell Optics: Brimbell Optics was founded by Oska Venn in 1987.\n</tool_response>"),
    ("assistant", '<tool_call>{"name": "search", "arguments": {"query": "Oska Venn born"}}</tool_call>'),
    ("tool", "<tool_response>\n[1] Oska Venn: Oska Venn was born in Lorrowby.\n</tool_response>"),
    ("assistant", "<answer>Lorrowby</answer>"),
)

NAIVE_RAG_SYSTEM_PROMPT = "Answer the question using the passages. Write only the answer, as <answer>short answer</answer>."

# The Naive RAG baseline gets the same kind of worked example as the agent (one exchange, made-up entities),
# so that the comparison is between retrieval strategies, not between prompted and unprompted formats.
NAIVE_RAG_EXAMPLE_MESSAGES: tuple[tuple[str, str], ...] = (
    ("user", "Passages:\n[1] Oska Venn: Oska Venn was born in Lorrowby. Oska Venn worked as a chemist.\n"
             "[2] Brimbell Optics: Brimbell Optics was founded by Oska Venn in 1987.\n\nQuestion: Which city was Oska Venn born in?"),
    ("assistant", "<answer>Lorrowby</answer>"),
)


def answers(task: Task) -> list[str]:
    """The gold answer and its aliases."""
    return list(task.reference)


def num_hops(task: Task) -> int:
    return int(task.metadata.get("num_hops", 0))


@config_dataclass
class QAOptions:
    task_metric: Literal["em", "f1"] = "em"
    """The task reward: "em" (exact match in {0, 1}) or "f1" (token F1)."""
    naive_rag_top_k: int = 3
    """Passages the Naive RAG baseline retrieves per question."""


class MultiHopQAEnv(ToolEnv):
    Options = QAOptions
    required_tools = ("search",)
    score_metric = "em"
    report_by = ("num_hops", "source")
    user_prefix = "Question: "

    def intro(self) -> str:
        return INTRO

    def example_messages(self) -> tuple[tuple[str, str], ...]:
        return EXAMPLE_MESSAGES

    def reward(self, task: Task, episode: EpisodeState) -> Reward:
        if episode.answer is None:
            return Reward(0.0, {"em": 0.0, "f1": 0.0})
        answer = episode.answer if isinstance(episode.answer, str) else str(episode.answer)
        em, f1 = exact_match(answer, answers(task)), f1_score(answer, answers(task))
        return Reward(em if self.options.task_metric == "em" else f1, {"em": em, "f1": f1})

    def demonstration(self, task: Task) -> list[str] | None:
        queries = task.metadata.get("gold_queries") or []
        if not queries:
            return None
        return [*(self.parser.format_call("search", {"query": q}) for q in queries),
                self.parser.format_answer(answers(task)[0])]

    async def baselines(self, tasks: list[Task]) -> dict[str, ToolEnv]:
        if "search" not in self.tools:
            return {}
        rag = NaiveRAGEnv(self.chat, dataclasses.replace(self.config, max_turns=1, plain_text_is_answer=True),
                          self.options, parser=self.parser)
        await rag.retrieve(self.tools["search"], tasks, self.options.naive_rag_top_k)
        return {"naive_rag": rag}


class NaiveRAGEnv(MultiHopQAEnv):
    """One retrieval with the question before the episode, the passages in the prompt, one turn."""

    required_tools = ()

    def __init__(self, chat, config: EnvConfig, options: Any = None, *, parser=None):
        super().__init__(chat, config, options, parser=parser)
        self._contexts: dict[str, str] = {}

    async def retrieve(self, search, tasks: list[Task], top_k: int) -> None:
        results = await asyncio.gather(*(search.execute({"query": t.prompt, "top_k": top_k}) for t in tasks))
        for task, result in zip(tasks, results, strict=True):
            if not result.success:
                raise RuntimeError(f"Naive RAG retrieval failed for {task.task_id}: {result.error}")
            self._contexts[task.task_id] = f"Passages:\n{format_content(result.content)}\n\nQuestion: {task.prompt}"

    @property
    def system_prompt(self) -> str:
        return NAIVE_RAG_SYSTEM_PROMPT

    def example_messages(self) -> tuple[tuple[str, str], ...]:
        return NAIVE_RAG_EXAMPLE_MESSAGES

    def first_messages(self, task: Task) -> list[tuple[str, str]]:
        return [("user", self._contexts[task.task_id])]
