import jax
import jax.numpy as jnp
import numpy as np
import pytest

import bottleneck as bn
from bottleneck.data.synthetic import (
    NEAR_TIE_NATS,
    dirichlet_targets,
    expected_cross_entropy,
    synthetic_metrics,
)


def test_dirichlet_targets_are_distributions_and_sparse_for_small_alpha():
    sparse = dirichlet_targets(jax.random.key(0), 64, 200, 0.01)
    flat = dirichlet_targets(jax.random.key(0), 64, 200, 10.0)
    for probs in (sparse, flat):
        assert probs.shape == (64, 200) and bool(jnp.all(probs >= 0))
        np.testing.assert_allclose(jnp.sum(probs, -1), 1.0, atol=1e-5)
    assert float(jnp.mean(jnp.max(sparse, -1))) > 5 * float(jnp.mean(jnp.max(flat, -1)))
    np.testing.assert_array_equal(sparse, dirichlet_targets(jax.random.key(0), 64, 200, 0.01))


@pytest.mark.parametrize(
    "args, message",
    [
        ((0, 5, 0.1), "num_contexts >= 1"),
        ((3, 1, 0.1), "num_outcomes >= 2"),
        ((3, 5, 0.0), "alpha must be > 0"),
    ],
)
def test_dirichlet_bad_arguments(args, message):
    with pytest.raises(ValueError, match=message):
        dirichlet_targets(jax.random.key(0), *args)


def test_metrics_against_numpy():
    targets = dirichlet_targets(jax.random.key(1), 16, 12, 0.5)
    log_probs = bn.log_softmax(jax.random.normal(jax.random.key(2), (16, 12)))
    metrics = synthetic_metrics(targets, log_probs)
    p, lp = np.asarray(targets, np.float64), np.asarray(log_probs, np.float64)
    ce = -np.mean(np.sum(p * lp, -1))
    entropy = -np.mean(np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1)), 0), -1))
    np.testing.assert_allclose(metrics.cross_entropy, ce, rtol=1e-5)
    np.testing.assert_allclose(metrics.kl, ce - entropy, rtol=1e-4)
    np.testing.assert_allclose(metrics.mode_matching, 100 * np.mean(p.argmax(-1) == lp.argmax(-1)))
    assert int(metrics.numerical_rank) == int(bn.numerical_rank(log_probs))
    modes = p.argmax(-1)
    margins = np.abs(
        lp[np.arange(16), modes] - np.where(np.eye(12)[modes] > 0, -np.inf, lp).max(-1)
    )
    assert int(metrics.near_tied_modes) == int(np.sum(margins < NEAR_TIE_NATS))
    perfect = synthetic_metrics(targets, jnp.log(targets + 1e-30))
    assert float(perfect.mode_matching) == 100.0 and abs(float(perfect.kl)) < 1e-4
    np.testing.assert_allclose(expected_cross_entropy(targets, log_probs), ce, rtol=1e-5)


def test_near_tied_modes_counts_the_contexts_whose_match_could_flip():
    targets = jnp.array([[0.9, 0.1, 0.0], [0.2, 0.7, 0.1], [0.1, 0.1, 0.8]])
    log_probs = jnp.log(
        jnp.array([[0.50, 0.49, 0.01], [0.30, 0.40, 0.30], [0.45, 0.10, 0.45]])
    )  # margins at the true mode: 0.02, 0.29 and exactly 0 nats
    metrics = synthetic_metrics(targets, log_probs)
    assert int(metrics.near_tied_modes) == 2
    np.testing.assert_allclose(metrics.mode_matching, 100 * 2 / 3, rtol=1e-6)  # the tie: argmax 0
