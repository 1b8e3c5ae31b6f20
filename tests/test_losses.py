import jax
import jax.numpy as jnp
import numpy as np
import pytest

import bottleneck as bn


def test_cross_entropy_matches_reference():
    log_probs = bn.log_softmax(jax.random.normal(jax.random.key(0), (3, 4, 10)))
    labels = jax.random.randint(jax.random.key(1), (3, 4), 0, 10)
    got = jax.jit(bn.cross_entropy)(log_probs, labels)
    lp = np.asarray(log_probs, np.float64)
    want = -np.mean(np.take_along_axis(lp, np.asarray(labels)[..., None], -1))
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_cross_entropy_mask_ignores_positions():
    log_probs = bn.log_softmax(jax.random.normal(jax.random.key(2), (6, 5)))
    labels = jnp.array([0, 1, 2, 3, 4, 0])
    where = jnp.array([True, False, True, True, False, False])
    got = jax.jit(bn.cross_entropy)(log_probs, labels, where)
    want = bn.cross_entropy(log_probs[where], labels[where])
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert float(bn.cross_entropy(log_probs, labels, jnp.zeros(6, bool))) == 0.0
    grad = jax.grad(lambda lp: bn.cross_entropy(lp, labels, where))(log_probs)
    assert bool(jnp.all(grad[~where] == 0))


def test_cross_entropy_vmaps():
    log_probs = bn.log_softmax(jax.random.normal(jax.random.key(3), (4, 7, 9)))
    labels = jax.random.randint(jax.random.key(4), (4, 7), 0, 9)
    per_row = jax.vmap(bn.cross_entropy)(log_probs, labels)
    np.testing.assert_allclose(jnp.mean(per_row), bn.cross_entropy(log_probs, labels), rtol=1e-6)


@pytest.mark.parametrize(
    "labels, where, message",
    [
        (jnp.zeros((3,), jnp.int32), None, r"labels must have shape \(2,\)"),
        (jnp.zeros((2,)), None, "labels must have an integer dtype"),
        (jnp.zeros((2,), jnp.int32), jnp.ones((3,), bool), r"where must have shape \(2,\)"),
    ],
)
def test_cross_entropy_bad_arguments(labels, where, message):
    with pytest.raises(ValueError, match=message):
        bn.cross_entropy(jnp.zeros((2, 5)), labels, where)
