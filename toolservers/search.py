"""The `search` tool: BM25 (bm25s) over a passage corpus read from JSONL.

Corpus file: one JSON object per line, `{"id": str, "title": str, "text": str}`; a blank line is
skipped, anything else that is not such an object (or a repeated id) stops the load with the line
number. Title and text are indexed together.

Index cache: building the index tokenizes the whole corpus (seconds for 100k passages), so the
built index and its vocabulary are saved under `cache_dir/<key>/`, where key = sha256 of the
corpus file's bytes and of the index settings (bm25s version, stopwords, k1, b). A changed corpus
or setting gets a new key, so a stale index is never loaded. The cache entry is written to a
temporary folder and renamed into place, so a crash mid-write leaves no half entry.

Calls run inline on the server loop, in batches: every search request drained in one loop turn
is answered by one `retrieve` call (bm25s scores a batch of queries together; `workers` threads).
Passages with score 0 (no query term in common) are not returned, so a query made only of
stopwords or unknown words returns [].
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import bm25s
from bm25s.tokenization import Tokenizer

from agentrl.common.config import config_dataclass
from agentrl.common.files import iter_jsonl, sha256_update
from agentrl.toolservers.server import Job, Outcome, Tool, ToolSpec

log = logging.getLogger(__name__)

MAX_TOP_K = 50


class BM25Index:
    """BM25 over passages ({"id", "title", "text"}), title and text indexed together; the one index
    behind the search service and the in-process `LocalSearchTool` (engine/tools.py), so both rank a
    query the same way."""

    def __init__(self, passages: list[dict], tokenizer: Tokenizer, retriever: bm25s.BM25):
        self.passages, self.tokenizer, self.retriever = passages, tokenizer, retriever

    @classmethod
    def build(cls, passages: list[dict], k1: float = 1.5, b: float = 0.75) -> BM25Index:
        tokenizer = Tokenizer(stopwords="en", stemmer=None)
        ids = tokenizer.tokenize([f"{p['title']}\n{p['text']}" for p in passages], return_as="ids", show_progress=False)
        retriever = bm25s.BM25(k1=k1, b=b)
        retriever.index(ids, show_progress=False)
        return cls(passages, tokenizer, retriever)

    @classmethod
    def load(cls, passages: list[dict], folder: Path) -> BM25Index:
        tokenizer = Tokenizer(stopwords="en", stemmer=None)
        tokenizer.load_vocab(str(folder))
        return cls(passages, tokenizer, bm25s.BM25.load(str(folder), show_progress=False))

    def save(self, folder: Path) -> None:
        self.retriever.save(str(folder), show_progress=False)
        self.tokenizer.save_vocab(str(folder))

    def search(self, queries: list[str], top_ks: list[int], num_threads: int = 1) -> list[list[dict]]:
        """The best passages for each query (at most its top_k, each with its "score"); passages with
        score 0 (no query term in common) are left out, so a query of stopwords only finds []."""
        top_ks = [min(k, len(self.passages)) for k in top_ks]
        query_ids = self.tokenizer.tokenize(queries, update_vocab=False, return_as="ids", show_progress=False)
        doc_idx, scores = self.retriever.retrieve(query_ids, k=max(top_ks), show_progress=False,
                                                  n_threads=0 if num_threads == 1 else num_threads)
        results = []
        for row, top_k in enumerate(top_ks):
            hits = []
            for idx, score in zip(doc_idx[row][:top_k], scores[row][:top_k], strict=True):
                if score <= 0:
                    break
                hits.append({**self.passages[int(idx)], "score": round(float(score), 4)})
            results.append(hits)
        return results


@config_dataclass
class SearchConfig:
    """The search service (`[search]` of `agentrl toolserver --config`)."""

    corpus_path: str
    """JSONL file of {"id", "title", "text"} passages."""
    cache_dir: str = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "agentrl", "search")
    """Where built indexes are kept, one sub-folder per (corpus content, settings)."""
    num_threads: int = 1
    """Threads bm25s uses to score one batch of queries."""
    k1: float = 1.5
    """BM25 term-frequency saturation."""
    b: float = 0.75
    """BM25 length normalization."""

    def __post_init__(self) -> None:
        if self.num_threads < 1:
            raise ValueError(f"num_threads: must be >= 1, got {self.num_threads}")
        if self.k1 < 0 or not 0 <= self.b <= 1:
            raise ValueError(f"k1: BM25 needs k1 >= 0 and 0 <= b <= 1, got k1={self.k1}, b={self.b}")

    def check_host(self) -> None:
        """The corpus file is there (ValueError otherwise)."""
        if not Path(self.corpus_path).is_file():
            raise ValueError(f"corpus {self.corpus_path!r} is not a file (expected JSONL of id/title/text)")


def load_corpus(path: str) -> list[dict]:
    passages, seen = [], set()
    for where, obj in iter_jsonl(path):
        if not isinstance(obj, dict) or not all(isinstance(obj.get(k), str) for k in ("id", "title", "text")):
            raise ValueError(f"{where}: expected an object with string id, title and text")
        if obj["id"] in seen:
            raise ValueError(f"{where}: id {obj['id']!r} appears twice")
        seen.add(obj["id"])
        passages.append({"id": obj["id"], "title": obj["title"], "text": obj["text"]})
    if not passages:
        raise ValueError(f"{path}: no passages")
    return passages


class SearchTool(Tool):
    spec = ToolSpec(
        name="search",
        description="Search the passage corpus with BM25 and return the top matching passages.",
        parameters={
            "type": "object",
            "properties": {
                "query": {"type": "string", "description": "Keywords or a question.", "minLength": 1,
                          "maxLength": 2000},
                "top_k": {"type": "integer", "description": "How many passages to return (default 3).",
                          "minimum": 1, "maximum": MAX_TOP_K, "default": 3},
            },
            "required": ["query"],
            "additionalProperties": False,
        },
        idempotent=True,
    )

    def __init__(self, config: SearchConfig):
        config.check_host()
        self.config = config
        self.index: BM25Index | None = None
        self.cache_hit = False

    def start(self) -> None:
        t0 = time.monotonic()
        passages = load_corpus(self.config.corpus_path)
        entry = Path(self.config.cache_dir) / self._cache_key()
        self.cache_hit = entry.is_dir()
        if self.cache_hit:
            self.index = BM25Index.load(passages, entry / "index")
        else:
            self.index = BM25Index.build(passages, self.config.k1, self.config.b)
            self._cache(entry)
        log.info(
            "search index over %d passages %s in %.2f s", len(passages),
            "loaded from cache" if self.cache_hit else "built", time.monotonic() - t0,
        )

    def _cache_key(self) -> str:
        h = sha256_update(hashlib.sha256(), Path(self.config.corpus_path))
        h.update(f"bm25s={bm25s.__version__};stopwords=en;k1={self.config.k1};b={self.config.b}".encode())
        return h.hexdigest()[:32]

    def _cache(self, entry: Path) -> None:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=entry.parent, prefix=".building-"))
        try:
            self.index.save(tmp / "index")
            os.rename(tmp, entry)
        except FileExistsError:
            pass  # another server built the same entry first; ours is identical
        except OSError as exc:
            if entry.is_dir():  # lost the rename race on a filesystem that reports ENOTEMPTY
                log.info("cache entry %s was written concurrently (%s)", entry, exc)
            else:
                raise
        finally:
            if tmp.exists():
                shutil.rmtree(tmp)

    def run_batch(self, jobs: list[Job]) -> list[Outcome]:
        assert self.index is not None
        hits = self.index.search([job.args["query"] for job in jobs], [job.args.get("top_k", 3) for job in jobs],
                                 self.config.num_threads)
        return [Outcome(True, h) for h in hits]
