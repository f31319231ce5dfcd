"""The multi-hop QA task loaders: "synthetic" (the seeded world of `tasks.py`, with a curriculum of
hop counts) and "datasets" (HotpotQA / 2WikiMultihopQA / MuSiQue files in their published formats).
Registered by name in `agentrl.engine.tasksets.LOADERS` ([tasks] loader = "synthetic")."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import field
from pathlib import Path
from typing import Literal

from agentrl.common.config import FilePath, config_dataclass
from agentrl.engine.task import Task
from agentrl.engine.tasksets import TaskSet, cycled
from agentrl.envs.multihop_qa import tasks as T


@config_dataclass
class CurriculumStage:
    hops: list[int]
    """Hop counts of the training questions in this stage (drawn uniformly)."""
    until_version: int | None = None
    """Learner version (optimizer steps, SFT included) at which the next stage takes over; None: last stage."""


@config_dataclass
class SyntheticOptions:
    seed: int = 0
    """Seed of the world (entities, facts, corpus) and of question sampling."""
    num_companies: int = 400
    """World size (each company has a founder and a product); the held-out split is 20% of it."""
    heldout_num: int = 48
    """Held-out questions evaluated before, during and after training."""
    heldout_hops: list[int] = field(default_factory=lambda: [1, 2])
    """Hop counts of the held-out questions (1-4)."""
    num_train: int = 400
    """Distinct training questions drawn per curriculum stage (cycled)."""
    curriculum: list[CurriculumStage] = field(
        default_factory=lambda: [CurriculumStage(hops=[1], until_version=6), CurriculumStage(hops=[1, 2])])
    """Stages of training hop counts, in order; the last has no `until_version`."""
    demonstration_hops: list[int] = field(default_factory=lambda: [1, 2])
    """Hop counts of the training questions the SFT cold start demonstrates; a repeated count weighs
    more (`[1, 2, 2]`: two thirds 2-hop)."""
    transfer_hops: list[int] = field(default_factory=lambda: [3])
    """Hop counts of the transfer questions (held-out split, never trained on; `TaskSet.transfer`)."""
    transfer_num: int = 24
    """Transfer questions; 0: none."""

    def __post_init__(self) -> None:
        for name, hops in (("heldout_hops", self.heldout_hops), ("demonstration_hops", self.demonstration_hops),
                           ("curriculum", [h for s in self.curriculum for h in s.hops]),
                           ("transfer_hops", self.transfer_hops)):
            bad = [h for h in hops if h not in (1, 2, 3, 4)]
            if bad or not hops:
                raise ValueError(f"{name}: hop counts must be 1-4 (and at least one), got {hops}")
        if self.transfer_num < 0:
            raise ValueError(f"transfer_num must be >= 0, got {self.transfer_num}")
        if self.curriculum[-1].until_version is not None:
            raise ValueError("curriculum: the last stage must not set until_version (it runs to the end)")


def load_synthetic(options: SyntheticOptions, workdir: Path) -> TaskSet:
    world = T.SyntheticWorld.generate(T.SyntheticQAConfig(seed=options.seed, num_companies=options.num_companies))
    heldout = world.questions("heldout", hops=options.heldout_hops, num=options.heldout_num, seed=options.seed)
    stages = options.curriculum
    pools = [world.questions("train", hops=s.hops, num=min(options.num_train, world.num_questions("train", s.hops)),
                             seed=options.seed + i) for i, s in enumerate(stages)]

    def train_pool(version: Callable[[], int]) -> Iterator[Task]:
        cursors = [0] * len(pools)
        while True:
            v = version()
            stage = next(i for i, s in enumerate(stages) if s.until_version is None or v < s.until_version)
            yield pools[stage][cursors[stage] % len(pools[stage])]
            cursors[stage] += 1

    def demonstration_pool(num: int) -> list[Task]:
        return world.questions("train", hops=options.demonstration_hops, num=num, seed=options.seed + 100)

    try:
        transfer = (world.questions("heldout", hops=options.transfer_hops, num=options.transfer_num, seed=options.seed + 200)
                    if options.transfer_num else [])
    except ValueError as e:  # the world's own count check, named by the option that asked
        raise ValueError(f"[tasks.options] transfer_num = {options.transfer_num}: {e}") from e
    return TaskSet(heldout=heldout, train_pool=train_pool, corpus=world.write_corpus(workdir / "corpus.jsonl"),
                   demonstration_pool=demonstration_pool, transfer=transfer)


load_synthetic.Options = SyntheticOptions


@config_dataclass
class DatasetFile:
    format: Literal["hotpotqa", "2wikimultihopqa", "musique"]
    """The file's published format."""
    path: FilePath
    """JSON or JSONL file."""
    limit: int | None = None
    """Use the first `limit` questions of the file."""


@config_dataclass
class DatasetsOptions:
    train_files: list[DatasetFile] = field(default_factory=list)
    """Training questions (cycled)."""
    eval_files: list[DatasetFile] = field(default_factory=list)
    """Held-out questions."""
    corpus: FilePath = ""
    """Passage JSONL ({"id","title","text"}, or the "contents" layout of wiki dumps) for the search
    service; empty: the passages of the files' own contexts."""

    def __post_init__(self) -> None:
        if not self.eval_files:
            raise ValueError("eval_files: the datasets loader needs at least one ([[tasks.options.eval_files]] tables)")


_FORMATS = {"hotpotqa": T.load_hotpotqa, "2wikimultihopqa": T.load_2wikimultihopqa, "musique": T.load_musique}


def _read_files(files: list[DatasetFile]) -> tuple[list[Task], list[dict]]:
    tasks, passages = [], []
    for f in files:
        more, rows = _FORMATS[f.format](f.path, limit=f.limit)
        tasks += more
        passages += rows
    return tasks, passages


def load_datasets(options: DatasetsOptions, workdir: Path) -> TaskSet:
    heldout, passages = _read_files(options.eval_files)
    train, train_passages = _read_files(options.train_files)
    if options.corpus:
        corpus = Path(options.corpus)
        if not corpus.is_file():
            raise FileNotFoundError(f"[tasks.options] corpus: no such file {corpus}")
    else:
        seen: dict[str, dict] = {}
        for p in [*passages, *train_passages]:
            seen.setdefault(p["id"], p)
        corpus = T.write_passages(seen.values(), workdir / "contexts.jsonl")
    return TaskSet(heldout=heldout, train_pool=cycled(train, "train_files"), corpus=corpus)


load_datasets.Options = DatasetsOptions
