"""Data-parallel training with FSDP2 (`torch.distributed.fsdp.fully_shard`) under torchrun.

Layout: every decoder layer is its own FSDP unit (its parameters are gathered just before its
forward/backward and freed after), and the `PackedPolicy` is the root unit, holding the tied
embedding / LM head, the final norm and the value head; because the root's forward runs both the
decoder and `linear_logprob`, the LM head weight is unsharded exactly while the kernel reads it.
The optimizer is built after sharding, so each rank keeps the AdamW state of its shard only.
Frozen parameters (`train_layers`, `train_embeddings`) are not sharded: they stay whole on every
rank (`shard_policy` docstring).

Data: each rank trains on its own share of the batch (`shard_samples`, balanced by tokens, whole
sequences); `Trainer.rl_step` normalises by the global token count and scales by the world size so
that FSDP's gradient averaging gives the single-process update. Every rank must run the same number
of micro-batch forwards (FSDP's collectives are per forward); `shard_samples` + the same
`max_row_tokens` does not guarantee that, so `equalise_micro_batches` splits rows until the counts
match (an extra forward on a small row costs little; a mismatch would hang), and where a rank has
too few sequences to split that far it runs one-token padding rows with no action token (zero loss,
zero gradient).

The learner service under torchrun (`service.py` docstring) uses `RankGroup` (rank 0's commands to
the other ranks), `full_state` / `load_full_state` (full state dicts gathered to and broadcast from
rank 0) and `init_distributed(timeout_s)` (the process group's timeout bounds every collective).

Backend: gloo on CPU (tests: 2 processes); where CUDA exists "cpu:gloo,cuda:nccl", so each
collective runs on the backend of its tensors' device. What runs where on a GPU learner
(`LearnerConfig.device`, each rank on `cuda:{LOCAL_RANK}`): FSDP's all-gathers and reduce-scatters
move CUDA parameters and gradients (nccl; the FSDP mesh is built on the learner's device, see
`shard_policy`); everything else is CPU and goes through gloo: `RankGroup`'s object collectives
(rank 0's commands and sample shares: pickled bytes, `OBJECT_DEVICE`), the scalar sums of
`trainer._global_sum`, the micro-batch count of `equalise_micro_batches`, and the state-dict gathers
(`cpu_offload=True`).

The equivalence check (one optimizer step on fixed batches of a tiny model, sharded vs one
process) lives with the tests: tests/support/fsdp_check.py, run under torchrun by
tests/test_learner_fsdp.py.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from agentrl.learner.batching import MicroBatch, PackedPolicy, Sample, build_micro_batches, pack_first_fit

OBJECT_DEVICE = torch.device("cpu")
"""Where object collectives serialise: the CPU (gloo), also on a GPU host. torch would pick the CPU
for the "cpu:gloo,cuda:nccl" pair by itself; `broadcast_object_list` is told explicitly, and
`scatter_object_list` / `gather_object` (no device argument) rely on that pick."""


def init_distributed(timeout_s: float = 600.0, device: torch.device | None = None) -> tuple[int, int]:
    """(rank, world size) from torchrun's environment; initialises the process group.

    `timeout_s` bounds every collective: a rank whose peer died or hangs raises after at most this
    long instead of waiting forever (gloo enforces it on each receive). A CUDA `device` becomes the
    current device first, so that nccl and FSDP use this rank's GPU and no other."""
    if "RANK" not in os.environ:
        raise RuntimeError("not started by torchrun (RANK unset); run: torchrun --nproc_per_node N ...")
    if device is not None and device.type == "cuda":
        torch.cuda.set_device(device)
    # The learner's tensors live on the CPU (collectives included): gloo for those, nccl for any
    # CUDA tensor, so the same code runs on a GPU host.
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    torch.distributed.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return torch.distributed.get_rank(), torch.distributed.get_world_size()


PR_SET_PDEATHSIG = 1
"""prctl(2) option: the signal this process gets when the thread that started it exits."""


def die_with_launcher() -> None:
    """Have the kernel SIGKILL this rank when its torchrun agent dies, by any means.

    torchrun starts each rank in a session of its own, so an agent killed alone (SIGKILL, the OOM
    killer) would leave its ranks running, holding the learner's port and memory, with nothing
    left to stop them; the run's keeper then starts a new learner beside them. A rank has nothing
    to save without its agent: the next learner resumes from the last checkpoint. torchrun starts
    its ranks from its main thread, which lives as long as the agent. Nothing is asked of a rank
    that another launcher started (no TORCHELASTIC_RUN_ID)."""
    import ctypes

    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    agent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl(PR_SET_PDEATHSIG): {os.strerror(errno)}")
    if agent == 1 or os.getppid() != agent:  # the agent died before the request took effect
        os.kill(os.getpid(), signal.SIGKILL)


