import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import bottleneck as bn


def np_mixture(component_log_probs, log_weights):
    p = np.exp(np.asarray(component_log_probs, np.float64))
    w = np.exp(np.asarray(log_weights, np.float64))
    return np.log(np.sum(w[..., None] * p, axis=-2))


def _random_mixture(key, shape, num_components, vocab):
    k1, k2 = jax.random.split(key)
    components = bn.log_softmax(3.0 * jax.random.normal(k1, (*shape, num_components, vocab)))
    log_weights = bn.log_softmax(jax.random.normal(k2, (*shape, num_components)))
    return components, log_weights


def test_matches_probability_space_reference():
    components, log_weights = _random_mixture(jax.random.key(0), (4, 3), 5, 17)
    got = jax.jit(bn.mixture_log_probs)(components, log_weights)
    chex.assert_shape(got, (4, 3, 17))
    np.testing.assert_allclose(got, np_mixture(components, log_weights), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(jnp.sum(jnp.exp(got), -1), 1.0, atol=1e-5)


def test_vmap_and_broadcast_weights():
    components, log_weights = _random_mixture(jax.random.key(1), (6,), 3, 8)
    chex.assert_trees_all_close(
        jax.vmap(bn.mixture_log_probs)(components, log_weights),
        bn.mixture_log_probs(components, log_weights),
        atol=1e-6,
    )
    shared = log_weights[0]
    np.testing.assert_allclose(
        bn.mixture_log_probs(components, shared), np_mixture(components, shared[None]), atol=1e-5
    )


def test_single_component_and_degenerate_weights():
    components, _ = _random_mixture(jax.random.key(2), (), 2, 9)
    np.testing.assert_allclose(
        bn.mixture_log_probs(components[:1], jnp.zeros(1)), components[0], atol=1e-6
    )
    only_second = jnp.array([-jnp.inf, 0.0])
    np.testing.assert_allclose(
        bn.mixture_log_probs(components, only_second), components[1], atol=1e-6
    )


def test_confident_components_stay_exact_in_log_space():
    """Log-probabilities far below log(1e-8) survive (the reference MoS code floors them)."""
    components = jnp.array([[0.0, -2e4, -1e4], [-3e4, 0.0, -1e4]])
    log_weights = jnp.log(jnp.array([0.5, 0.5]))
    got = jax.jit(bn.mixture_log_probs)(components, log_weights)
    np.testing.assert_allclose(got, [jnp.log(0.5), jnp.log(0.5), -1e4], rtol=1e-6)
    grads = jax.grad(lambda c, w: bn.mixture_log_probs(c, w)[2], argnums=(0, 1))(
        components, log_weights
    )
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in grads)


def test_mixture_rank_exceeds_single_softmax_bound():
    """Yang et al.: a mixture of softmaxes escapes the d + 1 rank bound of one softmax."""
    dim, num_components = 4, 3
    with jax.enable_x64(True):

        @jax.jit  # one compile, not op-by-op dispatch
        def ranks(key):
            keys = jax.random.split(key, 3)
            hidden = jax.random.normal(keys[0], (num_components, 80, dim), jnp.float64)
            decoder = jax.random.normal(keys[1], (40, dim), jnp.float64)
            components = bn.log_softmax(hidden @ decoder.T)  # [K, N, M]
            log_weights = bn.log_softmax(
                jax.random.normal(keys[2], (80, num_components), jnp.float64)
            )
            mixed = bn.mixture_log_probs(jnp.swapaxes(components, 0, 1), log_weights)
            return bn.numerical_rank(components[0]), bn.numerical_rank(mixed)

        single, mixture = ranks(jax.random.key(3))
        assert int(single) == dim + 1
        assert int(mixture) > dim + 1


@pytest.mark.parametrize(
    "components, log_weights, message",
    [
        (
            jnp.zeros((2, 3, 5)),
            jnp.zeros((2, 4)),
            r"log_weights must have shape \[\.\.\., K\] with K = 3",
        ),
        (jnp.zeros((5,)), jnp.zeros((1,)), r"component_log_probs must have shape \[\.\.\., K, M\]"),
        (jnp.zeros((2, 3, 5)), jnp.zeros((4, 3)), "do not broadcast"),
        (
            jnp.zeros((3, 5), jnp.int32),
            jnp.zeros((3,)),
            "component_log_probs must have a floating dtype",
        ),
    ],
)
def test_bad_shapes_raise(components, log_weights, message):
    with pytest.raises(ValueError, match=message):
        bn.mixture_log_probs(components, log_weights)


