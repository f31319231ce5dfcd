"""LoRA adapters as a weight push's payload: the file's names and metadata, and the merge.

A push file is safetensors either way. Full weights carry checkpoint names. An adapter carries the
names of a `peft` adapter file (`base_model.model.<module>.lora_A.weight`, `...lora_B.weight`) and
the metadata `agentrl_payload = "lora"` plus its scaling (alpha / rank), so the server, which knows
nothing of the run's LoRA config, can add scaling x B @ A to the weights it holds
(agentrl.common.vllm_ext). Shared by the learner (learner/lora.py) and the server's worker
extension: torch only, imported lazily by the functions that compute.
"""

from __future__ import annotations

import re
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


def merge_adapter(weights: dict[str, torch.Tensor], adapter: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """weight + scaling x B @ A for every module the adapter covers (checkpoint names; float32
    arithmetic, each result in its weight's dtype); weights it does not cover are not returned.
    ValueError names what does not fit: a name that is no LoRA tensor, an A without its B, a module
    the model lacks, shapes that do not match the weight."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in adapter.items():
        match = LORA_KEY.match(key.removeprefix(PEFT_PREFIX))
        if match is None:
            raise ValueError(f"{key!r} is not a LoRA adapter tensor (expected <module>.lora_A.weight / .lora_B.weight)")
        pairs.setdefault(match["module"], {})[match["which"]] = tensor
    merged = {}
    for module, pair in pairs.items():
        name = f"{module}.weight"
        if set(pair) != {"A", "B"}:
            raise ValueError(f"the adapter of {module} has lora_{''.join(pair)} only")
        if name not in weights:
            raise ValueError(f"an adapter for {module}, which the model does not have")
        base, a, b = weights[name], pair["A"].float(), pair["B"].float()
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != base.shape[1] or b.shape[0] != base.shape[0] or a.shape[0] != b.shape[1]:
            raise ValueError(f"the adapter of {module}: A {tuple(a.shape)} and B {tuple(b.shape)} do not fit its weight "
                             f"{tuple(base.shape)}")
        merged[name] = (base.float() + scaling * (b @ a)).to(base.dtype)
    return merged
