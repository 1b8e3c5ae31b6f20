"""Mixtures: of normalized distributions in log space (MoS, Yang et al. 2018; MoSS, Kanai et al.)
and of logits under sigmoid-tree gates (Mixtape, Yang et al. 2019)."""

from __future__ import annotations

from collections.abc import Sequence

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


def sigmoid_tree_log_weights(pre_activations: jax.Array, axis: int = -1) -> jax.Array:
    r"""Log weights of ``K`` leaves from the ``K - 1`` sigmoid gates of a complete binary tree.

    Mixtape's sigmoid tree decomposition (Yang, Luong, Salakhutdinov & Le, NeurIPS 2019,
    Sec. 3.2): node ``n`` (heap order, root 1, children ``2n`` and ``2n + 1``) sends its mass
    left with probability ``gamma_n = sigma(l_n)``; a leaf's weight is the product along its
    path. For ``K = 4``:

    .. math::
       \pi_1 = \gamma_1 \gamma_2,\ \pi_2 = \gamma_1 (1 - \gamma_2),\
       \pi_3 = (1 - \gamma_1) \gamma_3,\ \pi_4 = (1 - \gamma_1)(1 - \gamma_3)

    computed in log space (``log sigma(l)`` and ``log sigma(-l)``), so the weights sum to 1
    exactly in value and need no normalizer: ``K - 1`` sigmoids replace a softmax over ``K``.

    Args:
      pre_activations: ``[..., K - 1, ...]`` gate pre-activations ``l``, the gates on ``axis``;
        ``K`` must be a power of two (a complete tree); ``K - 1 = 0`` gives one leaf of weight 1.
      axis: the gate axis.

    Returns:
      ``[..., K, ...]`` log weights ``log pi`` (normalized over ``axis``), dtype at least float32.

    Raises:
      ValueError: ``K - 1 + 1`` not a power of two.
    """
    require_float("pre_activations", pre_activations)
    pre = jnp.moveaxis(jnp.asarray(pre_activations), axis, -1)
    pre = pre.astype(compute_dtype(pre))
    num_leaves = _tree_leaves(pre.shape[-1])
    depth = num_leaves.bit_length() - 1
    left, right = jax.nn.log_sigmoid(pre), jax.nn.log_sigmoid(-pre)
    leaves = []
    for leaf in range(num_leaves):
        node, total = 1, jnp.zeros(pre.shape[:-1], pre.dtype)
        for level in range(depth):
            bit = (leaf >> (depth - 1 - level)) & 1
            total = total + (right if bit else left)[..., node - 1]
            node = 2 * node + bit
        leaves.append(total)
    return jnp.moveaxis(jnp.stack(leaves, axis=-1), -1, axis)


def gated_logits(component_logits: jax.Array, log_weights: jax.Array, axis: int = -2) -> jax.Array:
    r"""Mixtape's gated logits: the components' logits mixed per token by their gate priors.

    .. math:: \bar z_x = \sum_{k=1}^{K} \pi_{x,k}\, z_{k,x}

    (Yang et al. 2019, eq. 2 with ``z_{k,x} = h_k^\top w_x``): one softmax over ``\bar z``
    follows, unlike MoS's mixture of ``K`` softmaxes. Mixed in linear space: the weights are
    probabilities, and the logits are not exponentiated here.

    Args:
      component_logits: ``[..., K, M]`` logits of each component.
      log_weights: ``[..., K, M]`` log gate priors (normalized over ``K``), broadcastable.
      axis: the component axis (default ``-2``).

    Returns:
      ``[..., M]`` gated logits, dtype at least float32.
    """
    dtype = compute_dtype(component_logits, log_weights)
    weights = jnp.exp(jnp.asarray(log_weights).astype(dtype))
    return jnp.sum(weights * jnp.asarray(component_logits).astype(dtype), axis=axis)


