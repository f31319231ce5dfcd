"""10,000 generated malformed or adversarial model outputs through the environment, with real tool
services (calculator and search over ZeroMQ): no episode may fail or crash, every trajectory keeps
its invariants, and the services still answer a good call afterwards.

The outputs come from a seeded generator over the classes that have broken agent runs: JSON escapes
that decode to lone surrogates (msgpack cannot pack them), integers past 64 bits, `1e999` (inf),
NaN/Infinity literals, nesting 1,000-5,000 deep (RecursionError in `json`), duplicate keys, wrong
types, unknown tools, unclosed and nested tags, imagined tool responses, control characters, long
strings, huge calculator work, and raw token-id sequences drawn from the whole vocabulary
(special tokens included), as a sampling policy can emit them. Each episode runs one of the three
tool-call parsers (Hermes, Llama 3 JSON, Mistral). Generation is cut at the turn's token budget as
a server's would be (finish reason "length"). Strings stay under ~1,500 characters: longer single
words cost the stand-in policy's own BPE encode quadratic time (a real server returns ids).
"""

from __future__ import annotations

import asyncio
import json
import random

import pytest
from transformers import AutoTokenizer

from agentrl.common.inference import Generation
from agentrl.common.model import prepare_model
from agentrl.engine.chat import ChatFormat
from agentrl.engine.env import EnvConfig
from agentrl.engine.episode import SamplingConfig, run_episode
from agentrl.engine.parsers import HermesParser, Llama3JsonParser, MistralParser
from agentrl.engine.tools import remote_tools
from agentrl.envs.multihop_qa.env import MultiHopQAEnv
from agentrl.envs.multihop_qa.tasks import SyntheticQAConfig, synthetic_tasks, write_passages
from agentrl.toolservers.client import ToolClient
from agentrl.toolservers.process import start_toolserver

NUM_OUTPUTS = 10_000
ACTIONS_PER_EPISODE = 4
CONCURRENT_EPISODES = 64


def _value(rng: random.Random, depth: int = 0):
    """A JSON value as text, often one the wire cannot carry."""
    kind = rng.randrange(14 if depth < 3 else 9)
    if kind == 0:
        return json.dumps(rng.choice(["x", "2+2", "Acme", "", " " * 50, "\u2603\u00ff", "9**9**9", "1/0"]))
    if kind == 1:
        return rng.choice(['"\\ud800"', '"a\\udfff b"', '"\\ud83d"', '"\\u0000\\u001f"', '"\\\\"'])
    if kind == 2:
        return str(rng.choice([0, -1, 2**63, 2**64, -(2**63) - 1, 10**40, 7]))
    if kind == 3:
        return rng.choice(["1e999", "-1e999", "NaN", "Infinity", "-Infinity", "1.5", "1e-400"])
    if kind == 4:
        return rng.choice(["true", "false", "null"])
    if kind == 5:
        n = rng.choice([40, 1000, 5000])
        return "[" * n + "]" * n
    if kind == 6:
        return json.dumps("z" * rng.choice([1, 300, 1500]))
    if kind == 7:
        return '"unterminated'
    if kind == 8:
        return rng.choice(["{", "}", "[1,]", "{'a': 1}", "0x10", "undefined"])
    if kind in (9, 10, 11):
        keys = rng.sample(["query", "expression", "top_k", "q", "a", "expression"], rng.randint(0, 3))
        return "{" + ", ".join(f'"{k}": {_value(rng, depth + 1)}' for k in keys) + "}"
    return "[" + ", ".join(_value(rng, depth + 1) for _ in range(rng.randint(0, 3))) + "]"


def _call_json(rng: random.Random) -> str:
    name = rng.choice(['"calculator"', '"search"', '"browse"', '""', "5", '"\\ud800"', '"search"'])
    arguments = _value(rng) if rng.random() < 0.5 else rng.choice([
        '{"expression": "' + rng.choice(["2+2", "10**100", "9**9**9**9", "1/0", "(" * 300, "2**10000"]) + '"}',
        '{"query": ' + _value(rng) + "}",
        '{"query": "Acme founder", "top_k": ' + _value(rng) + "}",
        '{"query": "Acme", "query": 5}',
    ])
    key = rng.choice(["arguments", "arguments", "parameters", "args"])
    return "{" + f'"name": {name}, "{key}": {arguments}' + "}"