def close_distributed(completed: bool) -> None:
    """Leave the process group. `completed`: this rank finished its work normally, so every rank
    meets at a barrier first; no rank then closes its gloo connections while a peer still has a
    collective or a write in flight on them (a rank that left early aborted its peer's teardown:
    "terminate called without an active exception", SIGABRT). A rank leaving on an error skips the
    barrier: its peers may be gone, and the barrier would wait out the collective timeout."""
    if completed:
        torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def end_rank(code: int) -> NoReturn:
    """End a torchrun rank's process with `code` now, skipping the interpreter's teardown.

    Called after `close_distributed`, when the rank's work is done and its files are closed. CI saw
    a rank abort on its way out after a clean stop (its "stopped at rank 0's request" printed, then
    "terminate called without an active exception", SIGABRT), and torchrun then stopped the other
    rank and failed a run that had finished. The log cannot tell whether the abort came in
    `destroy_process_group` or in the interpreter's teardown, where gloo's and FSDP's native objects
    are freed in an order their threads may not expect; this removes the second, and `faulthandler`
    (enabled in the learner's ranks) prints the Python stacks of the first if it comes. Nothing is
    left to save at this point, so the rank flushes its output and exits at once."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def launched_world_size() -> int:
    """WORLD_SIZE set by torchrun, 1 without it (a plain process)."""
    return int(os.environ.get("WORLD_SIZE", "1")) if "RANK" in os.environ else 1


def shard_policy(policy: PackedPolicy, device: torch.device | None = None) -> PackedPolicy:
    """FSDP2 over what trains; frozen parameters (`train_layers`, `train_embeddings`) stay whole on
    every rank: they have no gradient to reduce and no optimizer state to shard, and a fully frozen
    FSDP unit deadlocked here (its backward prefetch all-gather is never matched on the other rank:
    gloo timeout at the second step with one micro-batch per rank and train_layers = 1).

    `device`: where the policy already is (the learner moves it first); the FSDP mesh is built for
    that device type. None = torch's default mesh, which is CUDA whenever CUDA exists: FSDP would
    then move a CPU policy onto the GPU, away from its CPU micro-batches."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = None
    if device is not None:
        mesh = init_device_mesh(device.type, (torch.distributed.get_world_size(),))
    frozen = {p for p in policy.parameters() if not p.requires_grad}
    for layer in policy.lm.model.layers:
        if any(p.requires_grad for p in layer.parameters()):
            fully_shard(layer, mesh=mesh, ignored_params=frozen & set(layer.parameters()) or None)
    fully_shard(policy, mesh=mesh, ignored_params=frozen or None)
    return policy


def shard_samples(samples: Sequence[Sample], rank: int, world: int) -> list[Sample]:
    """Whole sequences to ranks, longest first onto the least-loaded rank (deterministic)."""
    loads = [0] * world
    owner = {}
    for i in sorted(range(len(samples)), key=lambda i: (-samples[i].num_tokens, i)):
        r = min(range(world), key=lambda r: (loads[r], r))
        owner[i] = r
        loads[r] += samples[i].num_tokens
    return [s for i, s in enumerate(samples) if owner[i] == rank]


