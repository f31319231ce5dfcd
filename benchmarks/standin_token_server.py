"""STAND-IN token server for the orchestrator capacity benchmark (not an inference server).

It answers vLLM's token-in/token-out endpoint (`POST /inference/v1/generate`, the shape
`agentrl.common.inference.VLLMClient` reads) at once, without a model, so that a benchmark measures
only the orchestrator's own work per turn. Runs in its own process:

    python benchmarks/standin_token_server.py --port PORT --tokenizer MODEL_DIR

Every answer is a Hermes tool call `<tool_call>{"name": "search", "arguments": {"query": "q N"}}</tool_call>`
followed by `<|im_end|>`, tokenized once at start-up (N = the number of `<|im_start|>` ids in the
prompt, so successive turns of an episode issue different queries and none is a duplicate). The
answers are pre-serialised HTTP responses.

It must never be the bottleneck of the measurement, so it is a minimal HTTP/1.1 keep-alive server on
a bare asyncio protocol (aiohttp's server cost ~150 us of CPU per request, about half of what the
orchestrator is allowed per turn): it reads the request line, Content-Length and body, counts the
`<|im_start|>` ids with a byte search and writes the prepared answer. Requests on one connection are
answered in order. It prints `READY <port>` on stdout when serving.
"""

from __future__ import annotations

import argparse
import asyncio
import json

IM_START_ID = 1


def build_answers(model_dir: str, num: int = 128) -> list[bytes]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    out = []
    for n in range(num):
        text = '<tool_call>{"name": "search", "arguments": {"query": "q ' + str(n) + '"}}</tool_call>'
        ids = [*tok.encode(text, add_special_tokens=False), im_end]
        choice = {
            "token_ids": ids,
            "logprobs": {"content": [{"token_id": i, "logprob": -0.25} for i in ids]},
            "finish_reason": "stop",
            "weight_versions": [{"start": 0, "end": len(ids), "version": "default"}],
        }
        out.append(http_response(200, json.dumps({"choices": [choice]}).encode()))
    return out


def http_response(status: int, body: bytes) -> bytes:
    reason = {200: "OK", 400: "Bad Request", 404: "Not Found"}[status]
    head = f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    return head.encode() + body


def count_im_start(body: bytes) -> int:
    """Occurrences of id 1 in the compact JSON list `"token_ids":[1,...]`: `[1,` at the start and
    `,1,` inside. Two adjacent 1s cannot occur (every `<|im_start|>` is followed by a role name), and no
    other field of the request has `,1,` or `[1,` in it."""
    return body.count(b"[1,") + body.count(b",1,")


class StandinProtocol(asyncio.Protocol):
    def __init__(self, answers: list[bytes]):
        self.answers = answers
        self.buffer = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while True:
            head_end = self.buffer.find(b"\r\n\r\n")
            if head_end < 0:
                return
            head = bytes(self.buffer[:head_end]).decode("latin-1")
            length = 0
            for line in head.split("\r\n")[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value)
            end = head_end + 4 + length
            if len(self.buffer) < end:
                return
            body = bytes(self.buffer[head_end + 4:end])
            del self.buffer[:end]
            self.transport.write(self.answer(head.split(" ", 2), body))

    def answer(self, request_line: list[str], body: bytes) -> bytes:
        if len(request_line) < 2:
            return http_response(400, b'{"error": "bad request line"}')
        method, path = request_line[0], request_line[1]
        if method == "POST" and path == "/inference/v1/generate":
            return self.answers[count_im_start(body) % len(self.answers)]
        if method == "GET" and path == "/health":
            return http_response(200, b"{}")
        return http_response(404, b'{"error": "not found"}')


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--tokenizer", required=True, help="HF model folder whose tokenizer the answers use")
    args = parser.parse_args()
    answers = build_answers(args.tokenizer)

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(lambda: StandinProtocol(answers), "127.0.0.1", args.port, backlog=8192)
        print(f"READY {args.port}", flush=True)  # only once the socket accepts connections
        async with server:
            await server.serve_forever()

    asyncio.run(serve())


if __name__ == "__main__":
    main()
