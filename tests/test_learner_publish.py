"""WeightPublisher: how often a push makes the servers drop their KV (kv_refresh_every)."""

from __future__ import annotations

import pytest
import torch

from agentrl.common import weights
from agentrl.learner.publish import WeightPublisher


async def test_every_kth_push_recomputes_the_servers_kv(monkeypatch, tmp_path):
    calls: list[tuple[str, int, bool]] = []

    async def fake_push(url, path, version, *, timeout_s, recompute_kv):
        calls.append((url, version, recompute_kv))
        return weights.PushResult(version, 0.0, 0.0, 0.0, 0.0)

    monkeypatch.setattr(weights, "push_weights", fake_push)
    monkeypatch.setattr(weights, "SHM_DIR", str(tmp_path))
    publisher = WeightPublisher(["http://a", "http://b"], kv_refresh_every=3)
    for version in range(1, 8):
        await publisher.publish(version, {"w": torch.zeros(2)})
    await publisher.wait()
    refreshed = sorted({v for _, v, recompute in calls if recompute})
    assert refreshed == [3, 6] and len(calls) == 14  # both servers, every push; the KV only on every 3rd
    every = WeightPublisher(["http://a"])
    await every.publish(1, {"w": torch.zeros(2)})
    await every.wait()
    assert calls[-1] == ("http://a", 1, True)  # the default recomputes on every push
    with pytest.raises(ValueError, match="kv_refresh_every"):
        WeightPublisher(["http://a"], kv_refresh_every=0)
