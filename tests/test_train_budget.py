"""The main job's time-budget rules: what the final evaluation reserves, which evaluations move the
deadline when evaluations are outside the budget, when an RL-phase evaluation may start, and that the
supervisor keeps the evaluation history it bases them on (including after --resume)."""

from __future__ import annotations

import json

import pytest

from agentrl.budget import eval_extends_deadline_s, evenly_spaced, final_eval_reserve_s, rl_eval_fits
from agentrl.runconfig import TrainConfig
from agentrl.train import Supervisor


def _summary(label: str, eval_s: float) -> dict:
    return {"label": label, "eval_s": eval_s, "score": 0.0, "score_metric": "em", "em": 0.0, "f1": 0.0, "n": 4,
            "served_version": 0}


def test_reserve_follows_the_latest_evaluation_that_had_the_server_to_itself():
    assert final_eval_reserve_s([], in_budget=True) == pytest.approx(1.25 * 120.0 + 30.0)
    baseline_only = [_summary("base_tool_call", 200.0), _summary("naive_rag", 20.0)]
    assert final_eval_reserve_s(baseline_only, in_budget=True) == pytest.approx(1.25 * 200.0 + 30.0)
    # The SFT evaluation replaces the baseline; RL-phase evaluations (slowed by the actor) and Naive
    # RAG (one turn) never count.
    history = [*baseline_only, _summary("sft", 80.0), _summary("rl", 400.0), _summary("naive_rag", 5.0)]
    assert final_eval_reserve_s(history, in_budget=True) == pytest.approx(1.25 * 80.0 + 30.0)
    assert final_eval_reserve_s(history, in_budget=False) == 0.0


def test_a_baseline_on_a_subset_counts_scaled_to_the_whole_held_out_set():
    # 4 of 16 tasks: x sqrt(4), a larger concurrent batch using the server better (agentrl/budget.py)
    subset = [{**_summary("base_tool_call", 50.0), "subset_of": 16}, _summary("naive_rag", 5.0)]
    assert final_eval_reserve_s(subset, in_budget=True) == pytest.approx(1.25 * 100.0 + 30.0)
    history = [*subset, _summary("sft", 80.0)]
    assert final_eval_reserve_s(history, in_budget=True) == pytest.approx(1.25 * 80.0 + 30.0)


def test_baseline_tasks_are_evenly_spaced_through_the_held_out_set():
    heldout = list(range(64))
    assert evenly_spaced(heldout, 16) == list(range(0, 64, 4))
    assert evenly_spaced(heldout, 0) == heldout and evenly_spaced(heldout, 100) == heldout
    assert evenly_spaced(list(range(10)), 3) == [0, 3, 6]


def test_only_before_and_after_evaluations_move_the_deadline_when_outside_the_budget():
    assert eval_extends_deadline_s(_summary("sft", 75.0), in_budget=False) == 75.0
    assert eval_extends_deadline_s(_summary("final", 60.0), in_budget=False) == 60.0
    # Training goes on beside an RL-phase evaluation; baselines run before the budget starts.
    for label in ("rl", "base_tool_call", "naive_rag"):
        assert eval_extends_deadline_s(_summary(label, 90.0), in_budget=False) == 0.0
    for label in ("sft", "final", "rl"):
        assert eval_extends_deadline_s(_summary(label, 90.0), in_budget=True) == 0.0


def test_rl_evaluation_starts_only_when_due_and_when_it_fits():
    # Due at 100 s, the last RL-phase one took 40 s (x 1.25 = 50 s), the RL phase ends at 200 s; the
    # clean evaluations' durations do not count once an RL-phase one ran.
    history = [_summary("base_tool_call", 200.0), _summary("sft", 20.0), _summary("rl", 40.0)]

    def fits(now_s: float, evals: list[dict] = history) -> bool:
        return rl_eval_fits(now_s, evals, next_eval_s=100.0, rl_end_s=200.0, in_budget=True)

    assert not fits(99.0)
    assert fits(100.0) and fits(149.0)
    assert not fits(150.0)
    # Before the first RL-phase evaluation the final-evaluation reserve (1.25 x 20 + 30 = 55 s)
    # stands in for it: 1.25 x 55 = 68.75 s must fit.
    assert fits(131.0, history[:2]) and not fits(131.5, history[:2])


