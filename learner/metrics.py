"""Per-step metrics: one JSON line per optimizer step, the same scalars in TensorBoard, a progress bar.

The JSONL file is the record of truth (append-only, flushed every step; a restarted learner appends,
so a step that was redone after a crash appears twice and the later line wins). TensorBoard gets
every numeric scalar; lists and strings (group ids) stay in the JSONL only.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from agentrl.common.files import iter_jsonl


class MetricsWriter:
    def __init__(self, output_dir: Path, *, tensorboard: bool = True, progress_total: int | None = None,
                 progress_initial: int = 0, progress_bar: bool = True):
        output_dir.mkdir(parents=True, exist_ok=True)
        self.path = output_dir / "metrics.jsonl"
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (owned; closed in close())
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(output_dir / "tensorboard"))
        self._bar = None
        if progress_bar:
            from tqdm import tqdm

            self._bar = tqdm(total=progress_total, initial=progress_initial, unit="step", file=sys.stderr,
                             dynamic_ncols=True, desc="learner")

    def write(self, step: int, record: dict[str, Any]) -> None:
        self._file.write(json.dumps({"step": step, **record}, sort_keys=True) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in record.items():
                if isinstance(value, bool) or not isinstance(value, int | float):
                    continue
                self._tb.add_scalar(key, value, step)
        if self._bar is not None:
            self._bar.update(1)
            shown = {k: record[k] for k in ("loss", "reward/task", "tokens_per_s", "staleness/mean") if k in record}
            self._bar.set_postfix({k.split("/")[-1]: f"{v:.3g}" for k, v in shown.items()}, refresh=False)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        self._file.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """All lines of a metrics.jsonl; for a redone step the later line wins."""
    by_step: dict[int, dict[str, Any]] = {}
    for _, record in iter_jsonl(path):
        by_step[record["step"]] = record
    return [by_step[s] for s in sorted(by_step)]
