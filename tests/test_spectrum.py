import jax
import jax.numpy as jnp
import numpy as np
import pytest

import bottleneck as bn


def test_singular_values_match_numpy_descending():
    a = jax.random.normal(jax.random.key(0), (2, 7, 5))
    got = jax.jit(bn.singular_values)(a)
    want = np.linalg.svd(np.asarray(a, np.float64), compute_uv=False)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    assert bool(jnp.all(jnp.diff(got, axis=-1) <= 0))


@pytest.mark.parametrize("rank", [1, 3, 6])
def test_numerical_rank_of_low_rank_products(rank):
    k1, k2 = jax.random.split(jax.random.key(rank))
    a = jax.random.normal(k1, (40, rank)) @ jax.random.normal(k2, (rank, 30))
    assert int(jax.jit(bn.numerical_rank)(a)) == rank
    assert int(bn.numerical_rank(jnp.zeros((4, 4)))) == 0


def test_numerical_rank_default_tolerance_is_numerical_recipes():
    s = np.array([1.0, 1e-3, 3e-6, 1e-7], np.float32)
    a = jnp.diag(jnp.asarray(s))
    tol = 0.5 * np.sqrt(4 + 4 + 1) * 1.0 * np.finfo(np.float32).eps  # 1.79e-7
    assert int(bn.numerical_rank(a)) == int(np.sum(s > tol)) == 3
    assert int(bn.numerical_rank(a, tol=1e-4)) == 2


def test_effective_rank_counts_energy():
    a = jnp.diag(jnp.array([3.0, 2.0, 1.0, 0.1]))  # squared: 9, 4, 1, 0.01
    assert int(bn.effective_rank(a, energy=0.6)) == 1
    assert int(bn.effective_rank(a, energy=0.9)) == 2
    assert int(bn.effective_rank(a, energy=0.99)) == 3
    assert int(bn.effective_rank(a, energy=1.0)) == 4
    with pytest.raises(ValueError, match="energy must be in"):
        bn.effective_rank(a, energy=0.0)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_ranks_of_a_non_finite_matrix_are_nan_not_a_count(bad):
    """A NaN or inf entry gives NaN singular values, which no comparison counts: the ranks
    read 0 (or 1) unless they say NaN. Per matrix of a batch, eagerly and under jit."""
    finite = jax.random.normal(jax.random.key(3), (6, 5))
    everywhere = jnp.full((6, 5), bad)
    one_entry = finite.at[2, 3].set(bad)
    batch = jnp.stack([finite, everywhere, one_entry])
    for rank in (bn.numerical_rank, bn.effective_rank, jax.jit(bn.numerical_rank)):
        got = np.asarray(rank(batch))
        assert got.dtype == np.float32 and got[0] == rank(finite) >= 4, got
        assert np.isnan(got[1:]).all(), got
    assert np.isnan(float(bn.numerical_rank(everywhere, tol=0.1)))
    assert np.isnan(float(jax.jit(bn.effective_rank)(one_entry)))
    with pytest.raises(ValueError, match="cannot convert float NaN to integer"):
        int(bn.numerical_rank(everywhere))  # a script's int(rank) stops, never prints 0


def test_ranks_are_whole_numbers_as_float32():
    a = jnp.diag(jnp.array([3.0, 2.0, 0.0]))
    for rank in (bn.numerical_rank(a), bn.effective_rank(a, energy=1.0)):
        assert rank.dtype == jnp.float32 and float(rank) == 2.0


def test_jacobian_singular_values_of_linear_map_and_relu_layer():
    k1, k2 = jax.random.split(jax.random.key(7))
    weights = jax.random.normal(k1, (6, 4))
    xs = jax.random.normal(k2, (5, 4))
    got = jax.jit(lambda xs: bn.jacobian_singular_values(lambda x: weights @ x, xs))(xs)
    np.testing.assert_allclose(got, np.linalg.svd(np.asarray(weights), compute_uv=False), rtol=1e-5)

    def relu_layer(x):
        return jax.nn.relu(weights @ x)

    per_input = [
        np.linalg.svd(
            np.asarray(weights) * (np.asarray(weights @ x) > 0)[:, None], compute_uv=False
        )
        for x in xs
    ]
    np.testing.assert_allclose(
        bn.jacobian_singular_values(relu_layer, xs), np.mean(per_input, 0), rtol=1e-5, atol=1e-6
    )


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match=r"a must have shape \[\.\.\., m, n\]"):
        bn.singular_values(jnp.ones(3))
    with pytest.raises(ValueError, match=r"xs must have shape \[num_inputs, n_in\]"):
        bn.jacobian_singular_values(jnp.tanh, jnp.ones(3))
