"""Poison groups at the learner's door: refused at decode (before spool and ack), nacked, kept in
rejected/, never crash-looping the learner; the sender drops what is nacked and keeps flowing.

Real parts: the learner's own `Intake` (its `GroupReceiver` on a real ZeroMQ ROUTER socket, its
spool, ledger and rejected/ store), the orchestrator's `GroupSender`, raw ZeroMQ DEALER sockets for
the hostile frames.
"""

from __future__ import annotations

import asyncio
import math
import os
import signal
import socket

import msgpack
import numpy as np
import pytest
import zmq
import zmq.asyncio
from support.synthetic import make_group

from agentrl.common.trajectory import GroupRejected, decode_group, encode_group, int32_array
from agentrl.common.transport import GROUP, NACK, GroupReceiver, GroupSender
from agentrl.learner.intake import Intake
from agentrl.learner.ledger import Ledger, Spool
from agentrl.learner.rejected import RejectedStore, read_rejected

VOCAB = 100
MAX_FRAME_BYTES = 1 << 20  # the receiver's MAXMSGSIZE here; 2 MiB frames are "oversized"


def endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def good(gid: str, seed: int = 0):
    return make_group(gid, [1.0, 0.0], vocab_size=VOCAB, seed=seed)


def _header(frames: list[bytes]) -> dict:
    return msgpack.unpackb(frames[0], raw=False)


def _with_header(frames: list[bytes], mutate) -> list[bytes]:
    header = _header(frames)
    mutate(header)
    return [msgpack.packb(header, use_bin_type=True), *frames[1:]]


def _set_traj(key, value, index=0):
    def mutate(h):
        h["trajectories"][index][key] = value
    return mutate


def _set_turn(key, value):
    def mutate(h):
        h["trajectories"][0]["turns"][0][key] = value
    return mutate


def _array(frames: list[bytes], field_index: int, fn) -> list[bytes]:
    """Frames with array `field_index` (0 token_ids, 1 is_action, 2 logprobs, 3 versions) of trajectory 0 replaced."""
    dtypes = ["<i4", "u1", "<f4", "<i4"]
    arr = np.frombuffer(frames[1 + field_index], dtype=dtypes[field_index]).copy()
    out = list(frames)
    out[1 + field_index] = fn(arr)
    return out


