"""Multi-hop QA: the retrieval process term and its anti-gaming rules, the failure labels, the
tool-disabled evaluation's environment, and their per-hop summaries (scripted episodes through the
real environment and a real BM25 index over the synthetic world; no server needed)."""

from __future__ import annotations

import dataclasses

import pytest
from transformers import AutoTokenizer

from agentrl.common.model import prepare_model
from agentrl.engine.chat import ChatFormat
from agentrl.engine.env import CallRecord, EnvConfig, format_content
from agentrl.engine.episode import SamplingConfig, ScriptedPolicy, run_episode
from agentrl.engine.evaluation import summarize
from agentrl.engine.tools import LocalSearchTool
from agentrl.envs.multihop_qa.env import (
    EXAMPLE_1HOP,
    EXAMPLE_1HOP_PASSAGES,
    FAILURE_LABELS,
    NAIVE_RAG_EXAMPLE_MESSAGES,
    MultiHopQAEnv,
    QAOptions,
    retrieval_credit,
)
from agentrl.envs.multihop_qa.tasks import SyntheticQAConfig, synthetic_tasks
from agentrl.report import failure_table


@pytest.fixture(scope="module")
def chat():
    return ChatFormat(AutoTokenizer.from_pretrained(prepare_model()))


@pytest.fixture(scope="module")
def world_tasks():
    return synthetic_tasks(split="heldout", num=16, hops=(1, 2), config=SyntheticQAConfig(num_companies=60))


def make_env(chat, world, **options) -> MultiHopQAEnv:
    env = MultiHopQAEnv(chat, EnvConfig(max_turns=5), QAOptions(**options))
    env.register_tool(LocalSearchTool(world.passages))
    return env


def search(query: str, top_k: int | None = None) -> str:
    args = f'"query": "{query}"' + (f', "top_k": {top_k}' if top_k else "")
    return f'<tool_call>{{"name": "search", "arguments": {{{args}}}}}</tool_call>'


def answer(text: str) -> str:
    return f"<answer>{text}</answer>"


async def play(env, task, actions):
    return await run_episode(env, task, ScriptedPolicy(env, actions), SamplingConfig(), group_id="g")


def two_hop(tasks):
    return next(t for t in tasks if t.metadata["num_hops"] == 2)


async def test_retrieval_term_pays_for_the_second_hop_and_not_for_dumping(chat, world_tasks):
    world, tasks = world_tasks
    env = make_env(chat, world, retrieval_reward=0.4)
    task = two_hop(tasks)
    q1, q2 = task.metadata["gold_queries"]
    bridge = task.metadata["intermediate_answers"][0]

    chained = await play(env, task, [search(q1), search(q2), answer("nobody")])
    stopped = await play(env, task, [search(q1), answer(bridge)])
    padded = await play(env, task, [search(q1), search(q2), search("weather"), search(q2 + " again"), answer("nobody")])
    right = await play(env, task, [search(q1), search(q2), answer(task.reference[0])])
    term = {name: t.turns[-1].process_rewards["retrieval"] for name, t in
            (("chained", chained), ("stopped", stopped), ("padded", padded), ("right", right))}
    # Both wrong, yet the episode that chained the bridge search is paid more than the one that stopped.
    assert chained.metrics["em"] == stopped.metrics["em"] == 0.0
    assert term["chained"] == pytest.approx(0.4) and term["stopped"] == pytest.approx(0.2)
    # Every search beyond the hop count lowers the credit: 2 found / 4 searches.
    assert term["padded"] == pytest.approx(0.2) and term["padded"] < term["chained"]
    assert term["right"] == pytest.approx(0.4) and right.metrics["em"] == 1.0
    # The term is recorded on the last turn only, once.
    assert all("retrieval" not in t.process_rewards for t in chained.turns[:-1])
    # Off by default: the main job's rewards are unchanged unless the option is set.
    plain = await play(make_env(chat, world), task, [search(q1), search(q2), answer("nobody")])
    assert "retrieval" not in plain.turns[-1].process_rewards


