"""Task sets: where a run's training stream, held-out set and files for the built-in services come from.

One registry of loaders, used by `agentrl train`, `agentrl eval` and `agentrl rollout` alike:

    [tasks]
    loader = "synthetic"          # a built-in name, or "package.module:function"
    [tasks.options]               # validated by the loader's own options dataclass
    seed = 0
    heldout_num = 96

A loader is `load(options, workdir) -> TaskSet`, with `options` an instance of its `Options`
dataclass (declared as the function's `Options` attribute; built from `[tasks.options]` with the
same strict checks as every config; a loader without `Options` takes none). Built-in loaders:

- "synthetic" and "datasets": the multi-hop QA environment's (agentrl/envs/multihop_qa/loaders.py:
  its seeded world with a curriculum of hop counts; HotpotQA / 2WikiMultihopQA / MuSiQue files),
  registered here by name, as any package's loader can be by its "package.module:function";
- "jsonl": generic tasks, one JSON object per line ({"id", "prompt" or "messages", "reference",
  "metadata"}: engine/task.py), a file per split.
- "hf_datasets": a Hugging Face `datasets` folder written by `save_to_disk` (a DatasetDict with
  train and held-out splits), columns mapped to the task fields. Nothing is fetched from a hub.

`TaskSet.train_stream(version)` yields training tasks forever; `version()` is the learner's
current version, read each time a task is drawn, so a curriculum can follow training. Tasks are
checked when the set is built (ids unique, fields typed), so a malformed file names the task and
the field before any server starts.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentrl.common.config import ConfigError, FilePath, Origins, PluginRef, config_dataclass
from agentrl.common.files import iter_jsonl
from agentrl.engine.plugins import build_options, resolve
from agentrl.engine.task import Task, TaskError, check_unique_ids


@dataclass
class TaskSet:
    heldout: list[Task]
    """Evaluated before, during and after training (greedy)."""
    train_pool: Callable[[Callable[[], int]], Iterator[Task]]
    """`train_pool(version)` -> training tasks forever (see `train_stream`)."""
    corpus: Path | None = None
    """Passage JSONL ({"id","title","text"}) for the built-in search service, when the tasks need one."""
    demonstration_pool: Callable[[int], list[Task]] | None = None
    """`demonstration_pool(num)` -> the training tasks the SFT cold start demonstrates; None: the
    first `num` tasks of the training stream at version 0."""
    transfer: list[Task] = field(default_factory=list)
    """Held-out tasks harder than any trained on (QA: more hops): the final policy is evaluated on
    them once, after the budget, as a figure of how far the learned behaviour carries (`eval.transfer`)."""

    def train_stream(self, version: Callable[[], int]) -> Iterator[Task]:
        return self.train_pool(version)

    def demonstration_tasks(self, num: int) -> list[Task]:
        if self.demonstration_pool is not None:
            return self.demonstration_pool(num)
        return list(itertools.islice(self.train_stream(lambda: 0), num))


def generated_taskset(seed: int, num_train: int, num_heldout: int,
                      make: Callable[[random.Random, int, str], Task]) -> TaskSet:
    """A task set from a seeded generator: `make(rng, index, split)` builds the index-th task of a split
    ("train" or "heldout") from that split's own random stream (seeded "{seed}-train" and
    "{seed}-heldout", so the splits never share a draw); the training tasks cycle. What a generated
    environment's `load_tasks` returns (examples/arithmetic)."""
    train_rng, heldout_rng = random.Random(f"{seed}-train"), random.Random(f"{seed}-heldout")
    train = [make(train_rng, i, "train") for i in range(num_train)]
    heldout = [make(heldout_rng, i, "heldout") for i in range(num_heldout)]
    return TaskSet(heldout=heldout, train_pool=cycled(train, "training tasks"))


def cycled(tasks: list[Task], what: str) -> Callable[[Callable[[], int]], Iterator[Task]]:
    def pool(version: Callable[[], int]) -> Iterator[Task]:
        if not tasks:
            raise ValueError(f"the task set has no {what}: it can evaluate, not train")
        return itertools.cycle(tasks)

    return pool


# ---------------------------------------------------------------- generic tasks


@config_dataclass
class JsonlOptions:
    train: FilePath = ""
    """JSONL of training tasks (cycled); empty: evaluation only."""
    heldout: FilePath = ""
    """JSONL of held-out tasks."""
    corpus: FilePath = ""
    """Passage JSONL for the built-in search service, if the tasks use it."""
    heldout_limit: int | None = None
    """Evaluate only the first N held-out tasks."""

    def __post_init__(self) -> None:
        if not self.heldout:
            raise ValueError("heldout: the jsonl loader needs a held-out file")


def read_task_file(path: str | Path, limit: int | None = None) -> list[Task]:
    """Tasks of a JSONL file (one object per line; engine/task.py); TaskError naming path:line and the field."""
    path = Path(path)
    if not path.is_file():
        raise TaskError(f"{path}: no such task file")
    tasks = []
    for where, obj in iter_jsonl(path, TaskError):
        tasks.append(Task.from_json(obj, where))
        if limit is not None and len(tasks) >= limit:
            break
    check_unique_ids(tasks, str(path))
    return tasks


def load_jsonl(options: JsonlOptions, workdir: Path) -> TaskSet:
    heldout = read_task_file(options.heldout, options.heldout_limit)
    train = read_task_file(options.train) if options.train else []
    return TaskSet(heldout=heldout, train_pool=cycled(train, "train file"), corpus=Path(options.corpus) if options.corpus else None)


