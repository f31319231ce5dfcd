"""The optimizer step: decoupled PPO over packed micro-batches with gradient accumulation, and SFT.

Shape legend: N action tokens of one micro-batch, S sequences of one micro-batch.

One RL step = one batch (chosen by token budget upstream) = one optimizer step. The batch is split
into packed micro-batches (`batching.py`) whose gradients accumulate before the step. Because every
micro-batch is evaluated under the same weights before the step, the log-probs recomputed in its
forward ARE the proximal policy of AReaL's decoupled objective: `proximal = logprobs.detach()`, and
no separate no-grad pass is needed (it would cost a third of the compute for identical numbers).
The behavior log-probs (from vLLM) enter only through the truncated importance weight
exp(proximal - behavior) clipped at `is_cap`; the clipped ratio logprobs / proximal carries the
gradient. Observation and prompt positions are never gathered, so they cannot receive gradient
through the loss (`tests/test_learner_trainer.py` checks it).

Micro-batch weighting: the kernel aggregates within a micro-batch; each micro-batch loss is scaled
so that the accumulated gradient equals the loss aggregated over the whole batch:
token_mean by tokens/total_tokens, seq_mean by seqs/total_seqs, constant by 1 (its normaliser is a
per-batch constant already).

PPO with GAE: values come from a linear value head on the same final hidden states (a shared
trunk: one forward serves actor and critic, the critic costs H extra parameters). Advantages are
computed per sequence inside the step from those values (detached), then the value loss
0.5 * (V - returns)^2 (token mean, weight `vf_coef`) is added.

Non-finite gradients: when the global gradient norm of a step is inf or NaN (an overflow in the
loss, a poisoned log-prob that got through), the step is skipped: the gradients are zeroed, neither
the optimizer nor the LR schedule moves, and `StepStats.skipped` says so (`Trainer.num_skipped_steps`
counts them). The norm is the global one under torch.distributed, so every rank skips together.

Trainable parameters (`train_layers`): "all", or the top k decoder layers plus the final norm
(and the LM head, which is tied to the input embedding in SmolLM2: `train_embeddings` decides
whether that shared matrix trains; freezing it saves 28M of 135M parameters' optimizer state).
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from agentrl.learner.advantages import gae_over_actions
from agentrl.learner.batching import MicroBatch, PackedPolicy
from agentrl.learner.trainer_config import Kernels, TrainerConfig


def compute_dtype(config: TrainerConfig, device_type: str = "cpu") -> torch.dtype:
    """The autocast dtype of `config` on a device type (`TrainerConfig.compute_dtype_name`)."""
    return getattr(torch, config.compute_dtype_name(device_type))


def set_trainable(causal_lm: nn.Module, train_layers: int | str, train_embeddings: bool) -> int:
    """Freeze what does not train (TrainerConfig.train_layers docstring); returns #trainable params."""
    if train_layers == "all":
        for p in causal_lm.parameters():
            p.requires_grad_(True)
    else:
        for p in causal_lm.parameters():
            p.requires_grad_(False)
        layers = causal_lm.model.layers
        for layer in list(layers)[len(layers) - int(train_layers):] if train_layers else []:
            for p in layer.parameters():
                p.requires_grad_(True)
        for p in causal_lm.model.norm.parameters():
            p.requires_grad_(True)
    causal_lm.get_input_embeddings().weight.requires_grad_(train_embeddings)
    causal_lm.get_output_embeddings().weight.requires_grad_(train_embeddings)
    return sum(p.numel() for p in {id(p): p for p in causal_lm.parameters() if p.requires_grad}.values())