def poison_messages(rng: np.random.Generator, n: int) -> list[tuple[str, str | None, list[bytes]]]:
    """n hostile messages as (kind, group id the nack must carry or None, frames after the routing id).
    Each is refused by the checks; the ones with a readable str group id get a unique one."""
    out = []
    for i in range(n):
        gid = f"poison-{i}"
        base = encode_group(good(gid, seed=i))
        k = i % 24
        if k == 0:
            out.append(("random bytes", None, [GROUP, rng.bytes(int(rng.integers(0, 300)))]))
        elif k == 1:
            out.append(("random kind", None, [rng.bytes(int(rng.integers(1, 20))), *base]))
        elif k == 2:
            cut = int(rng.integers(1, len(base[0])))
            out.append(("truncated msgpack", None, [GROUP, base[0][:cut], *base[1:]]))
        elif k == 3:
            out.append(("int group id", None, [GROUP, *_with_header(base, lambda h: h.update(group_id=12345))]))
        elif k == 4:
            out.append(("string reward", gid, [GROUP, *_with_header(base, _set_traj("task_reward", "1.0"))]))
        elif k == 5:
            out.append(("string process reward", gid, [GROUP, *_with_header(base, _set_turn("process_rewards", {"valid": "0.1"}))]))
        elif k == 6:
            out.append(("NaN reward", gid, [GROUP, *_with_header(base, _set_traj("task_reward", math.nan))]))
        elif k == 7:
            out.append(("inf process reward", gid, [GROUP, *_with_header(base, _set_turn("process_rewards", {"x": math.inf}))]))
        elif k == 8:
            out.append(("NaN log-prob", gid, [GROUP, *_array(base, 2, lambda a: np.full_like(a, np.nan).tobytes())]))
        elif k == 9:
            out.append(("token id past the vocabulary", gid,
                        [GROUP, *_array(base, 0, lambda a: np.full_like(a, VOCAB + int(rng.integers(0, 10**6))).tobytes())]))
        elif k == 10:
            out.append(("negative token id", gid, [GROUP, *_array(base, 0, lambda a: np.full_like(a, -3).tobytes())]))
        elif k == 11:
            out.append(("huge prompt_len", gid, [GROUP, *_with_header(base, _set_traj("prompt_len", 2**62))]))
        elif k == 12:
            out.append(("huge turn bounds", gid, [GROUP, *_with_header(base, _set_turn("action_end", 2**63))]))
        elif k == 13:
            huge = b"\xdd\xff\xff\xff\xff" + rng.bytes(16)  # msgpack array32 claiming 4G elements
            out.append(("huge msgpack length", None, [GROUP, huge, *base[1:]]))
        elif k == 14:
            out.append(("missing frames", gid, [GROUP, *base[:-3]]))
        elif k == 15:
            out.append(("array length mismatch", gid, [GROUP, *_array(base, 1, lambda a: a[:-1].tobytes())]))
        elif k == 16:
            out.append(("odd byte length", gid, [GROUP, *_array(base, 2, lambda a: a.tobytes() + b"\x00")]))
        elif k == 17:
            out.append(("is_action of 2", gid, [GROUP, *_array(base, 1, lambda a: np.where(a > 0, 2, 0).astype(np.uint8).tobytes())]))
        elif k == 18:
            out.append(("version below -1", gid, [GROUP, *_array(base, 3, lambda a: np.where(a >= 0, -7, a).astype("<i4").tobytes())]))
        elif k == 19:
            out.append(("float sample index", gid, [GROUP, *_with_header(base, _set_traj("sample_index", 1.5))]))
        elif k == 20:
            out.append(("unknown status", gid, [GROUP, *_with_header(base, _set_traj("status", "great"))]))
        elif k == 21:
            out.append(("wrong wire version", gid, [GROUP, *_with_header(base, lambda h: h.update(wire_version=99))]))
        elif k == 22:
            out.append(("NaN metric", gid, [GROUP, *_with_header(base, _set_traj("metrics", {"em": math.nan}))]))
        else:
            out.append(("empty message", None, [b""]))
    return out


async def _consume(intake: Intake, got: list) -> None:
    while True:
        got.append(await intake.next_group())


async def _wait_for(pred, timeout_s: float = 20.0) -> None:
    for _ in range(int(timeout_s / 0.02)):
        if pred():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not reached in time")


def _intake(tmp_path, ep: str) -> Intake:
    receiver = GroupReceiver(ep, max_frame_bytes=MAX_FRAME_BYTES, vocab_size=VOCAB)
    return Intake(receiver, Spool(tmp_path / "spool"), Ledger(), RejectedStore(tmp_path / "rejected", max_bytes=1 << 30))


async def _read_nacks(sock: zmq.asyncio.Socket, nacks: list) -> None:
    while True:
        frames = await sock.recv_multipart()
        nacks.append(frames)