def test_retrieval_credit_counts_only_the_first_top_k_results(world_tasks):
    _, tasks = world_tasks
    task = two_hop(tasks)
    first, second = task.metadata["supporting_ids"]

    class Episode:
        def __init__(self, calls):
            self.calls = calls

    def hits(*ids):
        return [{"id": i, "title": i, "text": ""} for i in ids]

    # Asking for many results buys nothing: the second passage at rank 4 does not count.
    dump = Episode([CallRecord(0, "search", {"query": "x", "top_k": 10}, True, hits(first, "a", "b", second, "c"))])
    assert retrieval_credit(task, dump, top_k=3) == pytest.approx(0.5)
    assert retrieval_credit(task, dump, top_k=5) == pytest.approx(1.0)
    # A failed search and another tool's output never count; repeats count as searches made.
    other = Episode([CallRecord(0, "search", {"query": "x"}, False, None, "timeout"),
                     CallRecord(1, "python", {"code": "x"}, True, hits(first, second))])
    assert retrieval_credit(task, other, top_k=3) == 0.0
    repeated = Episode([CallRecord(0, "search", {"query": "x"}, True, hits(first)),
                        CallRecord(1, "search", {"query": "x"}, True, hits(first), repeated=True),
                        CallRecord(2, "search", {"query": "y"}, True, hits(second))])
    assert retrieval_credit(task, repeated, top_k=3) == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="retrieval"):
        QAOptions(retrieval_reward=-1.0)


async def test_failure_labels_name_why_a_multi_hop_answer_is_wrong(chat, world_tasks):
    world, tasks = world_tasks
    env = make_env(chat, world)
    task = two_hop(tasks)
    q1, q2 = task.metadata["gold_queries"]
    bridge = task.metadata["intermediate_answers"][0]

    def labels(traj):
        return {k.removeprefix("fail_") for k in FAILURE_LABELS if traj.metrics[k] == 1.0}

    assert labels(await play(env, task, [search(q1), answer(bridge)])) == {"stopped_early", "intermediate"}
    assert labels(await play(env, task, [search(q1), search(q1), answer("x")])) == {"query"}
    assert labels(await play(env, task, [search(q1), search("weather"), answer("x")])) == {"query"}
    assert labels(await play(env, task, [search(q1), search(q2), answer("x")])) == {"retrieved"}
    assert labels(await play(env, task, [search(q1)] + [search(f"more {i}") for i in range(4)])) == {"truncated", "query"}
    assert labels(await play(env, task, [search(q1), search(q2), answer(task.reference[0])])) == set()


async def test_tool_disabled_environment_keeps_the_prompt_and_fails_every_call(chat, world_tasks):
    world, tasks = world_tasks
    env = make_env(chat, world)
    disabled = env.with_tools_disabled()
    task = two_hop(tasks)
    assert disabled.reset(task).token_ids == env.reset(task).token_ids
    traj = await play(disabled, task, [search(task.metadata["gold_queries"][0]), answer("x")])
    text = chat.decode(traj.token_ids.tolist())
    assert "disabled in this evaluation" in text and "[1]" not in text.split("disabled in this evaluation")[1]
    assert traj.metrics["fail_stopped_early"] == 1.0  # no search succeeded
    # The original environment still searches.
    again = await play(env, task, [search(task.metadata["gold_queries"][0]), answer("x")])
    assert "disabled" not in chat.decode(again.token_ids.tolist())


async def test_per_hop_summary_and_report_carry_the_failure_shares(chat, world_tasks):
    world, tasks = world_tasks
    env = make_env(chat, world)
    one_hop = [t for t in tasks if t.metadata["num_hops"] == 1][:2]
    two = [t for t in tasks if t.metadata["num_hops"] == 2][:2]
    trajs = [await play(env, t, [search(t.metadata["gold_queries"][0]), answer(t.reference[0])]) for t in one_hop]
    trajs += [await play(env, t, [search(t.metadata["gold_queries"][0]), answer(t.metadata["intermediate_answers"][0])])
              for t in two]
    summary = summarize("final", env, one_hop + two, trajs)
    assert summary["by_num_hops"]["1"]["score"] == 1.0 and summary["by_num_hops"]["1"]["fail_stopped_early"] == 0.0
    assert summary["by_num_hops"]["2"]["score"] == 0.0 and summary["by_num_hops"]["2"]["fail_intermediate"] == 1.0
    assert summary["em_num_hops_1"] == 1.0 and summary["em_num_hops_2"] == 0.0  # flat, for the curves
    table = "\n".join(failure_table([("After RL (final)", summary)]))
    assert "| After RL (final) | 2 | 2 | 0.000 | 1.00 | 0.00 | 0.00 | 1.00 | 0.00 |" in table
    assert "| intermediate | query | retrieved | stopped_early | truncated |" in table