def plan_rows(samples: Sequence[Sample], max_row_tokens: int, num_rows: int) -> tuple[list[list[int]], int]:
    """Rows of sample indices for `num_rows` micro-batches, and how many padding rows must follow.

    Rows are first-fit packed, then the heaviest splittable row is halved until there are
    `num_rows`; a share with fewer sequences than `num_rows` (e.g. one long sequence against the
    other rank's three) cannot split that far, so the rest are padding rows (`padding_micro_batch`).
    Pure and deterministic, so rank 0 can plan every rank's rows before it sends the shares.
    """
    rows = pack_first_fit([s.num_tokens for s in samples], max_row_tokens)
    while len(rows) < num_rows:
        splittable = [r for r in rows if len(r) > 1]
        if not splittable:
            break
        row = max(splittable, key=lambda r: sum(samples[i].num_tokens for i in r))
        rows.remove(row)
        rows += [row[: len(row) // 2], row[len(row) // 2 :]]
    return rows, num_rows - len(rows)


def padding_micro_batch() -> MicroBatch:
    """A one-token row with no action token: it runs the forward (and so FSDP's per-forward
    collectives) and contributes exactly zero loss and gradient. `num_seqs` is 1 because the loss
    kernel needs a positive count; only the 'seq_mean' aggregation reads it (see `check_padding`)."""
    empty_i64 = torch.zeros(0, dtype=torch.int64)
    empty_f32 = torch.zeros(0, dtype=torch.float32)
    return MicroBatch(input_ids_L=torch.zeros(1, dtype=torch.int64), position_ids_L=torch.zeros(1, dtype=torch.int64),
                      gather_idx_N=empty_i64, targets_N=empty_i64, behavior_logprobs_N=empty_f32,
                      advantages_N=empty_f32, policy_versions_N=empty_i64, seq_ids_N=empty_i64, num_seqs=1,
                      samples=[])


def num_padding_rows(shares: Sequence[Sequence[Sample]], max_row_tokens: int) -> int:
    """Padding rows all ranks together will run for these shares (what `equalise_micro_batches` does)."""
    num_rows = max(len(pack_first_fit([s.num_tokens for s in share], max_row_tokens)) for share in shares)
    return sum(plan_rows(share, max_row_tokens, num_rows)[1] for share in shares)


def equalise_micro_batches(samples: list[Sample], max_row_tokens: int) -> list[MicroBatch]:
    """This rank's micro-batches, rows split (or padded) until every rank has the same number."""
    rows = pack_first_fit([s.num_tokens for s in samples], max_row_tokens)
    count = torch.tensor([len(rows)])
    torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MAX)
    rows, num_padding = plan_rows(samples, max_row_tokens, int(count))
    return build_micro_batches(samples, max_row_tokens, rows=rows) + [padding_micro_batch() for _ in range(num_padding)]


FULL_STATE = StateDictOptions(full_state_dict=True, cpu_offload=True)
"""Gather to full tensors on rank 0's CPU (the other ranks get empty dicts)."""
FROM_RANK0 = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
"""Load full tensors that only rank 0 holds: it broadcasts, each rank keeps its shard."""


def full_state(policy: PackedPolicy, optimizer: torch.optim.Optimizer | None = None) -> tuple[dict, dict | None]:
    """(policy state, optimizer state) as full tensors on rank 0 (collective; empty on the others).

    The policy state has the same keys as `policy.state_dict()` of an unsharded policy; the
    optimizer state is keyed by parameter name (not by index, as an unsharded optimizer's is)."""
    model_state = get_model_state_dict(policy, options=FULL_STATE)
    optim_state = get_optimizer_state_dict(policy, optimizer, options=FULL_STATE) if optimizer is not None else None
    return model_state, optim_state


def load_full_state(policy: PackedPolicy, model_state: dict, optimizer: torch.optim.Optimizer | None = None,
                    optim_state: dict | None = None, *, strict: bool = True) -> None:
    """Inverse of `full_state` (collective): rank 0 passes the full dicts, the other ranks `{}`."""
    set_model_state_dict(policy, model_state, options=dataclasses.replace(FROM_RANK0, strict=strict))
    if optimizer is not None:
        set_optimizer_state_dict(policy, optimizer, optim_state, options=FROM_RANK0)


class RankGroup:
    """Rank 0's command channel to the other ranks, and small-object collectives.

    Only rank 0 talks to the outside world; the others loop on `recv` and run what rank 0 sends,
    so every collective is entered in the same order on every rank. The commands are
    ("step", reward weights) followed by a `scatter` of the sample shares, ("snapshot",),
    ("checkpoint",), ("heartbeat",) and ("stop",).
    """

    def __init__(self, rank: int, world: int):
        self.rank = rank
        self.world = world

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def send(self, op: str, payload: Any = None) -> None:
        if not self.is_leader:
            raise RuntimeError("only rank 0 sends commands")
        torch.distributed.broadcast_object_list([op, payload], src=0, device=OBJECT_DEVICE)

    def recv(self) -> tuple[str, Any]:
        message: list[Any] = [None, None]
        torch.distributed.broadcast_object_list(message, src=0, device=OBJECT_DEVICE)
        return message[0], message[1]

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank."""
        box = [obj if self.is_leader else None]
        torch.distributed.broadcast_object_list(box, src=0, device=OBJECT_DEVICE)
        return box[0]

    def scatter(self, objs: Sequence[Any] | None) -> Any:
        """objs[r] to rank r (rank 0 passes the list, the others None)."""
        out: list[Any] = [None]
        torch.distributed.scatter_object_list(out, list(objs) if self.is_leader else None, src=0)
        return out[0]

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's `obj`, in rank order, on rank 0 (None elsewhere)."""
        out = [None] * self.world if self.is_leader else None
        torch.distributed.gather_object(obj, out, dst=0)
        return out