def on_device(method):
    """Run `method` with `self.device` as the current CUDA device (a no-op on the CPU).

    The learner steps on a worker thread (`asyncio.to_thread`), whose current CUDA device is 0
    whatever `torch.cuda.set_device` chose on the main thread; Triton launches its kernels on the
    current device, so rank r > 0 would otherwise launch onto GPU 0 with pointers into GPU r."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        if self.device.type != "cuda":
            return method(self, *args, **kwargs)
        with torch.cuda.device(self.device):
            return method(self, *args, **kwargs)

    return run


def _loss_fn(kernels: Kernels):
    if kernels == "fused":
        from agentrl.kernels.policy_loss import policy_loss

        return policy_loss
    from agentrl.kernels.reference import policy_loss_reference

    return policy_loss_reference


def _world_size() -> int:
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _global_sum(*values: float) -> list[float]:
    """Sum scalars over the ranks (identity in one process)."""
    if _world_size() == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64)
    torch.distributed.all_reduce(t)
    return t.tolist()


@dataclass
class StepStats:
    """What one optimizer step measured (the metrics line takes these)."""

    loss: float
    num_tokens: int
    """Tokens forwarded (prompt + observations + actions)."""
    num_action_tokens: int
    num_seqs: int
    grad_norm: float
    lr: float
    compute_s: float
    kernel_stats: dict[str, float]
    skipped: bool = False
    """The gradient norm was not finite: nothing was applied (module docstring)."""


class Trainer:
    """Owns the policy module, the optimizer and the LR schedule; knows nothing about transport."""

    def __init__(self, policy: PackedPolicy, config: TrainerConfig, *, reference: PackedPolicy | None = None):
        self.policy = policy
        self.config = config
        self.reference = reference
        if config.loss.kl_coef > 0 and reference is None:
            raise ValueError("loss.kl_coef > 0 needs a frozen reference policy (reference=...)")
        if config.advantage.estimator == "gae" and policy.value_head is None:
            raise ValueError("the 'gae' estimator needs a value head: build PackedPolicy(..., value_head=True)")
        self.device = next(policy.parameters()).device
        """Where the policy lives; each micro-batch moves here right before its forward (rows are
        built on the CPU). Scalars come back through float(), the loss kernels run where the
        log-probs are (Triton on CUDA, torch on the CPU: kernels/)."""
        params = [p for p in policy.parameters() if p.requires_grad]
        if not params:
            raise ValueError("no trainable parameters: check train_layers / train_embeddings")
        opt = config.optimizer
        self.optimizer = torch.optim.AdamW(params, lr=opt.lr, betas=opt.betas, weight_decay=opt.weight_decay)
        warmup = opt.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup > 0 else 1.0
        )
        self._loss = _loss_fn(config.kernels)
        self.num_skipped_steps = 0
        """Steps skipped for a non-finite gradient norm."""

    def _forward(self, mb: MicroBatch, with_entropy: bool, policy: PackedPolicy | None = None):
        """`policy` (default: the trained one; the KL reference passes itself) on micro-batch `mb`."""
        policy = self.policy if policy is None else policy
        return policy(mb.input_ids_L, mb.position_ids_L, mb.gather_idx_N, mb.targets_N,
                      temperature=self.config.temperature, with_entropy=with_entropy,
                      shared_prefix_len=mb.shared_prefix_len if self.config.share_prefix else 0)

    def _advantages(self, mb: MicroBatch, values_N: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(advantages_N, returns_N): precomputed with the batch, returns None; with the 'gae'
        estimator, from the critic's values (detached) by `advantages.gae_over_actions`, with the
        returns the value loss regresses on."""
        if self.config.advantage.estimator != "gae":
            if mb.advantages_N is None:
                raise ValueError(f"micro-batch without advantages for the {self.config.advantage.estimator!r} estimator")
            return mb.advantages_N, None
        adv_cfg = self.config.advantage
        adv_N, ret_N = gae_over_actions(mb.samples, mb.seq_ids_N.cpu().numpy(), values_N.detach().float().cpu().numpy(),
                                        adv_cfg.gamma, adv_cfg.lam)
        return torch.from_numpy(adv_N).to(values_N.device), torch.from_numpy(ret_N).to(values_N.device)

    @on_device
    def rl_step(self, micro_batches: list[MicroBatch], anchor: Sequence[MicroBatch] = (),
                anchor_coef: float = 0.0) -> StepStats:
        """Accumulate the decoupled-PPO gradient over the micro-batches, then one optimizer step.
        With `anchor` (gold demonstrations, learner/anchor.py), `anchor_coef` x their mean NLL over
        action tokens (at `temperature`, like the rest of the step) is added to the loss before the
        step; the stats' `loss` is the policy-gradient part, the anchor's NLL is `anchor_nll`.

        Advantages arrive precomputed in the micro-batches, except with the 'gae' estimator, which
        computes them here from the critic's values and the samples' weighted token rewards. Under
        torch.distributed each rank passes its own share of the batch, the same number of
        micro-batches on every rank (FSDP's collectives run once per forward).
        """
        t0 = time.perf_counter()
        cfg = self.config
        world = _world_size()
        total_tokens, total_seqs = _global_sum(
            sum(mb.num_action_tokens for mb in micro_batches), sum(mb.num_seqs for mb in micro_batches))
        if total_tokens == 0:
            raise ValueError("batch has no action tokens to train on")
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = 0.0
        stats_sum: dict[str, float] = {}
        for mb in micro_batches:
            if mb.num_action_tokens == 0 and world == 1:
                continue
            mb = mb.to(self.device)
            logprobs_N, entropy_N, values_N = self._forward(mb, with_entropy=True)
            advantages_N, returns_N = self._advantages(mb, values_N)
            ref_N = None
            if self.reference is not None:
                with torch.no_grad():
                    ref_N, _, _ = self._forward(mb, with_entropy=False, policy=self.reference)
            mask_N = torch.ones(mb.num_action_tokens, dtype=torch.bool, device=self.device)
            entropy_arg = entropy_N if cfg.loss.entropy_coef > 0 else entropy_N.detach()
            loss, stats = self._loss(
                logprobs_N, logprobs_N.detach(), mb.behavior_logprobs_N, advantages_N, mask_N, mb.seq_ids_N,
                num_seqs=mb.num_seqs, config=cfg.loss, ref_logprobs=ref_N, entropy=entropy_arg,
            )
            if returns_N is not None:
                value_loss = 0.5 * ((values_N - returns_N) ** 2).mean()
                loss = loss + cfg.vf_coef * value_loss
                stats = {**stats, "value_loss": value_loss.detach()}
            token_share = mb.num_action_tokens / total_tokens
            share = {"token_mean": token_share, "seq_mean": mb.num_seqs / total_seqs, "constant": 1.0}[cfg.loss.agg]
            # Data parallel: FSDP averages gradients over the W ranks; each rank's share of the global
            # loss is therefore scaled back up by W so the update equals the single-process one.
            (loss * (share * world)).backward()
            loss_sum += float(loss.detach()) * share
            for k, v in stats.items():
                if k != "num_tokens":
                    stats_sum[k] = stats_sum.get(k, 0.0) + float(v) * token_share
            # How far the sampler (vLLM) is from the trainer's current weights: the k3 estimate of
            # KL(behavior || proximal) from the behaviour's own samples; it grows with staleness and
            # with engine/trainer numeric mismatch (what the truncated IS weight corrects).
            delta_N = logprobs_N.detach() - mb.behavior_logprobs_N
            kl_behavior = float((torch.expm1(delta_N) - delta_N).mean()) if mb.num_action_tokens else 0.0
            stats_sum["kl_behavior_proximal"] = stats_sum.get("kl_behavior_proximal", 0.0) + kl_behavior * token_share
        anchor_tokens = sum(mb.num_action_tokens for mb in anchor)
        if anchor_tokens:
            stats_sum["anchor_nll"], _ = self._nll_backward(anchor, anchor_tokens, anchor_coef)
        grad_norm, stepped = self._clip_and_step()
        loss_sum, *stat_values = _global_sum(loss_sum, *stats_sum.values())
        return StepStats(
            loss=loss_sum,
            num_tokens=int(_global_sum(sum(mb.num_tokens for mb in micro_batches))[0]),
            num_action_tokens=int(total_tokens),
            num_seqs=int(total_seqs),
            grad_norm=grad_norm,
            lr=self.optimizer.param_groups[0]["lr"],
            compute_s=time.perf_counter() - t0,
            kernel_stats=dict(zip(stats_sum, stat_values, strict=True)),
            skipped=not stepped,
        )

    @on_device
    def sft_step(self, micro_batches: list[MicroBatch]) -> StepStats:
        """Masked NLL (token mean over action tokens) on gold trajectories; same kernels."""
        t0 = time.perf_counter()
        world = _world_size()
        (total_tokens,) = _global_sum(sum(mb.num_action_tokens for mb in micro_batches))
        if total_tokens == 0:
            raise ValueError("batch has no action tokens to train on")
        self.optimizer.zero_grad(set_to_none=True)
        nll_sum, entropy_sum = self._nll_backward(micro_batches, total_tokens, world)
        grad_norm, stepped = self._clip_and_step()
        nll_sum, entropy_sum, num_tokens, num_seqs = _global_sum(
            nll_sum, entropy_sum, sum(mb.num_tokens for mb in micro_batches), sum(mb.num_seqs for mb in micro_batches))
        return StepStats(
            loss=nll_sum,
            num_tokens=int(num_tokens),
            num_action_tokens=int(total_tokens),
            num_seqs=int(num_seqs),
            grad_norm=grad_norm,
            lr=self.optimizer.param_groups[0]["lr"],
            compute_s=time.perf_counter() - t0,
            kernel_stats={"entropy": entropy_sum / total_tokens, "nll": nll_sum},
            skipped=not stepped,
        )

    def _nll_backward(self, micro_batches: Sequence[MicroBatch], total_tokens: int, scale: float) -> tuple[float, float]:
        """Backward of `scale` x the NLL of the micro-batches' action tokens summed over
        `total_tokens` (the mean when they are all of them); (that NLL, the entropy summed over them).
        The SFT step, and the RL step's demonstration anchor."""
        nll_sum = entropy_sum = 0.0
        for mb in micro_batches:
            if mb.num_action_tokens == 0 and _world_size() == 1:
                continue
            logprobs_N, entropy_N, _ = self._forward(mb.to(self.device), with_entropy=True)
            nll = -logprobs_N.sum() / total_tokens
            (nll * scale).backward()
            nll_sum += float(nll.detach())
            entropy_sum += float(entropy_N.detach().sum())
        return nll_sum, entropy_sum

    def _clip_and_step(self) -> tuple[float, bool]:
        """(global gradient norm, whether the step was applied): skipped when the norm is not finite."""
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        clip = self.config.optimizer.grad_clip
        norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else math.inf)
        grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        if not math.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            self.num_skipped_steps += 1
            return grad_norm, False
        self.optimizer.step()
        self.scheduler.step()
        return grad_norm, True
