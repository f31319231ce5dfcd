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

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The default LoRA targets: every linear layer of a Llama-style decoder layer (attention and MLP)."""


@config_dataclass
class LoraConfig:
    """LoRA adapters trained with `peft` instead of the weights themselves (`rank` > 0 turns it on).

    The adapters go on `target_modules` of the layers `TrainerConfig.train_layers` names (all, or
    the top k); every weight of the model stays frozen, the embedding and the (tied) LM head
    included, which the fused log-prob kernel reads as it does today. A push sends the adapter only
    (learner/lora.py); the server adds it to the weights it serves (agentrl.common.vllm_ext)."""

    rank: int = 0
    """The adapters' rank r; 0: no LoRA (the weights train)."""
    alpha: float = 32.0
    """Scaling numerator: an adapter adds (alpha / rank) x B @ A to its layer's weight."""
    dropout: float = 0.0
    """Dropout on the adapters' input while training (peft's lora_dropout); keep 0 for RL, where the
    recomputed log-probs must be those of the policy that sampled."""
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    """Module names (the last part of a linear layer's name) that get an adapter."""

    def __post_init__(self) -> None:
        if self.rank < 0:
            raise ValueError(f"lora.rank={self.rank} must be >= 0 (0 turns LoRA off)")
        if not self.alpha > 0:
            raise ValueError(f"lora.alpha={self.alpha} must be > 0")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"lora.dropout={self.dropout} must lie in [0, 1)")
        if self.rank and not self.target_modules:
            raise ValueError("lora.target_modules is empty: name the linear layers that get adapters, e.g. "
                             f"{list(LORA_TARGETS)}")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


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
    """"all", or k: only the top k decoder layers and the final norm train (with LoRA: only they get
    adapters, and nothing else trains)."""
    train_embeddings: bool = True
    """Whether the (tied) embedding / LM head matrix trains (must be false with LoRA)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """`[learner.trainer.lora]`: train LoRA adapters instead of the weights (LoraConfig)."""
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
        if self.lora.enabled:
            if self.train_embeddings:
                raise ValueError("lora.rank > 0 trains adapters only, and the embedding / LM head stays frozen: set "
                                 "learner.trainer.train_embeddings = false (or lora.rank = 0 to train the weights)")
            if self.train_layers == 0:
                raise ValueError("lora.rank > 0 with train_layers = 0 puts no adapter anywhere: train_layers names the "
                                 "layers that get adapters ('all' or the top k > 0)")

    def compute_dtype_name(self, device_type: str = "cpu") -> str:
        """The autocast dtype on a device type, "bfloat16" or "float32" ("auto": agentrl.common.hardware)."""
        if self.precision == "auto":
            return auto_dtype_name(device_type)
        return "bfloat16" if self.precision == "bf16" else "float32"
