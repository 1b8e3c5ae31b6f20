"""Dynamic evaluation: the update against a hand computation, the statistics, and that it adapts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bottleneck.data import batchify
from bottleneck.nn.awd_lstm import AWDLSTM, AWDLSTMLanguageModel
from bottleneck.train import Trainer, make_optimizer
from bottleneck.train.dynamic_eval import (
    GradientStatistics,
    accumulate_squared_gradients,
    dynamic_eval_update,
    gradient_statistics,
)
from bottleneck.train.lm import eval_windows


def test_update_matches_a_hand_computation():
    params = {"w": jnp.array([1.0, -2.0]), "b": jnp.array([0.5])}
    params0 = {"w": jnp.array([0.0, 0.0]), "b": jnp.array([1.0])}
    grads = {"w": jnp.array([0.2, -0.4]), "b": jnp.array([1.0])}
    stats = GradientStatistics(
        rms={"w": jnp.array([0.1, 0.3]), "b": jnp.array([0.5])},
        decay={"w": jnp.array([2.0, 1.0]), "b": jnp.array([4.0])},
    )
    lr, lamb, eps = 0.01, 0.1, 0.001
    new = dynamic_eval_update(params, grads, params0, stats, lr=lr, lamb=lamb, epsilon=eps)
    # theta - lr g / (MS + eps) + lamb r (theta0 - theta), element by element
    w = [1.0 - 0.01 * 0.2 / 0.101 + 0.1 * 2.0 * (0.0 - 1.0),
         -2.0 - 0.01 * -0.4 / 0.301 + 0.1 * 1.0 * (0.0 + 2.0)]  # fmt: skip
    b = [0.5 - 0.01 * 1.0 / 0.501 + 0.1 * 4.0 * (1.0 - 0.5)]
    np.testing.assert_allclose(new["w"], w, rtol=1e-6)
    np.testing.assert_allclose(new["b"], b, rtol=1e-6)


def test_gradient_statistics_of_both_styles():
    batches = [{"w": jnp.array([1.0, 2.0]), "b": jnp.array([3.0])},
               {"w": jnp.array([1.0, 0.0]), "b": jnp.array([-1.0])}]  # fmt: skip
    sum_squares = jax.tree.map(jnp.zeros_like, batches[0])
    for grads in batches:
        sum_squares = accumulate_squared_gradients(sum_squares, grads)
    np.testing.assert_allclose(sum_squares["w"], [2.0, 4.0])

    yang = gradient_statistics(sum_squares, 2, lamb=0.01, style="yang")
    np.testing.assert_allclose(yang.rms["w"], np.sqrt([2.0, 4.0]))  # sqrt of the sum
    normaliser = np.mean(np.sqrt([2.0, 4.0])) + np.sqrt(10.0)  # sum over arrays of their mean
    np.testing.assert_allclose(yang.decay["w"], np.sqrt([2.0, 4.0]) / normaliser, rtol=1e-6)

    krause = gradient_statistics(sum_squares, 2, lamb=0.01, style="krause")
    np.testing.assert_allclose(krause.rms["b"], [np.sqrt(5.0)])  # sqrt of the mean
    normaliser = (np.mean(np.sqrt([1.0, 2.0])) + np.sqrt(5.0)) / 2  # mean over arrays
    np.testing.assert_allclose(krause.decay["b"], [np.sqrt(5.0) / normaliser], rtol=1e-6)

    # Decay rates are clipped at 1 / lambda so that a step never overshoots theta0.
    clipped = gradient_statistics(sum_squares, 2, lamb=1.0, style="krause")
    assert float(jnp.max(clipped.decay["b"])) == 1.0
    with pytest.raises(ValueError, match="style must be one of"):
        gradient_statistics(sum_squares, 2, lamb=0.1, style="adam")


def test_dynamic_evaluation_adapts_to_a_repeated_sequence():
    vocab = 20
    model = AWDLSTM(vocab, emsize=8, nhid=16, nlayers=1, dropout=0.0, dropouth=0.0,
                    dropouti=0.0, dropoute=0.0, wdrop=0.0, rngs=nnx.Rngs(0))  # fmt: skip
    trainer = Trainer(AWDLSTMLanguageModel(model), make_optimizer(1.0, optimizer="sgd"))
    phrase = np.random.default_rng(0).integers(0, vocab, 10).astype(np.int32)
    stream = batchify(np.tile(phrase, 12), 1)
    params = trainer.state.params
    static = trainer.evaluate(params, stream, 5)
    train = batchify(np.random.default_rng(1).integers(0, vocab, 400).astype(np.int32), 4)
    dynamic, stats = trainer.dynamic_evaluate(
        params, eval_windows(train, 5), stream, stats_batch_size=4, segment=5,
        lr=0.03, lamb=0.01, epsilon=1e-3, style="yang", max_batches=5,
    )  # fmt: skip
    assert dynamic < static - 0.3, (dynamic, static)  # it learns the repetition as it reads
    assert jax.tree.structure(stats.rms) == jax.tree.structure(params)
    # The parameters themselves are left as they were (dynamic evaluation works on a copy).
    np.testing.assert_allclose(trainer.evaluate(params, stream, 5), static)
    # Without adaptation (lr = 0, lambda tiny) it is the static evaluation.
    frozen, _ = trainer.dynamic_evaluate(
        params, [], stream, stats_batch_size=4, segment=5, lr=1e-12, lamb=1e-6,
        epsilon=1e-3, style="yang", stats=stats,
    )  # fmt: skip
    np.testing.assert_allclose(frozen, static, rtol=1e-5)
