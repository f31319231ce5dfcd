"""Tasks: seeded synthetic multi-hop QA, loaders for HotpotQA / 2WikiMultihopQA / MuSiQue files and for
a Wikipedia-style passage corpus.

Synthetic world. A seed fixes a world of made-up entities and four relations that chain:

    product --made by--> company --founded by--> person --born in--> city --located in--> country

Every fact is one passage of the search corpus ({"id", "title", "text"}; title = the subject's
name, text = the fact plus a filler sentence about the subject), so each hop of a question is
answered by exactly one passage and a search for "founder of Velorix Labs" finds it by its words.
A question of `h` hops follows `h` relations from a named start entity; its answer is the short
name of the last entity (so exact match is meaningful) and its gold supporting passages are the
`h` fact passages in hop order, with one gold search query per hop (used by the gold trajectory).

Invariants:
- Deterministic: the same `SyntheticQAConfig` gives byte-identical passages and questions.
- Every name is unique in the world (no two entities share a name), so answers are unambiguous.
- Splits are disjoint: every company (with its single founder and its products) belongs to one
  split, chosen by the seeded shuffle; a question belongs to the split of the company on its chain
  (questions about a city's country alone belong to the city's split). Held-out questions
  therefore never name the start entity of a training question.
- Difficulty is the hop count, a parameter (`hops=(1,)` ... `(4,)`), for a 1 -> 4 hop curriculum.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from agentrl.common.config import config_dataclass
from agentrl.common.files import iter_jsonl
from agentrl.engine.task import Task

SPLITS = ("train", "heldout")


def qa_task(task_id: str, question: str, answers: tuple[str, ...] | list[str], *, num_hops: int = 0, source: str = "synthetic",
            supporting_ids: tuple[str, ...] | list[str] = (), gold_queries: tuple[str, ...] | list[str] = (),
            intermediate_answers: tuple[str, ...] | list[str] = (),
            supporting_facts: tuple[str, ...] | list[str] = ()) -> Task:
    """A question-answering task in the generic layout: prompt = the question, reference = the gold
    answer and its aliases (EM/F1 take the best over them), metadata = the hop count, the source,
    the gold supporting passage ids (in hop order for synthetic tasks), one gold search query per
    hop that retrieves the hop's passage, the bridge entities each hop but the last resolves to,
    and the sentence of each hop's passage that states the hop's fact (these three for synthetic
    tasks only: the QA environment's demonstration and failure labels)."""
    return Task(task_id, prompt=question, reference=list(answers),
                metadata={"num_hops": num_hops, "source": source, "supporting_ids": list(supporting_ids),
                          "gold_queries": list(gold_queries), "intermediate_answers": list(intermediate_answers),
                          "supporting_facts": list(supporting_facts)})


@config_dataclass
class SyntheticQAConfig:
    seed: int = 0
    """Seed of the world and of the question sampling."""
    num_companies: int = 400
    """Companies in the world; each has one founder and `products_per_company` products."""
    products_per_company: int = 1
    num_cities: int = 60
    num_countries: int = 12
    heldout_fraction: float = 0.2
    """Fraction of companies (and cities) whose questions form the held-out split."""

    def __post_init__(self) -> None:
        if self.num_companies < 2 or self.num_cities < 2 or self.num_countries < 1:
            raise ValueError("num_companies: needs num_companies >= 2, num_cities >= 2, num_countries >= 1")
        if not 0.0 < self.heldout_fraction < 1.0:
            raise ValueError(f"heldout_fraction: must be in (0, 1), got {self.heldout_fraction}")
        if self.products_per_company < 1:
            raise ValueError("products_per_company: must be >= 1 (4-hop questions start at a product)")


_ONSETS = ["b", "br", "d", "dr", "f", "g", "gr", "k", "kr", "l", "m", "n", "p", "qu", "r", "s", "st", "t", "tr", "v", "z", "th", "h", "c"]
_VOWELS = ["a", "e", "i", "o", "u", "ae", "io", "ou"]
_CODAS = ["", "", "n", "r", "l", "s", "x", "th", "m", "nd", "rk"]
_COMPANY_SUFFIXES = ["Labs", "Systems", "Works", "Dynamics", "Industries", "Robotics", "Foundry", "Analytics"]
_PRODUCT_KINDS = ["Pad", "Engine", "Lens", "Drive", "Beacon", "Loom", "Relay", "Kettle"]
_CITY_SUFFIXES = ["wick", "ford", "haven", "mere", "stead", "port", "bury", "dale"]
_COUNTRY_SUFFIXES = ["ia", "onia", "land", "ara", "istan", "ovia"]
_PROFESSIONS = ["glassmaker", "cartographer", "chemist", "architect", "violinist", "engineer", "botanist", "sailor"]
_FOUNDED_YEARS = range(1951, 2020)


def _word(rng: random.Random, num_syllables: int) -> str:
    return "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(num_syllables))


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


@dataclass
class _Fact:
    relation: str
    subject: str
    obj: str
    passage_id: str
    sentence: str
    """The passage's sentence that states the fact (its first)."""


@dataclass
class SyntheticWorld:
    """The generated world: entities, facts and passages. Build with `SyntheticWorld.generate`."""

    config: SyntheticQAConfig
    passages: list[dict] = field(default_factory=list)
    """Search corpus rows {"id", "title", "text"}, in a fixed order."""
    _facts: dict[tuple[str, str], _Fact] = field(default_factory=dict)
    """(relation, subject) -> fact; each subject has at most one object per relation."""
    _split_of: dict[str, str] = field(default_factory=dict)
    """Entity name -> split, for companies, their founders and products, and for cities."""
    _companies: list[str] = field(default_factory=list)
    _cities: list[str] = field(default_factory=list)
    _products: list[str] = field(default_factory=list)

    @classmethod
    def generate(cls, config: SyntheticQAConfig | None = None) -> SyntheticWorld:
        config = config or SyntheticQAConfig()
        rng = random.Random(config.seed)
        used: set[str] = set()

        def unique(make) -> str:
            for _ in range(10_000):
                name = make()
                if name not in used:
                    used.add(name)
                    return name
            raise RuntimeError("name space exhausted; lower the entity counts")

        countries = [unique(lambda: _word(rng, 2).capitalize() + rng.choice(_COUNTRY_SUFFIXES)) for _ in range(config.num_countries)]
        cities = [unique(lambda: _word(rng, 1).capitalize() + rng.choice(_CITY_SUFFIXES)) for _ in range(config.num_cities)]
        world = cls(config=config)
        for city in cities:
            world._add_fact("located_in", city, rng.choice(countries), f"{city} is a city in {{obj}}.",
                            f"{city} is known for its {rng.choice(['harbour', 'old bridge', 'markets', 'observatory', 'gardens'])}.")
        for _ in range(config.num_companies):
            company = unique(lambda: _word(rng, 2).capitalize() + " " + rng.choice(_COMPANY_SUFFIXES))
            founder = unique(lambda: _word(rng, 2).capitalize() + " " + _word(rng, 1).capitalize())
            year = rng.choice(_FOUNDED_YEARS)
            world._add_fact("founded_by", company, founder, f"{company} was founded by {{obj}} in {year}.",
                            f"{company} employs {rng.randint(12, 9000)} people.")
            world._add_fact("born_in", founder, rng.choice(cities), f"{founder} was born in {{obj}}.",
                            f"{founder} worked as a {rng.choice(_PROFESSIONS)} before starting a company.")
            world._companies.append(company)
            for _ in range(config.products_per_company):
                product = unique(lambda: _word(rng, 2).capitalize() + " " + rng.choice(_PRODUCT_KINDS))
                world._add_fact("made_by", product, company, f"The {product} is made by {{obj}}.",
                                f"The {product} went on sale in {rng.choice(_FOUNDED_YEARS)}.")
                world._products.append(product)
        world._cities = cities

        split_rng = random.Random(config.seed * 7919 + 1)
        for names in (world._companies, world._cities):
            order = list(names)
            split_rng.shuffle(order)
            num_heldout = max(1, round(len(order) * config.heldout_fraction))
            for i, name in enumerate(order):
                world._split_of[name] = "heldout" if i < num_heldout else "train"
        for company in world._companies:
            world._split_of[world._facts[("founded_by", company)].obj] = world._split_of[company]
        for product in world._products:
            world._split_of[product] = world._split_of[world._facts[("made_by", product)].obj]
        return world

    def _add_fact(self, relation: str, subject: str, obj: str, sentence: str, filler: str) -> None:
        passage_id = f"{relation}-{_slug(subject)}"
        sentence = sentence.format(obj=obj)
        self._facts[(relation, subject)] = _Fact(relation, subject, obj, passage_id, sentence)
        self.passages.append({"id": passage_id, "title": subject, "text": f"{sentence} {filler}"})

    def write_corpus(self, path: str | Path) -> Path:
        """Write the passage corpus as JSONL (the search tool server's `--corpus`)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w") as f:
            for row in self.passages:
                f.write(json.dumps(row) + "\n")
        return path

    def questions(self, split: str = "train", hops: Sequence[int] = (1, 2, 3, 4), num: int = 100, seed: int = 0) -> list[Task]:
        """`num` distinct questions of the given split, hop counts drawn uniformly from `hops` (a
        repeated count weighs more: `[1, 2, 2]` draws 2-hop questions twice as often).

        Deterministic in (world, split, hops, num, seed). Raises ValueError if the split holds fewer
        distinct questions than asked for.
        """
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        bad = [h for h in hops if h not in _CHAINS]
        if bad or not hops:
            raise ValueError(f"hops must be a non-empty subset of {sorted(_CHAINS)}, got {list(hops)}")
        pools = {h: self._question_pool(split, h) for h in sorted(set(hops))}
        total = sum(len(p) for p in pools.values())
        if num > total:
            raise ValueError(f"asked for {num} {split} questions with hops {list(hops)} but the world has {total}; "
                             "raise SyntheticQAConfig.num_companies")
        rng = random.Random(f"{self.config.seed}-{split}-{seed}")
        for pool in pools.values():
            rng.shuffle(pool)
        hop_order = sorted(set(hops))
        out: list[Task] = []
        cursor = dict.fromkeys(hop_order, 0)
        while len(out) < num:
            h = rng.choice([h for h in sorted(hops) if cursor[h] < len(pools[h])])
            out.append(pools[h][cursor[h]])
            cursor[h] += 1
        return out

    def num_questions(self, split: str, hops: Sequence[int]) -> int:
        """Distinct questions of `split` with the given hop counts."""
        return sum(len(self._question_pool(split, h)) for h in set(hops))

    def _question_pool(self, split: str, num_hops: int) -> list[Task]:
        pool = []
        for chain in _CHAINS[num_hops]:
            starts = {"made_by": self._products, "founded_by": self._companies,
                      "born_in": [self._facts[("founded_by", c)].obj for c in self._companies],
                      "located_in": self._cities}[chain[0]]
            for start in starts:
                task = self._compose(start, chain)
                if task is not None and self._split_of[start] == split:
                    pool.append(task)
        return pool

    def _compose(self, start: str, chain: tuple[str, ...]) -> Task | None:
        entity, description = start, (f"the {start}" if chain[0] == "made_by" else start)
        passage_ids, queries, bridges, sentences = [], [], [], []
        for i, relation in enumerate(chain):
            fact = self._facts.get((relation, entity))
            if fact is None:
                return None
            passage_ids.append(fact.passage_id)
            sentences.append(fact.sentence)
            queries.append(_QUERY[relation].format(x=entity))
            if i == len(chain) - 1:
                question = _QUESTION[relation].format(x=description)
            else:
                description = _DESCRIBE[relation].format(x=description)
                bridges.append(fact.obj)
            entity = fact.obj
        question = question[0].upper() + question[1:]
        task_id = f"syn{self.config.seed}-{len(chain)}h-{'.'.join(r[0] for r in chain)}-{_slug(start)}"
        return qa_task(task_id, question, [entity], num_hops=len(chain), source="synthetic",
                       supporting_ids=passage_ids, gold_queries=queries, intermediate_answers=bridges,
                       supporting_facts=sentences)


# Relation chains by hop count; each ends at an entity with a short name.
_CHAINS: dict[int, list[tuple[str, ...]]] = {
    1: [("made_by",), ("founded_by",), ("born_in",), ("located_in",)],
    2: [("made_by", "founded_by"), ("founded_by", "born_in"), ("born_in", "located_in")],
    3: [("made_by", "founded_by", "born_in"), ("founded_by", "born_in", "located_in")],
    4: [("made_by", "founded_by", "born_in", "located_in")],
}
# How an intermediate entity is described from the previous one.
_DESCRIBE = {
    "made_by": "the company that makes {x}",
    "founded_by": "the founder of {x}",
    "born_in": "the city where {x} was born",
}
_QUESTION = {
    "made_by": "which company makes {x}?",
    "founded_by": "who founded {x}?",
    "born_in": "which city was {x} born in?",
    "located_in": "in which country is {x}?",
}
# What each relation's subject is, for a step that names the entity found before it ("that person").
_QUERY = {
    "made_by": "who makes {x}",
    "founded_by": "founder of {x}",
    "born_in": "{x} born",
    "located_in": "{x} city country",
}


def synthetic_tasks(split: str = "heldout", num: int = 64, hops: Sequence[int] = (1, 2, 3, 4), seed: int = 0,
                    config: SyntheticQAConfig | None = None) -> tuple[SyntheticWorld, list[Task]]:
    """The world for `config` (default: seed 0) and `num` questions of `split`."""
    world = SyntheticWorld.generate(config)
    return world, world.questions(split=split, hops=hops, num=num, seed=seed)


# ---------------------------------------------------------------- published datasets


def _load_json_or_jsonl(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"dataset file not found: {path}")
    text = path.read_text()
    stripped = text.lstrip()
    if stripped.startswith("["):
        rows = json.loads(text)
    else:
        rows = [row for _, row in iter_jsonl(path)]
    if not all(isinstance(r, dict) for r in rows):
        raise ValueError(f"{path}: expected a JSON list of objects or JSONL of objects")
    return rows


def _require(row: dict, keys: Iterable[str], path: Path, fmt: str) -> None:
    missing = [k for k in keys if k not in row]
    if missing:
        raise ValueError(f"{path}: record {row.get('_id', row.get('id', '?'))!r} lacks {missing}; is this a {fmt} file?")


def passage_id_for_title(title: str) -> str:
    """Passage id of a Wikipedia paragraph named by its title (HotpotQA / 2Wiki contexts)."""
    return "wiki-" + _slug(title)


def load_hotpotqa(path: str | Path, limit: int | None = None) -> tuple[list[Task], list[dict]]:
    """HotpotQA (distractor / fullwiki dev or train JSON): tasks and the passages of their contexts.

    Record: {"_id", "question", "answer", "supporting_facts": [[title, sent_idx]], "context":
    [[title, [sentence, ...]]], "type", "level"}.
    """
    return _load_title_context(path, limit, "hotpotqa", "HotpotQA")


def load_2wikimultihopqa(path: str | Path, limit: int | None = None) -> tuple[list[Task], list[dict]]:
    """2WikiMultihopQA: the HotpotQA layout plus "evidences" ([subject, relation, object] triples),
    whose count is the hop count."""
    return _load_title_context(path, limit, "2wikimultihopqa", "2WikiMultihopQA")


def _load_title_context(path: str | Path, limit: int | None, source: str, fmt: str) -> tuple[list[Task], list[dict]]:
    path = Path(path)
    rows = _load_json_or_jsonl(path)[:limit]
    tasks, passages = [], {}
    for row in rows:
        _require(row, ("_id", "question", "answer", "supporting_facts", "context"), path, fmt)
        for title, sentences in row["context"]:
            passages.setdefault(passage_id_for_title(title), {"id": passage_id_for_title(title), "title": title, "text": "".join(sentences).strip()})
        support: list[str] = []
        for title, _sent in row["supporting_facts"]:
            if passage_id_for_title(title) not in support:
                support.append(passage_id_for_title(title))
        num_hops = len(row["evidences"]) if row.get("evidences") else len(support)
        tasks.append(qa_task(f"{source}-{row['_id']}", row["question"], [row["answer"]], supporting_ids=support,
                             num_hops=num_hops, source=source))
    return tasks, list(passages.values())


def load_musique(path: str | Path, limit: int | None = None, answerable_only: bool = True) -> tuple[list[Task], list[dict]]:
    """MuSiQue (ans / full, JSONL): tasks and their paragraphs.

    Record: {"id", "paragraphs": [{"idx", "title", "paragraph_text", "is_supporting"}], "question",
    "question_decomposition": [{"id", "question", "answer", "paragraph_support_idx"}], "answer",
    "answer_aliases", "answerable"}. The hop count is the decomposition's length.
    """
    path = Path(path)
    rows = _load_json_or_jsonl(path)
    tasks, passages = [], {}
    for row in rows:
        _require(row, ("id", "paragraphs", "question", "answer", "question_decomposition"), path, "MuSiQue")
        if answerable_only and not row.get("answerable", True):
            continue
        support = []
        for para in row["paragraphs"]:
            pid = f"musique-{row['id']}-{para['idx']}"
            passages[pid] = {"id": pid, "title": para["title"], "text": para["paragraph_text"]}
            if para.get("is_supporting"):
                support.append(pid)
        answers = (row["answer"], *row.get("answer_aliases", []))
        tasks.append(qa_task(f"musique-{row['id']}", row["question"], answers, supporting_ids=support,
                             num_hops=len(row["question_decomposition"]), source="musique"))
        if limit is not None and len(tasks) >= limit:
            break
    return tasks, list(passages.values())


def load_passages(path: str | Path, limit: int | None = None) -> list[dict]:
    """A Wikipedia-style passage corpus in JSONL: {"id", "title", "text"} per line.

    The `"contents": "Title\\ntext"` layout of the common wiki-18 dumps (DPR / FlashRAG) is also read:
    its first line is the title.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"passage corpus not found: {path}")
    out = []
    for where, row in iter_jsonl(path):
        if "id" not in row:
            raise ValueError(f"{where}: passage lacks 'id'")
        if "text" in row and "title" in row:
            out.append({"id": str(row["id"]), "title": row["title"], "text": row["text"]})
        elif "contents" in row:
            title, _, text = row["contents"].partition("\n")
            out.append({"id": str(row["id"]), "title": title.strip('"'), "text": text})
        else:
            raise ValueError(f"{where}: passage needs 'title' and 'text' (or 'contents'), has {sorted(row)}")
        if limit is not None and len(out) >= limit:
            break
    return out


def write_passages(passages: Iterable[dict], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for row in passages:
            f.write(json.dumps({"id": row["id"], "title": row["title"], "text": row["text"]}) + "\n")
    return path