async def test_1000_malformed_frames_are_nacked_kept_and_the_receiver_keeps_answering(tmp_path):
    ep = endpoint()
    intake = _intake(tmp_path, ep)
    await intake.receiver.start()
    ctx = zmq.asyncio.Context()
    hostile = ctx.socket(zmq.DEALER)
    hostile.setsockopt(zmq.LINGER, 0)
    hostile.connect(ep)
    sender = GroupSender(ep, max_unacked=4)
    await sender.start()
    got: list = []
    nacks: list = []
    consumer = asyncio.create_task(_consume(intake, got))
    nack_reader = asyncio.create_task(_read_nacks(hostile, nacks))
    rng = np.random.default_rng(0)
    messages = poison_messages(rng, 960)
    num_oversized = 0
    try:
        for batch in range(40):
            chunk = messages[batch * 24:(batch + 1) * 24]
            for _, _, frames in chunk:
                await hostile.send_multipart(frames)
            # One oversized frame per batch, on its own connection: ZeroMQ cuts that connection while reading
            # the frame (MAXMSGSIZE), before the learner sees anything, so it is neither nacked nor kept.
            big = ctx.socket(zmq.DEALER)
            big.setsockopt(zmq.LINGER, 0)
            big.connect(ep)
            oversized = encode_group(good(f"big-{batch}"))
            await big.send_multipart([GROUP, oversized[0], rng.bytes(2 * MAX_FRAME_BYTES), *oversized[2:]])
            num_oversized += 1
            await sender.send(good(f"ok-{batch}", seed=batch))
            await _wait_for(lambda b=batch: any(g.group_id == f"ok-{b}" for g in got)
                            and len(nacks) == (b + 1) * 24)
            big.close(linger=0)
        assert await sender.wait_all_acked(20)
    finally:
        consumer.cancel()
        nack_reader.cancel()
        await sender.close()
        await intake.receiver.close()
        ctx.destroy(linger=0)
    assert len(messages) + num_oversized == 1000
    # Only the good groups came through, each once, in order; only they are spooled.
    assert [g.group_id for g in got] == [f"ok-{b}" for b in range(40)]
    assert sorted(intake.spool.pending()) == sorted(f"ok-{b}" for b in range(40))
    assert sender.num_acked == 40 and sender.num_rejected == 0
    # Every poison message was nacked (the id it named, when readable) and is in rejected/, byte for byte.
    assert intake.receiver.num_malformed == len(messages)
    assert all(n[0] == NACK and len(n) == 3 and n[2] for n in nacks)
    assert [n[1].decode() or None for n in nacks] == [gid for _, gid, _ in messages]
    records = read_rejected(tmp_path / "rejected")
    assert len(records) == len(messages)
    for record, (kind, gid, frames) in zip(records, messages, strict=True):
        assert record["frames"] == frames, kind
        assert record["group_id"] == gid and record["reason"] and record["source"] == "socket", kind


async def test_the_sender_drops_nacked_groups_and_does_not_stall(tmp_path):
    """Two poison groups (a token id past the model's vocabulary, a NaN log-prob: neither is visible to
    the sender) then good ones, with max_unacked = 2: unanswered, the two would hold both slots forever."""
    ep = endpoint()
    intake = _intake(tmp_path, ep)
    await intake.receiver.start()
    sender = GroupSender(ep, max_unacked=2, resend_after_s=0.4)
    await sender.start()
    past_vocab = good("bad-vocab")
    past_vocab.trajectories[1].token_ids[3] = VOCAB + 7
    nan_logprob = good("bad-nan")
    nan_logprob.trajectories[0].behavior_logprobs[nan_logprob.trajectories[0].is_action == 1] = np.nan
    got: list = []
    consumer = asyncio.create_task(_consume(intake, got))
    try:
        await asyncio.wait_for(sender.send(past_vocab), 10)
        await asyncio.wait_for(sender.send(nan_logprob), 10)
        for i in range(6):
            await asyncio.wait_for(sender.send(good(f"ok-{i}", seed=i)), 10)  # would block forever on 2 unanswered
        assert await sender.wait_all_acked(10)
        await asyncio.sleep(1.5)  # several resend_after_s periods: nothing is left to resend
        assert [g.group_id for g in got] == [f"ok-{i}" for i in range(6)]
        assert sender.num_rejected == 2 and sender.num_unacked == 0 and sender.num_resent == 0
        assert "outside the model's vocabulary" in sender.rejected["bad-vocab"]
        assert "behavior_logprobs" in sender.rejected["bad-nan"] and "nan" in sender.rejected["bad-nan"]
        assert intake.receiver.num_malformed == 2  # each refused once, never resent
        assert {r["group_id"] for r in read_rejected(tmp_path / "rejected")} == {"bad-vocab", "bad-nan"}
        assert "bad-vocab" not in intake.spool and "bad-nan" not in intake.ledger
    finally:
        consumer.cancel()
        await sender.close()
        await intake.receiver.close()


