"""Task sets: where a run's training stream, held-out set and search corpus come from.

One registry of loaders, used by `agentrl train`, `agentrl eval` and `agentrl rollout` alike:

    [tasks]
    loader = "synthetic"          # a built-in name, or "package.module:function"
    [tasks.options]               # validated by the loader's own options dataclass
    seed = 0
    heldout_num = 96

A loader is `load(options, workdir) -> TaskSet`, with `options` an instance of its `Options`
dataclass (declared as the function's `Options` attribute; built from `[tasks.options]` with the
same strict checks as every config). Built-in loaders:

- "synthetic": the seeded multi-hop world of `tasks.py` (corpus written to `workdir`), held-out
  questions of the world's held-out split, and a training stream that follows a curriculum of hop
  counts by learner version.
- "datasets": HotpotQA / 2WikiMultihopQA / MuSiQue files in their published formats
  (`train_files`, `eval_files`) and a passage corpus JSONL (`corpus`) for the search service.

`TaskSet.train_stream(version)` yields training tasks forever; `version()` is the learner's
current version, read each time a task is drawn, so a curriculum can follow training.
"""

from __future__ import annotations

import importlib
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from agentrl.common.config import ConfigError, Origins, build, config_dataclass
from agentrl.engine import tasks as T
from agentrl.engine.tasks import QATask


@dataclass
class TaskSet:
    heldout: list[QATask]
    """Evaluated before, during and after training (greedy)."""
    train_pool: Callable[[Callable[[], int]], Iterator[QATask]]
    """`train_pool(version)` -> training tasks forever (see `train_stream`)."""
    corpus: Path | None = None
    """Passage JSONL ({"id","title","text"}) the search service serves, when the tasks need one."""
    gold: Callable[..., list[QATask]] | None = None
    """`gold(num, seed, hops)` -> training tasks with gold queries (SFT demonstrations); None: none."""

    def train_stream(self, version: Callable[[], int]) -> Iterator[QATask]:
        return self.train_pool(version)


# ---------------------------------------------------------------- the synthetic world


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

    def __post_init__(self) -> None:
        bad = [h for h in self.heldout_hops if h not in (1, 2, 3, 4)]
        if bad:
            raise ValueError(f"heldout_hops: hop counts must be 1-4, got {bad}")
        bad = [h for s in self.curriculum for h in s.hops if h not in (1, 2, 3, 4)]
        if bad:
            raise ValueError(f"curriculum: hop counts must be 1-4, got {bad}")
        if not self.curriculum:
            raise ValueError("curriculum: needs at least one stage")
        if self.curriculum[-1].until_version is not None:
            raise ValueError("curriculum: the last stage must not set until_version (it runs to the end)")


def load_synthetic(options: SyntheticOptions, workdir: Path) -> TaskSet:
    world = T.SyntheticWorld.generate(T.SyntheticQAConfig(seed=options.seed, num_companies=options.num_companies))
    heldout = world.questions("heldout", hops=options.heldout_hops, num=options.heldout_num, seed=options.seed)
    stages = options.curriculum
    pools = [world.questions("train", hops=s.hops, num=min(options.num_train, world.num_questions("train", s.hops)),
                             seed=options.seed + i) for i, s in enumerate(stages)]

    def train_pool(version: Callable[[], int]) -> Iterator[QATask]:
        cursors = [0] * len(pools)
        while True:
            v = version()
            stage = next(i for i, s in enumerate(stages) if s.until_version is None or v < s.until_version)
            yield pools[stage][cursors[stage] % len(pools[stage])]
            cursors[stage] += 1

    def gold(num: int, seed: int, hops: list[int] | None = None) -> list[QATask]:
        return world.questions("train", hops=hops or sorted({h for s in stages for h in s.hops}), num=num,
                               seed=options.seed + seed)

    return TaskSet(heldout=heldout, train_pool=train_pool, corpus=world.write_corpus(workdir / "corpus.jsonl"), gold=gold)


