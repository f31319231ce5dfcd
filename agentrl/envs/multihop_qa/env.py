"""The multi-hop question-answering environment (Agent-R1's setting), built on the public ToolEnv API.

Tasks (agentrl/envs/multihop_qa/tasks.py `qa_task`): prompt = the question, reference = the gold answer and its
aliases, metadata = num_hops, source, supporting passage ids, gold search queries (synthetic).

    intro / example      "You answer questions by searching a knowledge base ..." and one worked
                         2-hop example on made-up entities, as chat turns (SmolLM2 needs it to call
                         tools at all: 0 of 8 samples made a valid call without one, 3 of 8 with one)
    first messages       "Question: <question>"
    end of the episode   <answer>...</answer>
    reward               exact match (or F1, `task_metric`) of the answer against the gold answers,
                         with the SQuAD / HotpotQA normalisation (metrics.py); metrics em and f1;
                         optionally a `retrieval` process term (below)
    failure labels       for a wrong episode, metrics fail_truncated, fail_stopped_early,
                         fail_intermediate, fail_query, fail_retrieved (see `failure_labels`)
    demonstration        one search per gold query, then the gold answer (synthetic tasks)
    baselines            Naive RAG: one retrieval with the question, the passages in the prompt,
                         one answer turn

The held-out score is EM; scores are also reported by hop count.

Prompt options (each the policy's own text, trained and rewarded like the rest of the action;
why each exists and what it measured: docs/notes/multihop-qa.md):
- `plan`: the first action begins with `<think>searches: N</think>`, N the question's hop count;
- `progress` (needs `plan`): every action after a search result begins with
  `<think>searches done: K of N</think>`;
- `evidence` (needs `progress`): that text first copies the sentence of the result that answers
  the search;
- `progress_note` (needs `plan`): the environment ends each search result with the searches made
  against the written count and the step that count asks for.

The retrieval term (`retrieval_reward` > 0) pays for finding the task's supporting passages, so
an episode that chains a second, bridge-entity search is preferred over one that stops after the
first even when both answers are wrong (a 2-hop group whose answers are all wrong otherwise
carries no gradient: 97 of 104 such groups in the main job). It cannot be gamed by dumping:
a passage counts only when a search ranks it among its first `retrieval_top_k` results (asking
for top_k=50 buys nothing), and the credit is divided by max(hops, searches made), so every search
beyond the hop count lowers it: value = retrieval_reward * found / max(hops, searches).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import re
from typing import Any, Literal

from agentrl.common.config import config_dataclass
from agentrl.engine.env import EnvConfig, EpisodeState, Reward, ToolEnv, format_content
from agentrl.engine.task import Task
from agentrl.envs.multihop_qa.metrics import exact_match, f1_score

INTRO = ('You answer questions by searching a knowledge base. Call a tool with <tool_call>{"name": "<tool name>", '
         '"arguments": {...}}</tool_call>. Look up one fact per search. When you know the answer, reply '
         "<answer>short answer</answer>.")

# One worked example on made-up entities, given as real chat turns after the system message. Measured
# on this machine with SmolLM2-135M-Instruct (vLLM, 4 questions x 4 samples, first turn, 60 tokens):
# the same example written as text inside the system prompt gave 2/16 valid search calls at T=1.0,
# 6/16 at T=0.7 and 0/4 greedy; as chat turns, 6/16, 12/16 and 4/4.
EXAMPLE_2HOP: tuple[tuple[str, str], ...] = (
    ("user", "Question: Which city was the founder of Brimbell Optics born in?"),
    ("assistant", '<tool_call>{"name": "search", "arguments": {"query": "founder of Brimbell Optics"}}</tool_call>'),
    ("tool", "<tool_response>\n[1] Brimbell Optics: Brimbell Optics was founded by Oska Venn in 1987.\n</tool_response>"),
    ("assistant", '<tool_call>{"name": "search", "arguments": {"query": "Oska Venn born"}}</tool_call>'),
    ("tool", "<tool_response>\n[1] Oska Venn: Oska Venn was born in Lorrowby.\n</tool_response>"),
    ("assistant", "<answer>Lorrowby</answer>"),
)

# A 1-hop worked example. Its search returns what the real search returns over EXAMPLE_1HOP_PASSAGES
# (three passages, the answer in [1], two that share a word with the query; checked in
# tests/test_engine_qa_multihop.py), shown with the 2-hop one by `worked_examples = [1, 2]`.
# Measured (docs/notes/multihop-qa.md, "Worked examples"): it raises the untrained model's EM from 0.021 to
# 0.146 and makes a policy trained without it search once on every question; after 20 SFT steps
# on two thirds 2-hop demonstrations the policy searches twice on every question with it or without.
EXAMPLE_1HOP_PASSAGES: tuple[dict, ...] = (
    {"id": "ex-1", "title": "Tessick Lamp", "text": "The Tessick Lamp is made by Quorran Works. The Tessick Lamp went on sale in 1994."},
    {"id": "ex-2", "title": "Vendle Lamp", "text": "The Vendle Lamp is made by Osprane Glass. The Vendle Lamp went on sale in 2001."},
    {"id": "ex-3", "title": "Quorran Works", "text": "Quorran Works was founded by Ilda Marsk in 1979. Quorran Works employs 412 people."},
    {"id": "ex-4", "title": "Ilda Marsk", "text": "Ilda Marsk was born in Tessick. Ilda Marsk worked as a potter before starting a company."},
)
EXAMPLE_1HOP: tuple[tuple[str, str], ...] = (
    ("user", "Question: Which company makes the Tessick Lamp?"),
    ("assistant", '<tool_call>{"name": "search", "arguments": {"query": "who makes the Tessick Lamp"}}</tool_call>'),
    ("tool", "<tool_response>\n"
             "[1] Tessick Lamp: The Tessick Lamp is made by Quorran Works. The Tessick Lamp went on sale in 1994.\n"
             "[2] Vendle Lamp: The Vendle Lamp is made by Osprane Glass. The Vendle Lamp went on sale in 2001.\n"
             "[3] Ilda Marsk: Ilda Marsk was born in Tessick. Ilda Marsk worked as a potter before starting a company.\n"
             "</tool_response>"),
    ("assistant", "<answer>Quorran Works</answer>"),
)

# The `plan` option (QAOptions.plan): the count of searches, stated before the first one.
PLAN_INSTRUCTION = "Before the first search, write how many searches the question needs, as <think>searches: N</think>."


def plan_text(num_searches: int) -> str:
    return f"<think>searches: {num_searches}</think>"


# The `progress` option (QAOptions.progress): after each result, the searches done against the plan.
PROGRESS_INSTRUCTION = "After each search result, write <think>searches done: K of N</think> before the next search or the answer."


# The `evidence` option (QAOptions.evidence): the progress text also copies the fact just found.
EVIDENCE_INSTRUCTION = ("After each search result, write <think>S searches done: K of N</think> before the next search "
                        "or the answer, S the sentence of the result that answers the search.")


def progress_text(done: int, planned: int, evidence: str | None = None) -> str:
    return f"<think>{f'{evidence} ' if evidence else ''}searches done: {done} of {planned}</think>"


def progress_note(done: int, planned: int) -> str:
    """The `progress_note` option's text (QAOptions.progress_note)."""
    step = "search for the next entity" if done < planned else "answer now"
    return f"{done} of {planned} planned searches done: {step}."


