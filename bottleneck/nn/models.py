"""Models built around an output head."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from bottleneck.nn.heads import OutputHead
from bottleneck.nn.presets import make_head
from bottleneck.sharding import DATA, axis_size, context_mesh


class ContextEmbeddingModel(nnx.Module):
    """A free embedding ``h_c`` per context followed by any head (Ganea et al.'s synthetic model).

    With one independent ``h_c in R^d`` per context there is no context-encoder bottleneck: the
    only limit on fitting ``P*(. | c)`` is the output layer, ``head(h_c)`` with a shared output
    embedding ``W [M, d]`` (+ bias).

    Args:
      num_contexts: ``N``.
      features: ``d``.
      num_outcomes: ``M``.
      head: a name from :data:`bottleneck.nn.HEAD_NAMES`.
      rngs: NNX random streams.
      head_options: passed to :func:`bottleneck.nn.make_head`.

    Built inside ``with jax.set_mesh(mesh)`` for a ``("data", "vocab")`` mesh, the contexts are
    sharded on ``data`` and the head is vocabulary-parallel on ``vocab``.
    """

    def __init__(
        self,
        num_contexts: int,
        features: int,
        num_outcomes: int,
        head: str,
        *,
        rngs: nnx.Rngs,
        **head_options,
    ):
        if num_contexts < 1 or features < 1:
            raise ValueError(
                f"num_contexts and features must be >= 1, got {num_contexts} and {features}"
            )
        sharded = {"out_sharding": (DATA, None)} if axis_size(context_mesh(), DATA) > 1 else {}
        self.contexts = nnx.Param(
            jax.random.normal(rngs.params(), (num_contexts, features), jnp.float32), **sharded
        )
        self.head: OutputHead = make_head(head, features, num_outcomes, rngs=rngs, **head_options)

    def __call__(self) -> jax.Array:
        """Log-probabilities ``[N, M]`` of every outcome in every context."""
        return self.head(self.contexts[...])