async def test_a_poison_group_in_an_old_spool_is_moved_to_rejected_on_replay(tmp_path):
    """A spool written by a learner that checked less: replay refuses the poison group once, records it
    as "malformed" in the ledger (pruned at the next checkpoint) and goes on with the rest."""
    spool = Spool(tmp_path / "spool")
    spool.put(good("before"))
    poisoned = good("nan-reward")
    poisoned.trajectories[0].task_reward = math.nan
    spool.put(poisoned)
    spool.put(good("after", seed=2))
    intake = _intake(tmp_path, endpoint())
    assert intake.num_replayed == 3
    first = await asyncio.wait_for(intake.next_group(), 5)
    second = await asyncio.wait_for(intake.next_group(), 5)
    assert [first.group_id, second.group_id] == ["before", "after"]
    assert intake.ledger.rejected == {"nan-reward": "malformed"} and intake.num_replay_rejected == 1
    [record] = read_rejected(tmp_path / "rejected")
    assert record["group_id"] == "nan-reward" and record["source"] == "spool" and "task_reward is nan" in record["reason"]
    intake.prune()
    assert "nan-reward" not in intake.spool and "before" in intake.spool


# ---- policy versions past int32 -------------------------------------------------------------------
async def test_version_overflow_is_refused_with_a_clear_error_not_an_abort(tmp_path):
    from agentrl.common.inference import InferenceServerError, parse_version

    # Where the server's label is read: an error for this request (the episode fails with the reason).
    with pytest.raises(InferenceServerError, match="99999999999.*outside"):
        parse_version("99999999999")
    assert parse_version("2147483647") == 2**31 - 1 and parse_version("default") == 0
    # Where the trajectory casts to int32: a ValueError naming the field and the value.
    with pytest.raises(ValueError, match=r"policy_versions: value 99999999999 is outside the int32 range"):
        int32_array([-1, 3, 99999999999], "policy_versions")
    assert int32_array([-1, 2**31 - 1], "v").tolist() == [-1, 2**31 - 1]
    # The sender drops such a group (logged, counted) instead of raising into the orchestrator, and
    # keeps sending the next ones.
    ep = endpoint()
    intake = _intake(tmp_path, ep)
    await intake.receiver.start()
    sender = GroupSender(ep, max_unacked=1)
    await sender.start()
    overflow = good("overflow")
    traj = overflow.trajectories[0]
    traj.policy_versions = np.where(traj.is_action == 1, 99999999999, -1).astype(np.int64)
    int_id = good("x")
    int_id.group_id = 7
    try:
        await sender.send(overflow)
        await sender.send(int_id)
        await sender.send(good("fine"))
        assert (await asyncio.wait_for(intake.next_group(), 10)).group_id == "fine"
        assert sender.num_rejected == 2 and sender.num_sent == 1
        assert "int32 range" in sender.rejected["overflow"] and "not a non-empty str" in sender.rejected["7"]
    finally:
        await sender.close()
        await intake.receiver.close()
    # On the wire versions are int32 already; below -1 is refused at decode.
    frames = _array(encode_group(good("neg")), 3, lambda a: np.where(a >= 0, -2**31, a).astype("<i4").tobytes())
    with pytest.raises(GroupRejected, match="policy_versions holds -2147483648"):
        decode_group(frames, vocab_size=VOCAB)


def test_every_poison_kind_is_refused_by_decode_and_a_good_group_is_not():
    rng = np.random.default_rng(1)
    for kind, gid, frames in poison_messages(rng, 24):
        if frames[0] != GROUP:
            continue
        with pytest.raises(GroupRejected) as err:
            decode_group(frames[1:], vocab_size=VOCAB)
        assert err.value.group_id == gid, kind
    group = decode_group(encode_group(good("g")), vocab_size=VOCAB)
    assert group.group_id == "g" and len(group.trajectories) == 2


