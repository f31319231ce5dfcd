"""The curriculum by pass rate and the signal monitor (engine/curriculum.py), pure: no processes."""

from __future__ import annotations

import itertools
import json
from collections import Counter

import numpy as np
import pytest

from agentrl.common.trajectory import Trajectory, TrajectoryGroup, Turn
from agentrl.engine.curriculum import CurriculumConfig, PassRateCurriculum, SignalMonitor
from agentrl.engine.task import Task

TASKS = [Task(f"t{i}", prompt=f"question {i}", reference=str(i)) for i in range(40)]


def stream():
    return itertools.cycle(TASKS)


def group(task_id: str, rewards: list[float], process: list[float] | None = None, failed: int = 0) -> TrajectoryGroup:
    trajs = []
    for i, reward in enumerate([*rewards, *([0.0] * failed)]):
        turn = Turn(action_start=1, action_end=2, obs_end=2,
                    process_rewards={"valid_call": (process or [0.0] * len(rewards))[i]} if i < len(rewards) else {})
        trajs.append(Trajectory(task_id=task_id, group_id=f"g-{task_id}", sample_index=i,
                                token_ids=np.array([1, 2], dtype=np.int32), is_action=np.array([0, 1], dtype=np.uint8),
                                behavior_logprobs=np.zeros(2, dtype=np.float32),
                                policy_versions=np.array([-1, 0], dtype=np.int32), prompt_len=1, turns=[turn],
                                task_reward=reward, status="failed" if i >= len(rewards) else "ok"))
    return TrajectoryGroup(f"g-{task_id}", task_id, trajs)


def pass_rate_of(task_id: str) -> float:
    """The world of these tests: t0-t9 are mixed (half pass), t10-t24 always fail, the rest always pass."""
    index = int(task_id[1:])
    return 0.5 if index < 10 else 0.0 if index < 25 else 1.0


def play(cur: PassRateCurriculum, num: int) -> list[str]:
    drawn = []
    for _ in range(num):
        task = cur.draw()
        rate = pass_rate_of(task.task_id)
        cur.observe(group(task.task_id, [1.0] * int(4 * rate) + [0.0] * (4 - int(4 * rate))))
        drawn.append(task.task_id)
    return drawn


def test_without_observations_the_draws_are_the_streams_order():
    cur = PassRateCurriculum(CurriculumConfig(), stream)
    assert [cur.draw().task_id for _ in range(50)] == [t.task_id for t in itertools.islice(stream(), 50)]


def test_mixed_tasks_are_revisited_and_solved_or_failed_ones_kept_at_the_floor():
    cfg = CurriculumConfig(revisit_share=0.5, floor=0.2, seed=3)
    cur = PassRateCurriculum(cfg, stream)
    play(cur, 40)  # the first pass over the stream: every task tried once
    counts = Counter(play(cur, 4000))
    mixed = sum(counts[f"t{i}"] for i in range(10))
    others = sum(counts.values()) - mixed
    # Half of the draws revisit the 10 mixed tasks; the stream's draws take a mixed task whenever it
    # comes up and the other 30 at the floor: per pass 10 + 30 x 0.2 = 16 draws, 10 of them mixed.
    expected_mixed = 0.5 + 0.5 * 10 / 16
    assert mixed / 4000 == pytest.approx(expected_mixed, abs=0.03)
    assert others > 0, "the floor keeps drawing tasks without signal"
    # Every task of the world is still drawn: none is starved.
    assert set(counts) == {t.task_id for t in TASKS}
    summary = cur.summary()
    assert summary["curriculum/tasks_mixed"] == 10 and summary["curriculum/tasks_all_fail"] == 15
    assert summary["curriculum/tasks_all_pass"] == 15


def test_floor_one_and_no_revisits_is_the_plain_stream():
    cur = PassRateCurriculum(CurriculumConfig(revisit_share=0.0, floor=1.0), stream)
    assert play(cur, 120) == [t.task_id for t in itertools.islice(stream(), 120)]


