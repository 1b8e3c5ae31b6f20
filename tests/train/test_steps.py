import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from bottleneck import nn
from bottleneck.train import Trainer, UsageError, make_optimizer
from bottleneck.train.lm_config import OptimizerConfig


def _regression_loss(model, batch):
    x, y = batch
    return jnp.mean((model(x) - y) ** 2)


def test_trainer_steps_match_a_plain_optax_loop():
    x = jax.random.normal(jax.random.key(0), (32, 3))
    y = x @ jnp.array([[1.0], [-2.0], [0.5]])
    trainer = Trainer(nnx.Linear(3, 1, rngs=nnx.Rngs(0)), optax.sgd(0.1), _regression_loss)
    losses = [float(trainer.step((x, y))) for _ in range(3)] + list(
        map(float, trainer.run((x, y), 4))
    )

    params = nnx.state(nnx.Linear(3, 1, rngs=nnx.Rngs(0)), nnx.Param)
    graphdef = nnx.graphdef(nnx.Linear(3, 1, rngs=nnx.Rngs(0)))
    tx = optax.sgd(0.1)
    opt_state = tx.init(params)
    expected = []
    for _ in range(7):
        loss, grads = jax.value_and_grad(
            lambda p: _regression_loss(nnx.merge(graphdef, p), (x, y))
        )(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        expected.append(float(loss))
    np.testing.assert_allclose(losses, expected, rtol=1e-5)
    assert losses[-1] < 0.5 * losses[0]
    np.testing.assert_allclose(trainer.model.kernel[...], params["kernel"][...], rtol=1e-5)


def test_make_optimizer_gives_plif_slopes_their_own_rate():
    head = nn.make_head("plif", 4, 10, rngs=nnx.Rngs(0), num_knots=50)
    h = jax.random.normal(jax.random.key(1), (8, 4))
    labels = jnp.arange(8) % 10
    before = nnx.clone(head)
    trainer = Trainer(
        head, make_optimizer(0.0, optimizer="sgd", plif_learning_rate=0.02), lambda m, b: m.loss(*b)
    )
    trainer.step((h, labels))
    grads = nnx.grad(lambda m: m.loss(h, labels))(before)
    after = trainer.model
    np.testing.assert_array_equal(after.decoder[...], before.decoder[...])
    np.testing.assert_allclose(
        after.pointwise.raw_slopes[...],
        before.pointwise.raw_slopes[...] - 0.02 * grads["pointwise"]["raw_slopes"][...],
        atol=1e-7,
    )


def test_make_optimizer_clips_and_decays():
    params = {"w": jnp.array([3.0, 4.0])}
    grads = {"w": jnp.array([30.0, 40.0])}
    tx = make_optimizer(1.0, optimizer="sgd", grad_clip_norm=0.5, weight_decay=0.1)
    updates, _ = tx.update(grads, tx.init(params), params)
    # clipped gradient (0.3, 0.4) plus decay 0.1 * w, times -lr
    np.testing.assert_allclose(
        updates["w"], -(jnp.array([0.3, 0.4]) + 0.1 * params["w"]), rtol=1e-6
    )
    with pytest.raises(ValueError, match="optimizer must be one of"):
        make_optimizer(0.1, optimizer="lion")


def test_adamw_decays_the_matrices_only_also_beside_plif_slopes():
    head = nn.make_head("plif", 4, 10, rngs=nnx.Rngs(0), num_knots=50)
    params = nnx.state(head, nnx.Param)
    tx = make_optimizer(0.1, optimizer="adamw", plif_learning_rate=0.5, weight_decay=0.2)
    zeros = jax.tree.map(jnp.zeros_like, params)
    with jax.numpy_dtype_promotion("standard"):  # optax's Adam is not strict-promotion clean
        updates, _ = tx.update(zeros, tx.init(params), params)
    # No gradient: Adam's part is 0 and the decoupled decay -lr * wd * w is all that is left.
    np.testing.assert_allclose(
        updates["decoder"][...], -0.1 * 0.2 * params["decoder"][...], rtol=1e-6
    )
    assert not np.any(updates["bias"][...]) and not np.any(updates["pointwise"]["raw_slopes"][...])


def test_adamw_schedule_warms_up_linearly_then_decays_by_a_cosine():
    config = OptimizerConfig("adamw", lr=1.0, warmup_steps=2, final_lr_fraction=0.1, clip=0)
    tx = config.transformation(plif=False, total_steps=6)
    params = {"w": jnp.zeros(())}
    state, rates = tx.init(params), []
    for _ in range(8):  # a constant gradient: each Adam step is exactly -(the step's rate)
        with jax.numpy_dtype_promotion("standard"):
            updates, state = tx.update({"w": jnp.ones(())}, state, params)
        rates.append(-float(updates["w"]))
    cosine = [0.1 + 0.45 * (1 + np.cos(np.pi * k / 4)) for k in range(5)]
    np.testing.assert_allclose(rates, [0.0, 0.5, *cosine, 0.1], rtol=1e-4)  # float32 Adam
    with pytest.raises(UsageError, match="warmup_steps 2 must be below the run's 2 steps"):
        config.transformation(plif=False, total_steps=2)