def test_worked_examples_option_orders_the_examples_before_the_question(chat, world_tasks):
    world, tasks = world_tasks
    task = two_hop(tasks)

    def prompt(**options) -> str:
        return chat.decode(make_env(chat, world, **options).reset(task).token_ids)

    one, two, question = "Which company makes the Tessick Lamp?", "the founder of Brimbell Optics", task.prompt
    default = prompt()
    assert two in default and one not in default and default.index(two) < default.rindex(question)
    both = prompt(worked_examples=[1, 2])
    assert both.index(one) < both.index(two) < both.rindex(question)
    assert "<answer>Quorran Works</answer>" in both
    flipped = prompt(worked_examples=[2, 1])
    assert flipped.index(two) < flipped.index(one) < flipped.rindex(question)
    assert one in prompt(worked_examples=[1]) and two not in prompt(worked_examples=[1])
    for bad in ([], [3], [1, 1]):
        with pytest.raises(ValueError, match="worked_examples"):
            QAOptions(worked_examples=bad)


def test_the_one_hop_worked_example_shows_what_the_real_search_returns():
    # The example's tool turn is the search tool's own result over the example's made-up passages,
    # rendered as the environment renders tool results: the policy sees the same layout in the
    # example as in its episodes (three ranked passages, the answer in [1]).
    tool = LocalSearchTool(list(EXAMPLE_1HOP_PASSAGES))
    (_, question), (_, call), (_, response), (_, final) = EXAMPLE_1HOP
    query = call.split('"query": "')[1].split('"')[0]
    assert response == f"<tool_response>\n{format_content(tool.search(query))}\n</tool_response>"
    assert response.count("\n[") == 3 and "[1] Tessick Lamp" in response
    assert final == "<answer>Quorran Works</answer>" and "Quorran Works" in response.split("[2]")[0]


async def test_plan_option_states_the_search_count_in_examples_and_demonstrations(chat, world_tasks):
    world, tasks = world_tasks
    env = make_env(chat, world, plan=True, worked_examples=[1, 2])
    plain = make_env(chat, world, worked_examples=[1, 2])
    one = next(t for t in tasks if t.metadata["num_hops"] == 1)
    two = two_hop(tasks)
    # Demonstrations: the count is the question's hop count, before the first call only.
    for task, n in ((one, 1), (two, 2)):
        actions = env.demonstration(task)
        assert actions[0].startswith(f"<think>searches: {n}</think><tool_call>")
        assert not any("<think>" in a for a in actions[1:])
        assert actions[0].removeprefix(f"<think>searches: {n}</think>") == plain.demonstration(task)[0]
        # The demonstration still plays as a correct episode: the count is no parse error.
        traj = await play(env, task, actions)
        assert traj.metrics["em"] == 1.0 and traj.metrics["num_tool_calls"] == n
        assert not any(t.process_rewards.get("malformed_call") for t in traj.turns)
    # Worked examples: each first assistant turn carries its own count; the instructions ask for it.
    prompt = chat.decode(env.reset(two).token_ids)
    assert prompt.count("<think>searches: 1</think>") == 1 and prompt.count("<think>searches: 2</think>") == 1
    assert prompt.index("<think>searches: 1</think>") < prompt.index("Tessick Lamp is made by")
    assert "how many searches" in env.system_prompt
    default = make_env(chat, world)
    assert "<think>" not in chat.decode(default.reset(two).token_ids) and "how many searches" not in default.system_prompt
    assert not any("<think>" in a for a in default.demonstration(two))


