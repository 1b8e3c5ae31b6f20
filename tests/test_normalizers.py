import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import bottleneck as bn


def _np_log_normalize(log_g, axis):
    log_g = np.asarray(log_g, np.float64)
    m = log_g.max(axis=axis, keepdims=True)
    return log_g - m - np.log(np.exp(log_g - m).sum(axis=axis, keepdims=True))


def _np_log_sigmoid(z):
    return -np.logaddexp(0.0, -z)


# float64 NumPy references, written from the papers' definitions (Kanai eqs. 1, 11, 34, 35).
REFERENCES = {
    bn.log_softmax: lambda z, axis: _np_log_normalize(z, axis),
    bn.log_sigsoftmax: lambda z, axis: _np_log_normalize(z + _np_log_sigmoid(z), axis),
    bn.log_sigmoid_normalizer: lambda z, axis: _np_log_normalize(_np_log_sigmoid(z), axis),
    bn.log_relu_normalizer: lambda z, axis: np.log(
        (np.maximum(z, 0) + 1e-8) / (np.maximum(z, 0) + 1e-8).sum(axis=axis, keepdims=True)
    ),
}
NORMALIZERS = list(REFERENCES)
IDS = [f.__name__ for f in NORMALIZERS]


@pytest.mark.parametrize("normalizer", NORMALIZERS, ids=IDS)
@pytest.mark.parametrize("axis", [-1, 1])
def test_matches_float64_reference(normalizer, axis):
    z = 3.0 * jax.random.normal(jax.random.key(0), (3, 6, 5))
    got = jax.jit(normalizer, static_argnames="axis")(z, axis=axis)
    chex.assert_shape(got, z.shape)
    want = REFERENCES[normalizer](np.asarray(z, np.float64), axis)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("normalizer", NORMALIZERS, ids=IDS)
def test_vmap_matches_batched_call(normalizer):
    z = jax.random.normal(jax.random.key(1), (4, 3, 11))
    chex.assert_trees_all_close(jax.vmap(normalizer)(z), jax.jit(normalizer)(z), atol=1e-6)


EXTREME_ROWS = jnp.array(
    [
        [1e4, -1e4, 0.0, 3.0, -1e4, 1e4],
        [-1e4] * 6,
        [1e4] * 6,
        [1e4, -1e4] * 3,
        [-1e4, -9999.0, -1e4, 1.0, 0.0, -0.5],
    ],
    jnp.float32,
)


@pytest.mark.parametrize("normalizer", NORMALIZERS, ids=IDS)
def test_extreme_logits_finite_values_and_gradients(normalizer):
    log_probs = jax.jit(normalizer)(EXTREME_ROWS)
    assert bool(jnp.all(jnp.isfinite(log_probs)))
    np.testing.assert_allclose(jnp.sum(jnp.exp(log_probs), -1), 1.0, atol=1e-5)
    labels = jnp.arange(EXTREME_ROWS.shape[0]) % EXTREME_ROWS.shape[1]
    grads = jax.jit(jax.grad(lambda z: bn.cross_entropy(normalizer(z), labels)))(EXTREME_ROWS)
    assert bool(jnp.all(jnp.isfinite(grads)))


@pytest.mark.parametrize("normalizer", NORMALIZERS, ids=IDS)
def test_normalized_and_ranking_preserved(normalizer):
    z = 5.0 * jax.random.normal(jax.random.key(2), (64, 50))
    log_probs = jax.jit(normalizer)(z)
    np.testing.assert_allclose(jnp.sum(jnp.exp(log_probs), -1), 1.0, atol=1e-5)
    # Every g here is monotone increasing, so f is a smoothed argmax of z (Kanai Sec. 3.2).
    # The ReLU normalizer is only non-decreasing: it ties all negative logits.
    positive_max = jnp.max(z, -1) > 0
    np.testing.assert_array_equal(
        jnp.argmax(log_probs, -1)[positive_max], jnp.argmax(z, -1)[positive_max]
    )


@pytest.mark.parametrize("normalizer", NORMALIZERS, ids=IDS)
def test_bfloat16_inputs_reduce_in_float32(normalizer):
    z16 = (4.0 * jax.random.normal(jax.random.key(3), (8, 300))).astype(jnp.bfloat16)
    got = jax.jit(normalizer)(z16)
    assert got.dtype == jnp.float32
    want = normalizer(z16.astype(jnp.float32))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("normalizer", NORMALIZERS, ids=IDS)
def test_integer_logits_rejected(normalizer):
    with pytest.raises(ValueError, match="z must have a floating dtype"):
        normalizer(jnp.arange(4))


@pytest.mark.parametrize("eps", [0.0, -1e-8, float("inf"), float("nan")])
def test_relu_eps_must_be_positive_and_finite(eps):
    """eps = inf made every score infinite and every log-probability NaN, silently."""
    with pytest.raises(ValueError, match="eps must be > 0 and finite"):
        bn.log_relu_normalizer(jnp.zeros(3), eps=eps)


