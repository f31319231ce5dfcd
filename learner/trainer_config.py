"""The trainer's config (`[learner.trainer]`, `[sft.learner.trainer]`): plain data, no torch, so that
reading or checking a run's config does not import the training stack (`learner/trainer.py` trains)."""

from __future__ import annotations

from dataclasses import field
from typing import Literal

from agentrl.common.config import config_dataclass
from agentrl.common.hardware import auto_dtype_name
from agentrl.kernels.policy_loss_config import PolicyLossConfig
from agentrl.learner.advantages import AdvantageConfig

Kernels = Literal["fused", "reference"]
"""\"fused\": agentrl.kernels (no [N, V] logits); \"reference\": the materialising references."""

Precision = Literal["auto", "fp32", "bf16"]


@config_dataclass
class OptimizerConfig:
    lr: float = 1e-6
    """AdamW learning rate (per step), after warm-up."""
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    """AdamW decoupled weight decay (per step, relative)."""
    grad_clip: float = 1.0
    """Max global gradient L2 norm; <= 0 disables clipping."""
    warmup_steps: int = 0
    """Linear warm-up of the learning rate over this many optimizer steps, then constant."""

    def __post_init__(self) -> None:
        self.betas = tuple(self.betas)  # type: ignore[assignment]
        if not self.lr > 0:
            raise ValueError(f"optimizer.lr={self.lr} must be > 0")
        if not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"optimizer.betas={self.betas} must lie in [0, 1)")
        if self.warmup_steps < 0:
            raise ValueError(f"optimizer.warmup_steps={self.warmup_steps} must be >= 0")


@config_dataclass
class TrainerConfig:
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    max_row_tokens: int = 2048
    """Tokens per packed micro-batch row (activation memory and attention cost grow with it)."""
    precision: Precision = "auto"
    """"bf16": fp32 master weights and optimizer state, bf16 autocast matmuls (2.2x the fp32
    matmul rate on a CPU with AVX-512 BF16: 184 vs 82 GFLOP/s; emulated and ~60x slower without);
    "fp32": everything in float32; "auto": bf16 on CUDA and on CPUs with native bf16, else fp32
    (agentrl.common.hardware)."""
    kernels: Kernels = "fused"
    """"fused": agentrl.kernels (no [N, V] logits); "reference": the materialising references."""
    temperature: float = 1.0
    """Sampling temperature the behaviour log-probs were computed at (logits are divided by it)."""
    train_layers: int | Literal["all"] = "all"
    """"all", or k: only the top k decoder layers and the final norm train."""
    train_embeddings: bool = True
    """Whether the (tied) embedding / LM head matrix trains."""
    vf_coef: float = 0.5
    """Weight of the value loss (gae only)."""
    share_prefix: bool = True
    """Run the prefix that all sequences of a micro-batch share once through the frozen bottom
    layers (PackedPolicy.forward); no effect when the embedding or every layer trains."""

    def __post_init__(self) -> None:
        if self.max_row_tokens <= 0:
            raise ValueError(f"max_row_tokens={self.max_row_tokens} must be > 0")
        if self.train_layers != "all" and not (isinstance(self.train_layers, int) and self.train_layers >= 0):
            raise ValueError(f"train_layers={self.train_layers!r}: use 'all' or an int k >= 0")

    def compute_dtype_name(self, device_type: str = "cpu") -> str:
        """The autocast dtype on a device type, "bfloat16" or "float32" ("auto": agentrl.common.hardware)."""
        if self.precision == "auto":
            return auto_dtype_name(device_type)
        return "bfloat16" if self.precision == "bf16" else "float32"
