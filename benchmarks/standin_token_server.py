"""STAND-IN token server for the orchestrator capacity benchmark (not an inference server).

It answers vLLM's token-in/token-out endpoint (`POST /inference/v1/generate`, the shape
`agentrl.engine.inference.VLLMClient` reads) at once, without a model, so that a benchmark measures
only the orchestrator's own work per turn. Runs in its own process:

    python benchmarks/standin_token_server.py --port PORT --tokenizer MODEL_DIR

Every answer is a Hermes tool call `<tool_call>{"name": "search", "arguments": {"query": "q N"}}</tool_call>`
followed by `<|im_end|>`, tokenized once at start-up (N = the number of `<|im_start|>` ids in the
prompt, so successive turns of an episode issue different queries and none is a duplicate). The
answers are pre-serialised JSON bytes; per request the server parses the body and counts one id.
It prints `READY <port>` on stdout when serving.
"""

from __future__ import annotations

import argparse
import asyncio
import json

from aiohttp import web

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
        out.append(json.dumps({"choices": [choice]}).encode())
    return out


def make_app(answers: list[bytes]) -> web.Application:
    async def generate(request: web.Request) -> web.Response:
        body = json.loads(await request.read())
        n = body["token_ids"].count(IM_START_ID) % len(answers)
        return web.Response(body=answers[n], content_type="application/json")

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/inference/v1/generate", generate)
    app.router.add_get("/health", health)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--tokenizer", required=True, help="HF model folder whose tokenizer the answers use")
    args = parser.parse_args()
    app = make_app(build_answers(args.tokenizer))

    async def serve() -> None:
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", args.port, backlog=8192).start()
        print(f"READY {args.port}", flush=True)  # only once the socket accepts connections
        await asyncio.Event().wait()

    asyncio.run(serve())

if __name__ == "__main__":
    main()
