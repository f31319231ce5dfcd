"""vLLM worker extension: validated, in-place weight reload from a safetensors file.

Loaded inside each vLLM worker process via `--worker-extension-cls
agentrl.common.vllm_ext.WeightSwapExtension` and called through `collective_rpc` (over HTTP: `POST /collective_rpc {"method": ..., "args": [...]}`). A push is two
calls: `agentrl_stage_weights(path)` reads and validates while the server keeps generating, then,
with generation paused, `agentrl_apply_staged()` reloads; the pause covers only the reload.

Why layer-wise reload: on vLLM's CPU worker, calling `model.load_weights` after start leaves the
model half-updated (the CPU linear layers repack their weights at load); the worker's
`reload_weights(weights_iterator=...)` re-runs the whole load-and-process path per layer and
works. Seen on this machine kind: 0.35 s for 135M parameters.

Validation before apply: the extension keeps the checkpoint-format tensors it last loaded (names,
shapes and values, on the CPU). A push is read fully, and every tensor's name, shape and
dtype-kind are checked against that record before anything is handed to the model, so a corrupt
file, an unknown name or a wrong shape is refused and the served weights stay untouched. A push
may carry a subset of the tensors (e.g. only the layers a run trains); the rest come from the
record, so the model always receives a complete, consistent set.

Results are returned as JSON-able dicts (`{"ok": True, ...}` or `{"ok": False, "error": ...}`)
instead of raised, so the HTTP caller gets the reason rather than a bare 500.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch


def _read_safetensors(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(path, device="cpu")


def _checkpoint_files(model_dir: Path) -> list[Path]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    return files


class WeightSwapExtension:
    """Mixed into vLLM's worker class; `self` is the worker (has `model_runner`, `vllm_config`)."""

    _agentrl_record: dict[str, torch.Tensor] | None = None

    def _agentrl_load_record(self) -> dict[str, torch.Tensor]:
        if self._agentrl_record is None:
            model_dir = Path(self.vllm_config.model_config.model)
            record: dict[str, torch.Tensor] = {}
            for f in _checkpoint_files(model_dir):
                record.update(_read_safetensors(str(f)))
            self._agentrl_record = record
        return self._agentrl_record

    _agentrl_staged: dict[str, torch.Tensor] | None = None

    def agentrl_stage_weights(self, path: str) -> dict:
        """Read and validate a push without touching the served model (runs while serving)."""
        start = time.perf_counter()
        self._agentrl_staged = None
        record = self._agentrl_load_record()
        try:
            update = _read_safetensors(path)
        except FileNotFoundError:
            return {"ok": False, "error": f"weights file not found: {path}"}
        except Exception as err:  # noqa: BLE001 - any parse failure means a refused push, reported to the caller
            return {"ok": False, "error": f"cannot read weights file {path}: {type(err).__name__}: {err}"}
        if not update:
            return {"ok": False, "error": f"weights file {path} holds no tensors"}
        problems = []
        for name, tensor in update.items():
            ref = record.get(name)
            if ref is None:
                problems.append(f"unknown parameter {name!r}")
            elif tuple(tensor.shape) != tuple(ref.shape):
                problems.append(f"{name}: shape {tuple(tensor.shape)}, expected {tuple(ref.shape)}")
            elif not tensor.is_floating_point():
                problems.append(f"{name}: dtype {tensor.dtype} is not floating point")
            elif not bool(torch.isfinite(tensor).all()):
                problems.append(f"{name}: contains NaN or Inf")
        if problems:
            shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
            return {"ok": False, "error": f"refused {path}: {shown}"}
        self._agentrl_staged = {name: t.to(record[name].dtype) for name, t in update.items()}
        return {"ok": True, "num_tensors": len(update), "stage_s": time.perf_counter() - start}

    def agentrl_apply_staged(self) -> dict:
        """Reload the model from the record merged with the staged push. Call while paused."""
        if self._agentrl_staged is None:
            return {"ok": False, "error": "no validated push is staged"}
        start = time.perf_counter()
        record = self._agentrl_load_record()
        record.update(self._agentrl_staged)
        self._agentrl_staged = None
        self.reload_weights(weights_iterator=iter(record.items()))
        return {"ok": True, "reload_s": time.perf_counter() - start}

    def agentrl_weight_fingerprint(self) -> dict:
        """A cheap checksum of the served parameters (sum of each tensor), for tests and debugging."""
        model = self.model_runner.get_model()
        total = 0.0
        for _, p in model.named_parameters():
            total += float(p.detach().float().sum())
        return {"ok": True, "sum": total}
