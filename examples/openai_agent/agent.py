"""A plain ReAct agent for agentrl's multi-hop QA environment, written only against the `openai` client.

It knows nothing of agentrl: it offers the model the tools it is given (`task["tools"]`, OpenAI
function schemas), runs each call the model makes by POSTing its arguments to the tool endpoint
beside the chat API (`/agentrl/tools/{name}` under the same base URL), feeds the result back as a
`tool` message, and stops when the model answers without a call. It returns None: the environment
scores the recorded episode (exact match of the `<answer>` in the final reply).

Two ways to run it (config.toml uses the first):
- `[agent] entry = "examples/openai_agent/agent.py:run"`: `run(task, client)` is awaited with an
  `openai.AsyncOpenAI` already pointed at the episode's gateway session;
- `[agent] command = ["python", "examples/openai_agent/agent.py"]`: the task arrives as JSON on
  stdin, the client reads OPENAI_BASE_URL / OPENAI_API_KEY, and the reward (null) is printed last.
"""

from __future__ import annotations

import asyncio
import json
import sys

import openai

MAX_TURNS = 4
MAX_TOKENS_PER_TURN = 96

SYSTEM = ("You answer questions by searching a knowledge base. Look up one fact per search. "
          "When you know the answer, reply <answer>short answer</answer>.")


def _call(call_id: str, query: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": "search", "arguments": json.dumps({"query": query})}}


# One worked example on made-up entities: a 135M model calls no tool at all without one.
EXAMPLE = [
    {"role": "user", "content": "Question: Which city was the founder of Brimbell Optics born in?"},
    {"role": "assistant", "content": None, "tool_calls": [_call("call_ex1", "founder of Brimbell Optics")]},
    {"role": "tool", "tool_call_id": "call_ex1", "content": "[1] Brimbell Optics: Brimbell Optics was founded by Oska Venn in 1987."},
    {"role": "assistant", "content": None, "tool_calls": [_call("call_ex2", "Oska Venn born")]},
    {"role": "tool", "tool_call_id": "call_ex2", "content": "[1] Oska Venn: Oska Venn was born in Lorrowby."},
    {"role": "assistant", "content": "<answer>Lorrowby</answer>"},
]


async def run_tool(client: openai.AsyncOpenAI, name: str, arguments_json: str) -> str:
    try:
        arguments = json.loads(arguments_json)
    except json.JSONDecodeError as err:
        return f"error: the arguments are not JSON ({err})"
    result = await client.post(f"/agentrl/tools/{name}", body=arguments, cast_to=dict)
    return result["content"] if result["success"] else f"error: {result['error']}"


async def run(task: dict, client: openai.AsyncOpenAI) -> float | None:
    model = (await client.models.list()).data[0].id
    messages = [{"role": "system", "content": SYSTEM}, *EXAMPLE, {"role": "user", "content": f"Question: {task['prompt']}"}]
    for _ in range(MAX_TURNS):
        response = await client.chat.completions.create(model=model, messages=messages, tools=task["tools"],
                                                        max_tokens=MAX_TOKENS_PER_TURN)
        message = response.choices[0].message
        messages.append(message.model_dump(exclude_none=False))
        if not message.tool_calls:
            return None  # the final reply: the environment's reward reads its <answer>
        for call in message.tool_calls:
            content = await run_tool(client, call.function.name, call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": content})
    return None


async def _main() -> None:
    task = json.loads(sys.stdin.read())
    async with openai.AsyncOpenAI(max_retries=0) as client:  # OPENAI_BASE_URL / OPENAI_API_KEY from the environment
        reward = await run(task, client)
    print(json.dumps(reward))


if __name__ == "__main__":
    asyncio.run(_main())