# ---- a non-finite gradient in the learner's step ---------------------------------------------------
async def test_the_learner_skips_a_nonfinite_update_records_it_and_goes_on(tmp_path):
    """Through the learner's own step: a non-finite gradient (here an inf weight makes every log-prob
    NaN) applies nothing, keeps the version, records the groups as "nonfinite_gradient", and the next
    metrics line counts the skip."""
    import torch
    from support.synthetic import tiny_llama

    from agentrl.learner.config import LearnerConfig
    from agentrl.learner.metrics import MetricsWriter, read_metrics
    from agentrl.learner.service import Learner
    from agentrl.learner.trainer_config import OptimizerConfig, TrainerConfig

    model_dir = tmp_path / "model"
    tiny_llama(128, seed=0).save_pretrained(model_dir)
    config = LearnerConfig(output_dir=str(tmp_path / "run"), model_dir=str(model_dir), publish={"every": 0},
                           transport={"version_endpoint": None, "group_endpoint": endpoint()}, tensorboard=False, progress_bar=False,
                           trainer=TrainerConfig(precision="fp32", optimizer=OptimizerConfig(lr=1e-3)))
    learner = Learner(config)
    learner.start_training()
    assert learner.intake.receiver.vocab_size == 128
    assert learner.intake.receiver.max_frame_bytes == config.transport.max_group_frame_bytes == 64 << 20
    learner.metrics, learner.publisher, learner.version_pub = MetricsWriter(learner.out, tensorboard=False,
                                                                            progress_bar=False), None, None
    norm = learner.ranks.model.model.norm.weight
    saved = norm.detach().clone()
    with torch.no_grad():
        norm[0] = float("inf")
    weights_before = {n: p.detach().clone() for n, p in learner.ranks.model.named_parameters()}
    groups = [make_group(f"g{i}", [1.0, 0.0], vocab_size=128, seed=i) for i in range(2)]
    await learner._train_step(groups, 0.0)
    assert learner.step == 0 and learner.num_skipped_steps == 1
    assert learner.intake.ledger.rejected == {"g0": "nonfinite_gradient", "g1": "nonfinite_gradient"}
    for name, p in learner.ranks.model.named_parameters():
        assert torch.equal(p, weights_before[name]), name
    with torch.no_grad():
        norm.copy_(saved)
    await learner._train_step([make_group("g2", [1.0, 0.0], vocab_size=128, seed=2)], 0.0)
    learner.metrics.close()
    [line] = read_metrics(learner.out / "metrics.jsonl")
    assert line["step"] == 1 and line["steps/skipped_nonfinite_grad"] == 1 and np.isfinite(line["grad_norm"])
    assert line["group_ids"] == ["g2"] and line["rejected_group_ids"] == ["g0", "g1"]