def test_supervisor_keeps_the_evaluation_history_and_reads_it_back_on_resume(tmp_path):
    config = TrainConfig()
    first = Supervisor(config, tmp_path)
    first.deadline = 1000.0
    first.log_eval(_summary("base_tool_call", 200.0))
    first.log_eval(_summary("sft", 80.0))
    first.log_eval(_summary("rl", 300.0))
    assert first.deadline == 1000.0  # in the budget: nothing is added back
    assert first.final_eval_reserve_s() == pytest.approx(1.25 * 80.0 + 30.0)
    assert [json.loads(line)["label"] for line in (tmp_path / "evals.jsonl").read_text().splitlines()] == [
        "base_tool_call", "sft", "rl"]

    resumed = Supervisor(config, tmp_path, resume=True)
    assert [e["label"] for e in resumed.evaluations.summaries] == ["base_tool_call", "sft", "rl"]
    assert resumed.final_eval_reserve_s() == pytest.approx(1.25 * 80.0 + 30.0)
    assert Supervisor(config, tmp_path).evaluations.summaries == []  # a fresh run does not inherit an old history

    config.eval.in_budget = False
    outside = Supervisor(config, tmp_path / "outside")
    (tmp_path / "outside").mkdir()
    outside.deadline = 1000.0
    outside.log_eval(_summary("sft", 80.0))
    outside.log_eval(_summary("rl", 300.0))
    assert outside.deadline == 1080.0
    assert outside.final_eval_reserve_s() == 0.0


def test_a_damaged_evaluation_history_is_named_on_resume(tmp_path):
    (tmp_path / "evals.jsonl").write_text(json.dumps(_summary("sft", 80.0)) + "\n" + '{"label": "rl", "eval_s"\n')
    with pytest.raises(ValueError, match=r"evals\.jsonl:2: not a JSON record"):
        Supervisor(TrainConfig(), tmp_path, resume=True)


def test_a_fresh_run_into_a_run_directory_is_refused(tmp_path, capsys, monkeypatch):
    from agentrl.train import main

    async def no_run(self):  # were the refusal gone, fail here instead of starting services
        raise AssertionError("a run started in a directory that holds one")

    monkeypatch.setattr(Supervisor, "run", no_run)
    (tmp_path / "config.toml").write_text("minutes = 1.0\n")
    (tmp_path / "evals.jsonl").write_text(json.dumps(_summary("sft", 80.0)) + "\n")
    assert main(["--out", str(tmp_path)]) == 2
    assert f"--resume {tmp_path}" in capsys.readouterr().err
    # Nothing of the earlier run was touched.
    assert (tmp_path / "config.toml").read_text() == "minutes = 1.0\n"
    assert len((tmp_path / "evals.jsonl").read_text().splitlines()) == 1


def test_the_sft_cold_start_stops_at_its_own_limit_or_when_only_the_final_reserve_is_left():
    from agentrl.budget import sft_stop_at

    # deadline 1000 s, final evaluation reserve 100 s: never later than 900 s
    assert sft_stop_at(0.0, 0.0, 1000.0, 100.0) == 900.0  # no limit of its own
    assert sft_stop_at(0.0, 5.0, 1000.0, 100.0) == 300.0  # 5 minutes
    assert sft_stop_at(0.0, 60.0, 1000.0, 100.0) == 900.0  # a limit past the budget does not extend it
    assert sft_stop_at(200.0, 5.0, 1000.0, 100.0) == 500.0


def test_the_sft_learner_trains_the_demonstrations_at_temperature_1_whatever_rl_samples_at():
    """learner.trainer.temperature is RL's sampling temperature; the SFT learner must not inherit it
    (at 0.7 the default's SFT checkpoint lost every 2-hop question)."""
    from agentrl.common.config import layer, to_dict
    from agentrl.learner.config import LearnerConfig
    from agentrl.runconfig import load_run_config, sft_learner_overrides

    def sft_learner(sets):
        config = load_run_config(None, sets).config
        return config, LearnerConfig(**layer(to_dict(config.learner), sft_learner_overrides(config.sft)))

    config, learner = sft_learner(["orchestrator.sampling.temperature=0.6", "learner.trainer.temperature=0.6",
                                   "learner.kl_reference=true", "learner.trainer.loss.kl_coef=0.05"])
    assert config.learner.trainer.temperature == 0.6 and learner.trainer.temperature == 1.0
    assert config.learner.kl_reference and not learner.kl_reference and learner.trainer.loss.kl_coef == 0.0
    assert learner.max_steps == config.sft.steps and learner.trainer.optimizer.lr == config.sft.learner["trainer"]["optimizer"]["lr"]
    # [sft.learner] may still name its own.
    _, learner = sft_learner(["sft.learner.trainer.temperature=0.9"])
    assert learner.trainer.temperature == 0.9


