"""Mixtures of normalized distributions in log space: MoS (Yang et al. 2018), MoSS (Kanai et al.)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from bottleneck._checks import compute_dtype, require_float, require_ndim


def mixture_log_probs(component_log_probs: jax.Array, log_weights: jax.Array) -> jax.Array:
    r"""Log-probabilities of a mixture of ``K`` categorical distributions.

    .. math:: \log p(x) = \log \sum_{k=1}^{K} \pi_k\, p_k(x)
              = \operatorname{logsumexp}_k\big(\log \pi_k + \log p_k(x)\big)

    Computed entirely in log space with the per-position maximum subtracted, never through
    probabilities: the reference MoS code's ``log(sum_k pi_k p_k + 1e-8)`` floors every
    log-probability at ``log 1e-8`` and underflows for confident components; this does neither.
    The rank of the result is not bounded by ``d + 1`` (Yang et al., Section 3).

    Args:
      component_log_probs: ``[..., K, M]`` log-probabilities of each component (each row
        normalized over ``M``).
      log_weights: ``[..., K]`` log mixture weights (normalized over ``K``); leading
        dimensions must broadcast with those of ``component_log_probs``.

    Returns:
      ``[..., M]`` mixture log-probabilities, dtype at least float32.

    Example:
      >>> import jax.numpy as jnp, bottleneck as bn
      >>> comps = jnp.log(jnp.array([[0.9, 0.1], [0.1, 0.9]]))
      >>> mixed = bn.mixture_log_probs(comps, jnp.log(jnp.array([0.5, 0.5])))
      >>> [round(v, 4) for v in mixed.tolist()]
      [-0.6931, -0.6931]
    """
    require_float("component_log_probs", component_log_probs)
    require_float("log_weights", log_weights)
    require_ndim("component_log_probs", component_log_probs, 2, "[..., K, M]")
    require_ndim("log_weights", log_weights, 1, "[..., K]")
    num_components = jnp.shape(component_log_probs)[-2]
    if jnp.shape(log_weights)[-1] != num_components:
        raise ValueError(
            f"log_weights must have shape [..., K] with K = {num_components} (from "
            f"component_log_probs {jnp.shape(component_log_probs)}), got {jnp.shape(log_weights)}"
        )
    try:
        jnp.broadcast_shapes(jnp.shape(component_log_probs)[:-2], jnp.shape(log_weights)[:-1])
    except ValueError as err:
        raise ValueError(
            f"leading dimensions of component_log_probs {jnp.shape(component_log_probs)} and "
            f"log_weights {jnp.shape(log_weights)} do not broadcast"
        ) from err
    dtype = compute_dtype(component_log_probs, log_weights)
    joint = component_log_probs.astype(dtype) + log_weights.astype(dtype)[..., None]
    peak = jax.lax.stop_gradient(jnp.max(joint, axis=-2, keepdims=True))
    return jnp.squeeze(peak, -2) + jnp.log(jnp.sum(jnp.exp(joint - peak), axis=-2))
