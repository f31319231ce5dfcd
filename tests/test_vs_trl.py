"""benchmarks/vs_trl.py: the TRL side sees the same job as agentrl (no TRL install here).

The TRL side restates agentrl's task rules from text (benchmarks/trl_side/agentrl_text.py) because
TRL's reward functions receive text. These tests hold it to agentrl's own ToolEnv: the same prompt
text and ids, the same process terms and EM on fixed episodes, the same tool result text, and the
same search hits as the search service.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

from agentrl.engine.chat import ChatFormat
from agentrl.engine.env import EnvConfig, ToolEnv, format_content
from agentrl.engine.episode import SamplingConfig, ScriptedPolicy, run_episode
from agentrl.engine.tools import FunctionTool
from agentrl.envs.multihop_qa.env import MultiHopQAEnv
from agentrl.envs.multihop_qa.tasks import SyntheticQAConfig, SyntheticWorld
from agentrl.toolservers.search import SearchTool

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks" / "trl_side"))
sys.path.insert(0, str(REPO / "benchmarks"))

import agentrl_text as A  # noqa: E402
import grpo_tools as G  # noqa: E402
import vs_trl  # noqa: E402


@pytest.fixture(scope="module")
def world():
    return SyntheticWorld.generate(SyntheticQAConfig(seed=0, num_companies=40))


@pytest.fixture(scope="module")
def search(world):
    return G.Search(world.passages)


def _env(tokenizer, search, **prompt) -> ToolEnv:
    env = MultiHopQAEnv(ChatFormat(tokenizer), EnvConfig(max_turns=4, max_action_tokens=96, max_total_tokens=3072, **prompt))
    spec = SearchTool.spec
    env.register_tool(FunctionTool(spec.name, spec.description, spec.parameters, lambda query, top_k=3: search(query, top_k)))
    return env


def _prefix(env: ToolEnv) -> list[dict]:
    return [{"role": "system", "content": env.system_prompt}] + [
        {"role": r, "content": c.removeprefix("<tool_response>\n").removesuffix("\n</tool_response>") if r == "tool" else c}
        for r, c in (env.example_messages() if env.config.worked_example else ())]


@pytest.mark.parametrize("prompt", [{}, {"tool_list": "signature", "worked_example": False}])
def test_prompt_text_and_ids_match_agentrl(tokenizer, world, search, prompt):
    env = _env(tokenizer, search, **prompt)
    task = world.questions("heldout", hops=[2], num=1)[0]
    agentrl_ids = env.reset(task).token_ids
    tok = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    tok.chat_template = G.CHAT_TEMPLATE
    messages = G.prompt_messages(_prefix(env), task.prompt)
    assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == env.chat.decode(agentrl_ids)
    assert list(tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]) == agentrl_ids


def _gold_call(query: str) -> str:
    return "<tool_call>" + json.dumps({"name": "search", "arguments": {"query": query}}) + "</tool_call>"


EPISODES = {
    "two searches then the right answer": lambda t: [_gold_call(t.metadata["gold_queries"][0]), _gold_call(t.metadata["gold_queries"][1]),
                                                     f"<answer>{t.reference[0]}</answer>"],
    "duplicate call, then a wrong answer": lambda t: [_gold_call(t.metadata["gold_queries"][0]), _gold_call(t.metadata["gold_queries"][0]),
                                                      "<answer>Nobody</answer>"],
    "bad JSON, unknown tool, bad arguments, no action": lambda t: [
        '<tool_call>{"name": "search", "arguments": {"query": </tool_call>',
        '<tool_call>{"name": "browse", "arguments": {"url": "x"}}</tool_call>'
        '<tool_call>{"name": "search", "arguments": {"query": "a", "top_k": 0}}</tool_call>',
        "I am not sure.",
        "<answer>unclosed"],
    "four calls in one turn (one over the limit), text after the answer": lambda t: [
        "".join(_gold_call(f"{t.metadata['gold_queries'][0]} {i}") for i in range(4)),
        f"<answer>{t.reference[0]}</answer> and more text <answer>other</answer>"],
    "an imagined tool response after the call is cut": lambda t: [
        _gold_call(t.metadata["gold_queries"][0]) + "<tool_response>\n[1] made up\n</tool_response>",
        f"<answer>{t.reference[0]}</answer>"],
}


@pytest.mark.parametrize("name", list(EPISODES))
def test_process_terms_and_em_match_agentrl_env(tokenizer, world, search, name):
    env = _env(tokenizer, search)
    task = world.questions("train", hops=[2], num=1)[0]
    actions = EPISODES[name](task)
    traj = asyncio.run(run_episode(env, task, ScriptedPolicy(env, actions), SamplingConfig(temperature=0.0), group_id="g"))
    agentrl_terms: dict[str, float] = {}
    for turn in traj.turns:
        for term, value in turn.process_rewards.items():
            agentrl_terms[term] = agentrl_terms.get(term, 0.0) + value
    score = A.score_turns(actions[: len(traj.turns)], list(task.reference))
    assert score.process_terms == pytest.approx(agentrl_terms)
    assert score.em == traj.metrics["em"]


def test_trl_completion_text_splits_into_agentrl_turns(tokenizer, world, search):
    """The reward function sees TRL's decoded multi-turn completion; it must recover the turns."""
    task = world.questions("train", hops=[2], num=1)[0]
    actions = EPISODES["two searches then the right answer"](task)
    tool = "<|im_start|>tool\n<tool_response>\n[1] A: b\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    text = f"{actions[0]}<|im_end|>\n{tool}{actions[1]}<|im_end|>\n{tool}{actions[2]}<|im_end|>"
    assert G.split_turns(text) == actions
    assert A.score_turns(G.split_turns(text), list(task.reference)).em == 1.0