def test_sft_max_minutes_is_checked_with_the_config():
    from agentrl.common.config import ConfigError
    from agentrl.runconfig import load_run_config

    assert load_run_config(None, ["sft.max_minutes=12.5"]).config.sft.max_minutes == 12.5
    with pytest.raises(ConfigError, match="max_minutes"):
        load_run_config(None, ["sft.max_minutes=-1"])


def test_rl_phase_evaluations_stay_within_the_evaluation_share():
    from agentrl.report import evaluation_seconds

    # Clean evaluations of 100 s: the final one's reserve is 1.25 x 100 + 30 = 155 s, and an RL-phase
    # evaluation is expected to take 1.25 x that before the first one ran.
    history = [_summary("base_tool_call", 100.0), _summary("naive_rag", 20.0), _summary("sft", 100.0)]
    assert evaluation_seconds(history) == 220.0
    needed = 220.0 + 1.25 * 155.0 + 155.0

    def fits(max_eval_s: float, evals: list[dict] = history) -> bool:
        return rl_eval_fits(500.0, evals, next_eval_s=0.0, rl_end_s=10_000.0, in_budget=True, max_eval_s=max_eval_s)

    assert fits(needed) and not fits(needed - 1.0)
    assert not fits(0.0)  # eval.max_share = 0: none during RL
    # Evaluations read from the cache, reused for an unchanged policy, or diagnostics after the
    # budget took no time of it.
    free = [{**_summary("base_tool_call", 100.0), "cached": True}, {**_summary("final", 100.0), "repeat_of": "sft"},
            _summary("final_without_tools", 50.0), _summary("final_transfer", 50.0)]
    assert evaluation_seconds(free) == 0.0
    assert evaluation_seconds([*history, *free]) == 220.0


def test_an_evaluation_that_did_not_run_moves_no_deadline():
    for flag in ({"cached": True}, {"repeat_of": "sft"}):
        assert eval_extends_deadline_s({**_summary("final", 60.0), **flag}, in_budget=False) == 0.0


def test_the_rl_shortfall_warning_names_the_budget_that_gives_rl_its_share():
    from agentrl.budget import rl_shortfall_message

    # A 28-minute budget keeps 0.4 x 28 = 11.2 minutes for RL; 3 minutes are left: 8.2 more are needed.
    text = rl_shortfall_message(180.0, 0.4, 28.0)
    assert "the RL phase gets 3.0 minutes, less than rl_min_share = 0.4 of the 28-minute budget (11.2 minutes)" in text
    assert "This machine needs about 8 more minutes for RL; use --minutes 37" in text
    assert "use --minutes 40" in rl_shortfall_message(-30.0, 0.4, 28.0)  # none left at all


def test_rl_min_share_must_leave_room_for_the_rest():
    with pytest.raises(ValueError, match="rl_min_share"):
        TrainConfig(rl_min_share=1.0)
    with pytest.raises(ValueError, match="rl_min_share"):
        TrainConfig(rl_min_share=-0.1)


class _FakePool:
    def __init__(self, version: int):
        self.version = version

    async def weight_versions(self) -> dict[str, int]:
        return {"http://server": self.version}


def _fake_supervisor(tmp_path, version: int, monkeypatch, calls: list):
    from types import SimpleNamespace

    import agentrl.phases.evaluations as evaluations

    async def fake_evaluate(conn, tasks, label, env=None, episodes=None, on_progress=None):
        calls.append(label)
        return {**_summary(label, 50.0), "served_version": version, "harness": "native"}, []

    monkeypatch.setattr(evaluations, "evaluate", fake_evaluate)
    supervisor = Supervisor(TrainConfig(), tmp_path)
    supervisor.conn = supervisor.evaluations.conn = SimpleNamespace(pool=_FakePool(version), env=SimpleNamespace(report_by=()),
                                                                    chat=None)
    supervisor.heldout, supervisor.taskset = [], SimpleNamespace(transfer=[])
    return supervisor