load_jsonl.Options = JsonlOptions


@config_dataclass
class HFDatasetsOptions:
    path: FilePath
    """A folder written by `datasets.DatasetDict.save_to_disk` (or `Dataset.save_to_disk` for one split)."""
    train_split: str = "train"
    """The split trained on ("" for none)."""
    heldout_split: str = "test"
    """The split evaluated."""
    id_field: str = "id"
    """Column holding the task id (absent: the row index, as "<split>-<i>")."""
    prompt_field: str = "prompt"
    """Column holding the prompt (a string) or the messages (a list of {"role","content"})."""
    reference_field: str = "reference"
    """Column holding what the environment scores against."""
    metadata_fields: list[str] = field(default_factory=list)
    """Columns copied into the task's metadata."""
    heldout_limit: int | None = None
    """Evaluate only the first N held-out rows."""


def load_hf_datasets(options: HFDatasetsOptions, workdir: Path) -> TaskSet:
    import datasets  # the `datasets` package: only this loader needs it

    folder = Path(options.path)
    if not folder.is_dir():
        raise TaskError(f"[tasks.options] path: no such folder {folder}")
    loaded = datasets.load_from_disk(str(folder))
    splits = loaded if isinstance(loaded, datasets.DatasetDict) else datasets.DatasetDict({options.heldout_split: loaded})

    def rows(split: str, limit: int | None) -> list[Task]:
        if split not in splits:
            raise TaskError(f"{folder}: no split {split!r}; it has {sorted(splits)}")
        data = splits[split]
        missing = [c for c in (options.prompt_field, options.reference_field, *options.metadata_fields) if c not in data.column_names]
        if missing:
            raise TaskError(f"{folder} split {split!r}: no column(s) {missing}; it has {data.column_names}")
        out = []
        for i, row in enumerate(data):
            if limit is not None and i >= limit:
                break
            prompt = row[options.prompt_field]
            obj: dict[str, Any] = {"id": row.get(options.id_field, f"{split}-{i}"), "reference": row[options.reference_field],
                                   "metadata": {k: row[k] for k in options.metadata_fields}}
            obj["messages" if isinstance(prompt, list) else "prompt"] = prompt
            out.append(Task.from_json(obj, f"{folder} split {split!r} row {i}"))
        check_unique_ids(out, f"{folder} split {split!r}")
        return out

    train = rows(options.train_split, None) if options.train_split else []
    return TaskSet(heldout=rows(options.heldout_split, options.heldout_limit), train_pool=cycled(train, "train split"))


load_hf_datasets.Options = HFDatasetsOptions


# ---------------------------------------------------------------- the registry


# The multi-hop QA loaders are the QA environment package's, registered by name as a user's would be.
LOADERS: dict[str, Callable[..., TaskSet] | str] = {
    "synthetic": "agentrl.envs.multihop_qa.loaders:load_synthetic",
    "datasets": "agentrl.envs.multihop_qa.loaders:load_datasets",
    "jsonl": load_jsonl,
    "hf_datasets": load_hf_datasets,
}


@config_dataclass
class TasksConfig:
    loader: PluginRef = "synthetic"
    """A built-in loader (synthetic, datasets, jsonl, hf_datasets) or "package.module:function"."""
    options: dict[str, Any] = field(default_factory=dict)
    """The loader's options ([tasks.options]), checked against its `Options` dataclass."""


def resolve_loader(name: str) -> Callable[..., TaskSet]:
    fn = resolve(name, "tasks.loader", LOADERS)
    if not callable(fn):
        raise ConfigError(f"tasks.loader: {name!r} is not a function")
    return fn


def loader_options(config: TasksConfig, *, origins: Origins | None = None, source: str = "config") -> Any:
    """The loader's options, validated (a ConfigError names tasks.options.KEY and where it was set)."""
    return build_options(resolve_loader(config.loader), config.options, "tasks.options", origins=origins, source=source)


def load_taskset(config: TasksConfig, workdir: Path) -> TaskSet:
    """The task set (a loader that fails or returns malformed tasks raises TaskError / ValueError
    naming the task and field)."""
    workdir.mkdir(parents=True, exist_ok=True)
    fn = resolve_loader(config.loader)
    options = loader_options(config)
    taskset = fn(options, workdir) if options is not None else fn(workdir)
    if not isinstance(taskset, TaskSet):
        raise TaskError(f"tasks.loader {config.loader!r} returned {type(taskset).__name__}, not a TaskSet")
    for i, task in enumerate(taskset.heldout):
        if not isinstance(task, Task):
            raise TaskError(f"tasks.loader {config.loader!r}: held-out task {i} is a {type(task).__name__}, not a Task")
    check_unique_ids(taskset.heldout, f"the held-out tasks of {config.loader!r}")
    if not taskset.heldout:
        raise TaskError(f"tasks.loader {config.loader!r} returned no held-out tasks")
    for i, task in enumerate(taskset.transfer):
        if not isinstance(task, Task):
            raise TaskError(f"tasks.loader {config.loader!r}: transfer task {i} is a {type(task).__name__}, not a Task")
    check_unique_ids([*taskset.heldout, *taskset.transfer], f"the held-out and transfer tasks of {config.loader!r}")
    return taskset
