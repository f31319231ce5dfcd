"""Packing trajectories into micro-batch rows by token budget, and the packed forward pass.

Shape legend: T tokens of one trajectory, L tokens of one packed row (sum of its sequences' T),
N rows of hidden states whose next token is an action (the only rows the LM head sees), H hidden
size, V vocabulary size, S sequences in a row.

Packing: sequences are placed first-fit-decreasing into rows of at most `max_row_tokens` tokens
(one sequence longer than that gets a row of its own), so a row carries no padding at all. Within a
row, position ids restart at 0 for every sequence.

Attention on a packed row. transformers 5.x can derive a block-diagonal causal mask from reset
position ids (sdpa/eager with `attention_mask=None`, `use_cache=False`), but the CPU kernels then
compute all L^2 scores of the row and mask most of them away: at 4 sequences x 440 tokens that is
~4x the attention FLOPs. Measured here (SmolLM2-135M forward+backward, bf16 autocast, 4 x 440
tokens, 1 thread, medians of 3 on the shared machine, load ~12): packed with the mask 41.5 tokens/s,
one forward per sequence 71.6, packed with the per-sequence attention below 75.4. So the
`PackedPolicy` registers its own attention function, "agentrl_packed": it cuts the row at the
position-id resets and runs causal `scaled_dot_product_attention` per sequence (varlen attention,
as flash-attention does on GPU), with no mask built at all. The projections and MLP still see the
whole row as one matmul. `tests/test_learner_trainer.py` checks that a packed row's log-probs equal
each sequence's own forward and the HF logits.

Log-probs: the hidden state at position i predicts token i + 1. Only rows whose next token is an
action are gathered (`gather_idx_N`) and sent with the LM head weight to
`agentrl.kernels.linear_logprob`, which never materialises the [N, V] logits; prompt and
observation positions never reach the LM head, so they get no gradient through it by construction.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from agentrl.common.trajectory import Trajectory

if TYPE_CHECKING:
    from agentrl.learner.trainer_config import Kernels



@dataclass
class Sample:
    """One trajectory with its token-level advantages, ready to pack."""

    group_id: str
    sample_index: int
    trajectory: Trajectory
    advantages_T: np.ndarray | None
    """[T] float32, zero on non-action tokens; None where the step computes them (GAE: from the
    critic's values and `rewards_T`) or needs none (SFT)."""
    rewards_T: np.ndarray | None = None
    """[T] float32 weighted token rewards (`rewards.token_rewards`); only GAE reads them."""

    @property
    def num_tokens(self) -> int:
        return self.trajectory.num_tokens


@dataclass
class MicroBatch:
    """One packed row. Tensors over L are the model's input; tensors over N are per action token."""

    input_ids_L: torch.Tensor
    position_ids_L: torch.Tensor
    gather_idx_N: torch.Tensor
    """int64 positions in the row whose hidden state predicts an action token."""
    targets_N: torch.Tensor
    """int64 the action token ids."""
    behavior_logprobs_N: torch.Tensor
    advantages_N: torch.Tensor | None
    """None when the samples carry none (GAE computes them in the step; SFT needs none)."""
    policy_versions_N: torch.Tensor
    seq_ids_N: torch.Tensor
    """int64 in [0, num_seqs): which sequence of this row the token belongs to."""
    num_seqs: int
    samples: list[Sample]
    shared_prefix_len: int = 0
    """Tokens every sequence of the row starts with (system prompt, worked example, and for a GRPO
    group the question), at most each sequence's length - 1; see `PackedPolicy.forward`."""

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids_L.shape[0])

    @property
    def num_action_tokens(self) -> int:
        return int(self.targets_N.shape[0])

    def to(self, device: torch.device) -> MicroBatch:
        """This micro-batch with every tensor on `device` (the same tensors when already there: on
        the CPU nothing is copied). Rows are built on the CPU from numpy and moved right before use,
        so only the micro-batch in flight occupies accelerator memory."""
        moved = {f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)
                 if isinstance(getattr(self, f.name), torch.Tensor)}
        return dataclasses.replace(self, **moved)


