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

LoRA adapters: a push whose file says it is an adapter (agentrl.common.adapters) is merged into
the record's weights at stage time (weight + scaling x B @ A, in float32, stored in the served
dtype) and applied like a full push, but the record keeps the unmerged weights, so every adapter
push is added to the same base. The server therefore decodes at full speed with no LoRA kernels,
and the push carries only the adapter's bytes.

A server started with vLLM's own LoRA (`--enable-lora`, agentrl's `services.vllm_server.lora =
"vllm"`) serves the adapter instead: an adapter push is checked against the model folder's shapes and
the server's `--max-lora-rank`, written as a peft folder into the worker's own weights directory,
and the stage's answer names that folder (`lora_dir`); the pusher then reloads the adapter in place
through vLLM's `/v1/load_lora_adapter` (agentrl.common.weights). Full-weight pushes are refused on
such a server: its linear layers are vLLM's LoRA wrappers, and the policy is the adapter.

Dtypes: the record and every staged tensor are kept in the served dtype (the server's `--dtype`),
so the reload hands the model tensors of its own dtype. Handing it the float32 tensors of the model
folder made vLLM log "Attempted to load weight ... float32 into bfloat16" for every tensor of every
push (~5,600 lines a run); the values are the same either way, since the load casts to the
parameter's dtype with the same rounding.

Tied embeddings: when the model ties its LM head to the input embedding, vLLM's layer-wise reload
refills the embedding and puts the LM head's previous tensor back ("ParallelLMHead: Failed to load
weights": the checkpoint format has no lm_head.weight to load), which unties them: seen here, a push
that changed the embedding left the served log-probs exactly those of the new embedding with the
old LM head. `agentrl_apply_staged` therefore ties the head to the new embedding again and re-runs
its post-load processing (the CPU backend packs the LM head's weight for its GEMM), after every
reload. vLLM warns "Failed to load weights" for two layers on every push, and `_ReloadNoise`
drops exactly those two lines (a filter on vLLM's layer-wise reload logger, installed on the first
push): ParallelLMHead when the model is tied (it is re-tied right after, as above; an untied LM head
that fails to load still warns), and RotaryEmbedding, which has no weights in a checkpoint at all
(its cos/sin cache is computed) and is put back unchanged. Any other layer's warning passes.

Results are returned as JSON-able dicts (`{"ok": True, ...}` or `{"ok": False, "error": ...}`)
instead of raised, so the HTTP caller gets the reason rather than a bare 500.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

import torch

from agentrl.common.adapters import (
    POLICY_ADAPTER,
    adapter_pairs,
    adapter_scaling,
    merge_adapter,
    model_shapes,
    peft_adapter_config,
    write_peft_folder,
)

RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
LOAD_LOGGER = "vllm.model_executor.models.utils"


class _IntendedNarrowing(logging.Filter):
    """Drops "Attempted to load weight X with dtype torch.float32 into parameter with dtype
    torch.bfloat16 (or float16)" at server start: agentrl's model folders hold the learner's float32
    master weights and the server runs bf16 by choice (`--dtype`), so every tensor is narrowed once
    by design (~120 lines per start for the 135M model). Any other dtype mismatch still warns."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        return not (record.msg.startswith("Attempted to load weight") and len(args) == 3
                    and str(args[1]) == "torch.float32" and str(args[2]) in ("torch.bfloat16", "torch.float16"))


logging.getLogger(LOAD_LOGGER).addFilter(_IntendedNarrowing())  # this module is imported by each worker at start


class _ReloadNoise(logging.Filter):
    """Drops the reload's "Failed to load weights" lines of layers with nothing to load (docstring)."""

    def __init__(self, tied: bool):
        super().__init__()
        self.quiet = {"RotaryEmbedding: Failed to load weights"} | ({"ParallelLMHead: Failed to load weights"} if tied else set())

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() not in self.quiet


def _read_safetensors(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(path, device="cpu")


def _read_push(path: str) -> tuple[dict[str, torch.Tensor], dict[str, str] | None]:
    """A push file's tensors and header metadata, in one read."""
    from safetensors import safe_open

    with safe_open(path, framework="pt", device="cpu") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


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
            tied = bool(getattr(self.vllm_config.model_config.hf_config, "tie_word_embeddings", False))
            logging.getLogger(RELOAD_LOGGER).addFilter(_ReloadNoise(tied))
            dtype = self.vllm_config.model_config.dtype
            record: dict[str, torch.Tensor] = {}
            for f in _checkpoint_files(model_dir):
                record.update({k: v.to(dtype) if v.is_floating_point() else v for k, v in _read_safetensors(str(f)).items()})
            self._agentrl_record = record
        return self._agentrl_record

    _agentrl_staged: dict[str, torch.Tensor] | None = None
    _agentrl_staged_is_delta = False
    """The staged tensors are an adapter merged into the record: applied on top of it, not kept in
    it, so that every adapter push is added to the same base weights."""

    def agentrl_stage_weights(self, path: str) -> dict:
        """Read and validate a push without touching the served model (runs while serving)."""
        start = time.perf_counter()
        self._agentrl_staged = None
        record = self._agentrl_load_record()
        try:
            update, metadata = _read_push(path)
            scaling = adapter_scaling(metadata)
        except ValueError as err:
            return {"ok": False, "error": f"refused {path}: {err}"}
        except FileNotFoundError:
            return {"ok": False, "error": f"weights file not found: {path}"}
        except Exception as err:  # noqa: BLE001 - any parse failure means a refused push, reported to the caller
            return {"ok": False, "error": f"cannot read weights file {path}: {type(err).__name__}: {err}"}
        if not update:
            return {"ok": False, "error": f"weights file {path} holds no tensors"}
        lora_config = getattr(self.vllm_config, "lora_config", None)
        if lora_config is not None:
            if scaling is None:
                return {"ok": False, "error": f"refused {path}: this server serves the policy as a LoRA adapter "
                                              "(--enable-lora), and the push holds full weights; push the adapter, or "
                                              "serve without --enable-lora (services.vllm_server.lora = \"merge\")"}
            return self._agentrl_stage_served_adapter(path, update, scaling, lora_config.max_lora_rank, start)
        if scaling is not None:
            return self._agentrl_stage_adapter(path, update, scaling, start)
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
        self._agentrl_staged_is_delta = False
        return {"ok": True, "num_tensors": len(update), "stage_s": time.perf_counter() - start}

    def _agentrl_stage_adapter(self, path: str, adapter: dict[str, torch.Tensor], scaling: float, start: float) -> dict:
        """Stage a LoRA adapter (agentrl.common.adapters): the weights it covers, merged into the
        record's, which the next apply serves and the record keeps unmerged."""
        bad = [name for name, t in adapter.items() if not t.is_floating_point() or not bool(torch.isfinite(t).all())]
        if bad:
            return {"ok": False, "error": f"refused {path}: not finite floating point: {bad[:5]}"}
        try:
            merged = merge_adapter(self._agentrl_load_record(), adapter, scaling)
        except ValueError as err:
            return {"ok": False, "error": f"refused {path}: {err}"}
        self._agentrl_staged = merged
        self._agentrl_staged_is_delta = True
        return {"ok": True, "num_tensors": len(adapter), "stage_s": time.perf_counter() - start}

    _agentrl_shape_record: dict[str, list[int]] | None = None

    def _agentrl_shapes(self) -> dict[str, list[int]]:
        """The model folder's tensor shapes (checkpoint names), from the safetensors headers: all an
        adapter served by vLLM's LoRA path is checked against (no copy of the weights is kept)."""
        if self._agentrl_shape_record is None:
            self._agentrl_shape_record = model_shapes(Path(self.vllm_config.model_config.model))
        return self._agentrl_shape_record

    _agentrl_adapter_dirs: list[Path] = []
    """The adapter folders this worker wrote for vLLM's LoRA path, oldest first (the last two kept)."""
    _agentrl_adapter_count = 0

    def _agentrl_stage_served_adapter(self, path: str, adapter: dict[str, torch.Tensor], scaling: float,
                                      max_rank: int, start: float) -> dict:
        """Check an adapter push and write it as the peft folder vLLM's LoRA path loads (module
        docstring); the pusher loads it with `/v1/load_lora_adapter`."""
        bad = [name for name, t in adapter.items() if not t.is_floating_point() or not bool(torch.isfinite(t).all())]
        if bad:
            return {"ok": False, "error": f"refused {path}: not finite floating point: {bad[:5]}"}
        try:
            pairs = adapter_pairs(self._agentrl_shapes(), adapter)
        except ValueError as err:
            return {"ok": False, "error": f"refused {path}: {err}"}
        ranks = {a.shape[0] for a, _ in pairs.values()}
        if len(ranks) != 1:
            return {"ok": False, "error": f"refused {path}: the adapter's modules have different ranks {sorted(ranks)}"}
        rank = ranks.pop()
        if rank > max_rank:
            return {"ok": False, "error": f"refused {path}: the adapter's rank {rank} is above this server's "
                                          f"--max-lora-rank {max_rank}; start it with --max-lora-rank >= {rank} "
                                          "(services.vllm_server.max_lora_rank)"}
        from agentrl.common.weights import own_weights_dir

        modules = sorted({module.rsplit(".", 1)[-1] for module in pairs})
        self._agentrl_adapter_count += 1
        folder = own_weights_dir() / f"adapter-{self._agentrl_adapter_count}"
        config = peft_adapter_config(rank, scaling * rank, modules, None, self.vllm_config.model_config.model)
        write_peft_folder(folder, {k: t.float() for k, t in adapter.items()}, config)
        self._agentrl_adapter_dirs = [*self._agentrl_adapter_dirs, folder]
        for old in self._agentrl_adapter_dirs[:-2]:  # the served adapter's folder and this one stay
            shutil.rmtree(old, ignore_errors=True)
        self._agentrl_adapter_dirs = self._agentrl_adapter_dirs[-2:]
        self._agentrl_staged = None
        return {"ok": True, "num_tensors": len(adapter), "stage_s": time.perf_counter() - start,
                "lora_dir": str(folder), "lora_name": POLICY_ADAPTER, "rank": rank}

    def agentrl_apply_staged(self) -> dict:
        """Reload the model from the record merged with the staged push. Call while paused."""
        if self._agentrl_staged is None:
            return {"ok": False, "error": "no validated push is staged"}
        start = time.perf_counter()
        record = self._agentrl_load_record()
        if self._agentrl_staged_is_delta:
            weights = {**record, **self._agentrl_staged}
        else:
            record.update(self._agentrl_staged)
            weights = record
        self._agentrl_staged = None
        self.reload_weights(weights_iterator=iter(weights.items()))
        self._agentrl_retie()
        return {"ok": True, "reload_s": time.perf_counter() - start}

    def _agentrl_retie(self) -> None:
        """Tie the LM head to the (reloaded) input embedding again (module docstring)."""
        if not getattr(self.vllm_config.model_config.hf_config, "tie_word_embeddings", False):
            return
        model = self.model_runner.get_model()
        lm_head, embed = model.lm_head, model.model.embed_tokens
        lm_head.tie_weights(embed)
        lm_head.quant_method.process_weights_after_loading(lm_head)

    def agentrl_weight_fingerprint(self) -> dict:
        """A cheap checksum of the served parameters (sum of each tensor), for tests and debugging."""
        model = self.model_runner.get_model()
        total = 0.0
        for _, p in model.named_parameters():
            total += float(p.detach().float().sum())
        return {"ok": True, "sum": total}