EXAMPLES_BY_HOPS: dict[int, tuple[tuple[str, str], ...]] = {1: EXAMPLE_1HOP, 2: EXAMPLE_2HOP}
# The sentence of each worked example's search result that answers it (the `evidence` option).
EXAMPLE_FACTS_BY_HOPS: dict[int, tuple[str, ...]] = {
    1: ("The Tessick Lamp is made by Quorran Works.",),
    2: ("Brimbell Optics was founded by Oska Venn in 1987.", "Oska Venn was born in Lorrowby."),
}
EXAMPLE_MESSAGES = EXAMPLE_2HOP  # the default prompt's worked example

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
    retrieval_reward: float = 0.0
    """Weight of the `retrieval` process term (module docstring); 0 = no term."""
    retrieval_top_k: int = 3
    """A supporting passage counts only when a search ranks it among its first this many results."""
    worked_examples: list[int] = dataclasses.field(default_factory=lambda: [2])
    """Hop counts of the worked examples shown before the question, in order (each of 1 and 2 at
    most once); shown only when `env.worked_example` is on."""
    plan: bool = False
    """The first action of a worked example or demonstration begins with the number of searches the
    question needs, `<think>searches: N</think>` (N = its hop count), and the instructions ask for it."""
    progress: bool = False
    """Every action after a search result begins with the searches done against the plan,
    `<think>searches done: K of N</think>`, in the worked examples and the demonstrations, and the
    instructions ask for it. Needs `plan`."""
    evidence: bool = False
    """The progress text after a search result first copies the sentence of the result that answers
    the search, then states the count. Needs `progress`."""
    progress_note: bool = False
    """After each search the environment adds the searches made against the written count and the
    next step that count asks for. Needs `plan`."""

    def __post_init__(self) -> None:
        if self.retrieval_reward < 0 or self.retrieval_top_k < 1:
            raise ValueError(f"retrieval_reward must be >= 0 and retrieval_top_k >= 1, got "
                             f"{self.retrieval_reward} and {self.retrieval_top_k}")
        for name in ("progress", "progress_note"):
            if getattr(self, name) and not self.plan:
                raise ValueError(f"{name} = true needs plan = true (it counts the searches against the plan)")
        if self.evidence and not self.progress:
            raise ValueError("evidence = true needs progress = true (the fact is written in the progress text)")
        hops = list(self.worked_examples)
        if not hops or len(set(hops)) != len(hops) or any(h not in EXAMPLES_BY_HOPS for h in hops):
            raise ValueError(f"worked_examples must list distinct hop counts from {sorted(EXAMPLES_BY_HOPS)}, "
                             f"got {hops}")


