"""Batch shapes shared by the benchmarks: one training batch of Merity et al.'s AWD-LSTM."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Shape:
    """``batch x steps`` tokens of ``dim``-wide hidden states over a ``vocab``-word vocabulary."""

    name: str
    batch: int
    steps: int
    dim: int
    vocab: int

    @property
    def tokens(self) -> int:
        return self.batch * self.steps

    @property
    def full_logits_bytes(self) -> int:
        return self.tokens * self.vocab * 4


PTB = Shape("ptb", batch=20, steps=70, dim=400, vocab=10_000)
WT2 = Shape("wt2", batch=80, steps=70, dim=400, vocab=33_278)
