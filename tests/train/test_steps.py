import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from bottleneck import nn
from bottleneck.runs import UsageError
from bottleneck.runs.lm_config import OptimizerConfig
from bottleneck.train import (
    Trainer,
    eval_step,
    log_probs_step,
    make_optimizer,
    train_step,
    window_step,
)
from bottleneck.train.lm import Window
from bottleneck.train.steps import init_state, train_steps


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
    grads = nnx.jit(nnx.grad(lambda m: m.loss(h, labels)))(before)
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


# -- the module-level steps, each alone, against naive references --------------------------------


def _table_model_and_window():
    from tests.runs.test_run_loop import TableModel

    model = TableModel(stateful=True, seed=1)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 8, (2, 6)).astype(np.int32)
    window = Window(tokens, np.roll(tokens, -1, axis=1), np.int32(4))  # 4 real steps of 6
    return model, window, model.initial_carry(2)


def test_train_step_alone_is_the_naive_optax_step_and_donates_under_jit():
    x = jax.random.normal(jax.random.key(0), (16, 3))
    batch = (x, x @ jnp.array([[1.0], [-2.0], [0.5]]))
    graphdef, params = nnx.split(nnx.Linear(3, 1, rngs=nnx.Rngs(0)))
    tx = optax.sgd(0.1, momentum=0.9)  # an optimizer with a state
    state = init_state(params, tx)
    step = jax.jit(functools.partial(train_step, graphdef, tx, _regression_loss), donate_argnums=0)
    new, loss = step(state, batch)
    assert state.params["kernel"][...].is_deleted()  # donated

    loss_want, grads = jax.value_and_grad(
        lambda p: _regression_loss(nnx.merge(graphdef, p), batch)
    )(params)
    updates, opt_state = tx.update(grads, tx.init(params), params)
    np.testing.assert_allclose(loss, loss_want, rtol=1e-6)
    chex.assert_trees_all_close(new.params, optax.apply_updates(params, updates), rtol=1e-6)
    chex.assert_trees_all_close(new.opt_state, opt_state, rtol=1e-6)
    assert int(new.step) == 1 and int(new.num_averaged) == 0
    chex.assert_trees_all_equal(new.average, params)  # untouched without averaging

    (_, losses) = train_steps(graphdef, tx, _regression_loss, init_state(params, tx), batch, 3)
    assert losses.shape == (3,) and float(losses[0]) == pytest.approx(float(loss), rel=1e-6)


@pytest.mark.parametrize("averaging", [False, True])
def test_window_step_alone_is_the_scaled_update_with_the_steps_key_and_the_average(averaging):
    model, window, carry = _table_model_and_window()
    graphdef, params = nnx.split(model, nnx.Param)
    tx, base_key = optax.sgd(0.5), jax.random.key(7)
    state = init_state(params, tx)._replace(step=jnp.int32(3), num_averaged=jnp.int32(2))
    new, new_carry, metrics = window_step(
        graphdef, tx, base_key, state, carry, window, jnp.float32(0.25), jnp.bool_(averaging)
    )

    def objective(p):  # naive: dropout key fold_in(base_key, step), update scaled by lr_scale
        key = jax.random.fold_in(base_key, 3)
        m = nnx.merge(graphdef, p)
        return m.objective(window.inputs, window.targets, carry, key=key, length=window.length)

    (loss, aux), grads = jax.value_and_grad(objective, has_aux=True)(params)
    want = jax.tree.map(lambda p, g: p - 0.25 * 0.5 * g, params, grads)
    np.testing.assert_allclose(metrics.loss, loss, rtol=1e-6)
    np.testing.assert_allclose(metrics.nll, aux.nll, rtol=1e-6)
    np.testing.assert_array_equal(new_carry, aux.carry)
    chex.assert_trees_all_close(new.params, want, rtol=1e-6, atol=1e-7)
    assert int(new.step) == 4 and int(new.num_averaged) == 2 + averaging
    # The average of 2 iterates (here: the start) and the new one, or unchanged.
    average = jax.tree.map(lambda a, p: a + (p - a) / 3, params, want) if averaging else params
    chex.assert_trees_all_close(new.average, average, rtol=1e-6, atol=1e-7)


def test_eval_and_log_probs_steps_alone_sum_the_real_positions_only():
    model, window, carry = _table_model_and_window()
    graphdef, params = nnx.split(model, nnx.Param)
    nll_sum, eval_carry = eval_step(graphdef, params, carry, window)
    log_probs, lp_sum, lp_carry = log_probs_step(graphdef, params, carry, window)

    want_log_probs, want_carry = model.log_probs(window.inputs, carry, length=window.length)
    picked = np.take_along_axis(np.asarray(want_log_probs), window.targets[..., None], -1)[..., 0]
    want = -picked[:, : int(window.length)].sum()  # 2 sequences x 4 real steps, padding ignored
    np.testing.assert_allclose(nll_sum, want, rtol=1e-6)
    np.testing.assert_allclose(lp_sum, want, rtol=1e-6)
    np.testing.assert_allclose(log_probs, want_log_probs, rtol=1e-6)
    np.testing.assert_array_equal(eval_carry, want_carry)
    np.testing.assert_array_equal(lp_carry, want_carry)


def test_trainer_window_step_donates_and_matches_the_module_level_step():
    model, window, carry = _table_model_and_window()
    trainer = Trainer(model, optax.sgd(0.5), seed=5)
    start = jax.tree.map(jnp.copy, trainer.state)
    before = trainer.state
    trainer.window_step(carry, window, 0.5, averaging=False)
    assert before.params["table"][...].is_deleted()  # the jitted step donated the old state
    base_key = jax.random.split(jax.random.key(5))[1]
    want, _, _ = window_step(
        trainer.graphdef, optax.sgd(0.5), base_key, start, carry, window,
        jnp.float32(0.5), jnp.bool_(False),
    )  # fmt: skip
    chex.assert_trees_all_close(trainer.state, want, rtol=1e-6)