def pack_first_fit(lengths: Sequence[int], max_row_tokens: int) -> list[list[int]]:
    """Indices of `lengths` grouped into rows of total <= max_row_tokens, first-fit decreasing."""
    if max_row_tokens <= 0:
        raise ValueError(f"max_row_tokens={max_row_tokens} must be > 0")
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for r, free in enumerate(room):
            if lengths[i] <= free:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(max_row_tokens - lengths[i])
    return rows


def build_micro_batches(
    samples: Sequence[Sample], max_row_tokens: int, rows: list[list[int]] | None = None
) -> list[MicroBatch]:
    """Pack samples into rows (module docstring), or use the given `rows` of sample indices, and
    build the per-row tensors."""
    rows = rows if rows is not None else pack_first_fit([s.num_tokens for s in samples], max_row_tokens)
    if len({s.advantages_T is None for s in samples}) > 1:
        raise ValueError("either every sample of a batch carries advantages or none does")
    out = []
    for row in rows:
        ids, pos, gather, targets, behav, adv, versions, seq_ids = [], [], [], [], [], [], [], []
        offset = 0
        row_samples = [samples[i] for i in row]
        for s_idx, sample in enumerate(row_samples):
            traj = sample.trajectory
            num_tokens = traj.num_tokens
            # Token 0 has no predecessor; the trajectory contract puts the prompt first, so it is never an action.
            action_T = np.flatnonzero(traj.is_action[1:]) + 1
            ids.append(traj.token_ids.astype(np.int64))
            pos.append(np.arange(num_tokens, dtype=np.int64))
            gather.append(offset + action_T - 1)
            targets.append(traj.token_ids[action_T].astype(np.int64))
            behav.append(traj.behavior_logprobs[action_T])
            if sample.advantages_T is not None:
                adv.append(sample.advantages_T[action_T].astype(np.float32))
            versions.append(traj.policy_versions[action_T].astype(np.int64))
            seq_ids.append(np.full(action_T.shape[0], s_idx, dtype=np.int64))
            offset += num_tokens
        out.append(MicroBatch(
            shared_prefix_len=_shared_prefix_len([s.trajectory.token_ids for s in row_samples]),
            input_ids_L=torch.from_numpy(np.concatenate(ids)),
            position_ids_L=torch.from_numpy(np.concatenate(pos)),
            gather_idx_N=torch.from_numpy(np.concatenate(gather)),
            targets_N=torch.from_numpy(np.concatenate(targets)),
            behavior_logprobs_N=torch.from_numpy(np.concatenate(behav).astype(np.float32)),
            advantages_N=torch.from_numpy(np.concatenate(adv)) if adv else None,
            policy_versions_N=torch.from_numpy(np.concatenate(versions)),
            seq_ids_N=torch.from_numpy(np.concatenate(seq_ids)),
            num_seqs=len(row_samples),
            samples=row_samples,
        ))
    return out


def _shared_prefix_len(token_ids: Sequence[np.ndarray]) -> int:
    """Length of the token prefix all sequences share, capped so every sequence keeps >= 1 token."""
    if len(token_ids) < 2:
        return 0
    first = token_ids[0]
    shared = min(len(t) for t in token_ids) - 1
    for other in token_ids[1:]:
        differs = np.flatnonzero(first[:shared] != other[:shared])
        if differs.size:
            shared = int(differs[0])
    return max(shared, 0)


PACKED_ATTENTION = "agentrl_packed"

SHARED_PREFIX_MODEL_TYPES = ("llama", "qwen2", "mistral")
"""Decoder-only models whose `model.forward` is embed -> rotary -> layers -> norm (no embedding
scale, no per-layer masks): `PackedPolicy._shared_prefix_forward` reproduces exactly that."""


