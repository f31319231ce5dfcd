"""LoRA adapters as a weight push's payload: the file's names and metadata, and the merge.

A push file is safetensors either way. Full weights carry checkpoint names. An adapter carries the
names of a `peft` adapter file (`base_model.model.<module>.lora_A.weight`, `...lora_B.weight`) and
the metadata `agentrl_payload = "lora"` plus its scaling (alpha / rank), so the server, which knows
nothing of the run's LoRA config, can add scaling x B @ A to the weights it holds
(agentrl.common.vllm_ext). Shared by the learner (learner/lora.py) and the server's worker
extension: torch only, imported lazily by the functions that compute.

A server that serves the adapter with vLLM's own LoRA path (`services.vllm_server.lora = "vllm"`)
loads it from a peft adapter folder under the name `POLICY_ADAPTER`: `write_peft_folder` writes one
(the learner's export, the server's worker for each push) and `identity_adapter` the adapter the
server starts with (all zeros: the base model's outputs), from the model folder's safetensors
headers, without torch.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

PEFT_PREFIX = "base_model.model."
"""What a peft adapter file puts before the model's own module names."""
PAYLOAD_METADATA = "agentrl_payload"
"""The safetensors metadata key of a push file; "lora" marks an adapter (absent: full weights)."""
SCALING_METADATA = "agentrl_lora_scaling"
LORA_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<which>[AB])(?:\.default)?\.weight$")
"""A LoRA tensor's name without PEFT_PREFIX: peft's in-model name (`.default` is the adapter's
name) or its file name."""


POLICY_ADAPTER = "policy"
"""The name a server that serves the adapter itself (vLLM's LoRA path) knows the policy's adapter
by: its `--lora-modules` entry, the `model` of every request, the `lora_name` of every reload."""
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM takes for `--max-lora-rank` (vllm/config/lora.py, MaxLoRARanks)."""
ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG_FILE = "adapter_config.json"


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest `--max-lora-rank` vLLM takes that holds an adapter of `rank`; ValueError above 512."""
    for allowed in VLLM_MAX_LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"rank {rank} is above vLLM's largest --max-lora-rank ({VLLM_MAX_LORA_RANKS[-1]})")


def peft_adapter_config(rank: int, alpha: float, target_modules: list[str], layers: list[int] | None,
                        base_model: str, dropout: float = 0.0) -> dict:
    """The adapter_config.json of a peft LoRA adapter (what `peft.LoraConfig.save_pretrained` writes
    for these fields; `PeftModel.from_pretrained` and vLLM's LoRA loader read it)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model, "r": int(rank),
            "lora_alpha": alpha, "lora_dropout": dropout, "target_modules": sorted(target_modules),
            "layers_to_transform": layers, "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
            "modules_to_save": None, "use_rslora": False, "use_dora": False}


def write_peft_folder(folder: Path, tensors: dict, config: dict) -> Path:
    """A peft adapter folder: `config` (peft_adapter_config) and the tensors (peft file names; torch
    tensors or numpy arrays). The tensors file is written first and the config last, each by rename,
    so a folder with a config is complete."""
    import json
    import os

    folder.mkdir(parents=True, exist_ok=True)
    partial = folder / f".{ADAPTER_FILE}.partial"
    if all(type(t).__module__ == "numpy" for t in tensors.values()):
        from safetensors.numpy import save_file
    else:
        from safetensors.torch import save_file
        tensors = {k: v.contiguous() for k, v in tensors.items()}
    save_file(tensors, str(partial))
    os.replace(partial, folder / ADAPTER_FILE)
    (folder / f".{ADAPTER_CONFIG_FILE}.partial").write_text(json.dumps(config, indent=2))
    os.replace(folder / f".{ADAPTER_CONFIG_FILE}.partial", folder / ADAPTER_CONFIG_FILE)
    return folder


def adapter_folder_rank(folder: Path) -> int:
    """The rank `r` of a peft adapter folder's adapter_config.json (ValueError when it has none)."""
    import json

    path = Path(folder) / ADAPTER_CONFIG_FILE
    try:
        rank = json.loads(path.read_text())["r"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{path}: not a peft LoRA adapter config with a rank `r` ({type(err).__name__}: {err})") from None
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"{path}: r = {rank!r} is not a positive int")
    return rank