def _text_output(rng: random.Random) -> str:
    pieces = []
    for _ in range(rng.randint(1, 4)):
        form = rng.randrange(10)
        if form <= 3:
            pieces.append(f"<tool_call>{_call_json(rng)}</tool_call>")
        elif form == 4:
            pieces.append(f"<tool_call>{_call_json(rng)}")  # unclosed
        elif form == 5:
            pieces.append(f"[TOOL_CALLS][{_call_json(rng)}]" if rng.random() < 0.5 else f"[TOOL_CALLS]search[ARGS]{_value(rng)}")
        elif form == 6:
            pieces.append(_call_json(rng) + rng.choice(["", ";", "; " + _call_json(rng)]))  # Llama 3 style
        elif form == 7:
            pieces.append(rng.choice(["<answer>", "</answer>", "<answer>x</answer>", "<tool_response>made up</tool_response>",
                                      "<|im_end|>", "<|im_start|>user\n", "<tool_call><tool_call>", "</tool_call>"]))
        elif form == 8:
            pieces.append("".join(chr(rng.randrange(1, 0x2FFF)) for _ in range(rng.randint(1, 40))))
        else:
            pieces.append(rng.choice(["Let me think.", "\x00\x07\x1b[2J", "\u202e\u200b", "a" * 1500]))
    return rng.choice(["", " ", "\n"]).join(pieces)


class FuzzPolicy:
    """Answers each generate() with the next adversarial output, cut at the turn's token budget."""

    def __init__(self, chat: ChatFormat, rng: random.Random, vocab_size: int):
        self.chat, self.rng, self.vocab_size = chat, rng, vocab_size
        self.outputs = 0

    async def __call__(self, prompt_ids: list[int], params) -> Generation:
        self.outputs += 1
        if self.rng.random() < 0.1:  # raw ids from the whole vocabulary, special tokens included
            ids = [self.rng.randrange(self.vocab_size) for _ in range(self.rng.randint(1, 64))]
        else:
            ids = self.chat.encode(_text_output(self.rng))
        ids.append(self.chat.im_end_id)
        finish = "stop"
        if len(ids) > params.max_tokens:
            ids, finish = ids[: params.max_tokens], "length"
        return Generation(ids, [-1.0] * len(ids), finish, [0] * len(ids), "fuzz")


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    world, tasks = synthetic_tasks(split="heldout", num=16, config=SyntheticQAConfig(num_companies=40))
    corpus = write_passages(world.passages, tmp_path_factory.mktemp("fuzz") / "passages.jsonl")
    calculator = start_toolserver("calculator", "tcp://127.0.0.1:*")
    search = start_toolserver("search", "tcp://127.0.0.1:*", "--corpus", str(corpus))
    yield tasks, calculator, search
    for proc in (calculator, search):
        assert proc.stop() == 0, proc.log_tail()  # the services survived and stop cleanly


@pytest.mark.slow
@pytest.mark.timeout(900)
async def test_ten_thousand_adversarial_outputs_fail_no_episode(services):
    tasks, calculator, search = services
    tokenizer = AutoTokenizer.from_pretrained(prepare_model())
    chat = ChatFormat(tokenizer)
    rng = random.Random(20261201)
    async with ToolClient([calculator.endpoint]) as calc_client, ToolClient([search.endpoint]) as search_client:
        tools = [*await remote_tools(calc_client), *await remote_tools(search_client)]
        parsers = [HermesParser, HermesParser, Llama3JsonParser, MistralParser]
        policy = FuzzPolicy(chat, rng, len(tokenizer))
        config = EnvConfig(max_turns=ACTIONS_PER_EPISODE, max_action_tokens=2048, max_total_tokens=16384, tool_timeout_s=5.0)
        statuses: dict[str, int] = {}
        failures: list[str] = []
        malformed_turns = 0

        async def episode(i: int):
            nonlocal malformed_turns
            env = MultiHopQAEnv(chat, config, parser=parsers[i % len(parsers)]())
            for tool in tools:
                env.register_tool(tool)
            traj = await run_episode(env, tasks[i % len(tasks)], policy, SamplingConfig(), group_id=f"g{i}")
            traj.validate()  # the token bookkeeping invariants hold for every episode
            statuses[traj.status] = statuses.get(traj.status, 0) + 1
            if traj.status == "failed":
                failures.append(traj.error or "")
            malformed_turns += sum("malformed_call" in t.process_rewards for t in traj.turns)

        i = 0
        while policy.outputs < NUM_OUTPUTS:
            await asyncio.gather(*(episode(i + k) for k in range(CONCURRENT_EPISODES)))
            i += CONCURRENT_EPISODES
        assert not failures, f"{len(failures)} failed episodes; first:\n{failures[0]}"
        assert policy.outputs >= NUM_OUTPUTS and set(statuses) <= {"ok", "truncated"}, statuses
        assert malformed_turns > NUM_OUTPUTS // 4  # the generator mostly produces malformed calls, and they are penalised
        # The services still answer a good call after all of it.
        good = await calc_client.call("calculator", {"expression": "6*7"}, deadline_s=10)
        assert good.ok and "42" in str(good.content)
        found = await search_client.call("search", {"query": tasks[0].prompt}, deadline_s=10)
        assert found.ok