load_synthetic.Options = SyntheticOptions


# ---------------------------------------------------------------- published datasets


@config_dataclass
class DatasetFile:
    format: Literal["hotpotqa", "2wikimultihopqa", "musique"]
    """The file's published format."""
    path: str
    """JSON or JSONL file."""
    limit: int | None = None
    """Use the first `limit` questions of the file."""


@config_dataclass
class DatasetsOptions:
    train_files: list[DatasetFile] = field(default_factory=list)
    """Training questions (cycled)."""
    eval_files: list[DatasetFile] = field(default_factory=list)
    """Held-out questions."""
    corpus: str = ""
    """Passage JSONL ({"id","title","text"}, or the "contents" layout of wiki dumps) for the search
    service; empty: the passages of the files' own contexts."""

    def __post_init__(self) -> None:
        if not self.eval_files:
            raise ValueError("the datasets loader needs eval_files ([[tasks.options.eval_files]] tables)")


_FORMATS = {"hotpotqa": T.load_hotpotqa, "2wikimultihopqa": T.load_2wikimultihopqa, "musique": T.load_musique}


def _read_files(files: list[DatasetFile]) -> tuple[list[QATask], list[dict]]:
    tasks, passages = [], []
    for f in files:
        more, rows = _FORMATS[f.format](f.path, limit=f.limit)
        tasks += more
        passages += rows
    return tasks, passages


def load_datasets(options: DatasetsOptions, workdir: Path) -> TaskSet:
    heldout, passages = _read_files(options.eval_files)
    train, train_passages = _read_files(options.train_files)

    def train_pool(version: Callable[[], int]) -> Iterator[QATask]:
        if not train:
            raise ValueError("the datasets loader has no train_files: it can evaluate, not train")
        return itertools.cycle(train)

    if options.corpus:
        corpus = Path(options.corpus)
        if not corpus.is_file():
            raise FileNotFoundError(f"[tasks.options] corpus: no such file {corpus}")
    else:
        seen: dict[str, dict] = {}
        for p in [*passages, *train_passages]:
            seen.setdefault(p["id"], p)
        corpus = T.write_passages(seen.values(), workdir / "contexts.jsonl")
    return TaskSet(heldout=heldout, train_pool=train_pool, corpus=corpus)


load_datasets.Options = DatasetsOptions


# ---------------------------------------------------------------- the registry


LOADERS: dict[str, Callable[..., TaskSet]] = {"synthetic": load_synthetic, "datasets": load_datasets}


@config_dataclass
class TasksConfig:
    loader: str = "synthetic"
    """A built-in loader (synthetic, datasets) or "package.module:function" (module docstring)."""
    options: dict[str, Any] = field(default_factory=dict)
    """The loader's options ([tasks.options]), checked against its `Options` dataclass."""


def resolve_loader(name: str) -> Callable[..., TaskSet]:
    """The loader function for a registry name or a "package.module:function" path."""
    if name in LOADERS:
        return LOADERS[name]
    module_name, sep, attr = name.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"tasks.loader: {name!r} is neither a built-in loader ({', '.join(LOADERS)}) "
                          "nor a 'package.module:function' path")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ConfigError(f"tasks.loader: cannot import {module_name!r}: {err}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"tasks.loader: {module_name!r} has no function {attr!r}")
    return fn


def loader_options(config: TasksConfig, *, origins: Origins | None = None, source: str = "config") -> Any:
    """The loader's options, validated (a ConfigError names tasks.options.KEY and where it was set)."""
    options_type = getattr(resolve_loader(config.loader), "Options", None)
    if options_type is None:
        return dict(config.options)
    return build(options_type, config.options, origins=origins, default_source=source, prefix=("tasks", "options"))


def load_taskset(config: TasksConfig, workdir: Path) -> TaskSet:
    workdir.mkdir(parents=True, exist_ok=True)
    return resolve_loader(config.loader)(loader_options(config), workdir)