async def test_a_batch_that_trains_nothing_adds_its_wait_and_drops_to_the_next_steps_line(tmp_path):
    """Dynamic sampling drops a group whose rewards are all equal; a batch of only such groups makes
    no step and writes no line, so its waiting time and dropped count go into the next step's line:
    the lines' sums are the run's totals (the report's "waiting for data" and the drop count)."""
    from support.synthetic import tiny_llama

    from agentrl.learner.advantages import AdvantageConfig
    from agentrl.learner.config import LearnerConfig
    from agentrl.learner.metrics import MetricsWriter, read_metrics
    from agentrl.learner.service import Learner
    from agentrl.learner.trainer_config import OptimizerConfig, TrainerConfig

    model_dir = tmp_path / "model"
    tiny_llama(128, seed=0).save_pretrained(model_dir)
    config = LearnerConfig(output_dir=str(tmp_path / "run"), model_dir=str(model_dir), publish={"every": 0},
                           transport={"version_endpoint": None, "group_endpoint": endpoint()}, tensorboard=False, progress_bar=False,
                           trainer=TrainerConfig(precision="fp32", optimizer=OptimizerConfig(lr=1e-3),
                                                 advantage=AdvantageConfig(dynamic_sampling=True)))
    learner = Learner(config)
    learner.start_training()
    learner.metrics, learner.publisher, learner.version_pub = MetricsWriter(learner.out, tensorboard=False,
                                                                            progress_bar=False), None, None
    await learner._train_step([make_group("same0", [1.0, 1.0], vocab_size=128, seed=0)], 5.0)
    await learner._train_step([make_group("same1", [0.0, 0.0], vocab_size=128, seed=1)], 4.0)
    assert learner.step == 0
    await learner._train_step([make_group("g2", [1.0, 0.0], vocab_size=128, seed=2),
                               make_group("same3", [1.0, 1.0], vocab_size=128, seed=3)], 2.0)
    await learner._train_step([make_group("g4", [1.0, 0.0], vocab_size=128, seed=4)], 1.0)
    learner.metrics.close()
    first, second = read_metrics(learner.out / "metrics.jsonl")
    assert first["step"] == 1 and first["time/wait_s"] == 11.0 and first["groups/dropped_equal_rewards"] == 3
    assert first["group_ids"] == ["g2"] and first["rejected_group_ids"] == ["same0", "same1", "same3"]
    assert second["time/wait_s"] == 1.0 and second["groups/dropped_equal_rewards"] == 0


