"""Weight publishing: snapshot on the training thread, write and push to every vLLM server behind it.

Cost split (why the work is where it is): the snapshot (a bf16 copy of 135M parameters, about 0.1 s)
must happen between optimizer steps, because the next step changes the weights in place; the
safetensors write (270 MB) and the HTTP push (stage, pause(keep), layer-wise reload, resume: about
1.2 s per server here) only read the snapshot, so they run in a background task while the next
step trains. Training stalls only for the snapshot, plus the wait for the previous push when pushes
are due faster than they complete (at most one push is in flight: a second would only race the
first onto the same servers). Both stalls are measured and reported (`stall_s`).

The weights go out in bfloat16 (the servers run bf16; half the bytes of fp32). A tied LM head is
not sent: the server ties it to the embedding it receives.

Ownership: the publisher owns its one background task; `wait()` surfaces its failure (a push error
stops the learner instead of letting servers silently fall behind) and `close()` bounds shutdown.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class PushReport:
    version: int
    total_s: float
    """Background time from snapshot to the last server confirming."""
    write_s: float
    per_server: dict[str, dict[str, float]]
    """base URL -> {pause_s, reload_s, stage_s}."""


def snapshot_weights(causal_lm: nn.Module, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Checkpoint-named copy of the weights, in `dtype`, on the CPU, without the tied LM head.

    On the CPU, not where the model is: the copy waits there for the background write (a GPU
    learner keeps no second copy of the weights in accelerator memory while the next step trains)."""
    tied = bool(getattr(causal_lm.config, "tie_word_embeddings", False))
    out = {}
    with torch.no_grad():
        for name, tensor in causal_lm.state_dict().items():
            if tied and name == "lm_head.weight":
                continue
            if hasattr(tensor, "full_tensor"):
                tensor = tensor.full_tensor()
            out[name] = tensor.detach().to(device="cpu", dtype=dtype, copy=True)
    return out


def snapshot_from_policy_state(policy_state: dict[str, torch.Tensor], *, tied: bool, prefix: str = "lm.",
                               dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """`snapshot_weights` from a full `PackedPolicy` state dict (the sharded learner's gather):
    the causal LM's entries under `prefix`, renamed to checkpoint names, in `dtype`, without the
    tied LM head, on the CPU; the value head is the learner's own and is not sent."""
    out = {}
    for name, tensor in policy_state.items():
        if not name.startswith(prefix):
            continue
        name = name[len(prefix):]
        if tied and name == "lm_head.weight":
            continue
        out[name] = tensor.detach().to(device="cpu", dtype=dtype, copy=True)
    return out


class WeightPublisher:
    def __init__(self, server_urls: list[str], *, push_timeout_s: float = 300.0, kv_refresh_every: int = 1):
        if kv_refresh_every < 1:
            raise ValueError(f"kv_refresh_every={kv_refresh_every} must be >= 1")
        self.server_urls = list(server_urls)
        self.push_timeout_s = push_timeout_s
        self.kv_refresh_every = kv_refresh_every
        """Every this many pushes, the servers' KV and prefix caches are dropped (running requests
        recompute under the new weights); the pushes between keep them (engine.weights, step 3)."""
        self._num_pushes = 0
        self._task: asyncio.Task | None = None
        self.served_version = 0
        self.reports: list[PushReport] = []

    async def publish(self, version: int, snapshot: dict[str, torch.Tensor]) -> float:
        """Start pushing `snapshot` as `version`; returns the seconds spent waiting for the previous push."""
        t0 = time.perf_counter()
        await self.wait()
        stall_s = time.perf_counter() - t0
        self._task = asyncio.create_task(self._push(version, snapshot), name=f"weight-push-v{version}")
        return stall_s

    async def _push(self, version: int, snapshot: dict[str, torch.Tensor]) -> PushReport:
        from agentrl.common.weights import push_weights, write_weights

        t0 = time.perf_counter()
        self._num_pushes += 1
        recompute_kv = self._num_pushes % self.kv_refresh_every == 0
        path = await asyncio.to_thread(write_weights, snapshot)
        write_s = time.perf_counter() - t0
        try:
            results = await asyncio.gather(
                *(push_weights(url, path, version, timeout_s=self.push_timeout_s, recompute_kv=recompute_kv)
                  for url in self.server_urls)
            )
        finally:
            path.unlink(missing_ok=True)
        report = PushReport(
            version=version,
            total_s=time.perf_counter() - t0,
            write_s=write_s,
            per_server={url: {"pause_s": r.pause_s, "reload_s": r.reload_s, "stage_s": r.stage_s}
                        for url, r in zip(self.server_urls, results, strict=True)},
        )
        self.served_version = version
        self.reports.append(report)
        return report

    async def wait(self) -> PushReport | None:
        """Wait for the push in flight (if any); re-raises its failure."""
        task, self._task = self._task, None
        return await task if task is not None else None

    async def close(self, timeout_s: float = 60.0) -> None:
        if self._task is not None:
            await asyncio.wait_for(self.wait(), timeout_s)