def test_a_task_that_stops_being_mixed_leaves_the_revisit_set():
    cur = PassRateCurriculum(CurriculumConfig(), lambda: itertools.cycle(TASKS[:1]))
    task = cur.draw()
    cur.observe(group(task.task_id, [1.0, 0.0]))
    assert list(cur.mixed) == [task.task_id]
    assert cur.draw() == task  # a revisit, or the stream's next (the same task)
    cur.observe(group(task.task_id, [1.0, 1.0]))
    assert not cur.mixed
    assert (cur.records[task.task_id].attempts, cur.records[task.task_id].passes) == (4, 3)


def test_skips_are_bounded():
    cfg = CurriculumConfig(revisit_share=0.0, floor=0.0, max_skips=5)
    cur = PassRateCurriculum(cfg, stream)
    for _ in range(40):  # every task known to fail
        cur.observe(group(cur.draw().task_id, [0.0, 0.0]))
    before = cur.num_taken
    cur.draw()
    assert cur.num_taken - before == 6 and cur.num_skipped == 5


def test_failed_samples_do_not_count_and_an_all_failed_group_is_ignored():
    cur = PassRateCurriculum(CurriculumConfig(), stream)
    task = cur.draw()
    cur.observe(group(task.task_id, [1.0, 0.0], failed=2))
    assert cur.records[task.task_id].attempts == 2
    task = cur.draw()
    cur.observe(group(task.task_id, [], failed=3))
    assert task.task_id not in cur.records


def test_observing_a_task_it_did_not_draw_is_an_error():
    cur = PassRateCurriculum(CurriculumConfig(), stream)
    with pytest.raises(KeyError, match="not drawn"):
        cur.observe(group("t5", [1.0]))


def test_a_restored_state_draws_exactly_what_the_saved_sampler_would():
    cfg = CurriculumConfig(seed=11)
    a = PassRateCurriculum(cfg, stream)
    play(a, 137)
    state = json.loads(json.dumps(a.state()))  # as the actor writes and reads it
    b = PassRateCurriculum(cfg, stream, state=state)
    assert b.state() == a.state()
    assert play(b, 300) == play(a, 300)
    assert b.summary() == a.summary()


def test_a_state_of_another_version_is_refused():
    cur = PassRateCurriculum(CurriculumConfig(), stream)
    state = cur.state() | {"version": 99}
    with pytest.raises(ValueError, match="version 99"):
        PassRateCurriculum(CurriculumConfig(), stream, state=state)


@pytest.mark.parametrize("bad", [{"revisit_share": 1.0}, {"floor": 1.5}, {"max_revisit_tasks": 0}])
def test_bad_config_is_refused(bad):
    with pytest.raises(ValueError):
        CurriculumConfig(**bad)


def test_signal_monitor_counts_equal_groups_and_groups_without_task_reward():
    monitor = SignalMonitor(window=4, pass_reward=1.0)
    monitor.observe(group("a", [0.0, 0.0], process=[0.1, 0.1]))  # equal: no signal
    monitor.observe(group("b", [0.0, 0.0], process=[0.1, 0.0]))  # shaping differs: signal, no task reward
    monitor.observe(group("c", [1.0, 1.0]))  # all solved: equal
    assert monitor.summary()["signal/groups_since_task_reward"] == 0
    for name in "defg":
        monitor.observe(group(name, [0.0, 0.0]))
    summary = monitor.summary()
    assert summary["signal/groups"] == 7 and summary["signal/equal_groups"] == 6
    assert summary["signal/recent_groups"] == 4 and summary["signal/recent_equal"] == 4
    assert summary["signal/groups_since_task_reward"] == 4
    monitor.observe(group("h", [], failed=2))  # infrastructure only: not counted
    assert monitor.summary()["signal/groups"] == 7
