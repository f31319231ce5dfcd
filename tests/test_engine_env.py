"""ToolEnv, parser, chat ids and rewards, driven by scripted actions (no server needed)."""

from __future__ import annotations

import asyncio

import pytest
from transformers import AutoTokenizer

from agentrl.common.inference import Generation
from agentrl.common.model import prepare_model
from agentrl.common.trajectory import TrajectoryGroup, decode_group, encode_group
from agentrl.engine import rewards as R
from agentrl.engine.chat import ChatFormat, render
from agentrl.engine.env import EnvConfig, ToolEnv
from agentrl.engine.episode import SamplingConfig, ScriptedPolicy, build_demonstration, run_episode
from agentrl.engine.tools import FunctionTool, LocalSearchTool, ToolUnavailable
from agentrl.envs.multihop_qa.env import MultiHopQAEnv
from agentrl.envs.multihop_qa.tasks import SyntheticQAConfig, synthetic_tasks

# A malformed-call corpus: each line is one action a policy might produce.
MALFORMED_ACTIONS = [
    "",
    "I think the answer is probably somewhere.",
    "<tool_call>{\"name\": \"search\", \"arguments\": {\"query\": \"x\"}",                  # truncated tag
    "<tool_call>{name: search}</tool_call>",                                                # bad JSON
    "<tool_call>[1, 2, 3]</tool_call>",                                                     # not an object
    "<tool_call>{\"name\": \"search\", \"arguments\": \"not json\"}</tool_call>",         # arguments not an object
    "<tool_call>{\"name\": \"browse\", \"arguments\": {\"url\": \"x\"}}</tool_call>",     # unknown tool
    "<tool_call>{\"name\": \"search\", \"arguments\": {\"q\": \"x\"}}</tool_call>",       # schema: missing query
    "<tool_call>{\"name\": \"search\", \"arguments\": {\"query\": 5}}</tool_call>",       # schema: wrong type
    "<tool_call>{\"name\": \"search\", \"arguments\": {\"query\": \"x\", \"top_k\": 99}}</tool_call>",  # schema: out of range
    "<tool_call></tool_call>",
    "<tool_call><tool_call>{}</tool_call></tool_call>",
    "<answer>unfinished",
    "</tool_call></answer>",
    "<tool_call>{\"name\": \"boom\", \"arguments\": {}}</tool_call>",                       # tool raises
    "<tool_call>{\"name\": \"slow\", \"arguments\": {}}</tool_call>",                       # tool times out
    "\u00ff\u2603 <tool_call>{\"name\": \"search\", \"arguments\": {\"query\": \"\u2603\"}}</tool_call>",
    "<tool_call>" * 50,
]


@pytest.fixture(scope="module")
def chat():
    return ChatFormat(AutoTokenizer.from_pretrained(prepare_model()))


@pytest.fixture(scope="module")
def world_tasks():
    return synthetic_tasks(split="heldout", num=8, config=SyntheticQAConfig(num_companies=40))


def make_env(chat, world, **config) -> ToolEnv:
    env = MultiHopQAEnv(chat, EnvConfig(**config))
    env.register_tool(LocalSearchTool(world.passages))
    env.register_tool(FunctionTool("boom", "always fails", {"type": "object", "properties": {}}, lambda: 1 / 0))

    async def slow():
        await asyncio.sleep(30)

    env.register_tool(FunctionTool("slow", "never answers in time", {"type": "object", "properties": {}}, slow))
    return env


def test_chatml_boundaries_are_single_special_ids(chat):
    assert chat.assistant_head_ids[0] == chat.im_start_id and chat.turn_end_ids[0] == chat.im_end_id
    assert chat.decode(chat.message("user", "hi")) == render([("user", "hi", "<|im_end|>\n")])
    assert chat.im_end_id in chat.stop_token_ids


async def test_malformed_corpus_never_crashes_and_is_penalised(chat, world_tasks):
    world, tasks = world_tasks
    env = make_env(chat, world, max_turns=len(MALFORMED_ACTIONS) + 1, max_total_tokens=16384, tool_timeout_s=0.2)
    traj = await run_episode(env, tasks[0], ScriptedPolicy(env, [*MALFORMED_ACTIONS, "<answer>x</answer>"]),
                             SamplingConfig(), group_id="g")
    assert traj.status == "ok" and len(traj.turns) == len(MALFORMED_ACTIONS) + 1
    rewards = [t.process_rewards for t in traj.turns]
    for i, action in enumerate(MALFORMED_ACTIONS):
        if "search" in action and "\u2603\"}}" in action:
            assert rewards[i].get("valid_call", 0) > 0  # the only well-formed call in the corpus
        elif '"boom"' in action or '"slow"' in action:
            assert rewards[i] == {"valid_call": 0.1}  # well-formed, but the tool failed: no success reward
        else:
            assert sum(rewards[i].values()) < 0, (action, rewards[i])
    text = chat.decode(traj.token_ids.tolist())
    assert "unknown tool 'browse'" in text and "invalid arguments" in text and "ZeroDivisionError" in text
    assert "timed out" in text and "not closed" in text


async def test_gold_trajectory_decodes_to_conversation_and_masks_actions(chat, world_tasks):
    world, tasks = world_tasks
    env = make_env(chat, world, max_turns=5)
    task = next(t for t in tasks if t.metadata["num_hops"] >= 2)
    traj = await build_demonstration(env, task)
    assert traj.status == "ok" and traj.task_reward == 1.0 and len(traj.turns) == task.metadata["num_hops"] + 1
    text = chat.decode(traj.token_ids.tolist())
    for pid in task.metadata["supporting_ids"]:  # the real corpus passages came back through the search tool
        assert next(p["text"] for p in world.passages if p["id"] == pid) in text
    ids = traj.token_ids.tolist()
    for turn in traj.turns:
        action_text = chat.decode(ids[turn.action_start:turn.action_end])
        assert action_text.startswith(("<tool_call>", "<answer>")) and action_text.endswith("<|im_end|>")
        assert traj.is_action[turn.action_start:turn.action_end].all()
    assert int(traj.is_action.sum()) == sum(t.action_end - t.action_start for t in traj.turns)
    assert decode_group(encode_group(TrajectoryGroup("g", task.task_id, [traj]))).trajectories[0].turns == traj.turns


