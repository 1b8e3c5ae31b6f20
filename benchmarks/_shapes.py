"""Batch shapes shared by the benchmarks: one training batch of Merity et al.'s AWD-LSTM."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from bottleneck import nn
from bottleneck.train.lm import Window


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


def random_window(vocab: int, batch: int, steps: int) -> Window:
    """A batch-major ``[batch, steps]`` window of uniform random ids (seed 0) and their next
    ids as targets: one training step's input for a stateless model."""
    tokens = np.random.default_rng(0).integers(0, vocab, (batch, steps + 1)).astype(np.int32)
    return Window(inputs=tokens[:, :-1], targets=tokens[:, 1:], length=np.int32(steps))


# The heads the head-cost benchmarks compare, as the study runs them: name -> (preset, options).
HEADS = {
    "softmax": ("softmax", {}),
    "sigsoftmax": ("sigsoftmax", {}),
    "plif": ("plif", {"num_knots": 10_000, "plif_noise": 1.0}),
    "mos": ("mos", {"num_components": 4, "latent": "linear"}),
    "mixtape": ("mixtape", {"num_components": 4}),
    "mixtape_shared": ("mixtape", {"num_components": 4}),  # + token_counts, shared_gate_below
}


def cost_head(
    name: str, d: int, vocab: int, counts: np.ndarray, shared_gate_below: float, **extra: Any
) -> nnx.Module:
    """The head ``HEADS[name]`` (seed 0); Mixtape shared takes its gates from ``counts``."""
    preset, options = HEADS[name]
    if name == "mixtape_shared":
        options = {**options, "token_counts": counts, "shared_gate_below": shared_gate_below}
    return nn.make_head(preset, d, vocab, rngs=nnx.Rngs(0), **options, **extra)


def loss_and_gradients(head: nnx.Module) -> tuple[Any, Any]:
    """``head.loss(h, labels)``'s value and gradients (for every parameter of the head and for
    ``h``) as one jitted function of ``(state, h, labels)``, and the head's state."""
    graphdef, state = nnx.split(head)

    def loss(state: Any, h: jax.Array, labels: jax.Array) -> jax.Array:
        return nnx.merge(graphdef, state).loss(h, labels)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1))), state


PTB = Shape("ptb", batch=20, steps=70, dim=400, vocab=10_000)
WT2 = Shape("wt2", batch=80, steps=70, dim=400, vocab=33_278)


def token_counts(data_dir: Path | None, vocab: int) -> tuple[np.ndarray, str]:
    """Training counts per word id: PTB's (``data_dir/ptb.train.txt``) or a Zipf law."""
    if data_dir is None:
        ranks = np.arange(1, vocab + 1)
        return np.floor(929_589 / (ranks * np.log(1.78 * vocab))).astype(np.int64), "zipf"
    words: dict[str, int] = {}
    counts: list[int] = []
    path = Path(data_dir) / "ptb.train.txt"
    if not path.is_file():
        raise SystemExit(f"--data_dir: no ptb.train.txt in {data_dir}")
    for line in path.read_text().splitlines():
        for word in [*line.split(), "<eos>"]:
            index = words.setdefault(word, len(words))
            if index == len(counts):
                counts.append(0)
            counts[index] += 1
    if len(counts) != vocab:
        raise SystemExit(f"--data_dir: expected {vocab} words in ptb.train.txt, got {len(counts)}")
    return np.asarray(counts, np.int64), "ptb"