def packed_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, position_ids=None, **kwargs):
    """Causal attention per sequence of a packed row; query [1, Hq, L, D], key/value [1, Hkv, P + L, D].

    Sequences start where the position ids stop counting up by one (module docstring). P > 0 when
    the keys begin with a shared prefix every sequence continues (the prefix pass of
    `PackedPolicy.forward`): each sequence then attends to all P prefix keys and causally to its own.
    Returns [1, L, Hq, D].
    """
    if position_ids is None or query.shape[0] != 1:
        raise ValueError("agentrl_packed attention needs one packed row with its position_ids")
    length = query.shape[2]
    prefix = key.shape[2] - length
    pos = position_ids[0]
    starts = [0, *((pos[1:] != pos[:-1] + 1).nonzero()[:, 0] + 1).tolist(), length]
    enable_gqa = query.shape[1] != key.shape[1]
    outs = []
    for a, b in zip(starts[:-1], starts[1:], strict=True):
        if prefix == 0:
            outs.append(F.scaled_dot_product_attention(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], is_causal=True,
                                                       scale=scaling, dropout_p=dropout, enable_gqa=enable_gqa))
            continue
        keys = torch.cat([key[:, :, :prefix], key[:, :, prefix + a:prefix + b]], dim=2)
        values = torch.cat([value[:, :, :prefix], value[:, :, prefix + a:prefix + b]], dim=2)
        visible = torch.ones(b - a, prefix + b - a, dtype=torch.bool, device=query.device).tril(diagonal=prefix)
        outs.append(F.scaled_dot_product_attention(query[:, :, a:b], keys, values, attn_mask=visible,
                                                   scale=scaling, dropout_p=dropout, enable_gqa=enable_gqa))
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None


def _no_mask(*args, **kwargs):
    return None


AttentionInterface.register(PACKED_ATTENTION, packed_attention)
AttentionMaskInterface.register(PACKED_ATTENTION, _no_mask)


def _logprob_fn(kernels: Kernels):
    if kernels == "fused":
        from agentrl.kernels.linear_logprob import linear_logprob

        return linear_logprob
    if kernels == "reference":
        from agentrl.kernels.reference import linear_logprob_reference

        return linear_logprob_reference
    raise ValueError(f"kernels={kernels!r}: choose 'fused' or 'reference'")


