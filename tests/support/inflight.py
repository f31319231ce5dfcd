"""Requests kept in flight through a weight push: the shared helper of the push tests."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from agentrl.common.inference import Generation, SamplingParams, VLLMClient

T = TypeVar("T")


async def push_with_requests_in_flight(client: VLLMClient, prompt_ids: list[int], push: Awaitable[T], *,
                                       num_requests: int = 32, max_tokens: int = 64) -> tuple[T, list[Generation]]:
    """Keep `num_requests` sampling requests running (each one that finishes is replaced) from half a
    second before `push` starts until it returns, so the swap lands inside some of them whatever the
    machine's speed; (the push's result, every generation)."""
    pushed = asyncio.Event()

    async def keep_generating(seed: int) -> list[Generation]:
        done = []
        while not pushed.is_set():
            done.append(await client.generate(prompt_ids, SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed,
                                                                         ignore_eos=True)))
            seed += num_requests
        return done

    streams = [asyncio.create_task(keep_generating(i)) for i in range(num_requests)]
    try:
        await asyncio.sleep(0.5)
        result = await push
    finally:
        pushed.set()
        streams_done = await asyncio.gather(*streams)
    return result, [g for stream in streams_done for g in stream]
