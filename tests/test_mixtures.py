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
        keys = jax.random.split(jax.random.key(3), 3)
        hidden = jax.random.normal(keys[0], (num_components, 80, dim), jnp.float64)
        decoder = jax.random.normal(keys[1], (40, dim), jnp.float64)
        components = bn.log_softmax(hidden @ decoder.T)  # [K, N, M]
        log_weights = bn.log_softmax(jax.random.normal(keys[2], (80, num_components), jnp.float64))
        mixed = bn.mixture_log_probs(jnp.swapaxes(components, 0, 1), log_weights)
        assert int(bn.numerical_rank(components[0])) == dim + 1
        assert int(bn.numerical_rank(mixed)) > dim + 1


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
    got_grads = grad(bn.mixture_log_probs, axis)(moved, moved_weights)
    want_grads = grad(bn.mixture_log_probs)(components, log_weights)
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