@pytest.mark.parametrize("axis", [2, -2, 1, -3])
def test_vocabulary_on_any_axis(axis):
    """Components just before the vocabulary axis; equal to the axis=-1 result on moved axes."""
    keys = jax.random.split(jax.random.key(4), 2)
    components = bn.log_softmax(jax.random.normal(keys[0], (2, 3, 7, 5)), axis=-1)  # [B, T, K, M]
    log_weights = bn.log_softmax(jax.random.normal(keys[1], (2, 3, 7)), axis=-1)  # [B, T, K]
    want = bn.mixture_log_probs(components, log_weights)  # [B, T, M]
    vocab = axis % 4
    # Move (K, M) to (vocab - 1, vocab), and K to vocab - 1 in the weights.
    moved = jnp.moveaxis(components, (2, 3), (vocab - 1, vocab))
    moved_weights = jnp.moveaxis(log_weights, 2, vocab - 1)
    got = jax.jit(bn.mixture_log_probs, static_argnums=2)(moved, moved_weights, axis)
    np.testing.assert_allclose(got, jnp.moveaxis(want, -1, vocab - 1), rtol=1e-6, atol=1e-6)
    grad = lambda f, *a: jax.grad(lambda c, w: jnp.sum(jnp.sin(f(c, w, *a))), argnums=(0, 1))  # noqa: E731
    # One compile for both gradients, rather than op-by-op dispatch.
    got_grads, want_grads = jax.jit(
        lambda: (
            grad(bn.mixture_log_probs, axis)(moved, moved_weights),
            grad(bn.mixture_log_probs)(components, log_weights),
        )
    )()
    np.testing.assert_allclose(
        got_grads[0], jnp.moveaxis(want_grads[0], (2, 3), (vocab - 1, vocab)), rtol=1e-5, atol=1e-6
    )
    np.testing.assert_allclose(
        got_grads[1], jnp.moveaxis(want_grads[1], 2, vocab - 1), rtol=1e-5, atol=1e-6
    )


def test_vocabulary_axis_with_broadcast_weights():
    components = bn.log_softmax(jax.random.normal(jax.random.key(5), (2, 3, 5, 4)), axis=2)
    log_weights = bn.log_softmax(jax.random.normal(jax.random.key(6), (3, 4)), axis=0)  # [K, T]
    got = bn.mixture_log_probs(components, log_weights, axis=2)  # [B, M, T]
    want = bn.mixture_log_probs(jnp.moveaxis(components, 3, 1), log_weights.T)  # [B, T, M]
    np.testing.assert_allclose(got, jnp.moveaxis(want, 1, 2), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "components, log_weights, axis, message",
    [
        (jnp.zeros((3, 5)), jnp.zeros((3,)), 2, "axis 2 is out of range for component_log_probs"),
        (jnp.zeros((3, 5)), jnp.zeros((5,)), 0, "components K just before the vocabulary axis 0"),
        (
            jnp.zeros((2, 3, 5)),
            jnp.zeros((3, 5)),
            1,
            r"log_weights must have shape \[\.\.\., K, 5\] with K = 2",
        ),
        (jnp.zeros((0, 5)), jnp.zeros((0,)), -1, r"at least one component \(K >= 1\)"),
    ],
)
def test_bad_axis_raises(components, log_weights, axis, message):
    with pytest.raises(ValueError, match=message):
        bn.mixture_log_probs(components, log_weights, axis=axis)


def np_tree_gated_logits(z, pre):
    """sum_k pi_k z_k in float64 with pi_k the product of the gates on leaf k's heap path."""
    z, pre = np.asarray(z, np.float64), np.asarray(pre, np.float64)
    num_leaves = z.shape[-2]
    depth = num_leaves.bit_length() - 1
    gate = 1.0 / (1.0 + np.exp(-pre))  # [..., K - 1, M]
    total = np.zeros(z.shape[:-2] + z.shape[-1:])
    for leaf in range(num_leaves):
        node, weight = 1, 1.0
        for level in range(depth):
            bit = (leaf >> (depth - 1 - level)) & 1
            weight = weight * (1.0 - gate[..., node - 1, :] if bit else gate[..., node - 1, :])
            node = 2 * node + bit
        total = total + weight * z[..., leaf, :]
    return total


@pytest.mark.parametrize("num_leaves", [1, 2, 4, 8])
def test_sigmoid_tree_gated_logits_match_the_path_products(num_leaves):
    k1, k2 = jax.random.split(jax.random.key(num_leaves))
    z = 4.0 * jax.random.normal(k1, (3, 5, num_leaves, 11))
    pre = 2.0 * jax.random.normal(k2, (3, 5, num_leaves - 1, 11))
    got = jax.jit(bn.mixtures.sigmoid_tree_gated_logits)(z, pre)
    chex.assert_shape(got, (3, 5, 11))
    np.testing.assert_allclose(got, np_tree_gated_logits(z, pre), rtol=1e-5, atol=1e-5)
    composed = bn.mixtures.gated_logits(z, bn.mixtures.sigmoid_tree_log_weights(pre, axis=-2))
    np.testing.assert_allclose(got, composed, rtol=1e-5, atol=1e-5)


