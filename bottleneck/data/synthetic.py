"""Ganea et al. 2019's synthetic task: N contexts with Dirichlet-sampled next-outcome laws.

Each context ``c_j`` gets a true distribution ``P*(. | c_j) ~ Dir(alpha 1_M)`` over ``M``
outcomes, sampled once. A model with a free embedding per context isolates the softmax
bottleneck from the context-embedding bottleneck: any misfit comes from the output layer.
Small ``alpha`` gives sparse, peaked laws (hard for a rank-(d+1) log-softmax).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from bottleneck.spectrum import effective_rank, numerical_rank


def dirichlet_targets(
    key: jax.Array, num_contexts: int, num_outcomes: int, alpha: float
) -> jax.Array:
    """True laws ``P* [num_contexts, num_outcomes]``, each row ``~ Dir(alpha 1)``, float32."""
    if num_contexts < 1 or num_outcomes < 2:
        raise ValueError(
            f"need num_contexts >= 1 and num_outcomes >= 2, got {num_contexts} and {num_outcomes}"
        )
    if not alpha > 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    concentration = jnp.full((num_outcomes,), alpha, jnp.float32)
    return jax.random.dirichlet(key, concentration, (num_contexts,))


def expected_cross_entropy(target_probs: jax.Array, log_probs: jax.Array) -> jax.Array:
    r"""Mean over contexts of :math:`-\sum_x P^*(x|c) \log P_\theta(x|c)`, the exact training loss.

    Args:
      target_probs: ``[N, M]`` true laws ``P*``.
      log_probs: ``[N, M]`` model log-probabilities.
    """
    return -jnp.mean(jnp.sum(target_probs * log_probs, axis=-1))


# Mode matching is an argmax: a context whose true mode's learned log-probability lies within this
# many nats of the best other outcome's may count either way under another summation order.
NEAR_TIE_NATS = 0.05


class SyntheticMetrics(NamedTuple):
    """What Ganea et al. report, plus the rank of the learned log-probability matrix."""

    mode_matching: jax.Array  # % of contexts with argmax P* == argmax P_theta
    cross_entropy: jax.Array  # expected CE, nats
    kl: jax.Array  # mean KL(P* || P_theta), nats
    numerical_rank: jax.Array
    effective_rank: jax.Array
    # contexts whose |log P_theta(true mode) - max over the other outcomes| < NEAR_TIE_NATS
    near_tied_modes: jax.Array


def synthetic_metrics(target_probs: jax.Array, log_probs: jax.Array) -> SyntheticMetrics:
    """Mode matching, cross-entropy, KL to ``P*`` and ranks of ``log P_theta`` ``[N, M]``."""
    if target_probs.shape != log_probs.shape:
        raise ValueError(
            f"log_probs must have the shape of target_probs {target_probs.shape}, got {log_probs.shape}"
        )
    cross_entropy = expected_cross_entropy(target_probs, log_probs)
    entropy = -jnp.mean(jnp.sum(jax.scipy.special.xlogy(target_probs, target_probs), axis=-1))
    true_mode = jnp.argmax(target_probs, -1)
    matches = true_mode == jnp.argmax(log_probs, -1)
    is_mode = jax.nn.one_hot(true_mode, log_probs.shape[-1], dtype=bool)
    at_mode = jnp.max(jnp.where(is_mode, log_probs, -jnp.inf), axis=-1)
    best_other = jnp.max(jnp.where(is_mode, -jnp.inf, log_probs), axis=-1)
    return SyntheticMetrics(
        mode_matching=100.0 * jnp.mean(matches.astype(jnp.float32)),
        cross_entropy=cross_entropy,
        kl=cross_entropy - entropy,
        numerical_rank=numerical_rank(log_probs),
        effective_rank=effective_rank(log_probs),
        near_tied_modes=jnp.sum(jnp.abs(at_mode - best_other) < NEAR_TIE_NATS),
    )