def test_tool_result_text_and_hits_match_the_search_service(world, search, tmp_path):
    from agentrl.toolservers.search import SearchConfig
    from agentrl.toolservers.server import Job

    corpus = world.write_corpus(tmp_path / "corpus.jsonl")
    service = SearchTool(SearchConfig(corpus_path=str(corpus), cache_dir=str(tmp_path / "cache")))
    service.start()
    for query in ("founder of " + world._companies[0], "who makes " + world._products[3], "zzz qqq"):
        job = Job(peer=b"", req_id=0, args={"query": query, "top_k": 3}, received_s=0.0, deadline_s=float("inf"))
        hits = service.run_batch([job])[0].content
        assert [h["id"] for h in hits] == [p["id"] for p in search(query, 3)]
        assert A.format_passages(search(query, 3)) == format_content(hits)


def test_schema_check_matches_the_search_service_schema():
    import jsonschema

    validator = jsonschema.Draft202012Validator(SearchTool.spec.parameters)
    for args in ({"query": "x"}, {"query": ""}, {"query": "x", "top_k": 0}, {"query": "x", "top_k": 50}, {"query": "x", "top_k": 51},
                 {"query": 3}, {"top_k": 2}, {"query": "x", "extra": 1}, {"query": "x", "top_k": True}, {"query": "x" * 2001}):
        assert (A.search_arguments_error(args) is None) == validator.is_valid(args), args


def test_cli_rejects_bad_budgets():
    assert vs_trl.parse_args([]).minutes == 10.0
    for argv in (["--minutes", "0"], ["--prompts-per-step", "0"], ["--heldout-num", "0"], ["--only", "both"]):
        with pytest.raises(SystemExit):
            vs_trl.parse_args(argv)


def test_agentrl_side_config_round_trips_through_the_train_cli_loader(tmp_path):
    """vs_trl.py hands `agentrl train --config` the job it exports to the TRL side."""
    from agentrl.common.config import dump_toml
    from agentrl.runconfig import config_data, load_run_config

    config = vs_trl.comparison_config(2.5)
    path = tmp_path / "agentrl_config.toml"
    path.write_text(dump_toml(config_data(config)))
    loaded = load_run_config(path).config
    assert loaded.services.tools == ["search"]
    assert loaded.minutes == 2.5 and loaded.eval.every_s >= 1e9 and not loaded.eval.baselines
    assert loaded.orchestrator.group_size == config.orchestrator.group_size