async def test_an_evaluation_of_an_unchanged_policy_is_not_run_again(tmp_path, monkeypatch):
    calls: list[str] = []
    supervisor = _fake_supervisor(tmp_path, 25, monkeypatch, calls)
    sft, trajs = await supervisor.evaluations.of_policy("sft")
    supervisor.log_eval(sft, trajs)
    assert calls == ["sft"] and (tmp_path / "evals" / "sft-v25.jsonl").is_file()
    # The served version is still 25 (RL made no step): the final evaluation reuses the SFT one.
    final, trajs = await supervisor.evaluations.of_policy("final")
    assert calls == ["sft"] and trajs is None
    assert final["label"] == "final" and final["repeat_of"] == "sft" and final["score"] == sft["score"]
    assert (tmp_path / "evals" / "final-v25.jsonl").read_text() == (tmp_path / "evals" / "sft-v25.jsonl").read_text()
    # Another served version is evaluated.
    supervisor.conn.pool.version = 26
    await supervisor.evaluations.of_policy("final")
    assert calls == ["sft", "final"]
    # A resumed run's evaluations were another server's: its fresh server at version 26 is evaluated.
    resumed = _fake_supervisor(tmp_path, 26, monkeypatch, calls)
    resumed.evaluations.summaries = supervisor.evaluations.summaries
    resumed.evaluations.first_of_this_process = len(resumed.evaluations.summaries)
    await resumed.evaluations.of_policy("final")
    assert calls == ["sft", "final", "final"]


async def test_an_rl_phase_without_time_is_skipped_with_the_warning(tmp_path, monkeypatch, capsys):
    import time

    calls: list[str] = []
    supervisor = _fake_supervisor(tmp_path, 25, monkeypatch, calls)
    supervisor.config.minutes = 28.0
    supervisor.log_eval(_summary("sft", 100.0))
    supervisor.deadline = time.monotonic() + 170.0  # the final evaluation's reserve is 155 s
    from agentrl.phases.rl import rl_phase

    await rl_phase(supervisor)
    out = capsys.readouterr().out
    assert "warning: the RL phase gets 0.2 minutes, less than rl_min_share = 0.4" in out
    assert "RL phase skipped" in out
    assert supervisor.phases["rl"] == {"skipped": "no time left", "rl_s": 0.0, "rl_steps": 0}
    assert not supervisor.procs  # no learner or actor was started


async def test_an_sft_phase_without_time_is_skipped_before_a_learner_starts(tmp_path, monkeypatch, capsys):
    import time

    calls: list[str] = []
    supervisor = _fake_supervisor(tmp_path, 0, monkeypatch, calls)
    supervisor.config.learner.anchor.coef = 0.0
    supervisor.config.minutes = 28.0

    import agentrl.phases.sft as sft

    async def demonstrations(sup):
        return ["a demonstration"], "test"

    monkeypatch.setattr(sft, "demonstrations", demonstrations)
    supervisor.log_eval(_summary("base_tool_call", 100.0))
    # 0.4 x 28 minutes for RL and 2 x 155 s for the SFT and final evaluations: 982 s; 60 s more is
    # less than the 90 s a learner needs.
    supervisor.deadline = time.monotonic() + 0.4 * 28 * 60 + 2 * 155.0 + 60.0
    await sft.sft_phase(supervisor)
    assert "SFT cold start skipped: " in capsys.readouterr().out
    assert supervisor.phases["sft"] == {"skipped": "no time left"} and not supervisor.procs and not calls


async def test_a_baseline_on_a_subset_is_never_reused_as_the_sft_or_final_evaluation(tmp_path):
    """An unchanged policy's evaluation is reused, but only one on the whole held-out set: the
    16-question Base Tool Call must not stand in for a final evaluation of 64."""
    from types import SimpleNamespace

    supervisor = Supervisor(TrainConfig(), tmp_path)
    evaluations = supervisor.evaluations
    evaluations.heldout = ["t"] * 64

    async def weight_versions():
        return {"http://server": 0}

    ran = []

    async def evaluate(tasks, label, env=None):
        ran.append(label)
        return {**_summary(label, 10.0), "n": len(tasks)}, []

    evaluations.conn = SimpleNamespace(pool=SimpleNamespace(weight_versions=weight_versions))
    evaluations.run = evaluate
    evaluations.summaries = [{**_summary("base_tool_call", 50.0), "n": 16, "subset_of": 64}]
    summary, _ = await evaluations.of_policy("final")
    assert ran == ["final"] and summary["n"] == 64
    evaluations.summaries = [{**_summary("base_tool_call", 50.0), "n": 64}]  # the whole set: reused
    summary, trajectories = await evaluations.of_policy("final")
    assert ran == ["final"] and trajectories is None and summary["repeat_of"] == "base_tool_call"