class MultiHopQAEnv(ToolEnv):
    Options = QAOptions
    required_tools = ("search",)
    score_metric = "em"
    report_by = ("num_hops", "source")
    summary_metrics = ("em", "f1")
    user_prefix = "Question: "

    def intro(self) -> str:
        progress = EVIDENCE_INSTRUCTION if self.options.evidence else PROGRESS_INSTRUCTION
        return " ".join([INTRO, *([PLAN_INSTRUCTION] if self.options.plan else []),
                         *([progress] if self.options.progress else [])])

    def example_messages(self) -> tuple[tuple[str, str], ...]:
        return self._examples

    @functools.cached_property
    def _examples(self) -> tuple[tuple[str, str], ...]:
        """The worked-example turns of `worked_examples`, in order; built once."""
        messages = []
        for h in self.options.worked_examples:
            turns = EXAMPLES_BY_HOPS[h]
            actions = self._with_plan([content for role, content in turns if role == "assistant"],
                                      EXAMPLE_FACTS_BY_HOPS[h])
            it = iter(actions)
            searches = len(actions) - 1
            done = 0
            for role, content in turns:
                if role == "assistant":
                    content = next(it)
                elif role == "tool" and self.options.progress_note:
                    done += 1
                    content = f"{content}\n{progress_note(done, searches)}"
                messages.append((role, content))
        return tuple(messages)

    def _with_plan(self, actions: list[str], facts: list[str] | tuple[str, ...]) -> list[str]:
        """A solved episode's actions (one search per hop, then the answer) with the `plan` count
        before the first and, with `progress`, the searches done before each later one (and, with
        `evidence`, `facts[i]`: the sentence the i-th search found)."""
        n = len(actions) - 1
        evidence = list(facts) if self.options.evidence else [None] * n
        return [(plan_text(n) if self.options.plan and i == 0 else "")
                + (progress_text(i, n, evidence[i - 1]) if self.options.progress and i > 0 else "") + a
                for i, a in enumerate(actions)]

    def observation_note(self, state: EpisodeState) -> str | None:
        """With `progress_note`: the searches made against the written count, and what comes next."""
        if not self.options.progress_note:
            return None
        planned = self.planned_searches(state)
        if planned is None:  # no plan written: nothing to count against
            return None
        return progress_note(len(_searches(state)), planned)

    def planned_searches(self, state: EpisodeState) -> int | None:
        """The search count the policy wrote in its first action of the episode (`plan_text`), or None."""
        if not state.turns:
            return None
        first = state.turns[0]
        match = _PLAN.search(self.chat.decode(state.token_ids[first.action_start:first.action_end]))
        return int(match.group(1)) if match else None

    def reward(self, task: Task, episode: EpisodeState) -> Reward:
        if episode.answer is None:
            em = f1 = 0.0
        else:
            answer = episode.answer if isinstance(episode.answer, str) else str(episode.answer)
            em, f1 = exact_match(answer, answers(task)), f1_score(answer, answers(task))
        metrics = {"em": em, "f1": f1, **failure_labels(task, episode, em, self.options.retrieval_top_k)}
        terms = {}
        if self.options.retrieval_reward > 0 and task.metadata.get("supporting_ids"):
            terms["retrieval"] = self.options.retrieval_reward * retrieval_credit(task, episode, self.options.retrieval_top_k)
        return Reward(em if self.options.task_metric == "em" else f1, metrics, terms)

    def demonstration(self, task: Task) -> list[str] | None:
        queries = task.metadata.get("gold_queries") or []
        if not queries:
            return None
        facts = task.metadata.get("supporting_facts") or []
        if self.options.evidence and len(facts) != len(queries):
            raise ValueError(f"task {task.task_id}: evidence = true needs one supporting fact per gold query (metadata "
                             f"supporting_facts), got {len(facts)} for {len(queries)} queries")
        return self._with_plan([*(self.parser.format_call("search", {"query": q}) for q in queries),
                                self.parser.format_answer(answers(task)[0])], facts)

    async def baselines(self, tasks: list[Task]) -> dict[str, ToolEnv]:
        if "search" not in self.tools:
            return {}
        # Its one-exchange example whatever the agent's prompt options (`env.worked_example` too): the
        # baseline is a fixed method, and the untrained model without it answers in free sentences.
        rag = NaiveRAGEnv(self.chat, dataclasses.replace(self.config, max_turns=1, plain_text_is_answer=True,
                                                         worked_example=True),
                          self.options, parser=self.parser)
        await rag.retrieve(self.tools["search"], tasks, self.options.naive_rag_top_k)
        return {"naive_rag": rag}


