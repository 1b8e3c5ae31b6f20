"""Losses on log-probabilities."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from bottleneck._checks import as_compute, require_float, require_ndim


def _check_labels(log_probs: jax.Array, labels: jax.Array, where: jax.Array | None) -> None:
    require_float("log_probs", log_probs)
    require_ndim("log_probs", log_probs, 1, "[..., vocab]")
    if not jnp.issubdtype(jnp.asarray(labels).dtype, jnp.integer):
        raise ValueError(f"labels must have an integer dtype, got {jnp.asarray(labels).dtype}")
    if jnp.shape(labels) != jnp.shape(log_probs)[:-1]:
        raise ValueError(
            f"labels must have shape {jnp.shape(log_probs)[:-1]} (log_probs {jnp.shape(log_probs)} "
            f"without its vocab axis), got {jnp.shape(labels)}"
        )
    if where is not None and jnp.shape(where) != jnp.shape(labels):
        raise ValueError(
            f"where must have shape {jnp.shape(labels)} like labels, got {jnp.shape(where)}"
        )


def cross_entropy(
    log_probs: jax.Array, labels: jax.Array, where: jax.Array | None = None
) -> jax.Array:
    r"""Mean negative log-likelihood of integer labels over the unmasked positions.

    .. math:: \mathcal{L} = -\frac{1}{|\{n: w_n\}|} \sum_{n:\,w_n} \log p_n(y_n)

    Args:
      log_probs: ``[..., vocab]`` log-probabilities (any normalizer's output).
      labels: ``[...]`` integer targets in ``[0, vocab)``.
      where: optional ``[...]`` boolean mask; ``False`` positions are ignored (padding).
        With every position masked the loss is 0.

    Returns:
      Scalar float32 (or wider) mean NLL.

    Example:
      >>> import jax.numpy as jnp, bottleneck as bn
      >>> lp = bn.log_softmax(jnp.zeros((2, 4)))
      >>> round(float(bn.cross_entropy(lp, jnp.array([0, 3]))), 4)  # log 4
      1.3863
    """
    _check_labels(log_probs, labels, where)
    log_probs = as_compute(log_probs)
    picked = jnp.take_along_axis(log_probs, labels[..., None].astype(jnp.int32), axis=-1)[..., 0]
    if where is None:
        return -jnp.mean(picked)
    where = jnp.asarray(where, bool)
    total = jnp.sum(jnp.where(where, picked, jnp.zeros((), picked.dtype)))
    count = jnp.maximum(jnp.sum(where), 1).astype(picked.dtype)
    return -total / count