def test_export_holds_the_same_job(tmp_path, tokenizer):
    config = vs_trl.comparison_config(1.0, extra_sets=("tasks.options.heldout_num=3", "sft.num_examples=4"))
    job = vs_trl.export_job(config, tmp_path, prompts_per_step=2, num_train=40)
    spec = json.loads((tmp_path / "export.json").read_text())
    assert spec == json.loads(json.dumps(job))
    rows = {name: [json.loads(line) for line in (tmp_path / f).read_text().splitlines()] for name, f in spec["files"].items()}
    assert len(rows["heldout"]) == 3 and len(rows["gold"]) == 4 and len(rows["train"]) == 40
    # The curriculum, in the learner's versions: RL starts at version sft.steps and takes 2 questions
    # per version, so a stage that ends at until_version holds (until_version - start) x 2 questions.
    start = 0
    for stage in config.tasks.options["curriculum"]:
        end = (stage["until_version"] - config.sft.steps) * 2 if "until_version" in stage else len(rows["train"])
        if end > start:
            assert {r["num_hops"] for r in rows["train"][start:end]} == set(stage["hops"])
        start = max(start, end)
    assert start == len(rows["train"])
    # Gold trajectories are agentrl's ids: they start with the same prompt prefix the TRL template renders.
    tok = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    tok.chat_template = G.CHAT_TEMPLATE
    prefix_ids = tok.apply_chat_template(spec["prompt_prefix"], return_dict=True)["input_ids"]
    gold = rows["gold"][0]
    assert gold["token_ids"][: len(prefix_ids)] == list(prefix_ids)
    assert 0 < sum(gold["is_action"]) < len(gold["is_action"]) == len(gold["token_ids"])
    rl_trainer = config.learner.trainer
    assert spec["recipe"]["train_layers"] == rl_trainer.train_layers == 8
    assert spec["recipe"]["rl_lr"] == rl_trainer.optimizer.lr and spec["recipe"]["sft_lr"] == config.sft.learner["trainer"]["optimizer"]["lr"] == 3e-4


def test_trl_venv_is_reused_when_its_stamp_matches_and_rebuilt_when_not(tmp_path, monkeypatch):
    venv = tmp_path / ".venv-trl"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    monkeypatch.setattr(vs_trl, "VENV", venv)
    monkeypatch.setattr(vs_trl, "STAMP", venv / ".agentrl-stamp")
    calls = []
    monkeypatch.setattr(vs_trl.subprocess, "run", lambda argv, **kw: calls.append(argv) or type("R", (), {"returncode": 0})())
    (venv / ".agentrl-stamp").write_text(json.dumps(vs_trl.trl_requirements()))
    assert vs_trl.ensure_trl_venv(tmp_path / "log") == venv / "bin" / "python" and calls == []
    (venv / ".agentrl-stamp").write_text(json.dumps(["trl==0.0.1"]))
    vs_trl.ensure_trl_venv(tmp_path / "log")
    assert [c[1:3] for c in calls] == [["-m", "venv"], ["-m", "pip"], ["-m", "pip"]]
    assert calls[1][-1].startswith("torch==") and f"trl=={vs_trl.TRL_VERSION}" in calls[2]
    assert json.loads((venv / ".agentrl-stamp").read_text()) == vs_trl.trl_requirements()


def test_run_side_reads_the_last_json_line_and_reports_a_failing_side(tmp_path):
    ok = [sys.executable, "-c", "import json; print('progress'); print(json.dumps({'episodes': 7}))"]
    assert vs_trl.run_side("ok", ok, tmp_path / "ok.log", timeout_s=60)["episodes"] == 7
    bad = [sys.executable, "-c", "import sys; print('half way'); sys.exit(3)"]
    with pytest.raises(RuntimeError, match="exited with 3(.|\n)*half way"):
        vs_trl.run_side("bad", bad, tmp_path / "bad.log", timeout_s=60)


@pytest.mark.parametrize("option", ["env.options.retrieval_reward=1.0", "env.options.progress_note=true",
                                    "learner.trainer.advantage.dynamic_sampling=true", "learner.trainer.train_layers=all",
                                    "learner.anchor.coef=0.3"])
def test_export_refuses_what_the_trl_side_cannot_restate(tmp_path, option):
    config = vs_trl.comparison_config(1.0, extra_sets=(option,))
    with pytest.raises(ValueError, match="the TRL side"):
        vs_trl.export_job(config, tmp_path / "job", prompts_per_step=2, num_train=4)
    assert not (tmp_path / "job").exists()  # refused before anything was written