def _searches(episode: EpisodeState) -> list:
    return [c for c in episode.calls if c.name == "search"]


_PLAN = re.compile(r"<think>searches: (\d+)</think>")  # plan_text



def retrieved_ids(episode: EpisodeState, top_k: int) -> set[str]:
    """Ids of the passages the episode's searches ranked among their first `top_k` results."""
    found = set()
    for call in _searches(episode):
        if call.success and isinstance(call.content, list):
            found.update(hit["id"] for hit in call.content[:top_k] if isinstance(hit, dict) and "id" in hit)
    return found


def retrieval_credit(task: Task, episode: EpisodeState, top_k: int) -> float:
    """found / max(hops, searches) in [0, 1] (module docstring)."""
    supporting = set(task.metadata.get("supporting_ids") or [])
    if not supporting:
        return 0.0
    found = len(supporting & retrieved_ids(episode, top_k))
    return found / max(len(supporting), len(_searches(episode)))


FAILURE_LABELS = ("fail_truncated", "fail_stopped_early", "fail_intermediate", "fail_query", "fail_retrieved")
"""Why a wrong episode was wrong (each 0 or 1; more than one can hold):
fail_truncated      ended without an answer (turn or token limit)
fail_stopped_early  answered after fewer searches than the question has hops
fail_intermediate   answered with a bridge entity (an intermediate hop's answer)
fail_query          searched at least once per hop (or repeated a query) but some supporting
                    passage was never among a search's first top-k results
fail_retrieved      every supporting passage was retrieved, the answer is still wrong"""


def failure_labels(task: Task, episode: EpisodeState, em: float, top_k: int) -> dict[str, float]:
    """The FAILURE_LABELS of a finished episode; all 0 for a right one (or without supporting ids)."""
    labels = dict.fromkeys(FAILURE_LABELS, 0.0)
    supporting = set(task.metadata.get("supporting_ids") or [])
    if em >= 1.0 or not supporting:
        return labels
    searches = _searches(episode)
    all_found = supporting <= retrieved_ids(episode, top_k)
    if episode.answer is None:
        labels["fail_truncated"] = 1.0
    else:
        labels["fail_stopped_early"] = float(len(searches) < num_hops(task))
        bridges = task.metadata.get("intermediate_answers") or []
        labels["fail_intermediate"] = exact_match(str(episode.answer), bridges) if bridges else 0.0
    repeated = any(c.repeated for c in searches)
    labels["fail_query"] = float(not all_found and (len(searches) >= num_hops(task) or repeated))
    labels["fail_retrieved"] = float(all_found and episode.answer is not None)
    return labels


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