async def test_naive_rag_baseline_keeps_its_own_example(chat, world_tasks):
    # The baseline subclasses the agent's environment; it must not inherit the agent's tool-calling
    # worked examples (it has no tools and one turn).
    world, tasks = world_tasks
    env = make_env(chat, world, plan=True, worked_examples=[1, 2])
    rag = (await env.baselines(tasks))["naive_rag"]
    for task in tasks:
        text = chat.decode(rag.reset(task).token_ids)
        assert NAIVE_RAG_EXAMPLE_MESSAGES[0][1] in text and "<tool_call>" not in text and "Tessick Lamp" not in text


async def test_naive_rag_baseline_keeps_its_own_example_when_the_agent_has_none(chat, world_tasks):
    # With `env.worked_example = false` the agent's prompt has no example; the baseline is a fixed
    # method and keeps its own (without it the untrained model answers in free sentences: EM 0).
    world, tasks = world_tasks
    env = MultiHopQAEnv(chat, EnvConfig(max_turns=5, worked_example=False), QAOptions())
    env.register_tool(LocalSearchTool(world.passages))
    assert "Brimbell Optics" not in chat.decode(env.reset(tasks[0]).token_ids)
    rag = (await env.baselines(tasks))["naive_rag"]
    assert NAIVE_RAG_EXAMPLE_MESSAGES[0][1] in chat.decode(rag.reset(tasks[0]).token_ids)


async def test_progress_option_counts_the_searches_done_against_the_plan(chat, world_tasks):
    world, tasks = world_tasks
    env = make_env(chat, world, plan=True, progress=True, worked_examples=[1, 2])
    plan_only = make_env(chat, world, plan=True, worked_examples=[1, 2])
    one = next(t for t in tasks if t.metadata["num_hops"] == 1)
    two = two_hop(tasks)
    assert env.demonstration(one)[1].startswith("<think>searches done: 1 of 1</think><answer>")
    actions = env.demonstration(two)
    assert actions[0] == plan_only.demonstration(two)[0]  # the plan, as without progress
    assert actions[1].startswith("<think>searches done: 1 of 2</think><tool_call>")
    assert actions[2].startswith("<think>searches done: 2 of 2</think><answer>")
    assert [a.split("</think>")[-1] for a in actions] == [a.split("</think>")[-1] for a in plan_only.demonstration(two)]
    traj = await play(env, two, actions)  # still a correct episode: the progress text is no parse error
    assert traj.metrics["em"] == 1.0 and traj.metrics["num_tool_calls"] == 2
    assert not any(t.process_rewards.get("malformed_call") for t in traj.turns)
    prompt = chat.decode(env.reset(two).token_ids)
    assert prompt.count("<think>searches done: 1 of 1</think>") == 1  # the 1-hop worked example
    assert prompt.count("<think>searches done: 1 of 2</think>") == 1 and prompt.count("<think>searches done: 2 of 2</think>") == 1
    assert "searches done: K of N" in env.system_prompt and "searches done" not in plan_only.system_prompt
    with pytest.raises(ValueError, match="needs plan"):
        QAOptions(progress=True)