class PackedPolicy(nn.Module):
    """A Hugging Face causal LM (plus an optional value head) evaluated on packed rows.

    This module is the FSDP root: its forward runs the decoder and the LM head under one set of
    FSDP hooks, so the (tied) LM head weight is unsharded while `linear_logprob` reads it.
    """

    def __init__(self, causal_lm: nn.Module, *, value_head: bool = False, kernels: Kernels = "fused",
                 compute_dtype: torch.dtype = torch.float32):
        super().__init__()
        causal_lm.config._attn_implementation = PACKED_ATTENTION
        self.lm = causal_lm
        hidden_size = causal_lm.config.hidden_size
        self.value_head = nn.Linear(hidden_size, 1) if value_head else None
        if self.value_head is not None:
            nn.init.zeros_(self.value_head.weight)
            nn.init.zeros_(self.value_head.bias)
        self.kernels = kernels
        self._logprob = _logprob_fn(kernels)
        self.compute_dtype = compute_dtype

    def forward(
        self,
        input_ids_L: torch.Tensor,
        position_ids_L: torch.Tensor,
        gather_idx_N: torch.Tensor,
        targets_N: torch.Tensor,
        temperature: float = 1.0,
        with_entropy: bool = True,
        shared_prefix_len: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(logprobs_N float32, entropy_N or None, values_N or None) for the gathered positions.

        `shared_prefix_len` P > 0 (MicroBatch.shared_prefix_len: every sequence of the row starts
        with the same P tokens) lets the frozen bottom of the network see those P tokens once instead
        of once per sequence: when the embedding and the bottom k decoder layers do not train, their
        output for the shared prefix is the same in every sequence and nothing needs its gradient.
        So the prefix runs alone through the k frozen layers (keeping its keys and values), the rest
        of every sequence runs packed through them attending to those prefix keys, and the
        trainable top layers get the full row with the prefix's hidden states copied into each
        sequence: the same computation as the plain forward (tests/test_learner_trainer.py: log-probs
        and gradients within 1e-5 in fp32; in bf16 the differently shaped matmuls round differently,
        ~1e-3 on log-probs), with the frozen layers' work cut by (S - 1) x P tokens. Only for model
        types whose decoder forward is exactly embed -> rotary -> layers -> norm with full attention
        (`SHARED_PREFIX_MODEL_TYPES`, no sliding window); others take the plain path.
        Measured (benchmarks/learner.py's recipe batch: 8 sequences of ~695 tokens sharing a
        400-token prompt, 22 frozen layers, medians of 3 steps side by side): rows of 2 sequences
        1.04-1.07x (0.98x in an earlier run: within noise), rows of 4 1.10x, one row of 8 1.16-1.21x
        (609 vs 505 tokens/s): the gain grows with the sequences per row, so the CPU recipe packs a
        whole step into one row (max_row_tokens 8192). `TrainerConfig.share_prefix = false` turns it off.
        """
        use_autocast = self.compute_dtype != torch.float32
        frozen = self._frozen_bottom_layers() if shared_prefix_len > 0 else 0
        # Autocast where the row is (bf16 matmuls over fp32 master weights on the CPU and on CUDA alike).
        with torch.autocast(input_ids_L.device.type, dtype=self.compute_dtype, enabled=use_autocast):
            if frozen:
                hidden = self._shared_prefix_forward(input_ids_L, position_ids_L, shared_prefix_len, frozen)
            else:
                hidden = self.lm.model(input_ids=input_ids_L[None], position_ids=position_ids_L[None],
                                       use_cache=False).last_hidden_state
        hidden_NH = hidden[0].index_select(0, gather_idx_N).to(self.compute_dtype)
        weight_VH = self.lm.get_output_embeddings().weight.to(self.compute_dtype)
        result = self._logprob(hidden_NH, weight_VH, targets_N, None, temperature, with_entropy)
        logprobs_N, entropy_N = result if with_entropy else (result, None)
        values_N = None
        if self.value_head is not None:
            values_N = self.value_head(hidden_NH.float())[:, 0]
        return logprobs_N.float(), (entropy_N.float() if entropy_N is not None else None), values_N

    def _frozen_bottom_layers(self) -> int:
        """How many decoder layers from the bottom have no trainable parameter, when the input
        embedding does not train either (else 0: its gradient flows through every layer) and the
        model's forward is one `_shared_prefix_forward` reproduces (else 0)."""
        model = self.lm.model
        config = self.lm.config
        full_attention = all(t == "full_attention" for t in (getattr(config, "layer_types", None) or ["full_attention"]))
        sliding = getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True)
        if config.model_type not in SHARED_PREFIX_MODEL_TYPES or not full_attention or sliding:
            return 0
        if model.embed_tokens.weight.requires_grad:
            return 0
        count = 0
        for layer in model.layers:
            if any(p.requires_grad for p in layer.parameters()):
                break
            count += 1
        return count

    def _shared_prefix_forward(self, input_ids_L: torch.Tensor, position_ids_L: torch.Tensor, prefix_len: int,
                               frozen: int) -> torch.Tensor:
        """The decoder's last hidden state [1, L, H] of a packed row whose sequences share their first
        `prefix_len` tokens, computing those tokens once in the `frozen` bottom layers (forward's docstring)."""
        from transformers import DynamicCache

        model = self.lm.model
        layers = list(model.layers)
        in_suffix_L = position_ids_L >= prefix_len
        with torch.no_grad():
            cache = DynamicCache(config=model.config)
            prefix_pos = position_ids_L[None, :prefix_len]
            prefix = model.embed_tokens(input_ids_L[None, :prefix_len])
            prefix_pe = model.rotary_emb(prefix, position_ids=prefix_pos)
            for layer in layers[:frozen]:
                prefix = layer(prefix, attention_mask=None, position_ids=prefix_pos, past_key_values=cache, use_cache=True,
                               position_embeddings=prefix_pe)
            suffix_pos = position_ids_L[in_suffix_L][None]
            suffix = model.embed_tokens(input_ids_L[in_suffix_L][None])
            suffix_pe = model.rotary_emb(suffix, position_ids=suffix_pos)
            for layer in layers[:frozen]:
                # The cache appends the suffix keys to the prefix's: attention sees [prefix ; row].
                suffix = layer(suffix, attention_mask=None, position_ids=suffix_pos, past_key_values=cache, use_cache=True,
                               position_embeddings=suffix_pe)
            hidden = suffix.new_empty((1, input_ids_L.shape[0], suffix.shape[-1]))
            hidden[0, in_suffix_L] = suffix[0]
            hidden[0, ~in_suffix_L] = prefix[0, position_ids_L[~in_suffix_L]]
        positions = position_ids_L[None]
        pe = model.rotary_emb(hidden, position_ids=positions)
        for layer in layers[frozen:]:
            hidden = layer(hidden, attention_mask=None, position_ids=positions, past_key_values=None, use_cache=False,
                           position_embeddings=pe)
        return model.norm(hidden)