# ---- the learner process itself --------------------------------------------------------------------
@pytest.mark.slow
async def test_the_learner_process_refuses_poison_trains_the_rest_and_restarts_clean(tmp_path):
    """The issue's poison list through a real `agentrl learner` process: it trains the good groups to
    max_steps and exits 0; the poison is nacked (or dropped by the sender), kept in rejected/, not
    spooled, so a restart has nothing to replay and starts clean."""
    import subprocess
    import sys

    from support.synthetic import tiny_llama

    from agentrl.learner.metrics import read_metrics

    vocab = 64
    model_dir = tmp_path / "model"
    tiny_llama(vocab_size=vocab).save_pretrained(model_dir)
    ep = endpoint()
    run_dir = tmp_path / "run"
    config = tmp_path / "learner.toml"
    config.write_text(f"""
output_dir = "{run_dir}"
model_dir = "{model_dir}"
tokens_per_step = 100
max_steps = 3
publish.every = 0
staleness_bound = 100
transport.group_endpoint = "{ep}"
transport.version_endpoint = "{endpoint()}"
tensorboard = false
progress_bar = false

[trainer]
precision = "fp32"
max_row_tokens = 256
""")

    def group(gid: str, seed: int):  # 2 samples x 25 tokens: two groups fill a 100-token step
        return make_group(gid, [1.0, 0.0], prompt_len=5, turns=[(8, 4), (8, 0)], vocab_size=vocab, seed=seed)

    def start() -> subprocess.Popen:
        log = open(tmp_path / "learner.log", "ab")  # noqa: SIM115 (the child holds it)
        return subprocess.Popen([sys.executable, "-P", "-m", "agentrl.cli", "learner", "--config", str(config)],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    nan_reward = group("nan-reward", 100)
    nan_reward.trajectories[0].task_reward = math.nan
    past_vocab = group("past-vocab", 101)
    past_vocab.trajectories[1].token_ids[0] = vocab
    nan_logprob = group("nan-logprob", 102)
    nan_logprob.trajectories[0].behavior_logprobs[nan_logprob.trajectories[0].is_action == 1] = np.nan
    int_id = group("int-id", 103)
    int_id.group_id = 5
    base = encode_group(group("string-process-reward", 104))
    raw_poison = [[GROUP, *_with_header(base, _set_turn("process_rewards", {"valid": "0.1"}))],
                  [GROUP, *_with_header(encode_group(group("x", 105)), lambda h: h.update(group_id=12345))]]
    learner = start()
    ctx = zmq.asyncio.Context()
    hostile = ctx.socket(zmq.DEALER)
    hostile.setsockopt(zmq.LINGER, 0)
    sender = GroupSender(ep, max_unacked=2)
    try:
        # Once the learner waits for its first batch, the hostile frames come first: it must answer them
        # (it reads the socket only while it assembles a batch, so later ones could outlive its last step).
        await _wait_for(lambda: "READY" in (tmp_path / "learner.log").read_text(), timeout_s=120)
        hostile.connect(ep)
        for frames in raw_poison:
            await hostile.send_multipart(frames)
        nacks = [await asyncio.wait_for(hostile.recv_multipart(), 30) for _ in raw_poison]
        await sender.start()
        for poison in (nan_reward, past_vocab, nan_logprob, int_id):
            await asyncio.wait_for(sender.send(poison), 60)
        for i in range(6):
            await asyncio.wait_for(sender.send(group(f"ok-{i}", i)), 60)
        assert await asyncio.to_thread(learner.wait, 120) == 0
    finally:
        if learner.poll() is None:
            os.killpg(learner.pid, signal.SIGKILL)
        await sender.close()
        ctx.destroy(linger=0)
    assert sender.num_acked == 6 and sender.num_rejected == 4 and sender.num_unacked == 0
    assert set(sender.rejected) == {"nan-reward", "past-vocab", "nan-logprob", "5"}
    assert [n[0] for n in nacks] == [NACK, NACK] and nacks[0][1] == b"string-process-reward" and nacks[1][1] == b""
    kept = read_rejected(run_dir / "rejected")
    assert sorted(r["group_id"] or "" for r in kept) == sorted(["", "nan-logprob", "nan-reward", "past-vocab",
                                                                 "string-process-reward"])
    trained = [gid for line in read_metrics(run_dir / "metrics.jsonl") for gid in line["group_ids"]]
    assert sorted(trained) == [f"ok-{i}" for i in range(6)]
    assert not list((run_dir / "spool").glob("*.grp"))  # pruned by the final checkpoint; no poison ever there
    restarted = start()
    try:
        assert await asyncio.to_thread(restarted.wait, 120) == 0  # at max_steps already: starts, checkpoints, exits
    finally:
        if restarted.poll() is None:
            os.killpg(restarted.pid, signal.SIGKILL)
    assert "replay=0" in (tmp_path / "learner.log").read_text().split("READY")[-1]


async def test_version_messages_that_do_not_decode_are_skipped_and_the_publisher_bounds_its_frames():
    """The actor's version subscriber reads what a PUB sends: junk is skipped and counted (it used to
    kill the listening task, freezing the actor's view of the learner's version). The learner's PUB
    reads only subscriptions, under a small MAXMSGSIZE."""
    from agentrl.common.transport import CONTROL_MAX_FRAME_BYTES, VersionPublisher, VersionSubscriber

    ep = endpoint()
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(ep)
    sub = VersionSubscriber(ep)
    await sub.start()
    try:
        for _ in range(100):  # PUB drops what it sends before the subscription arrives
            await pub.send(msgpack.packb({"version": 1, "served_version": 1}))
            if sub.latest is not None:
                break
            await asyncio.sleep(0.05)
        assert sub.latest == (1, 1)
        for junk in (b"\xc1", msgpack.packb([1, 2]), msgpack.packb({"version": "9", "served_version": 9}),
                     msgpack.packb({"version": 9}), msgpack.packb({"version": True, "served_version": 9})):
            await pub.send(junk)
        await pub.send(msgpack.packb({"version": 3, "served_version": 2}))
        assert await sub.wait_until(lambda v: v == (3, 2), timeout_s=10) == (3, 2)
        assert sub.num_malformed == 5
    finally:
        await sub.close()
        ctx.destroy(linger=0)
    publisher = VersionPublisher(endpoint())
    await publisher.start()
    try:
        assert publisher._sock.getsockopt(zmq.MAXMSGSIZE) == CONTROL_MAX_FRAME_BYTES
    finally:
        await publisher.close()