@pytest.mark.parametrize(
    "normalizer", [*NORMALIZERS, bn.log_normalize], ids=[*IDS, "log_normalize"]
)
@pytest.mark.parametrize("shape, axis", [((2, 0), -1), ((0,), 0), ((3, 0, 2), 1)])
def test_empty_vocabulary_raises(normalizer, shape, axis):
    """No distribution over an empty vocabulary: a clear error naming the axis."""
    with pytest.raises(
        ValueError, match=rf"must have a non-empty vocabulary axis \(axis {axis % len(shape)}\)"
    ):
        normalizer(jnp.zeros(shape), axis=axis)
    normalizer(jnp.zeros((0, 3)), axis=-1)  # an empty batch is fine


@pytest.mark.parametrize("normalizer", NORMALIZERS, ids=IDS)
def test_axis_out_of_range_raises(normalizer):
    with pytest.raises(
        ValueError, match=r"axis 2 is out of range for log_scores with shape \(4, 3\)"
    ):
        normalizer(jnp.zeros((4, 3)), axis=2)


def _low_rank_logits(num_contexts, vocab, dim, key):
    k1, k2 = jax.random.split(key)
    hidden = jax.random.normal(k1, (num_contexts, dim), jnp.float64)
    decoder = jax.random.normal(k2, (vocab, dim), jnp.float64)
    return hidden @ decoder.T


def test_theorem_2_log_softmax_rank_bounded_sigsoftmax_not():
    """Kanai Theorem 2 / Yang et al.: rank(log_softmax(H W^T)) <= d + 1; sigsoftmax exceeds it."""
    dim = 8
    with jax.enable_x64(True):
        logits = _low_rank_logits(120, 60, dim, jax.random.key(4))
        softmax_rank = int(bn.numerical_rank(jax.jit(bn.log_softmax)(logits)))
        sigsoftmax_rank = int(bn.numerical_rank(jax.jit(bn.log_sigsoftmax)(logits)))
        sigmoid_rank = int(bn.numerical_rank(jax.jit(bn.log_sigmoid_normalizer)(logits)))
    assert softmax_rank == dim + 1
    assert sigsoftmax_rank > dim + 1
    assert sigmoid_rank > dim + 1


def test_theorem_4_sigsoftmax_tends_to_softmax_under_constant_shift():
    """Kanai Theorem 4 (eq. 17): sigsoftmax(z + k 1) -> softmax(z) as k -> +inf."""
    # float64: in float32 the rounding of z + 20 alone (ulp 2e-6) hides the e^-20 limit error.
    with jax.enable_x64(True):
        z = jax.random.normal(jax.random.key(5), (4, 30), jnp.float64)
        softmax = bn.log_softmax(z)
        errors = [
            float(jnp.max(jnp.abs(jax.jit(bn.log_sigsoftmax)(z + k) - softmax)))
            for k in (0.0, 5.0, 10.0, 20.0)
        ]
    assert errors == sorted(errors, reverse=True)
    assert errors[0] > 0.1
    assert errors[-1] < 1e-7


@pytest.mark.parametrize(
    "normalizer, factor",
    [
        (bn.log_sigsoftmax, lambda z: 2.0 - jax.nn.sigmoid(z)),  # Kanai Theorem 5
        (bn.log_sigmoid_normalizer, lambda z: 1.0 - jax.nn.sigmoid(z)),  # Appendix B.2
        (bn.log_softmax, lambda z: jnp.ones_like(z)),  # eq. 2
    ],
    ids=["sigsoftmax", "sigmoid", "softmax"],
)
def test_gradient_formula(normalizer, factor):
    """d log f_i / d z_j = (1[i = j] - f_j) * c(z_j), with c = 2 - sigma for sigsoftmax."""
    z = 2.0 * jax.random.normal(jax.random.key(6), (7,))
    jacobian = jax.jit(jax.jacobian(normalizer))(z)
    probs = jnp.exp(normalizer(z))
    want = (jnp.eye(7) - probs[None, :]) * factor(z)[None, :]
    np.testing.assert_allclose(jacobian, want, atol=1e-6)


def test_log_normalize_with_any_scores():
    scores = jnp.array([[0.0, jnp.log(3.0)], [-5.0, -5.0]])
    np.testing.assert_allclose(
        jnp.exp(bn.log_normalize(scores)), [[0.25, 0.75], [0.5, 0.5]], atol=1e-7
    )


def test_log_sigmoid_matches_jax_in_value_and_gradient():
    from bottleneck.normalizers import _log_sigmoid

    z = jnp.array([-1e4, -100.0, -20.0, -1.0, -1e-7, 0.0, 1e-7, 1.0, 20.0, 100.0, 1e4])
    np.testing.assert_allclose(_log_sigmoid(z), jax.nn.log_sigmoid(z), rtol=1e-6, atol=1e-30)
    grad = jax.vmap(jax.grad(_log_sigmoid))(z)
    np.testing.assert_allclose(grad, jax.nn.sigmoid(-z), rtol=1e-6, atol=1e-30)
