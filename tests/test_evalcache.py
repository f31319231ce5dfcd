"""The cache of the untrained policy's evaluations (agentrl/evalcache.py): every input that
determines the result is in the key, and a run reads an entry only under its own key."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from agentrl import evalcache
from agentrl.runconfig import TrainConfig
from agentrl.train import Supervisor


def _inputs(model_dir, **changes):
    args = {"model_dir": model_dir, "dtype": "float32", "max_model_len": 4096, "env": {"class": "multihop_qa", "max_turns": 4},
            "prompt": {"system_prompt": "You answer questions.", "tools": [{"name": "search"}]},
            "tasks": [{"task_id": "q1", "prompt": "Who founded X?", "reference": "Y"}],
            "decoding": {"temperature": 0.0}, "baselines": ["environment"]}
    return evalcache.key_inputs(**{**args, **changes})


@pytest.fixture
def model(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text('{"hidden_size": 8}')
    (folder / "model.safetensors").write_bytes(b"\x00" * 64)
    return folder


def test_every_input_that_determines_the_result_changes_the_key(model, tmp_path):
    key = evalcache.cache_key(_inputs(model))
    assert key == evalcache.cache_key(_inputs(model))  # deterministic
    other_model = tmp_path / "other"
    other_model.mkdir()
    (other_model / "config.json").write_text('{"hidden_size": 8}')
    (other_model / "model.safetensors").write_bytes(b"\x00" * 63 + b"\x01")  # one byte of the weights differs
    changed = {
        "model": _inputs(other_model),
        "dtype": _inputs(model, dtype="bfloat16"),
        "max_model_len": _inputs(model, max_model_len=2048),
        "env": _inputs(model, env={"class": "multihop_qa", "max_turns": 3}),
        "prompt": _inputs(model, prompt={"system_prompt": "You answer questions!", "tools": [{"name": "search"}]}),
        "tools": _inputs(model, prompt={"system_prompt": "You answer questions.", "tools": [{"name": "lookup"}]}),
        "tasks": _inputs(model, tasks=[{"task_id": "q1", "prompt": "Who founded X?", "reference": "Z"}]),
        "decoding": _inputs(model, decoding={"temperature": 0.7}),
        "baselines": _inputs(model, baselines=[]),
    }
    keys = {name: evalcache.cache_key(inputs) for name, inputs in changed.items()}
    assert key not in keys.values() and len(set(keys.values())) == len(keys), keys
    # The code that serves and scores is in it too: vLLM's and torch's versions, agentrl's sources.
    base = _inputs(model)
    assert base["vllm"] or base["vllm_cuda"]
    for name in ("vllm", "vllm_cuda", "torch", "transformers", "agentrl_source", "hardware"):
        assert evalcache.cache_key({**base, name: "something else"}) != key
    # A file renamed inside the model folder (e.g. another tokenizer file) changes it as well.
    (model / "model.safetensors").rename(model / "weights.safetensors")
    assert evalcache.cache_key(_inputs(model)) != key


def test_an_entry_is_read_only_under_its_own_key(model, tmp_path):
    run = tmp_path / "run"
    (run / "evals").mkdir(parents=True)
    (run / "evals" / "base_tool_call-v0.jsonl").write_text('{"task_id": "q1", "score": 0.0}\n')
    inputs = _inputs(model)
    key = evalcache.cache_key(inputs)
    cache = tmp_path / "cache"
    evalcache.store(cache, key, inputs, {"base_tool_call": {"score": 0.0}, "baselines": {}}, run, ["evals/base_tool_call-v0.jsonl"])
    assert evalcache.lookup(cache, evalcache.cache_key(_inputs(model, dtype="bfloat16"))) is None
    entry = evalcache.lookup(cache, key)
    assert entry["summaries"]["base_tool_call"] == {"score": 0.0}
    evalcache.restore(entry, tmp_path / "run2")
    assert (tmp_path / "run2" / "evals" / "base_tool_call-v0.jsonl").read_text() == '{"task_id": "q1", "score": 0.0}\n'
    # An entry moved under another key's folder is refused, not used.
    other = evalcache.cache_key(_inputs(model, max_model_len=1))
    (cache / "baselines" / key).rename(cache / "baselines" / other)
    with pytest.raises(ValueError, match="not its folder's"):
        evalcache.lookup(cache, other)


async def test_a_second_run_reads_the_baselines_and_another_model_evaluates_again(model, tmp_path, monkeypatch):
    import agentrl.phases.baseline as baseline
    import agentrl.phases.evaluations as evaluations
    from agentrl.phases.baseline import baseline_cache, baseline_phase

    calls: list[str] = []
    failed_episodes = 0

    async def fake_evaluate(conn, tasks, label, env=None, episodes=None, on_progress=None):
        calls.append(label)
        return {"label": label, "score": 0.125, "score_metric": "em", "n": 8, "served_version": 0, "eval_s": 265.0,
                "time": 1.0, "num_failed": failed_episodes}, []

    async def fake_baselines(conn, tasks):
        calls.append("naive_rag")
        return {"naive_rag": ({"label": "naive_rag", "score": 0.25, "score_metric": "em", "n": 8, "served_version": 0,
                               "eval_s": 64.0, "time": 1.0, "num_failed": 0}, [])}

    monkeypatch.setattr(evaluations, "evaluate", fake_evaluate)
    monkeypatch.setattr(baseline, "evaluate_baselines", fake_baselines)
    monkeypatch.setattr(Supervisor, "prompt", lambda self: {"system_prompt": "You answer questions."})
    config = TrainConfig()
    config.eval.cache_dir = str(tmp_path / "cache")

    def run(name: str) -> Supervisor:
        supervisor = Supervisor(config, tmp_path / name)
        (tmp_path / name).mkdir()
        supervisor.model_dir = str(model)
        supervisor.conn = supervisor.evaluations.conn = SimpleNamespace(env=SimpleNamespace(report_by=()), chat=None)
        # Each run writes its own copy of the corpus (as the synthetic loader does): same contents, same key.
        (tmp_path / name / "corpus.jsonl").write_text(corpus_text)
        supervisor.heldout, supervisor.taskset = [], SimpleNamespace(transfer=[], corpus=tmp_path / name / "corpus.jsonl")
        return supervisor

    corpus_text = '{"id": "1", "text": "Oska Venn was born in Lorrowby."}\n'

    first = run("first")
    await baseline_phase(first)
    assert calls == ["base_tool_call", "naive_rag"] and "cached" not in first.phases["baseline"]
    second = run("second")
    await baseline_phase(second)
    assert calls == ["base_tool_call", "naive_rag"]  # nothing evaluated
    assert second.phases["baseline"]["base_tool_call"]["score"] == 0.125
    assert second.phases["baseline"]["baselines"]["naive_rag"]["score"] == 0.25
    assert [e["label"] for e in second.evaluations.summaries] == ["base_tool_call", "naive_rag"] and all(e["cached"] for e in second.evaluations.summaries)
    assert (tmp_path / "second" / "evals" / "base_tool_call-v0.jsonl").is_file()
    assert json.loads((tmp_path / "second" / "phases.json").read_text())["baseline"]["cached"]
    # Other weights: evaluated again, never the first model's result.
    (model / "model.safetensors").write_bytes(b"\x01" * 64)
    third = run("third")
    await baseline_phase(third)
    assert calls == ["base_tool_call", "naive_rag"] * 2 and "cached" not in third.phases["baseline"]
    # Another search corpus behind the same questions: evaluated again.
    corpus_text = '{"id": "1", "text": "Oska Venn was born in Tessat."}\n'
    await baseline_phase(run("fourth"))
    assert calls == ["base_tool_call", "naive_rag"] * 3
    # A result with failed episodes is not kept: the next run evaluates again.
    corpus_text = '{"id": "1", "text": "Oska Venn was born in Marrow."}\n'
    failed_episodes = 2
    await baseline_phase(run("fifth"))
    failed_episodes = 0
    await baseline_phase(run("sixth"))
    assert calls == ["base_tool_call", "naive_rag"] * 5
    # Switched off, or with servers or tools the run did not start: never read.
    config.eval.cache_baselines = False
    assert baseline_cache(run("off")) is None
    config.eval.cache_baselines = True
    assert baseline_cache(run("on")) is not None
    config.services.tool_endpoints = ["tcp://10.0.0.2:5555"]
    assert baseline_cache(run("endpoint")) is None
    config.services.tool_endpoints = []
    config.services.vllm = ["http://127.0.0.1:8000"]
    assert baseline_cache(run("given")) is None


def test_a_model_folder_is_read_again_only_when_its_files_change(model, tmp_path, monkeypatch):
    memo = tmp_path / "memo"
    first = evalcache.folder_digest(model, memo)
    assert first == evalcache.folder_digest(model)  # the same digest with or without the memo
    reads: list = []
    real = evalcache.sha256_update
    monkeypatch.setattr(evalcache, "sha256_update", lambda digest, path: reads.append(path) or real(digest, path))
    assert evalcache.folder_digest(model, memo) == first and reads == []  # unchanged: not read
    (model / "model.safetensors").write_bytes(b"\x02" * 64)  # same size, new contents and time
    assert evalcache.folder_digest(model, memo) != first and reads
