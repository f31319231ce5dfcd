"""The demonstration anchor: gold trajectories trained by likelihood beside each RL step.

With `anchor.coef` > 0 (LearnerConfig) every RL optimizer step adds, to the policy-gradient loss,
`anchor.coef` x the mean negative log-likelihood of the action tokens of a few gold demonstrations
(about `anchor.tokens_per_step` tokens, whole trajectories), read from `anchor_dir`: a spool folder
of demonstration groups (`agentrl train` writes the SFT cold start's there). The demonstrations are
taken in a seeded shuffled order and cycled, each once per pass (a step ends with its pass); a
learner that resumes at step k takes a new order seeded by (seed, k), so a restart does not repeat
the first steps' demonstrations. The likelihood is the policy's at `trainer.temperature`, the
sampling temperature the RL loss uses too (the logits are divided by it in the one forward): the
anchor holds the distribution the actor samples from.

Why: GRPO trains only on groups whose rewards differ, so questions the policy already answers right
carry no gradient, and updates from the questions it is still learning move them too; a KL term to
the SFT policy is too weak to hold them (the deciding token is one among many in a token-mean KL).
The anchor pulls towards the gold actions, not towards what SFT got wrong. It is InstructGPT's
pretraining-mix term with the cold start's demonstrations as the data. The runs that measured both
effects: docs/notes/recipe.md, "Demonstration anchor" (runs O, V, Y).
"""

from __future__ import annotations

import random
from pathlib import Path

from agentrl.learner.batching import Sample
from agentrl.learner.ledger import Spool


class Anchor:
    def __init__(self, samples: list[Sample], tokens_per_step: int, seed: int = 0):
        if not samples:
            raise ValueError("the anchor needs at least one demonstration")
        if tokens_per_step < 1:
            raise ValueError(f"anchor tokens_per_step={tokens_per_step} must be >= 1")
        self.samples = samples
        self.tokens_per_step = tokens_per_step
        self.seed = seed
        self.restart(0)

    def restart(self, step: int) -> None:
        """Begin a new order, seeded by (seed, `step`): the learner's step at start or resume."""
        self._rng = random.Random(f"{self.seed}-{step}")
        self._order: list[int] = []

    @classmethod
    def from_dir(cls, directory: str | Path, *, vocab_size: int, tokens_per_step: int, seed: int = 0) -> Anchor:
        """Every trajectory of the spooled groups in `directory`, through the receiver's checks."""
        path = Path(directory)
        if not path.is_dir():
            raise FileNotFoundError(f"anchor_dir {path}: no such folder (a spool of demonstration groups)")
        spool = Spool(path)
        samples = [Sample(gid, t.sample_index, t, None)
                   for gid in spool.pending() for t in spool.load(gid, vocab_size=vocab_size).trajectories
                   if t.is_action.any()]
        if not samples:
            raise ValueError(f"anchor_dir {path}: no demonstration with action tokens")
        return cls(samples, tokens_per_step, seed)

    def next_samples(self) -> list[Sample]:
        """Whole demonstrations, at least one, while they fit in `tokens_per_step` tokens; a step
        ends with its pass, so no step holds a demonstration twice."""
        taken, tokens = [], 0
        while not taken or (self._order and tokens + self._peek().num_tokens <= self.tokens_per_step):
            self._peek()
            sample = self.samples[self._order.pop()]
            taken.append(sample)
            tokens += sample.num_tokens
        return taken

    def _peek(self) -> Sample:
        if not self._order:
            self._order = list(range(len(self.samples)))
            self._rng.shuffle(self._order)
        return self.samples[self._order[-1]]