def test_sigmoid_tree_gated_logits_gradients_in_both_modes():
    """The fused tree against autodiff of the composition (weights, then gated_logits), in
    reverse mode (grad) and forward mode (jacfwd, which Mixtape's Jacobian diagnostics use)."""
    k1, k2, k3 = jax.random.split(jax.random.key(5), 3)
    z = 3.0 * jax.random.normal(k1, (6, 8, 7))
    pre = 2.0 * jax.random.normal(k2, (6, 7, 7))
    cotangent = jax.random.normal(k3, (6, 7))
    fused = lambda z, pre: bn.mixtures.sigmoid_tree_gated_logits(z, pre)  # noqa: E731

    def composed(z, pre):
        log_weights = bn.mixtures.sigmoid_tree_log_weights(pre, axis=-2)
        return bn.mixtures.gated_logits(z, log_weights)

    @jax.jit  # one compile for every derivative below, rather than op-by-op dispatch
    def derivatives(z, pre):
        grads = [
            jax.grad(lambda z, p, f=f: jnp.sum(cotangent * f(z, p)), (0, 1))(z, pre)
            for f in (fused, composed)
        ]
        jacobians = [
            (jax.jacfwd(fused, a)(z, pre), jax.jacrev(composed, a)(z, pre)) for a in (0, 1)
        ]
        # Broadcast inputs get the summed gradient, as any broadcast.
        shared_pre = pre[:1]
        broadcast = (
            jax.grad(lambda p: jnp.sum(cotangent * fused(z, p)))(shared_pre),
            jax.grad(lambda p: jnp.sum(cotangent * composed(z, jnp.broadcast_to(p, pre.shape))))(
                shared_pre
            ),
        )
        return grads, jacobians, broadcast

    grads, jacobians, (got, want) = derivatives(z, pre)
    for f_grad, g_grad in zip(*grads, strict=True):
        np.testing.assert_allclose(f_grad, g_grad, rtol=1e-5, atol=1e-5)
    for forward, reverse in jacobians:
        np.testing.assert_allclose(forward, reverse, atol=1e-5)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_sigmoid_tree_gated_logits_stay_finite_at_extreme_inputs():
    """Logits and gate pre-activations up to |1e4|: saturated gates pick one subtree exactly,
    and neither the values nor the gradients overflow."""
    z = jnp.array([[1e4, -1e4], [-1e4, 1e4], [3.0, -2.0], [0.5, 7.0]])  # K = 4, M = 2
    pre = jnp.array([[1e4, -1e4], [-1e4, 1e4], [0.0, 1e4]])
    got = bn.mixtures.sigmoid_tree_gated_logits(z, pre)
    # column 0: root left, node 2 right -> z_2 = -1e4; column 1: root right, node 3 left -> z_3.
    np.testing.assert_array_equal(got, jnp.array([-1e4, -2.0]))
    grads = jax.grad(lambda z, p: jnp.sum(bn.mixtures.sigmoid_tree_gated_logits(z, p)), (0, 1))(
        z, pre
    )
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in grads)
    np.testing.assert_array_equal(grads[0], jnp.array([[0, 0], [1, 0], [0, 1], [0, 0.0]]))


def test_sigmoid_tree_gated_logits_axis_dtype_and_vmap():
    z = jax.random.normal(jax.random.key(0), (4, 9, 3))  # components on axis 0
    pre = jax.random.normal(jax.random.key(1), (3, 9, 3))
    got = bn.mixtures.sigmoid_tree_gated_logits(z, pre, axis=0)
    want = bn.mixtures.sigmoid_tree_gated_logits(jnp.moveaxis(z, 0, -2), jnp.moveaxis(pre, 0, -2))
    np.testing.assert_allclose(got, want, rtol=1e-6)
    low = bn.mixtures.sigmoid_tree_gated_logits(z.astype(jnp.bfloat16), pre.astype(jnp.bfloat16), 0)
    assert low.dtype == jnp.float32
    mapped = jax.vmap(bn.mixtures.sigmoid_tree_gated_logits, in_axes=(2, 2), out_axes=1)(z, pre)
    np.testing.assert_allclose(mapped, got, rtol=1e-6)


@pytest.mark.parametrize(
    "z_shape, pre_shape, message",
    [
        ((2, 3, 5), (2, 2, 5), r"K a power of two, got 2 gates \(K = 3\)"),
        ((2, 4, 5), (2, 2, 5), "must have K - 1 = 3 gates on axis -2 for K = 4"),
        ((2, 4, 5), (3, 3, 5), "do not broadcast outside axis -2"),
        ((5,), (4,), r"component_logits must have shape \[..., K, M\], got shape \(5,\)"),
    ],
)
def test_sigmoid_tree_gated_logits_bad_shapes_raise(z_shape, pre_shape, message):
    with pytest.raises(ValueError, match=message):
        bn.mixtures.sigmoid_tree_gated_logits(jnp.zeros(z_shape), jnp.zeros(pre_shape))
