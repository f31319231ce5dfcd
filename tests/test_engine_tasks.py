"""Synthetic multi-hop QA, published-format loaders and EM/F1."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentrl.envs.multihop_qa.metrics import exact_match, f1_score, normalize_answer
from agentrl.envs.multihop_qa.tasks import (
    SyntheticQAConfig,
    SyntheticWorld,
    load_2wikimultihopqa,
    load_hotpotqa,
    load_musique,
    load_passages,
    synthetic_tasks,
)

FIXTURES = Path(__file__).parent / "fixtures" / "datasets"


def test_normalisation_and_scores():
    assert normalize_answer("The  Eiffel-Tower!") == "eiffeltower"
    assert exact_match("the Tarnwick.", ["Tarnwick"]) == 1.0
    assert exact_match("Tarnwick City", "Tarnwick") == 0.0
    assert f1_score("Tarnwick City", "Tarnwick") == pytest.approx(2 * 0.5 * 1.0 / 1.5)
    assert f1_score("yes", "no") == 0.0
    assert f1_score("no way", "no") == 0.0  # HotpotQA: a yes/no gold only matches exactly
    assert f1_score("Amara", ["Bo Quell", "Amara Quell"]) == pytest.approx(2 / 3)
    with pytest.raises(ValueError):
        exact_match("x", [])


def test_synthetic_world_is_deterministic_and_answerable_from_its_passages():
    config = SyntheticQAConfig(seed=3, num_companies=50)
    a, b = SyntheticWorld.generate(config), SyntheticWorld.generate(config)
    assert a.passages == b.passages
    qa = a.questions("train", num=40, seed=1)
    assert qa == b.questions("train", num=40, seed=1)
    by_id = {p["id"]: p for p in a.passages}
    assert len(by_id) == len(a.passages)
    for task in qa:
        assert len(task.metadata["supporting_ids"]) == task.metadata["num_hops"] == len(task.metadata["gold_queries"])
        # The answer is stated in the last supporting passage, and each hop's passage names the next entity.
        assert task.reference[0] in by_id[task.metadata["supporting_ids"][-1]]["text"]
        for prev, nxt in zip(task.metadata["supporting_ids"], task.metadata["supporting_ids"][1:], strict=False):
            assert by_id[nxt]["title"] in by_id[prev]["text"]
        # The bridge entities: hop i's passage names entity i, which hop i+1's passage is about.
        bridges = task.metadata["intermediate_answers"]
        assert len(bridges) == task.metadata["num_hops"] - 1
        for bridge, nxt in zip(bridges, task.metadata["supporting_ids"][1:], strict=True):
            assert by_id[nxt]["title"] == bridge


def test_synthetic_difficulty_and_disjoint_splits():
    world = SyntheticWorld.generate(SyntheticQAConfig(seed=0, num_companies=60))
    for hops in (1, 2, 3, 4):
        tasks = world.questions("train", hops=(hops,), num=10)
        assert {t.metadata["num_hops"] for t in tasks} == {hops}
    train = world.questions("train", num=300)
    heldout = world.questions("heldout", num=60)
    assert not {t.task_id for t in train} & {t.task_id for t in heldout}
    # No held-out question starts from the entity a training question starts from.
    assert not {t.metadata["supporting_ids"][0] for t in train} & {t.metadata["supporting_ids"][0] for t in heldout}
    # A repeated hop count weighs more: [1, 2, 2] draws about two thirds 2-hop (uniform: one half).
    def share_2hop(hops):
        return sum(t.metadata["num_hops"] == 2 for t in world.questions("train", hops=hops, num=90, seed=5)) / 90
    assert 0.35 < share_2hop([1, 2]) < 0.65 and share_2hop([1, 2, 2]) > 0.55
    assert world.questions("train", hops=[2, 1], num=20, seed=2) == world.questions("train", hops=[1, 2], num=20, seed=2)
    with pytest.raises(ValueError, match="num_companies"):
        world.questions("heldout", num=10_000)
    with pytest.raises(ValueError, match="hops"):
        world.questions("train", hops=(5,))


def test_synthetic_corpus_jsonl(tmp_path):
    world, _ = synthetic_tasks(num=4, config=SyntheticQAConfig(num_companies=10))
    path = world.write_corpus(tmp_path / "corpus.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows == world.passages and set(rows[0]) == {"id", "title", "text"}
    assert load_passages(path) == rows


def test_hotpotqa_loader():
    tasks, passages = load_hotpotqa(FIXTURES / "hotpotqa_dev_fixture.json")
    assert [tuple(t.reference) for t in tasks] == [("yes",), ("Chief of Protocol",)]
    assert tuple(tasks[1].metadata["supporting_ids"]) == ("wiki-kiss-and-tell-1945-film", "wiki-shirley-temple")
    assert tasks[1].metadata["num_hops"] == 2
    ids = {p["id"] for p in passages}
    assert set(tasks[1].metadata["supporting_ids"]) <= ids
    shirley = next(p for p in passages if p["title"] == "Shirley Temple")
    assert "Chief of Protocol" in shirley["text"]


def test_2wiki_loader_counts_hops_from_evidences():
    tasks, passages = load_2wikimultihopqa(FIXTURES / "2wikimultihopqa_dev_fixture.json")
    assert tuple(tasks[0].reference) == ("Małgorzata Braunek",) and tasks[0].metadata["num_hops"] == 2
    assert len(passages) == 2


def test_musique_loader_skips_unanswerable_and_keeps_aliases():
    tasks, passages = load_musique(FIXTURES / "musique_ans_dev_fixture.jsonl")
    assert len(tasks) == 1
    assert tuple(tasks[0].reference) == ("Miquette Giraudy", "Miquette") and tasks[0].metadata["num_hops"] == 2
    assert tuple(tasks[0].metadata["supporting_ids"]) == ("musique-2hop__460946_294723-1", "musique-2hop__460946_294723-2")
    assert len(load_musique(FIXTURES / "musique_ans_dev_fixture.jsonl", answerable_only=False)[0]) == 2


def test_passage_loader_formats_and_errors(tmp_path):
    rows = load_passages(FIXTURES / "wiki_passages_fixture.jsonl")
    assert rows[1] == {"id": "2", "title": "Ed Wood", "text": "Edward Davis Wood Jr. was an American filmmaker."}
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "1", "body": "x"}\n')
    with pytest.raises(ValueError, match="title"):
        load_passages(bad)
    with pytest.raises(ValueError, match="HotpotQA"):
        load_hotpotqa(FIXTURES / "musique_ans_dev_fixture.jsonl")


def test_synthetic_transfer_tasks_are_held_out_and_harder(tmp_path):
    from agentrl.engine.tasksets import TasksConfig, load_taskset
    from agentrl.envs.multihop_qa.loaders import SyntheticOptions

    config = TasksConfig(loader="synthetic", options={"num_companies": 100, "heldout_num": 20, "heldout_hops": [1, 2],
                                                       "num_train": 20, "transfer_num": 8})
    taskset = load_taskset(config, tmp_path)
    assert len(taskset.transfer) == 8 and {t.metadata["num_hops"] for t in taskset.transfer} == {3}
    assert not {t.task_id for t in taskset.transfer} & {t.task_id for t in taskset.heldout}
    # Held-out split: no transfer question starts from a fact any training question (of any hop
    # count, all of them) starts from, while every one starts from a fact some held-out question does.
    world = SyntheticWorld.generate(SyntheticQAConfig(seed=0, num_companies=100))

    def first_facts(split):
        return {t.metadata["supporting_ids"][0]
                for t in world.questions(split, hops=(1, 2, 3), num=world.num_questions(split, (1, 2, 3)))}

    transfer_starts = {t.metadata["supporting_ids"][0] for t in taskset.transfer}
    assert not transfer_starts & first_facts("train") and transfer_starts <= first_facts("heldout")
    none = load_taskset(TasksConfig(loader="synthetic", options={"num_companies": 100, "heldout_num": 4, "num_train": 4,
                                                                 "transfer_num": 0}), tmp_path / "none")
    assert none.transfer == []
    with pytest.raises(ValueError, match="transfer_hops"):
        SyntheticOptions(transfer_hops=[5])
    with pytest.raises(ValueError, match=r"transfer_num = 10000: asked for 10000 heldout questions with hops \[3\] but the world has \d+"):
        load_taskset(TasksConfig(loader="synthetic", options={"num_companies": 100, "heldout_num": 4, "num_train": 4,
                                                              "transfer_num": 10_000}), tmp_path / "many")