async def test_evidence_option_copies_the_fact_each_search_found(chat, world_tasks):
    world, tasks = world_tasks
    env = make_env(chat, world, plan=True, progress=True, evidence=True, worked_examples=[1, 2])
    progress_only = make_env(chat, world, plan=True, progress=True, worked_examples=[1, 2])
    two = two_hop(tasks)
    facts = two.metadata["supporting_facts"]
    bridge, gold = two.metadata["intermediate_answers"][0], two.reference[0]
    # The world's sentences: the first states the bridge, the second the answer, each ends its own fact.
    assert len(facts) == 2 and bridge in facts[0] and gold in facts[1]
    actions = env.demonstration(two)
    assert actions[0] == progress_only.demonstration(two)[0]
    # The sentence first, the count last: the step that decides what comes next follows the count.
    assert actions[1].startswith(f"<think>{facts[0]} searches done: 1 of 2</think><tool_call>")
    assert actions[2] == f"<think>{facts[1]} searches done: 2 of 2</think><answer>{gold}</answer>"
    assert [a.split("</think>")[-1] for a in actions] == [a.split("</think>")[-1] for a in progress_only.demonstration(two)]
    # Each copied sentence is in the search result before it (a real BM25 search over the world).
    traj = await play(env, two, actions)
    assert traj.metrics["em"] == 1.0 and traj.metrics["num_tool_calls"] == 2
    text = chat.decode(traj.token_ids[traj.prompt_len:])
    for fact in facts:
        assert text.index(fact) < text.index(f"<think>{fact} searches done")
    # The worked examples copy theirs, each found in the example's own result; the instructions ask.
    prompt = chat.decode(env.reset(two).token_ids)
    for fact in ("The Tessick Lamp is made by Quorran Works.", "Oska Venn was born in Lorrowby."):
        assert prompt.count(fact) == 2 and f"<think>{fact} searches done" in prompt
    assert "the sentence of the result" in env.system_prompt and "the sentence" not in progress_only.system_prompt
    with pytest.raises(ValueError, match="needs progress"):
        QAOptions(plan=True, evidence=True)
    bare = dataclasses.replace(two, metadata={**two.metadata, "supporting_facts": []})
    with pytest.raises(ValueError, match="one supporting fact per gold query"):
        env.demonstration(bare)


async def test_progress_note_ends_each_search_result_with_the_count_and_the_next_step(chat, world_tasks):
    from agentrl.engine.episode import build_demonstration

    world, tasks = world_tasks

    def env_with(worked_example=False, **options):
        env = MultiHopQAEnv(chat, EnvConfig(max_turns=5, worked_example=worked_example), QAOptions(**options))
        env.register_tool(LocalSearchTool(world.passages))
        return env

    def notes(traj):
        return chat.decode(traj.token_ids).count("planned searches done")

    env = env_with(plan=True, progress=True, progress_note=True)
    two = two_hop(tasks)
    q1, q2 = two.metadata["gold_queries"]
    traj = await play(env, two, ["<think>searches: 2</think>" + search(q1), search(q2), answer(two.reference[0])])
    text = chat.decode(traj.token_ids)
    first, second = text.index("1 of 2 planned searches done: search for the next entity."), text.index("2 of 2 planned searches done: answer now.")
    # Each note ends its tool message (the policy reads it right before deciding) and is not trained.
    assert text.index("</tool_response>") < first < text.index(search(q2)) < second and traj.metrics["em"] == 1.0
    obs = [i for i, a in enumerate(traj.is_action) if not a]
    assert chat.decode([traj.token_ids[i] for i in obs]).count("planned searches done") == 2 == notes(traj)
    # The count is the policy's: a wrong one is counted against as written.
    traj = await play(env, two, ["<think>searches: 1</think>" + search(q1), answer("Nowhere")])
    assert "1 of 1 planned searches done: answer now." in chat.decode(traj.token_ids)
    # No count written, or the option off: no note.
    assert notes(await play(env, two, [search(q1), answer("x")])) == 0
    plain = env_with(plan=True, progress=True)
    assert notes(await play(plain, two, ["<think>searches: 2</think>" + search(q1), answer("x")])) == 0
    # The SFT demonstrations carry the notes (they run through the same step), and so do the worked examples.
    assert notes(await build_demonstration(env, two)) == 2
    shown = env_with(worked_example=True, plan=True, progress_note=True)
    assert notes(await play(shown, two, [answer("x")])) == 2  # the 2-hop worked example's two results
    # A long result is cut before the note, not the note itself.
    short = env_with(plan=True, progress_note=True)
    short.config.max_observation_tokens = 24
    text = chat.decode((await play(short, two, ["<think>searches: 2</think>" + search(q1), answer("x")])).token_ids)
    assert "1 of 2 planned searches done: search for the next entity." in text
    with pytest.raises(ValueError, match="needs plan"):
        QAOptions(progress_note=True)