def sigmoid_tree_gated_logits(
    component_logits: jax.Array, pre_activations: jax.Array, axis: int = -2
) -> jax.Array:
    r"""Mixtape's gated logits under sigmoid-tree gates, fused into one pass up the tree.

    Equal (to round-off) to ``gated_logits(component_logits, sigmoid_tree_log_weights(
    pre_activations, axis), axis)``, i.e. :math:`\bar z_x = \sum_k \pi_{x,k} z_{k,x}` with the
    tree's leaf weights (Yang et al. 2019, Sec. 3.2), computed bottom-up: each gate ``n`` mixes
    its two subtrees' values ``a_n`` (left) and ``b_n`` (right),

    .. math:: v_n = \sigma(l_n)\, a_n + \sigma(-l_n)\, b_n = b_n + \sigma(l_n)\,(a_n - b_n),
              \qquad \bar z = v_1,

    one sigmoid per gate and column (``K - 1``) instead of the log weights' ``2 (K - 1)``
    log-sigmoids and ``K`` exponentials, each component and gate an ``[..., M]`` slice, and
    differentiated by plain autodiff in both modes. Round-off: ``v_n`` is within a few ulps of
    ``max(|a_n|, |b_n|)``; a saturated gate (``sigma(l) = 1`` or ``0`` in float32) picks its
    subtree exactly. The gate's derivative ``sigma(l) (1 - sigma(l)) (a_n - b_n)`` keeps its
    relative precision for ``l < 0`` and reads 0 once ``sigma(l)`` rounds to 1 (``l > 17``),
    where it is below ``4e-8 |a_n - b_n|``.

    Args:
      component_logits: ``[..., K, M]`` logits of each component, the components on ``axis``;
        ``K`` a power of two.
      pre_activations: ``[..., K - 1, M]`` gate pre-activations ``l`` in heap order (root 1,
        children ``2n`` and ``2n + 1``; ``gamma_n = sigma(l_n)`` goes left), the gates on
        ``axis``; every other dimension broadcasts with ``component_logits``'.
      axis: the component (and gate) axis (default ``-2``).

    Returns:
      ``[..., M]`` gated logits, dtype at least float32.

    Raises:
      ValueError: ``K`` not a power of two, or shapes that do not match as above.

    Example:
      >>> import jax.numpy as jnp, bottleneck as bn
      >>> z = jnp.array([[1.0], [2.0], [3.0], [4.0]])  # K = 4 components, M = 1
      >>> l = jnp.array([[0.0], [0.0], [0.0]])  # every gate 1/2: uniform weights 1/4
      >>> bn.mixtures.sigmoid_tree_gated_logits(z, l).tolist()
      [2.5]
    """
    require_float("component_logits", component_logits)
    require_float("pre_activations", pre_activations)
    require_ndim("component_logits", component_logits, 2, "[..., K, M]")
    require_ndim("pre_activations", pre_activations, 2, "[..., K - 1, M]")
    z_shape, pre_shape = jnp.shape(component_logits), jnp.shape(pre_activations)
    if not -len(z_shape) <= axis < len(z_shape) or not -len(pre_shape) <= axis < len(pre_shape):
        raise ValueError(
            f"axis {axis} is out of range for component_logits {z_shape} or pre_activations "
            f"{pre_shape}"
        )
    num_leaves, num_gates = z_shape[axis], pre_shape[axis]
    if num_gates != num_leaves - 1:
        raise ValueError(
            f"pre_activations must have K - 1 = {num_leaves - 1} gates on axis {axis} for "
            f"K = {num_leaves} components, got {num_gates} (shapes {pre_shape} and {z_shape})"
        )
    _tree_leaves(num_gates)
    try:
        rest = jnp.broadcast_shapes(_without(z_shape, axis), _without(pre_shape, axis))
    except ValueError as err:
        raise ValueError(
            f"component_logits {z_shape} and pre_activations {pre_shape} do not broadcast "
            f"outside axis {axis}"
        ) from err
    dtype = compute_dtype(component_logits, pre_activations)
    z, pre = jnp.asarray(component_logits), jnp.asarray(pre_activations)
    take = lambda x, i: jax.lax.index_in_dim(x, i, axis, keepdims=False).astype(dtype)  # noqa: E731
    return sigmoid_tree_mix(
        [jnp.broadcast_to(take(z, k), rest) for k in range(num_leaves)],
        [take(pre, n) for n in range(num_gates)],
    )


def sigmoid_tree_mix(
    component_logits: Sequence[jax.Array], pre_activations: Sequence[jax.Array]
) -> jax.Array:
    r""":func:`sigmoid_tree_gated_logits` of ``K`` component logits and ``K - 1`` gates given
    as sequences of arrays of one shape (the gates in heap order), unchecked.

    Mixtape's sigmoid tree (Yang et al. 2019, Sec. 3.2) bottom-up: gate ``n`` mixes its left and
    right subtrees' values, :math:`v_n = b_n + \sigma(l_n)(a_n - b_n)`, and the result is the
    root's :math:`v_1 = \sum_k \pi_k z_k`.

    Args:
      component_logits: ``K`` arrays ``[..., M]``, ``K`` a power of two.
      pre_activations: ``K - 1`` arrays ``[..., M]``, heap order (root first).

    Returns:
      ``[..., M]`` gated logits.

    For callers that compute each component's ``[..., M]`` logits by a product of its own:
    on XLA:CPU reading and writing the slices of one ``[..., K, M]`` array costs strided
    passes, and Mixtape's loss (value and gradients) ran 1.2-1.4x faster with ``K`` products
    and ``K - 1`` gate products of their own (``benchmarks/head_cost.py``).

    Example:
      >>> import jax.numpy as jnp, bottleneck as bn
      >>> z = [jnp.array([1.0]), jnp.array([2.0]), jnp.array([3.0]), jnp.array([4.0])]
      >>> l = [jnp.array([0.0]), jnp.array([0.0]), jnp.array([0.0])]  # uniform weights 1/4
      >>> bn.mixtures.sigmoid_tree_mix(z, l).tolist()
      [2.5]
    """
    values = list(component_logits)
    while len(values) > 1:  # leaves up to the root: level n holds heap nodes n .. 2n - 1
        nodes = len(values) // 2
        values = [
            values[2 * i + 1]
            + jax.nn.sigmoid(pre_activations[nodes - 1 + i]) * (values[2 * i] - values[2 * i + 1])
            for i in range(nodes)
        ]
    return values[0]


def _without(shape: tuple[int, ...], axis: int) -> tuple[int, ...]:
    axis = axis % len(shape)
    return shape[:axis] + shape[axis + 1 :]


def _tree_leaves(num_gates: int) -> int:
    """``K = num_gates + 1``, checked to be a power of two (a complete binary tree)."""
    num_leaves = num_gates + 1
    if num_leaves & (num_leaves - 1):
        raise ValueError(
            f"a sigmoid tree needs K - 1 gates with K a power of two, got {num_gates} gates "
            f"(K = {num_leaves})"
        )
    return num_leaves
