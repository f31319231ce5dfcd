"""The report's question-by-question comparison of two held-out evaluations."""

from __future__ import annotations

import json

import pytest

from agentrl.report import paired_by, paired_comparison, write_report


def test_paired_comparison_counts_discordant_questions_and_sign_test():
    before = {"a": 0.0, "b": 1.0, "c": 0.0, "d": 0.0, "e": 1.0}
    after = {"a": 1.0, "b": 1.0, "c": 1.0, "d": 0.0, "e": 0.0, "only-after": 1.0}
    result = paired_comparison(before, after)
    # 5 shared questions; a and c gained, e lost: n = 3 discordant, P(X <= 1 | Bin(3, 1/2)) = 4/8, two-sided 1.0
    assert result == {"n": 5, "gained": 2, "lost": 1, "p_value": 1.0}
    ten_gains = paired_comparison({str(i): 0.0 for i in range(10)}, {str(i): 1.0 for i in range(10)})
    assert ten_gains["gained"] == 10 and ten_gains["p_value"] == pytest.approx(2 / 2**10)
    assert paired_comparison({"a": 1.0}, {"b": 1.0}) is None


def test_report_states_the_paired_comparison(tmp_path):
    def summary(score, version, by):
        return {"score": score, "score_metric": "em", "em": score, "f1": score, "n": 4, "served_version": version,
                "by_num_hops": {"1": {"score": by[0], "n": 2}, "2": {"score": by[1], "n": 2}}}

    phases = {"baseline": {"base_tool_call": summary(0.0, 0, (0.0, 0.0))},
              "sft": summary(0.25, 12, (0.5, 0.0)), "rl": {"rl_steps": 18, "rl_s": 600.0},
              "final": summary(0.75, 30, (1.0, 0.5)),
              "final_transfer": {"score": 0.125, "score_metric": "em", "em": 0.125, "n": 8, "served_version": 30,
                                 "by_num_hops": {"3": {"score": 0.125, "n": 8}}}}
    (tmp_path / "phases.json").write_text(json.dumps(phases))
    (tmp_path / "evals").mkdir()
    for label, version, ems in (("sft", 12, [1, 0, 0, 0]), ("final", 30, [1, 1, 1, 0])):
        (tmp_path / "evals" / f"{label}-v{version}.jsonl").write_text(
            "".join(json.dumps({"task_id": f"q{i}", "score": float(em), "group": {"num_hops": str(1 + i // 2)}}) + "\n"
                    for i, em in enumerate(ems)))
    text = write_report(tmp_path).read_text()
    assert "em gain of the RL phase over the SFT-only checkpoint: **+0.500**" in text
    # the score by hop count, per policy
    assert "| policy | em | f1 | em num_hops=1 | em num_hops=2 |" in text
    assert "| After RL (final) | 0.750 | 0.750 | 1.000 (n=2) | 0.500 (n=2) |" in text
    assert "RL right where SFT was wrong 2, SFT right where RL is wrong 0" in text and "p = 0.5" in text
    # and the same sign test within each hop count: q0, q1 are 1-hop (q1 gained), q2, q3 2-hop (q2 gained)
    assert "- hops = 1 (2 questions): RL gained 1, lost 0, p = 1" in text
    assert "- hops = 2 (2 questions): RL gained 1, lost 0, p = 1" in text
    assert paired_by(tmp_path, ("sft", phases["sft"]), ("final", phases["final"]))["num_hops"]["2"]["gained"] == 1
    assert "on transfer tasks, harder than any trained on: em **0.125** (n=8; num_hops=3: 0.125 (n=8))" in text


def test_a_run_without_rl_says_so_first_and_labels_no_row_after_rl(tmp_path):
    def summary(label, score, version):
        return {"label": label, "score": score, "score_metric": "em", "em": score, "n": 4, "served_version": version,
                "eval_s": 100.0}

    sft = {**summary("sft", 0.25, 25), "steps_done": 25, "sft_s": 1050.0}
    final = {**summary("final", 0.25, 25), "repeat_of": "sft"}
    phases = {"baseline": {"base_tool_call": summary("base_tool_call", 0.0, 0)}, "sft": sft,
              "rl": {"skipped": "no time left", "rl_s": 0.0, "rl_steps": 0}, "final": final}
    (tmp_path / "phases.json").write_text(json.dumps(phases))
    (tmp_path / "evals.jsonl").write_text("".join(json.dumps({**s, "time": 1.0}) + "\n" for s in
                                                  (phases["baseline"]["base_tool_call"], sft, final)))
    lines = write_report(tmp_path).read_text().splitlines()
    assert lines[0] == "# Training report"
    assert lines[2].startswith("**RL did not run: the SFT cold start and the evaluations left no time for it in the "
                               "budget; the final policy is the SFT checkpoint.**"), lines[:4]
    text = "\n".join(lines)
    assert "After RL" not in text and "gain of the RL phase" not in text
    assert "| Final (no RL step: the SFT checkpoint) | 0.250 |" in text
    # The time table counts the final evaluation that was not run (a repeat) as no time.
    assert "| held-out evaluation after SFT | 1.7 |" in text
    assert "| final held-out evaluation (reused: the policy was unchanged) | 0.0 |" in text
    assert "| RL phase (training; its evaluations below) | 0.0 |" in text


def test_an_evaluation_whose_every_episode_failed_has_no_f1_and_the_report_still_writes(tmp_path):
    """A final evaluation that ran while the only server was down (a Ray node lost late in a run on the
    slower machine kind) records no f1; the curve of f1 skips it instead of failing the run's end."""
    def summary(label, score, version, time, **extra):
        return {"label": label, "score": score, "score_metric": "em", "em": score, "n": 6, "served_version": version,
                "time": time, "eval_s": 20.0, **extra}

    base = summary("base_tool_call", 0.0, 0, 100.0, f1=0.0)
    final = summary("final", 0.0, -1, 400.0)  # every episode failed: no f1
    (tmp_path / "phases.json").write_text(json.dumps({"baseline": {"base_tool_call": base}, "final": final,
                                                      "rl": {"rl_steps": 2, "rl_s": 160.0}}))
    (tmp_path / "evals.jsonl").write_text(json.dumps(base) + "\n" + json.dumps(final) + "\n")
    assert "Held-out em over time" in write_report(tmp_path).read_text()