def test_short_prompt_options_list_every_tool_and_drop_the_example(chat, world_tasks):
    world, tasks = world_tasks
    long_env = make_env(chat, world)
    short_env = make_env(chat, world, tool_list="signature", worked_example=False)
    long_state, short_state = long_env.reset(tasks[0]), short_env.reset(tasks[0])
    assert "Brimbell Optics" in chat.decode(long_state.token_ids)  # the worked example
    short_text = chat.decode(short_state.token_ids)
    assert "Brimbell Optics" not in short_text and short_text.endswith(f"Question: {tasks[0].prompt}<|im_end|>\n<|im_start|>assistant\n")
    assert "search(query: string, top_k?: integer): " in short_text and "boom(): always fails" in short_text
    assert short_state.prompt_len < long_state.prompt_len - 200
    with pytest.raises(ValueError, match="tool_list"):
        EnvConfig(tool_list="xml")


async def test_cut_after_answer_keeps_exact_prefix_of_generated_ids(chat, world_tasks):
    world, tasks = world_tasks
    env = make_env(chat, world)
    state = env.reset(tasks[0])
    ids = chat.encode("<answer>" + tasks[0].reference[0] + "</answer> and then some rambling text")
    logprobs = [-0.1 * (i + 1) for i in range(len(ids))]
    await env.step(state, Generation(ids, logprobs, "length", [7] * len(ids), "x"))
    traj = state.to_trajectory("g", 0)
    kept = traj.token_ids[traj.prompt_len:].tolist()
    assert kept == ids[: len(kept)] and len(kept) < len(ids)
    assert chat.decode(kept).startswith("<answer>" + tasks[0].reference[0] + "</answer>")
    assert traj.behavior_logprobs[traj.prompt_len:].tolist() == pytest.approx(logprobs[: len(kept)])
    assert traj.task_reward == 1.0 and set(traj.policy_versions[traj.is_action.astype(bool)]) == {7}


async def test_limits_truncate_and_duplicates_cost(chat, world_tasks):
    world, tasks = world_tasks
    env = make_env(chat, world, max_turns=3, max_calls_per_turn=1, rewards=R.ProcessRewardConfig(no_answer=-0.5))
    call = '<tool_call>{"name": "search", "arguments": {"query": "founder"}}</tool_call>'
    traj = await run_episode(env, tasks[0], ScriptedPolicy(env, [call + call, call, call]), SamplingConfig(), group_id="g")
    assert traj.status == "truncated" and len(traj.turns) == 3
    assert traj.turns[0].process_rewards["over_limit"] < 0
    assert traj.turns[1].process_rewards["duplicate_call"] < 0 and "tool_success" not in traj.turns[1].process_rewards
    assert traj.metrics["em"] == 0.0
    # Ending without an answer costs no_answer once, on the last turn only.
    assert traj.turns[-1].process_rewards["no_answer"] == env.config.rewards.no_answer < 0
    assert all("no_answer" not in t.process_rewards for t in traj.turns[:-1])
    answered = await run_episode(env, tasks[0], ScriptedPolicy(env, [call, "<answer>x</answer>"]), SamplingConfig(), group_id="g")
    assert answered.status == "ok" and all("no_answer" not in t.process_rewards for t in answered.turns)


async def test_tool_infrastructure_failure_marks_episode_failed(chat, world_tasks):
    world, tasks = world_tasks
    env = make_env(chat, world)

    env.tools["search"].execute = _raise_unavailable  # the search service lost its last replica
    call = '<tool_call>{"name": "search", "arguments": {"query": "x"}}</tool_call>'
    traj = await run_episode(env, tasks[0], ScriptedPolicy(env, [call]), SamplingConfig(), group_id="g")
    assert traj.status == "failed" and "no live replica" in traj.error and traj.is_action.sum() > 0


async def _raise_unavailable(arguments, timeout_s=None):
    raise ToolUnavailable("no live replica")


class _SearchFirst(MultiHopQAEnv):
    """A rule the action can break (the `refuse` hook): an answer before any search is not taken."""

    def refuse(self, state, parsed):
        if parsed.answer is not None and not state.calls:
            return "search before answering"
        return None


async def test_a_refused_action_is_not_carried_out_and_the_turn_counts(chat, world_tasks):
    world, tasks = world_tasks
    env = _SearchFirst(chat, EnvConfig(max_turns=3))
    env.register_tool(LocalSearchTool(world.passages))
    call = '<tool_call>{"name": "search", "arguments": {"query": "founder"}}</tool_call>'
    traj = await run_episode(env, tasks[0], ScriptedPolicy(env, ["<answer>x</answer>", call, "<answer>y</answer>"]),
                             SamplingConfig(), group_id="g")
    # The early answer did not end the episode: the policy was shown why, the turn cost no_action,
    # and the episode went on to the search and the answer after it.
    assert traj.status == "ok" and len(traj.turns) == 3 and traj.metrics["num_tool_calls"] == 1
    assert "search before answering" in chat.decode(traj.token_ids)
    assert traj.turns[0].process_rewards.get("no_action") == env.config.rewards.no_action
    assert "no_action" not in traj.turns[1].process_rewards