def model_shapes(model_dir: Path) -> dict[str, list[int]]:
    """Every tensor's shape in a model folder's safetensors files, from their headers (no tensor read,
    no torch)."""
    from safetensors import safe_open

    shapes = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="numpy") as f:
            shapes |= {k: f.get_slice(k).get_shape() for k in f.keys()}
    return shapes


def identity_adapter(model_dir: Path, rank: int, target_modules: list[str], layers: list[int]) -> dict:
    """An adapter of `rank` on `target_modules` of `layers` whose A and B are zeros (float32 numpy,
    peft file names): served, it changes nothing. Shapes from the model folder's safetensors headers."""
    import numpy as np

    shapes = model_shapes(model_dir)
    out = {}
    for name, shape in shapes.items():
        parts = name.split(".")
        if (len(shape) != 2 or len(parts) < 4 or parts[-1] != "weight" or parts[-2] not in target_modules
                or "layers" not in parts):
            continue
        index = parts.index("layers") + 1
        if index < len(parts) and parts[index].isdigit() and int(parts[index]) in layers:
            module = name.removesuffix(".weight")
            out[f"{PEFT_PREFIX}{module}.lora_A.weight"] = np.zeros((rank, shape[1]), np.float32)
            out[f"{PEFT_PREFIX}{module}.lora_B.weight"] = np.zeros((shape[0], rank), np.float32)
    if not out:
        raise ValueError(f"no {target_modules} weights in layers {layers} of {model_dir}")
    return out


def adapter_metadata(scaling: float) -> dict[str, str]:
    """The safetensors metadata of an adapter push."""
    return {PAYLOAD_METADATA: "lora", SCALING_METADATA: repr(float(scaling))}


def adapter_scaling(metadata: dict[str, str] | None) -> float | None:
    """The scaling of an adapter push's metadata; None for full weights. ValueError for a payload
    kind this version does not know, or a scaling that is not a finite number."""
    import math

    kind = (metadata or {}).get(PAYLOAD_METADATA)
    if kind is None:
        return None
    if kind != "lora":
        raise ValueError(f"payload {kind!r}: this server takes full weights or 'lora' adapters")
    try:
        scaling = float(metadata[SCALING_METADATA])
    except (KeyError, ValueError):
        raise ValueError(f"a 'lora' payload needs a numeric {SCALING_METADATA} in its metadata, got "
                         f"{metadata.get(SCALING_METADATA)!r}") from None
    if not math.isfinite(scaling):
        raise ValueError(f"{SCALING_METADATA} = {scaling} is not finite")
    return scaling


def adapter_pairs(shapes: dict[str, tuple[int, ...]], adapter: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """module -> (A, B) of an adapter checked against the model's weight `shapes` (checkpoint names).
    ValueError names what does not fit: a name that is no LoRA tensor, an A without its B, a module
    the model lacks, shapes that do not match the weight."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in adapter.items():
        match = LORA_KEY.match(key.removeprefix(PEFT_PREFIX))
        if match is None:
            raise ValueError(f"{key!r} is not a LoRA adapter tensor (expected <module>.lora_A.weight / .lora_B.weight)")
        pairs.setdefault(match["module"], {})[match["which"]] = tensor
    out = {}
    for module, pair in pairs.items():
        name = f"{module}.weight"
        if set(pair) != {"A", "B"}:
            raise ValueError(f"the adapter of {module} has lora_{''.join(pair)} only")
        if name not in shapes:
            raise ValueError(f"an adapter for {module}, which the model does not have")
        shape, a, b = tuple(shapes[name]), pair["A"], pair["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != shape[1] or b.shape[0] != shape[0] or a.shape[0] != b.shape[1]:
            raise ValueError(f"the adapter of {module}: A {tuple(a.shape)} and B {tuple(b.shape)} do not fit its weight "
                             f"{shape}")
        out[module] = (a, b)
    return out


def merge_adapter(weights: dict[str, torch.Tensor], adapter: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """weight + scaling x B @ A for every module the adapter covers (checkpoint names; float32
    arithmetic, each result in its weight's dtype); weights it does not cover are not returned.
    ValueError as `adapter_pairs`."""
    merged = {}
    for module, (a, b) in adapter_pairs({name: tuple(w.shape) for name, w in weights.items()}, adapter).items():
        base = weights[f"{module}.weight"]
        merged[f"{module}.weight"] = (base.float() + scaling * (b.float() @ a.float())).to(base.dtype)
    return merged
