"""Mixtures of normalized distributions in log space: MoS (Yang et al. 2018), MoSS (Kanai et al.)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from bottleneck._checks import compute_dtype, require_float, require_ndim


def mixture_log_probs(
    component_log_probs: jax.Array, log_weights: jax.Array, axis: int = -1
) -> jax.Array:
    r"""Log-probabilities of a mixture of ``K`` categorical distributions.

    .. math:: \log p(x) = \log \sum_{k=1}^{K} \pi_k\, p_k(x)
              = \operatorname{logsumexp}_k\big(\log \pi_k + \log p_k(x)\big)

    Computed entirely in log space with the per-position maximum subtracted, never through
    probabilities: the reference MoS code's ``log(sum_k pi_k p_k + 1e-8)`` floors every
    log-probability at ``log 1e-8`` and underflows for confident components; this does neither.
    The rank of the result is not bounded by ``d + 1`` (Yang et al., Section 3).

    Args:
      component_log_probs: ``[..., K, M]`` log-probabilities of each component (each row
        normalized over ``M``). With another ``axis`` the vocabulary ``M`` sits there and the
        components ``K`` just before it: ``[..., K, M, *rest]``.
      log_weights: ``[..., K]`` log mixture weights (normalized over ``K``), i.e.
        ``component_log_probs``'s shape without the vocabulary axis (``[..., K, *rest]``);
        leading dimensions must broadcast with those of ``component_log_probs``.
      axis: the vocabulary axis of ``component_log_probs`` (default ``-1``).

    Returns:
      ``[..., M]`` (``[..., M, *rest]``) mixture log-probabilities, dtype at least float32.

    Raises:
      ValueError: ``axis`` out of range or with no component axis before it, no components
        (``K = 0``), or shapes that do not match as above.

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
    ndim = jnp.ndim(component_log_probs)
    if not -ndim <= axis < ndim:
        raise ValueError(
            f"axis {axis} is out of range for component_log_probs with shape "
            f"{jnp.shape(component_log_probs)} (vocabulary axis)"
        )
    # Counted from the end, the vocabulary sits at `vocab` in the components and the component
    # axis at `vocab - 1`; in the weights (the components without the vocabulary axis) the
    # component axis is at `vocab`. Leading dimensions may differ (they broadcast).
    vocab = axis - ndim if axis >= 0 else axis
    if vocab - 1 < -ndim:
        raise ValueError(
            f"component_log_probs must have shape [..., K, M] with the components K just before "
            f"the vocabulary axis {axis}, got shape {jnp.shape(component_log_probs)}"
        )
    shape, weights_shape = jnp.shape(component_log_probs), jnp.shape(log_weights)
    num_components, rest = shape[vocab - 1], shape[ndim + vocab + 1 :]
    if weights_shape[max(len(weights_shape) + vocab, 0) :] != (num_components, *rest):
        expected = "[..., K]" if not rest else f"[..., K, {', '.join(map(str, rest))}]"
        raise ValueError(
            f"log_weights must have shape {expected} with K = {num_components} (from "
            f"component_log_probs {shape}, vocabulary axis {axis}), got {weights_shape}"
        )
    if num_components == 0:
        raise ValueError(
            f"component_log_probs must have at least one component (K >= 1), got shape {shape}"
        )
    component_log_probs = jnp.moveaxis(component_log_probs, (vocab - 1, vocab), (-2, -1))
    log_weights = jnp.moveaxis(log_weights, vocab, -1)
    try:
        jnp.broadcast_shapes(jnp.shape(component_log_probs)[:-2], jnp.shape(log_weights)[:-1])
    except ValueError as err:
        raise ValueError(
            f"leading dimensions of component_log_probs {shape} and log_weights "
            f"{weights_shape} do not broadcast"
        ) from err
    dtype = compute_dtype(component_log_probs, log_weights)
    joint = component_log_probs.astype(dtype) + log_weights.astype(dtype)[..., None]
    peak = jax.lax.stop_gradient(jnp.max(joint, axis=-2, keepdims=True))
    mixed = jnp.squeeze(peak, -2) + jnp.log(jnp.sum(jnp.exp(joint - peak), axis=-2))
    return jnp.moveaxis(mixed, -1, vocab)
